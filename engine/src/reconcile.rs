//! Apply-time reconciliation: the engine that the provider embeds.
//!
//! Level-triggered, like the best controllers: every call reads what is declared
//! (the store) and what is observed (the driver: which node processes still run,
//! what they serve), closes the gap, and records every step as an event. A run that
//! fails half-way leaves rows that say where it stopped; the next run picks up from
//! there. Side effects on a group happen only under the group's lease, so that the
//! provider and the daemon never act on one group at the same time.

use crate::cloud::{
    Cloud, CloudError, Clouds, Distributor, DriverStore, ProvisionRequest, Publication, Registry,
};
use crate::fault::fault_point;
use crate::model::{
    check_vserver_placement, DistributorSpec, Finding, Findings, GroupSpec, PathStep, SeGroupSpec,
    VserverSpec,
};
use crate::nodeapi::NodeClient;
use crate::placement;
use crate::store::{
    distributor_lease_key, now_ms, Lease, NodeRow, NodeState, Row, Store, StoreError,
};
use lbscale_core::apply;
use lbscale_core::duration::parse_duration;
use lbscale_core::seplan::ScalingMode;
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Cloud(#[from] CloudError),
    /// The configuration cannot be applied as it stands (names the attribute).
    #[error("{}: {}", .0.summary, .0.detail)]
    Invalid(Finding),
    #[error("{0} not found in the store")]
    NotFound(String),
    #[error("{0}")]
    InUse(String),
    /// A wait ran past its deadline; `step` says which one.
    #[error("timed out after {after_s}s at step \"{step}\": {detail}")]
    Timeout {
        step: &'static str,
        after_s: u64,
        detail: String,
    },
    #[error("step \"{step}\" failed: {detail}")]
    Step { step: &'static str, detail: String },
}

pub type Result<T> = std::result::Result<T, EngineError>;

/// One node as Terraform and the CLI show it: its stored row with the state that
/// is observed now (a node whose process died shows as `failed`).
#[derive(Debug, Clone, PartialEq)]
pub struct NodeView {
    pub id: String,
    pub availability_zone: String,
    pub private_ip: String,
    pub public_ip: Option<String>,
    pub state: String,
    pub serving: bool,
}

/// One vserver in one AZ behind an `nlb`: the nodes that hold it now and what
/// its span may be, for the daemon to size it from their CPU.
#[derive(Debug, Clone)]
pub struct SpanView {
    pub vserver_id: String,
    pub vserver: String,
    pub az: String,
    /// Node ids, the primary first; as many as the span (or the AZ has).
    pub holders: Vec<String>,
    pub span: u32,
    pub min: u32,
    pub max: u32,
    pub plan: lbscale_core::seplan::PlanParams,
}

#[derive(Debug, Clone)]
pub struct GroupView {
    pub id: String,
    pub spec: GroupSpec,
    pub nodes: Vec<NodeView>,
}

impl GroupView {
    /// Nodes serving now: active, registered with the distributor, and alive.
    pub fn node_count(&self) -> i64 {
        self.nodes.iter().filter(|n| n.serving).count() as i64
    }
    /// `ok` when every AZ has at least `min_nodes` serving, else what is missing.
    pub fn status(&self) -> String {
        let short: Vec<String> = self
            .spec
            .availability_zones
            .iter()
            .filter_map(|az| {
                let n = self
                    .nodes
                    .iter()
                    .filter(|n| n.serving && &n.availability_zone == az)
                    .count() as i64;
                (n < self.spec.min_nodes)
                    .then(|| format!("{az}: {n}/{} serving", self.spec.min_nodes))
            })
            .collect();
        if short.is_empty() {
            "ok".into()
        } else {
            format!("degraded ({})", short.join(", "))
        }
    }
}

#[derive(Debug, Clone)]
pub struct DistributorView {
    pub id: String,
    pub spec: DistributorSpec,
    pub endpoints: Vec<String>,
    pub address: BTreeMap<String, String>,
}

pub struct Engine {
    pub store: Arc<Store>,
    /// The drivers by cloud name, as the embedding program registered them.
    clouds: Registry,
    pub(crate) holder: String,
    /// One operation per group at a time within this process. The store's lease
    /// excludes other processes, but it is held in this process's name, so two
    /// operations of one process (Terraform creating two vservers of a group in
    /// parallel) would both pass it and push configurations over each other.
    group_locks: std::sync::Mutex<BTreeMap<String, Arc<tokio::sync::Mutex<()>>>>,
}

/// How long a workflow's lease lasts without renewal: a crashed holder's group
/// is free again this long after it died. A running workflow renews it every
/// third of this (see [`KeptLease`]), however long the workflow takes.
pub const WORKFLOW_LEASE_TTL: Duration = Duration::from_secs(10);

/// How long a publication waits for another process's publication to the same
/// distributor (each takes at most the driver's own publish timeout: a Route 53
/// change may take two minutes to be in sync, plus its calls' retries).
const PUBLISH_LEASE_WAIT: Duration = Duration::from_secs(300);

/// A lease kept alive by a background task (renewed every third of its TTL) while
/// the work it covers runs. A renewal that finds the lease taken over marks it
/// lost; [`KeptLease::check`], called before every side effect, then stops the
/// work. Dropping it stops the renewals (the lease then expires on its own).
pub struct KeptLease {
    lease: Lease,
    store: Arc<Store>,
    lost: Arc<AtomicBool>,
    renewer: tokio::task::JoinHandle<()>,
    /// This process's turn on the group (see `Engine::group_locks`), released
    /// with the lease.
    _turn: Option<tokio::sync::OwnedMutexGuard<()>>,
}

impl KeptLease {
    /// Starts renewing `lease` (just acquired with `ttl`) every `ttl / 3`.
    pub fn keep(store: Arc<Store>, lease: Lease, ttl: Duration) -> KeptLease {
        let lost = Arc::new(AtomicBool::new(false));
        let renewer = {
            let (store, lease, lost) = (store.clone(), lease.clone(), lost.clone());
            tokio::spawn(async move {
                let every = (ttl / 3).max(Duration::from_millis(100));
                loop {
                    tokio::time::sleep(every).await;
                    match store.renew_lease(&lease, ttl) {
                        Ok(_) => {}
                        Err(e @ StoreError::LeaseLost { .. }) => {
                            tracing::warn!(group = %lease.group_id, error = %e, "lease lost; the work it covers stops before its next step");
                            lost.store(true, Ordering::SeqCst);
                            return;
                        }
                        // A busy store: try again at the next period (the check
                        // before each step sees an expiry).
                        Err(e) => {
                            tracing::warn!(group = %lease.group_id, error = %e, "could not renew the lease")
                        }
                    }
                }
            })
        };
        KeptLease {
            lease,
            store,
            lost,
            renewer,
            _turn: None,
        }
    }

    pub fn lease(&self) -> &Lease {
        &self.lease
    }

    /// The fence check before a side effect: an error once another holder took
    /// the lease over (or it expired).
    pub fn check(&self) -> std::result::Result<(), StoreError> {
        if self.lost.load(Ordering::SeqCst) {
            return Err(StoreError::LeaseLost {
                group: self.lease.group_id.clone(),
                detail: "a renewal found it taken over".into(),
            });
        }
        self.store.check_lease(&self.lease)
    }

    /// Stops renewing; the lease stays as it is until it expires.
    pub fn stop(self) -> Lease {
        self.renewer.abort();
        self.lease.clone()
    }

    /// Stops renewing and gives the lease up at once.
    pub fn release(self) {
        self.renewer.abort();
        let _ = self.store.release_lease(&self.lease);
    }
}

impl Drop for KeptLease {
    fn drop(&mut self) {
        self.renewer.abort();
    }
}

/// How long a destroy waits for the objects that still use the one it removes.
/// Terraform destroys them in the same run, in parallel when the configuration
/// names them by a literal id (as `terraform plan -generate-config-out` writes
/// it), which gives Terraform no order between them.
const IN_USE_WAIT: Duration = Duration::from_secs(30);

/// Waits until `users` (the names of what still uses `what`) is empty, at most
/// [`IN_USE_WAIT`]; then refuses, naming them.
async fn wait_unused(
    what: String,
    kind: &str,
    users: impl Fn() -> Result<Vec<String>>,
) -> Result<()> {
    let deadline = Instant::now() + IN_USE_WAIT;
    loop {
        let names = users()?;
        if names.is_empty() {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(EngineError::InUse(format!(
                "{what} still has {kind}(s) {} after waiting {}s for their destroy; destroy them first",
                names.join(", "),
                IN_USE_WAIT.as_secs()
            )));
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

fn new_id(prefix: &str) -> String {
    format!("{prefix}-{:08x}", rand::random::<u32>())
}

fn new_token() -> String {
    (0..32)
        .map(|_| format!("{:02x}", rand::random::<u8>()))
        .collect()
}

impl Engine {
    /// Opens the store at `state_url` (relative paths from `base_dir`), with
    /// the drivers of `clouds` (built on that store).
    pub fn open(state_url: &str, base_dir: &Path, clouds: Clouds) -> Result<Engine> {
        let store = Arc::new(Store::open_url(state_url, base_dir)?);
        let holder = format!(
            "provider-{}-{:04x}",
            std::process::id(),
            rand::random::<u16>()
        );
        Ok(Engine {
            clouds: clouds.open(DriverStore::new(store.clone())),
            store,
            holder,
            group_locks: std::sync::Mutex::new(BTreeMap::new()),
        })
    }

    /// Why `cloud` cannot be used now (for nodes too, with `nodes`), if it
    /// cannot: no driver registered by that name ([`CloudError::NoDriver`]),
    /// or settings missing from the provider and the environment. Said at
    /// plan time, before anything is created.
    pub fn cloud_unusable(&self, cloud: &str, nodes: bool) -> Option<CloudError> {
        self.clouds.unusable(cloud, nodes)
    }

    pub(crate) fn cloud(&self, name: &str) -> Result<&dyn Cloud> {
        Ok(self.clouds.nodes(name)?)
    }

    fn distributor_driver(&self, cloud: &str) -> Result<&dyn Distributor> {
        Ok(self.clouds.distributors(cloud)?)
    }

    // --- traffic distributors ----------------------------------------------------

    pub async fn create_distributor(&self, spec: &DistributorSpec) -> Result<String> {
        let driver = self.distributor_driver(&spec.cloud)?;
        let id = new_id("td");
        self.store.insert_distributor(&id, spec)?;
        driver.publish(&id, spec, &Publication::default()).await?;
        Ok(id)
    }

    pub async fn update_distributor(&self, id: &str, spec: &DistributorSpec) -> Result<()> {
        self.store.update_distributor(id, spec)?;
        self.publish(id).await
    }

    /// Stops the distributor and forgets it. Groups that still name it keep
    /// serving through their nodes; Terraform replaces a distributor by destroying
    /// it before the groups move to the new one, so this is not refused. A group
    /// left pointing at a distributor that is gone gets a plan-time error.
    pub async fn delete_distributor(&self, id: &str) -> Result<()> {
        let Some(row) = self.store.distributor(id)? else {
            return Ok(());
        };
        for g in self.store.groups_of_distributor(id)? {
            self.store.record_event(
                &g.id,
                None,
                "distributor_removed",
                &format!("traffic distributor {:?} destroyed", row.spec.name),
            )?;
        }
        // Under the distributor's lease: a publication in flight (the daemon's)
        // must not restart the process that this removes.
        let turn = self
            .lease(
                &distributor_lease_key(id),
                Instant::now() + PUBLISH_LEASE_WAIT,
            )
            .await?;
        self.distributor_driver(&row.spec.cloud)?.remove(id).await?;
        // Deletes the lease row too.
        self.store.delete_distributor(id)?;
        drop(turn);
        Ok(())
    }

    pub fn distributor_view(&self, id: &str) -> Result<Option<DistributorView>> {
        let Some(row) = self.store.distributor(id)? else {
            return Ok(None);
        };
        let driver = self.distributor_driver(&row.spec.cloud)?;
        let publication = self.publication(id)?;
        Ok(Some(DistributorView {
            endpoints: publication.endpoints.values().flatten().cloned().collect(),
            address: driver.addresses(id, &row.spec),
            id: row.id,
            spec: row.spec,
        }))
    }

    /// What the distributor must hand out now: every registered node of every group
    /// that uses it, and the ports of the vservers placed on those groups.
    fn publication(&self, distributor_id: &str) -> Result<Publication> {
        let mut p = Publication::default();
        // Clients resolve a `dns` distributor's name to the nodes' public
        // addresses (where the cloud gives them one); an `nlb` reaches them on
        // their private ones.
        let dns = self
            .store
            .distributor(distributor_id)?
            .is_some_and(|d| d.spec.mode == "dns");
        for g in self.store.groups_of_distributor(distributor_id)? {
            let mut ports: Vec<u16> = self
                .store
                .vservers_of_group(&g.id)?
                .iter()
                .filter(|v| v.spec.service_type != "UDP")
                .map(|v| v.spec.port as u16)
                .collect();
            ports.sort_unstable();
            ports.dedup();
            for az in &g.spec.availability_zones {
                p.endpoints.entry(az.clone()).or_default();
                let e = p.ports.entry(az.clone()).or_default();
                e.extend(&ports);
                e.sort_unstable();
                e.dedup();
            }
            let nodes = self.store.nodes_of_group(&g.id)?;
            let registered: Vec<&NodeRow> = nodes.iter().filter(|n| n.registered).collect();
            for n in &registered {
                p.endpoints
                    .entry(n.az.clone())
                    .or_default()
                    .push(match (&n.public_ip, dns) {
                        (Some(public), true) => public.clone(),
                        _ => n.private_ip.clone(),
                    });
            }
            // SE scale-out: a port goes to its primary, or to its holders by flow
            // hash. Vservers of several groups on one port share it.
            let ports_of: BTreeMap<String, u16> = self
                .store
                .vservers_of_group(&g.id)?
                .into_iter()
                .filter(|v| v.spec.service_type != "UDP")
                .map(|v| (v.spec.name, v.spec.port as u16))
                .collect();
            for ((vserver, az), placed) in self.placements(&g, &registered)? {
                let Some(port) = ports_of.get(&vserver) else {
                    continue;
                };
                let t = p
                    .port_targets
                    .entry(az)
                    .or_default()
                    .entry(*port)
                    .or_default();
                for a in placed.targets {
                    if !t.addresses.contains(&a) {
                        t.addresses.push(a);
                    }
                }
                // Groups sharing a port: flow hash wins over primary-first, which
                // wins over round robin.
                t.balance = t.balance.max(placed.balance);
            }
        }
        Ok(p)
    }

    /// Makes the distributor hand out what the store says now; a distributor
    /// that is gone (destroyed for a replacement) has nothing left to update.
    ///
    /// One publication at a time per distributor, across processes (the
    /// distributor's lease): the daemon and a Terraform apply, or two groups of
    /// one apply, may change what a distributor hands out at the same moment.
    /// Each reads the store and bumps the distributor's configuration version;
    /// interleaved, the later write could carry the earlier view under the same
    /// version and a registration would be lost until the next publication.
    pub(crate) async fn publish(&self, distributor_id: &str) -> Result<()> {
        // A distributor destroyed under its groups (to be replaced) has nothing
        // to publish, and must not get a lease row that nothing would delete.
        if self.store.distributor(distributor_id)?.is_none() {
            return Ok(());
        }
        let turn = self
            .lease(
                &distributor_lease_key(distributor_id),
                Instant::now() + PUBLISH_LEASE_WAIT,
            )
            .await?;
        let r = self.publish_holding_lease(distributor_id).await;
        turn.release();
        r
    }

    async fn publish_holding_lease(&self, distributor_id: &str) -> Result<()> {
        let Some(row) = self.store.distributor(distributor_id)? else {
            return Ok(());
        };
        let publication = self.publication(distributor_id)?;
        self.distributor_driver(&row.spec.cloud)?
            .publish(distributor_id, &row.spec, &publication)
            .await
            .map_err(|e| EngineError::Step {
                step: "register addresses with the distributor",
                detail: e.to_string(),
            })
    }

    // --- autoscale groups --------------------------------------------------------

    /// Rules that need the store: the distributor exists and is on the same cloud.
    pub fn check_group(&self, spec: &GroupSpec) -> Result<Findings> {
        let mut f = Findings::default();
        match self.store.distributor(&spec.traffic_distributor_id)? {
            None => f.0.push(Finding::error(
                vec![PathStep::Attr("traffic_distributor_id")],
                "Unknown traffic distributor",
                format!(
                    "no traffic distributor has id {:?}.",
                    spec.traffic_distributor_id
                ),
            )),
            Some(d) if d.spec.cloud != spec.cloud => f.0.push(Finding::error(
                vec![PathStep::Attr("cloud")],
                "Cloud mismatch",
                format!(
                    "cloud must equal the traffic distributor's cloud ({:?}), got {:?}.",
                    d.spec.cloud, spec.cloud
                ),
            )),
            Some(_) => {}
        }
        Ok(f)
    }

    fn reject(findings: Findings) -> Result<()> {
        match findings
            .0
            .into_iter()
            .find(|f| f.severity == crate::model::Severity::Error)
        {
            Some(f) => Err(EngineError::Invalid(f)),
            None => Ok(()),
        }
    }

    /// Declares the group in the store (after the store-backed checks) and
    /// returns its id; [`Engine::reconcile_group`] then brings it up. Two steps,
    /// so that a group whose bring-up fails is still known (and can be retried
    /// or destroyed) rather than orphaned.
    pub fn declare_group(&self, spec: &GroupSpec) -> Result<String> {
        Self::reject(self.check_group(spec)?)?;
        self.cloud(&spec.cloud)?;
        let id = new_id("asg");
        self.store.insert_group(&id, spec, &new_token())?;
        self.store
            .record_event(&id, None, "group_created", "declared by terraform apply")?;
        Ok(id)
    }

    pub async fn update_group(&self, id: &str, spec: &GroupSpec) -> Result<()> {
        Self::reject(self.check_group(spec)?)?;
        let old = self
            .store
            .group(id)?
            .ok_or_else(|| EngineError::NotFound(format!("autoscale group {id}")))?;
        self.store.update_group(id, spec)?;
        self.reconcile_group(id).await?;
        if old.spec.traffic_distributor_id != spec.traffic_distributor_id {
            self.publish(&old.spec.traffic_distributor_id).await?;
        }
        Ok(())
    }

    pub async fn delete_group(&self, id: &str) -> Result<()> {
        let Some(group) = self.store.group(id)? else {
            return Ok(());
        };
        let name = &group.spec.name;
        wait_unused(format!("autoscale group {name:?}"), "SE group", || {
            Ok(self.store.se_groups_of_group(id)?.into_iter().map(|s| s.spec.name).collect())
        })
        .await?;
        // Destroy may take the TTL plus a full drain: bound it by those, not apply_timeout.
        let budget =
            group.spec.drain_timeout() + self.ttl_of(&group.spec)? + Duration::from_secs(60);
        let deadline = Instant::now() + budget;
        let lease = self.lease(id, deadline).await?;
        let nodes = self.store.nodes_of_group(id)?;
        let out = self
            .scale_in(&group, nodes, deadline, "group destroyed", &lease)
            .await;
        lease.release();
        out?;
        self.store.delete_group(id)?;
        self.store.release_addresses(id)?;
        Ok(())
    }

    /// The group and its nodes as they are now. A node whose liveness the
    /// cloud could not tell is shown as the store has it.
    pub async fn group_view(&self, id: &str) -> Result<Option<GroupView>> {
        let Some(row) = self.store.group(id)? else {
            return Ok(None);
        };
        let cloud = self.cloud(&row.spec.cloud)?;
        let rows = self.store.nodes_of_group(id)?;
        let alive = cloud
            .alive(&rows)
            .await
            .unwrap_or_else(|_| vec![true; rows.len()]);
        let mut nodes = Vec::new();
        for (n, alive) in rows.into_iter().zip(alive) {
            nodes.push({
                let state = if n.state.is_member() && n.state != NodeState::Provisioning && !alive {
                    NodeState::Failed
                } else {
                    n.state
                };
                NodeView {
                    serving: alive && n.registered && state == NodeState::Active,
                    id: n.id,
                    availability_zone: n.az,
                    private_ip: n.private_ip,
                    public_ip: n.public_ip,
                    state: state.as_str().to_string(),
                }
            });
        }
        Ok(Some(GroupView {
            id: row.id,
            spec: row.spec,
            nodes,
        }))
    }

    pub(crate) fn ttl_of(&self, spec: &GroupSpec) -> Result<Duration> {
        let d = self.store.distributor(&spec.traffic_distributor_id)?;
        Ok(match d {
            Some(d) if d.spec.mode == "dns" => {
                parse_duration(&d.spec.ttl).unwrap_or(Duration::from_secs(60))
            }
            _ => Duration::ZERO,
        })
    }

    /// Takes the lease `key` (a group's id, or [`distributor_lease_key`]), waiting
    /// for another holder (the daemon, another apply) to let go until `deadline`.
    /// Within this process, one operation at a time holds it (the store's lease is
    /// held in the process's name, so it alone would let two of them in).
    /// The lease is short ([`WORKFLOW_LEASE_TTL`]) and renewed while the work runs.
    pub(crate) async fn lease(&self, key: &str, deadline: Instant) -> Result<KeptLease> {
        let ttl = WORKFLOW_LEASE_TTL;
        let turn = {
            let lock = self
                .group_locks
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .entry(key.to_string())
                .or_default()
                .clone();
            tokio::time::timeout_at(deadline.into(), lock.lock_owned())
                .await
                .map_err(|_| EngineError::Timeout {
                    step: "take the lease",
                    after_s: 0,
                    detail: format!("another operation of this process still holds {key}"),
                })?
        };
        let mut turn = Some(turn);
        loop {
            match self.store.acquire_lease(key, &self.holder, ttl) {
                Ok(l) => {
                    let mut kept = KeptLease::keep(self.store.clone(), l, ttl);
                    kept._turn = turn.take();
                    return Ok(kept);
                }
                Err(StoreError::LeaseHeld { holder, .. }) if Instant::now() < deadline => {
                    tracing::info!(key, holder, "waiting for the lease");
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
                Err(StoreError::LeaseHeld { holder, .. }) => {
                    return Err(EngineError::Timeout {
                        step: "take the lease",
                        after_s: 0,
                        detail: format!("{holder} still holds {key}"),
                    })
                }
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// Brings the group to its declared shape, bounded by `apply_timeout`:
    /// failed nodes replaced, every AZ between `min_nodes` and `max_nodes`, every
    /// node running the group's vservers, every active node registered with the
    /// distributor, removed AZs and extra nodes drained and removed. A count that
    /// the daemon set inside the bounds is left as it is.
    pub async fn reconcile_group(&self, id: &str) -> Result<()> {
        let group = self
            .store
            .group(id)?
            .ok_or_else(|| EngineError::NotFound(format!("autoscale group {id}")))?;
        let started = Instant::now();
        let deadline = started + group.spec.apply_timeout();
        let lease = self.lease(id, deadline).await?;
        let out = self.reconcile_locked(&group, deadline, &lease).await;
        lease.release();
        out.map_err(|e| match e {
            EngineError::Timeout { step, detail, .. } => EngineError::Timeout {
                step,
                after_s: started.elapsed().as_secs(),
                detail,
            },
            other => other,
        })
    }

    async fn reconcile_locked(
        &self,
        group: &Row<GroupSpec>,
        deadline: Instant,
        lease: &KeptLease,
    ) -> Result<()> {
        let (id, spec) = (&group.id, &group.spec);
        let cloud = self.cloud(&spec.cloud)?;
        let token = self
            .store
            .group_token(id)?
            .ok_or_else(|| EngineError::NotFound(format!("token of group {id}")))?;

        // 1. Observe, then let the core decide (docs/design.md, "Apply").
        let rows = self.store.nodes_of_group(id)?;
        let alive = cloud.alive(&rows).await?;
        let observed: Vec<apply::ObservedNode> = rows
            .iter()
            .zip(&alive)
            .map(|(n, alive)| apply::ObservedNode {
                id: n.id.clone(),
                az: n.az.clone(),
                seq: n.seq,
                life: match n.state {
                    NodeState::Failed => apply::Life::Failed,
                    s if s.is_member() && !alive => apply::Life::Failed,
                    s if s.is_member() => apply::Life::Member,
                    _ => apply::Life::Leaving,
                },
            })
            .collect();
        let shape = apply::Shape {
            availability_zones: spec.availability_zones.clone(),
            min_nodes: spec.min_nodes.max(0) as u32,
            max_nodes: spec.max_nodes.max(0) as u32,
        };
        let plan = apply::plan(&shape, &observed);

        // 2. Failed nodes: nothing to drain, removed at once.
        let mut registration_changed = false;
        for mut n in rows
            .iter()
            .filter(|n| plan.remove_failed.contains(&n.id))
            .cloned()
        {
            lease.check()?;
            registration_changed |= n.registered;
            n.state = NodeState::Failed;
            n.registered = false;
            self.store.update_node(&n)?;
            self.store.record_event(
                id,
                Some(&n.az),
                "node_failed",
                &format!("node {} is not running", n.id),
            )?;
            cloud.deprovision(&n).await?;
            self.store.delete_node(&n.id)?;
            self.store.record_event(
                id,
                Some(&n.az),
                "node_removed",
                &format!("failed node {} removed", n.id),
            )?;
        }
        if registration_changed {
            lease.check()?;
            self.publish(&spec.traffic_distributor_id).await?;
        }
        // (Registrations made in step 4 are published at its end.)
        let leaving: Vec<NodeRow> = plan
            .leave
            .iter()
            .filter_map(|(leaver, _)| rows.iter().find(|n| &n.id == leaver).cloned())
            .collect();

        // 3. Provision up to min_nodes in every AZ.
        for (az, count) in &plan.start {
            for _ in 0..*count {
                self.provision(
                    group,
                    az,
                    &token,
                    lease,
                    &format!("below min_nodes ({})", group.spec.min_nodes),
                )
                .await?;
            }
        }

        // 4. Configure every staying node with the group's vservers; a node that
        //    runs the current configuration is active.
        let leaving_ids: Vec<String> = leaving.iter().map(|n| n.id.clone()).collect();
        self.push_configs(cloud, group, &token, &leaving_ids, deadline, lease)
            .await?;
        // Ports may have changed even when no node did (a vserver was added).
        lease.check()?;
        self.publish(&spec.traffic_distributor_id).await?;

        // 5. Remove the nodes that leave: out of the distributor, TTL, drain, gone.
        if !leaving.is_empty() {
            self.scale_in(
                group,
                leaving,
                deadline,
                "over max_nodes or in a removed availability zone",
                lease,
            )
            .await?;
        }
        Ok(())
    }

    /// The scale-out workflow for one AZ (what the daemon runs when a breach is
    /// confirmed): provision a node, join it (push every vserver), register it in
    /// the store and add its address to the distributor. Refused at max_nodes.
    /// Returns the new node's id.
    pub async fn scale_out(&self, group_id: &str, az: &str, reason: &str) -> Result<String> {
        let group = self
            .store
            .group(group_id)?
            .ok_or_else(|| EngineError::NotFound(format!("autoscale group {group_id}")))?;
        let deadline = Instant::now() + group.spec.apply_timeout();
        let lease = self.lease(group_id, deadline).await?;
        let out = async {
            let members = self
                .store
                .nodes_of_group(group_id)?
                .into_iter()
                .filter(|n| n.az == az && n.state.is_member())
                .count() as i64;
            if !group.spec.availability_zones.iter().any(|z| z == az)
                || members >= group.spec.max_nodes
            {
                return Err(EngineError::Step {
                    step: "scale out",
                    detail: format!(
                        "{az} has {members} node(s), max_nodes is {} (or the AZ is not declared)",
                        group.spec.max_nodes
                    ),
                });
            }
            lease.check()?;
            self.store
                .record_event(group_id, Some(az), "scale_out", reason)?;
            let before: Vec<String> = self
                .store
                .nodes_of_group(group_id)?
                .into_iter()
                .map(|n| n.id)
                .collect();
            // Level-triggered: provisioning one more node and reconciling joins,
            // configures and registers it like any other.
            let token = self.store.group_token(group_id)?.unwrap_or_default();
            self.provision(&group, az, &token, &lease, "scale-out")
                .await?;
            self.reconcile_locked(&group, deadline, &lease).await?;
            let added = self
                .store
                .nodes_of_group(group_id)?
                .into_iter()
                .find(|n| !before.contains(&n.id));
            added.map(|n| n.id).ok_or_else(|| EngineError::Step {
                step: "scale out",
                detail: "the new node disappeared".into(),
            })
        }
        .await;
        lease.release();
        out
    }

    /// The scale-in workflow for one AZ: the newest node leaves (out of the
    /// distributor, one TTL, drain, deprovision). Refused at min_nodes.
    pub async fn scale_in_one(&self, group_id: &str, az: &str, reason: &str) -> Result<String> {
        let group = self
            .store
            .group(group_id)?
            .ok_or_else(|| EngineError::NotFound(format!("autoscale group {group_id}")))?;
        let deadline = Instant::now()
            + group.spec.drain_timeout()
            + self.ttl_of(&group.spec)?
            + Duration::from_secs(60);
        let lease = self.lease(group_id, deadline).await?;
        let out = async {
            let members: Vec<NodeRow> = self
                .store
                .nodes_of_group(group_id)?
                .into_iter()
                .filter(|n| n.az == az && n.state.is_member())
                .collect();
            if members.len() as i64 <= group.spec.min_nodes {
                return Err(EngineError::Step {
                    step: "scale in",
                    detail: format!(
                        "{az} has {} node(s), min_nodes is {}",
                        members.len(),
                        group.spec.min_nodes
                    ),
                });
            }
            // Nodes are in creation order: the newest leaves.
            let leaving = members
                .last()
                .cloned()
                .expect("more than min_nodes members");
            let id = leaving.id.clone();
            self.scale_in(&group, vec![leaving], deadline, reason, &lease)
                .await?;
            Ok(id)
        }
        .await;
        lease.release();
        out
    }

    /// Joins every member of the group that stays (not in `leaving`) and pushes
    /// each its configuration if it changed. Newest first: a new secondary serves
    /// before its primary starts forwarding to it, and the nodes of a new group
    /// (none active yet) do not ramp against each other.
    pub(crate) async fn push_configs(
        &self,
        cloud: &dyn Cloud,
        group: &Row<GroupSpec>,
        token: &str,
        leaving: &[String],
        deadline: Instant,
        lease: &KeptLease,
    ) -> Result<()> {
        self.push_configs_with(
            cloud,
            group,
            token,
            leaving,
            Duration::ZERO,
            deadline,
            lease,
        )
        .await
    }

    /// [`Engine::push_configs`], with the primaries keeping the connections they
    /// forwarded to a dropped secondary at least `scalein_floor`.
    #[allow(clippy::too_many_arguments)]
    async fn push_configs_with(
        &self,
        cloud: &dyn Cloud,
        group: &Row<GroupSpec>,
        token: &str,
        leaving: &[String],
        scalein_floor: Duration,
        deadline: Instant,
        lease: &KeptLease,
    ) -> Result<()> {
        let version = self.store.config_version(&group.id)?;
        let config = self.node_config(&group.id, version)?;
        for n in self.store.nodes_of_group(&group.id)?.into_iter().rev() {
            if !n.state.is_member() || leaving.contains(&n.id) {
                continue;
            }
            self.join(
                cloud,
                group,
                n,
                token,
                &config,
                leaving,
                scalein_floor,
                deadline,
                lease,
            )
            .await?;
        }
        Ok(())
    }

    /// Joins a node to its cluster: pushes its configuration (the group's vservers
    /// with this node's scale-out roles) if the node does not run it yet (then it
    /// is active), and marks it registered with the distributor (the caller
    /// publishes).
    #[allow(clippy::too_many_arguments)]
    async fn join(
        &self,
        cloud: &dyn Cloud,
        group: &Row<GroupSpec>,
        mut n: NodeRow,
        token: &str,
        base: &lbscale_proto::NodeConfig,
        leaving: &[String],
        scalein_floor: Duration,
        deadline: Instant,
        lease: &KeptLease,
    ) -> Result<()> {
        let group_id = group.id.as_str();
        let version = base.version;
        let mut config = self.config_for_node(group, base, &n, leaving)?;
        // The floor matters only to the secondaries dropped by this push; the
        // configuration is otherwise the same (no re-push for it later).
        let fingerprint = config_fingerprint(&config);
        for v in &mut config.vservers {
            if let Some(so) = v.scaleout.as_mut() {
                so.scalein_timeout_ms = so.scalein_timeout_ms.max(scalein_floor.as_millis() as u64);
            }
        }
        let applied = n.handle.get("config_fingerprint").and_then(|v| v.as_str());
        if applied != Some(fingerprint.as_str()) || n.state != NodeState::Active {
            if n.state != NodeState::Active {
                // A joining node's services are new: they ramp under slow start
                // against the nodes that already serve in its AZ. Only older nodes
                // are peers, so forwarding between ramping nodes never loops; a
                // node that is already active gets none (a vserver added to every
                // node at once does not ramp anywhere).
                let peers: Vec<String> = self
                    .store
                    .nodes_of_group(group_id)?
                    .into_iter()
                    .filter(|p| {
                        p.az == n.az
                            && p.seq < n.seq
                            && p.state == NodeState::Active
                            && p.registered
                    })
                    .map(|p| p.private_ip)
                    .collect();
                for v in &mut config.vservers {
                    // Manual slow start (interval 0) would hold every new node at
                    // new_service_request until an operator acts, so a scale-out
                    // would add no capacity: a joining node ramps only
                    // automatically.
                    let automatic = v.slow_start.as_ref().is_some_and(|ss| {
                        ss.new_service_request > 0 && ss.increment_interval_s > 0
                    });
                    if automatic {
                        v.ramp_peers = peers.clone();
                    }
                }
            }
            lease.check()?;
            self.configure(cloud, &n, token, config, deadline).await?;
            fault_point("after_configure");
            lease.check()?;
            n.handle["config_version"] = version.into();
            n.handle["config_fingerprint"] = fingerprint.into();
            if n.state != NodeState::Active {
                n.state = NodeState::Active;
                self.store.record_event(
                    group_id,
                    Some(&n.az),
                    "node_active",
                    &format!(
                        "node {} serves the group's vservers (configuration {version})",
                        n.id
                    ),
                )?;
            }
            self.store.update_node(&n)?;
        }
        if !n.registered {
            lease.check()?;
            n.registered = true;
            self.store.update_node(&n)?;
            self.store.record_event(
                group_id,
                Some(&n.az),
                "node_registered",
                &format!(
                    "node {} ({}) added to the traffic distributor",
                    n.id, n.private_ip
                ),
            )?;
            fault_point("after_register");
        }
        Ok(())
    }

    /// Restarts every node of the group, one at a time and surge first: a new
    /// node joins and serves before the old one leaves (TTL, drain, gone). Used
    /// when a setting that nodes read only at start-up changes (`se_tunnel_mode`).
    pub async fn rolling_restart(&self, group_id: &str, reason: &str) -> Result<()> {
        let group = self
            .store
            .group(group_id)?
            .ok_or_else(|| EngineError::NotFound(format!("autoscale group {group_id}")))?;
        let old: Vec<NodeRow> = self
            .store
            .nodes_of_group(group_id)?
            .into_iter()
            .filter(|n| n.state.is_member())
            .collect();
        let per_node =
            group.spec.apply_timeout() + group.spec.drain_timeout() + self.ttl_of(&group.spec)?;
        let deadline = Instant::now() + per_node * (old.len() as u32).max(1);
        let lease = self.lease(group_id, deadline).await?;
        let out = async {
            let cloud = self.cloud(&group.spec.cloud)?;
            let token = self.store.group_token(group_id)?.unwrap_or_default();
            let config = self.node_config(group_id, self.store.config_version(group_id)?)?;
            self.store.record_event(
                group_id,
                None,
                "rolling_restart",
                &format!("{reason}: {} node(s), one at a time", old.len()),
            )?;
            // Newest first: the oldest node (every vserver's scale-out primary)
            // is replaced last, so the primary moves once, not at every step.
            for n in old.into_iter().rev() {
                let before: Vec<String> = self
                    .store
                    .nodes_of_group(group_id)?
                    .into_iter()
                    .map(|x| x.id)
                    .collect();
                self.provision(
                    &group,
                    &n.az,
                    &token,
                    &lease,
                    &format!("replaces {} (rolling restart)", n.id),
                )
                .await?;
                let fresh = self
                    .store
                    .nodes_of_group(group_id)?
                    .into_iter()
                    .find(|x| !before.contains(&x.id))
                    .ok_or_else(|| EngineError::Step {
                        step: "rolling restart",
                        detail: "the new node disappeared".into(),
                    })?;
                self.join(
                    cloud,
                    &group,
                    fresh,
                    &token,
                    &config,
                    &[],
                    Duration::ZERO,
                    deadline,
                    &lease,
                )
                .await?;
                // The primaries learn of the new node before the old one leaves.
                self.push_configs(
                    cloud,
                    &group,
                    &token,
                    std::slice::from_ref(&n.id),
                    deadline,
                    &lease,
                )
                .await?;
                lease.check()?;
                self.publish(&group.spec.traffic_distributor_id).await?;
                self.scale_in(
                    &group,
                    vec![n],
                    deadline,
                    "replaced by the rolling restart",
                    &lease,
                )
                .await?;
            }
            Ok(())
        }
        .await;
        lease.release();
        out
    }

    pub(crate) async fn provision(
        &self,
        group: &Row<GroupSpec>,
        az: &str,
        token: &str,
        lease: &KeptLease,
        why: &str,
    ) -> Result<()> {
        let (id, spec) = (&group.id, &group.spec);
        let cloud = self.cloud(&spec.cloud)?;
        let seq = self.store.next_node_seq(id)?;
        let node_id = format!("{}-{}-{}-{:04x}", spec.name, az, seq, rand::random::<u16>());
        // The row exists before the side effect, so that a crash never forgets a node.
        let mut row = NodeRow {
            id: node_id.clone(),
            group_id: id.clone(),
            az: az.to_string(),
            seq,
            state: NodeState::Provisioning,
            private_ip: String::new(),
            public_ip: None,
            registered: false,
            handle: serde_json::json!({}),
            created_at: now_ms(),
        };
        lease.check()?;
        self.store.insert_node(&row)?;
        self.store.record_event(
            id,
            Some(az),
            "node_provisioning",
            &format!("node {node_id}: {why}"),
        )?;
        fault_point("after_node_row");
        lease.check()?;
        let req = ProvisionRequest {
            node_id: node_id.clone(),
            group_id: id.clone(),
            az: az.to_string(),
            memory_limit_mb: spec.memory_limit_mb(),
            token: token.to_string(),
        };
        // Not cut short by the apply deadline: a node that exists must be recorded,
        // or it would be orphaned. The driver bounds its own start-up wait.
        let p = match cloud.provision(&req).await {
            Ok(p) => p,
            Err(e) => {
                // The cloud may have made the node before failing (an answer
                // lost, a start that timed out): remove whatever carries its id
                // before forgetting it. If that fails too, the row stays as
                // failed, and the next reconcile removes it.
                match cloud.deprovision(&row).await {
                    Ok(()) => self.store.delete_node(&node_id)?,
                    Err(cleanup) => {
                        row.state = NodeState::Failed;
                        self.store.update_node(&row)?;
                        tracing::warn!(node = %node_id, error = %cleanup, "could not remove what a failed provisioning left; the next reconcile retries");
                    }
                }
                return Err(EngineError::Step {
                    step: "provision node",
                    detail: e.to_string(),
                });
            }
        };
        fault_point("after_provision");
        row.private_ip = p.private_ip;
        row.public_ip = p.public_ip;
        row.handle = p.handle;
        if let Err(e) = lease.check() {
            // Another holder owns the group now and may already have given up
            // on this row: stop the process that only this run knows of.
            let _ = cloud.deprovision(&row).await;
            return Err(e.into());
        }
        row.state = NodeState::Joining;
        self.store.update_node(&row)?;
        self.store.record_event(
            id,
            Some(az),
            "node_joining",
            &format!("node {node_id} is up at {}", row.private_ip),
        )?;
        Ok(())
    }

    async fn configure(
        &self,
        cloud: &dyn Cloud,
        n: &NodeRow,
        token: &str,
        config: lbscale_proto::NodeConfig,
        deadline: Instant,
    ) -> Result<()> {
        let port = cloud.api_port(n);
        let mut last = String::new();
        while Instant::now() < deadline {
            let attempt = async {
                let mut c = NodeClient::connect(&n.private_ip, port, token).await?;
                c.configure(config.clone()).await
            };
            match attempt.await {
                Ok(_) => return Ok(()),
                // A refusal (a port in use, say) will not fix itself: report it now.
                Err(e @ crate::nodeapi::NodeApiError::Refused { .. }) => {
                    return Err(EngineError::Step {
                        step: "push the vservers to the node",
                        detail: format!("node {}: {e}", n.id),
                    })
                }
                Err(e) => last = e.to_string(),
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        Err(EngineError::Timeout {
            step: "wait for the node to be active",
            after_s: 0,
            detail: format!("node {} did not take its configuration: {last}", n.id),
        })
    }

    /// Removes `nodes` from the group: deregister, wait one TTL (dns), drain (ends
    /// early when the node has no connections left; at most drain_timeout), then
    /// deprovision and forget.
    pub(crate) async fn scale_in(
        &self,
        group: &Row<GroupSpec>,
        nodes: Vec<NodeRow>,
        deadline: Instant,
        reason: &str,
        lease: &KeptLease,
    ) -> Result<()> {
        if nodes.is_empty() {
            lease.check()?;
            self.publish(&group.spec.traffic_distributor_id).await?;
            return Ok(());
        }
        let (id, spec) = (&group.id, &group.spec);
        let cloud = self.cloud(&spec.cloud)?;
        let token = self.store.group_token(id)?.unwrap_or_default();
        let mut nodes = nodes;
        for n in nodes.iter_mut() {
            lease.check()?;
            if n.state.is_member() {
                self.store.record_event(
                    id,
                    Some(&n.az),
                    "scale_in",
                    &format!("node {}: {reason}", n.id),
                )?;
            }
            n.registered = false;
            if n.state != NodeState::Deprovisioning {
                n.state = NodeState::Draining;
            }
            self.store.update_node(n)?;
        }
        fault_point("after_deregister");
        // Primaries stop forwarding new connections to the nodes that leave. The
        // ones they forwarded there stay open as long as the node's drain may take
        // (not just vs_scalein_timeout: the node leaves the group, not only the
        // vserver). Best effort, bounded: a member that does not answer must not
        // hold up the scale-in; the daemon finds it stale and pushes it later.
        let push_deadline = (Instant::now() + CONFIG_PUSH_TIMEOUT).min(deadline);
        let floor = spec.drain_timeout();
        match self
            .push_configs_with(cloud, group, &token, &[], floor, push_deadline, lease)
            .await
        {
            Err(e @ EngineError::Store(_)) => return Err(e),
            Err(e) => self.store.record_event(
                id,
                None,
                "config_push_failed",
                &format!("while nodes leave: {e} (retried by the next reconcile)"),
            )?,
            Ok(()) => {}
        }
        lease.check()?;
        self.publish(&spec.traffic_distributor_id).await?;

        let ttl = self.ttl_of(spec)?;
        if !ttl.is_zero() && nodes.iter().any(|n| n.state == NodeState::Draining) {
            let until = (Instant::now() + ttl).min(deadline);
            tokio::time::sleep_until(until.into()).await;
            if Instant::now() >= deadline {
                return Err(EngineError::Timeout {
                    step: "wait one DNS TTL",
                    after_s: 0,
                    detail: format!("TTL {}s", ttl.as_secs()),
                });
            }
            self.store.record_event(
                id,
                None,
                "ttl_end",
                &format!("waited one DNS TTL ({}s)", ttl.as_secs()),
            )?;
        }

        let drain_until = (Instant::now() + spec.drain_timeout()).min(deadline);
        for n in nodes.iter_mut().filter(|n| n.state == NodeState::Draining) {
            lease.check()?;
            let port = cloud.api_port(n);
            if cloud.is_alive(n).await.unwrap_or(true) {
                if let Ok(mut c) = NodeClient::connect(&n.private_ip, port, &token).await {
                    let left = drain_until.saturating_duration_since(Instant::now());
                    let _ = c.drain(left).await;
                    loop {
                        let conns = c.stats().await.map(|s| s.active_connections).unwrap_or(0);
                        if conns == 0 {
                            break;
                        }
                        if Instant::now() >= drain_until {
                            if drain_until >= deadline && Instant::now() >= deadline {
                                return Err(EngineError::Timeout {
                                    step: "drain the node",
                                    after_s: 0,
                                    detail: format!(
                                        "node {} still had {conns} connection(s)",
                                        n.id
                                    ),
                                });
                            }
                            break;
                        }
                        tokio::time::sleep(Duration::from_millis(200)).await;
                    }
                }
            }
            lease.check()?;
            self.store.record_event(
                id,
                Some(&n.az),
                "drain_end",
                &format!("node {} drained", n.id),
            )?;
            n.state = NodeState::Deprovisioning;
            self.store.update_node(n)?;
            fault_point("after_drain");
        }

        for n in &nodes {
            lease.check()?;
            self.store.record_event(
                id,
                Some(&n.az),
                "deprovision_start",
                &format!("node {}", n.id),
            )?;
            cloud.deprovision(n).await?;
            fault_point("after_deprovision_before_delete");
            lease.check()?;
            self.store.delete_node(&n.id)?;
            self.store.record_event(
                id,
                Some(&n.az),
                "node_removed",
                &format!("node {} removed", n.id),
            )?;
        }
        Ok(())
    }

    /// The vservers' placements in the group's AZs over `nodes` (oldest first),
    /// keyed by (vserver, AZ). Empty unless the distributor is an `nlb`: behind
    /// DNS, clients reach every node directly and no node forwards.
    fn placements(
        &self,
        group: &Row<GroupSpec>,
        nodes: &[&NodeRow],
    ) -> Result<BTreeMap<(String, String), placement::AzPlacement>> {
        let mut out = BTreeMap::new();
        if !self.behind_nlb(&group.spec)? {
            return Ok(out);
        }
        let se_groups: BTreeMap<String, SeGroupSpec> = self
            .store
            .se_groups_of_group(&group.id)?
            .into_iter()
            .map(|r| (r.id, r.spec))
            .collect();
        for v in self.store.vservers_of_group(&group.id)? {
            let Some(se) = se_groups.get(&v.spec.se_group_id) else {
                continue;
            };
            for az in &group.spec.availability_zones {
                let settings = placement::SeSettings {
                    mode: ScalingMode::parse(&se.scaling_mode).unwrap_or(ScalingMode::Native),
                    span: self.span_of(&v.id, az, se)?,
                    forwarding_cost: se.primary_forwarding_cost,
                    scalein_timeout_ms: parse_duration(&se.vs_scalein_timeout)
                        .map(|d| d.as_millis() as u64)
                        .unwrap_or(lbscale_core::seplan::DEFAULT_VS_SCALEIN_TIMEOUT),
                };
                let mut in_az: Vec<&&NodeRow> = nodes.iter().filter(|n| &n.az == az).collect();
                in_az.sort_by_key(|n| n.seq);
                let addresses: Vec<String> = in_az.iter().map(|n| n.private_ip.clone()).collect();
                out.insert(
                    (v.spec.name.clone(), az.clone()),
                    placement::place(&settings, &addresses),
                );
            }
        }
        Ok(out)
    }

    /// Whether the group's distributor is an `nlb`: only behind one does a
    /// vserver have a span, a primary and secondaries.
    fn behind_nlb(&self, group: &GroupSpec) -> Result<bool> {
        Ok(self
            .store
            .distributor(&group.traffic_distributor_id)?
            .is_some_and(|d| d.spec.mode == "nlb"))
    }

    /// How many nodes of `az` hold the vserver: as the daemon sized it, else
    /// `min_scaleout_per_vs`; within the SE group's bounds.
    fn span_of(&self, vserver_id: &str, az: &str, se: &SeGroupSpec) -> Result<u32> {
        let (min, max) = span_bounds(se);
        Ok(self
            .store
            .vserver_span(vserver_id, az)?
            .unwrap_or(min)
            .clamp(min, max))
    }

    /// Every vserver of the group in every AZ behind an `nlb` distributor, with
    /// the nodes that hold it (what [`Engine::placements`] places over). Empty
    /// behind `dns`: clients reach every node, there is no span to size.
    pub fn vserver_spans(&self, group_id: &str) -> Result<Vec<SpanView>> {
        let mut out = Vec::new();
        let Some(group) = self.store.group(group_id)? else {
            return Ok(out);
        };
        if !self.behind_nlb(&group.spec)? {
            return Ok(out);
        }
        let mut members: Vec<NodeRow> = self
            .store
            .nodes_of_group(group_id)?
            .into_iter()
            .filter(|n| n.state.is_member())
            .collect();
        members.sort_by_key(|n| n.seq);
        for se in self.store.se_groups_of_group(group_id)? {
            let (min, max) = span_bounds(&se.spec);
            let plan = lbscale_core::seplan::PlanParams {
                mode: ScalingMode::parse(&se.spec.scaling_mode).unwrap_or(ScalingMode::Native),
                forwarding_cost: se.spec.primary_forwarding_cost,
                ..Default::default()
            };
            for v in self.store.vservers_of_se_group(&se.id)? {
                for az in &group.spec.availability_zones {
                    let span = self.span_of(&v.id, az, &se.spec)?;
                    let holders = members
                        .iter()
                        .filter(|n| &n.az == az)
                        .take(span as usize)
                        .map(|n| n.id.clone())
                        .collect();
                    out.push(SpanView {
                        vserver_id: v.id.clone(),
                        vserver: v.spec.name.clone(),
                        az: az.clone(),
                        holders,
                        span,
                        min,
                        max,
                        plan,
                    });
                }
            }
        }
        Ok(out)
    }

    /// Sets how many nodes of `az` hold the vserver, records why, and pushes the
    /// new roles and shares to the nodes and the new targets to the distributor
    /// (adding an existing node to a vserver takes one push, not a new node).
    /// `claim`: the daemon's claim on the group, which the write is fenced by.
    pub async fn set_vserver_span(
        &self,
        group_id: &str,
        vserver_id: &str,
        az: &str,
        span: u32,
        reason: &str,
        claim: Option<&crate::store::Lease>,
    ) -> Result<()> {
        self.store.set_vserver_span(vserver_id, az, span, claim)?;
        self.store
            .record_event(group_id, Some(az), "vserver_span", reason)?;
        self.redeploy(Some(group_id.to_string())).await
    }

    /// Active nodes of the group whose last pushed configuration is not the one
    /// they should run now (a push that failed half-way, e.g. a primary that did
    /// not take its new secondary). The daemon's resume reconcile pushes them.
    pub fn stale_configurations(&self, group_id: &str) -> Result<Vec<String>> {
        let Some(group) = self.store.group(group_id)? else {
            return Ok(Vec::new());
        };
        let base = self.node_config(group_id, self.store.config_version(group_id)?)?;
        let mut stale = Vec::new();
        for n in self.store.nodes_of_group(group_id)? {
            if n.state != NodeState::Active {
                continue;
            }
            let want = config_fingerprint(&self.config_for_node(&group, &base, &n, &[])?);
            if n.handle.get("config_fingerprint").and_then(|v| v.as_str()) != Some(want.as_str()) {
                stale.push(n.id);
            }
        }
        Ok(stale)
    }

    /// What node `n` runs: the group's vservers with its scale-out role in each
    /// (placed over the members that stay, i.e. not in `leaving`).
    fn config_for_node(
        &self,
        group: &Row<GroupSpec>,
        base: &lbscale_proto::NodeConfig,
        n: &NodeRow,
        leaving: &[String],
    ) -> Result<lbscale_proto::NodeConfig> {
        use lbscale_proto::{Scaleout, ScaleoutPeer, ScaleoutRole};
        let nodes = self.store.nodes_of_group(&group.id)?;
        let staying: Vec<&NodeRow> = nodes
            .iter()
            .filter(|m| m.state.is_member() && !leaving.contains(&m.id))
            .collect();
        let placements = self.placements(group, &staying)?;
        let mut config = base.clone();
        if !placements.is_empty() {
            // Behind an nlb nodes forward to each other (a primary to its
            // secondaries) with a PROXY header naming the client.
            config.group_peers = staying
                .iter()
                .filter(|m| m.id != n.id)
                .map(|m| m.private_ip.clone())
                .collect();
        }
        for v in &mut config.vservers {
            let Some(p) = placements.get(&(v.name.clone(), n.az.clone())) else {
                continue;
            };
            let role = p.roles.iter().find(|(a, _)| *a == n.private_ip);
            v.scaleout = role.map(|(_, role)| match role {
                placement::Role::Primary {
                    own_share,
                    secondaries,
                } => Scaleout {
                    role: ScaleoutRole::Primary as i32,
                    primary_share: *own_share,
                    secondaries: secondaries
                        .iter()
                        .map(|(address, share)| ScaleoutPeer {
                            address: address.clone(),
                            share: *share,
                        })
                        .collect(),
                    scalein_timeout_ms: p.scalein_timeout_ms,
                },
                placement::Role::Secondary => Scaleout {
                    role: ScaleoutRole::Secondary as i32,
                    scalein_timeout_ms: p.scalein_timeout_ms,
                    ..Default::default()
                },
            });
        }
        Ok(config)
    }

    /// The full configuration the group's nodes run: every vserver placed on it.
    fn node_config(&self, group_id: &str, version: u64) -> Result<lbscale_proto::NodeConfig> {
        use lbscale_proto::{LbMethod, Service, ServiceType, Vserver};
        let vservers = self
            .store
            .vservers_of_group(group_id)?
            .into_iter()
            .map(|v| {
                let s = v.spec;
                Vserver {
                    name: s.name,
                    service_type: match s.service_type.as_str() {
                        "HTTP" => ServiceType::Http,
                        "TCP" => ServiceType::Tcp,
                        _ => ServiceType::Udp,
                    } as i32,
                    port: s.port as u32,
                    lb_method: LbMethod::from_str_name(&s.lb_method)
                        .unwrap_or(LbMethod::Leastconnection) as i32,
                    persistence: s.persistence,
                    // The node ramps new services itself (first bound there, or back
                    // UP) with lbscale-core's model; the engine only says how.
                    slow_start: s.slow_start.as_ref().map(|ss| lbscale_proto::SlowStart {
                        new_service_request: ss.new_service_request.max(0) as u32,
                        unit: if ss.unit == "PERCENT" {
                            lbscale_proto::SlowStartUnit::Percent
                        } else {
                            lbscale_proto::SlowStartUnit::PerSecond
                        } as i32,
                        increment_interval_s: ss.increment_interval.max(0) as u32,
                    }),
                    scaleout: None,
                    ramp_peers: vec![],
                    services: s
                        .services
                        .into_iter()
                        .map(|svc| Service {
                            name: svc.name,
                            address: svc.address,
                            port: svc.port as u32,
                            weight: svc.weight as u32,
                            enabled: svc.enabled,
                            cap_per_second: None,
                            custom_load: None,
                        })
                        .collect(),
                }
            })
            .collect();
        Ok(lbscale_proto::NodeConfig {
            version,
            vservers,
            group_peers: Vec::new(),
        })
    }

    // --- SE groups ---------------------------------------------------------------

    pub fn check_se_group(&self, spec: &SeGroupSpec) -> Result<Findings> {
        let mut f = Findings::default();
        if self.store.group(&spec.autoscale_group_id)?.is_none() {
            f.0.push(Finding::error(
                vec![PathStep::Attr("autoscale_group_id")],
                "Unknown autoscale group",
                format!("no autoscale group has id {:?}.", spec.autoscale_group_id),
            ));
        }
        Ok(f)
    }

    pub async fn create_se_group(&self, spec: &SeGroupSpec) -> Result<String> {
        Self::reject(self.check_se_group(spec)?)?;
        let id = new_id("seg");
        self.store.insert_se_group(&id, spec)?;
        Ok(id)
    }

    pub async fn update_se_group(&self, id: &str, spec: &SeGroupSpec) -> Result<()> {
        Self::reject(self.check_se_group(spec)?)?;
        let old = self
            .store
            .se_group(id)?
            .ok_or_else(|| EngineError::NotFound(format!("SE group {id}")))?;
        self.store.update_se_group(id, spec)?;
        if old.spec.se_tunnel_mode != spec.se_tunnel_mode
            && old.spec.autoscale_group_id == spec.autoscale_group_id
        {
            // Nodes read the tunnel mode only when they start.
            self.rolling_restart(
                &spec.autoscale_group_id,
                &format!(
                    "se_tunnel_mode {} -> {}",
                    old.spec.se_tunnel_mode, spec.se_tunnel_mode
                ),
            )
            .await?;
        }
        let placement_changed = old.spec.scaling_mode != spec.scaling_mode
            || old.spec.min_scaleout_per_vs != spec.min_scaleout_per_vs
            || old.spec.max_scaleout_per_vs != spec.max_scaleout_per_vs
            || old.spec.primary_forwarding_cost != spec.primary_forwarding_cost
            || old.spec.vs_scalein_timeout != spec.vs_scalein_timeout;
        if placement_changed && old.spec.autoscale_group_id == spec.autoscale_group_id {
            // New roles and shares on the nodes, new targets in the distributor.
            self.redeploy(Some(spec.autoscale_group_id.clone())).await?;
        }
        if old.spec.autoscale_group_id != spec.autoscale_group_id {
            // Its vservers move with it.
            for g in [&old.spec.autoscale_group_id, &spec.autoscale_group_id] {
                if self.store.group(g)?.is_some() {
                    self.store.bump_config_version(g)?;
                    self.reconcile_group(g).await?;
                }
            }
        }
        Ok(())
    }

    pub async fn delete_se_group(&self, id: &str) -> Result<()> {
        let Some(row) = self.store.se_group(id)? else {
            return Ok(());
        };
        wait_unused(format!("SE group {:?}", row.spec.name), "vserver", || {
            Ok(self.store.vservers_of_se_group(id)?.into_iter().map(|v| v.spec.name).collect())
        })
        .await?;
        self.store.delete_se_group(id)?;
        Ok(())
    }

    // --- vservers ----------------------------------------------------------------

    /// Rules that need the store: the SE group exists; UDP needs a dns distributor;
    /// SOURCEIP persistence across AZs is a warning.
    pub fn check_vserver(&self, spec: &VserverSpec) -> Result<Findings> {
        let mut f = Findings::default();
        let Some(se) = self.store.se_group(&spec.se_group_id)? else {
            f.0.push(Finding::error(
                vec![PathStep::Attr("se_group_id")],
                "Unknown SE group",
                format!("no SE group has id {:?}.", spec.se_group_id),
            ));
            return Ok(f);
        };
        if let Some(g) = self.store.group(&se.spec.autoscale_group_id)? {
            if let Some(d) = self.store.distributor(&g.spec.traffic_distributor_id)? {
                check_vserver_placement(
                    &mut f,
                    &spec.service_type,
                    &spec.persistence,
                    &d.spec.mode,
                    g.spec.availability_zones.len(),
                );
            }
        }
        Ok(f)
    }

    fn group_of_se_group(&self, se_group_id: &str) -> Result<Option<String>> {
        Ok(self
            .store
            .se_group(se_group_id)?
            .map(|s| s.spec.autoscale_group_id))
    }

    async fn redeploy(&self, group_id: Option<String>) -> Result<()> {
        if let Some(g) = group_id {
            if self.store.group(&g)?.is_some() {
                self.store.bump_config_version(&g)?;
                self.reconcile_group(&g).await?;
            }
        }
        Ok(())
    }

    pub async fn create_vserver(&self, spec: &VserverSpec) -> Result<String> {
        Self::reject(self.check_vserver(spec)?)?;
        let id = new_id("vs");
        self.store.insert_vserver(&id, spec)?;
        if let Err(e) = self
            .redeploy(self.group_of_se_group(&spec.se_group_id)?)
            .await
        {
            // Not deployed: take the row back so that the store says what runs.
            self.store.delete_vserver(&id)?;
            let _ = self
                .redeploy(self.group_of_se_group(&spec.se_group_id)?)
                .await;
            return Err(e);
        }
        Ok(id)
    }

    pub async fn update_vserver(&self, id: &str, spec: &VserverSpec) -> Result<()> {
        Self::reject(self.check_vserver(spec)?)?;
        let old = self
            .store
            .vserver(id)?
            .ok_or_else(|| EngineError::NotFound(format!("vserver {id}")))?;
        self.store.update_vserver(id, spec)?;
        let old_group = self.group_of_se_group(&old.spec.se_group_id)?;
        let new_group = self.group_of_se_group(&spec.se_group_id)?;
        if old_group != new_group {
            self.redeploy(old_group).await?;
        }
        self.redeploy(new_group).await
    }

    pub async fn delete_vserver(&self, id: &str) -> Result<()> {
        let Some(row) = self.store.vserver(id)? else {
            return Ok(());
        };
        self.store.delete_vserver(id)?;
        self.redeploy(self.group_of_se_group(&row.spec.se_group_id)?)
            .await
    }

    /// Where clients reach the vserver in each AZ: the AZ's VIP (`nlb`) or the
    /// application's domain (`dns`), with the vserver's port.
    pub fn vserver_vips(&self, spec: &VserverSpec) -> Result<BTreeMap<String, String>> {
        let mut out = BTreeMap::new();
        let Some(se) = self.store.se_group(&spec.se_group_id)? else {
            return Ok(out);
        };
        let Some(g) = self.store.group(&se.spec.autoscale_group_id)? else {
            return Ok(out);
        };
        let Some(d) = self.distributor_view(&g.spec.traffic_distributor_id)? else {
            return Ok(out);
        };
        for az in &g.spec.availability_zones {
            let host = if d.spec.mode == "dns" {
                d.spec.domain.clone().unwrap_or_default()
            } else {
                match d.address.get(az) {
                    Some(v) => v.clone(),
                    None => continue,
                }
            };
            out.insert(az.clone(), format!("{host}:{}", spec.port));
        }
        Ok(out)
    }

    pub fn events(&self, group_id: &str, limit: usize) -> Result<Vec<crate::store::Event>> {
        Ok(self.store.events_of_group(group_id, limit)?)
    }
}

/// How long a best-effort configuration push (while nodes leave) may take.
const CONFIG_PUSH_TIMEOUT: Duration = Duration::from_secs(10);

/// Identifies what a node was sent (ramp peers aside: they matter only while it
/// joins), so that a node is reconfigured exactly when its configuration changes.
/// `min_scaleout_per_vs` .. `max_scaleout_per_vs`, at least one node.
fn span_bounds(se: &SeGroupSpec) -> (u32, u32) {
    let min = se.min_scaleout_per_vs.clamp(1, i64::from(u32::MAX)) as u32;
    let max = (se.max_scaleout_per_vs.clamp(1, i64::from(u32::MAX)) as u32).max(min);
    (min, max)
}

fn config_fingerprint(config: &lbscale_proto::NodeConfig) -> String {
    use prost::Message;
    let mut c = config.clone();
    for v in &mut c.vservers {
        v.ramp_peers.clear();
    }
    // FNV-1a: stable across Rust versions (std's hasher is not), so a toolchain
    // upgrade does not make every node look changed.
    let h = c
        .encode_to_vec()
        .iter()
        .fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
            (h ^ u64::from(*b)).wrapping_mul(0x0000_0100_0000_01b3)
        });
    format!("{h:016x}")
}
