//! One availability zone of a group, which is its own cluster: its policy
//! state, the policy step on this evaluation's sample, and its workflow, which
//! runs as a task of its own so that a drain, a TTL wait or a slow node in
//! this AZ never holds up the group's other AZs. An AZ has at most one
//! workflow at a time; the engine runs it under the AZ's lease.

use crate::group::{report_error, EvalError};
use crate::metrics::SampleOut;
use crate::Shared;
use lbscale_core::policy::{
    self, Action, AzState, Decision, EventKind, Metric, Observation, Phase, PolicyConfig,
    ProvisionOutcome, Sample,
};
use lbscale_engine::store::{now_ms, Lease};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::task::JoinHandle;

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

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum WorkflowKind {
    ScaleOut,
    ScaleIn,
}

impl WorkflowKind {
    pub fn name(self) -> &'static str {
        match self {
            WorkflowKind::ScaleOut => "scale_out",
            WorkflowKind::ScaleIn => "scale_in",
        }
    }
}

/// How a workflow task ended: the node it added or removed, or why it failed.
struct Finished {
    result: Result<String, String>,
    /// Unix ms of its end.
    at: u64,
}

struct Workflow {
    kind: WorkflowKind,
    task: JoinHandle<Finished>,
}

/// What one evaluation needs to step an AZ and start its workflow.
pub(crate) struct AzCtx<'a> {
    pub shared: &'a Arc<Shared>,
    pub group_id: &'a str,
    pub name: &'a str,
    pub az: &'a str,
    pub cfg: &'a PolicyConfig,
    /// The daemon's claim on the group: it fences the policy state's writes,
    /// and a workflow keeps it renewed for as long as it runs.
    pub claim: &'a Lease,
    pub claim_ttl: Duration,
}

/// What this evaluation observed of the AZ.
pub(crate) struct AzSeen {
    pub serving: u32,
    pub provisioned: u32,
    pub sample: Option<SampleOut>,
}

pub(crate) struct AzRuntime {
    pub state: AzState,
    outcome: Option<Outcome>,
    /// What the store holds for this AZ (written by this daemon, or restored).
    persisted: Option<AzState>,
    workflow: Option<Workflow>,
}

impl AzRuntime {
    pub fn new(state: AzState, persisted: Option<AzState>) -> AzRuntime {
        AzRuntime {
            state,
            outcome: None,
            persisted,
            workflow: None,
        }
    }

    /// The workflow under way (or ended and not yet taken in).
    pub fn workflow(&self) -> Option<WorkflowKind> {
        self.workflow.as_ref().map(|w| w.kind)
    }

    /// An AZ whose scale-out runs until `end` resolves (tests of the loop).
    #[cfg(test)]
    pub fn scaling_out_until(end: tokio::sync::oneshot::Receiver<()>) -> AzRuntime {
        let task = tokio::spawn(async move {
            let _ = end.await;
            Finished {
                result: Ok("joined".into()),
                at: 0,
            }
        });
        AzRuntime {
            workflow: Some(Workflow {
                kind: WorkflowKind::ScaleOut,
                task,
            }),
            ..AzRuntime::new(AzState::new(2), None)
        }
    }

    /// Whether a workflow ended that the policy has not taken in.
    pub fn workflow_ended(&self) -> bool {
        self.workflow.as_ref().is_some_and(|w| w.task.is_finished())
    }

    /// One evaluation of the AZ: takes in the workflow that ended, then, unless
    /// one still runs, steps the policy on the sample and starts the workflow
    /// it asks for. Returns the workflow started.
    pub async fn evaluate(
        &mut self,
        cx: &AzCtx<'_>,
        seen: &AzSeen,
        now: i64,
    ) -> Result<Option<WorkflowKind>, EvalError> {
        if self.workflow_ended() {
            self.take_in_workflow(cx, seen).await;
            self.persist(cx).await?;
        }
        if self.workflow.is_some() {
            return Ok(None);
        }
        self.step(cx, seen, now).await
    }

    /// The policy step on a fresh sample; persisted before any workflow runs,
    /// so that a daemon killed in the middle of one leaves the workflow's phase
    /// behind (see `restore_az_state`). Refused once the claim is lost: then
    /// this daemon must not act on the group either.
    async fn step(
        &mut self,
        cx: &AzCtx<'_>,
        seen: &AzSeen,
        now: i64,
    ) -> Result<Option<WorkflowKind>, EvalError> {
        // Level-triggered: while idle, the policy counts what the store shows
        // (Terraform or an operator may have changed it since).
        if matches!(self.state.phase, Phase::Evaluating { .. }) {
            self.state.serving = seen.serving;
            self.state.provisioned = seen.provisioned;
        }
        let obs = observation(seen.sample.as_ref(), self.outcome);
        let before = self.state;
        let (next, out) = policy::step(cx.cfg, &self.state, &obs, now as u64);
        self.state = next;
        if let Err(e) = self.persist(cx).await {
            // As if this step had not run: the next evaluation takes it again.
            self.state = before;
            return Err(e);
        }
        if matches!(
            self.state.phase,
            Phase::Evaluating { .. } | Phase::Cooldown { .. }
        ) {
            self.outcome = None;
        }
        record_core_events(cx, &out.events).await;
        let sample_text = seen
            .sample
            .as_ref()
            .map(|s| s.describe())
            .unwrap_or_else(|| "no statistics (no serving node answered)".into());
        if out.evaluated {
            tracing::debug!(group = %cx.name, az = %cx.az, sample = %sample_text, phase = ?self.state.phase, "evaluated");
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
            cx.shared.metrics.decision(cx.name, cx.az, action);
            tracing::info!(group = %cx.name, az = %cx.az, action, reason = %decision_reason, sample = %sample_text, "scaling decision");
        }
        for action in out.actions {
            let (kind, reason) = match action {
                Action::Provision { attempt } => (
                    WorkflowKind::ScaleOut,
                    format!("{decision_reason}; sample: {sample_text}; attempt {attempt}"),
                ),
                Action::RemoveFromDistributor => (
                    WorkflowKind::ScaleIn,
                    format!("{decision_reason}; sample: {sample_text}"),
                ),
                // The engine's workflows carry these out as part of the two above.
                Action::Activate | Action::Deprovision | Action::DiscardFailedNode => continue,
            };
            self.start(cx, kind, reason.trim_start_matches("; ").to_string());
            return Ok(Some(kind));
        }
        Ok(None)
    }

    /// Runs the workflow as a task of its own (the engine takes the AZ's lease).
    fn start(&mut self, cx: &AzCtx<'_>, kind: WorkflowKind, reason: String) {
        let shared = cx.shared.clone();
        let (id, name, az) = (
            cx.group_id.to_string(),
            cx.name.to_string(),
            cx.az.to_string(),
        );
        let claim = cx.shared.engine.keep_claim(cx.claim, cx.claim_ttl);
        let task = tokio::spawn(async move {
            let started = Instant::now();
            let r = match kind {
                WorkflowKind::ScaleOut => shared.engine.scale_out(&id, &az, &reason).await,
                WorkflowKind::ScaleIn => shared.engine.scale_in_one(&id, &az, &reason).await,
            };
            drop(claim);
            let took = started.elapsed();
            shared.metrics.workflow(kind.name(), took);
            let took_ms = took.as_millis() as u64;
            match &r {
                Ok(node) if kind == WorkflowKind::ScaleOut => {
                    tracing::info!(group = %name, az = %az, node = %node, decision_to_serving_ms = took_ms, "scale-out done: the new node serves")
                }
                Ok(node) => {
                    tracing::info!(group = %name, az = %az, node = %node, took_ms, "scale-in done: the node is gone")
                }
                // The group was destroyed while the workflow waited for its
                // lease: nothing failed, and no event may outlive the group.
                Err(lbscale_engine::EngineError::NotFound(what)) => {
                    tracing::info!(group = %name, az = %az, %what, "workflow ended: the group is gone");
                }
                Err(e) => {
                    let what = match kind {
                        WorkflowKind::ScaleOut => "scale out",
                        WorkflowKind::ScaleIn => "scale in",
                    };
                    report_error(&shared, &id, &name, what, &e.to_string());
                    let event = format!("{}_failed", kind.name());
                    shared
                        .engine
                        .record_event(&id, Some(&az), &event, &e.to_string())
                        .await;
                }
            }
            Finished {
                result: r.map_err(|e| e.to_string()),
                at: now_ms() as u64,
            }
        });
        self.workflow = Some(Workflow { kind, task });
    }

    /// Tells the policy how the workflow ended: the cooldown starts when the
    /// node joined, a failed scale-out backs off, a scale-in goes back to
    /// evaluating.
    async fn take_in_workflow(&mut self, cx: &AzCtx<'_>, seen: &AzSeen) {
        let Some(w) = self.workflow.take() else {
            return;
        };
        let done = w.task.await.unwrap_or_else(|e| Finished {
            result: Err(format!("the workflow's task ended: {e}")),
            at: now_ms() as u64,
        });
        let at = done.at;
        match (w.kind, done.result) {
            (WorkflowKind::ScaleOut, r) => {
                self.outcome = Some(match r {
                    Ok(_) => Outcome::ScaledOut { at },
                    Err(_) => Outcome::ScaleOutFailed { at },
                });
                self.step_outcome(cx, at).await;
                if !matches!(self.state.phase, Phase::Provisioning { .. }) {
                    self.outcome = None;
                }
            }
            (WorkflowKind::ScaleIn, Ok(_)) => {
                // The engine ran TTL wait, drain and deprovision in one go; the
                // policy learns that the node drained by its end and was gone
                // just after.
                self.outcome = Some(Outcome::ScaledIn {
                    drained: at,
                    gone: at + 1,
                });
                self.step_outcome(cx, at + 1).await;
                if matches!(self.state.phase, Phase::Evaluating { .. }) {
                    self.outcome = None;
                }
            }
            (WorkflowKind::ScaleIn, Err(_)) => {
                // Nothing left the AZ that the engine did not record: start over
                // from what the store shows.
                let mut fresh = AzState::new(seen.serving);
                fresh.provisioned = seen.provisioned;
                fresh.phase = Phase::Evaluating { after: Some(at) };
                self.state = fresh;
                self.outcome = None;
            }
        }
    }

    async fn step_outcome(&mut self, cx: &AzCtx<'_>, at: u64) {
        let obs = observation(None, self.outcome);
        let (next, out) = policy::step(cx.cfg, &self.state, &obs, at);
        self.state = next;
        record_core_events(cx, &out.events).await;
    }

    /// Writes the AZ's policy state under the daemon's claim on the group, if
    /// it changed since the last write in a way that a resume would see
    /// (see [`same_on_resume`]).
    async fn persist(&mut self, cx: &AzCtx<'_>) -> Result<(), EvalError> {
        if self
            .persisted
            .is_some_and(|p| same_on_resume(&p, &self.state))
        {
            return Ok(());
        }
        cx.shared
            .engine
            .put_policy_state(cx.claim, cx.group_id, cx.az, &self.state)
            .await
            .map_err(|e| EvalError::new("persist the policy state", e))?;
        self.persisted = Some(self.state);
        Ok(())
    }
}

/// Whether a daemon that resumes the AZ from `persisted` does what it would
/// do from `now` (see `resume::restore_az_state`): the same state, or both
/// idle with no streak under way, only the instant of the last evaluation
/// (`Evaluating.after`) moved on. A resumed AZ evaluates at its first tick
/// after either instant, and no streak can be lost or reset, so an idle AZ
/// writes nothing at each evaluation: a steady group costs no write.
fn same_on_resume(persisted: &AzState, now: &AzState) -> bool {
    let idle = |s: &AzState| {
        matches!(s.phase, Phase::Evaluating { after: Some(_) })
            && s.out_streak == [0; 3]
            && s.in_streak == 0
    };
    persisted == now
        || (idle(persisted)
            && idle(now)
            && persisted.serving == now.serving
            && persisted.provisioned == now.provisioned)
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
async fn record_core_events(cx: &AzCtx<'_>, events: &[policy::Event]) {
    for e in events {
        let kind = match e.kind {
            EventKind::CooldownEnd => "cooldown_end",
            EventKind::ProvisionFailed => "provision_failed",
            EventKind::ScaleOutAbandoned => "scale_out_abandoned",
            // scale_out / scale_in and the workflow steps are recorded by the engine.
            _ => continue,
        };
        cx.shared
            .engine
            .record_event(cx.group_id, Some(cx.az), kind, &e.reason)
            .await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn idle(after: u64) -> AzState {
        let mut s = AzState::new(2);
        s.phase = Phase::Evaluating { after: Some(after) };
        s
    }

    #[test]
    fn an_idle_az_whose_last_evaluation_moved_on_is_not_written_again() {
        assert!(same_on_resume(&idle(1_000), &idle(61_000)));
        // A streak under way, a count, a phase: written.
        let mut breaching = idle(61_000);
        breaching.out_streak = [1, 0, 0];
        assert!(!same_on_resume(&idle(1_000), &breaching));
        assert!(!same_on_resume(&breaching, &idle(61_000)));
        let mut three = idle(61_000);
        three.serving = 3;
        assert!(!same_on_resume(&idle(1_000), &three));
        let mut cooling = idle(0);
        cooling.phase = Phase::Cooldown { until: 90_000 };
        assert!(!same_on_resume(&idle(1_000), &cooling));
        // The first evaluation (no instant yet) is written.
        assert!(!same_on_resume(&AzState::new(2), &idle(1_000)));
    }

    #[test]
    fn a_daemon_resuming_either_state_does_the_same() {
        // What the skipped write would have changed: restore_az_state gives the
        // same phase and streaks from both, and the AZ evaluates at the same
        // next tick.
        let cfg = PolicyConfig {
            min_nodes: 1,
            max_nodes: 3,
            stats_interval: 60_000,
            watch_samples: 2,
            cooldown: 20_000,
            drain_timeout: 2_000,
            distributor: lbscale_core::policy::Distributor::Dns,
            dns_ttl: 1_000,
            thresholds: lbscale_core::policy::Thresholds::default(),
        };
        let now = 200_000;
        let a = crate::resume::restore_az_state(&cfg, &idle(1_000), 1_000, now, 2, 2);
        let b = crate::resume::restore_az_state(&cfg, &idle(61_000), 61_000, now, 2, 2);
        assert_eq!((a.out_streak, a.in_streak), (b.out_streak, b.in_streak));
        let obs = Observation::default();
        let (na, _) = policy::step(&cfg, &a, &obs, now as u64);
        let (nb, _) = policy::step(&cfg, &b, &obs, now as u64);
        assert_eq!(na, nb);
    }
}
