//! One evaluation tick of the whole fleet a daemon might carry: 10,000 groups x 3 AZs,
//! 3 metrics each. Every iteration advances the clock by one stats interval so that
//! every AZ really evaluates (a repeated instant would be skipped as already done).

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion};
use lbscale_core::policy::{
    step, AzState, Band, Distributor, Metric, Observation, PolicyConfig, Sample, Thresholds,
};

const GROUPS: usize = 10_000;
const AZS: usize = 3;

fn config(i: usize) -> PolicyConfig {
    let mut thresholds = Thresholds::default();
    thresholds.set(
        Metric::Cpu,
        Band {
            min: 20.0,
            max: 80.0,
        },
    );
    thresholds.set(
        Metric::Memory,
        Band {
            min: 30.0,
            max: 85.0,
        },
    );
    thresholds.set(
        Metric::Throughput,
        Band {
            min: 100.0,
            max: 900.0,
        },
    );
    PolicyConfig {
        min_nodes: 1,
        max_nodes: 4 + (i % 4) as u32,
        stats_interval: 60_000,
        watch_samples: 3,
        cooldown: 600_000,
        drain_timeout: 600_000,
        distributor: if i % 2 == 0 {
            Distributor::Dns
        } else {
            Distributor::Nlb
        },
        dns_ttl: 60_000,
        thresholds,
    }
}

fn tick(c: &mut Criterion) {
    let configs: Vec<PolicyConfig> = (0..GROUPS).map(config).collect();
    let mut states: Vec<AzState> = vec![AzState::new(2); GROUPS * AZS];
    // In-band values with one metric breaching every other tick: streaks move, no
    // breach is confirmed, so every tick is a full evaluation.
    let observations: Vec<[Observation; 2]> = (0..GROUPS * AZS)
        .map(|i| {
            let base = Sample::default()
                .with(Metric::Cpu, 40.0 + (i % 30) as f64)
                .with(Metric::Memory, 50.0)
                .with(Metric::Throughput, 500.0);
            [
                Observation {
                    sample: Some(base),
                    ..Default::default()
                },
                Observation {
                    sample: Some(base.with(Metric::Memory, 95.0)),
                    ..Default::default()
                },
            ]
        })
        .collect();
    let per_group = 3 * std::mem::size_of::<AzState>() + std::mem::size_of::<PolicyConfig>();
    eprintln!(
        "size_of AzState = {} B, PolicyConfig = {} B, per group (3 AZs + config) = {} B",
        std::mem::size_of::<AzState>(),
        std::mem::size_of::<PolicyConfig>(),
        per_group
    );
    let mut n: u64 = 0;
    c.bench_function("tick 10k groups x 3 AZs x 3 metrics", |b| {
        b.iter(|| {
            n += 1;
            let now = n * 60_000;
            let which = (n % 2) as usize;
            let mut evaluated = 0usize;
            for (g, cfg) in configs.iter().enumerate() {
                for az in 0..AZS {
                    let i = g * AZS + az;
                    let (next, out) = step(cfg, &states[i], &observations[i][which], now);
                    evaluated += usize::from(out.evaluated);
                    states[i] = next;
                }
            }
            assert_eq!(evaluated, GROUPS * AZS);
            black_box(evaluated)
        })
    });
}

criterion_group!(benches, tick);
criterion_main!(benches);
