//! What one evaluation of the daemon reads of a group costs in statements:
//! a constant, whatever the number of nodes (it read the nodes and the
//! distributor again for every node before: 44 statements an evaluation with
//! six nodes). On SQLite and PostgreSQL (see `lbscale_engine::store_testing`).

use lbscale_engine::cloud::Clouds;
use lbscale_engine::model::{
    CloudName, DeclaredDuration, DistributorMode, DistributorSpec, GroupSpec, SeGroupSpec,
};
use lbscale_engine::store::{NodeRow, NodeState, Store};
use lbscale_engine::store_testing::vserver_spec;
use lbscale_engine::{store_test, Engine};

fn spec() -> GroupSpec {
    GroupSpec {
        name: "reads".into(),
        cloud: CloudName::Local,
        availability_zones: vec!["az1".into(), "az2".into(), "az3".into()],
        traffic_distributor_id: "td-1".into(),
        min_nodes: 1,
        max_nodes: 3,
        stats_interval: DeclaredDuration::parse("60s").unwrap(),
        watch_time: DeclaredDuration::parse("120s").unwrap(),
        cooldown: DeclaredDuration::parse("60s").unwrap(),
        drain_timeout: DeclaredDuration::parse("5s").unwrap(),
        thresholds: vec![],
        node: None,
        apply_timeout: DeclaredDuration::parse("5m").unwrap(),
    }
}

fn node(i: usize) -> NodeRow {
    NodeRow {
        id: format!("reads-n{i}"),
        group_id: "g1".into(),
        az: format!("az{}", i % 3 + 1),
        seq: i as i64 + 1,
        state: NodeState::Active,
        private_ip: format!("127.93.0.{}", i + 1),
        public_ip: None,
        registered: true,
        handle: serde_json::json!({"config_fingerprint": "0000000000000000"}),
        created_at: 0,
    }
}

/// Statements that `f` sends from this thread.
fn counted<T>(f: impl FnOnce() -> T) -> (T, u64) {
    let before = Store::statements_sent_here();
    let out = f();
    (out, Store::statements_sent_here() - before)
}

store_test!(
    an_evaluation_reads_its_group_in_statements_that_do_not_grow_with_its_nodes,
    |ts| {
        let clouds = Clouds::new().with(
            "local",
            lbscale_cloud_local::drivers(lbscale_cloud_local::LocalSettings::default()),
        );
        let engine = Engine::open(&ts.url, &ts.dir, clouds).unwrap();
        let store = engine.testing_store();
        store
            .insert_distributor(
                "td-1",
                &DistributorSpec {
                    name: "reads-dns".into(),
                    cloud: CloudName::Local,
                    mode: DistributorMode::Dns,
                    domain: Some("reads.lbscale.test".into()),
                    ttl: DeclaredDuration::parse("1s").unwrap(),
                },
            )
            .unwrap();
        store.insert_group("g1", &spec(), "secret").unwrap();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let mut costs = Vec::new();
        for n in [2, 6] {
            while store.nodes_of_group("g1").unwrap().len() < n {
                let i = store.nodes_of_group("g1").unwrap().len();
                store.insert_node(&node(i)).unwrap();
            }
            let (snap, read) = counted(|| rt.block_on(engine.group_snapshot("g1")).unwrap());
            let snap = snap.expect("the group is there");
            assert_eq!(snap.rows.len(), n);
            assert!(!snap.deleting && snap.applying.is_none());
            let (stale, checked) = counted(|| engine.stale_configurations_in(&snap));
            // Every node's fingerprint is a made-up one: all stale, all found.
            assert_eq!(stale.len(), n, "{stale:?}");
            // The check on its own (the CLI's, a resume's) reads the group,
            // its configuration version, its distributor, its nodes and its
            // vservers once each: 5, where it read the nodes and the
            // distributor again per node (2 n + 4).
            let (alone, cost) = counted(|| engine.stale_configurations("g1").unwrap());
            assert_eq!(alone, stale);
            assert_eq!(cost, 5, "{n} nodes");
            let (spans, spanned) = counted(|| engine.vserver_spans_in(&snap));
            assert!(spans.is_empty(), "behind dns: no span");
            // The distributor has served nothing yet: not settled, told from
            // the snapshot.
            let (settled, compared) = counted(|| engine.publication_settled_in(&snap).unwrap());
            assert_eq!(settled, Some(false));
            costs.push((read, checked, spanned, compared));
        }
        // The group row with its distributor, what that serves and its lease,
        // then the nodes, then the vservers (through the group's SE groups:
        // none here); the check and the publication's comparison read
        // nothing more, and behind dns there is no span to read.
        assert_eq!(costs, vec![(3, 0, 0, 0), (3, 0, 0, 0)]);

        // A distributor of two groups: the snapshot of one cannot tell.
        let mut other = spec();
        other.name = "reads-2".into();
        store.insert_group("g2", &other, "secret").unwrap();
        let snap = rt.block_on(engine.group_snapshot("g1")).unwrap().unwrap();
        assert_eq!(engine.publication_settled_in(&snap).unwrap(), None);

        // An nlb's port targets need the placements: not told from a snapshot.
        store
            .insert_distributor(
                "td-2",
                &DistributorSpec {
                    name: "reads-nlb".into(),
                    cloud: CloudName::Local,
                    mode: DistributorMode::Nlb,
                    domain: None,
                    ttl: DeclaredDuration::parse("1s").unwrap(),
                },
            )
            .unwrap();
        let mut behind_nlb = spec();
        behind_nlb.name = "reads-3".into();
        behind_nlb.traffic_distributor_id = "td-2".into();
        store.insert_group("g3", &behind_nlb, "secret").unwrap();
        let snap = rt.block_on(engine.group_snapshot("g3")).unwrap().unwrap();
        assert_eq!(engine.publication_settled_in(&snap).unwrap(), None);

        // Behind an nlb the snapshot reads the SE groups and the vservers'
        // spans too: two statements more, whatever the number of vservers
        // and AZs. Sizing the spans and checking the configurations then
        // read nothing (they read a span per vserver and AZ before).
        store
            .insert_se_group(
                "se-3",
                &SeGroupSpec {
                    name: "reads-se".into(),
                    autoscale_group_id: "g3".into(),
                    scaling_mode: "native".into(),
                    min_scaleout_per_vs: 1,
                    max_scaleout_per_vs: 3,
                    vs_scalein_timeout: DeclaredDuration::parse("30s").unwrap(),
                    se_tunnel_mode: 0,
                    primary_forwarding_cost: 0.0,
                },
            )
            .unwrap();
        for (i, name) in ["reads-vs-a", "reads-vs-b"].into_iter().enumerate() {
            store
                .insert_vserver(
                    &format!("vs-{i}"),
                    &vserver_spec(name, "se-3", "TCP", 18800 + i as i64),
                )
                .unwrap();
        }
        store.set_vserver_span("vs-0", "az1", 2, None).unwrap();
        for i in 0..6 {
            store
                .insert_node(&NodeRow {
                    id: format!("reads3-n{i}"),
                    group_id: "g3".into(),
                    private_ip: format!("127.93.3.{}", i + 1),
                    ..node(i)
                })
                .unwrap();
        }
        let (snap, read) = counted(|| rt.block_on(engine.group_snapshot("g3")).unwrap());
        let snap = snap.expect("the group is there");
        assert_eq!(read, 5);
        let (spans, spanned) = counted(|| engine.vserver_spans_in(&snap));
        assert_eq!(spanned, 0);
        let span_of = |vserver: &str, az: &str| {
            let s = spans
                .iter()
                .find(|s| s.vserver == vserver && s.az == az)
                .unwrap_or_else(|| panic!("no span of {vserver} in {az}: {spans:?}"));
            (s.span, s.holders.len())
        };
        assert_eq!(spans.len(), 2 * 3, "two vservers in three AZs: {spans:?}");
        // As sized where a span is stored, else min_scaleout_per_vs.
        assert_eq!(span_of("reads-vs-a", "az1"), (2, 2));
        assert_eq!(span_of("reads-vs-a", "az2"), (1, 1));
        assert_eq!(span_of("reads-vs-b", "az1"), (1, 1));
        // The same as the engine's own read of them.
        assert_eq!(
            format!("{spans:?}"),
            format!("{:?}", engine.vserver_spans("g3").unwrap())
        );
        let (stale, checked) = counted(|| engine.stale_configurations_in(&snap));
        assert_eq!(checked, 0);
        assert_eq!(stale.len(), 6, "{stale:?}");
        // On its own: the 5 statements above and the SE groups and spans.
        let (alone, cost) = counted(|| engine.stale_configurations("g3").unwrap());
        assert_eq!(alone, stale);
        assert_eq!(cost, 7);

        // Two SE groups: each vserver is sized by its own SE group's bounds,
        // in the order of the SE groups, then of the vservers in each (not
        // of the vservers across them). Written out by hand, not read again.
        store
            .insert_se_group(
                "se-4",
                &SeGroupSpec {
                    name: "reads-se-2".into(),
                    min_scaleout_per_vs: 1,
                    max_scaleout_per_vs: 2,
                    ..store.se_group("se-3").unwrap().unwrap().spec
                },
            )
            .unwrap();
        store
            .insert_vserver("vs-2", &vserver_spec("reads-vs-c", "se-4", "TCP", 18802))
            .unwrap();
        store
            .insert_vserver("vs-3", &vserver_spec("reads-vs-d", "se-3", "TCP", 18803))
            .unwrap();
        // Past its SE group's max in az2: held by 2 there, by its min
        // elsewhere.
        store.set_vserver_span("vs-2", "az2", 5, None).unwrap();
        let snap = rt.block_on(engine.group_snapshot("g3")).unwrap().unwrap();
        let spans = engine.vserver_spans_in(&snap);
        let seen: Vec<(String, String, u32, Vec<String>)> = spans
            .iter()
            .map(|s| (s.vserver.clone(), s.az.clone(), s.span, s.holders.clone()))
            .collect();
        // Nodes by AZ, oldest first: az1 n0, n3; az2 n1, n4; az3 n2, n5.
        let held = |v: &str, az: &str, span: u32, nodes: &[usize]| {
            let holders = nodes.iter().map(|i| format!("reads3-n{i}")).collect();
            (v.to_string(), az.to_string(), span, holders)
        };
        let one_each = |v: &str| {
            [
                held(v, "az1", 1, &[0]),
                held(v, "az2", 1, &[1]),
                held(v, "az3", 1, &[2]),
            ]
        };
        let mut expected = vec![
            held("reads-vs-a", "az1", 2, &[0, 3]),
            held("reads-vs-a", "az2", 1, &[1]),
            held("reads-vs-a", "az3", 1, &[2]),
        ];
        expected.extend(one_each("reads-vs-b"));
        expected.extend(one_each("reads-vs-d"));
        expected.extend([
            held("reads-vs-c", "az1", 1, &[0]),
            held("reads-vs-c", "az2", 2, &[1, 4]),
            held("reads-vs-c", "az3", 1, &[2]),
        ]);
        assert_eq!(seen, expected);
        let bounds = |v: &str| if v == "reads-vs-c" { (1, 2) } else { (1, 3) };
        assert!(spans.iter().all(|s| (s.min, s.max) == bounds(&s.vserver)));
    }
);
