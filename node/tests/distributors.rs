//! Integration tests of `lbscale-node dns` (queried with real `dig`) and
//! `lbscale-node nlb` (real TCP forwarding), both following config changes.

mod common;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::*;
use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;

fn write_atomic(path: &Path, body: &str) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, body).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

fn status_version(path: &Path) -> Option<u64> {
    let s = std::fs::read_to_string(path).ok()?;
    let v: serde_json::Value = serde_json::from_str(&s).ok()?;
    v.get("pid")?.as_u64()?;
    v.get("version")?.as_u64()
}

/// Runs dig; returns (status word, answer lines "name ttl class type data").
fn dig(server: &str, port: u16, name: &str, qtype: &str, tcp: bool) -> (String, Vec<Vec<String>>) {
    let mut cmd = Command::new("dig");
    cmd.args([
        &format!("@{server}"),
        "-p",
        &port.to_string(),
        name,
        qtype,
        "+time=2",
        "+tries=1",
        "+noall",
        "+answer",
        "+comments",
    ]);
    if tcp {
        cmd.arg("+tcp");
    }
    let out = cmd.output().expect("run dig");
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let status = text
        .split("status: ")
        .nth(1)
        .and_then(|s| s.split(',').next())
        .unwrap_or_else(|| panic!("no status in dig output:\n{text}"))
        .to_string();
    let answers = text
        .lines()
        .filter(|l| !l.starts_with(';') && !l.trim().is_empty())
        .map(|l| l.split_whitespace().map(String::from).collect())
        .collect();
    (status, answers)
}

fn flags(server: &str, port: u16, name: &str) -> String {
    let out = Command::new("dig")
        .args([
            &format!("@{server}"),
            "-p",
            &port.to_string(),
            name,
            "A",
            "+time=2",
            "+tries=1",
        ])
        .output()
        .expect("run dig");
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    text.lines()
        .find(|l| l.contains("flags:"))
        .unwrap_or("")
        .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dns_answers_with_dig_and_follows_config() {
    let dir = tmpdir("dns");
    let config = dir.join("dns.json");
    let status = dir.join("dns.status.json");
    write_atomic(
        &config,
        r#"{"version": 3, "zones": [{"domain": "App.Example.test", "ttl_secs": 60, "addresses": ["127.0.1.2", "127.0.1.3"]}]}"#,
    );
    let _p = Proc::spawn(
        "dns",
        &[
            "dns",
            "--listen",
            "127.78.0.1:5353",
            "--config",
            config.to_str().unwrap(),
            "--status",
            status.to_str().unwrap(),
        ],
        &dir.join("dns.log"),
    );
    wait_until("dns status version 3", Duration::from_secs(10), || {
        status_version(&status) == Some(3)
    })
    .await;

    for tcp in [false, true] {
        let (st, ans) = dig("127.78.0.1", 5353, "app.example.test.", "A", tcp);
        assert_eq!(st, "NOERROR");
        let mut addrs: Vec<&str> = ans.iter().map(|a| a[4].as_str()).collect();
        addrs.sort();
        assert_eq!(addrs, vec!["127.0.1.2", "127.0.1.3"], "tcp={tcp}");
        assert!(
            ans.iter().all(|a| a[1] == "60" && a[3] == "A"),
            "TTL 60: {ans:?}"
        );
    }
    assert!(
        flags("127.78.0.1", 5353, "APP.example.TEST").contains(" aa"),
        "authoritative answer"
    );
    let (st, _) = dig("127.78.0.1", 5353, "other.example.org", "A", false);
    assert_eq!(st, "REFUSED");
    let (st, ans) = dig("127.78.0.1", 5353, "app.example.test", "MX", false);
    assert_eq!((st.as_str(), ans.len()), ("NOERROR", 0));

    write_atomic(
        &config,
        r#"{"version": 4, "zones": [{"domain": "app.example.test", "ttl_secs": 5, "addresses": ["127.0.1.9"]}, {"domain": "b.test", "ttl_secs": 30, "addresses": ["127.0.2.1"]}]}"#,
    );
    wait_until("dns status version 4", Duration::from_secs(5), || {
        status_version(&status) == Some(4)
    })
    .await;
    let (_, ans) = dig("127.78.0.1", 5353, "app.example.test", "A", false);
    assert_eq!(ans.len(), 1);
    assert_eq!((ans[0][1].as_str(), ans[0][4].as_str()), ("5", "127.0.1.9"));
    let (_, ans) = dig("127.78.0.1", 5353, "b.test", "A", false);
    assert_eq!(ans[0][4], "127.0.2.1");

    // An invalid config is ignored: the previous one stays.
    write_atomic(&config, "{not json");
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(status_version(&status), Some(4));
    let (_, ans) = dig("127.78.0.1", 5353, "b.test", "A", false);
    assert_eq!(ans.len(), 1);
}

async fn first_line(addr: &str) -> Option<String> {
    let mut s = tokio::time::timeout(Duration::from_secs(5), TcpStream::connect(addr))
        .await
        .ok()?
        .ok()?;
    let mut buf = Vec::new();
    let mut tmp = [0u8; 64];
    let r = tokio::time::timeout(Duration::from_secs(5), async {
        while !buf.contains(&b'\n') {
            let n = s.read(&mut tmp).await.ok()?;
            if n == 0 {
                return None;
            }
            buf.extend_from_slice(&tmp[..n]);
        }
        Some(())
    })
    .await;
    r.ok()??;
    Some(String::from_utf8_lossy(&buf).lines().next()?.to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nlb_forwards_and_follows_config() {
    let a = tcp_backend("127.79.1.10:8080", "alpha").await;
    let b = tcp_backend("127.79.1.11:8080", "beta").await;
    let dir = tmpdir("nlb");
    let config = dir.join("nlb.json");
    let status = dir.join("nlb.status.json");
    write_atomic(
        &config,
        r#"{"version": 2, "listeners": [{"vip": "127.79.0.1", "port": 8080, "targets": ["127.79.1.10:8080", "127.79.1.12:8080", "127.79.1.11:8080"]}]}"#,
    );
    let _p = Proc::spawn(
        "nlb",
        &[
            "nlb",
            "--config",
            config.to_str().unwrap(),
            "--status",
            status.to_str().unwrap(),
        ],
        &dir.join("nlb.log"),
    );
    wait_until("nlb status version 2", Duration::from_secs(10), || {
        status_version(&status) == Some(2)
    })
    .await;
    // 127.79.1.12 refuses: it is skipped, every connection reaches a live target.
    let mut names = Vec::new();
    for _ in 0..6 {
        names.push(
            first_line("127.79.0.1:8080")
                .await
                .expect("forwarded connection"),
        );
    }
    assert!(
        names.iter().any(|n| n == "alpha") && names.iter().any(|n| n == "beta"),
        "spread: {names:?}"
    );
    assert!(names.iter().all(|n| n == "alpha" || n == "beta"));

    write_atomic(
        &config,
        r#"{"version": 3, "listeners": [{"vip": "127.79.0.1", "port": 8080, "targets": ["127.79.1.11:8080"]}, {"vip": "127.79.0.2", "port": 8081, "targets": ["127.79.1.10:8080"]}]}"#,
    );
    wait_until("nlb status version 3", Duration::from_secs(5), || {
        status_version(&status) == Some(3)
    })
    .await;
    for _ in 0..3 {
        assert_eq!(first_line("127.79.0.1:8080").await.as_deref(), Some("beta"));
    }
    assert_eq!(
        first_line("127.79.0.2:8081").await.as_deref(),
        Some("alpha")
    );

    // No target: the client connection is closed; removed listener: refused.
    write_atomic(
        &config,
        r#"{"version": 4, "listeners": [{"vip": "127.79.0.1", "port": 8080, "targets": []}]}"#,
    );
    wait_until("nlb status version 4", Duration::from_secs(5), || {
        status_version(&status) == Some(4)
    })
    .await;
    assert_eq!(first_line("127.79.0.1:8080").await, None);
    assert!(
        TcpStream::connect("127.79.0.2:8081").await.is_err(),
        "removed listener must be closed"
    );
    let before = a.hits() + b.hits();
    assert!(before >= 7);

    // `first` (a native scale-out primary, then the other holders): every
    // connection to the first target that accepts, in the order written.
    write_atomic(
        &config,
        r#"{"version": 5, "listeners": [{"vip": "127.79.0.1", "port": 8080, "balance": "first", "targets": ["127.79.1.11:8080", "127.79.1.10:8080"]}]}"#,
    );
    wait_until("nlb status version 5", Duration::from_secs(5), || {
        status_version(&status) == Some(5)
    })
    .await;
    for _ in 0..4 {
        assert_eq!(first_line("127.79.0.1:8080").await.as_deref(), Some("beta"));
    }
    // The first one down (127.79.1.12 refuses): the next one takes everything.
    write_atomic(
        &config,
        r#"{"version": 6, "listeners": [{"vip": "127.79.0.1", "port": 8080, "balance": "first", "targets": ["127.79.1.12:8080", "127.79.1.10:8080", "127.79.1.11:8080"]}]}"#,
    );
    wait_until("nlb status version 6", Duration::from_secs(5), || {
        status_version(&status) == Some(6)
    })
    .await;
    for _ in 0..4 {
        assert_eq!(
            first_line("127.79.0.1:8080").await.as_deref(),
            Some("alpha")
        );
    }
}

/// BGP scale-out's ECMP stand-in: a `flow_hash` listener spreads flows over every
/// node holding the vserver, each node serving its flows itself (no primary in the
/// path); a target of weight 0 gets nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nlb_flow_hash_spreads_flows_over_the_nodes() {
    use lbscale_proto::{LbMethod, NodeConfig, Service, ServiceType, StatsRequest, Vserver};
    let nodes = ["127.79.2.1", "127.79.2.2", "127.79.2.3"];
    let _backend = tcp_backend("127.79.2.100:9000", "app").await;
    let _procs: Vec<_> = nodes
        .iter()
        .enumerate()
        .map(|(i, ip)| start_serve(&format!("bgp-{i}"), ip, &["--health-interval-ms", "0"]))
        .collect();
    for ip in nodes {
        let mut cl = api_client(ip).await;
        cl.configure(NodeConfig {
            group_peers: Vec::new(),
            fence: 0,
            version: 1,
            vservers: vec![Vserver {
                name: "app".into(),
                service_type: ServiceType::Tcp as i32,
                port: 8090,
                lb_method: LbMethod::Roundrobin as i32,
                persistence: "NONE".into(),
                services: vec![Service {
                    name: "app".into(),
                    address: "127.79.2.100".into(),
                    port: 9000,
                    weight: 1,
                    enabled: true,
                    cap_per_second: None,
                    custom_load: None,
                }],
                slow_start: None,
                scaleout: None,
                ramp_peers: vec![],
                ..Default::default()
            }],
        })
        .await
        .expect("Configure");
    }
    let served = |ip: &'static str| async move {
        let mut cl = api_client(ip).await;
        let s = cl
            .get_stats(StatsRequest::default())
            .await
            .expect("GetStats")
            .into_inner();
        assert!(s.forwarded.is_empty(), "{ip} forwarded connections");
        s.served_connections_total.get("app").copied().unwrap_or(0)
    };

    let dir = tmpdir("nlb-bgp");
    let config = dir.join("nlb.json");
    let status = dir.join("nlb.status.json");
    let targets = r#"["127.79.2.1:8090", "127.79.2.2:8090", "127.79.2.3:8090"]"#;
    write_atomic(
        &config,
        &format!(
            r#"{{"version": 1, "listeners": [
                {{"vip": "127.79.3.1", "port": 8090, "targets": {targets}, "balance": "flow_hash"}},
                {{"vip": "127.79.3.2", "port": 8090, "targets": {targets}, "balance": "flow_hash",
                  "weights": {{"127.79.2.3:8090": 0}}}},
                {{"vip": "127.79.3.3", "port": 8090, "targets": {targets},
                  "weights": {{"127.79.2.1:8090": 0.5, "127.79.2.3:8090": 0}}}}]}}"#
        ),
    );
    let _p = Proc::spawn(
        "nlb",
        &[
            "nlb",
            "--config",
            config.to_str().unwrap(),
            "--status",
            status.to_str().unwrap(),
        ],
        &dir.join("nlb.log"),
    );
    wait_until("nlb status version 1", Duration::from_secs(10), || {
        status_version(&status) == Some(1)
    })
    .await;

    // Each connection is a new flow (a new source port).
    async fn drive(vip: &str, n: usize) {
        for _ in 0..n / 10 {
            let batch: Vec<_> = (0..10)
                .map(|_| {
                    let vip = vip.to_string();
                    tokio::spawn(async move { first_line(&vip).await })
                })
                .collect();
            for h in batch {
                assert_eq!(h.await.unwrap().as_deref(), Some("app"));
            }
        }
    }
    let n = 600;
    drive("127.79.3.1:8090", n).await;
    let mut counts = Vec::new();
    for ip in nodes {
        counts.push(served(ip).await);
    }
    eprintln!("flow_hash over 3 nodes, {n} flows: {counts:?}");
    assert_eq!(counts.iter().sum::<u64>(), n as u64);
    for c in &counts {
        let dev = (*c as f64 / (n as f64 / 3.0) - 1.0).abs();
        assert!(dev <= 0.2, "uneven spread: {counts:?}");
    }

    // Weight 0 (hashing, then smooth round robin with weights 0.5, 1, 0).
    drive("127.79.3.2:8090", 300).await;
    let mut after = Vec::new();
    for ip in nodes {
        after.push(served(ip).await);
    }
    let hashed: Vec<u64> = after.iter().zip(&counts).map(|(a, b)| a - b).collect();
    eprintln!("flow_hash, third node at weight 0, 300 flows: {hashed:?}");
    assert_eq!(hashed[2], 0, "{hashed:?}");
    assert!(hashed[0] >= 100 && hashed[1] >= 100, "{hashed:?}");
    drive("127.79.3.3:8090", 300).await;
    let mut last = Vec::new();
    for ip in nodes {
        last.push(served(ip).await);
    }
    let rr: Vec<u64> = last.iter().zip(&after).map(|(a, b)| a - b).collect();
    eprintln!("weighted round robin 0.5/1/0, 300 connections: {rr:?}");
    assert_eq!(rr, vec![100, 200, 0]);
}
