//! Slow start enforced by the data plane (issue 5, point 2): real HTTP traffic at a
//! fixed rate through `lbscale-node serve`, caps set through `Configure` exactly as
//! the engine computes them (`lbscale_core::slowstart`), and the requests each
//! service receives compared with the plan, per service per step, within 5 %.
//!
//! The engine's time is compressed: each step of reference cases G2/G3
//! (docs/design.md) is applied for a few seconds, with explicit caps (`cap_per_second`, which overrides the node's own
//! slow start; `Some(0)` holds a new service at no requests before its first
//! increment). The node's own slow start, from the vserver's settings, is tested in
//! `node_slowstart.rs`.
//!
//! Rates are measured from the backends' arrival times inside each step's window
//! (after a settling time): a service expecting at least 50 requests in the window
//! is measured as `n / window`; one expecting fewer (a low cap: 4 req/s for 3 s)
//! as `(n - 1) / (last - first)`, which does not suffer from the ±1 request
//! quantisation of counting a low-rate stream in a short window (a token bucket
//! spaces its requests regularly).

mod common;

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use common::*;
use lbscale_core::slowstart::{
    LbMethod as PlanMethod, Service as PlanService, SlowStartConfig, Unit, Vserver as Plan,
};
use lbscale_proto::{LbMethod, NodeConfig, Service, ServiceType, Vserver};

const SETTLE: Duration = Duration::from_millis(600);

/// One step: the plan's caps become the node's configuration.
fn node_config(
    version: u64,
    port: u16,
    plan: &Plan,
    t: u64,
    backends: &[(&str, &HttpBackend)],
) -> NodeConfig {
    let caps = plan.caps(t);
    let services = plan
        .services
        .iter()
        .zip(caps)
        .map(|(s, cap)| {
            let b = backends.iter().find(|(n, _)| *n == s.name).unwrap().1;
            Service {
                name: s.name.clone(),
                address: b.addr.ip().to_string(),
                port: b.addr.port() as u32,
                weight: s.weight,
                enabled: true,
                cap_per_second: cap,
                custom_load: None,
            }
        })
        .collect();
    NodeConfig {
        version,
        group_peers: Vec::new(),
        fence: 0,
        vservers: vec![Vserver {
            name: "web".into(),
            service_type: ServiceType::Http as i32,
            port: port as u32,
            lb_method: LbMethod::Roundrobin as i32,
            persistence: "NONE".into(),
            services,
            slow_start: None,
            scaleout: None,
            ramp_peers: vec![],
            ..Default::default()
        }],
    }
}

/// Rate received by a backend between `from` and `to`, from its arrival times
/// (see the module doc for the two estimators).
fn measured_rate(b: &HttpBackend, from: Instant, to: Instant, planned: f64) -> (f64, usize) {
    let st = b.stamps.lock().unwrap();
    let w: Vec<Instant> = st
        .iter()
        .copied()
        .filter(|t| *t >= from && *t < to)
        .collect();
    let window = (to - from).as_secs_f64();
    if planned * window >= 50.0 {
        return (w.len() as f64 / window, w.len());
    }
    if w.len() < 2 {
        return (0.0, w.len());
    }
    let span = (w[w.len() - 1] - w[0]).as_secs_f64();
    ((w.len() - 1) as f64 / span, w.len())
}

fn plan_service(name: &str) -> PlanService {
    PlanService {
        name: name.into(),
        weight: 1,
        ramp: None,
    }
}

/// A step of the scenario: at engine time `t` (ms) apply `change` to the plan.
type Change = Box<dyn Fn(&mut Plan, u64)>;

/// Runs the scenario through a node at `ip` and checks every step. `golden` is the
/// table of docs/design.md (rates per service, binding order) the plan must reproduce.
async fn run_scenario(
    name: &str,
    ip: &'static str,
    vip: &'static str,
    mut plan: Plan,
    backends: &[(&str, &HttpBackend)],
    steps: Vec<(u64, Change, Duration, Vec<f64>)>,
) {
    let _node = start_serve(name, ip, &[]).0;
    let mut cl = api_client(ip).await;
    let port: u16 = vip.rsplit(':').next().unwrap().parse().unwrap();
    let mut load: Option<Load> = None;
    let mut failures = Vec::new();
    let mut report = String::new();
    // What the engine observed in the previous step (it feeds the ramps' quiet rule).
    let mut got_traffic: Vec<bool> = Vec::new();
    for (k, (t, change, dur, golden)) in steps.into_iter().enumerate() {
        plan.record_traffic(&got_traffic);
        change(&mut plan, t);
        plan.advance(t);
        let rates = plan.rates(t);
        assert_eq!(rates.len(), golden.len(), "{name} t={t}: services");
        for (r, g) in rates.iter().zip(&golden) {
            assert!(
                (r - g).abs() < 0.01,
                "{name} t={t}: the engine's plan {rates:?} is not the reference case's {golden:?}"
            );
        }
        let cfg = node_config(k as u64 + 1, port, &plan, t, backends);
        tokio::time::timeout(Duration::from_secs(5), cl.configure(cfg))
            .await
            .expect("Configure within 5 s")
            .expect("Configure accepted");
        if load.is_none() {
            load = Some(start_load(vip, plan.request_rate));
        }
        let from = Instant::now() + SETTLE;
        tokio::time::sleep(SETTLE + dur).await;
        let to = Instant::now();
        got_traffic.clear();
        for ((s, want), cap) in plan.services.iter().zip(&rates).zip(plan.caps(t)) {
            let b = backends.iter().find(|(n, _)| *n == s.name).unwrap().1;
            let (got, n) = measured_rate(b, from, to, *want);
            got_traffic.push(n > 0);
            report.push_str(&format!(
                "{name} t={:>2}s {:<9} cap {:>6} planned {:>7.3} got {:>7.3} req/s ({n} requests)\n",
                t / 1000,
                s.name,
                cap.map(|c| format!("{c:.2}")).unwrap_or_else(|| "-".into()),
                want,
                got
            ));
            let ok = if *want == 0.0 {
                n == 0
            } else {
                (got - want).abs() <= 0.05 * want
            };
            if !ok {
                failures.push(format!(
                    "t={}s {}: planned {want:.3}, got {got:.3} req/s",
                    t / 1000,
                    s.name
                ));
            }
        }
    }
    let load = load.unwrap();
    load.stop.store(true, Ordering::Relaxed);
    tokio::time::timeout(Duration::from_secs(5), load.task)
        .await
        .expect("load generator stops within 5 s")
        .unwrap();
    eprint!("{report}");
    assert_eq!(
        load.errors.load(Ordering::Relaxed),
        0,
        "{name}: failed requests"
    );
    assert!(
        failures.is_empty(),
        "{name}: off the plan by more than 5 %:\n{}\n{report}",
        failures.join("\n")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn g2_manual_slow_start_follows_the_plan() {
    let s1 = http_backend("127.80.1.11:8001", "Service1").await;
    let s2 = http_backend("127.80.1.12:8001", "Service2").await;
    let s3 = http_backend("127.80.1.13:8001", "Service3").await;
    let s4 = http_backend("127.80.1.14:8001", "Service4").await;
    let backends = [
        ("Service1", &s1),
        ("Service2", &s2),
        ("Service3", &s3),
        ("Service4", &s4),
    ];
    let plan = Plan {
        lb_method: PlanMethod::RoundRobin,
        request_rate: 240.0,
        slow_start: SlowStartConfig {
            new_service_request: 10,
            unit: Unit::PerSecond,
            increment_interval: 0,
        },
        services: vec![plan_service("Service1"), plan_service("Service2")],
    };
    let d = Duration::from_millis(3500);
    let steps: Vec<(u64, Change, Duration, Vec<f64>)> = vec![
        (
            0,
            Box::new(|p: &mut Plan, t| p.add_service("Service3", 1, t)),
            d,
            vec![115.0, 115.0, 10.0],
        ),
        (
            10_000,
            Box::new(|p: &mut Plan, _| p.slow_start.new_service_request = 20),
            d,
            vec![110.0, 110.0, 20.0],
        ),
        (
            20_000,
            Box::new(|p: &mut Plan, t| {
                p.slow_start.new_service_request = 40;
                p.add_service("Service4", 1, t);
            }),
            d,
            vec![80.0, 80.0, 40.0, 40.0],
        ),
        (
            30_000,
            Box::new(|p: &mut Plan, _| p.slow_start.new_service_request = 0),
            d,
            vec![60.0; 4],
        ),
    ];
    run_scenario(
        "g2",
        "127.80.1.1",
        "127.80.1.1:8080",
        plan,
        &backends,
        steps,
    )
    .await;
}

fn g3_plan(nsr: u32, unit: Unit, interval: u32) -> Plan {
    Plan {
        lb_method: PlanMethod::RoundRobin,
        request_rate: 100.0,
        slow_start: SlowStartConfig {
            new_service_request: nsr,
            unit,
            increment_interval: interval,
        },
        services: (1..=4)
            .map(|i| plan_service(&format!("Service{i}")))
            .collect(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn g3_automatic_per_second_follows_the_plan() {
    let s: Vec<HttpBackend> = futures_join([
        "127.80.2.11:8001",
        "127.80.2.12:8001",
        "127.80.2.13:8001",
        "127.80.2.14:8001",
        "127.80.2.15:8001",
    ])
    .await;
    let names = ["Service1", "Service2", "Service3", "Service4", "Service5"];
    let backends: Vec<(&str, &HttpBackend)> = names.iter().copied().zip(s.iter()).collect();
    let row = |x: f64, s5: f64| vec![x, x, x, x, s5];
    let nothing = || -> Change { Box::new(|_: &mut Plan, _| {}) };
    let d = Duration::from_millis(3000);
    let steps: Vec<(u64, Change, Duration, Vec<f64>)> = vec![
        (
            0,
            Box::new(|p: &mut Plan, t| p.add_service("Service5", 1, t)),
            Duration::from_millis(2000),
            row(25.0, 0.0),
        ),
        (10_000, nothing(), d, row(24.0, 4.0)),
        (20_000, nothing(), d, row(23.0, 8.0)),
        (30_000, nothing(), d, row(22.0, 12.0)),
        (40_000, nothing(), d, row(21.0, 16.0)),
        (
            50_000,
            nothing(),
            Duration::from_millis(2500),
            row(20.0, 20.0),
        ),
    ];
    run_scenario(
        "g3s",
        "127.80.2.1",
        "127.80.2.1:8080",
        g3_plan(4, Unit::PerSecond, 10),
        &backends,
        steps,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn g3_automatic_percent_follows_the_plan() {
    let s: Vec<HttpBackend> = futures_join([
        "127.80.3.11:8001",
        "127.80.3.12:8001",
        "127.80.3.13:8001",
        "127.80.3.14:8001",
        "127.80.3.15:8001",
    ])
    .await;
    let names = ["Service1", "Service2", "Service3", "Service4", "Service5"];
    let backends: Vec<(&str, &HttpBackend)> = names.iter().copied().zip(s.iter()).collect();
    let row = |p: f64| {
        let each = 100.0 / (4.0 + p / 100.0);
        vec![each, each, each, each, each * p / 100.0]
    };
    let nothing = || -> Change { Box::new(|_: &mut Plan, _| {}) };
    let d = Duration::from_millis(3000);
    let steps: Vec<(u64, Change, Duration, Vec<f64>)> = vec![
        (
            0,
            Box::new(|p: &mut Plan, t| p.add_service("Service5", 1, t)),
            Duration::from_millis(2000),
            row(0.0),
        ),
        (5_000, nothing(), d, row(25.0)),
        (10_000, nothing(), d, row(50.0)),
        (15_000, nothing(), d, row(75.0)),
        (
            20_000,
            nothing(),
            Duration::from_millis(2500),
            vec![20.0; 5],
        ),
    ];
    run_scenario(
        "g3p",
        "127.80.3.1",
        "127.80.3.1:8080",
        g3_plan(25, Unit::Percent, 5),
        &backends,
        steps,
    )
    .await;
}

async fn futures_join<const N: usize>(addrs: [&str; N]) -> Vec<HttpBackend> {
    let names: [&'static str; 5] = ["Service1", "Service2", "Service3", "Service4", "Service5"];
    let mut v = Vec::new();
    for (i, a) in addrs.iter().enumerate() {
        v.push(http_backend(a, names[i % 5]).await);
    }
    v
}
