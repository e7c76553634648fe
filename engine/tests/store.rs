//! The daemon's persisted policy state in the store: written under the group's
//! daemon claim, fenced against a stale writer, gone with the group.
//!
//! Every test runs twice: on SQLite (`NAME::sqlite`) and on PostgreSQL
//! (`NAME::postgres`, against `LBSCALE_TEST_POSTGRES_URL`; see
//! `lbscale_engine::store_testing`).

use lbscale_core::policy::{AzState, Phase};
use lbscale_engine::model::{CloudName, DeclaredDuration, DistributorMode, GroupSpec};
use lbscale_engine::store::{
    az_lease_key, daemon_claim_key, NodeRow, NodeState, Store, StoreError, CONFIG_FENCE,
    RENEW_BATCH, SCHEMA_VERSION,
};
use lbscale_engine::store_test;
use lbscale_engine::store_testing::block_on;
use std::time::Duration;

fn group(s: &Store, id: &str) {
    let spec = GroupSpec {
        name: format!("{id}-name"),
        cloud: CloudName::Local,
        availability_zones: vec!["az1".into(), "az2".into()],
        traffic_distributor_id: "td-1".into(),
        min_nodes: 1,
        max_nodes: 3,
        stats_interval: DeclaredDuration::parse("1s").unwrap(),
        watch_time: DeclaredDuration::parse("2s").unwrap(),
        cooldown: DeclaredDuration::parse("20s").unwrap(),
        drain_timeout: DeclaredDuration::parse("2s").unwrap(),
        thresholds: vec![],
        node: None,
        apply_timeout: DeclaredDuration::parse("5m").unwrap(),
    };
    s.insert_group(id, &spec, "token").unwrap();
}

fn cooling(until: u64) -> AzState {
    let mut st = AzState::new(2);
    st.phase = Phase::Cooldown { until };
    st
}

store_test!(
    policy_state_is_written_read_and_overwritten_under_the_claim,
    |ts| {
        let s = ts.open();
        group(&s, "g1");
        let claim = s
            .acquire_lease(&daemon_claim_key("g1"), "daemon-a", Duration::from_secs(30))
            .unwrap();
        block_on(s.put_policy_state(&claim, "g1", "az1", &cooling(1_000))).unwrap();
        let mut evaluating = AzState::new(1);
        evaluating.out_streak = [1, 0, 0];
        block_on(s.put_policy_state(&claim, "g1", "az2", &evaluating)).unwrap();
        let rows = s.policy_states("g1").unwrap();
        assert_eq!(rows.len(), 2);
        assert_eq!(
            (rows[0].az.as_str(), rows[0].state),
            ("az1", cooling(1_000))
        );
        assert_eq!((rows[1].az.as_str(), rows[1].state), ("az2", evaluating));
        assert_eq!(
            (rows[0].holder.as_str(), rows[0].fence),
            ("daemon-a", claim.fence)
        );

        // Overwritten in place.
        block_on(s.put_policy_state(&claim, "g1", "az1", &cooling(2_000))).unwrap();
        let rows = s.policy_states("g1").unwrap();
        assert_eq!(rows.len(), 2);
        assert_eq!(rows[0].state, cooling(2_000));
        // Another group sees none of it.
        assert!(s.policy_states("g2").unwrap().is_empty());
    }
);

store_test!(
    claims_and_events_awaited_on_a_runtime_match_the_blocking_calls,
    |ts| {
        let s = ts.open();
        group(&s, "g1");
        let key = daemon_claim_key("g1");
        let ttl = Duration::from_secs(30);
        let first = block_on(s.acquire_lease_async(&key, "daemon-a", ttl)).unwrap();
        let again = block_on(s.acquire_lease_async(&key, "daemon-a", ttl)).unwrap();
        assert_eq!(
            (again.holder.as_str(), again.fence),
            ("daemon-a", first.fence)
        );
        assert!(again.expires_ms >= first.expires_ms);
        match block_on(s.acquire_lease_async(&key, "daemon-b", ttl)) {
            Err(StoreError::LeaseHeld { holder, .. }) => assert_eq!(holder, "daemon-a"),
            other => panic!("another daemon's claim is refused: {other:?}"),
        }
        // The blocking call sees the same claim.
        assert!(matches!(
            s.acquire_lease(&key, "daemon-b", ttl),
            Err(StoreError::LeaseHeld { .. })
        ));
        assert!(matches!(
            block_on(s.acquire_lease_async(&daemon_claim_key("gone"), "daemon-a", ttl)),
            Err(StoreError::GroupGone(_))
        ));

        // An event again is one event with a count; another is a row of its own.
        for _ in 0..2 {
            block_on(s.record_event_async("g1", Some("az1"), "scale_out_failed", "no room"))
                .unwrap();
        }
        block_on(s.record_event_async("g1", None, "resume_failed", "store down")).unwrap();
        let events = s.events_of_group("g1", 10).unwrap();
        let seen: Vec<(Option<&str>, &str, u64)> = events
            .iter()
            .map(|e| (e.az.as_deref(), e.kind.as_str(), e.count))
            .collect();
        assert_eq!(
            seen,
            [
                (Some("az1"), "scale_out_failed", 2),
                (None, "resume_failed", 1)
            ]
        );
    }
);

store_test!(a_writer_whose_claim_was_taken_over_is_refused, |ts| {
    let s = ts.open();
    group(&s, "g1");
    let key = daemon_claim_key("g1");
    let old = s
        .acquire_lease(&key, "daemon-a", Duration::from_millis(1))
        .unwrap();
    std::thread::sleep(Duration::from_millis(5));
    // daemon-a's claim expired: a write under it is refused even before anyone
    // else takes the group.
    assert!(matches!(
        block_on(s.put_policy_state(&old, "g1", "az1", &cooling(1))),
        Err(StoreError::LeaseLost { .. })
    ));
    let new = s
        .acquire_lease(&key, "daemon-b", Duration::from_secs(30))
        .unwrap();
    assert!(new.fence > old.fence);
    block_on(s.put_policy_state(&new, "g1", "az1", &cooling(5_000))).unwrap();
    // The stale writer (lower fence) must not overwrite the new holder's state.
    let err = block_on(s.put_policy_state(&old, "g1", "az1", &cooling(1))).unwrap_err();
    assert!(matches!(err, StoreError::LeaseLost { .. }), "{err:?}");
    let rows = s.policy_states("g1").unwrap();
    assert_eq!(rows[0].state, cooling(5_000));
    assert_eq!(
        (rows[0].holder.as_str(), rows[0].fence),
        ("daemon-b", new.fence)
    );
});

store_test!(
    deleting_the_group_removes_its_policy_state_and_claim,
    |ts| {
        let s = ts.open();
        group(&s, "g1");
        group(&s, "g2");
        let c1 = s
            .acquire_lease(&daemon_claim_key("g1"), "daemon-a", Duration::from_secs(30))
            .unwrap();
        let c2 = s
            .acquire_lease(&daemon_claim_key("g2"), "daemon-a", Duration::from_secs(30))
            .unwrap();
        block_on(s.put_policy_state(&c1, "g1", "az1", &cooling(1))).unwrap();
        block_on(s.put_policy_state(&c2, "g2", "az1", &cooling(1))).unwrap();
        assert_eq!(s.count_rows("policy_state").unwrap(), 2);

        s.delete_group("g1").unwrap();
        assert!(s.policy_states("g1").unwrap().is_empty());
        assert_eq!(s.rows_mentioning("g1").unwrap(), 0);
        assert_eq!(s.policy_states("g2").unwrap().len(), 1);
        // The claim went with the group: a daemon still evaluating it cannot write
        // a row back.
        assert!(matches!(
            block_on(s.put_policy_state(&c1, "g1", "az1", &cooling(1))),
            Err(StoreError::LeaseLost { .. })
        ));
        // Nor can one claim the deleted group afresh (which would leave a lease row
        // for a group that is gone).
        assert!(matches!(
            s.acquire_lease(&daemon_claim_key("g1"), "daemon-a", Duration::from_secs(30)),
            Err(StoreError::GroupGone(_))
        ));
        assert_eq!(s.rows_mentioning("g1").unwrap(), 0);
        assert_eq!(s.count_rows("policy_state").unwrap(), 1);
    }
);

store_test!(
    a_store_of_schema_version_1_gains_the_policy_state_table,
    |ts| {
        {
            let s = ts.open();
            group(&s, "g1");
        }
        // Back to what version 1 wrote: no policy_state table.
        ts.raw(
            "DROP INDEX groups_by_distributor; ALTER TABLE groups DROP COLUMN config_fence; ALTER TABLE groups DROP COLUMN deleting; ALTER TABLE distributors DROP COLUMN served; DROP INDEX events_by_age; ALTER TABLE events DROP COLUMN count; ALTER TABLE events DROP COLUMN last_ms; DROP TABLE policy_state; DROP TABLE vserver_spans; ALTER TABLE groups DROP COLUMN version; UPDATE meta SET value = '1' WHERE key = 'schema_version';",
        );
        let s = ts.open();
        assert!(
            s.group("g1").unwrap().is_some(),
            "data of version 1 is kept"
        );
        let c = s
            .acquire_lease(&daemon_claim_key("g1"), "d", Duration::from_secs(30))
            .unwrap();
        block_on(s.put_policy_state(&c, "g1", "az1", &cooling(9))).unwrap();
        drop(s);
        let s = ts.open();
        assert_eq!(s.policy_states("g1").unwrap()[0].state, cooling(9));
        assert_eq!(
            ts.raw_text("SELECT value FROM meta WHERE key = 'schema_version'"),
            Some(SCHEMA_VERSION.to_string())
        );
    }
);

// Two handles on one store (two daemons): a claim taken over through the other
// handle fences the first one's policy-state writes.
store_test!(
    a_claim_taken_over_through_another_handle_fences_the_first,
    |ts| {
        let a = ts.open();
        let b = ts.open();
        group(&a, "g1");
        let key = daemon_claim_key("g1");
        // Long enough to outlive the next two calls on a loaded host.
        let old = a
            .acquire_lease(&key, "daemon-a", Duration::from_secs(1))
            .unwrap();
        block_on(a.put_policy_state(&old, "g1", "az1", &cooling(1))).unwrap();
        assert!(matches!(
            b.acquire_lease(&key, "daemon-b", Duration::from_secs(30)),
            Err(StoreError::LeaseHeld { .. })
        ));
        std::thread::sleep(Duration::from_millis(1100));
        let new = b
            .acquire_lease(&key, "daemon-b", Duration::from_secs(30))
            .unwrap();
        assert_eq!(new.fence, old.fence + 1);
        block_on(b.put_policy_state(&new, "g1", "az1", &cooling(7))).unwrap();
        assert!(matches!(
            block_on(a.put_policy_state(&old, "g1", "az1", &cooling(1))),
            Err(StoreError::LeaseLost { .. })
        ));
        assert_eq!(a.policy_states("g1").unwrap()[0].state, cooling(7));
    }
);

// The daemon's span of a vserver per AZ: set, overwritten, gone with the vserver.
store_test!(
    a_vserver_span_is_kept_per_az_and_goes_with_the_vserver,
    |ts| {
        let s = ts.open();
        ts.raw("INSERT INTO vservers (id, name, se_group_id, spec, created_at) VALUES ('vs-1', 'v', 'seg', '{}', 0)");
        // A vserver that is gone (deleted since the daemon looked) gets no row.
        s.set_vserver_span("vs-gone", "az1", 3, None).unwrap();
        assert_eq!(s.vserver_span("vs-gone", "az1").unwrap(), None);
        assert_eq!(s.vserver_span("vs-1", "az1").unwrap(), None);
        s.set_vserver_span("vs-1", "az1", 2, None).unwrap();
        s.set_vserver_span("vs-1", "az2", 3, None).unwrap();
        s.set_vserver_span("vs-1", "az1", 4, None).unwrap();
        drop(s);
        let s = ts.open();
        assert_eq!(s.vserver_span("vs-1", "az1").unwrap(), Some(4));
        assert_eq!(s.vserver_span("vs-1", "az2").unwrap(), Some(3));
        // Under a daemon's claim: written while it holds the claim, refused
        // once another daemon took the group.
        group(&s, "g1");
        let key = daemon_claim_key("g1");
        let old = s
            .acquire_lease(&key, "daemon-a", Duration::from_millis(400))
            .unwrap();
        s.set_vserver_span("vs-1", "az1", 5, Some(&old)).unwrap();
        assert_eq!(s.vserver_span("vs-1", "az1").unwrap(), Some(5));
        // The claim lapses (its daemon stopped renewing it); another takes it.
        std::thread::sleep(Duration::from_millis(500));
        let new = s
            .acquire_lease(&key, "daemon-b", Duration::from_secs(30))
            .unwrap();
        assert!(matches!(
            s.set_vserver_span("vs-1", "az1", 1, Some(&old)),
            Err(StoreError::LeaseLost { .. })
        ));
        s.set_vserver_span("vs-1", "az1", 6, Some(&new)).unwrap();
        assert_eq!(s.vserver_span("vs-1", "az1").unwrap(), Some(6));
        s.delete_vserver("vs-1").unwrap();
        assert_eq!(s.count_rows("vserver_spans").unwrap(), 0);
    }
);

// A group that leaves an AZ takes its vservers' spans there with it.
store_test!(a_group_leaving_an_az_drops_its_spans_there, |ts| {
    let s = ts.open();
    group(&s, "g1");
    ts.raw("INSERT INTO se_groups (id, name, group_id, spec, created_at) VALUES ('seg', 'seg', 'g1', '{}', 0)");
    ts.raw("INSERT INTO vservers (id, name, se_group_id, spec, created_at) VALUES ('vs-1', 'v', 'seg', '{}', 0)");
    s.set_vserver_span("vs-1", "az1", 2, None).unwrap();
    s.set_vserver_span("vs-1", "az2", 3, None).unwrap();
    let mut spec = s.group("g1").unwrap().unwrap().spec;
    spec.availability_zones = vec!["az1".into()];
    s.update_group("g1", &spec).unwrap();
    assert_eq!(s.vserver_span("vs-1", "az1").unwrap(), Some(2));
    assert_eq!(s.vserver_span("vs-1", "az2").unwrap(), None);
});

store_test!(
    a_store_of_schema_version_3_gains_the_group_row_version,
    |ts| {
        {
            let s = ts.open();
            group(&s, "g1");
        }
        // Back to what version 3 wrote: groups without a row version.
        ts.raw(
            "DROP INDEX groups_by_distributor; ALTER TABLE groups DROP COLUMN config_fence; ALTER TABLE groups DROP COLUMN deleting; ALTER TABLE distributors DROP COLUMN served; DROP INDEX events_by_age; ALTER TABLE events DROP COLUMN count; ALTER TABLE events DROP COLUMN last_ms; ALTER TABLE groups DROP COLUMN version; UPDATE meta SET value = '3' WHERE key = 'schema_version';",
        );
        let s = ts.open();
        assert_eq!(s.group_versions().unwrap(), vec![("g1".to_string(), 1)]);
        let (row, v) = s.group_with_version("g1").unwrap().unwrap();
        assert_eq!((row.spec.name.as_str(), v), ("g1-name", 1));
        assert_eq!(
            ts.raw_text("SELECT value FROM meta WHERE key = 'schema_version'"),
            Some(SCHEMA_VERSION.to_string())
        );
    }
);

store_test!(
    a_group_row_version_rises_with_its_spec_and_its_distributor,
    |ts| {
        let s = ts.open();
        group(&s, "g1");
        group(&s, "g2");
        assert_eq!(
            s.group_versions().unwrap(),
            vec![("g1".to_string(), 1), ("g2".to_string(), 1)]
        );
        let (mut row, _) = s.group_with_version("g1").unwrap().unwrap();
        row.spec.max_nodes = 5;
        s.update_group("g1", &row.spec).unwrap();
        let (row, v) = s.group_with_version("g1").unwrap().unwrap();
        assert_eq!((row.spec.max_nodes, v), (5, 2));
        assert_eq!(s.group_with_version("g2").unwrap().unwrap().1, 1);
        // A distributor's change (its TTL is part of its groups' policy) raises
        // the version of every group behind it.
        let d = lbscale_engine::model::DistributorSpec {
            name: "td".into(),
            cloud: CloudName::Local,
            mode: DistributorMode::Dns,
            domain: Some("x.lbscale.test".into()),
            ttl: DeclaredDuration::parse("5s").unwrap(),
        };
        s.insert_distributor("td-1", &d).unwrap();
        s.update_distributor("td-1", &d).unwrap();
        assert_eq!(
            s.group_versions().unwrap(),
            vec![("g1".to_string(), 3), ("g2".to_string(), 2)]
        );
        s.delete_group("g2").unwrap();
        assert_eq!(s.group_versions().unwrap(), vec![("g1".to_string(), 3)]);
        assert!(s.group_with_version("g2").unwrap().is_none());
    }
);

store_test!(
    az_leases_exclude_the_group_lease_of_another_holder_not_each_other,
    |ts| {
        let s = ts.open();
        group(&s, "g1");
        let ttl = Duration::from_secs(30);
        // A daemon's workflows in two AZs at once.
        let az1 = s
            .acquire_lease(&az_lease_key("g1", "az1"), "daemon", ttl)
            .unwrap();
        let az2 = s
            .acquire_lease(&az_lease_key("g1", "az2"), "daemon", ttl)
            .unwrap();
        // Never two in one AZ.
        assert!(matches!(
            s.acquire_lease(&az_lease_key("g1", "az1"), "other", ttl),
            Err(StoreError::LeaseHeld { .. })
        ));
        // An apply waits for both.
        match s.acquire_lease("g1", "apply", ttl) {
            Err(StoreError::LeaseHeld { holder, .. }) => assert_eq!(holder, "daemon"),
            other => panic!("the group's lease was taken beside its AZ leases: {other:?}"),
        }
        // ...but not for another group's.
        group(&s, "g10");
        s.acquire_lease("g10", "apply", ttl).unwrap();
        s.release_lease(&az1).unwrap();
        assert!(
            s.acquire_lease("g1", "apply", ttl).is_err(),
            "az2 still runs"
        );
        s.release_lease(&az2).unwrap();
        let apply = s.acquire_lease("g1", "apply", ttl).unwrap();
        assert_eq!(s.lease_holder("g1").unwrap().as_deref(), Some("apply"));
        // While the apply runs, no daemon workflow starts in any AZ; the holder
        // of both may (one process's own workflows).
        assert!(matches!(
            s.acquire_lease(&az_lease_key("g1", "az2"), "daemon", ttl),
            Err(StoreError::LeaseHeld { .. })
        ));
        s.acquire_lease(&az_lease_key("g1", "az2"), "apply", ttl)
            .unwrap();
        s.release_lease(&apply).unwrap();
        assert_eq!(s.lease_holder("g1").unwrap(), None);
        // The AZ leases go with the group.
        s.delete_group("g1").unwrap();
        assert_eq!(s.rows_mentioning("g1").unwrap(), 0);
    }
);

// A group's configuration fences rise under any of its live leases, are at
// least the database clock's ms (a store restored from a backup still moves
// past what its nodes applied), and are refused under a lease that is gone.
store_test!(a_configuration_fence_rises_under_a_live_lease_only, |ts| {
    let s = ts.open();
    group(&s, "g1");
    let now_ms = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis() as u64
    };
    let before = now_ms();
    let lease = s.acquire_lease("g1", "a", Duration::from_secs(30)).unwrap();
    let f1 = s.next_config_fence("g1", &lease).unwrap();
    // The database's clock may be another host's: allow it a second behind.
    assert!(
        f1 + 1_000 >= before,
        "fence {f1} far below the clock {before}"
    );
    let f2 = s.next_config_fence("g1", &lease).unwrap();
    assert!(f2 > f1, "{f2} after {f1}");
    let az = s
        .acquire_lease(&az_lease_key("g1", "az1"), "a", Duration::from_secs(30))
        .unwrap();
    let f3 = s.next_config_fence("g1", &az).unwrap();
    assert!(
        f3 > f2,
        "an AZ lease's fence {f3} after the group lease's {f2}"
    );
    s.release_lease(&az).unwrap();
    assert!(matches!(
        s.next_config_fence("g1", &az),
        Err(StoreError::LeaseLost { .. })
    ));
    std::thread::sleep(Duration::from_millis(20));
    ts.raw("UPDATE groups SET config_fence = 0");
    let f4 = s.next_config_fence("g1", &lease).unwrap();
    assert!(f4 > f3, "after the fences went back: {f4}, not above {f3}");
});

store_test!(
    a_daemon_renews_all_its_claims_in_one_statement_per_batch,
    |ts| {
        let s = ts.open();
        let n = RENEW_BATCH + 44;
        let mut keys = Vec::new();
        let mut taken = Vec::new();
        for i in 0..n {
            let id = format!("g{i}");
            group(&s, &id);
            taken.push(
                s.acquire_lease(&daemon_claim_key(&id), "daemon-a", Duration::from_secs(30))
                    .unwrap(),
            );
            keys.push(daemon_claim_key(&id));
        }
        // One claim another daemon took over, one released, one expired: not
        // this daemon's any more, so not renewed.
        s.release_lease_of(&keys[0], "daemon-a").unwrap();
        s.acquire_lease(&keys[0], "daemon-b", Duration::from_secs(30))
            .unwrap();
        s.release_lease_of(&keys[1], "daemon-a").unwrap();
        s.acquire_lease(&keys[2], "daemon-a", Duration::from_millis(1))
            .unwrap();
        std::thread::sleep(Duration::from_millis(5));

        let before = Store::statements_sent_here();
        let renewed = s
            .renew_leases("daemon-a", &keys, Duration::from_secs(60))
            .unwrap();
        assert_eq!(
            Store::statements_sent_here() - before,
            2,
            "{n} claims: two statements of at most {RENEW_BATCH}"
        );
        let mut got: Vec<&str> = renewed.iter().map(|l| l.group_id.as_str()).collect();
        got.sort_unstable();
        let mut want: Vec<&str> = keys[3..].iter().map(String::as_str).collect();
        want.sort_unstable();
        assert_eq!(got, want);
        // Renewed for the new TTL, under the same fence.
        let l = renewed.iter().find(|l| l.group_id == keys[3]).unwrap();
        s.check_lease(l).unwrap();
        assert_eq!(l.fence, taken[3].fence);
        assert!(
            l.expires_ms >= taken[3].expires_ms + 25_000,
            "60 s from now, not the 30 s of the first take: {} vs {}",
            l.expires_ms,
            taken[3].expires_ms
        );
        assert!(matches!(
            s.acquire_lease(&keys[3], "daemon-b", Duration::from_secs(1)),
            Err(StoreError::LeaseHeld { .. })
        ));
        // daemon-b's claim is untouched.
        assert_eq!(
            s.lease_holder(&keys[0]).unwrap().as_deref(),
            Some("daemon-b")
        );
    }
);

store_test!(
    a_group_record_is_one_statement_with_its_lease_holder_and_distributor,
    |ts| {
        let s = ts.open();
        group(&s, "g1");
        let before = Store::statements_sent_here();
        let r = s.group_record("g1").unwrap().unwrap();
        assert_eq!(Store::statements_sent_here() - before, 1);
        assert_eq!(r.row.spec.name, "g1-name");
        assert!(!r.deleting && r.lease_holder.is_none() && r.distributor.is_none());
        assert_eq!(r.config_version, s.config_version("g1").unwrap());

        let d = lbscale_engine::model::DistributorSpec {
            name: "td-1".into(),
            cloud: CloudName::Local,
            mode: DistributorMode::Dns,
            domain: Some("td-1.lbscale.test".into()),
            ttl: DeclaredDuration::parse("1s").unwrap(),
        };
        s.insert_distributor("td-1", &d).unwrap();
        let apply = s
            .acquire_lease("g1", "provider-1", Duration::from_secs(30))
            .unwrap();
        s.mark_group_deleting("g1").unwrap();
        let r = s.group_record("g1").unwrap().unwrap();
        assert!(r.deleting);
        assert_eq!(r.lease_holder.as_deref(), Some("provider-1"));
        assert_eq!(r.distributor.map(|d| d.mode), Some(DistributorMode::Dns));
        s.release_lease(&apply).unwrap();
        assert!(s
            .group_record("g1")
            .unwrap()
            .unwrap()
            .lease_holder
            .is_none());
        assert!(s.group_record("nope").unwrap().is_none());
    }
);

store_test!(
    a_push_records_a_members_configuration_only_over_an_older_ones,
    |ts| {
        let s = ts.open();
        group(&s, "g1");
        let lease = s
            .acquire_lease(
                &az_lease_key("g1", "az1"),
                "engine-a",
                Duration::from_secs(30),
            )
            .unwrap();
        let n = NodeRow {
            id: "n1".into(),
            group_id: "g1".into(),
            az: "az1".into(),
            seq: 1,
            state: NodeState::Joining,
            private_ip: "127.0.0.9".into(),
            public_ip: None,
            registered: false,
            handle: serde_json::json!({"pid": 7}),
            created_at: 0,
        };
        s.insert_node(&n).unwrap();
        let pushed = |fence: serde_json::Value, fingerprint: &str| {
            let mut n = n.clone();
            n.handle[CONFIG_FENCE] = fence;
            n.handle["config_fingerprint"] = fingerprint.into();
            n
        };
        let row = |s: &Store| s.nodes_of_group("g1").unwrap().remove(0);
        // A row no push recorded yet takes any record; a newer push's lands
        // over an older one's, and the same push's again.
        assert!(s
            .record_config_under(&lease, &pushed(1_000.into(), "a"))
            .unwrap());
        assert!(s
            .record_config_under(&lease, &pushed(2_000.into(), "b"))
            .unwrap());
        assert!(s
            .record_config_under(&lease, &pushed(2_000.into(), "b"))
            .unwrap());
        // An older push's does not.
        assert!(!s
            .record_config_under(&lease, &pushed(1_500.into(), "c"))
            .unwrap());
        // The record writes the handle alone.
        assert_eq!(
            (
                row(&s).handle["config_fingerprint"].clone(),
                row(&s).state,
                row(&s).registered
            ),
            ("b".into(), NodeState::Joining, false)
        );
        // Activation and registration each once; registration only of an
        // active node.
        assert!(!s.register_node_under(&lease, "n1").unwrap());
        assert!(s.activate_node_under(&lease, "n1").unwrap());
        assert!(!s.activate_node_under(&lease, "n1").unwrap());
        assert!(s.register_node_under(&lease, "n1").unwrap());
        assert!(!s.register_node_under(&lease, "n1").unwrap());
        assert!(row(&s).registered);
        // A stored fence that is no whole number (a hand-edited row) fails no
        // statement: a string counts as none, a number as itself.
        for (odd, newer_lands) in [
            (serde_json::json!("soon"), true),
            (serde_json::json!(1e19), false),
            (serde_json::json!(2_000.5), false),
            (serde_json::json!(1_999.5), true),
        ] {
            let mut edited = row(&s);
            edited.handle[CONFIG_FENCE] = odd.clone();
            s.update_node(&edited).unwrap();
            assert_eq!(
                s.record_config_under(&lease, &pushed(2_000.into(), "e"))
                    .unwrap(),
                newer_lands,
                "over a stored {odd}"
            );
        }
        // Nothing once the node left.
        let mut left = row(&s);
        left.state = NodeState::Draining;
        left.registered = false;
        s.update_node(&left).unwrap();
        assert!(!s
            .record_config_under(&lease, &pushed(3_000.into(), "d"))
            .unwrap());
        assert!(!s.activate_node_under(&lease, "n1").unwrap());
        assert!(!s.register_node_under(&lease, "n1").unwrap());
        assert_eq!(
            (row(&s).state, row(&s).registered),
            (NodeState::Draining, false)
        );
    }
);
