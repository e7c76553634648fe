//! `lbscale daemon`: the sidecar that scales every group between applies.
//!
//! Level-triggered, in the shape of a controller. The daemon keeps its groups in
//! memory; every tick (200 ms) it reads one row, the groups' fingerprint, and
//! when that changed (or every 30 s) lists the groups' row versions and
//! re-reads only the rows that changed (a Terraform apply that changes min/max
//! or the thresholds takes effect at the next evaluation). A group that is due (its
//! requeue has come, or a workflow of one of its AZs ended) gets one evaluation,
//! run as its own task; a group has at most one evaluation at a time (its
//! runtime sits behind a mutex that the evaluation holds). A tick looks only at
//! the groups whose time has come in a queue by time (`schedule.rs`): each
//! evaluation says when to look at its group again, every tick while one of its
//! workflows runs.
//!
//! One evaluation ([`group::evaluate`]) returns what happens next ([`group::Next`]:
//! requeue after a duration, or workflows started); a failed one goes to one error
//! policy ([`group::error_policy`]), which reports it and decides the back-off:
//! 1. reads the group's policy and validates it with the core's own conversion
//!    (the one `lbscale simulate` uses);
//! 2. takes its turn through the engine ([`lbscale_engine::daemon_api`]): the
//!    daemon's claim on the group (a lease `daemon/<group id>` with a fencing
//!    token, taken at the group's first evaluation and then renewed with all
//!    the daemon's other claims by one task (`claims.rs`), and while the AZs'
//!    workflows run: a second daemon on the same store leaves the group alone,
//!    and takes it over one claim TTL after the first one died); then one
//!    snapshot of the group and its nodes ([`lbscale_engine::daemon_api::GroupSnapshot`],
//!    two statements) serves the rest of the evaluation, starting with the
//!    probe of the group's own lease: while Terraform applies the group, it is
//!    skipped;
//! 3. resumes: the first time it evaluates the group, and whenever the store
//!    shows work left half-done (a node provisioning, joining, draining or
//!    deprovisioning, a member whose process is gone, an active node not
//!    registered) while none of its own workflows runs, it runs the engine's
//!    level-triggered `reconcile_group`, which finishes each step where a crashed
//!    holder stopped, before deciding anything. A resume that fails is retried
//!    after a back-off (30 s doubling to 10 min, [`resume::ResumeBackoff`]; one
//!    stats interval doubling when only the publication failed), shown
//!    in `/v1/groups` and as `resume_failed` events; after a successful one, each
//!    AZ starts from the policy state that the store persisted
//!    ([`resume::restore_az_state`]);
//! 4. samples every serving node through its management API;
//! 5. evaluates each AZ on its own, as its own cluster: takes in the outcome of
//!    the AZ's workflow that ended (the cooldown starts when the node joined),
//!    and unless one still runs, feeds the AZ's mean to
//!    [`lbscale_core::policy::step`], persists the new state (table
//!    `policy_state`, under the claim's fencing token) before acting on it, and
//!    starts the workflow the step asks for as a task of its own. The engine runs
//!    it under the AZ's lease: two workflows never run in one AZ, a drain or a
//!    slow node in one AZ never delays another AZ, and an apply (which takes the
//!    group's lease) never acts together with one.

mod az;
mod claims;
pub mod group;
pub mod http;
pub mod malloc;
pub mod metrics;
pub mod resume;
mod sample;
mod schedule;
pub mod smallmap;
mod spans;
mod status;

use futures_util::FutureExt;
use lbscale_cloud_aws::AwsSettings;
use lbscale_cloud_local::LocalSettings;
use lbscale_engine::model::GroupSpec;
use lbscale_engine::store::Row;
use lbscale_engine::Engine;
use metrics::{GroupStatus, Metrics};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::future::Future;
use std::net::SocketAddr;
use std::panic::AssertUnwindSafe;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::task::JoinSet;

/// How the daemon runs.
#[derive(Debug, Clone)]
pub struct DaemonConfig {
    /// `sqlite://PATH` or `postgres://...`, as the provider's `state` setting.
    pub state_url: String,
    /// Relative store paths are taken from here (the current directory).
    pub base_dir: PathBuf,
    /// The HTTP listener (`/healthz`, `/metrics`, `/v1/groups`, `/v1/events`).
    pub listen: SocketAddr,
    /// Settings of the local cloud: must match the provider's (address prefix).
    pub local: LocalSettings,
    /// How often the loop looks for groups that are due.
    pub tick: Duration,
    /// How long shutdown waits for workflows in flight before abandoning them.
    pub shutdown_grace: Duration,
}

impl DaemonConfig {
    pub fn new(state_url: &str, base_dir: PathBuf, listen: SocketAddr) -> DaemonConfig {
        DaemonConfig {
            state_url: state_url.to_string(),
            base_dir,
            listen,
            local: LocalSettings::default(),
            tick: Duration::from_millis(200),
            shutdown_grace: Duration::from_secs(60),
        }
    }
}

/// What the group tasks and the HTTP listener share.
pub struct Shared {
    pub engine: Engine,
    /// This daemon's name in leases (`daemon-<pid>-<random>`).
    pub holder: String,
    pub metrics: Metrics,
    status: Mutex<BTreeMap<String, GroupStatus>>,
    /// When each distributor's publication was last compared with what it
    /// serves (see `group::settle_publication`).
    publication_checks: Mutex<HashMap<String, std::time::Instant>>,
    /// The groups this daemon holds the claim of.
    owned: Mutex<HashSet<String>>,
    /// Those claims' leases, renewed together ([`claims::keep_renewed`]).
    claims: claims::Claims,
    /// Daemons announced on the store (this one included), and the groups in
    /// it, as the loop last read them: this daemon's share is their quotient.
    daemons: AtomicUsize,
    groups: AtomicUsize,
    /// The descriptors spent on node connections, across the groups.
    pub(crate) node_connections: sample::NodeConnections,
}

impl Shared {
    /// How many groups this daemon should hold: its share of the store's
    /// groups among the daemons announced on it, rounded up (the shares
    /// together cover every group).
    fn share(&self) -> usize {
        let daemons = self.daemons.load(Ordering::Relaxed).max(1);
        self.groups.load(Ordering::Relaxed).div_ceil(daemons)
    }

    /// Whether this daemon may claim one group more (one it does not hold).
    pub(crate) fn may_claim(&self, id: &str) -> bool {
        let owned = self.owned.lock().unwrap_or_else(|e| e.into_inner());
        owned.contains(id) || owned.len() < self.share()
    }

    /// Records that this daemon holds group `id`'s claim; false (and not
    /// recorded) when it holds more than its share already and should let
    /// this one go instead.
    pub(crate) fn keep_claim(&self, id: &str) -> bool {
        let mut owned = self.owned.lock().unwrap_or_else(|e| e.into_inner());
        if owned.contains(id) && owned.len() > self.share() {
            owned.remove(id);
            return false;
        }
        owned.insert(id.to_string());
        true
    }

    /// Records that this daemon holds group `id`'s claim (one whose workflows
    /// run: not let go mid-way).
    pub(crate) fn keep_claim_anyway(&self, id: &str) {
        self.owned
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id.to_string());
    }

    pub(crate) fn disown(&self, id: &str) {
        self.owned
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(id);
    }

    /// Whether the distributor's publication is due for a check (at most one
    /// per `every`, whichever of its groups comes first); marks it checked.
    pub(crate) fn publication_check_due(&self, distributor: &str, every: Duration) -> bool {
        let now = std::time::Instant::now();
        let mut checks = self
            .publication_checks
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        match checks.get(distributor) {
            Some(last) if now.duration_since(*last) < every => false,
            _ => {
                checks.insert(distributor.to_string(), now);
                true
            }
        }
    }
    pub fn status_snapshot(&self) -> Vec<GroupStatus> {
        self.status
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .cloned()
            .collect()
    }
    pub(crate) fn update_status(&self, id: &str, f: impl FnOnce(&mut GroupStatus)) {
        if let Some(s) = self
            .status
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get_mut(id)
        {
            f(s)
        }
    }
    fn set_status(&self, s: GroupStatus) {
        self.status
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(s.id.clone(), s);
    }
    fn forget(&self, id: &str) -> Option<GroupStatus> {
        self.status
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(id)
    }
}

#[derive(Debug)]
pub struct StartError(pub String);

impl std::fmt::Display for StartError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// Runs until `shutdown` resolves; then lets the evaluations in flight finish (at
/// most `shutdown_grace`), gives up its ownership leases and returns.
pub async fn run(cfg: DaemonConfig, shutdown: impl Future<Output = ()>) -> Result<(), StartError> {
    let clouds = default_clouds(&cfg);
    run_with_clouds(cfg, clouds, shutdown).await
}

/// The clouds `lbscale daemon` is built with, from `cfg` and the environment.
pub fn default_clouds(cfg: &DaemonConfig) -> lbscale_engine::cloud::Clouds {
    lbscale_engine::cloud::Clouds::new()
        .with("local", lbscale_cloud_local::drivers(cfg.local.clone()))
        .with("aws", lbscale_cloud_aws::drivers(AwsSettings::from_env()))
        .with(
            "azure",
            lbscale_cloud_azure::drivers(lbscale_cloud_azure::AzureSettings::from_env()),
        )
        .with(
            "gcp",
            lbscale_cloud_gcp::drivers(lbscale_cloud_gcp::GcpSettings::from_env()),
        )
}

/// As [`run`], with the drivers of `clouds` (a benchmark registers a cloud of
/// simulated nodes under `local`; everything else is the daemon's own code).
pub async fn run_with_clouds(
    cfg: DaemonConfig,
    clouds: lbscale_engine::cloud::Clouds,
    shutdown: impl Future<Output = ()>,
) -> Result<(), StartError> {
    let engine = Engine::open(&cfg.state_url, &cfg.base_dir, clouds)
        .map_err(|e| StartError(format!("--state: {e}")))?;
    // The loop's own handle (and pool) for its one-row read per tick.
    let watch = lbscale_engine::store::Store::open_url(&cfg.state_url, &cfg.base_dir)
        .map_err(|e| StartError(format!("--state: {e}")))?;
    let listener = tokio::net::TcpListener::bind(cfg.listen)
        .await
        .map_err(|e| StartError(format!("--listen: cannot listen on {}: {e}", cfg.listen)))?;
    let holder = format!("daemon-{}-{:04x}", std::process::id(), rand_u16());
    let shared = Arc::new(Shared {
        engine,
        holder: holder.clone(),
        metrics: Metrics::default(),
        status: Mutex::new(BTreeMap::new()),
        publication_checks: Mutex::new(HashMap::new()),
        owned: Mutex::new(HashSet::new()),
        claims: claims::Claims::default(),
        daemons: AtomicUsize::new(1),
        groups: AtomicUsize::new(0),
        node_connections: sample::NodeConnections::new(),
    });
    let mut announced: Option<std::time::Instant> = None;
    tracing::info!(
        listen = %cfg.listen,
        store = %shared.engine.store_location(),
        holder = %holder,
        kept_node_connections = shared.node_connections.kept.limit(),
        "lbscale daemon started"
    );
    let http = tokio::spawn(http::serve(listener, shared.clone()));
    let renewals = tokio::spawn(claims::keep_renewed(shared.clone()));

    let mut groups: HashMap<String, Watched> = HashMap::new();
    let mut listed: Option<Listed> = None;
    let mut tasks: JoinSet<(String, i64)> = JoinSet::new();
    let mut schedule = schedule::Schedule::default();
    // Evaluations in flight at once: each holds store connections and node
    // connections while it runs; thousands of groups due together (a start,
    // a takeover) wait for a turn instead of starving the lease renewals.
    let turns = Arc::new(tokio::sync::Semaphore::new(MAX_EVALUATIONS_IN_FLIGHT));
    let mut ticker = tokio::time::interval(cfg.tick);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            _ = &mut shutdown => break,
            _ = ticker.tick() => {}
        }
        while let Some(done) = tasks.try_join_next() {
            match done {
                Ok((id, next)) => schedule.at(next, id),
                Err(e) => tracing::error!(error = %e, "a group evaluation was cancelled"),
            }
        }
        match changed(&watch, &listed).await {
            Ok(None) => {}
            Ok(Some(fingerprint)) => {
                if let Err(e) = refresh(&shared, &mut groups, &mut schedule) {
                    tracing::warn!(error = %e, "cannot list the groups; retrying at the next tick");
                    continue;
                }
                listed = Some(Listed {
                    fingerprint,
                    at: std::time::Instant::now(),
                });
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot read the groups' versions; retrying at the next tick");
                continue;
            }
        }
        if announced.is_none_or(|at| at.elapsed() >= ANNOUNCE_EVERY) {
            match watch.announce_daemon(&shared.holder, DAEMON_TTL) {
                Ok(n) => {
                    shared.daemons.store(n.max(1) as usize, Ordering::Relaxed);
                    announced = Some(std::time::Instant::now());
                }
                Err(e) => {
                    tracing::warn!(error = %e, "cannot announce this daemon on the store; retrying at the next tick")
                }
            }
        }
        shared.groups.store(groups.len(), Ordering::Relaxed);
        let now = lbscale_engine::store::now_ms();
        for id in schedule.take_due(now) {
            // Gone from the store since it was queued.
            let Some(w) = groups.get(&id) else {
                continue;
            };
            // In flight: this group's evaluation runs (or waits for its turn),
            // and queues the group again when it ends.
            let Ok(guard) = w.runtime.clone().try_lock_owned() else {
                continue;
            };
            if !guard.due(now) {
                schedule.at(guard.next_look(), id);
                continue;
            }
            let (row, version) = (w.row.clone(), w.version);
            tasks.spawn(evaluation(
                shared.clone(),
                guard,
                row,
                version,
                turns.clone(),
                id,
                now,
            ));
        }
    }

    tracing::info!(
        in_flight = tasks.len(),
        grace_s = cfg.shutdown_grace.as_secs(),
        "shutting down after the evaluations and workflows in flight"
    );
    let drained = tokio::time::timeout(cfg.shutdown_grace, async {
        while tasks.join_next().await.is_some() {}
        for w in groups.values() {
            w.runtime.lock().await.workflows_done().await;
        }
    })
    .await;
    if drained.is_err() {
        tracing::warn!(
            left = tasks.len(),
            "evaluations or workflows still running after the shutdown grace; abandoning them (the next apply or daemon resumes from the store)"
        );
        tasks.abort_all();
        while tasks.join_next().await.is_some() {}
    }
    http.abort();
    renewals.abort();
    for id in groups.keys() {
        group::release_ownership(&shared, id);
    }
    if let Err(e) = watch.withdraw_daemon(&shared.holder) {
        tracing::warn!(error = %e, "cannot withdraw this daemon from the store; the others count it until it expires");
    }
    tracing::info!("lbscale daemon stopped");
    Ok(())
}

/// One group's evaluation as the loop spawns it: it waits for a turn, runs
/// [`group::run`], and gives back the group and when to look at it again.
async fn evaluation(
    shared: Arc<Shared>,
    guard: tokio::sync::OwnedMutexGuard<group::GroupRuntime>,
    row: Row<GroupSpec>,
    version: i64,
    turns: Arc<tokio::sync::Semaphore>,
    id: String,
    now: i64,
) -> (String, i64) {
    let Ok(_turn) = turns.acquire_owned().await else {
        return (id, now);
    };
    // Boxed once it has its turn: the groups waiting for one (all of them at
    // a start or a takeover) hold their arguments, not an evaluation's whole
    // state (about 13 KiB each).
    let run = Box::pin(group::run(shared, guard, row, version));
    // A panic is a bug: logged, and the group evaluated again a minute later
    // (not at every tick: the same bug would panic five times a second).
    match AssertUnwindSafe(run).catch_unwind().await {
        Ok(next) => (id, next),
        Err(_) => {
            tracing::error!(group_id = %id, "a group evaluation panicked");
            (id, lbscale_engine::store::now_ms() + AFTER_PANIC_MS)
        }
    }
}

/// How long after a panicking evaluation its group is evaluated again.
const AFTER_PANIC_MS: i64 = 60_000;
/// How often a daemon announces itself on the store, and how long an
/// announcement lasts: the others count a daemon that died for this long.
const ANNOUNCE_EVERY: Duration = Duration::from_secs(2);
const DAEMON_TTL: Duration = Duration::from_secs(10);
/// Evaluations that run at once (the others wait for a turn, and their lag
/// shows it).
const MAX_EVALUATIONS_IN_FLIGHT: usize = 32;
/// The groups are listed again at least this often, even when the
/// fingerprint did not change (a safety net: the fingerprint could in
/// principle hide a change).
const RELIST_EVERY: Duration = Duration::from_secs(30);

/// When the groups were last listed, and the fingerprint they had.
struct Listed {
    fingerprint: (i64, i64, i64),
    at: std::time::Instant,
}

/// The groups' fingerprint when they must be listed again: it changed since
/// the last listing (a group added, removed or changed), or that listing is
/// [`RELIST_EVERY`] old. One row per tick, whatever the number of groups.
async fn changed(
    watch: &lbscale_engine::store::Store,
    listed: &Option<Listed>,
) -> Result<Option<(i64, i64, i64)>, lbscale_engine::store::StoreError> {
    let now = watch.groups_fingerprint().await?;
    Ok(match listed {
        Some(l) if l.fingerprint == now && l.at.elapsed() < RELIST_EVERY => None,
        _ => Some(now),
    })
}

/// A group as the daemon keeps it between ticks: its row as of `version`,
/// and its runtime (behind a mutex that an evaluation holds).
struct Watched {
    version: i64,
    row: Row<GroupSpec>,
    runtime: Arc<tokio::sync::Mutex<group::GroupRuntime>>,
}

/// Brings `groups` up to the store: reads the groups' versions, re-reads
/// only the rows that changed or are new, and forgets the groups that are
/// gone (a group that Terraform destroyed stops being scaled at once).
fn refresh(
    shared: &Shared,
    groups: &mut HashMap<String, Watched>,
    schedule: &mut schedule::Schedule,
) -> Result<(), lbscale_engine::EngineError> {
    let versions = shared.engine.group_versions()?;
    let present: HashSet<&str> = versions.iter().map(|(id, _)| id.as_str()).collect();
    let gone: Vec<String> = groups
        .keys()
        .filter(|id| !present.contains(id.as_str()))
        .cloned()
        .collect();
    for id in gone {
        groups.remove(&id);
        shared.disown(&id);
        if let Some(s) = shared.forget(&id) {
            shared.metrics.forget_group(&s.name);
            tracing::info!(group = %s.name, "group is gone from the store; no longer scaled");
        }
        group::release_ownership(shared, &id);
    }
    // Not only those just found gone: an evaluation that read a group before
    // it went may have asked for its credentials since it was last forgotten.
    shared
        .engine
        .retain_node_credentials(|id| present.contains(id));
    for (id, version) in versions {
        if groups.get(&id).is_some_and(|w| w.version == version) {
            continue;
        }
        // Deleted since the versions were read: gone at the next tick.
        let Some((row, version)) = shared.engine.group_with_version(&id)? else {
            continue;
        };
        match groups.get_mut(&id) {
            Some(w) => {
                w.row = row;
                w.version = version;
            }
            None => {
                shared.set_status(status::initial_status(&row));
                schedule.at(0, id.clone());
                groups.insert(
                    id,
                    Watched {
                        version,
                        row,
                        runtime: Arc::new(tokio::sync::Mutex::new(group::GroupRuntime::new())),
                    },
                );
            }
        }
    }
    Ok(())
}

fn rand_u16() -> u16 {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    (t ^ (std::process::id() << 7)) as u16
}

#[cfg(test)]
mod tests {
    use super::*;

    fn future_of_7<A, B, C, D, E, F, G, Fut: Future>(_: fn(A, B, C, D, E, F, G) -> Fut) -> usize {
        std::mem::size_of::<Fut>()
    }

    fn future_of_4<A, B, C, D, Fut: Future>(_: fn(A, B, C, D) -> Fut) -> usize {
        std::mem::size_of::<Fut>()
    }

    /// Thousands of groups wait for a turn at once when a daemon starts or
    /// takes over: each waiting task must not hold a whole evaluation.
    #[test]
    fn a_group_waiting_for_its_turn_holds_its_arguments_not_an_evaluation() {
        let waiting = future_of_7(evaluation);
        let evaluating = future_of_4(group::run);
        assert!(
            waiting * 8 < evaluating,
            "a waiting group's task is {waiting} bytes, an evaluation {evaluating}"
        );
    }
}
