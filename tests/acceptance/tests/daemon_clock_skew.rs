//! A daemon whose clock runs 30 s fast (libfaketime, as `faketime -f +30s`)
//! beside a daemon that owns the group, on one PostgreSQL store: leases expire
//! by the database's clock, so the fast one takes nothing while the owner
//! renews its claim, and takes the group once the owner lets it go. Needs
//! `LBSCALE_TEST_POSTGRES_URL` and libfaketime (scripts/setup.sh installs it);
//! without either, fails when `CI=true` and is skipped with a note otherwise.

use lbscale_acceptance::*;
use lbscale_engine::store_testing::{Kind, TestStore};
use std::path::Path;
use std::time::{Duration, Instant};

const LIBFAKETIME: &str = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1";

const CONFIG: &str = r#"
resource "lbscale_traffic_distributor" "d" {
  name   = "skew-dns"
  cloud  = "local"
  mode   = "dns"
  domain = "skew.lbscale.test"
  ttl    = "1s"
}

resource "lbscale_autoscale_group" "g" {
  name                   = "skew"
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
"#;

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// How many seconds the time of the first JSON log line is ahead of this
/// host's clock (modulo a day; the line was written moments ago).
fn log_time_ahead_s(log: &str) -> i64 {
    let line = log.lines().next().expect("a log line");
    let v: serde_json::Value = serde_json::from_str(line).unwrap();
    let ts = v["timestamp"].as_str().unwrap();
    let hms = &ts[11..19];
    let p: Vec<i64> = hms.split(':').map(|x| x.parse().unwrap()).collect();
    let logged = p[0] * 3600 + p[1] * 60 + p[2];
    let now = (lbscale_engine::store::now_ms() / 1000) % 86_400;
    let d = (logged - now).rem_euclid(86_400);
    if d > 43_200 {
        d - 86_400
    } else {
        d
    }
}

fn owner(d: &Daemon) -> String {
    d.group("skew")["owner"].as_str().unwrap_or("").to_string()
}

#[test]
fn a_daemon_with_a_fast_clock_takes_no_claim_before_it_expires() {
    if !Path::new(LIBFAKETIME).exists() {
        assert!(
            !std::env::var("CI").is_ok_and(|v| v == "true" || v == "1"),
            "{LIBFAKETIME} is missing but CI=true: run scripts/setup.sh"
        );
        eprintln!("note: SKIPPED: {LIBFAKETIME} is missing (scripts/setup.sh installs faketime)");
        return;
    }
    let Some(ts) = TestStore::new(Kind::Postgres, "daemon_skew") else {
        return;
    };
    let mut ws = Workspace::new("daemon-skew", 202);
    ws.state = Some(ts.url.clone());
    ws.write(CONFIG);
    ws.apply();

    let a = Daemon::start(&ws, free_port(), "a");
    wait_for("daemon a to own the group", Duration::from_secs(30), || {
        (owner(&a) == "self").then_some(())
    });
    let fast = Daemon::start_with(
        &ws,
        free_port(),
        "fast",
        &[("LD_PRELOAD", LIBFAKETIME), ("FAKETIME", "+30s")],
    );
    // Its clock is really 30 s ahead: its first log line's time says so.
    let ahead = log_time_ahead_s(&fast.logs());
    assert!(
        (20..=35).contains(&ahead),
        "the fast daemon's clock is {ahead} s ahead"
    );
    let holder_a = wait_for(
        "the fast daemon to see daemon a's claim",
        Duration::from_secs(30),
        || Some(owner(&fast)).filter(|o| o.starts_with("daemon-")),
    );
    // Three claim lifetimes (10 s each): by its own clock a's claim looks
    // expired all along, by the database's it never is.
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(30) {
        assert_eq!(owner(&a), "self", "daemon a lost the group");
        assert_eq!(owner(&fast), holder_a, "the fast daemon took the group");
        std::thread::sleep(Duration::from_millis(500));
    }
    // Once a lets it go (SIGTERM gives its claims up), the fast one takes it.
    a.stop();
    wait_for(
        "the fast daemon to take the group",
        Duration::from_secs(30),
        || (owner(&fast) == "self").then_some(()),
    );
    assert_eq!(ws.store().count_rows("nodes").unwrap(), 1);
    fast.stop();
    ws.destroy();
    ws.assert_nothing_left(&[]);
}

/// The same fast daemon beside an apply that scales the group up: the
/// daemon's clock must not make it take the apply's lease, nor see the node
/// that the apply starts as late and kill it.
#[test]
fn a_daemon_with_a_fast_clock_does_not_disturb_an_apply() {
    if !Path::new(LIBFAKETIME).exists() {
        assert!(
            !std::env::var("CI").is_ok_and(|v| v == "true" || v == "1"),
            "{LIBFAKETIME} is missing but CI=true: run scripts/setup.sh"
        );
        eprintln!("note: SKIPPED: {LIBFAKETIME} is missing (scripts/setup.sh installs faketime)");
        return;
    }
    let Some(ts) = TestStore::new(Kind::Postgres, "daemon_skew_apply") else {
        return;
    };
    let mut ws = Workspace::new("daemon-skew-apply", 203);
    ws.state = Some(ts.url.clone());
    let config = CONFIG.replace("skew", "skewap");
    ws.write(&config);
    ws.apply();
    let fast = Daemon::start_with(
        &ws,
        free_port(),
        "fast",
        &[("LD_PRELOAD", LIBFAKETIME), ("FAKETIME", "+30s")],
    );
    let ahead = log_time_ahead_s(&fast.logs());
    assert!(
        (20..=35).contains(&ahead),
        "the fast daemon's clock is {ahead} s ahead"
    );
    wait_for(
        "the fast daemon to own the group",
        Duration::from_secs(30),
        || (fast.group("skewap")["owner"].as_str() == Some("self")).then_some(()),
    );
    let group = ws.resource("lbscale_autoscale_group.g")["id"]
        .as_str()
        .expect("the group's id")
        .to_string();
    let before: Vec<String> = node_ids(&ws, &group);
    // The apply adds a node while the fast daemon evaluates the group.
    ws.write(&config.replace("min_nodes              = 1", "min_nodes              = 2"));
    ws.apply();
    let after = node_ids(&ws, &group);
    assert_eq!(
        after.len(),
        2,
        "the apply brought the group to 2 nodes: {after:?}"
    );
    assert!(
        before.iter().all(|n| after.contains(n)),
        "a node of before the apply is gone: {before:?} -> {after:?}"
    );
    // A few of the daemon's intervals later, nothing was killed or replaced.
    std::thread::sleep(Duration::from_secs(5));
    let events = ws.engine().events(&group, 1000).unwrap();
    let bad: Vec<_> = events
        .iter()
        .filter(|e| {
            [
                "node_failed",
                "node_removed",
                "scale_in",
                "scale_out_failed",
            ]
            .contains(&e.kind.as_str())
        })
        .map(|e| format!("{} {}", e.kind, e.reason))
        .collect();
    assert!(
        bad.is_empty(),
        "the fast daemon disturbed the apply: {bad:?}"
    );
    assert_eq!(node_ids(&ws, &group), after);
    fast.stop();
    ws.destroy();
    ws.assert_nothing_left(&[]);
}

fn node_ids(ws: &Workspace, group: &str) -> Vec<String> {
    let mut ids: Vec<String> = ws
        .engine()
        .node_rows(group)
        .unwrap()
        .into_iter()
        .map(|n| n.id)
        .collect();
    ids.sort();
    ids
}
