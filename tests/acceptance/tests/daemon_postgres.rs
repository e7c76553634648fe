//! Three `lbscale daemon`s on one PostgreSQL store share its groups, and when
//! one is killed the others take its groups over: real Terraform, real node
//! processes, the built binary (scripts/test.sh gives the PostgreSQL server;
//! without one the test says so and passes, as the other PostgreSQL tests).
//!
//! - each daemon claims its share (six groups, two each);
//! - one daemon killed (SIGKILL, its claims left to expire): the two others
//!   claim its groups and evaluate them again;
//! - no workflow done twice: every group keeps its one node (no node
//!   provisioned by two daemons, none replaced), and no scaling event.
//!
//! Waits are bounded by generous deadlines that say what they wait for; no
//! time is asserted (bench/daemon_scale.sh prints the figures).

use lbscale_acceptance::*;
use lbscale_engine::store_testing::{Kind, TestStore};
use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

const GROUPS: usize = 6;

fn config() -> String {
    let mut tf = String::from(
        r#"
resource "lbscale_traffic_distributor" "d" {
  name   = "dpg-dns"
  cloud  = "local"
  mode   = "dns"
  domain = "dpg.lbscale.test"
  ttl    = "1s"
}
"#,
    );
    for i in 0..GROUPS {
        tf.push_str(&format!(
            r#"
resource "lbscale_autoscale_group" "g{i}" {{
  name                   = "dpg{i}"
  cloud                  = "local"
  availability_zones     = ["az1"]
  traffic_distributor_id = lbscale_traffic_distributor.d.id
  min_nodes              = 1
  max_nodes              = 2
  stats_interval         = "1s"
  watch_time             = "2s"
  cooldown               = "3s"
  drain_timeout          = "2s"
  # Idle nodes move no traffic: inside 0..1000 Mbps, nothing scales.
  threshold {{
    metric = "throughput"
    min    = 0
    max    = 1000
  }}
}}
"#
        ));
    }
    tf
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The groups a daemon evaluates itself, by name, with their last evaluation.
fn owned(d: &Daemon) -> BTreeMap<String, i64> {
    d.json("/v1/groups")["groups"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .iter()
        .filter(|g| g["owner"] == "self" && g["last_evaluated_ms"].is_i64())
        .map(|g| {
            (
                g["name"].as_str().unwrap().to_string(),
                g["last_evaluated_ms"].as_i64().unwrap(),
            )
        })
        .collect()
}

/// Per group name: its node ids in the store.
fn nodes(ws: &Workspace) -> BTreeMap<String, Vec<String>> {
    let engine = ws.engine();
    (0..GROUPS)
        .map(|i| {
            let name = format!("dpg{i}");
            let g = engine
                .group_named(&name)
                .unwrap()
                .expect("group in the store");
            let ids = engine
                .node_rows(&g.id)
                .unwrap()
                .into_iter()
                .map(|n| n.id)
                .collect();
            (name, ids)
        })
        .collect()
}

/// Scaling and provisioning events since `since_ms`.
fn scaling_events(ws: &Workspace, since_ms: i64) -> Vec<String> {
    let engine = ws.engine();
    let mut out = Vec::new();
    for i in 0..GROUPS {
        let g = engine
            .group_named(&format!("dpg{i}"))
            .unwrap()
            .expect("group in the store");
        for e in engine.events(&g.id, 1000).unwrap() {
            if e.last_ms >= since_ms
                && (e.kind.starts_with("scale_") || e.kind.contains("provision"))
            {
                out.push(format!("dpg{i}: {} {}", e.kind, e.reason));
            }
        }
    }
    out
}

#[test]
fn three_daemons_on_postgres_share_the_groups_and_take_over_a_killed_ones() {
    let Some(ts) = TestStore::new(Kind::Postgres, "daemonpg") else {
        return;
    };
    let url = match lbscale_engine::store_testing::postgres_ca("daemonpg") {
        Some(ca) => format!(
            "{}?sslmode=verify-full&sslrootcert={}",
            ts.url,
            ca.display()
        ),
        None => ts.url.clone(),
    };
    let mut ws = Workspace::new("daemon-pg", 170);
    ws.state = Some(url);
    ws.write(&config());
    ws.apply();
    let before = nodes(&ws);
    assert!(
        before.values().all(|n| n.len() == 1),
        "one node per group after the apply: {before:?}"
    );

    let started_ms = lbscale_engine::store::now_ms();
    let daemons: Vec<Daemon> = ["a", "b", "c"]
        .iter()
        .map(|tag| Daemon::start(&ws, free_port(), tag))
        .collect();
    // Each takes its share: all six groups evaluated, none by two daemons,
    // and each daemon holds two.
    let shares = wait_for(
        "the three daemons to evaluate two groups each",
        Duration::from_secs(90),
        || {
            let shares: Vec<BTreeMap<String, i64>> = daemons.iter().map(owned).collect();
            (shares.iter().all(|s| s.len() == GROUPS / 3)).then_some(shares)
        },
    );
    let all: BTreeSet<&String> = shares.iter().flat_map(|s| s.keys()).collect();
    assert_eq!(
        all.len(),
        GROUPS,
        "a group evaluated by two daemons: {shares:?}"
    );

    // Daemon a dies without letting go; b and c claim its groups once its
    // claims expire (5 stats intervals, at least 10 s) and evaluate them.
    let mut daemons = daemons.into_iter();
    let a = daemons.next().unwrap();
    let (b, c) = (daemons.next().unwrap(), daemons.next().unwrap());
    let orphaned: Vec<String> = shares[0].keys().cloned().collect();
    let killed_at = lbscale_engine::store::now_ms();
    a.crash();
    let after = wait_for(
        "daemons b and c to claim and evaluate daemon a's groups, three each",
        Duration::from_secs(90),
        || {
            let (sb, sc) = (owned(&b), owned(&c));
            let taken = orphaned
                .iter()
                .all(|g| sb.get(g).or(sc.get(g)).is_some_and(|t| *t > killed_at));
            // Each at its share: one may claim past it for a moment (two
            // claims in one tick) and lets the excess go between workflows.
            let even = sb.len() == GROUPS / 2 && sc.len() == GROUPS / 2;
            (taken && even).then_some((sb, sc))
        },
    );
    let (sb, sc) = &after;
    assert!(
        sb.keys().all(|g| !sc.contains_key(g)),
        "a group evaluated by both survivors: {after:?}"
    );
    assert_eq!(sb.len(), GROUPS / 2, "b's share: {after:?}");
    assert_eq!(sc.len(), GROUPS / 2, "c's share: {after:?}");

    // Evaluations go on for every group.
    let later = lbscale_engine::store::now_ms();
    wait_for(
        "every group to be evaluated again by b or c",
        Duration::from_secs(30),
        || {
            let (sb, sc) = (owned(&b), owned(&c));
            (sb.values()
                .chain(sc.values())
                .filter(|t| **t > later)
                .count()
                == GROUPS)
                .then_some(())
        },
    );

    // Nothing done twice: the same node per group as before (none provisioned
    // by two daemons, none replaced by a resume), and no scaling at all.
    assert_eq!(nodes(&ws), before, "the groups' nodes changed");
    assert_eq!(scaling_events(&ws, started_ms), Vec::<String>::new());
    for d in [&b, &c] {
        let m = d.metrics();
        assert!(
            !m.contains("lbscale_decisions_total{"),
            "a survivor decided to scale:\n{m}"
        );
    }

    b.stop();
    c.stop();
    ws.destroy();
    ws.assert_nothing_left(&[]);
}
