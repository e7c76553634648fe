//! One group's evaluation: sample, step the policy per AZ, run the workflow.

use crate::metrics::{AzStatus, GroupStatus, RampingService, ResumeWait, SampleOut, VserverSpan};
use crate::resume::{restore_az_state, wait_ends_at, ResumeBackoff};
use crate::Shared;
use lbscale_core::duration::{format_as_seconds, parse_duration};
use lbscale_core::policy::{
    self, Action, AzState, Decision, EventKind, Metric, Observation, Phase, PhaseKind,
    PolicyConfig, PolicySpec, ProvisionOutcome, Sample,
};
use lbscale_core::seplan::SpanStreak;
use lbscale_engine::model::GroupSpec;
use lbscale_engine::nodeapi::NodeClient;
use lbscale_engine::reconcile::{GroupView, KeptLease, SpanView};
use lbscale_engine::store::{
    daemon_claim_key, now_ms, NodeRow, NodeState, PolicyStateRow, Row, Store, StoreError,
};
use lbscale_proto::NodeStats;
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::OwnedMutexGuard;

/// The API port of a node whose handle does not say.
const DEFAULT_API_PORT: u16 = 9990;
/// Longest wait for one node's statistics (connect + call).
const STATS_TIMEOUT: Duration = Duration::from_secs(2);
/// The probe of the group's lease (released at once).
const PROBE_TTL: Duration = Duration::from_secs(5);

/// What a finished workflow tells the policy, until the policy has taken it in.
#[derive(Debug, Clone, Copy)]
enum Outcome {
    /// The new node joined and is registered with the distributor at `at`.
    ScaledOut { at: u64 },
    /// The scale-out workflow failed at `at`.
    ScaleOutFailed { at: u64 },
    /// The leaving node drained by `drained` and was gone at `gone`.
    ScaledIn { drained: u64, gone: u64 },
}

struct AzRuntime {
    state: AzState,
    outcome: Option<Outcome>,
    /// What the store holds for this AZ (written by this daemon, or restored).
    persisted: Option<AzState>,
}

struct CachedClient {
    addr: String,
    client: NodeClient,
}

/// The daemon's memory of one group: the policy state of each AZ (persisted in
/// the store after every step that changes it; see the crate docs) and a
/// connection to each node's management API.
pub struct GroupRuntime {
    azs: BTreeMap<String, AzRuntime>,
    /// AZ states read from the store at the last resume, taken up by each AZ at
    /// its first step after it.
    restored: BTreeMap<String, PolicyStateRow>,
    clients: HashMap<String, CachedClient>,
    last_eval_ms: i64,
    /// Whether this daemon has reconciled the group once since it took it
    /// (finishing what a crashed holder left half-done).
    resumed: bool,
    /// Failed resumes in a row and when the next one is due.
    resume_backoff: ResumeBackoff,
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
            azs: BTreeMap::new(),
            restored: BTreeMap::new(),
            clients: HashMap::new(),
            last_eval_ms: 0,
            resumed: false,
            resume_backoff: ResumeBackoff::default(),
            span_streaks: HashMap::new(),
        }
    }

    /// Whether `stats_interval` has elapsed since the last evaluation. A spec whose
    /// interval does not parse is looked at every 10 s (to report the error).
    pub fn due(&self, spec: &GroupSpec, now: i64) -> bool {
        let interval = parse_duration(&spec.stats_interval)
            .map(|d| d.as_millis() as i64)
            .unwrap_or(10_000)
            .max(100);
        // Half a loop tick of slack, so that a 1 s interval is not evaluated
        // every 1.2 s because of the 200 ms loop.
        now - self.last_eval_ms >= interval - 100
    }
}

pub fn initial_status(row: &Row<GroupSpec>) -> GroupStatus {
    GroupStatus {
        id: row.id.clone(),
        name: row.spec.name.clone(),
        min_nodes: row.spec.min_nodes,
        max_nodes: row.spec.max_nodes,
        stats_interval: row.spec.stats_interval.clone(),
        owner: String::new(),
        last_evaluated_ms: None,
        in_flight: None,
        skipped_for: None,
        last_error: None,
        resume_backoff: None,
        azs: Vec::new(),
    }
}

/// Gives up this daemon's claim on a group (shutdown, group gone).
pub fn release_ownership(shared: &Shared, group_id: &str) {
    let _ = shared
        .engine
        .store
        .release_lease_of(&daemon_claim_key(group_id), &shared.holder);
}

/// The group's policy as the core validates it: the same functions as
/// `lbscale simulate` and the provider's plan-time checks.
pub fn policy_config(store: &Store, spec: &GroupSpec) -> Result<PolicyConfig, String> {
    let (mode, ttl) = match store
        .distributor(&spec.traffic_distributor_id)
        .map_err(|e| e.to_string())?
    {
        Some(d) => (d.spec.mode, d.spec.ttl),
        None => ("nlb".to_string(), "0s".to_string()),
    };
    let dur = |field: &str, v: &str| {
        parse_duration(v)
            .map_err(|_| format!("{field}: must be a duration such as 30s or 1m, got {v:?}"))
    };
    let count = |field: &str, v: i64| {
        u32::try_from(v).map_err(|_| format!("{field}: must be a whole number from 1, got {v}"))
    };
    let ps = PolicySpec {
        min_nodes: count("min_nodes", spec.min_nodes)?,
        max_nodes: count("max_nodes", spec.max_nodes)?,
        initial_nodes: None,
        stats_interval: dur("stats_interval", &spec.stats_interval)?,
        watch_time: dur("watch_time", &spec.watch_time)?,
        cooldown: dur("cooldown", &spec.cooldown)?,
        drain_timeout: dur("drain_timeout", &spec.drain_timeout)?,
        distributor: mode,
        dns_ttl: dur("traffic distributor ttl", &ttl)?,
        thresholds: spec
            .thresholds
            .iter()
            .map(|t| policy::ThresholdSpec {
                metric: t.metric.clone(),
                min: t.min,
                max: t.max,
            })
            .collect(),
    };
    policy::validate_policy(&ps)
        .map(|(c, _)| c)
        .map_err(|errs| {
            errs.iter()
                .map(|e| e.to_string())
                .collect::<Vec<_>>()
                .join("; ")
        })
}

/// One node as the daemon samples it.
struct Target {
    id: String,
    az: String,
    ip: String,
    port: u16,
}

/// Asks every target for its statistics, concurrently, each bounded by
/// [`STATS_TIMEOUT`]. Connections are kept for the next evaluation.
async fn sample_nodes(
    clients: &mut HashMap<String, CachedClient>,
    targets: &[Target],
    token: &str,
) -> HashMap<String, NodeStats> {
    // Forget the connections of nodes that left.
    clients.retain(|id, _| targets.iter().any(|t| &t.id == id));
    let mut set = tokio::task::JoinSet::new();
    for t in targets {
        let addr = format!("{}:{}", t.ip, t.port);
        let cached = clients.remove(&t.id).filter(|c| c.addr == addr);
        let (id, ip, port, token) = (t.id.clone(), t.ip.clone(), t.port, token.to_string());
        set.spawn(async move {
            let call = async {
                let mut client = match cached {
                    Some(c) => c.client,
                    None => NodeClient::connect(&ip, port, &token)
                        .await
                        .map_err(|e| e.to_string())?,
                };
                let stats = client.stats().await.map_err(|e| e.to_string())?;
                Ok::<_, String>((client, stats))
            };
            let r = match tokio::time::timeout(STATS_TIMEOUT, call).await {
                Ok(r) => r,
                Err(_) => Err(format!("no answer within {}s", STATS_TIMEOUT.as_secs())),
            };
            (id, addr, r)
        });
    }
    let mut out = HashMap::new();
    while let Some(joined) = set.join_next().await {
        let Ok((id, addr, r)) = joined else { continue };
        match r {
            Ok((client, stats)) => {
                clients.insert(id.clone(), CachedClient { addr, client });
                out.insert(id, stats);
            }
            Err(e) => tracing::debug!(node = %id, error = %e, "no statistics from node"),
        }
    }
    out
}

fn mean(stats: &[&NodeStats]) -> Option<SampleOut> {
    if stats.is_empty() {
        return None;
    }
    let n = stats.len() as f64;
    Some(SampleOut {
        cpu: stats.iter().map(|s| s.cpu_percent).sum::<f64>() / n,
        memory: stats.iter().map(|s| s.memory_percent).sum::<f64>() / n,
        throughput: stats.iter().map(|s| s.throughput_mbps).sum::<f64>() / n,
        nodes: stats.len() as u32,
    })
}

fn observation(sample: Option<&SampleOut>, outcome: Option<Outcome>) -> Observation {
    let mut obs = Observation {
        sample: sample.map(|s| {
            Sample::default()
                .with(Metric::Cpu, s.cpu)
                .with(Metric::Memory, s.memory)
                .with(Metric::Throughput, s.throughput)
        }),
        ..Default::default()
    };
    match outcome {
        Some(Outcome::ScaledOut { at }) => obs.provision = Some(ProvisionOutcome::Ready { at }),
        Some(Outcome::ScaleOutFailed { at }) => {
            obs.provision = Some(ProvisionOutcome::Failed { at })
        }
        Some(Outcome::ScaledIn { drained, gone }) => {
            obs.drained_at = Some(drained);
            obs.deprovisioned_at = Some(gone);
        }
        None => {}
    }
    obs
}

/// Records the core's events that no engine workflow records itself.
fn record_core_events(shared: &Shared, group_id: &str, az: &str, events: &[policy::Event]) {
    for e in events {
        let kind = match e.kind {
            EventKind::CooldownEnd => "cooldown_end",
            EventKind::ProvisionFailed => "provision_failed",
            EventKind::ScaleOutAbandoned => "scale_out_abandoned",
            // scale_out / scale_in and the workflow steps are recorded by the engine.
            _ => continue,
        };
        let _ = shared
            .engine
            .store
            .record_event(group_id, Some(az), kind, &e.reason);
    }
}

fn fail(shared: &Shared, id: &str, name: &str, what: &str, detail: String) {
    tracing::warn!(group = %name, step = what, error = %detail, "evaluation failed");
    shared.metrics.error(name);
    shared.update_status(id, |s| s.last_error = Some(format!("{what}: {detail}")));
}

/// One evaluation of one group (see the crate docs). Holds the group's runtime
/// for its whole duration, so that the loop starts no second one meanwhile.
pub async fn tick(shared: Arc<Shared>, mut rt: OwnedMutexGuard<GroupRuntime>, row: Row<GroupSpec>) {
    let now = now_ms();
    rt.last_eval_ms = now;
    let (id, spec) = (row.id.clone(), &row.spec);
    let name = spec.name.as_str();
    let store = &shared.engine.store;
    shared.update_status(&id, |s| {
        s.name = spec.name.clone();
        s.min_nodes = spec.min_nodes;
        s.max_nodes = spec.max_nodes;
        s.stats_interval = spec.stats_interval.clone();
    });

    let cfg = match policy_config(store, spec) {
        Ok(c) => c,
        Err(e) => return fail(&shared, &id, name, "read the group's policy", e),
    };
    let interval = Duration::from_millis(cfg.stats_interval);

    // 2. This daemon's claim on the group.
    let own_ttl = claim_ttl(interval);
    // Renewed for as long as this evaluation (and any workflow in it) runs, so
    // that a daemon that dies loses the group one claim TTL later, not minutes.
    let claim = match store.acquire_lease(&daemon_claim_key(&id), &shared.holder, own_ttl) {
        Ok(l) => KeptLease::keep(store.clone(), l, own_ttl),
        Err(StoreError::LeaseHeld { holder, .. }) => {
            if !rt.azs.is_empty() {
                tracing::info!(group = %name, owner = %holder, "another daemon evaluates this group; leaving it");
            }
            // Start from the store if this daemon takes the group over later.
            rt.azs.clear();
            rt.restored.clear();
            rt.clients.clear();
            rt.resumed = false;
            rt.resume_backoff = ResumeBackoff::default();
            shared.update_status(&id, |s| {
                s.owner = holder;
                s.azs.clear();
            });
            return;
        }
        Err(e) => return fail(&shared, &id, name, "claim the group", e.to_string()),
    };

    // 3. Terraform (or anything else) working on the group: skip this tick.
    match store.acquire_lease(&id, &shared.holder, PROBE_TTL) {
        Ok(l) => {
            let _ = store.release_lease(&l);
        }
        Err(StoreError::LeaseHeld { holder, .. }) => {
            tracing::debug!(group = %name, holder = %holder, "group's lease is held; skipping this tick");
            shared.update_status(&id, |s| {
                s.owner = "self".into();
                s.skipped_for = Some(holder);
            });
            return;
        }
        Err(e) => return fail(&shared, &id, name, "probe the group's lease", e.to_string()),
    }

    // 3b. Resume: the first time this daemon evaluates the group, and whenever
    //     the store shows work left half-done (a holder that crashed mid-workflow:
    //     a node in a transient state, a member whose process is gone), the
    //     engine's level-triggered reconcile finishes it before anything is
    //     decided. It leaves a count within min..max as it is. A resume that
    //     fails is retried after a back-off, not at every interval; nothing is
    //     decided meanwhile.
    let leftover = if rt.resumed {
        let view = match shared.engine.group_view(&id).await {
            Ok(Some(v)) => v,
            Ok(None) => return,
            Err(e) => return fail(&shared, &id, name, "read the group's nodes", e.to_string()),
        };
        let stale = match shared.engine.stale_configurations(&id) {
            Ok(s) => s,
            Err(e) => return fail(&shared, &id, name, "read the group's nodes", e.to_string()),
        };
        match store.nodes_of_group(&id) {
            Ok(rows) => leftover_work(&view, &rows, &stale),
            Err(e) => return fail(&shared, &id, name, "read the group's nodes", e.to_string()),
        }
    } else {
        Some("first evaluation by this daemon".to_string())
    };
    if leftover.is_none() {
        rt.resume_backoff = rt.resume_backoff.succeeded();
    }
    if let Some(why) = leftover {
        if !rt.resume_backoff.due(now) {
            tracing::debug!(group = %name, retry_at_ms = rt.resume_backoff.retry_at_ms, "a failed resume waits for its retry");
            shared.update_status(&id, |s| {
                s.owner = "self".into();
                s.skipped_for = None;
            });
            return;
        }
        tracing::info!(group = %name, why = %why, "resuming: reconciling the group before deciding");
        shared.update_status(&id, |s| s.in_flight = Some("resume".into()));
        let started = Instant::now();
        let r = shared.engine.reconcile_group(&id).await;
        shared.metrics.workflow("resume", started.elapsed());
        shared.update_status(&id, |s| s.in_flight = None);
        if let Err(e) = r {
            let failed_at = now_ms();
            let b = rt.resume_backoff.failed(failed_at);
            rt.resume_backoff = b;
            let wait = format_as_seconds(Duration::from_millis(
                (b.retry_at_ms - failed_at).max(0) as u64
            ));
            shared.metrics.resume_failed(name);
            let _ = store.record_event(
                &id,
                None,
                "resume_failed",
                &format!(
                    "resuming ({why}) failed {} time(s) in a row: {e}; retrying in {wait}",
                    b.failures
                ),
            );
            shared.update_status(&id, |s| {
                s.resume_backoff = Some(ResumeWait {
                    failures: b.failures,
                    retry_at_ms: b.retry_at_ms,
                    error: e.to_string(),
                })
            });
            return fail(
                &shared,
                &id,
                name,
                "resume the group's unfinished work",
                format!("{e} (retrying in {wait})"),
            );
        }
        rt.resume_backoff = rt.resume_backoff.succeeded();
        rt.resumed = true;
        // What the policy knew of the AZs predates the repair: start from what
        // the store persisted, against the nodes as the repair left them.
        rt.azs.clear();
        match store.policy_states(&id) {
            Ok(rows) => rt.restored = rows.into_iter().map(|r| (r.az.clone(), r)).collect(),
            Err(e @ StoreError::Decode { .. }) => {
                tracing::warn!(group = %name, error = %e, "the persisted policy state cannot be read; starting each AZ afresh");
                rt.restored.clear();
            }
            Err(e) => {
                // Resume again (it is idempotent) and read it then.
                rt.resumed = false;
                return fail(
                    &shared,
                    &id,
                    name,
                    "read the group's policy state",
                    e.to_string(),
                );
            }
        }
    }

    // 4. Observe.
    let view = match shared.engine.group_view(&id).await {
        Ok(Some(v)) => v,
        Ok(None) => return,
        Err(e) => return fail(&shared, &id, name, "read the group's nodes", e.to_string()),
    };
    let rows = match store.nodes_of_group(&id) {
        Ok(r) => r,
        Err(e) => return fail(&shared, &id, name, "read the group's nodes", e.to_string()),
    };
    let token = match store.group_token(&id) {
        Ok(t) => t.unwrap_or_default(),
        Err(e) => return fail(&shared, &id, name, "read the group's token", e.to_string()),
    };
    let targets: Vec<Target> = view
        .nodes
        .iter()
        .filter(|n| n.serving)
        .map(|n| {
            let port = rows
                .iter()
                .find(|r| r.id == n.id)
                .and_then(|r| r.handle.get("api_port"))
                .and_then(|p| p.as_u64())
                .and_then(|p| u16::try_from(p).ok())
                .filter(|p| *p != 0)
                .unwrap_or(DEFAULT_API_PORT);
            Target {
                id: n.id.clone(),
                az: n.availability_zone.clone(),
                ip: n.private_ip.clone(),
                port,
            }
        })
        .collect();
    let answers = sample_nodes(&mut rt.clients, &targets, &token).await;
    shared.metrics.evaluated();
    let span_views = match shared.engine.vserver_spans(&id) {
        Ok(v) => v,
        Err(e) => {
            return fail(
                &shared,
                &id,
                name,
                "read the vservers' spans",
                e.to_string(),
            )
        }
    };
    let span_target = span_target_cpu(spec);
    // Out of `rt` for the AZ loop, which holds `rt.azs` borrowed; put back
    // after it (an evaluation cut short starts the streaks afresh).
    let mut span_streaks = std::mem::take(&mut rt.span_streaks);

    // Forget AZs that the group no longer declares.
    rt.azs
        .retain(|az, _| spec.availability_zones.iter().any(|z| z == az));
    let mut statuses = Vec::new();
    for az in &spec.availability_zones {
        let in_az: Vec<_> = view
            .nodes
            .iter()
            .filter(|n| &n.availability_zone == az)
            .collect();
        let serving = in_az.iter().filter(|n| n.serving).count() as u32;
        let provisioned = in_az
            .iter()
            .filter(|n| matches!(n.state.as_str(), "provisioning" | "joining" | "active"))
            .count() as u32;
        let mut by_state = nodes_by_state(&view, az);
        let answered: Vec<&NodeStats> = targets
            .iter()
            .filter(|t| &t.az == az)
            .filter_map(|t| answers.get(&t.id))
            .collect();
        let sample = mean(&answered);
        let slow_start: Vec<RampingService> = targets
            .iter()
            .filter(|t| &t.az == az)
            .filter_map(|t| answers.get(&t.id).map(|s| (t, s)))
            .flat_map(|(t, s)| {
                s.services
                    .iter()
                    .filter(|x| x.in_slow_start)
                    .map(|x| RampingService {
                        node: t.id.clone(),
                        vserver: x.vserver.clone(),
                        service: x.service.clone(),
                        cap_per_second: x.cap_per_second,
                        requests_per_second: x.requests_per_second,
                    })
            })
            .collect();
        shared.metrics.set_az(name, az, &by_state, sample.as_ref());

        let restored = if rt.azs.contains_key(az) {
            None
        } else {
            rt.restored.remove(az)
        };
        let azrt = rt.azs.entry(az.clone()).or_insert_with(|| match restored {
            Some(row) => {
                let state =
                    restore_az_state(&cfg, &row.state, row.updated_at, now, serving, provisioned);
                tracing::info!(group = %name, az = %az, persisted = ?row.state.phase, restored = ?state.phase, "resuming the AZ's persisted policy state");
                AzRuntime {
                    state,
                    outcome: None,
                    persisted: Some(row.state),
                }
            }
            None => AzRuntime {
                state: AzState::new(serving),
                outcome: None,
                persisted: None,
            },
        });
        // Level-triggered: while idle, the policy counts what the store shows
        // (Terraform or an operator may have changed it since).
        if matches!(azrt.state.phase, Phase::Evaluating { .. }) {
            azrt.state.serving = serving;
            azrt.state.provisioned = provisioned;
        }
        let obs = observation(sample.as_ref(), azrt.outcome);
        let before = azrt.state;
        let (next, out) = policy::step(&cfg, &azrt.state, &obs, now as u64);
        azrt.state = next;
        // Persisted before any workflow runs, so that a daemon killed in the
        // middle of one leaves the workflow's phase behind (see
        // `restore_az_state`). Refused once the claim is lost: then this daemon
        // must not act on the group either.
        if let Err(e) = persist(store, claim.lease(), &id, az, azrt) {
            // As if this step had not run: the next evaluation takes it again.
            azrt.state = before;
            return fail(
                &shared,
                &id,
                name,
                "persist the policy state",
                e.to_string(),
            );
        }
        if matches!(
            azrt.state.phase,
            Phase::Evaluating { .. } | Phase::Cooldown { .. }
        ) {
            azrt.outcome = None;
        }
        record_core_events(&shared, &id, az, &out.events);
        let sample_text = sample
            .map(|s| s.describe())
            .unwrap_or_else(|| "no statistics (no serving node answered)".into());
        if out.evaluated {
            tracing::debug!(group = %name, az = %az, sample = %sample_text, phase = ?azrt.state.phase, "evaluated");
        }
        let decision_reason = out
            .events
            .iter()
            .find(|e| matches!(e.kind, EventKind::ScaleOut | EventKind::ScaleIn))
            .map(|e| e.reason.clone())
            .unwrap_or_default();
        if let Some(d) = out.decision {
            let action = match d {
                Decision::ScaleOut => "scale_out",
                Decision::ScaleIn => "scale_in",
            };
            shared.metrics.decision(name, az, action);
            tracing::info!(group = %name, az = %az, action, reason = %decision_reason, sample = %sample_text, "scaling decision");
        }

        let mut ran_workflow = false;
        for action in out.actions {
            match action {
                Action::Provision { attempt } => {
                    let reason =
                        format!("{decision_reason}; sample: {sample_text}; attempt {attempt}")
                            .trim_start_matches("; ")
                            .to_string();
                    run_scale_out(&shared, &id, name, az, &reason, &cfg, azrt).await;
                    ran_workflow = true;
                }
                Action::RemoveFromDistributor => {
                    let reason = format!("{decision_reason}; sample: {sample_text}");
                    run_scale_in(
                        &shared,
                        &id,
                        name,
                        az,
                        &reason,
                        &cfg,
                        azrt,
                        serving,
                        provisioned,
                    )
                    .await;
                    ran_workflow = true;
                }
                // The engine's workflows carry these out as part of the two above.
                Action::Activate | Action::Deprovision | Action::DiscardFailedNode => {}
            }
        }
        if ran_workflow {
            // The outcome (cooldown, provisioning back-off, back to evaluating).
            if let Err(e) = persist(store, claim.lease(), &id, az, azrt) {
                fail(
                    &shared,
                    &id,
                    name,
                    "persist the policy state",
                    e.to_string(),
                );
            }
            // Show what the workflow left, not what the tick started from.
            if let Ok(Some(after)) = shared.engine.group_view(&id).await {
                by_state = nodes_by_state(&after, az);
                shared.metrics.set_az(name, az, &by_state, sample.as_ref());
            }
        }
        // A vserver's span follows its holders' CPU: only while the AZ's own
        // scaling is idle, so that one evaluation changes one thing.
        let may_resize = !ran_workflow && matches!(azrt.state.phase, Phase::Evaluating { .. });
        let spans = size_spans(
            &shared,
            &id,
            name,
            az,
            &span_views,
            &answers,
            SpanPolicy {
                target_cpu: span_target,
                watch_samples: cfg.watch_samples,
                may_resize,
            },
            &mut span_streaks,
            claim.lease(),
        )
        .await;
        statuses.push(az_status(
            az,
            &azrt.state,
            by_state,
            sample,
            slow_start,
            spans,
        ));
    }
    rt.span_streaks = span_streaks;
    shared.update_status(&id, |s| {
        s.owner = "self".into();
        s.skipped_for = None;
        s.resume_backoff = None;
        s.last_evaluated_ms = Some(now);
        s.azs = statuses;
    });
}

/// Writes the AZ's policy state under the daemon's claim on the group, if it
/// changed since the last write.
fn persist(
    store: &Store,
    claim: &lbscale_engine::store::Lease,
    group_id: &str,
    az: &str,
    azrt: &mut AzRuntime,
) -> Result<(), StoreError> {
    if azrt.persisted == Some(azrt.state) {
        return Ok(());
    }
    store.put_policy_state(claim, group_id, az, &azrt.state)?;
    azrt.persisted = Some(azrt.state);
    Ok(())
}

fn nodes_by_state(view: &lbscale_engine::reconcile::GroupView, az: &str) -> BTreeMap<String, u64> {
    let mut by_state: BTreeMap<String, u64> = BTreeMap::new();
    for n in view.nodes.iter().filter(|n| n.availability_zone == az) {
        *by_state.entry(n.state.clone()).or_default() += 1;
    }
    by_state
}

fn az_status(
    az: &str,
    state: &AzState,
    nodes: BTreeMap<String, u64>,
    sample: Option<SampleOut>,
    slow_start: Vec<RampingService>,
    vserver_spans: Vec<VserverSpan>,
) -> AzStatus {
    AzStatus {
        az: az.to_string(),
        phase: state.phase.kind(),
        serving: state.serving,
        provisioned: state.provisioned,
        nodes,
        sample,
        out_streak: Metric::ALL
            .iter()
            .map(|m| (m.name(), state.out_streak[m.index()]))
            .collect(),
        in_streak: state.in_streak,
        wait_until_ms: wait_ends_at(&state.phase),
        slow_start,
        vserver_spans,
    }
}

/// The CPU, percent, under which a vserver's holders should stay: the group's
/// `cpu` threshold max (where the group itself would scale out), else
/// [`lbscale_core::seplan::DEFAULT_SPAN_TARGET_CPU`].
fn span_target_cpu(spec: &GroupSpec) -> f64 {
    spec.thresholds
        .iter()
        .find(|t| t.metric == "cpu")
        .map(|t| t.max)
        .unwrap_or(lbscale_core::seplan::DEFAULT_SPAN_TARGET_CPU)
}

/// How the daemon sizes spans at one evaluation.
struct SpanPolicy {
    /// Percent CPU the holders should stay under.
    target_cpu: f64,
    /// Evaluations in a row that must ask to move a span the same way.
    watch_samples: u32,
    /// False while the AZ's own scaling is busy: spans are reported, not changed.
    may_resize: bool,
}

/// Sizes each vserver's span in `az` from the CPU its holders reported
/// (`lbscale_core::seplan::span_for_cpu`) and applies a new one through the
/// engine (an event says why) once `watch_samples` evaluations in a row asked
/// for it. A vserver whose holders did not all answer keeps its span. The
/// write is fenced by the daemon's `claim` on the group.
#[allow(clippy::too_many_arguments)]
async fn size_spans(
    shared: &Shared,
    group_id: &str,
    name: &str,
    az: &str,
    views: &[SpanView],
    answers: &HashMap<String, NodeStats>,
    policy: SpanPolicy,
    streaks: &mut HashMap<(String, String), SpanStreak>,
    claim: &lbscale_engine::store::Lease,
) -> Vec<VserverSpan> {
    let mut out = Vec::new();
    streaks.retain(|(v, a), _| a != az || views.iter().any(|x| &x.vserver_id == v));
    for v in views.iter().filter(|v| v.az == az) {
        let key = (v.vserver_id.clone(), az.to_string());
        let cpus: Option<Vec<f64>> = v
            .holders
            .iter()
            .map(|h| answers.get(h).map(|s| s.cpu_percent))
            .collect();
        let cpus = cpus.filter(|c| !c.is_empty());
        let mean = cpus
            .as_ref()
            .map(|c| c.iter().sum::<f64>() / c.len() as f64);
        let mut span = v.span;
        let want = match (&cpus, policy.may_resize) {
            (Some(cpus), true) => Some(lbscale_core::seplan::span_for_cpu(
                &v.plan,
                cpus,
                v.span,
                policy.target_cpu,
                v.min,
                v.max,
            )),
            _ => None,
        };
        let Some(want) = want else {
            streaks.remove(&key);
            out.push(VserverSpan {
                vserver: v.vserver.clone(),
                span,
                min: v.min,
                max: v.max,
                holders: v.holders.clone(),
                cpu: mean,
            });
            continue;
        };
        let (streak, moved) = lbscale_core::seplan::span_streak_step(
            streaks.remove(&key),
            v.span,
            want.nodes,
            policy.watch_samples,
        );
        if let Some(streak) = streak {
            streaks.insert(key, streak);
        }
        if let Some(to) = moved {
            let target_cpu = policy.target_cpu;
            let reason = format!(
                "vserver {}: span {} -> {} node(s): its {} holder(s) at {:.1} % CPU on average, target {:.0} %{}",
                v.vserver,
                v.span,
                to,
                v.holders.len(),
                mean.unwrap_or(0.0),
                target_cpu,
                if want.saturated && to == want.nodes { " (max_scaleout_per_vs reached: saturated)" } else { "" }
            );
            match shared
                .engine
                .set_vserver_span(group_id, &v.vserver_id, az, to, &reason, Some(claim))
                .await
            {
                Ok(()) => {
                    tracing::info!(group = %name, az = %az, vserver = %v.vserver, from = v.span, to, %reason, "vserver span changed");
                    span = to;
                }
                Err(e) => {
                    tracing::warn!(group = %name, az = %az, vserver = %v.vserver, error = %e, "could not change the vserver's span");
                }
            }
        }
        out.push(VserverSpan {
            vserver: v.vserver.clone(),
            span,
            min: v.min,
            max: v.max,
            holders: v.holders.clone(),
            cpu: mean,
        });
    }
    out
}

/// How long this daemon's claim on a group lasts between evaluations: another
/// daemon takes the group over this long after this one stopped renewing it.
fn claim_ttl(interval: Duration) -> Duration {
    (interval * 5).max(Duration::from_secs(10))
}

/// Work that a holder left half-done, as the store and the processes show it:
/// a node in a transient or failed state, an active node that is not registered
/// with the distributor, or one that does not run the configuration it should
/// (`stale`). `None` when the group is settled.
fn leftover_work(view: &GroupView, rows: &[NodeRow], stale: &[String]) -> Option<String> {
    if let Some(n) = view.nodes.iter().find(|n| n.state != "active") {
        return Some(format!("node {} is {}", n.id, n.state));
    }
    if let Some(id) = stale.first() {
        return Some(format!("node {id} does not run its current configuration"));
    }
    rows.iter()
        .find(|r| r.state == NodeState::Active && !r.registered)
        .map(|r| format!("node {} is active but not registered", r.id))
}

#[allow(clippy::too_many_arguments)]
async fn run_scale_out(
    shared: &Shared,
    id: &str,
    name: &str,
    az: &str,
    reason: &str,
    cfg: &PolicyConfig,
    azrt: &mut AzRuntime,
) {
    shared.update_status(id, |s| s.in_flight = Some(format!("scale_out {az}")));
    let started = Instant::now();
    let r = shared.engine.scale_out(id, az, reason).await;
    let took = started.elapsed();
    shared.metrics.workflow("scale_out", took);
    shared.update_status(id, |s| s.in_flight = None);
    let at = now_ms() as u64;
    azrt.outcome = Some(match &r {
        Ok(node) => {
            tracing::info!(group = %name, az = %az, node = %node, decision_to_serving_ms = took.as_millis() as u64, "scale-out done: the new node serves");
            Outcome::ScaledOut { at }
        }
        Err(e) => {
            fail(shared, id, name, "scale out", e.to_string());
            let _ =
                shared
                    .engine
                    .store
                    .record_event(id, Some(az), "scale_out_failed", &format!("{e}"));
            Outcome::ScaleOutFailed { at }
        }
    });
    // Tell the policy now: the cooldown starts when the node has joined.
    let obs = observation(None, azrt.outcome);
    let (next, out) = policy::step(cfg, &azrt.state, &obs, at);
    azrt.state = next;
    if !matches!(azrt.state.phase, Phase::Provisioning { .. }) {
        azrt.outcome = None;
    }
    record_core_events(shared, id, az, &out.events);
}

#[allow(clippy::too_many_arguments)]
async fn run_scale_in(
    shared: &Shared,
    id: &str,
    name: &str,
    az: &str,
    reason: &str,
    cfg: &PolicyConfig,
    azrt: &mut AzRuntime,
    serving: u32,
    provisioned: u32,
) {
    shared.update_status(id, |s| s.in_flight = Some(format!("scale_in {az}")));
    let started = Instant::now();
    let r = shared.engine.scale_in_one(id, az, reason).await;
    let took = started.elapsed();
    shared.metrics.workflow("scale_in", took);
    shared.update_status(id, |s| s.in_flight = None);
    match r {
        Ok(node) => {
            tracing::info!(group = %name, az = %az, node = %node, took_ms = took.as_millis() as u64, "scale-in done: the node is gone");
            let done = now_ms() as u64;
            // The engine ran TTL wait, drain and deprovision in one go; the policy
            // learns that the node drained by `done` and was gone just after.
            azrt.outcome = Some(Outcome::ScaledIn {
                drained: done,
                gone: done + 1,
            });
            let obs = observation(None, azrt.outcome);
            let (next, out) = policy::step(cfg, &azrt.state, &obs, done + 1);
            azrt.state = next;
            if matches!(azrt.state.phase, Phase::Evaluating { .. }) {
                azrt.outcome = None;
            }
            record_core_events(shared, id, az, &out.events);
        }
        Err(e) => {
            fail(shared, id, name, "scale in", e.to_string());
            let _ =
                shared
                    .engine
                    .store
                    .record_event(id, Some(az), "scale_in_failed", &format!("{e}"));
            // Nothing left the AZ that the engine did not record: start over from
            // what the store shows at the next evaluation.
            let mut fresh = AzState::new(serving);
            fresh.provisioned = provisioned;
            fresh.phase = Phase::Evaluating {
                after: Some(now_ms() as u64),
            };
            azrt.state = fresh;
            azrt.outcome = None;
        }
    }
}

/// The phase names of `/v1/groups` (for callers that print them).
pub fn phase_name(p: PhaseKind) -> &'static str {
    match p {
        PhaseKind::Evaluating => "evaluating",
        PhaseKind::Provisioning => "provisioning",
        PhaseKind::Cooldown => "cooldown",
        PhaseKind::Ttl => "ttl",
        PhaseKind::Draining => "draining",
        PhaseKind::Deprovisioning => "deprovisioning",
    }
}
