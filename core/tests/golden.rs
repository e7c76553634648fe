//! The reference cases of docs/design.md (section 7), as the project's own test data.
//!
//! G1 is checked tick by tick in both its DNS and NLB forms from the JSON inputs in
//! `tests/data/` (the same files the CLI tests feed to `lbscale simulate`).

use std::path::Path;

use lbscale_core::policy::{Decision, EventKind, PhaseKind};
use lbscale_core::simulate::{simulate_json, SimOutput};

fn load(name: &str) -> serde_json::Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data")
        .join(name);
    let text = std::fs::read_to_string(&path).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// `(first tick, last tick, phase, serving, provisioned, action)`, ticks in minutes.
type Span = (u64, u64, PhaseKind, u32, u32, Option<Decision>);

fn expand(spans: &[Span]) -> Vec<(u64, PhaseKind, u32, u32, Option<Decision>)> {
    spans
        .iter()
        .flat_map(|&(a, b, p, s, n, d)| (a..=b).map(move |m| (m * 60, p, s, n, d)))
        .collect()
}

fn ticks_of(out: &SimOutput) -> Vec<(u64, PhaseKind, u32, u32, Option<Decision>)> {
    out.ticks
        .iter()
        .map(|r| {
            assert_eq!(r.az, "az1");
            (r.t.0 / 1000, r.phase, r.serving, r.provisioned, r.action)
        })
        .collect()
}

fn events_of(out: &SimOutput) -> Vec<(u64, EventKind, String)> {
    out.events
        .iter()
        .map(|e| (e.t.0 / 1000, e.kind, e.reason.clone()))
        .collect()
}

use Decision::{ScaleIn, ScaleOut};
use PhaseKind::{Cooldown, Deprovisioning, Draining, Evaluating, Ttl};

/// The part of G1 both forms share: T1–T20.
fn g1_common() -> Vec<Span> {
    vec![
        // T1, T2 breach; T3 breaks the streak; T4, T5 breach again.
        (1, 5, Evaluating, 1, 1, None),
        // T6: the third consecutive breach: scale-out, node provisioned and joined.
        (6, 6, Evaluating, 2, 2, Some(ScaleOut)),
        // T7–T16: cooldown (the samples there are 95 and must not be evaluated).
        (7, 16, Cooldown, 2, 2, None),
        // T17 evaluated, nothing fires; T18, T19 below min.
        (17, 19, Evaluating, 2, 2, None),
        // T20: third sample below min: scale-in; the address leaves the distributor.
        (20, 20, Evaluating, 1, 2, Some(ScaleIn)),
    ]
}

#[test]
fn g1_dns_tick_by_tick() {
    let out = simulate_json(&load("g1_dns.json")).unwrap();
    let mut spans = g1_common();
    spans.extend([
        // TTL first (T21), then the full drain timeout (T22–T31).
        (21, 21, Ttl, 1, 2, None),
        (22, 31, Draining, 1, 2, None),
        // The wait ended at T31: the node is deprovisioned at T32.
        (32, 32, Deprovisioning, 1, 1, None),
        // Evaluation resumes at the tick after the node is gone; no cooldown.
        (33, 33, Evaluating, 1, 1, None),
    ]);
    assert_eq!(ticks_of(&out), expand(&spans));
    assert_eq!(
        events_of(&out),
        vec![
            (
                360,
                EventKind::ScaleOut,
                "memory 90 > 85 for 3 samples [node az1-2]".into()
            ),
            (
                360,
                EventKind::NodeActive,
                "new node joined the cluster and the distributor; 2 serving [node az1-2]".into()
            ),
            (
                960,
                EventKind::CooldownEnd,
                "cooldown of 600s ended; evaluation resumes at the next tick".into()
            ),
            (
                1200,
                EventKind::ScaleIn,
                "memory 30 < 40 for 3 samples [node az1-2]".into()
            ),
            (
                1260,
                EventKind::TtlEnd,
                "DNS TTL of 60s waited; resolvers no longer hand out the address [node az1-2]"
                    .into()
            ),
            (
                1860,
                EventKind::DrainEnd,
                "drain timeout of 600s reached [node az1-2]".into()
            ),
            (
                1920,
                EventKind::DeprovisionStart,
                "detaching, deregistering and deleting the node [node az1-2]".into()
            ),
            (
                1920,
                EventKind::NodeRemoved,
                "node deleted; 1 left in the cloud [node az1-2]".into()
            ),
        ]
    );
}

#[test]
fn g1_nlb_tick_by_tick() {
    let out = simulate_json(&load("g1_nlb.json")).unwrap();
    let mut spans = g1_common();
    spans.extend([
        // No TTL: the drain covers T21–T30.
        (21, 30, Draining, 1, 2, None),
        // Deprovisioned at T31, evaluation resumes at T32.
        (31, 31, Deprovisioning, 1, 1, None),
        (32, 33, Evaluating, 1, 1, None),
    ]);
    assert_eq!(ticks_of(&out), expand(&spans));
    let kinds: Vec<(u64, EventKind)> = out.events.iter().map(|e| (e.t.0 / 1000, e.kind)).collect();
    assert_eq!(
        kinds,
        vec![
            (360, EventKind::ScaleOut),
            (360, EventKind::NodeActive),
            (960, EventKind::CooldownEnd),
            (1200, EventKind::ScaleIn),
            (1800, EventKind::DrainEnd),
            (1860, EventKind::DeprovisionStart),
            (1860, EventKind::NodeRemoved),
        ]
    );
}

/// G1's note: the order inside the wait (TTL then drain) changes no observable time,
/// but a drain that ends early must still follow the TTL: with connections gone two
/// minutes into the drain, DNS deprovisions at T24 (TTL T21, drain to T23).
#[test]
fn g1_dns_with_connections_draining_early() {
    let mut doc = load("g1_dns.json");
    doc["connections_drain_after"] = serde_json::json!("2m");
    let out = simulate_json(&doc).unwrap();
    let phases: Vec<(u64, PhaseKind)> = ticks_of(&out)
        .into_iter()
        .filter(|r| (20..=26).contains(&(r.0 / 60)))
        .map(|r| (r.0 / 60, r.1))
        .collect();
    assert_eq!(
        phases,
        vec![
            (20, Evaluating),
            (21, Ttl),
            (22, Draining),
            (23, Draining),
            (24, Deprovisioning),
            (25, Evaluating),
            (26, Evaluating),
        ]
    );
    let drain = out
        .events
        .iter()
        .find(|e| e.kind == EventKind::DrainEnd)
        .unwrap();
    assert_eq!(drain.t.0, 1_380_000);
    assert!(drain.reason.starts_with("no connections left"));
}

use lbscale_core::seplan::{self, PlanParams, ScalingMode};
use lbscale_core::slowstart::{self, read_back, Unit};

/// `(t seconds, [rate of each service in binding order], [services in slow start])`.
type SlowRow = (u64, Vec<f64>, Vec<&'static str>);

fn slow_rows(file: &str) -> Vec<(u64, Vec<f64>, Vec<String>)> {
    let out = slowstart::simulate_json(&load(file)).unwrap();
    out.rows
        .iter()
        .map(|r| {
            let total: f64 = r.rates.0.iter().map(|(_, v)| v).sum();
            let expected_total = if file.starts_with("g2") { 240.0 } else { 100.0 };
            assert!(
                (total - expected_total).abs() < 0.01,
                "{file} t={}: {total}",
                r.t.0
            );
            (
                r.t.0 / 1000,
                r.rates.0.iter().map(|(_, v)| *v).collect(),
                r.slow_start.clone(),
            )
        })
        .collect()
}

fn expect_rows(file: &str, expected: Vec<SlowRow>) {
    let expected: Vec<(u64, Vec<f64>, Vec<String>)> = expected
        .into_iter()
        .map(|(t, r, s)| (t, r, s.into_iter().map(String::from).collect()))
        .collect();
    assert_eq!(slow_rows(file), expected);
}

#[test]
fn g2_manual_slow_start_round_robin() {
    expect_rows(
        "g2_manual.json",
        vec![
            (0, vec![115.0, 115.0, 10.0], vec!["Service3"]),
            (10, vec![110.0, 110.0, 20.0], vec!["Service3"]),
            (
                20,
                vec![80.0, 80.0, 40.0, 40.0],
                vec!["Service3", "Service4"],
            ),
            (30, vec![60.0, 60.0, 60.0, 60.0], vec![]),
        ],
    );
}

#[test]
fn g3_automatic_per_second() {
    let s = |x: f64, s5: f64| vec![x, x, x, x, s5];
    expect_rows(
        "g3_per_second.json",
        vec![
            (0, s(25.0, 0.0), vec!["Service5"]),
            (10, s(24.0, 4.0), vec!["Service5"]),
            (20, s(23.0, 8.0), vec!["Service5"]),
            (30, s(22.0, 12.0), vec!["Service5"]),
            (40, s(21.0, 16.0), vec!["Service5"]),
            // Leaves slow start at 50 s and keeps its normal share.
            (50, s(20.0, 20.0), vec![]),
            (60, s(20.0, 20.0), vec![]),
        ],
    );
}

#[test]
fn g3_automatic_percent() {
    // 25 %, 50 %, 75 % of one existing service's load, then full share at 20 s:
    // existing services get 100 / (4 + p/100).
    let row = |p: f64| {
        let each = 100.0 / (4.0 + p / 100.0);
        let r = |x: f64| (x * 1000.0).round() / 1000.0;
        let e = r(each);
        vec![e, e, e, e, r(each * p / 100.0)]
    };
    expect_rows(
        "g3_percent.json",
        vec![
            (0, row(0.0), vec!["Service5"]),
            (5, row(25.0), vec!["Service5"]),
            (10, row(50.0), vec!["Service5"]),
            (15, row(75.0), vec!["Service5"]),
            (20, vec![20.0; 5], vec![]),
            (25, vec![20.0; 5], vec![]),
        ],
    );
    assert_eq!(row(25.0)[4], 5.882);
}

#[test]
fn g4_native_scale_out_ceiling() {
    let params = PlanParams::default();
    assert_eq!(params.forwarding_cost, 0.3);
    let caps: Vec<f64> = (1..=4).map(|n| seplan::plan(&params, n).capacity).collect();
    for (got, want) in caps.iter().zip([1.0, 1.7, 2.4, 3.1]) {
        assert!((got - want).abs() < 1e-9, "{caps:?}");
    }
    let four = seplan::plan(&params, 4);
    let rounded: Vec<f64> = four
        .shares
        .iter()
        .map(|s| (s * 1000.0).round() / 1000.0)
        .collect();
    assert_eq!(rounded, vec![0.032, 0.323, 0.323, 0.323]);
    // A 5th node adds only a marginal gain (the primary's forwarding ceiling 1/f).
    let five = seplan::plan(&params, 5).capacity;
    assert!(five - four.capacity < 0.25 && five > four.capacity);
    // BGP has no primary bottleneck.
    let bgp = PlanParams {
        mode: ScalingMode::Bgp,
        ..params
    };
    assert_eq!(seplan::plan(&bgp, 4).capacity, 4.0);
    assert_eq!(seplan::plan(&bgp, 4).shares, vec![0.25; 4]);
}

#[test]
fn g5_read_back() {
    assert_eq!(
        read_back(5, Unit::PerSecond, 10),
        "New Service Startup Request Rate: 5 PER_SECOND, Increment Interval: 10"
    );
}
