//! The local cloud against the real `lbscale-node` binary: a node is a process that
//! outlives nothing but its deprovisioning, on its own loopback address.

use lbscale_cloud_local::{LocalCloud, LocalSettings};
use lbscale_engine::cloud::{Cloud, DriverStore, ProvisionRequest};
use lbscale_engine::model::NodeSpec;
use lbscale_engine::nodeapi::{auth, NodeClient};
use lbscale_engine::store::{NodeRow, NodeState, Store};
use std::path::PathBuf;
use std::sync::Arc;

/// The workspace's `lbscale-node`, built next to this test's own binary.
fn node_binary() -> PathBuf {
    if let Ok(p) = std::env::var("LBSCALE_NODE_BIN") {
        return p.into();
    }
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().unwrap().parent().unwrap();
    let p = dir.join("lbscale-node");
    assert!(
        p.is_file(),
        "build lbscale-node first (cargo build -p lbscale-node): {} missing",
        p.display()
    );
    p
}

#[tokio::test(flavor = "multi_thread")]
async fn a_node_is_a_real_process_with_an_authenticated_api() {
    let dir = std::env::temp_dir().join(format!("lbscale-local-{}", std::process::id()));
    let store = Arc::new(Store::open(&dir.join("state.db")).unwrap());
    let settings = LocalSettings {
        address_prefix: "127.61.".into(),
        node_binary: Some(node_binary()),
        ..LocalSettings::default()
    };
    let cloud = LocalCloud::new(settings, DriverStore::new(store.clone()));
    let secret = "0123456789abcdef".repeat(4);
    let node_id = format!("t-az1-1-{}", std::process::id());
    let req = ProvisionRequest {
        credentials: auth::node_credentials(&secret, &node_id).unwrap(),
        node_id,
        group_id: "g".into(),
        group_name: "g".into(),
        az: "az1".into(),
        node: NodeSpec {
            memory_limit_mb: 256,
            ..NodeSpec::default()
        },
    };
    let p = cloud.provision(&req).await.expect("provision");
    assert!(p.private_ip.starts_with("127.61."), "{}", p.private_ip);
    let row = NodeRow {
        id: req.node_id.clone(),
        group_id: "g".into(),
        az: "az1".into(),
        seq: 1,
        state: NodeState::Joining,
        private_ip: p.private_ip.clone(),
        public_ip: p.public_ip.clone(),
        registered: false,
        handle: p.handle.clone(),
        created_at: 0,
    };
    assert!(cloud.is_alive(&row).await.unwrap());
    let pid = p.handle["pid"].as_u64().unwrap() as u32;

    let mut client = NodeClient::connect(&p.private_ip, p.api_port, &req.node_id, &secret)
        .await
        .unwrap();
    let stats = client.stats().await.unwrap();
    assert_eq!(stats.node_id, req.node_id);
    // Another group's engine (another CA) does not take the node for its own,
    // nor does this engine take it for another node of the group.
    for (node, secret) in [
        (req.node_id.as_str(), "f".repeat(64)),
        ("t-az1-2-x", secret.clone()),
    ] {
        let err = match NodeClient::connect(&p.private_ip, p.api_port, node, &secret).await {
            Ok(_) => panic!("{node} under {secret:.4}…: the node's certificate was taken"),
            Err(e) => e.to_string(),
        };
        assert!(err.contains("certificate"), "{err}");
    }

    cloud.deprovision(&row).await.unwrap();
    assert!(!running(pid));
    assert!(!cloud.is_alive(&row).await.unwrap());
    assert!(
        std::net::TcpStream::connect((p.private_ip.as_str(), p.api_port)).is_err(),
        "API still listening"
    );
    assert_eq!(
        store.rows_mentioning(&req.node_id).unwrap(),
        0,
        "address not released"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Whether `pid` runs: it exists and has not exited (a zombie has).
fn running(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        stat.rsplit_once(')')
            .is_some_and(|(_, rest)| !matches!(rest.trim_start().chars().next(), Some('Z' | 'X')))
    })
}

/// A local cloud on a fresh store in `name`'s directory, on loopback `prefix`.
fn cloud(name: &str, prefix: &str) -> (PathBuf, LocalCloud) {
    let dir = std::env::temp_dir().join(format!("lbscale-local-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let store = Arc::new(Store::open(&dir.join("state.db")).unwrap());
    let settings = LocalSettings {
        address_prefix: prefix.into(),
        node_binary: Some(node_binary()),
        ..LocalSettings::default()
    };
    (dir, LocalCloud::new(settings, DriverStore::new(store)))
}

fn request(id: &str) -> ProvisionRequest {
    ProvisionRequest {
        node_id: id.into(),
        group_id: "g".into(),
        group_name: "g".into(),
        az: "az1".into(),
        node: NodeSpec {
            memory_limit_mb: 256,
            ..NodeSpec::default()
        },
        credentials: auth::node_credentials(&"0123456789abcdef".repeat(4), id).unwrap(),
    }
}

/// Node `id`'s row with driver handle `handle`.
fn row(id: &str, ip: &str, handle: serde_json::Value) -> NodeRow {
    NodeRow {
        id: id.into(),
        group_id: "g".into(),
        az: "az1".into(),
        seq: 1,
        state: NodeState::Active,
        private_ip: ip.into(),
        public_ip: None,
        registered: true,
        handle,
        created_at: 0,
    }
}

fn pid_of(handle: &serde_json::Value) -> u32 {
    handle["pid"].as_u64().expect("a pid in the handle") as u32
}

/// Starts `program args` as a child of the test, and waits until its
/// arguments show `expect` (after its exec). The caller kills and waits.
#[allow(clippy::zombie_processes)]
fn start(program: &str, args: &[&str], expect: &str) -> std::process::Child {
    use std::os::unix::process::CommandExt;
    // Not the test's output: a process left behind must not hold it open.
    let mut child = std::process::Command::new(program)
        .args(args)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        // Its own process group, so that its children (bash's sleep) go with it.
        .process_group(0)
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    loop {
        let cmdline = std::fs::read(format!("/proc/{}/cmdline", child.id())).unwrap_or_default();
        if String::from_utf8_lossy(&cmdline).contains(expect) {
            return child;
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{program} {args:?} did not start within 5 s");
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn removing_a_node_kills_no_process_that_only_mentions_its_id() {
    let (dir, cloud) = cloud("ids", "127.63.");
    let id = format!("ids-az1-1-{}", std::process::id());
    let other_id = format!("x-{id}");
    let node = cloud.provision(&request(&id)).await.expect("provision");
    let other = cloud
        .provision(&request(&other_id))
        .await
        .expect("provision");
    let log = PathBuf::from(node.handle["dir"].as_str().unwrap()).join("node.log");
    let log = log.display().to_string();
    // An operator following the node's log; a program whose name holds the
    // id; a program whose arguments hold `--node-id <id>` exactly.
    let mut bystanders = [
        start("tail", &["-f", &log], &log),
        start(
            "bash",
            &[
                "-c",
                "exec -a \"lbscale-node serve --node-id $0\" sleep 300",
                &id,
            ],
            "lbscale-node serve",
        ),
        start("bash", &["-c", "sleep 300; true", "--node-id", &id], &id),
    ];

    // A driver record that points at the bystander with the exact argument
    // pair (an older record, without start time or executable): not ours.
    let pair = bystanders[2].id();
    let mut older = node.handle.clone();
    older["pid"] = pair.into();
    let older = older.as_object_mut().unwrap();
    older.remove("start_time");
    older.remove("exe");
    let impostor = row(&id, &node.private_ip, older.clone().into());
    assert!(!cloud.is_alive(&impostor).await.unwrap());
    cloud.deprovision(&impostor).await.unwrap();
    assert!(
        running(pair),
        "the bash process with --node-id {id} was killed"
    );

    // No recorded pid (a crash before the handle was saved): the node is
    // found among all processes, and only it is stopped.
    let lost = row(&id, &node.private_ip, serde_json::Value::Null);
    let node_pid = pid_of(&node.handle);
    assert!(running(node_pid), "the node was already gone");
    cloud.deprovision(&lost).await.unwrap();
    assert!(!running(node_pid), "node {id} outlived its deprovisioning");
    assert!(
        running(pid_of(&other.handle)),
        "node {other_id} was killed with node {id}"
    );
    let other_row = row(&other_id, &other.private_ip, other.handle.clone());
    assert!(cloud.is_alive(&other_row).await.unwrap());
    for b in &mut bystanders {
        assert!(
            b.try_wait().unwrap().is_none(),
            "process {} was killed with node {id}",
            b.id()
        );
        unsafe {
            libc::kill(-(b.id() as i32), libc::SIGKILL);
        }
        b.wait().unwrap();
    }
    cloud.deprovision(&other_row).await.unwrap();
    assert!(!running(pid_of(&other.handle)));
    let _ = std::fs::remove_dir_all(&dir);
}

/// Field 22 of /proc/PID/stat: when the process started.
fn start_time(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let (_, rest) = stat.rsplit_once(')').unwrap();
    rest.split_whitespace().nth(19).unwrap().parse().unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_recorded_pid_that_now_names_another_node_process_is_not_killed() {
    let (dir, cloud) = cloud("reuse", "127.64.");
    let id = format!("reuse-az1-1-{}", std::process::id());
    let node = cloud.provision(&request(&id)).await.expect("provision");
    let pid = pid_of(&node.handle);
    assert_eq!(node.handle["start_time"].as_u64(), Some(start_time(pid)));
    // The node dies behind the cloud's back...
    unsafe {
        libc::kill(pid as i32, libc::SIGKILL);
    }
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while running(pid) {
        assert!(
            std::time::Instant::now() < deadline,
            "SIGKILL did not end {pid}"
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    // ...and its pid is taken by a process that is the same program with the
    // same `--node-id`, started later by someone else. (The kernel hands out
    // pids in order, so the recorded pid is made to name it.)
    let c = auth::node_credentials(&"0123456789abcdef".repeat(4), &id).unwrap();
    let mut api_files = Vec::new();
    for (option, name, content) in [
        ("--token-file", "impostor-token", &c.token_file),
        ("--tls-ca", "impostor-ca.pem", &c.ca_pem),
        ("--tls-cert", "impostor.pem", &c.cert_pem),
        ("--tls-key", "impostor-key.pem", &c.key_pem),
    ] {
        std::fs::write(dir.join(name), content).unwrap();
        api_files.extend([option.to_string(), dir.join(name).display().to_string()]);
    }
    let bin = node_binary().display().to_string();
    let mut args = vec![
        "serve",
        "--node-id",
        &id,
        "--listen-ip",
        "127.64.250.9",
        "--api-port",
        "9990",
        "--memory-limit-mb",
        "64",
    ];
    args.extend(api_files.iter().map(String::as_str));
    let mut impostor = start(&bin, &args, &id);
    let mut handle = node.handle.clone();
    handle["pid"] = impostor.id().into();
    let recorded = row(&id, &node.private_ip, handle.clone());
    assert!(!cloud.is_alive(&recorded).await.unwrap());
    cloud.deprovision(&recorded).await.unwrap();
    assert!(
        impostor.try_wait().unwrap().is_none(),
        "a process started after the node, under the node's recorded pid, was killed"
    );

    // The start time alone told them apart: with the impostor's own, the
    // record names it, and deprovisioning stops it.
    handle["start_time"] = start_time(impostor.id()).into();
    let matching = row(&id, &node.private_ip, handle);
    assert!(cloud.is_alive(&matching).await.unwrap());
    cloud.deprovision(&matching).await.unwrap();
    // Deprovisioning returns once the process is no longer the node (a process
    // that is exiting already lost its /proc/PID/exe); its exit follows.
    let exited = (0..100).any(|_| {
        let done = impostor.try_wait().unwrap().is_some();
        if !done {
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        done
    });
    assert!(
        exited,
        "the process the record names outlived its deprovisioning by 5 s"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
