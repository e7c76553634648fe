//! One group's evaluation, in the shape of a controller's reconcile: one
//! function ([`evaluate`]) looks at the group and says what happens next
//! ([`Next`]), and one error policy ([`error_policy`]) decides how long a
//! failed evaluation waits. Each AZ is stepped on its own and runs its own
//! workflow as a task ([`crate::az`]); the evaluation itself never waits for one.

use crate::az::{AzCtx, AzRuntime, AzSeen, WorkflowKind};
use crate::claims::claim_ttl;
use crate::metrics::{ResumeWait, VserverSpan};
use crate::resume::{restore_az_state, ResumeBackoff};
use crate::sample::{self, CachedClient, Sampled};
use crate::smallmap::SmallMap;
use crate::spans::{size_spans, span_target_cpu, SpanPolicy};
use crate::status::{az_status, nodes_by_state};
use crate::Shared;
use lbscale_core::duration::format_as_seconds;
use lbscale_core::policy::{AzState, Phase, PolicyConfig};
use lbscale_core::seplan::SpanStreak;
use lbscale_engine::daemon_api::{Claim, GroupSnapshot};
use lbscale_engine::model::GroupSpec;
use lbscale_engine::nodeapi::EngineCredentials;
use lbscale_engine::reconcile::{GroupView, SpanView};
use lbscale_engine::store::{now_ms, Lease, NodeState, PolicyStateRow, Row, StoreError};
use lbscale_engine::EngineError;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::OwnedMutexGuard;

pub use crate::status::{initial_status, phase_name};

/// Slack on a requeue, so that a 1 s interval is not evaluated every 1.2 s
/// because of the 200 ms loop.
const LOOP_SLACK_MS: i64 = 100;
/// The longest an error policy's back-off grows to (or one interval, if longer).
const MAX_ERROR_BACKOFF: Duration = Duration::from_secs(5);

/// What happens after an evaluation.
#[derive(Debug, Clone, PartialEq)]
pub enum Next {
    /// Evaluate the group again after this long.
    Requeue(Duration),
    /// Workflows started in these AZs; the group is evaluated again after
    /// `requeue`, or as soon as one of them ends.
    WorkflowStarted { azs: Vec<String>, requeue: Duration },
}

impl Next {
    fn requeue(&self) -> Duration {
        match self {
            Next::Requeue(d) | Next::WorkflowStarted { requeue: d, .. } => *d,
        }
    }
}

/// A step of an evaluation that failed, for the error policy.
#[derive(Debug)]
pub struct EvalError {
    step: &'static str,
    detail: String,
}

impl EvalError {
    pub(crate) fn new(step: &'static str, detail: impl ToString) -> EvalError {
        EvalError {
            step,
            detail: detail.to_string(),
        }
    }
}

/// The daemon's memory of one group between evaluations: each AZ's policy
/// state (persisted in the store after every step that changes it) and
/// workflow, and a connection to each node's management API.
pub struct GroupRuntime {
    azs: SmallMap<String, AzRuntime>,
    /// AZ states read from the store at the last resume, taken up by each AZ at
    /// its first step after it.
    restored: SmallMap<String, PolicyStateRow>,
    clients: HashMap<String, CachedClient>,
    /// The group's node API token (it never changes).
    token: Option<String>,
    /// The engine's credentials (CA, client certificate, session tickets)
    /// that the kept connections were made with.
    credentials: Option<Arc<EngineCredentials>>,
    /// The group's policy as of a row version (which a change of the group or
    /// of its distributor raises): read again only when the version changes.
    policy: Option<(i64, PolicyConfig)>,
    /// Unix ms from which the group is due again.
    next_eval_ms: i64,
    /// Evaluations that failed in a row (the error policy's back-off).
    failures: u32,
    /// Whether the last evaluation left the group to an apply or another
    /// daemon: an ended workflow then waits for the requeue.
    left_alone: bool,
    /// Whether this daemon has reconciled the group once since it took it
    /// (finishing what a crashed holder left half-done).
    resumed: bool,
    /// Failed resumes in a row and when the next one is due.
    resume_backoff: ResumeBackoff,
    /// The fencing token of the claim this memory was built under.
    claim_fence: Option<i64>,
    /// Per (vserver id, AZ): the evaluations in a row that asked to move its
    /// span one way. A span changes after `watch_samples` of them, as the
    /// group itself scales only on a confirmed breach.
    span_streaks: HashMap<(String, String), SpanStreak>,
}

impl Default for GroupRuntime {
    fn default() -> Self {
        Self::new()
    }
}

impl GroupRuntime {
    pub fn new() -> GroupRuntime {
        GroupRuntime {
            azs: SmallMap::new(),
            restored: SmallMap::new(),
            clients: HashMap::new(),
            token: None,
            credentials: None,
            policy: None,
            next_eval_ms: 0,
            failures: 0,
            left_alone: false,
            resumed: false,
            resume_backoff: ResumeBackoff::default(),
            claim_fence: None,
            span_streaks: HashMap::new(),
        }
    }

    /// The claim this daemon acts on the group under now. Under another
    /// fencing token than before, the claim was lost meanwhile (another
    /// daemon may have evaluated the group and scaled it): what this daemon
    /// knew is stale and is forgotten, so that it resumes from what the store
    /// persisted. Not while its own workflows run (they hold their AZ's lease).
    fn claim_held(&mut self, fence: i64) {
        if self.claim_fence.is_some_and(|f| f != fence) && !self.workflows_in_flight() {
            self.forget();
        }
        self.claim_fence = Some(fence);
    }

    /// Whether the group is due: its requeue has come, or a workflow of one of
    /// its AZs ended (the policy takes the outcome in at once: the cooldown
    /// starts when the node has joined).
    pub fn due(&self, now: i64) -> bool {
        now >= self.next_eval_ms
            || (!self.left_alone && self.azs.values().any(|a| a.workflow_ended()))
    }

    /// From when (Unix ms) the loop looks at the group again: its requeue, or
    /// [`NEXT_TICK`] while an AZ's workflow runs whose end would make the
    /// group due.
    pub fn next_look(&self) -> i64 {
        if !self.left_alone && self.workflows_in_flight() {
            NEXT_TICK
        } else {
            self.next_eval_ms
        }
    }

    fn workflows_in_flight(&self) -> bool {
        self.azs.values().any(|a| a.workflow().is_some())
    }

    /// Forgets what this daemon knew, to start from the store if it takes the
    /// group (back) later.
    fn forget(&mut self) {
        self.claim_fence = None;
        self.azs.clear();
        self.restored.clear();
        self.clients.clear();
        self.resumed = false;
        self.resume_backoff = ResumeBackoff::default();
    }

    /// Waits for the AZs' workflows in flight (shutdown).
    pub async fn workflows_done(&mut self) {
        while self
            .azs
            .values()
            .any(|a| a.workflow().is_some() && !a.workflow_ended())
        {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// A time the loop has reached whatever the wall clock says (stepped back or
/// not): the group is looked at again at the next tick.
pub const NEXT_TICK: i64 = i64::MIN;

/// Gives up this daemon's claim on a group (shutdown, group gone).
pub fn release_ownership(shared: &Shared, group_id: &str) {
    shared.claims.remove(group_id);
    let _ = shared.engine.release_daemon_claim(group_id, &shared.holder);
}

/// Runs one evaluation of the group and requeues it: what [`evaluate`] says
/// next, or what [`error_policy`] decides after a failure. Holds the group's
/// runtime meanwhile, so that the loop starts no second one. Returns when the
/// loop looks at the group again ([`GroupRuntime::next_look`]).
pub async fn run(
    shared: Arc<Shared>,
    mut rt: OwnedMutexGuard<GroupRuntime>,
    row: Row<GroupSpec>,
    version: i64,
) -> i64 {
    let started = now_ms();
    // Its claim is renewed while it runs, however long (see `claims`).
    let _evaluating = shared.claims.evaluating(&row.id);
    // Requeued by an earlier evaluation (not a first one, nor one brought
    // forward by a workflow's end): how late this one starts.
    if rt.next_eval_ms > 0 && started >= rt.next_eval_ms {
        let due = rt.next_eval_ms + LOOP_SLACK_MS;
        shared
            .metrics
            .lag(Duration::from_millis((started - due).max(0) as u64));
    }
    let wait = match evaluate(&shared, &mut rt, &row, version, started).await {
        Ok(next) => {
            rt.failures = 0;
            next.requeue()
        }
        Err(e) => error_policy(&shared, &row, &mut rt, e),
    };
    rt.next_eval_ms = started + wait.as_millis() as i64 - LOOP_SLACK_MS;
    rt.next_look()
}

/// The one error policy: a failed evaluation is reported (log, metric,
/// `last_error`) and retried after one `stats_interval`, doubling with each
/// failure in a row up to [`MAX_ERROR_BACKOFF`] (or one interval, if longer).
pub fn error_policy(
    shared: &Shared,
    row: &Row<GroupSpec>,
    rt: &mut GroupRuntime,
    e: EvalError,
) -> Duration {
    report_error(shared, &row.id, &row.spec.name, e.step, &e.detail);
    rt.failures = rt.failures.saturating_add(1);
    error_backoff(interval_of(&row.spec), rt.failures)
}

/// The wait after `failures` failed evaluations in a row (from 1).
fn error_backoff(interval: Duration, failures: u32) -> Duration {
    let doubled = interval.saturating_mul(1 << failures.clamp(1, 8).saturating_sub(1));
    doubled.min(MAX_ERROR_BACKOFF.max(interval))
}

/// Says that `what` failed for the group (log, metric, `last_error`).
pub(crate) fn report_error(shared: &Shared, id: &str, name: &str, what: &str, detail: &str) {
    tracing::warn!(group = %name, step = what, error = %detail, "evaluation failed");
    shared.metrics.error(name);
    shared.update_status(id, |s| s.last_error = Some(format!("{what}: {detail}")));
}

/// The group's `stats_interval` (a zero one, which validation refuses, is
/// looked at every 100 ms at most).
fn interval_of(spec: &GroupSpec) -> Duration {
    spec.stats_interval.get().max(Duration::from_millis(100))
}

/// One evaluation of one group (see the crate docs): read its policy, take
/// its turn, resume what was left half-done, sample its nodes, then evaluate
/// each AZ on its own.
pub async fn evaluate(
    shared: &Arc<Shared>,
    rt: &mut GroupRuntime,
    row: &Row<GroupSpec>,
    version: i64,
    now: i64,
) -> Result<Next, EvalError> {
    let (id, spec) = (row.id.as_str(), &row.spec);
    shared.update_status(id, |s| {
        s.name = spec.name.clone();
        s.min_nodes = spec.min_nodes;
        s.max_nodes = spec.max_nodes;
        s.stats_interval = spec.stats_interval.to_string();
    });
    let cfg = policy(shared, rt, row, version)?;
    let interval = Duration::from_millis(cfg.stats_interval);
    let claim_ttl = claim_ttl(interval);
    let Some(claim) = take_turn(shared, rt, row, claim_ttl).await? else {
        return Ok(Next::Requeue(interval));
    };
    let Some(snap) = snapshot(shared, id).await? else {
        return Ok(Next::Requeue(interval)); // gone meanwhile
    };
    if let Some(holder) = snap.applying.clone() {
        tracing::debug!(group = %spec.name, holder = %holder, "group's lease is held; skipping this evaluation");
        rt.left_alone = true;
        shared.disown(id);
        shared.update_status(id, |s| {
            s.owner = "self".into();
            s.skipped_for = Some(holder);
        });
        return Ok(Next::Requeue(interval));
    }
    if finish_deletion(shared, row, snap.deleting).await? {
        return Ok(Next::Requeue(interval));
    }
    // Before the resume: a resume that failed on the distributor waits for
    // its back-off, but what the distributor serves is checked every interval.
    settle_publication(shared, &snap, interval);
    let snap = match resume(shared, rt, row, now, &snap).await? {
        Resumed::Stop => return Ok(Next::Requeue(interval)),
        Resumed::Settled => snap,
        // The repair changed the nodes: read them again.
        Resumed::Repaired => match snapshot(shared, id).await? {
            Some(s) => s,
            None => return Ok(Next::Requeue(interval)),
        },
    };
    let seen = observe(shared, rt, row, snap).await?;
    shared.metrics.evaluated();

    // Forget AZs that the group no longer declares.
    rt.azs
        .retain(|az, _| spec.availability_zones.iter().any(|z| z == az));
    let mut started = Vec::new();
    let mut statuses = Vec::new();
    for az in &spec.availability_zones {
        let cx = AzCtx {
            shared,
            group_id: id,
            name: &spec.name,
            az,
            cfg: &cfg,
            claim: &claim,
            claim_ttl,
        };
        let (status, workflow) = evaluate_az(&cx, rt, &seen, now).await?;
        if workflow.is_some() {
            started.push(az.clone());
        }
        statuses.push(status);
    }
    let in_flight: Vec<String> = rt
        .azs
        .iter()
        .filter_map(|(az, a)| a.workflow().map(|k| format!("{} {az}", k.name())))
        .collect();
    shared.update_status(id, |s| {
        s.owner = "self".into();
        s.skipped_for = None;
        s.resume_backoff = None;
        s.last_evaluated_ms = Some(now);
        s.in_flight = (!in_flight.is_empty()).then(|| in_flight.join(", "));
        s.azs = statuses;
    });
    Ok(if started.is_empty() {
        Next::Requeue(interval)
    } else {
        Next::WorkflowStarted {
            azs: started,
            requeue: interval,
        }
    })
}

/// The group's policy at row `version`, converted by the core.
fn policy(
    shared: &Shared,
    rt: &mut GroupRuntime,
    row: &Row<GroupSpec>,
    version: i64,
) -> Result<PolicyConfig, EvalError> {
    if let Some((v, cfg)) = rt.policy {
        if v == version {
            return Ok(cfg);
        }
    }
    let step = "read the group's policy";
    let cfg = shared
        .engine
        .group_policy(&row.spec)
        .map_err(|e| EvalError::new(step, e))?
        .map_err(|e| EvalError::new(step, e))?;
    rt.policy = Some((version, cfg));
    Ok(cfg)
}

/// The claim on the group when this daemon may act on it now; `None` when
/// another daemon evaluates it (or should: this one holds its share). A claim
/// this daemon holds surely (see [`crate::claims`]) costs no statement.
async fn take_turn(
    shared: &Shared,
    rt: &mut GroupRuntime,
    row: &Row<GroupSpec>,
    claim_ttl: Duration,
) -> Result<Option<Lease>, EvalError> {
    // Daemons on one store each hold about their share of its groups: one
    // that holds its share claims no more (another daemon has room for it).
    if !shared.may_claim(&row.id) {
        // Not renewed any more: it expires for a daemon with room for it.
        shared.claims.remove(&row.id);
        rt.left_alone = true;
        rt.forget();
        shared.update_status(&row.id, |s| {
            s.owner = String::new();
            s.azs.clear();
        });
        return Ok(None);
    }
    let claim = match shared.claims.usable(&row.id, claim_ttl) {
        Some(held) => Claim::Ours(held),
        None => {
            let sent = Instant::now();
            let claim = shared
                .engine
                .daemon_claim(&row.id, &shared.holder, claim_ttl)
                .await
                .map_err(|e| EvalError::new("claim the group", e))?;
            if let Claim::Ours(l) = &claim {
                shared.claims.insert(&row.id, l.clone(), claim_ttl, sent);
            }
            claim
        }
    };
    rt.left_alone = !matches!(claim, Claim::Ours(_));
    match claim {
        // More than its share (another daemon joined): let the group go,
        // between workflows, for a daemon with room to take it.
        Claim::Ours(_) if !rt.workflows_in_flight() && !shared.keep_claim(&row.id) => {
            release_ownership(shared, &row.id);
            tracing::info!(group = %row.spec.name, "more than this daemon's share of the groups: letting this one go to another daemon");
            rt.left_alone = true;
            rt.forget();
            shared.update_status(&row.id, |s| {
                s.owner = String::new();
                s.azs.clear();
            });
            Ok(None)
        }
        Claim::Ours(claim) => {
            shared.keep_claim_anyway(&row.id);
            rt.claim_held(claim.fence);
            Ok(Some(claim))
        }
        Claim::OtherDaemon { holder } => {
            shared.disown(&row.id);
            shared.claims.remove(&row.id);
            if !rt.azs.is_empty() {
                tracing::info!(group = %row.spec.name, owner = %holder, "another daemon evaluates this group; leaving it");
            }
            rt.forget();
            shared.update_status(&row.id, |s| {
                s.owner = holder;
                s.azs.clear();
            });
            Ok(None)
        }
    }
}

/// The group, its nodes and its vservers as this evaluation reads them
/// (three statements, five behind an `nlb`, awaited on the store
/// connection's thread);
/// `None` when the group is gone.
async fn snapshot(shared: &Shared, id: &str) -> Result<Option<GroupSnapshot>, EvalError> {
    shared
        .engine
        .group_snapshot(id)
        .await
        .map_err(|e| EvalError::new("read the group's nodes", e))
}

/// A group whose destroy began and stopped (the apply killed mid-drain) is
/// deleted, not resumed: true when that is what this evaluation did.
async fn finish_deletion(
    shared: &Shared,
    row: &Row<GroupSpec>,
    deleting: bool,
) -> Result<bool, EvalError> {
    let step = "finish the group's destroy";
    if !deleting {
        return Ok(false);
    }
    tracing::info!(group = %row.spec.name, "the group's destroy stopped half-way: finishing it");
    shared.update_status(&row.id, |s| s.in_flight = Some("destroy".into()));
    let r = shared.engine.delete_group(&row.id).await;
    shared.update_status(&row.id, |s| s.in_flight = None);
    r.map_err(|e| EvalError::new(step, e))?;
    Ok(true)
}

/// Publication is level-triggered (docs/design.md, section 3): once per stats
/// interval per distributor, what it serves (as its driver confirmed) is
/// compared with what the store says it must hand out, and published again
/// when they differ, so a publication that failed (a throttled or unwritable
/// distributor) is retried until it holds. A `dns` distributor of this group
/// only is compared from the evaluation's snapshot, with no statement of its
/// own; any other, or one that differs, in a task of its own that reads it
/// again: a publication may wait for the distributor's lease or for the cloud
/// to confirm it, and that must not hold up the group's AZs; a failure is
/// reported and tried again at the next check.
/// The group is the snapshot's row, read this evaluation (the cached row may
/// be a version behind: another distributor).
fn settle_publication(shared: &Arc<Shared>, snap: &GroupSnapshot, interval: Duration) {
    let row = &snap.row;
    let distributor = row.spec.traffic_distributor_id.clone();
    if !shared.publication_check_due(&distributor, interval) {
        return;
    }
    if let Ok(Some(true)) = shared.engine.publication_settled_in(snap) {
        return;
    }
    let (shared, id, name) = (shared.clone(), row.id.clone(), row.spec.name.clone());
    tokio::spawn(async move {
        match shared.engine.settle_publication(&distributor).await {
            Ok(true) => {
                tracing::info!(group = %name, distributor = %distributor, "the traffic distributor did not serve what the store says: published again")
            }
            Ok(false) => {}
            Err(e) => report_error(
                &shared,
                &id,
                &name,
                "publish the traffic distributor",
                &e.to_string(),
            ),
        }
    });
}

/// Resume: the first time this daemon evaluates the group, and whenever the
/// store shows work left half-done (a holder that crashed mid-workflow: a node
/// in a transient state, a member whose process is gone), the engine's
/// level-triggered reconcile finishes it before anything is decided. It leaves
/// a count within min..max as it is. Never while this daemon's own workflows
/// run (their nodes are in transient states). A resume that fails is retried
/// after a back-off, not at every interval; nothing is decided meanwhile.
async fn resume(
    shared: &Shared,
    rt: &mut GroupRuntime,
    row: &Row<GroupSpec>,
    now: i64,
    snap: &GroupSnapshot,
) -> Result<Resumed, EvalError> {
    if rt.workflows_in_flight() {
        return Ok(Resumed::Settled);
    }
    let (id, name) = (row.id.as_str(), row.spec.name.as_str());
    let why = if rt.resumed {
        leftover_work(shared, snap)
    } else {
        Some("first evaluation by this daemon".to_string())
    };
    let Some(why) = why else {
        rt.resume_backoff = rt.resume_backoff.succeeded();
        return Ok(Resumed::Settled);
    };
    if !rt.resume_backoff.due(now) {
        tracing::debug!(group = %name, retry_at_ms = rt.resume_backoff.retry_at_ms, "a failed resume waits for its retry");
        shared.update_status(id, |s| {
            s.owner = "self".into();
            s.skipped_for = None;
        });
        return Ok(Resumed::Stop);
    }
    tracing::info!(group = %name, why = %why, "resuming: reconciling the group before deciding");
    shared.update_status(id, |s| s.in_flight = Some("resume".into()));
    let started = Instant::now();
    let r = shared.engine.reconcile_group(id).await;
    shared.metrics.workflow("resume", started.elapsed());
    shared.update_status(id, |s| s.in_flight = None);
    if let Err(e) = r {
        return Err(resume_failed(shared, rt, row, &why, e).await);
    }
    rt.resume_backoff = rt.resume_backoff.succeeded();
    rt.resumed = true;
    // What the policy knew of the AZs predates the repair: start from what
    // the store persisted, against the nodes as the repair left them.
    rt.azs.clear();
    match shared.engine.policy_states(id) {
        Ok(rows) => rt.restored = rows.into_iter().map(|r| (r.az.clone(), r)).collect(),
        Err(e @ EngineError::Store(StoreError::Decode { .. })) => {
            tracing::warn!(group = %name, error = %e, "the persisted policy state cannot be read; starting each AZ afresh");
            rt.restored.clear();
        }
        Err(e) => {
            // Resume again (it is idempotent) and read it then.
            rt.resumed = false;
            return Err(EvalError::new("read the group's policy state", e));
        }
    }
    Ok(Resumed::Repaired)
}

/// How [`resume`] left the evaluation.
enum Resumed {
    /// Nothing was left half-done (or a workflow of this daemon runs).
    Settled,
    /// The group was reconciled: its nodes are to be read again.
    Repaired,
    /// A failed resume waits for its back-off: nothing is decided now.
    Stop,
}

/// A failed resume: its back-off, event and status.
async fn resume_failed(
    shared: &Shared,
    rt: &mut GroupRuntime,
    row: &Row<GroupSpec>,
    why: &str,
    e: EngineError,
) -> EvalError {
    let failed_at = now_ms();
    let b = if e.is_publication() {
        rt.resume_backoff
            .failed_publishing(failed_at, interval_of(&row.spec))
    } else {
        rt.resume_backoff.failed(failed_at)
    };
    rt.resume_backoff = b;
    let wait = format_as_seconds(Duration::from_millis(
        (b.retry_at_ms - failed_at).max(0) as u64
    ));
    shared.metrics.resume_failed(&row.spec.name);
    shared
        .engine
        .record_event(
            &row.id,
            None,
            "resume_failed",
            // The same words each time, so that repeats collapse into one event
            // with a count; the failures in a row and the next try are in the
            // group's status (`resume_backoff`).
            &format!("resuming ({why}) failed: {e}"),
        )
        .await;
    shared.update_status(&row.id, |s| {
        s.resume_backoff = Some(ResumeWait {
            failures: b.failures,
            retry_at_ms: b.retry_at_ms,
            error: e.to_string(),
        })
    });
    EvalError::new(
        "resume the group's unfinished work",
        format!("{e} (retrying in {wait})"),
    )
}

/// Work that a holder left half-done, as the store and the processes show it:
/// a node in a transient or failed state, an active node that is not registered
/// with the distributor, or one that does not run the configuration it should.
/// `None` when the group is settled. Told from the evaluation's snapshot
/// alone (no statement).
fn leftover_work(shared: &Shared, snap: &GroupSnapshot) -> Option<String> {
    if let Some(n) = snap.view.nodes.iter().find(|n| n.state != "active") {
        return Some(format!("node {} is {}", n.id, n.state));
    }
    let stale = shared.engine.stale_configurations_in(snap);
    if let Some(id) = stale.first() {
        return Some(format!("node {id} does not run its current configuration"));
    }
    snap.rows
        .iter()
        .find(|r| r.state == NodeState::Active && !r.registered)
        .map(|r| format!("node {} is active but not registered", r.id))
}

/// What one evaluation saw of the group.
struct Seen {
    view: GroupView,
    sampled: Sampled,
    spans: Vec<SpanView>,
    /// The CPU under which a vserver's holders should stay.
    span_target: f64,
}

/// The group's nodes (as the snapshot read them), their statistics and the
/// vservers' spans.
async fn observe(
    shared: &Shared,
    rt: &mut GroupRuntime,
    row: &Row<GroupSpec>,
    snap: GroupSnapshot,
) -> Result<Seen, EvalError> {
    let id = row.id.as_str();
    if rt.token.is_none() {
        let token = shared
            .engine
            .group_token(id)
            .map_err(|e| EvalError::new("read the group's token", e))?;
        rt.token = Some(token);
    }
    let token = rt.token.as_deref().unwrap_or_default();
    // The engine's, shared with its configuration pushes and drains: one TLS
    // session per node.
    let creds = shared
        .engine
        .node_credentials(id, token)
        .map_err(|e| EvalError::new("get the group's node API credentials", e))?;
    if !rt
        .credentials
        .as_ref()
        .is_some_and(|c| Arc::ptr_eq(c, &creds))
    {
        // Kept connections go on showing the certificate they were made
        // with: dial again with the new one.
        rt.clients.clear();
        rt.credentials = Some(creds.clone());
    }
    let targets = sample::targets(&snap.view, &snap.rows);
    let window = interval_of(&row.spec);
    let sampled = sample::sample(
        &mut rt.clients,
        &shared.node_connections,
        targets,
        token,
        &creds,
        window,
    )
    .await;
    let spans = shared.engine.vserver_spans_in(&snap);
    Ok(Seen {
        view: snap.view,
        sampled,
        spans,
        span_target: span_target_cpu(&row.spec),
    })
}

/// One AZ: its runtime (restored from the store at its first step after a
/// resume), its evaluation, its spans and its status.
async fn evaluate_az(
    cx: &AzCtx<'_>,
    rt: &mut GroupRuntime,
    seen: &Seen,
    now: i64,
) -> Result<(crate::metrics::AzStatus, Option<WorkflowKind>), EvalError> {
    let az = cx.az;
    let in_az: Vec<_> = seen
        .view
        .nodes
        .iter()
        .filter(|n| n.availability_zone == az)
        .collect();
    let az_seen = AzSeen {
        serving: in_az.iter().filter(|n| n.serving).count() as u32,
        provisioned: in_az
            .iter()
            .filter(|n| matches!(n.state.as_str(), "provisioning" | "joining" | "active"))
            .count() as u32,
        sample: seen.sampled.mean(az),
    };
    let by_state = nodes_by_state(&seen.view, az);
    cx.shared
        .metrics
        .set_az(cx.name, az, &by_state, az_seen.sample.as_ref());
    if !rt.azs.contains_key(az) {
        let azrt = az_runtime(cx, rt.restored.remove(az), &az_seen, now);
        rt.azs.insert(az.to_string(), azrt);
    }
    let azrt = rt.azs.get_mut(az).expect("inserted above");
    let started = azrt.evaluate(cx, &az_seen, now).await?;
    // A vserver's span follows its holders' CPU: only while the AZ's own
    // scaling is idle, so that one evaluation changes one thing.
    let may_resize =
        azrt.workflow().is_none() && matches!(azrt.state.phase, Phase::Evaluating { .. });
    let state = azrt.state;
    let spans = az_spans(cx, rt, seen, may_resize).await;
    let status = az_status(
        az,
        &state,
        by_state,
        az_seen.sample,
        seen.sampled.slow_start(az),
        spans,
    );
    Ok((status, started))
}

/// A new AZ runtime: from the state the store persisted (after a resume),
/// else from what the store shows.
fn az_runtime(
    cx: &AzCtx<'_>,
    restored: Option<PolicyStateRow>,
    seen: &AzSeen,
    now: i64,
) -> AzRuntime {
    match restored {
        Some(row) => {
            let state = restore_az_state(
                cx.cfg,
                &row.state,
                row.updated_at,
                now,
                seen.serving,
                seen.provisioned,
            );
            tracing::info!(group = %cx.name, az = %cx.az, persisted = ?row.state.phase, restored = ?state.phase, "resuming the AZ's persisted policy state");
            AzRuntime::new(state, Some(row.state))
        }
        None => AzRuntime::new(AzState::new(seen.serving), None),
    }
}

async fn az_spans(
    cx: &AzCtx<'_>,
    rt: &mut GroupRuntime,
    seen: &Seen,
    may_resize: bool,
) -> Vec<VserverSpan> {
    size_spans(
        cx.shared,
        cx.group_id,
        cx.name,
        cx.az,
        &seen.spans,
        &seen.sampled.answers,
        SpanPolicy {
            target_cpu: seen.span_target,
            watch_samples: cx.cfg.watch_samples,
            may_resize,
        },
        &mut rt.span_streaks,
        cx.claim,
    )
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_evaluation_waits_one_interval_doubling_to_five_seconds() {
        let waits: Vec<u64> = (1..=6)
            .map(|n| error_backoff(Duration::from_secs(1), n).as_secs())
            .collect();
        assert_eq!(waits, vec![1, 2, 4, 5, 5, 5]);
        // An interval longer than the cap is the wait.
        assert_eq!(
            error_backoff(Duration::from_secs(30), 4),
            Duration::from_secs(30)
        );
    }

    #[test]
    fn a_claim_taken_again_under_another_fence_forgets_what_was_known() {
        let mut rt = GroupRuntime::new();
        rt.claim_held(7);
        rt.resumed = true;
        rt.claim_held(7);
        assert!(rt.resumed, "the same claim: nothing forgotten");
        rt.claim_held(9);
        assert!(!rt.resumed, "lost and taken again: resumed from the store");
        assert_eq!(rt.claim_fence, Some(9));
    }

    #[test]
    fn a_group_is_due_at_its_requeue() {
        let mut rt = GroupRuntime::new();
        assert!(rt.due(0), "a new group is due at once");
        rt.next_eval_ms = 10_000;
        assert!(!rt.due(9_999));
        assert!(rt.due(10_000));
        assert_eq!(rt.next_look(), 10_000, "looked at again at its requeue");
        rt.left_alone = true;
        assert_eq!(rt.next_look(), 10_000);
    }

    #[tokio::test]
    async fn a_group_whose_workflow_runs_is_looked_at_every_tick_and_due_when_it_ends() {
        let (end, ended) = tokio::sync::oneshot::channel();
        let mut rt = GroupRuntime::new();
        rt.next_eval_ms = 60_000;
        rt.azs
            .insert("az1".into(), crate::az::AzRuntime::scaling_out_until(ended));
        assert_eq!(rt.next_look(), NEXT_TICK, "looked at at the next tick");
        assert!(!rt.due(5_000), "running: not due before its requeue");
        end.send(()).unwrap();
        for _ in 0..100 {
            if rt.due(5_000) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(rt.due(5_000), "the workflow's end makes the group due");
        rt.left_alone = true;
        assert_eq!(rt.next_look(), 60_000, "left alone: at its requeue");
        assert!(!rt.due(5_000));
    }

    #[test]
    fn next_says_when_to_evaluate_again() {
        let d = Duration::from_secs(2);
        assert_eq!(Next::Requeue(d).requeue(), d);
        let started = Next::WorkflowStarted {
            azs: vec!["az2".into()],
            requeue: d,
        };
        assert_eq!(started.requeue(), d);
    }
}
