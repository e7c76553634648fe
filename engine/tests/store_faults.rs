//! The store under faults: hosts whose clocks disagree, a PostgreSQL server
//! that stops answering, and a store that grows for months.
//!
//! The stalled-server tests reach the test server through a relay that stops
//! relaying (`store_testing::Link`): the store's calls get no answer, as from
//! a stalled server or over a half-open socket, while the server runs on.

use lbscale_engine::reconcile::KeptLease;
use lbscale_engine::store::{daemon_claim_key, EventRetention, Store, StoreError};
use lbscale_engine::store_test;
use lbscale_engine::store_testing::{
    backends_named, block_on, postgres_admin_url, with_pg_client, Kind, Link, TestStore,
};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn group(s: &Store, id: &str) {
    let spec: lbscale_engine::model::GroupSpec = serde_json::from_value(serde_json::json!({
        "name": format!("{id}-name"),
        "cloud": "local",
        "availability_zones": ["az1"],
        "traffic_distributor_id": "td-1",
        "min_nodes": 1,
        "max_nodes": 3,
        "stats_interval": "1s",
        "watch_time": "2s",
        "cooldown": "20s",
        "drain_timeout": "2s",
        "thresholds": [],
        "node": null,
        "apply_timeout": "5m",
    }))
    .expect("a group spec");
    s.insert_group(id, &spec, "token").unwrap();
}

// A host whose clock runs 30 s fast must not see a live lease as expired, nor
// a slow one see an expired lease as live: expiry is the database's clock.
store_test!(a_host_with_a_fast_clock_cannot_take_a_live_lease, |ts| {
    let a = ts.open();
    let fast = ts.open();
    fast.set_clock_offset_for_tests(30_000);
    let slow = ts.open();
    slow.set_clock_offset_for_tests(-30_000);
    group(&a, "g1");

    let held = a
        .acquire_lease("g1", "apply-a", Duration::from_secs(10))
        .unwrap();
    match fast.acquire_lease("g1", "daemon-fast", Duration::from_secs(10)) {
        Err(StoreError::LeaseHeld {
            holder,
            expires_in_ms,
            ..
        }) => {
            assert_eq!(holder, "apply-a");
            // What is left, by the database's clock, not 30 s less.
            assert!(
                (5_000..=10_000).contains(&expires_in_ms),
                "{expires_in_ms} ms left"
            );
        }
        other => panic!("a host 30 s ahead took a lease held for 10 s: {other:?}"),
    }
    // Nor the claim kind of lease, nor through a renewal of a lease it never had.
    let claim = a
        .acquire_lease(&daemon_claim_key("g1"), "daemon-a", Duration::from_secs(10))
        .unwrap();
    assert!(matches!(
        fast.acquire_lease(
            &daemon_claim_key("g1"),
            "daemon-fast",
            Duration::from_secs(10)
        ),
        Err(StoreError::LeaseHeld { .. })
    ));
    fast.check_lease(&held).unwrap();
    fast.check_lease(&claim).unwrap();

    // A short lease expires by the database's clock for the slow host too.
    group(&a, "g2");
    let short = a
        .acquire_lease("g2", "apply-a", Duration::from_millis(300))
        .unwrap();
    assert!(matches!(
        slow.acquire_lease("g2", "slow", Duration::from_secs(10)),
        Err(StoreError::LeaseHeld { .. })
    ));
    std::thread::sleep(Duration::from_millis(400));
    let taken = slow
        .acquire_lease("g2", "slow", Duration::from_secs(10))
        .expect("a host 30 s behind saw an expired lease as live");
    assert!(taken.fence > short.fence);
    // The first holder's renewal of its expired lease fails: it was taken.
    assert!(matches!(
        a.renew_lease(&short, Duration::from_secs(10)),
        Err(StoreError::LeaseLost { .. })
    ));
});

// A fenced write is refused once the claim expired by the database's clock,
// even from a host whose clock says it still runs; and a renewal of an expired
// lease that nobody took is refused too (another lease that excludes it may
// have been granted meanwhile).
store_test!(
    a_write_under_an_expired_claim_is_refused_in_its_statement,
    |ts| {
        let s = ts.open();
        s.set_clock_offset_for_tests(-60_000);
        group(&s, "g1");
        let claim = s
            .acquire_lease(
                &daemon_claim_key("g1"),
                "daemon-a",
                Duration::from_millis(200),
            )
            .unwrap();
        let state = lbscale_core::policy::AzState::new(1);
        block_on(s.put_policy_state(&claim, "g1", "az1", &state)).unwrap();
        std::thread::sleep(Duration::from_millis(300));
        let err = block_on(s.put_policy_state(&claim, "g1", "az1", &state)).unwrap_err();
        assert!(matches!(err, StoreError::LeaseLost { .. }), "{err:?}");
        assert!(matches!(
            s.renew_lease(&claim, Duration::from_secs(10)),
            Err(StoreError::LeaseLost { .. })
        ));
        assert!(matches!(
            s.check_lease(&claim),
            Err(StoreError::LeaseLost { .. })
        ));
    }
);

// Node rows written under a lease are fenced in their statement: once another
// holder took the lease over, the old holder's insert, update and delete
// change nothing.
store_test!(node_writes_under_a_lost_lease_change_nothing, |ts| {
    let s = ts.open();
    let other = ts.open();
    group(&s, "g1");
    let key = lbscale_engine::store::az_lease_key("g1", "az1");
    let mine = s
        .acquire_lease(&key, "daemon-a", Duration::from_millis(300))
        .unwrap();
    let node = |id: &str| lbscale_engine::store::NodeRow {
        id: id.into(),
        group_id: "g1".into(),
        az: "az1".into(),
        seq: 1,
        state: lbscale_engine::store::NodeState::Provisioning,
        private_ip: "127.0.0.9".into(),
        public_ip: None,
        registered: false,
        handle: serde_json::json!({}),
        created_at: 1,
    };
    s.insert_node_under(&mine, &node("n1")).unwrap();
    let mut n1 = node("n1");
    n1.state = lbscale_engine::store::NodeState::Active;
    n1.public_ip = Some("192.0.2.1".into());
    s.update_node_under(&mine, &n1).unwrap();
    assert_eq!(s.nodes_of_group("g1").unwrap(), vec![n1.clone()]);
    // A node that is gone, under a live lease: nothing to do, no error.
    s.update_node_under(&mine, &node("gone")).unwrap();

    std::thread::sleep(Duration::from_millis(400));
    let theirs = other
        .acquire_lease(&key, "daemon-b", Duration::from_secs(30))
        .unwrap();
    let lost = |r: Result<(), StoreError>| {
        assert!(matches!(r, Err(StoreError::LeaseLost { .. })), "{r:?}")
    };
    lost(s.insert_node_under(&mine, &node("n2")));
    let mut stale = n1.clone();
    stale.state = lbscale_engine::store::NodeState::Draining;
    lost(s.update_node_under(&mine, &stale));
    lost(s.delete_node_under(&mine, "n1"));
    assert_eq!(s.nodes_of_group("g1").unwrap(), vec![n1.clone()]);
    // The new holder's writes go through.
    other.delete_node_under(&theirs, "n1").unwrap();
    assert!(s.nodes_of_group("g1").unwrap().is_empty());
});

// The same event again is one row with a count; a group keeps its newest
// events up to the count, and none older than the age.
store_test!(repeated_events_collapse_and_old_ones_go, |ts| {
    let s = ts.open();
    s.set_event_retention(EventRetention {
        max_per_group: 5,
        max_age: Duration::from_secs(3600),
    });
    for _ in 0..50 {
        s.record_event("g1", None, "resume_failed", "cannot reach the node")
            .unwrap();
    }
    let ev = s.events_of_group("g1", 100).unwrap();
    assert_eq!(ev.len(), 1, "{ev:?}");
    assert_eq!(ev[0].count, 50);
    assert!(ev[0].last_ms >= ev[0].time_ms);
    // Another AZ, kind or reason is another row; the same one after it again too.
    s.record_event("g1", Some("az1"), "resume_failed", "cannot reach the node")
        .unwrap();
    s.record_event("g1", Some("az1"), "resume_failed", "another reason")
        .unwrap();
    s.record_event("g1", None, "resume_failed", "cannot reach the node")
        .unwrap();
    let ev = s.events_of_group("g1", 100).unwrap();
    let counts: Vec<u64> = ev.iter().map(|e| e.count).collect();
    assert_eq!(counts, [50, 1, 1, 1]);

    // By count: 30 distinct events leave the newest 5, in order.
    for i in 0..30 {
        s.record_event("g1", None, "scale_out", &format!("breach {i}"))
            .unwrap();
    }
    let reasons: Vec<String> = s
        .events_of_group("g1", 100)
        .unwrap()
        .into_iter()
        .map(|e| e.reason)
        .collect();
    assert_eq!(
        reasons,
        [
            "breach 25",
            "breach 26",
            "breach 27",
            "breach 28",
            "breach 29"
        ]
    );
    assert_eq!(s.count_rows("events").unwrap(), 5);
    // Another group's events are its own.
    s.record_event("g2", None, "scale_out", "x").unwrap();
    assert_eq!(s.events_of_group("g1", 100).unwrap().len(), 5);

    // By age: an event whose last occurrence is older than the age goes at
    // the group's next event (here the writer's clock moves two hours on).
    s.set_clock_offset_for_tests(2 * 3600 * 1000);
    s.record_event("g1", None, "scale_in", "later").unwrap();
    let ev = s.events_of_group("g1", 100).unwrap();
    assert_eq!(ev.len(), 1, "{ev:?}");
    assert_eq!(ev[0].reason, "later");
    assert_eq!(s.events_of_group("g2", 100).unwrap().len(), 1);
});

#[test]
fn retention_settings_are_read_and_bad_ones_named() {
    let d = EventRetention::parse(None, None).unwrap();
    assert_eq!(d, EventRetention::default());
    assert_eq!(d.max_per_group, 1000);
    assert_eq!(d.max_age, Duration::from_secs(30 * 24 * 3600));
    let r = EventRetention::parse(Some("50"), Some("48h")).unwrap();
    assert_eq!(
        (r.max_per_group, r.max_age),
        (50, Duration::from_secs(48 * 3600))
    );
    let e = EventRetention::parse(Some("0"), None)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains(
            "LBSCALE_EVENTS_MAX_PER_GROUP: must be a whole number from 1 to 1000000, got \"0\""
        ),
        "{e}"
    );
    let e = EventRetention::parse(None, Some("a week"))
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with("LBSCALE_EVENTS_MAX_AGE: must be a duration"),
        "{e}"
    );
    let e = EventRetention::parse(None, Some("5s"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("must be at least 1m"), "{e}");
}

// --- a stalled PostgreSQL server ------------------------------------------------

fn backends(ts: &TestStore, app: &str) -> Vec<i32> {
    backends_named(&ts.url, app)
}

/// A multi-threaded runtime of `workers` worker threads (and at most
/// `max_blocking` blocking-pool threads, when given), for the tests that
/// watch what a store call does to it.
fn runtime(workers: usize, max_blocking: Option<usize>) -> tokio::runtime::Runtime {
    let mut b = tokio::runtime::Builder::new_multi_thread();
    b.worker_threads(workers).enable_all();
    if let Some(n) = max_blocking {
        b.max_blocking_threads(n);
    }
    b.build().unwrap()
}

/// Ticks every 20 ms on the runtime for `span`; answers how many ticks there
/// were and the longest gap between two: what a call held the runtime up.
fn ticking_for(span: Duration) -> tokio::task::JoinHandle<(usize, Duration)> {
    tokio::spawn(async move {
        let mut at = vec![Instant::now()];
        while at[0].elapsed() < span {
            tokio::time::sleep(Duration::from_millis(20)).await;
            at.push(Instant::now());
        }
        let gap = at.windows(2).map(|w| w[1] - w[0]).max().unwrap();
        (at.len(), gap)
    })
}

/// A PostgreSQL store whose connections are named `app` and go through a
/// [`Link`] that the test can stall.
fn postgres_store(name: &str) -> Option<(TestStore, String, Link, Arc<Store>)> {
    let ts = TestStore::new(Kind::Postgres, name)?;
    let app = format!("lbt-{name}-{}", std::process::id());
    let link = Link::to(&ts.url);
    let s = Store::open_url(&format!("{}?application_name={app}", link.url), &ts.dir).unwrap();
    Some((ts, app, link, Arc::new(s)))
}

// A call on a stalled connection fails at its deadline, holds up no other
// call of the process meanwhile, and the health probe says so in time.
#[test]
fn a_stalled_postgres_connection_holds_up_only_its_own_call() {
    let Some((ts, app, link, s)) = postgres_store("stalled_call") else {
        return;
    };
    group(&s, "g1");
    // The store's connections reach the server, through the link.
    assert!(!backends(&ts, &app).is_empty());
    {
        let _stall = link.stall();
        let t = Instant::now();
        let err = s.probe(Duration::from_secs(2)).unwrap_err();
        assert!(matches!(err, StoreError::Unreachable(_)), "{err:?}");
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "the probe took {:?}",
            t.elapsed()
        );
        assert!(
            err.to_string().starts_with("the store is unreachable"),
            "{err}"
        );
    }
    // The link relays again; the store works again, with what it had.
    let t = Instant::now();
    loop {
        match s.probe(Duration::from_secs(2)) {
            Ok(()) => break,
            Err(e) if t.elapsed() < Duration::from_secs(30) => {
                eprintln!("after the stall: {e}");
                std::thread::sleep(Duration::from_millis(200));
            }
            Err(e) => panic!("the store did not come back after the stall: {e}"),
        }
    }
    assert!(s.group("g1").unwrap().is_some());

    // One stalled call holds no process-wide lock: while a call waits on a
    // stalled connection, another call of the same store says the store is
    // unreachable within its own deadline, not after the first's (20 s); when
    // it has to open a connection (the first took the idle one), within its
    // deadline too, not a whole connect timeout (30 s).
    let stall = link.stall();
    let busy = s.clone();
    let stuck = std::thread::spawn(move || {
        let t = Instant::now();
        (busy.group("g1").map(|g| g.is_some()), t.elapsed())
    });
    std::thread::sleep(Duration::from_millis(300));
    let t = Instant::now();
    let probed = s.probe(Duration::from_secs(2));
    let waited = t.elapsed();
    drop(stall);
    let (first, first_took) = stuck.join().unwrap();
    eprintln!("probe {probed:?} after {waited:?}; first call {first:?} after {first_took:?}");
    assert!(
        matches!(probed, Err(StoreError::Unreachable(_))),
        "{probed:?}"
    );
    assert!(
        waited < Duration::from_secs(10),
        "a call waited {waited:?} behind a stalled one"
    );
}

// A kept lease whose renewals cannot reach the store stops its work within
// the lease's TTL, by this host's clock alone; another holder then takes the
// lease by the database's clock, and the first one, resumed, cannot renew it.
#[test]
fn a_kept_lease_that_cannot_be_renewed_stops_its_work_within_its_ttl() {
    let Some((ts, _app, link, s)) = postgres_store("kept_lease") else {
        return;
    };
    let other = ts.open();
    group(&s, "g1");
    let rt = runtime(2, None);
    rt.block_on(async move {
        let ttl = Duration::from_secs(3);
        let lease = s.acquire_lease("g1", "first", ttl).unwrap();
        let kept = KeptLease::keep(s.clone(), lease.clone(), ttl);
        // Renewed past its first TTL while the store answers.
        tokio::time::sleep(ttl + Duration::from_secs(1)).await;
        kept.check().expect("the renewed lease is still ours");
        let stall = link.stall();
        let t = Instant::now();
        while !kept.is_lost() {
            assert!(
                t.elapsed() < ttl + Duration::from_secs(2),
                "the lease still counted as held {:?} into the stall",
                t.elapsed()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let err = kept.check().unwrap_err();
        assert!(matches!(err, StoreError::LeaseLost { .. }), "{err:?}");
        // Another holder (its own connections run) takes it once it expired.
        let taken = loop {
            match other.acquire_lease("g1", "second", Duration::from_secs(30)) {
                Ok(l) => break l,
                Err(StoreError::LeaseHeld { .. }) if t.elapsed() < Duration::from_secs(15) => {
                    tokio::time::sleep(Duration::from_millis(100)).await
                }
                Err(e) => panic!("the second holder could not take the lease: {e}"),
            }
        };
        assert!(taken.fence > lease.fence);
        drop(stall);
        // Resumed, the first holder stays out.
        let t = Instant::now();
        loop {
            match s.renew_lease(&lease, ttl) {
                Err(StoreError::LeaseLost { .. }) => break,
                Err(e) if t.elapsed() < Duration::from_secs(30) => {
                    eprintln!("after the stall: {e}");
                    tokio::time::sleep(Duration::from_millis(200)).await
                }
                other => panic!("the first holder renewed a lease it lost: {other:?}"),
            }
        }
        assert!(kept.check().is_err());
        other.check_lease(&taken).unwrap();
    });
}

// A store call that waits on a stalled server does not hold up the async
// tasks of the runtime it is called from, even with a single worker thread.
#[test]
fn a_stalled_store_call_does_not_block_the_runtime() {
    let Some((_ts, _app, link, s)) = postgres_store("runtime") else {
        return;
    };
    group(&s, "g1");
    let rt = runtime(1, None);
    let stall = link.stall();
    rt.block_on(async move {
        // Ticks every 20 ms, from before the stalled call until after it.
        let ticks = ticking_for(Duration::from_millis(3500));
        tokio::time::sleep(Duration::from_millis(100)).await;
        let stuck = tokio::spawn(async move {
            let t = Instant::now();
            let r = s.probe(Duration::from_secs(3));
            (r, t.elapsed())
        });
        let (r, took) = stuck.await.unwrap();
        let (count, gap) = ticks.await.unwrap();
        eprintln!("{count} ticks, longest gap {gap:?}; the stalled call {r:?} after {took:?}");
        assert!(r.is_err(), "the probe answered through a stalled link");
        assert!(took >= Duration::from_secs(2), "{took:?}");
        assert!(
            gap < Duration::from_millis(1000),
            "the runtime's only worker was held {gap:?} by the stalled call"
        );
    });
    drop(stall);
}

// The daemon's read of a group (`group_rows`, its statements run on the
// connection's own thread while the caller awaits) gives up at the call's
// deadline on a stalled server, holds up no worker of the runtime meanwhile,
// and does not use the stalled connection again.
#[test]
fn a_stalled_group_read_gives_up_at_its_deadline_and_holds_no_worker() {
    let Some(ts) = TestStore::new(Kind::Postgres, "stalled_group_read") else {
        return;
    };
    let app = format!("lbt-stalled-group-read-{}", std::process::id());
    let link = Link::to(&ts.url);
    // lock_wait 1 s: statement_timeout 6 s, the call's deadline 11 s.
    let s = Store::open_postgres(
        &format!("{}?application_name={app}", link.url),
        &ts.dir,
        Duration::from_secs(1),
    )
    .unwrap();
    group(&s, "g1");
    let rt = runtime(1, None);
    let read = rt
        .block_on(s.group_rows("g1"))
        .unwrap()
        .expect("g1 is there");
    assert_eq!(read.record.row.id, "g1");
    let stall = link.stall();
    let s = Arc::new(s);
    let s2 = s.clone();
    let (r, took, gap) = rt.block_on(async move {
        let ticks = ticking_for(Duration::from_secs(12));
        let t = Instant::now();
        let r = s2.group_rows("g1").await;
        let took = t.elapsed();
        let (_, gap) = ticks.await.unwrap();
        (r, took, gap)
    });
    eprintln!("the stalled read {r:?} after {took:?}; longest gap between ticks {gap:?}");
    let err = r.unwrap_err();
    assert!(matches!(err, StoreError::Unreachable(_)), "{err:?}");
    assert!(
        err.to_string().contains("did not answer within 11000 ms"),
        "{err}"
    );
    assert!(took >= Duration::from_secs(10), "gave up after {took:?}");
    assert!(
        gap < Duration::from_millis(1000),
        "the runtime's only worker was held {gap:?} by the stalled read"
    );
    drop(stall);
    // Answered again, on a connection other than the stalled one.
    let t = Instant::now();
    loop {
        match rt.block_on(s.group_rows("g1")) {
            Ok(Some(r)) => {
                assert_eq!(r.record.row.id, "g1");
                break;
            }
            other if t.elapsed() < Duration::from_secs(30) => {
                eprintln!("after the stall: {other:?}");
                std::thread::sleep(Duration::from_millis(200));
            }
            other => panic!("the store did not come back after the stall: {other:?}"),
        }
    }
}

// What the daemon reads and writes at each evaluation (`group_rows`, and in a
// breach streak `put_policy_state`), when it finds every connection of the
// pool busy, waits for one without a thread each: on a runtime with one
// worker and one blocking thread, eight reads and four writes, queued behind
// four writers that wait for the store's write lock, all get their answer
// once the writers are through, and the runtime's other tasks run all along.
#[test]
fn evaluation_reads_and_writes_wait_for_a_busy_pool_without_a_thread_each() {
    let Some((ts, app, _link, s)) = postgres_store("busy_pool") else {
        return;
    };
    group(&s, "g1");
    let claim = s
        .acquire_lease(&daemon_claim_key("g1"), "daemon-a", Duration::from_secs(60))
        .unwrap();
    let lock = ts.hold_write_lock();
    // The pool's four connections, each in a write that waits for the lock.
    let writers: Vec<_> = (0..4)
        .map(|i| {
            let s = s.clone();
            std::thread::spawn(move || group(&s, &format!("w{i}")))
        })
        .collect();
    let waiting = format!(
        "SELECT count(*)::text FROM pg_stat_activity \
         WHERE application_name = '{app}' AND wait_event_type = 'Lock'"
    );
    let t = Instant::now();
    while ts.raw_text(&waiting).as_deref() != Some("4") {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "the four writers were not all waiting for the lock within 10 s"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let rt = runtime(1, Some(1));
    let held = Duration::from_millis(2000);
    let s2 = s.clone();
    let (answers, written, waited, gap) = rt.block_on(async move {
        let s = s2;
        let ticks = ticking_for(held + Duration::from_millis(1000));
        let reads: Vec<_> = (0..8)
            .map(|_| {
                let s = s.clone();
                tokio::spawn(async move { s.group_rows("g1").await })
            })
            .collect();
        let writes: Vec<_> = (0..4)
            .map(|i| {
                let (s, claim) = (s.clone(), claim.clone());
                let mut state = lbscale_core::policy::AzState::new(1);
                state.out_streak = [i + 1, 0, 0];
                tokio::spawn(async move {
                    s.put_policy_state(&claim, "g1", &format!("az{i}"), &state)
                        .await
                })
            })
            .collect();
        tokio::time::sleep(held).await;
        // Every call still waits for a connection: the pool was busy.
        let waited = reads.iter().filter(|r| !r.is_finished()).count()
            + writes.iter().filter(|w| !w.is_finished()).count();
        drop(lock);
        let mut answers = Vec::new();
        for r in reads {
            answers.push(r.await.unwrap());
        }
        let mut written = Vec::new();
        for w in writes {
            written.push(w.await.unwrap());
        }
        let (_, gap) = ticks.await.unwrap();
        (answers, written, waited, gap)
    });
    for w in writers {
        w.join().unwrap();
    }
    eprintln!("{waited} of 12 calls waited behind a busy pool; longest gap between ticks {gap:?}");
    assert_eq!(waited, 12, "calls answered while every connection was busy");
    for a in answers {
        let rows = a.unwrap().expect("g1 is there");
        assert_eq!(rows.record.row.id, "g1");
    }
    for w in written {
        w.expect("the policy state is written under a live claim");
    }
    let streaks: Vec<(String, u32)> = s
        .policy_states("g1")
        .unwrap()
        .into_iter()
        .map(|r| (r.az, r.state.out_streak[0]))
        .collect();
    assert_eq!(
        streaks,
        (0..4u32)
            .map(|i| (format!("az{i}"), i + 1))
            .collect::<Vec<_>>()
    );
    assert!(
        gap < Duration::from_millis(1000),
        "the runtime's only worker was held {gap:?} by reads waiting for a connection"
    );
}

// A connection that the server closed (a restart, an administrator) is opened
// again at the next call; when that fails, the daemon's read says why rather
// than only that the connection is closed, and once the server takes
// connections again the read answers.
#[test]
fn a_read_after_a_failed_reconnect_says_why() {
    let Some((ts, app, _link, s)) = postgres_store("reconnect_refused") else {
        return;
    };
    let admin = postgres_admin_url("reconnect_refused").expect("the test server");
    group(&s, "g1");
    let rt = runtime(1, None);
    rt.block_on(s.group_rows("g1"))
        .unwrap()
        .expect("g1 is there");
    let db = ts.raw_text("SELECT current_database()").unwrap();
    let (close, db2) = (
        format!(
            "ALTER DATABASE {db} ALLOW_CONNECTIONS false; \
             SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = '{app}'"
        ),
        db.clone(),
    );
    with_pg_client(&admin, move |c| c.batch_execute(&close)).unwrap();
    // The first read may be the one to find the connection closed; the one
    // after it tries to open it again.
    let errors: Vec<String> = (0..3)
        .map(|_| match rt.block_on(s.group_rows("g1")) {
            Ok(r) => panic!("read {r:?} from a database that takes no connections"),
            Err(e) => e.to_string(),
        })
        .collect();
    let reopen = format!("ALTER DATABASE {db2} ALLOW_CONNECTIONS true");
    with_pg_client(&admin, move |c| c.batch_execute(&reopen)).unwrap();
    eprintln!("the reads while the database took no connections: {errors:#?}");
    assert!(
        errors
            .iter()
            .any(|e| e.contains("is not currently accepting connections")),
        "no read named the reconnect's failure: {errors:#?}"
    );
    let rows = rt
        .block_on(s.group_rows("g1"))
        .unwrap()
        .expect("g1 is there");
    assert_eq!(rows.record.row.id, "g1");
}
