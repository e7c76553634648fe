//! Sizing each vserver's span from the CPU of the nodes that hold it.

use crate::metrics::VserverSpan;
use crate::Shared;
use lbscale_core::seplan::SpanStreak;
use lbscale_engine::model::GroupSpec;
use lbscale_engine::reconcile::SpanView;
use lbscale_proto::NodeStats;
use std::collections::HashMap;

/// The CPU, percent, under which a vserver's holders should stay: the group's
/// `cpu` threshold max (where the group itself would scale out), else
/// [`lbscale_core::seplan::DEFAULT_SPAN_TARGET_CPU`].
pub(crate) fn span_target_cpu(spec: &GroupSpec) -> f64 {
    spec.thresholds
        .iter()
        .find(|t| t.metric == lbscale_core::policy::Metric::Cpu)
        .map(|t| t.max)
        .unwrap_or(lbscale_core::seplan::DEFAULT_SPAN_TARGET_CPU)
}

/// How the daemon sizes spans at one evaluation.
pub(crate) struct SpanPolicy {
    /// Percent CPU the holders should stay under.
    pub target_cpu: f64,
    /// Evaluations in a row that must ask to move a span the same way.
    pub watch_samples: u32,
    /// False while the AZ's own scaling is busy: spans are reported, not changed.
    pub may_resize: bool,
}

/// Sizes each vserver's span in `az` from the CPU its holders reported
/// (`lbscale_core::seplan::span_for_cpu`) and applies a new one through the
/// engine (an event says why) once `watch_samples` evaluations in a row asked
/// for it. A vserver whose holders did not all answer keeps its span. The
/// write is fenced by the daemon's `claim` on the group.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn size_spans(
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
