//! The PostgreSQL store end to end: the provider, given the URL (with its
//! password) through `LBSCALE_STATE`, applies a stack, the plan after it is
//! empty, the daemon (also from `LBSCALE_STATE`, so the password is not on its
//! command line) and the CLI (`--state`) work on the same database, and destroy
//! leaves no row behind. Needs
//! `LBSCALE_TEST_POSTGRES_URL` (scripts/test.sh starts a server); fails without
//! it when `CI=true`, and is skipped with a note otherwise.

use lbscale_acceptance::*;
use lbscale_engine::store_testing::{Kind, TestStore};
use std::process::Command;
use std::time::Duration;

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
    // Over TLS, the server authenticated by its CA, when the test server has one
    // (scripts/test.sh: always).
    let url = match lbscale_engine::store_testing::postgres_ca("acceptance") {
        Some(ca) => format!(
            "{}?sslmode=verify-full&sslrootcert={}",
            ts.url,
            ca.display()
        ),
        None => ts.url.clone(),
    };
    let mut ws = Workspace::new("postgres", 126);
    ws.state = Some(url.clone());
    ws.state_from_env = true;
    ws.write(CONFIG);
    assert!(
        !std::fs::read_to_string(ws.dir.join("main.tf"))
            .unwrap()
            .contains(&url),
        "the store URL is in main.tf"
    );
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
    let daemon = Daemon::start(&ws, free_port(), "pg");
    wait_for(
        "the daemon to evaluate the group",
        Duration::from_secs(20),
        || match daemon.get("/v1/groups") {
            Ok((200, body)) if body.contains("\"pg\"") => Some(()),
            _ => None,
        },
    );
    // Its claim is a row in the database, beside the workflows' leases.
    wait_for(
        "the daemon's claim on the group",
        Duration::from_secs(20),
        || {
            ts.raw_text(
                "SELECT holder FROM leases WHERE group_id LIKE 'daemon/%' AND expires_ms > 0",
            )
        },
    );
    if url.contains("sslmode=verify-full") {
        // The daemon's connections (all but this check's own) are encrypted.
        let db = ts.url.rsplit('/').next().unwrap();
        let seen = ts
            .raw_text(&format!(
                "SELECT count(*) FILTER (WHERE s.ssl)::text || '/' || count(*)::text \
             FROM pg_stat_ssl s JOIN pg_stat_activity a USING (pid) \
             WHERE a.datname = '{db}' AND a.pid <> pg_backend_pid()"
            ))
            .unwrap();
        let (tls, all) = seen.split_once('/').unwrap();
        assert!(
            all != "0" && tls == all,
            "encrypted/all connections of the daemon: {seen}"
        );
    }
    if let Some(p) = &secret {
        let cmdline = std::fs::read(format!("/proc/{}/cmdline", daemon.pid())).unwrap();
        assert!(
            !String::from_utf8_lossy(&cmdline).contains(p.as_str()),
            "the password is on the daemon's command line"
        );
    }
    // The CLI reads the same store.
    let status = Command::new(bin_dir().join("lbscale"))
        .args(["status", "--state", &url])
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
    let log = daemon.log.clone();
    daemon.stop();
    let logs = std::fs::read_to_string(log).unwrap();
    assert!(logs.contains("lbscale daemon started"), "{logs}");
    if let Some(p) = &secret {
        assert!(!logs.contains(p.as_str()), "the daemon logged the password");
    }

    ws.assert_plan_empty("after the daemon ran");
    ws.destroy();
    ws.assert_nothing_left(&[]);
    assert_eq!(ws.store().count_rows("leases").unwrap(), 0);
}
