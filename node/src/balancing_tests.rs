//! The balancing of a vserver's services as the data plane runs it: the LB
//! methods, caps, ramp peers and health over real service runtimes (`lb` picks,
//! `service` measures, `model` holds the snapshot).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use crate::clock::now_ns;
use crate::lb::Method;
use crate::model::{Kind, VsState};
use crate::service::{ServiceRt, SvcEntry};

/// `cap` 0.0: no cap (these tests were written before caps of 0 existed).
fn entry(name: &str, weight: u32, enabled: bool, cap: f64) -> SvcEntry {
    let e = SvcEntry::new(
        Arc::new(ServiceRt::new(name, "127.0.0.1", 1)),
        weight,
        enabled,
    );
    e.set_cap((cap > 0.0).then_some(cap));
    e
}

#[test]
fn smooth_weighted_round_robin() {
    let vs = VsState::new(
        "v".into(),
        Kind::Http,
        Method::RoundRobin,
        vec![
            entry("a", 5, true, 0.0),
            entry("b", 1, true, 0.0),
            entry("c", 1, true, 0.0),
            entry("d", 9, false, 0.0),
        ],
    );
    let picks: Vec<usize> = (0..7).map(|_| vs.pick(None).unwrap()).collect();
    assert_eq!(picks, vec![0, 0, 1, 0, 2, 0, 0]);
    assert!(!picks.contains(&3));
}

#[test]
fn round_robin_exclude_and_empty() {
    let vs = VsState::new(
        "v".into(),
        Kind::Tcp,
        Method::RoundRobin,
        vec![entry("a", 1, true, 0.0), entry("b", 1, true, 0.0)],
    );
    for _ in 0..5 {
        assert_eq!(vs.pick(Some(0)), Some(1));
    }
    let vs = VsState::new(
        "v".into(),
        Kind::Tcp,
        Method::RoundRobin,
        vec![entry("a", 1, false, 0.0)],
    );
    assert_eq!(vs.pick(None), None);
}

#[test]
fn least_connection_relative_to_weight() {
    let vs = VsState::new(
        "v".into(),
        Kind::Http,
        Method::LeastConnection,
        vec![entry("a", 1, true, 0.0), entry("b", 3, true, 0.0)],
    );
    vs.services[0].rt.active.store(1, Ordering::Relaxed);
    vs.services[1].rt.active.store(2, Ordering::Relaxed);
    assert_eq!(vs.pick(None), Some(1)); // 2/3 < 1/1
    vs.services[1].rt.active.store(4, Ordering::Relaxed);
    assert_eq!(vs.pick(None), Some(0)); // 1/1 < 4/3
}

#[test]
fn cap_diverts_to_other_services() {
    let vs = VsState::new(
        "v".into(),
        Kind::Http,
        Method::RoundRobin,
        vec![entry("new", 1, true, 1.0), entry("old", 1, true, 0.0)],
    );
    let mut new = 0;
    for _ in 0..100 {
        if vs.pick(None) == Some(0) {
            new += 1;
        }
    }
    assert!(new <= 2, "capped service got {new} of 100 immediate picks");
    // Only capped services left: fall back instead of refusing.
    let vs = VsState::new(
        "v".into(),
        Kind::Http,
        Method::RoundRobin,
        vec![entry("new", 1, true, 1.0)],
    );
    for _ in 0..10 {
        assert_eq!(vs.pick(None), Some(0));
    }
}

fn vs_of(method: Method, entries: Vec<SvcEntry>) -> VsState {
    VsState::new("v".into(), Kind::Http, method, entries)
}

#[test]
fn round_robin_leftover_of_a_capped_service_is_split_by_weight() {
    // Capped at ~0 after its first token: its share goes to the uncapped ones.
    let vs = vs_of(
        Method::RoundRobin,
        vec![
            entry("s1", 1, true, 0.0),
            entry("s2", 1, true, 0.0),
            entry("new", 1, true, 0.001),
        ],
    );
    let mut n = [0u32; 3];
    for _ in 0..300 {
        n[vs.pick(None).unwrap()] += 1;
    }
    assert!(n[2] <= 2, "capped service got {}", n[2]);
    assert!(
        n[0].abs_diff(n[1]) <= 2,
        "leftover must be split evenly between s1 and s2: {n:?}"
    );
    // With weights 1:3 the leftover follows the weights too.
    let vs = vs_of(
        Method::RoundRobin,
        vec![
            entry("s1", 1, true, 0.0),
            entry("s2", 3, true, 0.0),
            entry("new", 4, true, 0.001),
        ],
    );
    let mut n = [0u32; 3];
    for _ in 0..800 {
        n[vs.pick(None).unwrap()] += 1;
    }
    assert!(
        n[1].abs_diff(3 * n[0]) <= 8,
        "weights 1:3 for the leftover: {n:?}"
    );
}

#[test]
fn a_cap_of_zero_holds_the_service_and_peers_take_only_the_overflow() {
    for m in [Method::RoundRobin, Method::LeastConnection] {
        let mut entries = vec![
            entry("own1", 1, true, 0.0),
            entry("own2", 1, true, 0.0),
            entry("peer:a", 2, true, 0.0),
            entry("peer:b", 2, true, 0.0),
        ];
        entries[2].peer = true;
        entries[3].peer = true;
        let vs = vs_of(m, entries);
        // Uncapped own services take everything: peers get nothing.
        for _ in 0..40 {
            assert!(vs.pick(None).unwrap() < 2, "{m:?}: a peer got a request");
        }
        // Held at 0: the peers take it, round robin.
        vs.services[0].set_cap(Some(0.0));
        vs.services[1].set_cap(Some(0.0));
        let mut n = [0u32; 4];
        for _ in 0..40 {
            n[vs.pick(None).unwrap()] += 1;
        }
        assert_eq!(n, [0, 0, 20, 20], "{m:?}");
        // Peers gone (DOWN): the caps are ignored rather than refusing.
        vs.services[2].rt.set_up(false);
        vs.services[3].rt.set_up(false);
        assert!(vs.pick(None).unwrap() < 2, "{m:?}");
    }
}

#[test]
fn down_services_get_nothing_and_up_again_is_recorded() {
    for m in [
        Method::RoundRobin,
        Method::LeastConnection,
        Method::CustomLoad,
    ] {
        let vs = vs_of(m, vec![entry("a", 1, true, 0.0), entry("b", 5, true, 0.0)]);
        let before = vs.services[1].rt.up_since_ns();
        assert!(vs.services[1].rt.set_up(false));
        for _ in 0..20 {
            assert_eq!(
                vs.pick(None),
                Some(0),
                "{m:?}: a DOWN service got a request"
            );
        }
        assert_eq!(vs.pick(Some(0)), None, "{m:?}: only a DOWN service left");
        std::thread::sleep(std::time::Duration::from_millis(2));
        assert!(vs.services[1].rt.set_up(true));
        assert!(vs.services[1].rt.up_since_ns() > before);
        assert!(
            (0..20).any(|_| vs.pick(None) == Some(1)),
            "{m:?}: UP again gets traffic"
        );
    }
}

#[test]
fn least_response_time_and_lrtm() {
    let vs = vs_of(
        Method::LeastResponseTime,
        vec![entry("slow", 1, true, 0.0), entry("fast", 1, true, 0.0)],
    );
    vs.services[0].rt.record_response(1000);
    vs.services[1].rt.record_response(100);
    for _ in 0..5 {
        assert_eq!(vs.pick(None), Some(1));
    }
    // 21 in flight × 100 µs > 1 × 1000 µs.
    vs.services[1].rt.active.store(20, Ordering::Relaxed);
    assert_eq!(vs.pick(None), Some(0));
    // Weight 3 on the slow one: 1000/3 < 2100.
    let vs = vs_of(
        Method::Lrtm,
        vec![entry("a", 1, true, 0.0), entry("b", 1, true, 0.0)],
    );
    vs.services[0].rt.record_response(100);
    vs.services[1].rt.record_response(1000);
    assert_eq!(
        vs.pick(None),
        Some(0),
        "no probe yet: request response time"
    );
    // The monitor says otherwise: LRTM follows the monitor.
    vs.services[0].rt.record_monitor_rtt(900);
    vs.services[1].rt.record_monitor_rtt(50);
    assert_eq!(vs.pick(None), Some(1));
}

#[test]
fn least_bandwidth_and_packets() {
    let vs = vs_of(
        Method::LeastBandwidth,
        vec![entry("a", 1, true, 0.0), entry("b", 2, true, 0.0)],
    );
    vs.services[0].rt.record_traffic(1_000, 100);
    vs.services[1].rt.record_traffic(1_500, 1);
    assert_eq!(vs.pick(None), Some(1), "1500/2 < 1000/1");
    vs.services[1].rt.record_traffic(1_000, 1);
    assert_eq!(vs.pick(None), Some(0), "2500/2 > 1000/1");
    let vs = vs_of(
        Method::LeastPackets,
        vec![entry("a", 1, true, 0.0), entry("b", 1, true, 0.0)],
    );
    vs.services[0].rt.record_traffic(10, 100);
    vs.services[1].rt.record_traffic(1_000_000, 10);
    assert_eq!(vs.pick(None), Some(1));
    // Not tracked under another method.
    let rr = vs_of(Method::RoundRobin, vec![entry("c", 1, true, 0.0)]);
    rr.services[0].rt.record_traffic(1_000, 1);
    assert_eq!(
        rr.services[0].rt.load(Method::LeastBandwidth, now_ns()),
        0.0
    );
}

#[test]
fn custom_load_with_weights_and_ties_follow_weights() {
    let vs = vs_of(
        Method::CustomLoad,
        vec![entry("a", 1, true, 0.0), entry("b", 2, true, 0.0)],
    );
    vs.services[0].rt.set_custom_load(10.0);
    vs.services[1].rt.set_custom_load(15.0);
    for _ in 0..5 {
        assert_eq!(vs.pick(None), Some(1), "15/2 < 10/1");
    }
    vs.services[1].rt.set_custom_load(30.0);
    assert_eq!(vs.pick(None), Some(0));
    // Equal (zero) loads: the weighted schedule decides, 1:2.
    vs.services[0].rt.set_custom_load(0.0);
    vs.services[1].rt.set_custom_load(0.0);
    let mut n = [0u32; 2];
    for _ in 0..300 {
        n[vs.pick(None).unwrap()] += 1;
    }
    assert_eq!(n, [100, 200]);
}

#[test]
fn the_end_of_a_join_ramp_keeps_persistence_and_the_proxy_peers() {
    use crate::persist::Persistence;
    let mut entries = vec![entry("own", 1, true, 0.0), entry("peer:a", 1, true, 0.0)];
    entries[1].peer = true;
    let peers: std::collections::HashSet<std::net::IpAddr> =
        ["127.0.0.9".parse().unwrap()].into_iter().collect();
    let st = VsState::new("v".into(), Kind::Http, Method::LeastConnection, entries)
        .with_persistence(Persistence::Cookie)
        .with_proxy_from(Arc::new(peers));
    let own = st.without_peers();
    assert_eq!(own.services.len(), 1);
    assert!(Arc::ptr_eq(&own.services[0].rt, &st.services[0].rt));
    assert_eq!(own.method(), Method::LeastConnection);
    assert_eq!(own.persistence, Persistence::Cookie);
    assert_eq!(own.cookie_name, "lbscale_v");
    assert!(own.set_cookie(0).is_some());
    assert!(own.proxy_from.contains(&"127.0.0.9".parse().unwrap()));
}
