//! Every workflow step against a cloud that misbehaves on purpose: the local
//! cloud (real `lbscale-node` processes, a real DNS distributor) behind the
//! test cloud of `lbscale_engine::cloud::faulty`, whose chosen call refuses,
//! times out, answers late or loses its answer. Each test says what the engine
//! must do then: retry the call with back-off (idempotent calls), or stop at
//! that step with its error; leave no node process without its row, and no row
//! without its node; and record the step's events.

use lbscale_cloud_local::LocalSettings;
use lbscale_engine::cloud::faulty::{Call, Fault, Faults};
use lbscale_engine::cloud::Clouds;
use lbscale_engine::model::{
    CloudName, DeclaredDuration, DistributorMode, DistributorSpec, GroupSpec, Metric, SeGroupSpec,
    ThresholdSpec,
};
use lbscale_engine::nodeapi::auth::{node_credentials, NodeCredentials};
use lbscale_engine::store::{NodeRow, NodeState, CONFIG_FENCE};
use lbscale_engine::store_testing::vserver_spec;
use lbscale_engine::{Engine, EngineError};
use lbscale_proto::node_api_server::{NodeApi, NodeApiServer};
use lbscale_proto::{
    ConfigureReply, DrainReply, DrainRequest, NodeConfig, NodeStats, StatsRequest,
};
use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// The workspace's `lbscale-node`, built next to this test's own binary.
fn node_binary() -> PathBuf {
    if let Ok(p) = std::env::var("LBSCALE_NODE_BIN") {
        return p.into();
    }
    let exe = std::env::current_exe().unwrap();
    let p = exe.parent().unwrap().parent().unwrap().join("lbscale-node");
    assert!(
        p.is_file(),
        "build lbscale-node first (cargo build -p lbscale-node): {} missing",
        p.display()
    );
    p
}

/// An engine on a fresh store whose `local` cloud is behind `faults`, with a
/// `dns` distributor (TTL 1 s) and a group (1 to 3 nodes per AZ) declared, in
/// one AZ unless made [`Stack::with_azs`].
struct Stack {
    engine: Engine,
    faults: Faults,
    dir: PathBuf,
    distributor: String,
    group: String,
    group_name: String,
    azs: Vec<String>,
}

impl Stack {
    /// `prefix`: the test's own loopback range, so that tests run in parallel.
    async fn new(test: &str, prefix: &str) -> Stack {
        Stack::with_azs(test, prefix, &["az1"]).await
    }

    /// [`Stack::new`] with a group in `azs`.
    async fn with_azs(test: &str, prefix: &str, azs: &[&str]) -> Stack {
        let dir =
            std::env::temp_dir().join(format!("lbscale-faults-{test}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let faults = Faults::new();
        let settings = LocalSettings {
            address_prefix: prefix.into(),
            node_binary: Some(node_binary()),
            ..LocalSettings::default()
        };
        let clouds =
            Clouds::new().with("local", faults.wrap(lbscale_cloud_local::drivers(settings)));
        let url = format!("sqlite://{}", dir.join("state.db").display());
        let engine = Engine::open(&url, &dir, clouds).unwrap();
        let distributor = engine
            .create_distributor(&DistributorSpec {
                name: format!("{test}-d"),
                cloud: CloudName::Local,
                mode: DistributorMode::Dns,
                domain: Some(format!("{test}.lbscale.test")),
                ttl: DeclaredDuration::parse("1s").unwrap(),
            })
            .await
            .expect("create the distributor");
        let group_name = test.replace('_', "-");
        let group = engine
            .declare_group(&GroupSpec {
                name: group_name.clone(),
                cloud: CloudName::Local,
                availability_zones: azs.iter().map(|az| az.to_string()).collect(),
                traffic_distributor_id: distributor.clone(),
                min_nodes: 1,
                max_nodes: 3,
                stats_interval: DeclaredDuration::parse("1s").unwrap(),
                watch_time: DeclaredDuration::parse("2s").unwrap(),
                cooldown: DeclaredDuration::parse("2s").unwrap(),
                drain_timeout: DeclaredDuration::parse("1s").unwrap(),
                thresholds: vec![ThresholdSpec {
                    metric: Metric::Cpu,
                    min: 10.0,
                    max: 70.0,
                }],
                node: None,
                apply_timeout: DeclaredDuration::parse("60s").unwrap(),
            })
            .expect("declare the group");
        faults.forget_log();
        Stack {
            engine,
            faults,
            dir,
            distributor,
            group,
            group_name,
            azs: azs.iter().map(|az| az.to_string()).collect(),
        }
    }

    /// A stack whose group is up (one active node).
    async fn up(test: &str, prefix: &str) -> Stack {
        let s = Stack::new(test, prefix).await;
        s.engine
            .reconcile_group(&s.group)
            .await
            .expect("bring the group up");
        assert_eq!(s.serving().len(), 1);
        s.faults.forget_log();
        s
    }

    fn rows(&self) -> Vec<lbscale_engine::store::NodeRow> {
        self.engine.node_rows(&self.group).unwrap()
    }

    /// Ids of the nodes that are active and registered in the store.
    fn serving(&self) -> Vec<String> {
        self.rows()
            .into_iter()
            .filter(|n| n.state == NodeState::Active && n.registered)
            .map(|n| n.id)
            .collect()
    }

    /// Node ids of the running `lbscale-node` processes of this group.
    fn processes(&self) -> BTreeSet<String> {
        self.node_pids().into_keys().collect()
    }

    /// The running `lbscale-node` processes of this group, by node id.
    fn node_pids(&self) -> BTreeMap<String, u32> {
        let mut out = BTreeMap::new();
        for e in std::fs::read_dir("/proc").unwrap().flatten() {
            let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
                continue;
            };
            let Ok(cmd) = std::fs::read(e.path().join("cmdline")) else {
                continue;
            };
            let args: Vec<String> = cmd
                .split(|b| *b == 0)
                .map(|a| String::from_utf8_lossy(a).into_owned())
                .collect();
            if let Some(i) = args.iter().position(|a| a == "--node-id") {
                if let Some(id) = args.get(i + 1).filter(|id| self.names_a_node(id)) {
                    out.insert(id.clone(), pid);
                }
            }
        }
        out
    }

    /// Nothing left behind: every node process of the group has its row and
    /// every row its process, and no node directory outlives its row.
    /// Whether `id` is a node id of this stack's group: the AZ too, since one
    /// test's group name may begin another's.
    fn names_a_node(&self, id: &str) -> bool {
        self.azs
            .iter()
            .any(|az| id.starts_with(&format!("{}-{az}-", self.group_name)))
    }

    fn assert_consistent(&self, when: &str) {
        let rows: BTreeSet<String> = self.rows().into_iter().map(|n| n.id).collect();
        assert_eq!(
            self.processes(),
            rows,
            "{when}: node processes vs node rows"
        );
        let dirs: BTreeSet<String> = std::fs::read_dir(self.dir.join("local").join("nodes"))
            .map(|d| {
                d.flatten()
                    .filter_map(|e| e.file_name().to_str().map(str::to_string))
                    .filter(|n| self.names_a_node(n))
                    .collect()
            })
            .unwrap_or_default();
        assert!(
            dirs.is_subset(&rows),
            "{when}: node directories {dirs:?} without rows {rows:?}"
        );
    }

    fn event_kinds(&self) -> Vec<String> {
        let mut e = self.engine.events(&self.group, 200).unwrap();
        e.sort_by_key(|e| e.time_ms);
        e.into_iter().map(|e| e.kind).collect()
    }

    /// The local distributor's configuration file (what its DNS server serves).
    fn distributor_config(&self) -> PathBuf {
        self.dir
            .join("local")
            .join("distributors")
            .join(&self.distributor)
            .join("config.json")
    }

    /// Kills the node process with exactly this `--node-id`, as a crash would.
    fn kill_node(&self, node_id: &str) {
        for e in std::fs::read_dir("/proc").unwrap().flatten() {
            let Ok(cmd) = std::fs::read(e.path().join("cmdline")) else {
                continue;
            };
            let args: Vec<&[u8]> = cmd.split(|b| *b == 0).collect();
            if args
                .windows(2)
                .any(|w| w[0] == b"--node-id" && w[1] == node_id.as_bytes())
            {
                let pid = e.file_name().to_string_lossy().into_owned();
                let ok = std::process::Command::new("kill")
                    .args(["-KILL", &pid])
                    .status()
                    .unwrap()
                    .success();
                assert!(ok, "kill {pid} ({node_id})");
                return;
            }
        }
        panic!("no process of node {node_id}");
    }

    /// The addresses the distributor hands out now: those of the last
    /// configuration its DNS server took (publish waits for that).
    fn published(&self) -> Vec<String> {
        let path = self.distributor_config();
        let config: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        config["zones"][0]["addresses"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|v| v.as_str().map(str::to_string))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// The calls of `call` so far were made again after pauses that grow.
    fn assert_backed_off(&self, call: Call, failures: usize) {
        let calls = self.faults.calls(call);
        assert!(
            calls.len() > failures,
            "{call:?}: {} calls for {failures} failures: {calls:?}",
            calls.len()
        );
        let gaps: Vec<Duration> = calls.windows(2).map(|w| w[1].at - w[0].at).collect();
        for (i, g) in gaps.iter().take(failures).enumerate() {
            // 0.25 s, then twice the last (less a little for the clock).
            let floor = Duration::from_millis(240) * 2u32.pow(i as u32);
            assert!(
                *g >= floor,
                "{call:?}: retry {} came after {g:?}, before {floor:?}",
                i + 1
            );
        }
    }
}

impl Drop for Stack {
    fn drop(&mut self) {
        // Stop whatever the test left running (its group and its distributor).
        self.faults.clear();
        let rt = tokio::runtime::Handle::current();
        let (engine, group, d) = (&self.engine, self.group.clone(), self.distributor.clone());
        let deleted = tokio::task::block_in_place(|| {
            rt.block_on(async {
                // What stands on the group first, or its delete waits for it.
                let store = engine.testing_store();
                for v in store.vservers_of_group(&group).unwrap_or_default() {
                    let _ = engine.delete_vserver(&v.id).await;
                }
                for se in store.se_groups_of_group(&group).unwrap_or_default() {
                    let _ = engine.delete_se_group(&se.id).await;
                }
                let group = engine.delete_group(&group).await;
                let _ = engine.delete_distributor(&d).await;
                group
            })
        });
        // A test that moved the store under the engine (a lost lease, rows
        // with no process) can make the delete fail: its nodes must not
        // outlive the test all the same.
        let left = self.node_pids();
        if !left.is_empty() {
            eprintln!(
                "{}: delete_group left {left:?} running ({:?}); killing them",
                self.group_name,
                deleted.err()
            );
            for pid in left.values() {
                let _ = std::process::Command::new("kill")
                    .args(["-9", &pid.to_string()])
                    .status();
            }
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn step_of(e: &EngineError) -> String {
    e.to_string()
}

// --- reconcile: top-up to min_nodes ------------------------------------------

#[tokio::test(flavor = "multi_thread")]
async fn top_up_whose_provisioning_is_refused_leaves_nothing_and_the_next_run_completes() {
    let s = Stack::new("flt_prov_refused", "127.81.").await;
    s.faults.inject(Call::Provision, Fault::Refuse, 1);
    let e = s.engine.reconcile_group(&s.group).await.unwrap_err();
    assert!(step_of(&e).contains("provision node"), "{e}");
    // Not repeated in place: a provisioning is not idempotent.
    assert_eq!(s.faults.calls(Call::Provision).len(), 1);
    assert!(
        s.rows().is_empty(),
        "a row outlived a refused provisioning: {:?}",
        s.rows()
    );
    s.assert_consistent("after the refusal");
    assert!(s.event_kinds().contains(&"node_provisioning".to_string()));

    s.engine
        .reconcile_group(&s.group)
        .await
        .expect("the next run");
    assert_eq!(s.serving().len(), 1);
    assert_eq!(s.published().len(), 1);
    s.assert_consistent("after the next run");
}

#[tokio::test(flavor = "multi_thread")]
async fn top_up_whose_provisioning_answer_is_lost_removes_the_node_it_made() {
    let s = Stack::new("flt_prov_lost", "127.82.").await;
    // The node is started; the engine hears an error.
    s.faults.inject(Call::Provision, Fault::Lost, 1);
    let e = s.engine.reconcile_group(&s.group).await.unwrap_err();
    assert!(step_of(&e).contains("provision node"), "{e}");
    assert_eq!(
        s.faults.calls(Call::Deprovision).len(),
        1,
        "{:?}",
        s.faults.log()
    );
    assert!(s.rows().is_empty(), "{:?}", s.rows());
    s.assert_consistent("after the lost answer");

    s.engine
        .reconcile_group(&s.group)
        .await
        .expect("the next run");
    assert_eq!(s.serving().len(), 1);
    s.assert_consistent("after the next run");
}

#[tokio::test(flavor = "multi_thread")]
async fn top_up_whose_provisioning_times_out_leaves_nothing() {
    let s = Stack::new("flt_prov_timeout", "127.83.").await;
    s.faults
        .inject(Call::Provision, Fault::Timeout(Duration::from_secs(2)), 1);
    let e = s.engine.reconcile_group(&s.group).await.unwrap_err();
    assert!(step_of(&e).contains("timed out"), "{e}");
    assert!(s.rows().is_empty(), "{:?}", s.rows());
    s.assert_consistent("after the timeout");
    s.engine
        .reconcile_group(&s.group)
        .await
        .expect("the next run");
    assert_eq!(s.serving().len(), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn top_up_whose_provisioning_answers_late_keeps_that_one_node() {
    let s = Stack::new("flt_prov_late", "127.84.").await;
    s.faults
        .inject(Call::Provision, Fault::Late(Duration::from_secs(2)), 1);
    s.engine
        .reconcile_group(&s.group)
        .await
        .expect("a late answer is an answer");
    assert_eq!(s.faults.calls(Call::Provision).len(), 1);
    assert_eq!(s.serving().len(), 1);
    assert_eq!(s.published().len(), 1);
    s.assert_consistent("after a late answer");
    let kinds = s.event_kinds();
    for k in ["node_provisioning", "node_joining"] {
        assert!(kinds.contains(&k.to_string()), "{k} missing from {kinds:?}");
    }
}

// --- reconcile: observing the nodes --------------------------------------------

#[tokio::test(flavor = "multi_thread")]
async fn an_unanswered_liveness_check_is_retried_with_backoff_and_counts_no_node_dead() {
    let s = Stack::up("flt_alive_refused", "127.85.").await;
    let before = s.serving();
    s.faults.inject(Call::Alive, Fault::Refuse, 2);
    s.faults
        .inject(Call::Alive, Fault::Timeout(Duration::from_millis(300)), 1);
    s.engine.reconcile_group(&s.group).await.expect("retried");
    s.assert_backed_off(Call::Alive, 3);
    assert_eq!(
        s.serving(),
        before,
        "a node was replaced on a cloud that did not answer"
    );
    assert!(!s.event_kinds().contains(&"node_failed".to_string()));
    s.assert_consistent("after the retries");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_liveness_check_that_keeps_failing_stops_the_run_and_touches_no_node() {
    let s = Stack::up("flt_alive_down", "127.86.").await;
    let before = s.serving();
    s.faults.inject(Call::Alive, Fault::Refuse, 4);
    let e = s.engine.reconcile_group(&s.group).await.unwrap_err();
    assert!(step_of(&e).contains("refused"), "{e}");
    assert_eq!(s.faults.calls(Call::Alive).len(), 4);
    assert_eq!(s.serving(), before);
    assert_eq!(s.faults.calls(Call::Deprovision).len(), 0);
    s.assert_consistent("after the failed run");
}

// --- scale-out --------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread")]
async fn scale_out_whose_publication_is_refused_is_retried_and_serves_the_node() {
    let s = Stack::up("flt_out_publish", "127.87.").await;
    s.faults.inject(Call::Publish, Fault::Refuse, 2);
    let id = s
        .engine
        .scale_out(&s.group, "az1", "test")
        .await
        .expect("retried");
    s.assert_backed_off(Call::Publish, 2);
    assert!(s.serving().contains(&id));
    assert_eq!(s.published().len(), 2);
    assert!(s.event_kinds().contains(&"scale_out".to_string()));
    s.assert_consistent("after the scale-out");
}

#[tokio::test(flavor = "multi_thread")]
async fn scale_out_whose_provisioning_times_out_leaves_nothing_and_can_run_again() {
    let s = Stack::up("flt_out_timeout", "127.88.").await;
    s.faults
        .inject(Call::Provision, Fault::Timeout(Duration::from_secs(1)), 1);
    scale_out_fails_at_provisioning_and_leaves_nothing(&s).await;
    let id = s
        .engine
        .scale_out(&s.group, "az1", "test")
        .await
        .expect("again");
    assert!(s.serving().contains(&id));
    assert_eq!(s.serving().len(), 2);
    s.assert_consistent("after the second scale-out");
}

/// A cloud that answers a provisioning without the node's address: the node
/// could be neither configured nor reached, so the provisioning fails and the
/// node the cloud made is removed, as after any failed provisioning.
#[tokio::test(flavor = "multi_thread")]
async fn scale_out_whose_node_comes_without_an_address_removes_it() {
    let s = Stack::up("flt_out_no_address", "127.71.").await;
    s.faults.inject(Call::Provision, Fault::NoAddress, 1);
    let e = scale_out_fails_at_provisioning_and_leaves_nothing(&s).await;
    assert!(e.to_string().contains("no private address"), "{e}");
}

/// A scale-out of the stack's one-node group that fails at provisioning and
/// leaves no node, row or process behind: its error.
async fn scale_out_fails_at_provisioning_and_leaves_nothing(s: &Stack) -> EngineError {
    let e = s
        .engine
        .scale_out(&s.group, "az1", "test")
        .await
        .unwrap_err();
    assert!(step_of(&e).contains("provision node"), "{e}");
    assert_eq!(s.rows().len(), 1, "{:?}", s.rows());
    s.assert_consistent("after the failed scale-out");
    e
}

#[tokio::test(flavor = "multi_thread")]
async fn scale_out_whose_publication_stays_down_fails_and_the_next_reconcile_publishes() {
    let s = Stack::up("flt_out_publish_down", "127.89.").await;
    s.faults.inject(Call::Publish, Fault::Refuse, 4);
    let e = s
        .engine
        .scale_out(&s.group, "az1", "test")
        .await
        .unwrap_err();
    assert!(
        step_of(&e).contains("register addresses with the distributor"),
        "{e}"
    );
    assert_eq!(s.faults.calls(Call::Publish).len(), 4);
    s.assert_consistent("after the failed publication");
    let before = s.faults.calls(Call::Publish).len();
    s.engine
        .reconcile_group(&s.group)
        .await
        .expect("the next reconcile");
    assert!(
        s.faults.calls(Call::Publish).len() > before,
        "not published again"
    );
    assert_eq!(s.serving().len(), 2);
    s.assert_consistent("after the next reconcile");
}

// --- scale-in ---------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread")]
async fn scale_in_whose_deprovisioning_is_refused_is_retried_and_removes_the_node() {
    let s = Stack::up("flt_in_deprov", "127.90.").await;
    s.engine.scale_out(&s.group, "az1", "test").await.unwrap();
    s.faults.forget_log();
    s.faults.inject(Call::Deprovision, Fault::Refuse, 2);
    let gone = s
        .engine
        .scale_in_one(&s.group, "az1", "test")
        .await
        .expect("retried");
    s.assert_backed_off(Call::Deprovision, 2);
    assert!(!s.rows().iter().any(|n| n.id == gone));
    assert_eq!(s.serving().len(), 1);
    s.assert_consistent("after the scale-in");
    let kinds = s.event_kinds();
    for k in ["scale_in", "drain_end", "deprovision_start", "node_removed"] {
        assert!(kinds.contains(&k.to_string()), "{k} missing from {kinds:?}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn scale_in_whose_deprovisioning_stays_down_keeps_the_row_and_the_next_reconcile_removes_it()
{
    let s = Stack::up("flt_in_deprov_down", "127.91.").await;
    s.engine.scale_out(&s.group, "az1", "test").await.unwrap();
    s.faults.inject(Call::Deprovision, Fault::Refuse, 4);
    let e = s
        .engine
        .scale_in_one(&s.group, "az1", "test")
        .await
        .unwrap_err();
    assert!(step_of(&e).contains("refused"), "{e}");
    // The node still runs, and its row says it is on its way out.
    let leaving: Vec<_> = s
        .rows()
        .into_iter()
        .filter(|n| !n.state.is_member())
        .collect();
    assert_eq!(leaving.len(), 1, "{:?}", s.rows());
    assert_eq!(leaving[0].state, NodeState::Deprovisioning);
    s.assert_consistent("after the failed deprovisioning");

    s.engine
        .reconcile_group(&s.group)
        .await
        .expect("the next reconcile");
    assert!(!s.rows().iter().any(|n| n.id == leaving[0].id));
    assert_eq!(s.serving().len(), 1);
    s.assert_consistent("after the next reconcile");
}

#[tokio::test(flavor = "multi_thread")]
async fn scale_in_whose_publication_stays_down_stops_before_the_drain() {
    let s = Stack::up("flt_in_publish_down", "127.92.").await;
    s.engine.scale_out(&s.group, "az1", "test").await.unwrap();
    s.faults.inject(Call::Publish, Fault::Refuse, 4);
    let e = s
        .engine
        .scale_in_one(&s.group, "az1", "test")
        .await
        .unwrap_err();
    assert!(
        step_of(&e).contains("register addresses with the distributor"),
        "{e}"
    );
    // Not drained nor removed while clients may still be sent to it.
    assert_eq!(s.faults.calls(Call::Deprovision).len(), 0);
    assert!(!s.event_kinds().contains(&"drain_end".to_string()));
    s.assert_consistent("after the failed publication");

    s.engine
        .reconcile_group(&s.group)
        .await
        .expect("the next reconcile");
    assert_eq!(s.rows().len(), 1, "{:?}", s.rows());
    s.assert_consistent("after the next reconcile");
}

// --- destroy ----------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread")]
async fn destroy_whose_deprovisioning_answer_is_lost_is_retried_and_leaves_nothing() {
    let s = Stack::up("flt_delete_lost", "127.93.").await;
    s.faults.inject(Call::Deprovision, Fault::Lost, 1);
    s.engine.delete_group(&s.group).await.expect("retried");
    assert_eq!(s.faults.calls(Call::Deprovision).len(), 2);
    assert!(s.engine.group_view(&s.group).await.unwrap().is_none());
    assert!(s.rows().is_empty());
    s.assert_consistent("after the destroy");
}

// --- distributors -------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread")]
async fn a_distributor_publication_that_times_out_or_answers_late_is_retried_or_kept() {
    let s = Stack::up("flt_publish_timeout", "127.94.").await;
    s.faults
        .inject(Call::Publish, Fault::Timeout(Duration::from_millis(500)), 1);
    s.faults
        .inject(Call::Publish, Fault::Late(Duration::from_secs(1)), 1);
    s.engine.reconcile_group(&s.group).await.expect("retried");
    s.assert_backed_off(Call::Publish, 1);
    assert_eq!(s.published().len(), 1);
    s.assert_consistent("after the publication");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_distributor_whose_removal_is_refused_is_retried_and_stops() {
    let s = Stack::new("flt_remove_refused", "127.95.").await;
    // The driver's own record of its DNS server: no workflow shows it.
    let runtime = s
        .engine
        .testing_store()
        .distributor_runtime(&s.distributor)
        .unwrap();
    let pid = runtime["pid"].as_u64().expect("the DNS server's pid") as i32;
    s.faults.inject(Call::Remove, Fault::Refuse, 2);
    s.engine
        .delete_distributor(&s.distributor)
        .await
        .expect("retried");
    s.assert_backed_off(Call::Remove, 2);
    assert!(s.engine.distributor_view(&s.distributor).unwrap().is_none());
    assert!(
        !std::path::Path::new(&format!("/proc/{pid}")).exists()
            || std::fs::read(format!("/proc/{pid}/cmdline")).map_or(true, |c| c.is_empty()),
        "the DNS server {pid} outlived its distributor"
    );
}

/// An apply stopped after the engine recorded the distributor (here: its
/// first publication failed) is finished by the next one, which adopts the
/// object of the same name and settings instead of refusing the name.
#[tokio::test(flavor = "multi_thread")]
async fn a_distributor_whose_first_publication_fails_can_be_created_again() {
    let s = Stack::new("flt_create_down", "127.96.").await;
    s.faults.inject(Call::Publish, Fault::Refuse, 4);
    let spec = DistributorSpec {
        name: "flt-create-down-2".into(),
        cloud: CloudName::Local,
        mode: DistributorMode::Dns,
        domain: Some("again.lbscale.test".into()),
        ttl: DeclaredDuration::parse("1s").unwrap(),
    };
    s.engine.create_distributor(&spec).await.unwrap_err();
    let id = s
        .engine
        .create_distributor(&spec)
        .await
        .expect("created again");
    s.engine.delete_distributor(&id).await.unwrap();
}

/// An apply stopped after the engine recorded a group, an SE group and a
/// vserver (before Terraform saved them) is finished by the next apply: each
/// is adopted by name and settings, not refused as a name taken; another
/// object of a taken name with other settings is still refused.
#[tokio::test(flavor = "multi_thread")]
async fn an_interrupted_create_is_adopted_by_name_and_settings() {
    let s = Stack::new("flt_adopt", "127.98.").await;
    let spec = s.engine.group_view(&s.group).await.unwrap().unwrap().spec;
    // The first bring-up failed (the cloud refused every node).
    s.faults.inject(Call::Provision, Fault::Refuse, 4);
    s.engine.reconcile_group(&s.group).await.unwrap_err();
    s.faults.clear();
    let again = s.engine.declare_group(&spec).expect("declared again");
    assert_eq!(again, s.group, "the recorded group is adopted");
    s.engine
        .reconcile_group(&again)
        .await
        .expect("and brought up");
    assert_eq!(s.serving().len(), 1);
    let mut other = spec.clone();
    other.max_nodes = 2;
    let e = s.engine.declare_group(&other).unwrap_err();
    assert!(e.to_string().contains("already exists"), "{e}");

    let se = se_group("flt-adopt-se", &s.group);
    let se_id = s.engine.create_se_group(&se).await.unwrap();
    assert_eq!(s.engine.create_se_group(&se).await.unwrap(), se_id);
    let mut se_other = se.clone();
    se_other.max_scaleout_per_vs = 2;
    let e = s.engine.create_se_group(&se_other).await.unwrap_err();
    assert!(e.to_string().contains("already exists"), "{e}");

    let vs: lbscale_engine::model::VserverSpec = serde_json::from_value(serde_json::json!({
        "name": "flt-adopt-vs", "se_group_id": se_id, "service_type": "TCP", "port": 18990,
        "lb_method": "round_robin", "persistence": "none", "slow_start": null,
        "services": [{"name": "b1", "address": "127.0.0.1", "port": 18991, "weight": 1, "enabled": true}],
    }))
    .unwrap();
    let vs_id = s.engine.create_vserver(&vs).await.unwrap();
    assert_eq!(s.engine.create_vserver(&vs).await.unwrap(), vs_id);
    let mut vs_other = vs.clone();
    vs_other.port = 18992;
    let e = s.engine.create_vserver(&vs_other).await.unwrap_err();
    assert!(e.to_string().contains("already exists"), "{e}");

    s.engine.delete_vserver(&vs_id).await.unwrap();
    s.engine.delete_se_group(&se_id).await.unwrap();
    s.engine.delete_group(&s.group).await.unwrap();
    s.assert_consistent("after the destroy");
}

/// `endpoints` is what the distributor serves (as its driver confirmed), not
/// what the store wants; the publication that failed is unfinished work, which
/// the next settle (the daemon's, at its next interval) finishes.
#[tokio::test(flavor = "multi_thread")]
async fn a_node_whose_publication_failed_is_not_listed_as_served() {
    let s = Stack::up("flt_unpublished", "127.97.").await;
    s.faults.inject(Call::Publish, Fault::Refuse, 4);
    s.engine
        .scale_out(&s.group, "az1", "test")
        .await
        .unwrap_err();
    let mut listed = s
        .engine
        .distributor_view(&s.distributor)
        .unwrap()
        .unwrap()
        .endpoints;
    let mut served = s.published();
    listed.sort();
    served.sort();
    assert_eq!(listed, served, "endpoints vs what the DNS server hands out");
    assert_eq!(served.len(), 1, "the new node is not handed out yet");

    assert!(s.engine.settle_publication(&s.distributor).await.unwrap());
    assert_eq!(s.published().len(), 2, "the joined node is handed out");
    let listed = s
        .engine
        .distributor_view(&s.distributor)
        .unwrap()
        .unwrap()
        .endpoints;
    assert_eq!(listed.len(), 2);
    assert!(
        !s.engine.settle_publication(&s.distributor).await.unwrap(),
        "nothing left to publish"
    );
}

/// A dead node's row is deleted only after a publication without it was
/// confirmed: with the distributor unwritable (its configuration file
/// replaced by a directory), the dead node stays a failed row, and once the
/// file can be written again the next run takes its address out of DNS and
/// only then forgets it.
#[tokio::test(flavor = "multi_thread")]
async fn a_dead_node_leaves_dns_once_the_distributor_can_be_written_again() {
    let s = Stack::up("flt_unwritable", "127.78.").await;
    s.engine.scale_out(&s.group, "az1", "test").await.unwrap();
    assert_eq!(s.serving().len(), 2);
    let dead = s.rows().into_iter().max_by_key(|n| n.seq).unwrap();
    assert!(s.published().contains(&dead.private_ip));
    let config = s.distributor_config();
    let saved = std::fs::read(&config).unwrap();
    std::fs::remove_file(&config).unwrap();
    std::fs::create_dir(&config).unwrap();
    s.kill_node(&dead.id);

    s.engine
        .reconcile_group(&s.group)
        .await
        .expect_err("the distributor cannot be written");
    let row = s.rows().into_iter().find(|n| n.id == dead.id);
    let row = row.expect("the dead node's row stays until DNS is without it");
    assert_eq!((row.state, row.registered), (NodeState::Failed, false));
    // The daemon's comparison from an evaluation's snapshot sees it too.
    let snap = s.engine.group_snapshot(&s.group).await.unwrap().unwrap();
    assert_eq!(s.engine.publication_settled_in(&snap).unwrap(), Some(false));

    std::fs::remove_dir(&config).unwrap();
    std::fs::write(&config, saved).unwrap();
    assert!(
        s.published().contains(&dead.private_ip),
        "still the old answer"
    );
    s.engine.reconcile_group(&s.group).await.unwrap();
    assert!(!s.published().contains(&dead.private_ip), "out of DNS");
    assert!(s.rows().iter().all(|n| n.id != dead.id), "row forgotten");
    assert!(!s.engine.settle_publication(&s.distributor).await.unwrap());
    let snap = s.engine.group_snapshot(&s.group).await.unwrap().unwrap();
    assert_eq!(s.engine.publication_settled_in(&snap).unwrap(), Some(true));
    s.assert_consistent("after the dead node left");
}

/// A scale-out that read the group and then, before it took its AZ's lease,
/// was overtaken by `terraform destroy`: its lease is refused because the
/// group is gone, so nothing of the group is left (no node process, row,
/// directory, nor even an expired lease row).
#[tokio::test(flavor = "multi_thread")]
async fn a_scale_out_waiting_for_its_az_while_the_group_is_destroyed_leaves_nothing() {
    let s = Stack::up("flt_destroy_race", "127.79.").await;
    let store = s.engine.testing_store().clone();
    // The scale-out has read the group and is held before it takes its AZ's
    // lease; the destroy runs to its end meanwhile.
    let held = lbscale_engine::fault::holds::hold("scale_out_before_lease", &s.group);
    let scaling = tokio::time::timeout(
        Duration::from_secs(60),
        s.engine.scale_out(&s.group, "az1", "test"),
    );
    let destroying = async {
        tokio::time::timeout(Duration::from_secs(30), held.reached())
            .await
            .expect("the scale-out reached the point before its lease within 30 s");
        s.engine
            .delete_group(&s.group)
            .await
            .expect("the group is destroyed");
        held.release();
    };
    let (out, ()) = tokio::join!(scaling, destroying);
    match out.expect("the scale-out ended within 60 s") {
        Err(EngineError::NotFound(what)) => assert!(what.contains(&s.group), "{what}"),
        other => panic!("a scale-out of a destroyed group went on: {other:?}"),
    }
    // Its lease was refused, so not even an expired lease row is left.
    assert_eq!(store.rows_mentioning(&s.group).unwrap(), 0);
    assert!(
        s.processes().is_empty(),
        "node processes left: {:?}",
        s.processes()
    );
    s.assert_consistent("after the destroy");
}

/// A destroy that stopped half-way (its apply killed while the group's node
/// waited out the TTL) is finished, not undone: nothing but the deletion acts
/// on the group from then on (an apply's reconcile and a scale-out are
/// refused, so no resume tops the group back up), and the next destroy (or
/// the daemon) completes it.
#[tokio::test(flavor = "multi_thread")]
async fn a_destroy_that_stopped_half_way_is_finished_not_undone() {
    let s = Stack::up("flt_destroy_stopped", "127.80.").await;
    let stopped =
        tokio::time::timeout(Duration::from_millis(700), s.engine.delete_group(&s.group)).await;
    assert!(stopped.is_err(), "the destroy was still waiting (TTL 1 s)");
    assert!(s.engine.group_being_deleted(&s.group).unwrap());
    let e = s.engine.reconcile_group(&s.group).await.unwrap_err();
    assert!(e.to_string().contains("is being destroyed"), "{e}");
    let e = s
        .engine
        .scale_out(&s.group, "az1", "test")
        .await
        .unwrap_err();
    assert!(e.to_string().contains("is being destroyed"), "{e}");
    s.engine.delete_group(&s.group).await.expect("finished");
    assert!(!s.engine.group_being_deleted(&s.group).unwrap());
    assert!(
        s.processes().is_empty(),
        "node processes left: {:?}",
        s.processes()
    );
    s.assert_consistent("after the destroy was finished");
}

// --- drain ---------------------------------------------------------------------

/// A node management API on loopback, where the leaving node's row says its
/// node is: it refuses its first calls (as an overloaded node, or something in
/// front of it, may) or never answers, then says there are no connections.
/// A stand-in, because what is tested is the engine's side of a drain.
#[derive(Clone)]
struct StandInNode {
    refusals: usize,
    stall: bool,
    calls: Arc<AtomicUsize>,
}

impl StandInNode {
    fn new(refusals: usize, stall: bool) -> StandInNode {
        StandInNode {
            refusals,
            stall,
            calls: Arc::default(),
        }
    }

    /// Serves on `ip` at the nodes' API port with node `c`'s credentials (the
    /// engine takes no other node for it); returns once it listens.
    async fn serve(&self, ip: &str, port: u16, c: &NodeCredentials) {
        use tonic::transport::{Certificate, Identity, ServerTlsConfig};
        let addr: std::net::SocketAddr = format!("{ip}:{port}").parse().unwrap();
        let service = NodeApiServer::new(self.clone());
        let tls = ServerTlsConfig::new()
            .identity(Identity::from_pem(&c.cert_pem, &c.key_pem))
            .client_ca_root(Certificate::from_pem(&c.ca_pem));
        tokio::spawn(
            tonic::transport::Server::builder()
                .tls_config(tls)
                .unwrap()
                .add_service(service)
                .serve(addr),
        );
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while tokio::net::TcpStream::connect(addr).await.is_err() {
            assert!(
                std::time::Instant::now() < deadline,
                "the stand-in API did not listen on {addr}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    async fn answer(&self) -> Result<u64, tonic::Status> {
        let n = self.calls.fetch_add(1, Ordering::SeqCst);
        if self.stall {
            std::future::pending::<()>().await;
        }
        if n < self.refusals {
            return Err(tonic::Status::internal("stand-in: connections unavailable"));
        }
        Ok(0)
    }
}

#[tonic::async_trait]
impl NodeApi for StandInNode {
    async fn configure(
        &self,
        _: tonic::Request<NodeConfig>,
    ) -> Result<tonic::Response<ConfigureReply>, tonic::Status> {
        Err(tonic::Status::unimplemented(
            "the stand-in takes no configuration",
        ))
    }
    async fn drain(
        &self,
        _: tonic::Request<DrainRequest>,
    ) -> Result<tonic::Response<DrainReply>, tonic::Status> {
        let active_connections = self.answer().await?;
        Ok(tonic::Response::new(DrainReply { active_connections }))
    }
    async fn get_stats(
        &self,
        _: tonic::Request<StatsRequest>,
    ) -> Result<tonic::Response<NodeStats>, tonic::Status> {
        let active_connections = self.answer().await?;
        Ok(tonic::Response::new(NodeStats {
            active_connections,
            ..NodeStats::default()
        }))
    }
}

/// How the leaving node's drain went: how long after the TTL its
/// deprovisioning began, and what the drain's event said.
struct DrainSeen {
    after_ttl_ms: i64,
    reason: String,
}

/// Scales out to two nodes, points the newest one's row at `ip` (where
/// `api` serves as that node, or nothing), and scales in: the real node
/// process still runs, so the cloud says the node is there while its API fails.
async fn scale_in_through(s: &Stack, ip: &str, api: Option<&StandInNode>) -> DrainSeen {
    s.engine.scale_out(&s.group, "az1", "test").await.unwrap();
    let mut newest = s.rows().into_iter().max_by_key(|n| n.seq).unwrap();
    if let Some(api) = api {
        let secret = s.engine.group_token(&s.group).unwrap();
        api.serve(ip, 9990, &node_credentials(&secret, &newest.id).unwrap())
            .await;
    }
    newest.private_ip = ip.into();
    s.engine.testing_store().update_node(&newest).unwrap();
    let gone = s
        .engine
        .scale_in_one(&s.group, "az1", "test")
        .await
        .expect("the scale-in");
    assert_eq!(gone, newest.id);
    s.assert_consistent("after the scale-in");
    let mut events = s.engine.events(&s.group, 200).unwrap();
    events.sort_by_key(|e| e.time_ms);
    let last = |kind: &str| {
        events
            .iter()
            .rev()
            .find(|e| e.kind == kind)
            .unwrap_or_else(|| panic!("no {kind} event"))
    };
    DrainSeen {
        after_ttl_ms: last("deprovision_start").time_ms - last("ttl_end").time_ms,
        reason: last("drain_end").reason.clone(),
    }
}

/// The stack's drain timeout (1 s), less the store clock's rounding.
const DRAIN_MS: i64 = 990;

#[tokio::test(flavor = "multi_thread")]
async fn a_node_whose_connections_query_fails_is_drained_until_the_deadline() {
    let s = Stack::up("flt_drain_refused", "127.98.").await;
    let api = StandInNode::new(usize::MAX, false);
    let seen = scale_in_through(&s, "127.98.250.2", Some(&api)).await;
    assert!(
        seen.after_ttl_ms >= DRAIN_MS,
        "deprovisioned {} ms into a 1 s drain whose connections were unknown",
        seen.after_ttl_ms
    );
    assert!(
        seen.reason.contains("connections unknown") && seen.reason.contains("unavailable"),
        "{}",
        seen.reason
    );
    // Asked again, not once.
    assert!(api.calls.load(Ordering::SeqCst) >= 2);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_node_whose_api_cannot_be_reached_is_drained_until_the_deadline() {
    let s = Stack::up("flt_drain_unreachable", "127.99.").await;
    // Nothing listens there: every connection is refused.
    let seen = scale_in_through(&s, "127.99.250.2", None).await;
    assert!(
        seen.after_ttl_ms >= DRAIN_MS,
        "deprovisioned {} ms into a 1 s drain whose node could not be reached",
        seen.after_ttl_ms
    );
    assert!(
        seen.reason.contains("connections unknown") && seen.reason.contains("unreachable"),
        "{}",
        seen.reason
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_node_that_does_not_answer_is_drained_until_the_deadline_and_no_longer() {
    let s = Stack::up("flt_drain_stalled", "127.76.").await;
    let api = StandInNode::new(0, true);
    let seen = scale_in_through(&s, "127.76.250.2", Some(&api)).await;
    assert!(seen.after_ttl_ms >= DRAIN_MS, "{}", seen.after_ttl_ms);
    // Each call is bounded by the drain deadline, not by the API client's
    // own 10 s call timeout.
    assert!(
        seen.after_ttl_ms < 5_000,
        "a stalled node held a 1 s drain for {} ms",
        seen.after_ttl_ms
    );
    assert!(
        seen.reason.contains("connections unknown") && seen.reason.contains("did not answer"),
        "{}",
        seen.reason
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_drain_whose_connections_are_read_after_an_error_ends_as_drained() {
    let s = Stack::up("flt_drain_recovers", "127.75.").await;
    let api = StandInNode::new(1, false);
    let seen = scale_in_through(&s, "127.75.250.2", Some(&api)).await;
    assert!(seen.reason.ends_with(" drained"), "{}", seen.reason);
    assert!(api.calls.load(Ordering::SeqCst) >= 2);
}

/// A holder that lost the group's lease unawares (its renewal has not noticed
/// yet) cannot put the configuration it read back on a node over the newer
/// holder's: a configuration fence is taken only under a live lease, the node
/// refuses one lower than the highest it applied, and a store whose fences
/// went back (restored from a backup) still moves past what the nodes saw,
/// since a fence is at least the database's clock.
#[tokio::test(flavor = "multi_thread")]
async fn a_configuration_read_under_a_lost_lease_never_lands_on_a_node() {
    use lbscale_engine::nodeapi::{NodeApiError, NodeClient};
    use lbscale_engine::store::{Store, StoreError};

    let s = Stack::up("flt_fence", "127.66.").await;
    let other = Store::open_url(
        &format!("sqlite://{}", s.dir.join("state.db").display()),
        &s.dir,
    )
    .unwrap();
    let node = s.rows().remove(0);
    let token = other
        .group_token(&s.group)
        .unwrap()
        .expect("the group's token");
    let listens =
        |port: u16| std::net::TcpStream::connect((node.private_ip.as_str(), port)).is_ok();

    // Another process took the group's lease and a fence, then lost the lease.
    let before_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    let stale = other
        .acquire_lease(&s.group, "stale-holder", Duration::from_millis(100))
        .unwrap();
    let stale_fence = other.next_config_fence(&s.group, &stale).unwrap();
    assert!(
        stale_fence >= before_ms,
        "fence {stale_fence} is below the clock ({before_ms} ms)"
    );
    tokio::time::sleep(Duration::from_millis(250)).await;
    match other.next_config_fence(&s.group, &stale) {
        Err(StoreError::LeaseLost { .. }) => {}
        r => panic!("a fence under an expired lease: {r:?}"),
    }

    // The engine (the newer holder) adds a vserver: its push has a higher fence.
    let se = se_group("flt-fence-se", &s.group);
    let se_id = s.engine.create_se_group(&se).await.unwrap();
    let vserver = |name: &str, port: u16| -> lbscale_engine::model::VserverSpec {
        serde_json::from_value(serde_json::json!({
            "name": name, "se_group_id": se_id, "service_type": "TCP", "port": port,
            "lb_method": "round_robin", "persistence": "none", "slow_start": null,
            "services": [{"name": "b1", "address": "127.0.0.1", "port": 18971, "weight": 1, "enabled": true}],
        }))
        .unwrap()
    };
    let mut lower = vserver("flt-fence-lower", 18973);
    lower.service_type = "tcp".into();
    let e = s.engine.create_vserver(&lower).await.unwrap_err();
    assert!(
        e.to_string()
            .contains("service_type \"tcp\" is not one of HTTP, TCP or UDP"),
        "{e}"
    );
    s.engine
        .create_vserver(&vserver("flt-fence-a", 18970))
        .await
        .unwrap();
    assert!(listens(18970), "the node does not serve the new vserver");

    // What the stale holder read before (no vservers) is refused and changes nothing.
    let mut client = NodeClient::connect(&node.private_ip, 9990, &node.id, &token)
        .await
        .expect("connect to the node");
    let e = client
        .configure(lbscale_proto::NodeConfig {
            version: 1,
            fence: stale_fence,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert!(matches!(e, NodeApiError::Superseded { .. }), "{e}");
    assert!(listens(18970), "the stale configuration closed the vserver");

    // Restored from a backup: the store's fences went back to nothing. The
    // next push still lands, above what the node applied.
    rusqlite_raw(&s.dir, "UPDATE groups SET config_fence = 0");
    s.engine
        .create_vserver(&vserver("flt-fence-b", 18972))
        .await
        .expect("a push after the fences went back");
    assert!(
        listens(18972),
        "the node did not take the push after the restore"
    );
}

/// A statement on the stack's SQLite store, as an operator's restore would.
fn rusqlite_raw(dir: &std::path::Path, sql: &str) {
    let c = rusqlite::Connection::open(dir.join("state.db")).unwrap();
    c.execute_batch(sql).unwrap();
}

/// An SE group of `group`: native scaling, one node per vserver.
fn se_group(name: &str, group: &str) -> SeGroupSpec {
    SeGroupSpec {
        name: name.into(),
        autoscale_group_id: group.into(),
        scaling_mode: "native".into(),
        min_scaleout_per_vs: 1,
        max_scaleout_per_vs: 1,
        vs_scalein_timeout: DeclaredDuration::parse("30s").unwrap(),
        se_tunnel_mode: 0,
        primary_forwarding_cost: 0.0,
    }
}

/// The snapshot's answer on the group's publication, then the full check's
/// (which publishes when it finds a difference): they agree, and once
/// published both say settled. Whether the full check published.
async fn publication_agrees(s: &Stack, what: &str) -> bool {
    let snap = s.engine.group_snapshot(&s.group).await.unwrap().unwrap();
    let settled = s.engine.publication_settled_in(&snap).unwrap();
    let published = s.engine.settle_publication(&s.distributor).await.unwrap();
    assert_eq!(
        settled,
        Some(!published),
        "{what}: the snapshot said {settled:?}, the full check published: {published}"
    );
    let snap = s.engine.group_snapshot(&s.group).await.unwrap().unwrap();
    assert_eq!(
        s.engine.publication_settled_in(&snap).unwrap(),
        Some(true),
        "{what}: after publishing"
    );
    assert!(
        !s.engine.settle_publication(&s.distributor).await.unwrap(),
        "{what}: published twice"
    );
    published
}

/// The daemon's publication check from an evaluation's snapshot says
/// "settled" exactly when the full check finds nothing to publish: over nodes
/// with and without public addresses, a node not registered yet, and TCP,
/// UDP and HTTP vservers over two SE groups, before and after each change.
#[tokio::test(flavor = "multi_thread")]
async fn the_snapshots_publication_check_agrees_with_the_full_one() {
    let s = Stack::up("flt_agree", "127.65.").await;
    let store = s.engine.testing_store().clone();
    let real = s.rows().into_iter().next().expect("the group's node");
    let extra = |i: u8, public: bool, registered: bool| NodeRow {
        id: format!("flt-agree-extra-{i}"),
        group_id: s.group.clone(),
        az: "az1".into(),
        seq: 100 + i64::from(i),
        state: NodeState::Active,
        private_ip: format!("127.65.200.{i}"),
        public_ip: public.then(|| format!("198.51.100.{i}")),
        registered,
        handle: serde_json::json!({}),
        created_at: real.created_at,
    };
    store.insert_node(&extra(1, true, true)).unwrap();
    store.insert_node(&extra(2, false, true)).unwrap();
    store.insert_node(&extra(3, true, false)).unwrap();
    store
        .insert_se_group("flt-agree-se-a", &se_group("flt-agree-se-a", &s.group))
        .unwrap();
    store
        .insert_se_group("flt-agree-se-b", &se_group("flt-agree-se-b", &s.group))
        .unwrap();
    for (id, name, se, ty, port) in [
        (
            "flt-agree-vs-1",
            "flt-agree-tcp",
            "flt-agree-se-a",
            "TCP",
            15432,
        ),
        (
            "flt-agree-vs-2",
            "flt-agree-udp",
            "flt-agree-se-a",
            "UDP",
            15353,
        ),
        (
            "flt-agree-vs-3",
            "flt-agree-http",
            "flt-agree-se-b",
            "HTTP",
            18080,
        ),
    ] {
        store
            .insert_vserver(id, &vserver_spec(name, se, ty, port))
            .unwrap();
    }
    assert!(publication_agrees(&s, "nodes and vservers added").await);
    assert!(!publication_agrees(&s, "nothing changed").await);
    store.update_node(&extra(3, true, true)).unwrap();
    assert!(publication_agrees(&s, "a node registered").await);
    let mut n = extra(2, false, true);
    n.public_ip = Some("198.51.100.99".into());
    store.update_node(&n).unwrap();
    assert!(publication_agrees(&s, "a public address given").await);
    store
        .insert_vserver(
            "flt-agree-vs-4",
            &vserver_spec("flt-agree-udp2", "flt-agree-se-b", "UDP", 15354),
        )
        .unwrap();
    publication_agrees(&s, "a UDP vserver added").await;
    store
        .insert_vserver(
            "flt-agree-vs-5",
            &vserver_spec("flt-agree-tcp2", "flt-agree-se-b", "TCP", 16000),
        )
        .unwrap();
    assert!(publication_agrees(&s, "a TCP vserver added").await);
    store.delete_vserver("flt-agree-vs-1").unwrap();
    assert!(publication_agrees(&s, "a TCP vserver deleted").await);
}

/// The engine keeps a group's node API credentials: the configuration push
/// left the node a session ticket, so the next connection with them resumes
/// that session instead of checking certificates again, the daemon's
/// statistics connection too. A destroyed group's credentials are not kept.
#[tokio::test(flavor = "multi_thread")]
async fn a_groups_node_connections_share_its_credentials_and_resume_one_session() {
    use lbscale_engine::nodeapi::NodeClient;

    let s = Stack::up("flt_credentials", "127.67.").await;
    let token = s.engine.group_token(&s.group).unwrap();
    let creds = s.engine.node_credentials(&s.group, &token).unwrap();
    assert!(
        Arc::ptr_eq(
            &creds,
            &s.engine.node_credentials(&s.group, &token).unwrap()
        ),
        "the group's credentials were issued again while fresh"
    );
    let node = s.rows().remove(0);
    let mut client = NodeClient::connect_with(&creds, &node.private_ip, 9990, &node.id, &token)
        .await
        .expect("connect to the node");
    assert!(
        client.resumed_session(),
        "the configuration push did not use the group's kept credentials: nothing to resume"
    );
    // The daemon's samples dial with the same credentials, over a TLS
    // configuration of their own (another ALPN) that shares the tickets. One
    // ticket is kept per node: the resumed connection's call brings the next.
    client.stats().await.expect("the node's statistics");
    drop(client);
    let stats = lbscale_engine::nodeapi::stats::StatsClient::connect(
        &creds,
        &node.private_ip,
        9990,
        &node.id,
        &token,
    )
    .await
    .expect("a statistics connection to the node");
    assert!(
        stats.resumed_session(),
        "the statistics connection did not resume a session of the group's credentials"
    );

    s.engine.delete_group(&s.group).await.unwrap();
    let after = s.engine.node_credentials(&s.group, &token).unwrap();
    assert!(
        !Arc::ptr_eq(&creds, &after),
        "the destroyed group's credentials were kept"
    );
}

/// A push writes back a node's row only while the node is still a member: a
/// node that another workflow deregistered and began to drain while the push
/// configured it (another AZ's scale-in, under its own AZ's lease) stays so,
/// rather than coming back active and registered, which the next publication
/// would hand out to clients again.
#[tokio::test(flavor = "multi_thread")]
async fn a_push_does_not_put_back_a_node_another_workflow_took_out() {
    let s = Stack::up("flt_push_writeback", "127.68.").await;
    let n = a_push_meets_its_row_rewritten(&s, "flt-writeback", 18980, |n| {
        n.state = NodeState::Draining;
        n.registered = false;
    })
    .await;
    assert_eq!(
        (n.state, n.registered),
        (NodeState::Draining, false),
        "the push put the node back"
    );
}

/// Creates vserver `name` on `port` on the stack's one node. Its push is held
/// after the node took the configuration, before the push writes the node's
/// row; meanwhile `meanwhile` rewrites the row, as another workflow would.
/// Returns the row once the vserver is created.
async fn a_push_meets_its_row_rewritten(
    s: &Stack,
    name: &str,
    port: u16,
    meanwhile: impl FnOnce(&mut NodeRow),
) -> NodeRow {
    let store = s.engine.testing_store().clone();
    let se_id = s
        .engine
        .create_se_group(&se_group(&format!("{name}-se"), &s.group))
        .await
        .unwrap();
    let vserver = vserver_spec(name, &se_id, "TCP", port.into());
    let held = lbscale_engine::fault::holds::hold("join_before_node_write", &s.group);
    let pushing = tokio::time::timeout(Duration::from_secs(60), s.engine.create_vserver(&vserver));
    let rewriting = async {
        tokio::time::timeout(Duration::from_secs(30), held.reached())
            .await
            .expect("the push reached the node's row within 30 s");
        let mut n = s.rows().remove(0);
        meanwhile(&mut n);
        store.update_node(&n).unwrap();
        held.release();
    };
    let (out, ()) = tokio::join!(pushing, rewriting);
    out.expect("the push ended within 60 s")
        .expect("the vserver is created");
    s.rows().remove(0)
}

/// A node another AZ's workflow is still provisioning has no address yet: a
/// scale-in's push, which goes to every AZ, passes it by (its own workflow
/// configures it once it is up) and reaches the others.
#[tokio::test(flavor = "multi_thread")]
async fn a_push_passes_by_a_node_that_has_no_address_yet() {
    let s = Stack::with_azs("flt_push_no_address", "127.69.", &["az1", "az2"]).await;
    s.engine
        .reconcile_group(&s.group)
        .await
        .expect("bring the group up");
    s.engine
        .scale_out(&s.group, "az2", "test")
        .await
        .expect("a second node in az2");
    let store = s.engine.testing_store().clone();
    let provisioning = NodeRow {
        id: format!("{}-az1-9-0000", s.group_name),
        group_id: s.group.clone(),
        az: "az1".into(),
        seq: store.next_node_seq(&s.group).unwrap(),
        state: NodeState::Provisioning,
        private_ip: String::new(),
        public_ip: None,
        registered: false,
        handle: serde_json::json!({}),
        created_at: 0,
    };
    store.insert_node(&provisioning).unwrap();
    // Newest first, the push met the address-less node first, retried it for
    // its 10 s and gave up on every member ("config_push_failed").
    tokio::time::timeout(
        Duration::from_secs(60),
        s.engine.scale_in_one(&s.group, "az2", "test"),
    )
    .await
    .expect("the scale-in ended within 60 s")
    .expect("the scale-in succeeded");
    let failed: Vec<String> = s
        .engine
        .events(&s.group, 100)
        .unwrap()
        .into_iter()
        .filter(|e| e.kind == "config_push_failed")
        .map(|e| e.reason)
        .collect();
    assert!(failed.is_empty(), "{failed:?}");
    let rows = s.rows();
    assert_eq!(
        rows.iter().find(|n| n.id == provisioning.id),
        Some(&provisioning),
        "the push wrote the node it passed by"
    );
}

/// Two pushes can configure one node in one order and write its row in the
/// other (two AZs' workflows, whose leases do not exclude each other): the
/// row keeps what the newer push (the higher configuration fence) recorded,
/// which is what the node runs, rather than the older push's fingerprint.
#[tokio::test(flavor = "multi_thread")]
async fn an_older_push_does_not_write_over_a_newer_ones_record() {
    let s = Stack::up("flt_push_order", "127.70.").await;
    // A push under a fence taken after this one's (a minute later).
    let later_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
        + 60_000;
    let mut newer = None;
    let n = a_push_meets_its_row_rewritten(&s, "flt-order", 18982, |n| {
        n.handle[CONFIG_FENCE] = later_ms.into();
        n.handle["config_fingerprint"] = "the newer push's".into();
        newer = Some(n.handle.clone());
    })
    .await;
    assert_eq!(
        Some(n.handle.clone()),
        newer,
        "the older push wrote over the newer one's record"
    );
    assert_eq!((n.state, n.registered), (NodeState::Active, true));
}

/// A scale-out's push whose record of its new node's configuration was
/// refused (a newer push configured the node and made it active meanwhile)
/// still registers the node, which that push had not yet done, and tells of
/// it once; it does not tell of the activation it did not make.
#[tokio::test(flavor = "multi_thread")]
async fn a_push_outrun_by_a_newer_one_still_registers_the_node() {
    let s = Stack::up("flt_push_register", "127.72.").await;
    let store = s.engine.testing_store().clone();
    let count = |s: &Stack, kind: &str| s.event_kinds().iter().filter(|k| *k == kind).count();
    let (active_before, registered_before) =
        (count(&s, "node_active"), count(&s, "node_registered"));
    let later_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
        + 60_000;
    // The push reaches the new node first (newest first).
    let held = lbscale_engine::fault::holds::hold("join_before_node_write", &s.group);
    let scaling = tokio::time::timeout(
        Duration::from_secs(60),
        s.engine.scale_out(&s.group, "az1", "test"),
    );
    let newer = async {
        tokio::time::timeout(Duration::from_secs(30), held.reached())
            .await
            .expect("the push reached the new node's row within 30 s");
        let mut n = s.rows().into_iter().max_by_key(|n| n.seq).unwrap();
        assert_eq!((n.state, n.registered), (NodeState::Joining, false));
        n.state = NodeState::Active;
        n.handle[CONFIG_FENCE] = later_ms.into();
        n.handle["config_fingerprint"] = "the newer push's".into();
        store.update_node(&n).unwrap();
        held.release();
        n
    };
    let (out, newer) = tokio::join!(scaling, newer);
    let id = out
        .expect("the scale-out ended within 60 s")
        .expect("the scale-out succeeded");
    assert_eq!(id, newer.id);
    let n = s.rows().into_iter().find(|n| n.id == id).unwrap();
    assert_eq!(n.handle, newer.handle, "the newer record stays");
    assert!(n.registered, "the node was left unregistered");
    assert_eq!(count(&s, "node_registered"), registered_before + 1);
    assert_eq!(count(&s, "node_active"), active_before);
}
