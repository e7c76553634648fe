//! Property tests of the decision core (proptest, 256 cases each).

use std::collections::HashMap;
use std::time::Duration;

use lbscale_core::policy::{
    Band, Distributor, Metric, PhaseKind, PolicyConfig, Sample, Thresholds,
};
use lbscale_core::seplan::{self, PlanParams, ScalingMode};
use lbscale_core::simulate::{simulate, CloudModel, SimInput};
use lbscale_core::slowstart::{LbMethod, Service, SlowStartConfig, Unit, Vserver};
use proptest::prelude::*;

const MIN: u64 = 60_000;

prop_compose! {
    fn policy_input()(
        min_nodes in 1u32..4,
        extra in 0u32..4,
        k in 1u32..4,
        cooldown in 0u64..4,
        drain in 0u64..4,
        ttl in 0u64..3,
        dns in any::<bool>(),
        both_metrics in any::<bool>(),
        provision in 0u64..150,
        deprovision in 0u64..150,
        drain_after in proptest::option::of(0u64..300),
        failures in 0u32..4,
        azs in 1usize..3,
        initial_extra in 0u32..4,
        segments in proptest::collection::vec((0u8..4, 1usize..8, 0.0f64..10.0), 8..40),
    ) -> SimInput {
        // Sustained regimes (high, middle, low, missing) so that breaches hold for the
        // watch time and workflows run, rather than uniform noise that rarely does.
        let trace: Vec<Option<(f64, f64)>> = segments
            .iter()
            .flat_map(|&(level, len, jitter)| {
                let v = match level {
                    0 => Some((90.0 + jitter, 75.0 + jitter)),
                    1 => Some((60.0 + jitter, 50.0 + jitter)),
                    2 => Some((10.0 + jitter, 5.0 + jitter)),
                    _ => None,
                };
                std::iter::repeat_n(v, len)
            })
            .chain(std::iter::repeat(None))
            .take(60)
            .collect();
        let mut thresholds = Thresholds::default();
        thresholds.set(Metric::Memory, Band { min: 40.0, max: 85.0 });
        if both_metrics {
            thresholds.set(Metric::Cpu, Band { min: 20.0, max: 70.0 });
        }
        let max_nodes = min_nodes + extra;
        let policy = PolicyConfig {
            min_nodes,
            max_nodes,
            stats_interval: MIN,
            watch_samples: k,
            cooldown: cooldown * MIN,
            drain_timeout: drain * MIN,
            distributor: if dns { Distributor::Dns } else { Distributor::Nlb },
            dns_ttl: ttl * MIN,
            thresholds,
        };
        let names: Vec<String> = (1..=azs).map(|i| format!("az{i}")).collect();
        let mut samples = HashMap::new();
        for az in 0..azs {
            for (n, s) in trace.iter().enumerate() {
                if let Some((mem, cpu)) = s {
                    // The second AZ sees a shifted trace so AZs differ.
                    let shift = az as f64 * 17.0;
                    samples.insert(
                        (az, n as u64 + 1),
                        Sample::default()
                            .with(Metric::Memory, if az == 0 { *mem } else { (mem + shift) % 100.0 })
                            .with(Metric::Cpu, *cpu),
                    );
                }
            }
        }
        SimInput {
            availability_zones: names,
            policy,
            initial_nodes: (min_nodes + initial_extra).min(max_nodes),
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

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Whatever the trace and the cloud do, no AZ serves with fewer than min_nodes or
    /// has more than max_nodes in the cloud, and serving never exceeds provisioned.
    #[test]
    fn node_counts_stay_within_bounds(input in policy_input()) {
        let out = simulate(&input);
        prop_assert_eq!(out.ticks.len(), 60 * input.availability_zones.len());
        for t in &out.ticks {
            prop_assert!(t.serving >= input.policy.min_nodes, "{:?}", t);
            prop_assert!(t.provisioned <= input.policy.max_nodes, "{:?}", t);
            prop_assert!(t.serving <= t.provisioned, "{:?}", t);
        }
    }

    /// Decisions are only taken on ticks whose statistics were evaluated, and the
    /// tick after a decision is never an evaluation that decides again at once
    /// unless the workflow finished (a decision always starts a workflow).
    #[test]
    fn no_action_on_a_non_evaluating_tick(input in policy_input()) {
        let out = simulate(&input);
        for t in &out.ticks {
            if t.action.is_some() {
                prop_assert_eq!(t.phase, PhaseKind::Evaluating, "{:?}", t);
            }
        }
        // Every scale_out / scale_in event is at a tick that decided it.
        for e in &out.events {
            let decided = matches!(
                e.kind,
                lbscale_core::policy::EventKind::ScaleOut | lbscale_core::policy::EventKind::ScaleIn
            );
            if decided {
                let tick = out.ticks.iter().find(|t| t.t == e.t && t.az == e.az).unwrap();
                prop_assert!(tick.action.is_some(), "{:?}", e);
            }
        }
        // Per AZ, consecutive decisions are separated by at least one non-evaluating
        // tick, or a zero-length workflow was impossible to skip: a scale-in always
        // has a deprovisioning tick after it.
        for az in &input.availability_zones {
            let rows: Vec<_> = out.ticks.iter().filter(|t| &t.az == az).collect();
            for pair in rows.windows(2) {
                if pair[0].action == Some(lbscale_core::policy::Decision::ScaleIn) {
                    prop_assert_ne!(pair[1].phase, PhaseKind::Evaluating);
                }
            }
        }
    }
}

fn vserver(existing: &[u32], rate: f64, unit: Unit, inc: u32, interval: u32) -> Vserver {
    Vserver {
        lb_method: LbMethod::RoundRobin,
        request_rate: rate,
        slow_start: SlowStartConfig {
            new_service_request: inc,
            unit,
            increment_interval: interval,
        },
        services: existing
            .iter()
            .enumerate()
            .map(|(i, w)| Service {
                name: format!("e{i}"),
                weight: *w,
                ramp: None,
            })
            .collect(),
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Rates always sum to the vserver's rate, and a new service never gets more than
    /// its cap: `inc × steps` (automatic PER_SECOND), `inc` (manual PER_SECOND), or
    /// p % of an existing service's load per unit of weight (PERCENT).
    #[test]
    fn slow_start_rates_sum_and_respect_caps(
        existing in proptest::collection::vec(1u32..4, 1..5),
        new in proptest::collection::vec((1u32..4, 0u64..40), 1..4),
        rate in 0.0f64..1000.0,
        percent in any::<bool>(),
        inc in 0u32..40,
        interval in 0u32..15,
    ) {
        let unit = if percent { Unit::Percent } else { Unit::PerSecond };
        let mut vs = vserver(&existing, rate, unit, inc, interval);
        let mut adds: Vec<(u64, u32, String)> = new
            .iter()
            .enumerate()
            .map(|(i, (w, at))| (at * 1000, *w, format!("n{i}")))
            .collect();
        adds.sort();
        let mut since: HashMap<String, u64> = HashMap::new();
        for t in (0..=120u64).map(|s| s * 1000) {
            let got: Vec<bool> = vs.rates(t).iter().map(|r| *r > 0.0).collect();
            vs.record_traffic(&got);
            vs.advance(t);
            for (at, w, name) in &adds {
                if *at == t {
                    vs.add_service(name, *w, t);
                    since.insert(name.clone(), t);
                }
            }
            vs.advance(t);
            let rates = vs.rates(t);
            let total: f64 = rates.iter().sum();
            prop_assert!((total - rate).abs() <= 1e-6 * rate.max(1.0), "{} vs {}", total, rate);
            let existing_rate_per_weight = vs
                .services
                .iter()
                .zip(&rates)
                .find(|(s, _)| s.ramp.is_none())
                .map(|(s, r)| r / f64::from(s.weight));
            for (s, r) in vs.services.iter().zip(&rates) {
                let Some(ramp) = s.ramp else { continue };
                let steps = if interval == 0 { 0 } else { (t - ramp.since) / (u64::from(interval) * 1000) };
                match unit {
                    Unit::PerSecond => {
                        let cap = if interval == 0 { f64::from(inc) } else { f64::from(inc) * steps as f64 };
                        prop_assert!(*r <= cap + 1e-9, "{} > cap {} at {}", r, cap, t);
                    }
                    Unit::Percent => {
                        let p = if interval == 0 { f64::from(inc) } else { f64::from(inc) * steps as f64 };
                        let per_weight = existing_rate_per_weight.unwrap();
                        prop_assert!(
                            r / f64::from(s.weight) <= p.min(100.0) / 100.0 * per_weight + 1e-9,
                            "{} over {} % of {}", r, p, per_weight
                        );
                    }
                }
            }
        }
    }

    /// While a service is new, its automatic cap never decreases, even when the
    /// operator changes the increment mid-ramp (with a constant vserver rate).
    #[test]
    fn automatic_caps_never_decrease_while_new(
        existing in proptest::collection::vec(1u32..4, 1..5),
        rate in 1.0f64..1000.0,
        percent in any::<bool>(),
        incs in proptest::collection::vec(1u32..30, 1..5),
        interval in 1u32..10,
    ) {
        let unit = if percent { Unit::Percent } else { Unit::PerSecond };
        let mut vs = vserver(&existing, rate, unit, incs[0], interval);
        vs.add_service("new", 1, 0);
        let mut last_cap_unit = 0.0f64;
        let mut last_cap_rate = 0.0f64;
        for t in (0..=100u64).map(|s| s * 1000) {
            // Change the increment every 25 s.
            vs.slow_start.new_service_request = incs[(t / 25_000) as usize % incs.len()];
            let got: Vec<bool> = vs.rates(t).iter().map(|r| *r > 0.0).collect();
            vs.record_traffic(&got);
            vs.advance(t);
            let i = vs.services.len() - 1;
            let Some(ramp) = vs.services[i].ramp else { break };
            prop_assert!(ramp.cap >= last_cap_unit, "{} < {}", ramp.cap, last_cap_unit);
            last_cap_unit = ramp.cap;
            let cap_rate = vs.caps(t)[i].unwrap();
            prop_assert!(cap_rate + 1e-9 >= last_cap_rate, "{} < {}", cap_rate, last_cap_rate);
            last_cap_rate = cap_rate;
        }
    }

    /// SE plans: shares sum to 1, none negative, and capacity never decreases with
    /// more nodes, in every mode.
    #[test]
    fn se_shares_sum_to_one_and_capacity_grows(
        f in 0.0f64..=1.0,
        ecmp in 1u32..10,
        mode in prop_oneof![Just(ScalingMode::Native), Just(ScalingMode::Bgp), Just(ScalingMode::NativeAndBgp)],
    ) {
        let params = PlanParams { mode, forwarding_cost: f, ecmp_paths: ecmp };
        let mut last = 0.0;
        for n in 1..=24 {
            let plan = seplan::plan(&params, n);
            prop_assert_eq!(plan.shares.len(), n as usize);
            prop_assert!((plan.shares.iter().sum::<f64>() - 1.0).abs() < 1e-9);
            prop_assert!(plan.shares.iter().all(|s| *s >= 0.0));
            prop_assert!(plan.capacity + 1e-9 >= last, "{} < {} at {}", plan.capacity, last, n);
            prop_assert!(plan.capacity <= f64::from(n) + 1e-9);
            last = plan.capacity;
        }
    }
}

/// The generator above must actually exercise the workflows: over a fixed set of
/// seeds, most runs scale out and in at least once.
#[test]
fn property_inputs_exercise_scaling() {
    use proptest::strategy::ValueTree;
    use proptest::test_runner::TestRunner;
    let mut runner = TestRunner::deterministic();
    let (mut outs, mut ins) = (0, 0);
    for _ in 0..100 {
        let input = policy_input().new_tree(&mut runner).unwrap().current();
        let out = simulate(&input);
        outs += usize::from(
            out.ticks
                .iter()
                .any(|t| t.action == Some(lbscale_core::policy::Decision::ScaleOut)),
        );
        ins += usize::from(
            out.ticks
                .iter()
                .any(|t| t.action == Some(lbscale_core::policy::Decision::ScaleIn)),
        );
    }
    assert!(
        outs > 50 && ins > 30,
        "scale-outs in {outs} runs, scale-ins in {ins}"
    );
}
