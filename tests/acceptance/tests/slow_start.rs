//! Slow start in the loop: a node that joins a group (the engine's scale-out
//! workflow, which the daemon runs) gets every vserver of the group, and each
//! vserver's services ramp under the vserver's slow-start settings against the
//! nodes that already serve: what they may not take yet goes to the older node.

use lbscale_acceptance::*;
use lbscale_engine::nodeapi::NodeStats;
use lbscale_engine::store::NodeRow;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const PORT: u16 = 8085;

fn config(a: u16, b: u16) -> String {
    format!(
        r#"
resource "lbscale_traffic_distributor" "d" {{
  name   = "ss-dns"
  cloud  = "local"
  mode   = "dns"
  domain = "ss.lbscale.test"
  ttl    = "1s"
}}

resource "lbscale_autoscale_group" "g" {{
  name                   = "ss"
  cloud                  = "local"
  availability_zones     = ["az1"]
  traffic_distributor_id = lbscale_traffic_distributor.d.id
  min_nodes              = 1
  max_nodes              = 2
  drain_timeout          = "2s"
  threshold {{
    metric = "cpu"
    min    = 10
    max    = 70
  }}
}}

resource "lbscale_se_group" "s" {{
  name               = "ss-se"
  autoscale_group_id = lbscale_autoscale_group.g.id
}}

resource "lbscale_vserver" "web" {{
  name         = "ss-web"
  se_group_id  = lbscale_se_group.s.id
  service_type = "HTTP"
  port         = {PORT}
  lb_method    = "ROUNDROBIN"
  service {{
    name    = "a"
    address = "127.0.0.1"
    port    = {a}
  }}
  service {{
    name    = "b"
    address = "127.0.0.1"
    port    = {b}
  }}
  slow_start {{
    new_service_request = 8
    unit                = "PER_SECOND"
    increment_interval  = 1
  }}
}}
"#
    )
}

/// The vserver's bound services (a, b) as the node reports them.
fn own(stats: &NodeStats) -> Vec<&lbscale_engine::nodeapi::ServiceStats> {
    stats
        .services
        .iter()
        .filter(|s| s.vserver == "ss-web" && (s.service == "a" || s.service == "b"))
        .collect()
}

fn served(stats: &NodeStats) -> u64 {
    own(stats).iter().map(|s| s.requests_total).sum()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_joining_node_ramps_its_services_against_the_older_node() {
    let (a, b) = (http_backend("a"), http_backend("b"));
    let mut ws = Workspace::new("slowstart", 140);
    ws.write(&config(a, b));
    ws.apply();
    let group_id = ws.resource("lbscale_autoscale_group.g")["id"]
        .as_str()
        .unwrap()
        .to_string();
    let engine = ws.engine();
    let old: NodeRow = engine.node_rows(&group_id).unwrap().remove(0);
    let old_stats = ws.node_stats(&old).await;
    assert!(
        own(&old_stats).iter().all(|s| !s.in_slow_start),
        "the nodes of a new group do not ramp: {:?}",
        old_stats.services
    );

    // What the daemon does on a confirmed breach.
    let added = engine.scale_out(&group_id, "az1", "test").await.unwrap();
    let new = engine
        .node_rows(&group_id)
        .unwrap()
        .into_iter()
        .find(|n| n.id == added)
        .unwrap();
    let first = ws.node_stats(&new).await;
    let services = own(&first);
    assert_eq!(services.len(), 2, "the new node got the vserver: {first:?}");
    assert!(
        services.iter().all(|s| s.in_slow_start),
        "every service of the joining node starts in slow start: {services:?}"
    );

    // Steady traffic at the new node only (as DNS would send part of it there).
    let stop = Arc::new(AtomicBool::new(false));
    let load = {
        let (stop, ip) = (stop.clone(), new.private_ip.clone());
        std::thread::spawn(move || {
            let mut ok = 0u64;
            while !stop.load(Ordering::Relaxed) {
                if http_get(&ip, PORT, "ss.lbscale.test").is_ok_and(|r| r.0 == 200) {
                    ok += 1;
                }
                std::thread::sleep(Duration::from_millis(25));
            }
            ok
        })
    };
    let old_before = served(&ws.node_stats(&old).await);
    let started = Instant::now();
    let mut caps: Vec<(f64, f64)> = Vec::new();
    let ramp_over = loop {
        let s = ws.node_stats(&new).await;
        let o = own(&s);
        if o.iter().all(|x| !x.in_slow_start) {
            break started.elapsed();
        }
        caps.push((o[0].cap_per_second, o[1].cap_per_second));
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the ramp did not end in 30 s; caps seen {caps:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let old_during = served(&ws.node_stats(&old).await) - old_before;
    // Caps grow by the increment (8 req/s per second) and never shrink.
    for w in caps.windows(2) {
        assert!(
            w[1].0 >= w[0].0 && w[1].1 >= w[0].1,
            "a cap went down: {caps:?}"
        );
    }
    assert!(
        caps.iter().any(|c| c.0 > 0.0),
        "no cap above 0 was in force during the ramp: {caps:?}"
    );
    assert!(
        old_during > 0,
        "what the new services could not take went to the older node (ramp {ramp_over:?}, caps {caps:?})"
    );

    // After the ramp the new node serves everything it gets itself.
    let old_after = served(&ws.node_stats(&old).await);
    let new_after = served(&ws.node_stats(&new).await);
    tokio::time::sleep(Duration::from_secs(2)).await;
    stop.store(true, Ordering::Relaxed);
    let sent = load.join().unwrap();
    assert!(sent > 0);
    let old_end = served(&ws.node_stats(&old).await);
    let new_end = served(&ws.node_stats(&new).await);
    assert_eq!(
        old_end, old_after,
        "the older node got requests from the new node after its ramp"
    );
    assert!(
        new_end > new_after + 20,
        "the new node served {new_after} -> {new_end}"
    );

    ws.destroy();
}
