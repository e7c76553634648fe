//! The PostgreSQL store end to end: the provider with `state = "postgres://..."`
//! applies a stack, the plan after it is empty, the daemon and the CLI work on the
//! same database, and destroy leaves no row behind. Needs
//! `LBSCALE_TEST_POSTGRES_URL` (scripts/test.sh starts a server); fails without
//! it when `CI=true`, and is skipped with a note otherwise.

use lbscale_acceptance::*;
use lbscale_engine::store_testing::{Kind, TestStore};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

extern "C" {
    fn kill(pid: i32, sig: i32) -> i32;
}
const SIGTERM: i32 = 15;

const CONFIG: &str = r#"
resource "lbscale_traffic_distributor" "d" {
  name   = "pg-dns"
  cloud  = "local"
  mode   = "dns"
  domain = "pg.lbscale.test"
  ttl    = "1s"
}

resource "lbscale_autoscale_group" "g" {
  name                   = "pg"
  cloud                  = "local"
  availability_zones     = ["az1"]
  traffic_distributor_id = lbscale_traffic_distributor.d.id
  min_nodes              = 1
  max_nodes              = 2
  stats_interval         = "1s"
  drain_timeout          = "2s"
  threshold {
    metric = "memory"
    min    = 1
    max    = 99
  }
}

data "lbscale_autoscale_group" "g" {
  name = lbscale_autoscale_group.g.name
}

output "node_count" { value = data.lbscale_autoscale_group.g.node_count }
output "dns" { value = lbscale_traffic_distributor.d.address["dns"] }
"#;

fn password(url: &str) -> Option<String> {
    let rest = url.split_once("://")?.1;
    let userinfo = rest.split_once('@')?.0;
    Some(userinfo.split_once(':')?.1.to_string()).filter(|p| !p.is_empty())
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

#[test]
fn a_stack_on_a_postgres_store_applies_plans_empty_and_destroys_clean() {
    let Some(ts) = TestStore::new(Kind::Postgres, "acceptance") else {
        return;
    };
    let secret = password(&ts.url);
    let mut ws = Workspace::new("postgres", 126);
    ws.state = Some(ts.url.clone());
    ws.write(CONFIG);
    let applied = ws.apply();
    if let Some(p) = &secret {
        assert!(
            !applied.all().contains(p.as_str()),
            "the password was printed"
        );
    }
    assert_eq!(ws.outputs()["node_count"]["value"], 1);
    assert!(
        !ws.dir.join(".lbscale/state.db").exists(),
        "a SQLite file was written next to the PostgreSQL store"
    );
    {
        let store = ws.store();
        assert_eq!(store.backend_name(), "postgres");
        assert_eq!(store.count_rows("distributors").unwrap(), 1);
        assert_eq!(store.count_rows("groups").unwrap(), 1);
        assert_eq!(store.count_rows("nodes").unwrap(), 1);
    }
    ws.assert_plan_empty("after the apply on PostgreSQL");
    let dns = ws.outputs()["dns"]["value"].as_str().unwrap().to_string();
    assert_eq!(dig(&dns, "pg.lbscale.test").len(), 1);

    // The daemon on the same database: it claims the group and reports it.
    let port = free_port();
    let log = ws.dir.join("daemon.log");
    let mut daemon = Command::new(bin_dir().join("lbscale"))
        .args([
            "daemon",
            "--state",
            &ts.url,
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--address-prefix",
            &ws.prefix,
            "--node-binary",
            bin_dir().join("lbscale-node").to_str().unwrap(),
        ])
        .current_dir(&ws.dir)
        .env("LBSCALE_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .expect("start lbscale daemon");
    let logs = || std::fs::read_to_string(&log).unwrap_or_default();
    wait_for(
        "the daemon to evaluate the group",
        Duration::from_secs(20),
        || match daemon_get(port, "/v1/groups") {
            Ok((200, body)) if body.contains("\"pg\"") => Some(()),
            _ => None,
        },
    );
    wait_for(
        "the daemon's claim on the group",
        Duration::from_secs(20),
        || (ws.store().count_rows("leases").unwrap() > 0).then_some(()),
    );
    // The CLI reads the same store.
    let status = Command::new(bin_dir().join("lbscale"))
        .args(["status", "--state", &ts.url])
        .current_dir(&ws.dir)
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&status.stdout).into_owned();
    assert!(
        status.status.success(),
        "lbscale status: {}",
        String::from_utf8_lossy(&status.stderr)
    );
    assert!(out.contains("pg"), "{out}");
    unsafe { kill(daemon.id() as i32, SIGTERM) };
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        if let Some(st) = daemon.try_wait().unwrap() {
            assert!(st.success(), "daemon exited with {st}:\n{}", logs());
            break;
        }
        assert!(
            Instant::now() < deadline,
            "daemon did not stop:\n{}",
            logs()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let logs = logs();
    assert!(logs.contains("lbscale daemon started"), "{logs}");
    if let Some(p) = &secret {
        assert!(!logs.contains(p.as_str()), "the daemon logged the password");
    }

    ws.assert_plan_empty("after the daemon ran");
    ws.destroy();
    ws.assert_nothing_left(&[]);
    assert_eq!(ws.store().count_rows("leases").unwrap(), 0);
}
