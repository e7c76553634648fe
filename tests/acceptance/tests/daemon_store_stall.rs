//! A stalled database stops a daemon from acting, not from noticing.
//!
//! Two daemons on one PostgreSQL store; the first owns the group and reaches
//! the database through a relay (`store_testing::Link`). The relay then
//! passes nothing for 30 s, as a stalled server or a half-open socket
//! leaves a client: its calls get no answer. Its `/healthz` says so (503
//! with the reason) while its HTTP API keeps answering; its claim runs out,
//! the second daemon takes the group over; once the relay goes on, the first
//! is a follower and healthy again, and the group has the nodes it had
//! (nothing was done twice). Needs `LBSCALE_TEST_POSTGRES_URL` (fails without
//! it when `CI=true`, skipped with a note otherwise).

use lbscale_acceptance::*;
use lbscale_engine::store_testing::{backends_named, Kind, Link, TestStore};
use std::time::{Duration, Instant};

const CONFIG: &str = r#"
resource "lbscale_traffic_distributor" "d" {
  name   = "stall-dns"
  cloud  = "local"
  mode   = "dns"
  domain = "stall.lbscale.test"
  ttl    = "1s"
}

resource "lbscale_autoscale_group" "g" {
  name                   = "stall"
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

fn with_app(url: &str, app: &str) -> String {
    let sep = if url.contains('?') { '&' } else { '?' };
    format!("{url}{sep}application_name={app}")
}

fn nodes(ws: &Workspace) -> i64 {
    ws.store().count_rows("nodes").unwrap()
}

fn owner(d: &Daemon) -> String {
    d.group("stall")["owner"].as_str().unwrap_or("").to_string()
}

#[test]
fn a_daemon_whose_database_stalls_reports_it_and_hands_the_group_over() {
    let Some(ts) = TestStore::new(Kind::Postgres, "daemon_stall") else {
        return;
    };
    let mut ws = Workspace::new("daemon-stall", 201);
    ws.state = Some(ts.url.clone());
    ws.write(CONFIG);
    ws.apply();
    assert_eq!(nodes(&ws), 1);

    let app_a = format!("lbt-stall-a-{}", std::process::id());
    let app_b = format!("lbt-stall-b-{}", std::process::id());
    let link = Link::to(&ts.url);
    ws.state = Some(with_app(&link.url, &app_a));
    let a = Daemon::start(&ws, free_port(), "a");
    wait_for("daemon a to own the group", Duration::from_secs(30), || {
        (owner(&a) == "self").then_some(())
    });
    ws.state = Some(with_app(&ts.url, &app_b));
    let b = Daemon::start(&ws, free_port(), "b");
    ws.state = Some(ts.url.clone());
    let holder_a = wait_for(
        "daemon b to see daemon a's claim",
        Duration::from_secs(30),
        || Some(owner(&b)).filter(|o| o.starts_with("daemon-")),
    );
    // Daemon a's connections reach the server, through the link.
    assert!(!backends_named(&ts.url, &app_a).is_empty());

    // The stall.
    let started = Instant::now();
    let stall = link.stall();
    let (code, body) = wait_for(
        "daemon a's /healthz to say the store is unreachable",
        Duration::from_secs(15),
        || match a.get("/healthz") {
            Ok((503, body)) => Some((503, body)),
            _ => None,
        },
    );
    assert_eq!(code, 503);
    assert!(body.starts_with("store unreachable: "), "{body:?}");
    eprintln!("503 after {:?}: {}", started.elapsed(), body.trim_end());
    // The second daemon takes the group once the first one's claim ran out
    // (its lifetime: max(5 x stats_interval, 10 s)).
    wait_for(
        "daemon b to take the group over",
        Duration::from_secs(30),
        || (owner(&b) == "self").then_some(()),
    );
    eprintln!("taken over after {:?}", started.elapsed());
    // Through the rest of the stall the first keeps saying so, and its HTTP
    // API answers.
    while started.elapsed() < Duration::from_secs(30) {
        let (code, body) = a.get("/healthz").expect("daemon a's HTTP API answers");
        assert_eq!(code, 503, "healthz during the stall: {body}");
        assert_eq!(a.get("/v1/groups").unwrap().0, 200);
        std::thread::sleep(Duration::from_millis(500));
    }
    drop(stall);

    // Resumed: healthy, and a follower of the second.
    wait_for(
        "daemon a's /healthz to be ok again",
        Duration::from_secs(30),
        || matches!(a.get("/healthz"), Ok((200, ref b)) if b == "ok\n").then_some(()),
    );
    let holder_b = wait_for(
        "daemon a to follow daemon b",
        Duration::from_secs(30),
        || Some(owner(&a)).filter(|o| o.starts_with("daemon-")),
    );
    assert_ne!(holder_a, holder_b);
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(owner(&b), "self", "daemon b lost the group again");
    assert_eq!(owner(&a), holder_b, "daemon a took the group back");
    assert_eq!(nodes(&ws), 1, "a step was done twice");
    let logs = a.logs();
    assert!(logs.contains("the store is unreachable"), "{logs}");

    a.stop();
    b.stop();
    ws.destroy();
    ws.assert_nothing_left(&[]);
}
