//! What `/v1/groups` shows of a group and its AZs.

use crate::metrics::{AzStatus, GroupStatus, RampingService, SampleOut, VserverSpan};
use crate::resume::wait_ends_at;
use crate::smallmap::SmallMap;
use lbscale_core::policy::{AzState, Metric, PhaseKind};
use lbscale_engine::model::GroupSpec;
use lbscale_engine::reconcile::GroupView;
use lbscale_engine::store::Row;

/// A group's status before its first evaluation.
pub fn initial_status(row: &Row<GroupSpec>) -> GroupStatus {
    GroupStatus {
        id: row.id.clone(),
        name: row.spec.name.clone(),
        min_nodes: row.spec.min_nodes,
        max_nodes: row.spec.max_nodes,
        stats_interval: row.spec.stats_interval.to_string(),
        owner: String::new(),
        last_evaluated_ms: None,
        in_flight: None,
        skipped_for: None,
        last_error: None,
        resume_backoff: None,
        azs: Vec::new(),
    }
}

/// The AZ's nodes by lifecycle state.
pub(crate) fn nodes_by_state(view: &GroupView, az: &str) -> SmallMap<String, u64> {
    let mut by_state = SmallMap::new();
    for n in view.nodes.iter().filter(|n| n.availability_zone == az) {
        match by_state.get_mut(n.state.as_str()) {
            Some(count) => *count += 1,
            None => {
                by_state.insert(n.state.clone(), 1);
            }
        }
    }
    by_state
}

/// The AZ as `/v1/groups` shows it.
pub(crate) fn az_status(
    az: &str,
    state: &AzState,
    nodes: SmallMap<String, u64>,
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
