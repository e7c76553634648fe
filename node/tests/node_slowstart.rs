//! The node's own slow start (node/src/slowstart.rs) through real `serve` processes
//! and real HTTP traffic at a fixed rate: the vserver carries only its slow-start
//! settings (no `cap_per_second`), the node decides when a service is new (bound by
//! a later Configure, back UP after DOWN, or every service of a joining node
//! against its `ramp_peers`) and ramps it with lbscale-core's model.
//!
//! Each test reads from the node's statistics when the ramp started
//! (`new_since_ms`, node uptime) and maps the node's clock onto its own with one
//! GetStats round trip; it then counts the requests every backend received in each
//! increment interval (arrival times at the backends) and compares them with what
//! lbscale-core's model computes for that interval, fed with the rate the vserver
//! actually received in it. Tolerance per step and service: 10 % or 3 requests,
//! whichever is more (a token bucket lets one or two requests through early at a
//! boundary; the node's clock is mapped to within a millisecond or so); a service
//! the model gives nothing gets at most 1 request. Stats are sampled in the middle
//! of every step: `in_slow_start` and `cap_per_second` must be the model's. The TCP
//! join test counts connections over one 2 s window instead (within 3).

mod common;

use std::time::{Duration, Instant};

use common::*;
use lbscale_core::slowstart::{
    LbMethod as PlanMethod, Service as PlanService, SlowStartConfig, Unit, Vserver as Plan,
};
use lbscale_proto::{
    LbMethod, NodeConfig, NodeStats, Service, ServiceStats, ServiceType, SlowStart, SlowStartUnit,
    StatsRequest, Vserver,
};

/// Increment interval of every test, s.
const INTERVAL_S: u32 = 1;
const INTERVAL_MS: u64 = INTERVAL_S as u64 * 1000;

fn svc(name: &str, b: &HttpBackend) -> Service {
    Service {
        name: name.into(),
        address: b.addr.ip().to_string(),
        port: b.addr.port() as u32,
        weight: 1,
        enabled: true,
        cap_per_second: None,
        custom_load: None,
    }
}

fn slow_start(nsr: u32, unit: SlowStartUnit, interval_s: u32) -> Option<SlowStart> {
    Some(SlowStart {
        new_service_request: nsr,
        unit: unit as i32,
        increment_interval_s: interval_s,
    })
}

fn vserver(services: Vec<Service>, ss: Option<SlowStart>, ramp_peers: Vec<String>) -> Vserver {
    Vserver {
        name: "web".into(),
        service_type: ServiceType::Http as i32,
        port: 8080,
        lb_method: LbMethod::Roundrobin as i32,
        persistence: "NONE".into(),
        services,
        slow_start: ss,
        scaleout: None,
        ramp_peers,
        ..Default::default()
    }
}

async fn configure(cl: &mut Client, version: u64, v: Vserver) {
    tokio::time::timeout(
        Duration::from_secs(5),
        cl.configure(NodeConfig {
            version,
            group_peers: Vec::new(),
            fence: 0,
            vservers: vec![v],
        }),
    )
    .await
    .expect("Configure within 5 s")
    .expect("Configure accepted");
}

async fn stats(cl: &mut Client) -> NodeStats {
    tokio::time::timeout(
        Duration::from_secs(5),
        cl.get_stats(StatsRequest::default()),
    )
    .await
    .expect("GetStats within 5 s")
    .expect("GetStats")
    .into_inner()
}

fn service<'a>(st: &'a NodeStats, name: &str) -> &'a ServiceStats {
    st.services
        .iter()
        .find(|s| s.service == name)
        .unwrap_or_else(|| panic!("no statistics for {name}: {:?}", st.services))
}

/// The node's clock (uptime, ms) on the test's.
struct NodeClock {
    at: Instant,
    uptime_ms: u64,
}

impl NodeClock {
    /// One GetStats round trip: the node read its uptime half-way, give or take.
    async fn read(cl: &mut Client) -> (NodeClock, NodeStats) {
        let t0 = Instant::now();
        let st = stats(cl).await;
        let at = t0 + t0.elapsed() / 2;
        (
            NodeClock {
                at,
                uptime_ms: st.uptime_ms,
            },
            st,
        )
    }

    fn instant(&self, uptime_ms: u64) -> Instant {
        if uptime_ms >= self.uptime_ms {
            self.at + Duration::from_millis(uptime_ms - self.uptime_ms)
        } else {
            self.at - Duration::from_millis(self.uptime_ms - uptime_ms)
        }
    }
}

fn count(b: &HttpBackend, from: Instant, to: Instant) -> usize {
    b.stamps
        .lock()
        .unwrap()
        .iter()
        .filter(|t| **t >= from && **t < to)
        .count()
}

async fn sleep_until(t: Instant) {
    tokio::time::sleep_until(tokio::time::Instant::from_std(t)).await;
}

/// Per-step comparisons, reported together.
#[derive(Default)]
struct Check {
    report: String,
    failures: Vec<String>,
}

impl Check {
    fn requests(&mut self, step: &str, what: &str, want: f64, got: usize) {
        let ok = if want < 0.5 {
            got <= 1
        } else {
            (got as f64 - want).abs() <= (0.1 * want).max(3.0)
        };
        self.report.push_str(&format!(
            "{step} {what:<10} model {want:>6.1} got {got:>4} requests{}\n",
            if ok { "" } else { "   <-- off" }
        ));
        if !ok {
            self.failures
                .push(format!("{step} {what}: model {want:.1}, got {got}"));
        }
    }

    /// The node's stats against the model: in slow start or not, and the cap.
    fn slow_start(&mut self, step: &str, s: &ServiceStats, cap: Option<f64>) {
        let ok = s.in_slow_start == cap.is_some()
            && cap.is_none_or(|c| (s.cap_per_second - c).abs() <= (0.1 * c).max(0.5));
        self.report.push_str(&format!(
            "{step} {:<10} in_slow_start {} cap {:.2} (model {:?}){}\n",
            s.service,
            s.in_slow_start,
            s.cap_per_second,
            cap.map(|c| (c * 100.0).round() / 100.0),
            if ok { "" } else { "   <-- off" }
        ));
        if !ok {
            self.failures.push(format!(
                "{step} {}: in_slow_start {} cap {:.2}, model {cap:?}",
                s.service, s.in_slow_start, s.cap_per_second
            ));
        }
    }

    fn done(self, name: &str, errors: u64) {
        eprint!("{name}:\n{}", self.report);
        assert_eq!(errors, 0, "{name}: failed requests\n{}", self.report);
        assert!(
            self.failures.is_empty(),
            "{name}: off the model:\n{}\n{}",
            self.failures.join("\n"),
            self.report
        );
    }
}

fn plan(services: &[&str], nsr: u32, unit: Unit, interval: u32) -> Plan {
    Plan {
        lb_method: PlanMethod::RoundRobin,
        request_rate: 0.0,
        slow_start: SlowStartConfig {
            new_service_request: nsr,
            unit,
            increment_interval: interval,
        },
        services: services
            .iter()
            .map(|n| PlanService {
                name: n.to_string(),
                weight: 1,
                ramp: None,
            })
            .collect(),
    }
}

/// Runs `steps` increment intervals from `since` (node uptime) and checks, for
/// every step, the requests of each backend against `plan` (with the new service
/// already added at `since`) and the stats of `watched` in the middle of the step.
/// `rate_factor` scales the rate the node received into the model's rate (the join
/// ramp's AZ estimate); `forwarded` are backends of a peer that count as the
/// model's service `peers_name`, which gets `R_own − Σ own`.
#[allow(clippy::too_many_arguments)]
async fn run_steps(
    cl: &mut Client,
    clock: &NodeClock,
    since: u64,
    steps: u64,
    plan: &mut Plan,
    own: &[(&str, &HttpBackend)],
    forwarded: &[&HttpBackend],
    watched: &[&str],
    check: &mut Check,
) {
    let rate_factor = if forwarded.is_empty() { 1.0 } else { 2.0 };
    // Stats in the middle of every step.
    let mut mid_stats = Vec::new();
    for k in 0..steps {
        sleep_until(clock.instant(since + k * INTERVAL_MS + INTERVAL_MS / 2)).await;
        mid_stats.push(stats(cl).await);
    }
    sleep_until(clock.instant(since + steps * INTERVAL_MS) + Duration::from_millis(50)).await;
    let mut got_traffic: Vec<bool> = Vec::new();
    for k in 0..steps {
        let t = since + k * INTERVAL_MS;
        let (from, to) = (clock.instant(t), clock.instant(t + INTERVAL_MS));
        let counts: Vec<usize> = own.iter().map(|(_, b)| count(b, from, to)).collect();
        let fwd: usize = forwarded.iter().map(|b| count(b, from, to)).sum();
        let received = counts.iter().sum::<usize>() + fwd;
        plan.record_traffic(&got_traffic);
        plan.request_rate = received as f64 * rate_factor * 1000.0 / INTERVAL_MS as f64;
        plan.advance(t);
        let rates = plan.rates(t);
        let caps = plan.caps(t);
        let step = format!("t={}s", k * INTERVAL_MS / 1000);
        let per_step = |r: f64| r * INTERVAL_MS as f64 / 1000.0;
        got_traffic.clear();
        let mut own_planned = 0.0;
        for (((name, _), n), _) in own.iter().zip(&counts).zip(0..) {
            let i = plan.services.iter().position(|s| s.name == *name).unwrap();
            own_planned += rates[i];
            check.requests(&step, name, per_step(rates[i]), *n);
        }
        for s in &plan.services {
            let n = own
                .iter()
                .zip(&counts)
                .find(|((name, _), _)| *name == s.name)
                .map_or(fwd, |(_, n)| *n);
            got_traffic.push(n > 0);
        }
        if !forwarded.is_empty() {
            let own_rate = received as f64 * 1000.0 / INTERVAL_MS as f64;
            check.requests(&step, "forwarded", per_step(own_rate - own_planned), fwd);
        }
        for name in watched {
            let i = plan.services.iter().position(|s| s.name == *name).unwrap();
            check.slow_start(&step, service(&mid_stats[k as usize], name), caps[i]);
        }
    }
}

/// (a) A service whose health check goes DOWN then UP is new again and ramps per
/// second, automatically.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_service_back_up_ramps_again() {
    let names = ["S1", "S2", "S3", "S4"];
    let mut b = Vec::new();
    for (i, n) in names.iter().enumerate() {
        b.push(http_backend(&format!("127.88.1.{}:8001", 11 + i), n).await);
    }
    let (_node, _dir) = start_serve(
        "ss-backup",
        "127.88.1.1",
        &[
            "--health-interval-ms",
            "100",
            "--health-fall",
            "2",
            "--health-rise",
            "2",
        ],
    );
    let mut cl = api_client("127.88.1.1").await;
    let ss = slow_start(12, SlowStartUnit::PerSecond, INTERVAL_S);
    let services: Vec<Service> = names.iter().zip(&b).map(|(n, b)| svc(n, b)).collect();
    configure(&mut cl, 1, vserver(services, ss, vec![])).await;
    // A vserver's first configuration: every service is new, so none ramps.
    let st = stats(&mut cl).await;
    for n in names {
        let s = service(&st, n);
        assert!(!s.in_slow_start && s.health == "UP", "{s:?}");
    }
    let load = start_load("127.88.1.1:8080", 120.0);
    tokio::time::sleep(Duration::from_millis(1200)).await;

    let s4 = b.pop().unwrap();
    let addr = s4.addr.to_string();
    drop(s4);
    let mut down = false;
    for _ in 0..200 {
        if service(&stats(&mut cl).await, "S4").health == "DOWN" {
            down = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(down, "S4 never DOWN");
    tokio::time::sleep(Duration::from_millis(300)).await;
    b.push(http_backend(&addr, "S4").await);
    let mut up = None;
    for _ in 0..200 {
        let (clock, st) = NodeClock::read(&mut cl).await;
        let s = service(&st, "S4").clone();
        if s.health == "UP" {
            up = Some((clock, s));
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (clock, s4) = up.expect("S4 never UP again");
    assert!(
        s4.in_slow_start && s4.cap_per_second == 0.0,
        "UP again: new, held at 0 until the first increment: {s4:?}"
    );
    let since = s4.new_since_ms;

    let mut p = plan(&names[..3], 12, Unit::PerSecond, INTERVAL_S);
    p.add_service("S4", 1, since);
    let own: Vec<(&str, &HttpBackend)> = names.iter().copied().zip(b.iter()).collect();
    let mut check = Check::default();
    run_steps(
        &mut cl,
        &clock,
        since,
        4,
        &mut p,
        &own,
        &[],
        &["S4"],
        &mut check,
    )
    .await;
    let errors = load.finish().await;
    check.done("a_service_back_up_ramps_again", errors);
}

/// (b) A service bound by a later Configure ramps (PERCENT, automatic).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_service_bound_later_ramps() {
    let names = ["S1", "S2", "S3", "S4"];
    let mut b = Vec::new();
    for (i, n) in names.iter().enumerate() {
        b.push(http_backend(&format!("127.88.2.{}:8001", 11 + i), n).await);
    }
    let (_node, _dir) = start_serve("ss-bound", "127.88.2.1", &[]);
    let mut cl = api_client("127.88.2.1").await;
    let ss = slow_start(25, SlowStartUnit::Percent, INTERVAL_S);
    let services: Vec<Service> = names.iter().zip(&b).map(|(n, b)| svc(n, b)).collect();
    configure(&mut cl, 1, vserver(services[..3].to_vec(), ss, vec![])).await;
    let load = start_load("127.88.2.1:8080", 120.0);
    tokio::time::sleep(Duration::from_millis(1200)).await;
    configure(&mut cl, 2, vserver(services, ss, vec![])).await;
    let (clock, st) = NodeClock::read(&mut cl).await;
    let s4 = service(&st, "S4");
    assert!(s4.in_slow_start, "newly bound: new {s4:?}");
    let since = s4.new_since_ms;
    for n in &names[..3] {
        assert!(!service(&st, n).in_slow_start, "{n} is not new");
    }

    let mut p = plan(&names[..3], 25, Unit::Percent, INTERVAL_S);
    p.add_service("S4", 1, since);
    let own: Vec<(&str, &HttpBackend)> = names.iter().copied().zip(b.iter()).collect();
    let mut check = Check::default();
    // 0, 25, 50, 75 %, then 100 %: out of slow start.
    run_steps(
        &mut cl,
        &clock,
        since,
        5,
        &mut p,
        &own,
        &[],
        &["S4"],
        &mut check,
    )
    .await;
    let errors = load.finish().await;
    check.done("a_service_bound_later_ramps", errors);
}

/// (c) Manual slow start (interval 0) holds a new service at
/// `new_service_request`; a Configure with 0 releases it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn manual_slow_start_holds_until_released() {
    let names = ["S1", "S2", "S3"];
    let mut b = Vec::new();
    for (i, n) in names.iter().enumerate() {
        b.push(http_backend(&format!("127.88.3.{}:8001", 11 + i), n).await);
    }
    let (_node, _dir) = start_serve("ss-manual", "127.88.3.1", &[]);
    let mut cl = api_client("127.88.3.1").await;
    let services: Vec<Service> = names.iter().zip(&b).map(|(n, b)| svc(n, b)).collect();
    let held = slow_start(20, SlowStartUnit::PerSecond, 0);
    configure(&mut cl, 1, vserver(services[..2].to_vec(), held, vec![])).await;
    let load = start_load("127.88.3.1:8080", 120.0);
    tokio::time::sleep(Duration::from_millis(1200)).await;

    let mut p = plan(&names[..2], 20, Unit::PerSecond, 0);
    let own: Vec<(&str, &HttpBackend)> = names.iter().copied().zip(b.iter()).collect();
    let mut check = Check::default();
    let window = Duration::from_millis(2000);
    let settle = Duration::from_millis(300);
    for (version, label, ss) in [
        (2, "held", held),
        (3, "released", slow_start(0, SlowStartUnit::PerSecond, 0)),
    ] {
        configure(&mut cl, version, vserver(services.clone(), ss, vec![])).await;
        let (clock, _) = NodeClock::read(&mut cl).await;
        if version == 2 {
            p.add_service("S3", 1, clock.uptime_ms);
        } else {
            p.slow_start.new_service_request = 0;
        }
        let from = Instant::now() + settle;
        sleep_until(from + window / 2).await;
        let mid = stats(&mut cl).await;
        sleep_until(from + window).await;
        let counts: Vec<usize> = own
            .iter()
            .map(|(_, b)| count(b, from, from + window))
            .collect();
        p.request_rate = counts.iter().sum::<usize>() as f64 / window.as_secs_f64();
        p.advance(clock.uptime_ms);
        let rates = p.rates(clock.uptime_ms);
        for (i, n) in names.iter().enumerate() {
            check.requests(label, n, rates[i] * window.as_secs_f64(), counts[i]);
        }
        check.slow_start(label, service(&mid, "S3"), p.caps(clock.uptime_ms)[2]);
    }
    let errors = load.finish().await;
    check.done("manual_slow_start_holds_until_released", errors);
}

/// (d) A joining node ramps against its peer: the old node serves the vserver, the
/// new one gets it with `ramp_peers = [old]`; traffic reaches the new node only.
/// Its own services get the model's caps per step and the rest reaches the old
/// node; after the ramp the new node serves everything itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_joining_node_ramps_against_its_peer() {
    let o1 = http_backend("127.88.4.11:8001", "O1").await;
    let o2 = http_backend("127.88.4.12:8001", "O2").await;
    let n1 = http_backend("127.88.4.21:8001", "N1").await;
    let n2 = http_backend("127.88.4.22:8001", "N2").await;
    let ss = slow_start(12, SlowStartUnit::PerSecond, INTERVAL_S);
    let (_old, _) = start_serve("ss-old", "127.88.4.1", &[]);
    let mut old = api_client("127.88.4.1").await;
    configure(
        &mut old,
        1,
        vserver(vec![svc("O1", &o1), svc("O2", &o2)], ss, vec![]),
    )
    .await;
    let (_new, _) = start_serve("ss-new", "127.88.4.2", &[]);
    let mut cl = api_client("127.88.4.2").await;
    configure(
        &mut cl,
        1,
        vserver(
            vec![svc("N1", &n1), svc("N2", &n2)],
            ss,
            vec!["127.88.4.1".into()],
        ),
    )
    .await;
    let load = start_load("127.88.4.2:8080", 60.0);
    let (clock, st) = NodeClock::read(&mut cl).await;
    let since = service(&st, "N1").new_since_ms;
    let peer = service(&st, "peer:127.88.4.1:8080");
    assert!(!peer.in_slow_start && peer.health == "UP", "{peer:?}");
    for n in ["N1", "N2"] {
        assert!(service(&st, n).in_slow_start, "{n}: new on a joining node");
    }

    // The model: the own services, new, and one existing pseudo-service for the
    // peer of weight Σ own weights × 1 peer; the AZ's rate is the node's × 2.
    let mut p = plan(&["peers"], 12, Unit::PerSecond, INTERVAL_S);
    p.services[0].weight = 2;
    p.add_service("N1", 1, since);
    p.add_service("N2", 1, since);
    let own = [("N1", &n1), ("N2", &n2)];
    let mut check = Check::default();
    // 0, 12, 24 req/s each, then the cap (36) is past the full share (30): over.
    run_steps(
        &mut cl,
        &clock,
        since,
        4,
        &mut p,
        &own,
        &[&o1, &o2],
        &["N1", "N2"],
        &mut check,
    )
    .await;
    let st = stats(&mut cl).await;
    assert!(
        !st.services.iter().any(|s| s.service.starts_with("peer:")),
        "after the ramp the peer is no longer used: {:?}",
        st.services
    );
    let old_total: u64 = stats(&mut old)
        .await
        .services
        .iter()
        .map(|s| s.requests_total)
        .sum();
    let forwarded = o1.hits() + o2.hits();
    assert_eq!(
        old_total, forwarded,
        "the old node served exactly what was forwarded to it"
    );
    let errors = load.finish().await;
    check.done("a_joining_node_ramps_against_its_peer", errors);
}

/// (d, late clients) A joining node's ramp starts with its first request: clients
/// find it only once the distributor hands out its address, and a ramp that ran
/// (or ended, for a full share of 0) while nobody came would not ramp anything.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_joining_nodes_ramp_waits_for_its_first_client() {
    let o1 = http_backend("127.88.6.11:8001", "O1").await;
    let n1 = http_backend("127.88.6.21:8001", "N1").await;
    let ss = slow_start(12, SlowStartUnit::PerSecond, INTERVAL_S);
    let (_old, _) = start_serve("ss-late-old", "127.88.6.1", &[]);
    let mut old = api_client("127.88.6.1").await;
    configure(&mut old, 1, vserver(vec![svc("O1", &o1)], ss, vec![])).await;
    let (_new, _) = start_serve("ss-late-new", "127.88.6.2", &[]);
    let mut cl = api_client("127.88.6.2").await;
    configure(
        &mut cl,
        1,
        vserver(vec![svc("N1", &n1)], ss, vec!["127.88.6.1".into()]),
    )
    .await;
    // Three increment intervals without a client.
    tokio::time::sleep(Duration::from_millis(3 * 1000 * INTERVAL_S as u64 + 300)).await;
    let st = stats(&mut cl).await;
    let n = service(&st, "N1");
    assert!(
        n.in_slow_start && n.cap_per_second == 0.0,
        "no client yet: the ramp has not started ({n:?})"
    );
    // The first clients: the ramp starts from cap 0, the rest goes to the peer.
    let load = start_load("127.88.6.2:8080", 40.0);
    tokio::time::sleep(Duration::from_millis(1000 * INTERVAL_S as u64 / 2)).await;
    let st = stats(&mut cl).await;
    assert!(service(&st, "N1").in_slow_start, "{:?}", st.services);
    assert!(
        o1.hits() > 0,
        "what the new service may not take yet goes to the older node"
    );
    let errors = load.finish().await;
    assert_eq!(errors, 0);
}

/// (d, TCP) A joining node forwards the connections its own service may not take
/// yet to its peer (TCP to the peer's vserver port); manual slow start holds the
/// ramp until a Configure releases it, which ends the join ramp.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_joining_tcp_node_forwards_connections_to_its_peer() {
    let o = tcp_backend("127.88.5.11:9001", "O").await;
    let n = tcp_backend("127.88.5.21:9001", "N").await;
    let tcp_vs = |s: Service, ss: Option<SlowStart>, peers: Vec<String>| Vserver {
        service_type: ServiceType::Tcp as i32,
        port: 9000,
        ..vserver(vec![s], ss, peers)
    };
    let (_old, _) = start_serve("ss-old-tcp", "127.88.5.1", &[]);
    let mut old = api_client("127.88.5.1").await;
    configure(&mut old, 1, tcp_vs(svc("O", &o), None, vec![])).await;
    let (_new, _) = start_serve("ss-new-tcp", "127.88.5.2", &[]);
    let mut cl = api_client("127.88.5.2").await;
    let held = slow_start(5, SlowStartUnit::PerSecond, 0);
    configure(
        &mut cl,
        1,
        tcp_vs(svc("N", &n), held, vec!["127.88.5.1".into()]),
    )
    .await;
    let connect = || async {
        let mut s = tokio::net::TcpStream::connect("127.88.5.2:9000")
            .await
            .expect("connect to the new node");
        let mut line = Vec::new();
        let mut byte = [0u8; 1];
        while tokio::io::AsyncReadExt::read(&mut s, &mut byte)
            .await
            .unwrap_or(0)
            == 1
            && byte[0] != b'\n'
        {
            line.push(byte[0]);
        }
        String::from_utf8_lossy(&line).to_string()
    };
    // 20 connections per second for 2 s, each reads the backend's greeting.
    let window = |label: &'static str| async move {
        let mut tasks = Vec::new();
        let mut tick = tokio::time::interval(Duration::from_millis(50));
        for _ in 0..40 {
            tick.tick().await;
            tasks.push(tokio::spawn(connect()));
        }
        let mut got = (0, 0);
        for t in tasks {
            match t.await.unwrap().as_str() {
                "N" => got.0 += 1,
                "O" => got.1 += 1,
                other => panic!("{label}: greeting {other:?}"),
            }
        }
        got
    };
    // Held at 5 connections/s, the rest through the peer.
    let (own, fwd) = window("held").await;
    let st = stats(&mut cl).await;
    assert!(
        service(&st, "N").in_slow_start && service(&st, "N").cap_per_second == 5.0,
        "{:?}",
        st.services
    );
    assert_eq!(
        service(&st, "peer:127.88.5.1:9000").requests_total,
        fwd,
        "forwarded connections are counted"
    );
    // The model: N new, the peer's pseudo-service (weight 1 × 1 peer) existing, the
    // AZ's rate twice the node's 20 connections/s; over the 2 s window.
    let mut p = plan(&["peers"], 5, Unit::PerSecond, 0);
    p.add_service("N", 1, 0);
    p.request_rate = 2.0 * 20.0;
    p.advance(0);
    let want = p.rates(0)[1] * 2.0;
    eprintln!("tcp join held: own {own} forwarded {fwd} of 40 (model: own {want:.1})");
    assert!(
        (own as f64 - want).abs() <= 3.0 && own + fwd == 40,
        "held: own {own} (model {want:.1}), forwarded {fwd}"
    );

    // Released: the ramp is over, the node serves every connection itself.
    configure(
        &mut cl,
        2,
        tcp_vs(
            svc("N", &n),
            slow_start(0, SlowStartUnit::PerSecond, 0),
            vec![],
        ),
    )
    .await;
    let (own, fwd) = window("released").await;
    eprintln!("tcp join released: own {own} forwarded {fwd} of 40");
    assert_eq!((own, fwd), (40, 0), "after the ramp the peer is not used");
    let st = stats(&mut cl).await;
    assert!(!st.services.iter().any(|s| s.service.starts_with("peer:")));
}

/// A joining node whose ramp peers have gone (nodes deleted a moment before, as
/// a rolling restart does, and not yet marked DOWN by their health checks) serves
/// every request and connection with its own service, over its slow-start cap,
/// instead of failing them: a refused peer is followed by an own service, never
/// by another peer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gone_ramp_peers_never_fail_a_request() {
    let web = http_backend("127.88.8.21:8001", "N1").await;
    let echo = tcp_backend("127.88.8.21:9001", "N").await;
    // Nothing listens on these nodes' vserver ports: every connection is refused.
    let peers = vec!["127.88.8.1".to_string(), "127.88.8.3".to_string()];
    let ss = slow_start(1, SlowStartUnit::PerSecond, INTERVAL_S);
    let (_node, _) = start_serve("ss-gone-peers", "127.88.8.2", &[]);
    let mut cl = api_client("127.88.8.2").await;
    let tcp = Vserver {
        name: "tcp".into(),
        service_type: ServiceType::Tcp as i32,
        port: 9000,
        ..vserver(vec![svc("N", &echo)], ss, peers.clone())
    };
    tokio::time::timeout(
        Duration::from_secs(5),
        cl.configure(NodeConfig {
            version: 1,
            group_peers: Vec::new(),
            fence: 0,
            vservers: vec![vserver(vec![svc("N1", &web)], ss, peers), tcp],
        }),
    )
    .await
    .expect("Configure within 5 s")
    .expect("Configure accepted");
    let st = stats(&mut cl).await;
    let peer = service(&st, "peer:127.88.8.1:8080");
    assert!(peer.health == "UP", "the peers are not DOWN yet: {peer:?}");

    // Well inside the three failed probes (3 s) that take a peer DOWN.
    for i in 0..20 {
        let r = http_get("127.88.8.2:8080", "/").await;
        assert_eq!(
            (r.status, String::from_utf8_lossy(&r.body).trim()),
            (200, "N1"),
            "request {i}"
        );
        let mut s = tokio::net::TcpStream::connect("127.88.8.2:9000")
            .await
            .expect("connect to the TCP vserver");
        let mut greeting = [0u8; 2];
        tokio::time::timeout(
            Duration::from_secs(5),
            tokio::io::AsyncReadExt::read_exact(&mut s, &mut greeting),
        )
        .await
        .unwrap_or_else(|_| panic!("connection {i}: no greeting within 5 s"))
        .unwrap_or_else(|e| panic!("connection {i}: closed without the service: {e}"));
        assert_eq!(&greeting, b"N\n", "connection {i}");
    }
    let st = stats(&mut cl).await;
    let refused: u64 = st
        .services
        .iter()
        .filter(|s| s.service.starts_with("peer:"))
        .map(|s| s.requests_total)
        .sum();
    assert!(refused > 0, "the peers were tried first: {:?}", st.services);
}
