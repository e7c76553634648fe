//! `lbscale daemon`: the sidecar that scales every group between applies.
//!
//! Level-triggered. Every tick (200 ms) the loop lists every group in the store;
//! a group whose `stats_interval` has elapsed since its last evaluation gets one
//! evaluation, run as its own task so that a slow group (a drain takes seconds)
//! never stalls the others. A group has at most one task at a time (its runtime
//! sits behind a mutex that the task holds), so two workflows never run on one
//! group at once.
//!
//! One evaluation ([`group::tick`]):
//! 1. reads the group's policy from its spec (re-read every tick: a Terraform apply
//!    that changes min/max/thresholds takes effect at the next evaluation) and
//!    validates it with the core's own functions;
//! 2. claims the group for this daemon (an ownership lease `daemon/<group id>`,
//!    renewed in the background for as long as the evaluation and its workflow
//!    run): a second daemon on the same store leaves alone a group that the first
//!    one evaluates, and takes it over one claim TTL after the first one died;
//! 3. skips the group this tick when the group's own lease is held (Terraform is
//!    applying it): the lease is how the daemon and the provider coexist.
//!    Then it resumes: the first time it evaluates the group, and whenever the store
//!    shows work left half-done (a node provisioning, joining, draining or
//!    deprovisioning, a member whose process is gone, an active node not
//!    registered), it runs the engine's level-triggered `reconcile_group`, which
//!    finishes each step where a crashed holder stopped, before deciding anything.
//!    A resume that fails is retried after a back-off (30 s doubling to 10 min,
//!    [`resume::ResumeBackoff`]), shown in `/v1/groups` and as `resume_failed`
//!    events; after a successful one, each AZ starts from the policy state that
//!    the store persisted ([`resume::restore_az_state`]);
//! 4. samples every serving node through its management API and takes each AZ's
//!    mean; feeds it to [`lbscale_core::policy::step`] with the AZ's state, and
//!    persists the new state (table `policy_state`, under the claim's fencing
//!    token) before acting on it: a restarted daemon, or one that takes the group
//!    over, keeps a running cooldown and a provisioning back-off;
//! 5. runs the engine's scale-out / scale-in workflow when the step says so (the
//!    workflow takes the group's lease itself: short, renewed while it runs,
//!    checked before every side effect) and reports its outcome back to the
//!    policy at once, so that the cooldown starts when the node has joined.

pub mod group;
pub mod http;
pub mod metrics;
pub mod resume;

use lbscale_cloud_aws::AwsSettings;
use lbscale_cloud_local::LocalSettings;
use lbscale_engine::Engine;
use metrics::{GroupStatus, Metrics};
use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
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
}

impl Shared {
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
    let clouds = lbscale_engine::cloud::Clouds::new()
        .with("local", lbscale_cloud_local::drivers(cfg.local.clone()))
        .with("aws", lbscale_cloud_aws::drivers(AwsSettings::from_env()));
    let engine = Engine::open(&cfg.state_url, &cfg.base_dir, clouds)
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
    });
    tracing::info!(
        listen = %cfg.listen,
        store = %shared.engine.store.location(),
        holder = %holder,
        "lbscale daemon started"
    );
    let http = tokio::spawn(http::serve(listener, shared.clone()));

    let mut groups: HashMap<String, Arc<tokio::sync::Mutex<group::GroupRuntime>>> = HashMap::new();
    let mut tasks: JoinSet<()> = JoinSet::new();
    let mut ticker = tokio::time::interval(cfg.tick);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            _ = &mut shutdown => break,
            _ = ticker.tick() => {}
        }
        while let Some(done) = tasks.try_join_next() {
            if let Err(e) = done {
                tracing::error!(error = %e, "a group evaluation panicked or was cancelled");
            }
        }
        let all = match shared.engine.store.all_groups() {
            Ok(all) => all,
            Err(e) => {
                tracing::warn!(error = %e, "cannot list the groups; retrying at the next tick");
                continue;
            }
        };
        // A group that Terraform destroyed stops being scaled at once.
        let present: std::collections::HashSet<&str> = all.iter().map(|g| g.id.as_str()).collect();
        let gone: Vec<String> = groups
            .keys()
            .filter(|id| !present.contains(id.as_str()))
            .cloned()
            .collect();
        for id in gone {
            groups.remove(&id);
            if let Some(s) = shared.forget(&id) {
                shared.metrics.forget_group(&s.name);
                tracing::info!(group = %s.name, "group is gone from the store; no longer scaled");
            }
            group::release_ownership(&shared, &id);
        }
        let now = lbscale_engine::store::now_ms();
        for row in all {
            let rt = groups
                .entry(row.id.clone())
                .or_insert_with(|| {
                    shared.set_status(group::initial_status(&row));
                    Arc::new(tokio::sync::Mutex::new(group::GroupRuntime::new()))
                })
                .clone();
            // In flight: this group's previous evaluation (maybe a workflow) runs.
            let Ok(guard) = rt.try_lock_owned() else {
                continue;
            };
            if !guard.due(&row.spec, now) {
                continue;
            }
            tasks.spawn(group::tick(shared.clone(), guard, row));
        }
    }

    tracing::info!(
        in_flight = tasks.len(),
        grace_s = cfg.shutdown_grace.as_secs(),
        "shutting down after the evaluations in flight"
    );
    let drained = tokio::time::timeout(cfg.shutdown_grace, async {
        while tasks.join_next().await.is_some() {}
    })
    .await;
    if drained.is_err() {
        tracing::warn!(
            left = tasks.len(),
            "evaluations still running after the shutdown grace; abandoning them (the next apply or daemon resumes from the store)"
        );
        tasks.abort_all();
        while tasks.join_next().await.is_some() {}
    }
    http.abort();
    for id in groups.keys() {
        group::release_ownership(&shared, id);
    }
    tracing::info!("lbscale daemon stopped");
    Ok(())
}

fn rand_u16() -> u16 {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    (t ^ (std::process::id() << 7)) as u16
}
