//! The `phase` of a tick row when a wait ends between two ticks (docs/cli.md: "what the
//! AZ was doing at that tick").
//!
//! Rule: a tick is labelled `evaluating` when its statistics were evaluated;
//! otherwise with the phase in force once every wait that ended strictly before the
//! tick has been processed. A wait that ends exactly on a tick still labels that tick
//! (G1: the step after it runs at the next tick), and work done at the tick itself
//! (activating a node, requesting a deletion, a deletion finished at the tick) keeps
//! the label of the phase it leaves. So a tick is never labelled with a wait that had
//! already ended before it.

use std::collections::HashMap;
use std::path::Path;
use std::time::Duration;

use lbscale_core::policy::{
    Band, Decision, Distributor, EventKind, Metric, PhaseKind, PolicyConfig, Sample, Thresholds,
};
use lbscale_core::simulate::{simulate, simulate_json, CloudModel, SimInput, SimOutput};
use proptest::prelude::*;

use Decision::{ScaleIn, ScaleOut};
use PhaseKind::{Cooldown, Deprovisioning, Draining, Evaluating, Provisioning, Ttl};

fn load(name: &str) -> serde_json::Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data")
        .join(name);
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

type Row = (u64, PhaseKind, u32, u32, Option<Decision>);

/// `(first minute, last minute, phase, serving, provisioned, action)`.
type Span = (u64, u64, PhaseKind, u32, u32, Option<Decision>);

fn expand(spans: &[Span]) -> Vec<Row> {
    spans
        .iter()
        .flat_map(|&(a, b, p, s, n, d)| (a..=b).map(move |m| (m * 60, p, s, n, d)))
        .collect()
}

fn ticks_of(out: &SimOutput) -> Vec<Row> {
    out.ticks
        .iter()
        .map(|r| (r.t.0 / 1000, r.phase, r.serving, r.provisioned, r.action))
        .collect()
}

/// Events from the scale-in (T20) on, `(seconds, kind)`.
fn late_events(out: &SimOutput) -> Vec<(u64, EventKind)> {
    out.events
        .iter()
        .filter(|e| e.t.0 >= 1_200_000)
        .map(|e| (e.t.0 / 1000, e.kind))
        .collect()
}

/// G1's T1–T20, which none of the variants below changes.
fn g1_common() -> Vec<Span> {
    vec![
        (1, 5, Evaluating, 1, 1, None),
        (6, 6, Evaluating, 2, 2, Some(ScaleOut)),
        (7, 16, Cooldown, 2, 2, None),
        (17, 19, Evaluating, 2, 2, None),
        (20, 20, Evaluating, 1, 2, Some(ScaleIn)),
    ]
}

/// DNS with a 30 s TTL: scale-in at 1200, TTL ends at 1230, drain 1230–1830. At
/// T21 (1260) the TTL is over: `draining`, not `ttl`. At T31 (1860) the drain is
/// over (1830) and the node is deleted at once: `deprovisioning` with 1 node left,
/// not `draining`. Evaluation resumes at T32.
#[test]
fn dns_ttl_ending_between_ticks() {
    let mut doc = load("g1_dns.json");
    doc["group"]["dns_ttl"] = serde_json::json!("30s");
    let out = simulate_json(&doc).unwrap();
    let mut spans = g1_common();
    spans.extend([
        (21, 30, Draining, 1, 2, None),
        (31, 31, Deprovisioning, 1, 1, None),
        // T32 (95) and T33 (50) are evaluated; nothing fires.
        (32, 33, Evaluating, 1, 1, None),
    ]);
    assert_eq!(ticks_of(&out), expand(&spans));
    assert_eq!(
        late_events(&out),
        vec![
            (1200, EventKind::ScaleIn),
            (1230, EventKind::TtlEnd),
            (1830, EventKind::DrainEnd),
            (1860, EventKind::DeprovisionStart),
            (1860, EventKind::NodeRemoved),
        ]
    );
    let ttl = out
        .events
        .iter()
        .find(|e| e.kind == EventKind::TtlEnd)
        .unwrap();
    assert!(
        ttl.reason.starts_with("DNS TTL of 30s waited"),
        "{}",
        ttl.reason
    );
}

/// NLB whose leaving node has no connections 150 s into the drain: the drain ends at
/// 1350, between T22 and T23; T23 (1380) deletes the node: `deprovisioning` with 1
/// node, not `draining`. Evaluation resumes at T24; the 95s of T24–T26 scale out at
/// T26, and a 10 min cooldown follows (to 2160, past `until`).
#[test]
fn nlb_drain_ending_early_between_ticks() {
    let mut doc = load("g1_nlb.json");
    doc["connections_drain_after"] = serde_json::json!("150s");
    let out = simulate_json(&doc).unwrap();
    let mut spans = g1_common();
    spans.extend([
        (21, 22, Draining, 1, 2, None),
        (23, 23, Deprovisioning, 1, 1, None),
        (24, 25, Evaluating, 1, 1, None),
        (26, 26, Evaluating, 2, 2, Some(ScaleOut)),
        (27, 33, Cooldown, 2, 2, None),
    ]);
    assert_eq!(ticks_of(&out), expand(&spans));
    assert_eq!(
        late_events(&out),
        vec![
            (1200, EventKind::ScaleIn),
            (1350, EventKind::DrainEnd),
            (1380, EventKind::DeprovisionStart),
            (1380, EventKind::NodeRemoved),
            (1560, EventKind::ScaleOut),
            (1560, EventKind::NodeActive),
        ]
    );
    let drain = out
        .events
        .iter()
        .find(|e| e.kind == EventKind::DrainEnd)
        .unwrap();
    assert!(
        drain.reason.starts_with("no connections left"),
        "{}",
        drain.reason
    );
}

/// NLB with a 90 s deletion: the drain ends on T30, deletion is requested at T31
/// (1860) and the node is gone at 1950, between T32 and T33. T31 and T32 are
/// `deprovisioning` with the node still in the cloud; T33 is evaluated (the node
/// left before it) with 1 node.
#[test]
fn nlb_deletion_ending_between_ticks() {
    let mut doc = load("g1_nlb.json");
    doc["cloud"]["deprovision_time"] = serde_json::json!("90s");
    let out = simulate_json(&doc).unwrap();
    let mut spans = g1_common();
    spans.extend([
        (21, 30, Draining, 1, 2, None),
        (31, 32, Deprovisioning, 1, 2, None),
        (33, 33, Evaluating, 1, 1, None),
    ]);
    assert_eq!(ticks_of(&out), expand(&spans));
    assert_eq!(
        late_events(&out),
        vec![
            (1200, EventKind::ScaleIn),
            (1800, EventKind::DrainEnd),
            (1860, EventKind::DeprovisionStart),
            (1950, EventKind::NodeRemoved),
        ]
    );
}

/// Provisioning that takes 90 s: scale-out at T6 (360), node ready at 450; T7 is
/// `provisioning` with the new node not yet serving, T8 (480) activates it (work done
/// at the tick: still `provisioning`), and the cooldown runs from 480 to 1080.
#[test]
fn provisioning_ending_between_ticks() {
    let mut doc = load("g1_nlb.json");
    doc["cloud"]["provision_time"] = serde_json::json!("90s");
    doc["until"] = serde_json::json!(1140);
    let out = simulate_json(&doc).unwrap();
    let spans = [
        (1, 5, Evaluating, 1, 1, None),
        (6, 6, Evaluating, 1, 2, Some(ScaleOut)),
        (7, 7, Provisioning, 1, 2, None),
        (8, 8, Provisioning, 2, 2, None),
        (9, 18, Cooldown, 2, 2, None),
        // T19 (30) is evaluated: the first of a scale-in streak.
        (19, 19, Evaluating, 2, 2, None),
    ];
    assert_eq!(ticks_of(&out), expand(&spans));
}

const MIN: u64 = 60_000;

prop_compose! {
    /// Waits of any length in seconds (not whole minutes), so that they end between
    /// ticks as often as on them.
    fn odd_waits_input()(
        cooldown in 0u64..400,
        drain in 0u64..400,
        ttl in 0u64..200,
        dns in any::<bool>(),
        provision in 0u64..200,
        deprovision in 0u64..200,
        drain_after in proptest::option::of(0u64..400),
        failures in 0u32..3,
        k in 1u32..3,
        segments in proptest::collection::vec((0u8..3, 1usize..8), 8..30),
    ) -> SimInput {
        let trace: Vec<Option<f64>> = segments
            .iter()
            .flat_map(|&(level, len)| {
                let v = match level {
                    0 => Some(95.0),
                    1 => Some(20.0),
                    _ => None,
                };
                std::iter::repeat_n(v, len)
            })
            .chain(std::iter::repeat(None))
            .take(60)
            .collect();
        let mut thresholds = Thresholds::default();
        thresholds.set(Metric::Memory, Band { min: 40.0, max: 85.0 });
        let mut samples = HashMap::new();
        for (n, v) in trace.iter().enumerate() {
            if let Some(v) = v {
                samples.insert((0, n as u64 + 1), Sample::default().with(Metric::Memory, *v));
            }
        }
        SimInput {
            availability_zones: vec!["az1".into()],
            policy: PolicyConfig {
                min_nodes: 1,
                max_nodes: 3,
                stats_interval: MIN,
                watch_samples: k,
                cooldown: cooldown * 1000,
                drain_timeout: drain * 1000,
                distributor: if dns { Distributor::Dns } else { Distributor::Nlb },
                dns_ttl: ttl * 1000,
                thresholds,
            },
            initial_nodes: 2,
            cloud: CloudModel {
                provision_time: Duration::from_secs(provision),
                deprovision_time: Duration::from_secs(deprovision),
                provision_failures: failures,
            },
            connections_drain_after: drain_after.map(Duration::from_secs),
            samples,
            until: 60 * 60,
        }
    }
}

/// For a wait phase: the events that start an episode of it and those that end it.
fn episode_bounds(phase: PhaseKind) -> Option<(&'static [EventKind], &'static [EventKind])> {
    use EventKind as K;
    match phase {
        Evaluating => None,
        Provisioning => Some((&[K::ScaleOut], &[K::NodeActive, K::ScaleOutAbandoned])),
        Cooldown => Some((&[K::NodeActive], &[K::CooldownEnd])),
        Ttl => Some((&[K::ScaleIn], &[K::TtlEnd])),
        Draining => Some((&[K::ScaleIn, K::TtlEnd], &[K::DrainEnd])),
        Deprovisioning => Some((&[K::DrainEnd], &[K::NodeRemoved])),
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// A tick labelled with a wait is inside that wait: the wait started at or before
    /// the tick, and did not end before it (it may end exactly on it).
    #[test]
    fn a_tick_is_never_labelled_with_a_wait_that_had_ended(input in odd_waits_input()) {
        let out = simulate(&input);
        for row in &out.ticks {
            let Some((starts, ends)) = episode_bounds(row.phase) else { continue };
            let start = out
                .events
                .iter()
                .filter(|e| e.az == row.az && e.t <= row.t && starts.contains(&e.kind))
                .map(|e| e.t)
                .max();
            prop_assert!(start.is_some(), "{:?} without a start: {:?}", row, out.events);
            let start = start.unwrap();
            let ended = out
                .events
                .iter()
                .find(|e| e.az == row.az && e.t >= start && e.t < row.t && ends.contains(&e.kind));
            prop_assert!(ended.is_none(), "{:?} after {:?}", row, ended);
        }
    }
}
