//! Creates N autoscale groups (min 1 node each) in a throwaway store, through the
//! engine, for measuring the daemon's idle cost:
//! `cargo run -p lbscale-daemon --example many_groups -- DIR PREFIX N [STATS_INTERVAL]`
//! then `lbscale daemon --state sqlite://DIR/state.db --address-prefix PREFIX`.

use lbscale_cloud_local::LocalSettings;
use lbscale_engine::model::{
    CloudName, DeclaredDuration, DistributorMode, DistributorSpec, GroupSpec, Metric, ThresholdSpec,
};
use lbscale_engine::Engine;
use std::path::PathBuf;

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [dir, prefix, n, rest @ ..] = args.as_slice() else {
        eprintln!("usage: many_groups DIR PREFIX N [STATS_INTERVAL]");
        std::process::exit(2);
    };
    let interval = rest.first().cloned().unwrap_or_else(|| "1s".into());
    let n: usize = n.parse().expect("N");
    let dir = PathBuf::from(dir);
    std::fs::create_dir_all(&dir).unwrap();
    let node_binary = std::env::var("LBSCALE_NODE").ok().map(PathBuf::from);
    let settings = LocalSettings {
        address_prefix: prefix.clone(),
        node_binary,
        ..LocalSettings::default()
    };
    let clouds =
        lbscale_engine::cloud::Clouds::new().with("local", lbscale_cloud_local::drivers(settings));
    let engine = Engine::open("sqlite://state.db", &dir, clouds).expect("open store");
    let d = engine
        .create_distributor(&DistributorSpec {
            name: "bench-dns".into(),
            cloud: CloudName::Local,
            mode: DistributorMode::Dns,
            domain: Some("bench.lbscale.test".into()),
            ttl: DeclaredDuration::parse("1s").unwrap(),
        })
        .await
        .expect("distributor");
    let started = std::time::Instant::now();
    for i in 0..n {
        let spec = GroupSpec {
            name: format!("g{i:03}"),
            cloud: CloudName::Local,
            availability_zones: vec!["az1".into()],
            traffic_distributor_id: d.clone(),
            min_nodes: 1,
            max_nodes: 2,
            stats_interval: DeclaredDuration::parse(&interval).unwrap(),
            watch_time: DeclaredDuration::parse(&interval).unwrap(),
            cooldown: DeclaredDuration::parse("3s").unwrap(),
            drain_timeout: DeclaredDuration::parse("2s").unwrap(),
            thresholds: vec![ThresholdSpec {
                metric: Metric::Throughput,
                min: 1.0,
                max: 1000.0,
            }],
            node: None,
            apply_timeout: DeclaredDuration::parse("60s").unwrap(),
        };
        let id = engine.declare_group(&spec).expect("declare group");
        engine
            .reconcile_group(&id)
            .await
            .expect("bring the group up");
    }
    println!("{n} groups up in {:?}", started.elapsed());
}
