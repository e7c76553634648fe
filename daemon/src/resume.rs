//! What a daemon does when it (re)takes a group: the pure rules, kept apart from
//! the I/O of [`crate::group::tick`] so that they are unit-tested.
//!
//! - [`restore_az_state`]: what an AZ's persisted policy state means to a daemon
//!   that starts from it (after a restart or a takeover);
//! - [`ResumeBackoff`]: how long to wait before trying a failed resume again.
//!
//! Clock: every instant in an `AzState` is Unix time in ms, from
//! `lbscale_engine::store::now_ms` (the daemon's `now` for `policy::step`, the
//! workflows' outcome instants, the store's `updated_at`). So a persisted
//! `Cooldown { until }` means the same instant to the next process; no
//! conversion at the store boundary. Only a wall-clock jump could make it lie,
//! and [`restore_az_state`] bounds every restored wait by its configured length.

use lbscale_core::policy::{provision_backoff, AzState, Millis, Phase, PolicyConfig};
use std::time::Duration;

/// An AZ's persisted policy state, as the daemon resumes from it at `now` (both
/// Unix ms). `saved_at` is when it was written; `serving` / `provisioned` are
/// what the store shows now, after the resume reconcile settled the nodes.
///
/// - Waits the core times itself carry over: a running cooldown or provisioning
///   back-off ends when it would have ended had the daemon not stopped, but never
///   later than its full length from `now` (a wall clock set back, a cooldown
///   shortened by an apply).
/// - Streaks survive only if no sample was missed: written at most one
///   `stats_interval` (plus half of one, for the loop's jitter) ago. A daemon
///   that was down longer did not take the samples in between, and the core's rule
///   is that a missing sample breaks a streak; so a long outage never completes a
///   breach with samples from before it.
/// - A workflow the previous daemon had under way (provisioning, TTL wait, drain,
///   deprovisioning) was cut short by its end; the resume reconcile that runs
///   before this has finished or undone it. A cut scale-out starts a cooldown
///   from now (its node has most likely just joined: deciding again at once would
///   scale out twice on one breach); a cut scale-in goes back to evaluating.
pub fn restore_az_state(
    cfg: &PolicyConfig,
    saved: &AzState,
    saved_at: i64,
    now: i64,
    serving: u32,
    provisioned: u32,
) -> AzState {
    let now_u = now.max(0) as Millis;
    let mut s = *saved;
    s.serving = serving;
    s.provisioned = provisioned;
    let missed_a_sample = now.saturating_sub(saved_at) > (cfg.stats_interval * 3 / 2) as i64;
    if missed_a_sample {
        s.out_streak = [0; 3];
        s.in_streak = 0;
    }
    let cooldown_from_now = || {
        if cfg.cooldown > 0 {
            Phase::Cooldown {
                until: now_u.saturating_add(cfg.cooldown),
            }
        } else {
            Phase::Evaluating { after: Some(now_u) }
        }
    };
    s.phase = match saved.phase {
        Phase::Evaluating { after } => Phase::Evaluating {
            after: after.map(|a| a.min(now_u)),
        },
        Phase::Cooldown { until } => Phase::Cooldown {
            until: until.min(now_u.saturating_add(cfg.cooldown)),
        },
        Phase::ProvisionBackoff {
            retry_after,
            attempt,
        } => Phase::ProvisionBackoff {
            retry_after: retry_after
                .min(now_u.saturating_add(provision_backoff(attempt).as_millis() as Millis)),
            attempt,
        },
        // A scale-out that was cut off: if its node made it (the resume reconcile
        // finished it), the cooldown starts now, so that one breach never scales
        // out twice; if the reconcile removed the half-made node, nothing was
        // added and the AZ evaluates again (a breach needs fresh samples).
        Phase::Provisioning { .. } if provisioned >= saved.provisioned => cooldown_from_now(),
        Phase::Provisioning { .. } => Phase::Evaluating { after: Some(now_u) },
        Phase::Ttl { .. }
        | Phase::Draining { .. }
        | Phase::DeprovisionDue { .. }
        | Phase::Deprovisioning { .. } => Phase::Evaluating { after: Some(now_u) },
    };
    if !matches!(s.phase, Phase::Evaluating { .. }) {
        // Streaks count only while evaluating; a wait starts them afresh.
        s.out_streak = [0; 3];
        s.in_streak = 0;
    }
    s
}

/// The end of the wait an AZ is in, if its phase is one the core times.
pub fn wait_ends_at(phase: &Phase) -> Option<Millis> {
    match *phase {
        Phase::Cooldown { until } | Phase::Ttl { until } | Phase::Draining { until, .. } => {
            Some(until)
        }
        Phase::ProvisionBackoff { retry_after, .. } => Some(retry_after),
        _ => None,
    }
}

/// Failed resumes (the reconcile a daemon runs before deciding) of one group in a
/// row, and when the next try is due. A node that keeps refusing its
/// configuration would otherwise be retried every `stats_interval`: the waits are
/// the policy's provisioning back-off ([`provision_backoff`]: 30 s doubling to
/// 10 min), and a success starts over. A resume that failed only at publishing
/// waits less ([`ResumeBackoff::failed_publishing`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ResumeBackoff {
    /// Failures in a row; 0 when the last resume succeeded (or none ran).
    pub failures: u32,
    /// Unix ms before which the next resume does not run.
    pub retry_at_ms: i64,
}

impl ResumeBackoff {
    /// After a resume that failed at `at_ms`.
    pub fn failed(self, at_ms: i64) -> ResumeBackoff {
        let failures = self.failures.saturating_add(1);
        ResumeBackoff {
            failures,
            retry_at_ms: at_ms.saturating_add(provision_backoff(failures).as_millis() as i64),
        }
    }

    /// After a resume that failed at `at_ms` only at publishing to the traffic
    /// distributor: publication is level-triggered (the distributor is checked
    /// every `interval` anyway), so it waits one `interval`, doubling, and
    /// never longer than [`ResumeBackoff::failed`]. A distributor that could not
    /// be written for a while is then served again within about one interval of
    /// being fixed, a dead node's address dropped with it.
    pub fn failed_publishing(self, at_ms: i64, interval: Duration) -> ResumeBackoff {
        let failures = self.failures.saturating_add(1);
        let doubled = interval.saturating_mul(1 << failures.clamp(1, 16).saturating_sub(1));
        ResumeBackoff {
            failures,
            retry_at_ms: at_ms
                .saturating_add(doubled.min(provision_backoff(failures)).as_millis() as i64),
        }
    }

    /// After a resume that succeeded.
    pub fn succeeded(self) -> ResumeBackoff {
        ResumeBackoff::default()
    }

    /// Whether a resume may run at `now_ms`.
    pub fn due(&self, now_ms: i64) -> bool {
        self.failures == 0 || now_ms >= self.retry_at_ms
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lbscale_core::policy::{Distributor, Thresholds};

    fn cfg() -> PolicyConfig {
        PolicyConfig {
            min_nodes: 1,
            max_nodes: 3,
            stats_interval: 1_000,
            watch_samples: 2,
            cooldown: 20_000,
            drain_timeout: 2_000,
            distributor: Distributor::Dns,
            dns_ttl: 1_000,
            thresholds: Thresholds::default(),
        }
    }

    #[test]
    fn resume_backoff_is_30s_doubling_to_10min_and_resets_on_success() {
        let mut b = ResumeBackoff::default();
        assert!(b.due(0), "the first resume runs at once");
        let mut waits = Vec::new();
        let mut at = 1_000_000;
        for _ in 0..7 {
            b = b.failed(at);
            waits.push((b.retry_at_ms - at) / 1_000);
            assert!(!b.due(at), "not retried at the instant it failed");
            assert!(!b.due(b.retry_at_ms - 1));
            assert!(b.due(b.retry_at_ms));
            at = b.retry_at_ms;
        }
        assert_eq!(waits, vec![30, 60, 120, 240, 480, 600, 600]);
        assert_eq!(b.failures, 7);
        let b = b.succeeded();
        assert_eq!(b, ResumeBackoff::default());
        assert!(b.due(0));
        // A failure after the reset waits the first step again.
        assert_eq!(b.failed(5_000).retry_at_ms, 35_000);
    }

    #[test]
    fn a_resume_that_failed_at_publishing_waits_one_interval_doubling() {
        let mut b = ResumeBackoff::default();
        let mut waits = Vec::new();
        let mut at = 1_000_000;
        for _ in 0..7 {
            b = b.failed_publishing(at, Duration::from_secs(2));
            waits.push((b.retry_at_ms - at) / 1_000);
            at = b.retry_at_ms;
        }
        assert_eq!(waits, vec![2, 4, 8, 16, 32, 64, 128]);
        // Never longer than any other failed resume.
        let b = ResumeBackoff::default().failed_publishing(0, Duration::from_secs(3600));
        assert_eq!(b.retry_at_ms, 30_000);
        // A later failure of another kind goes on from the count.
        assert_eq!(b.failed(0).retry_at_ms, 60_000);
    }

    #[test]
    fn a_running_cooldown_carries_over_a_restart() {
        let mut saved = AzState::new(2);
        saved.phase = Phase::Cooldown { until: 120_000 };
        let s = restore_az_state(&cfg(), &saved, 100_000, 105_000, 2, 2);
        assert_eq!(s.phase, Phase::Cooldown { until: 120_000 });
        // Over by now: the core ends it at the next step.
        let s = restore_az_state(&cfg(), &saved, 100_000, 130_000, 2, 2);
        assert_eq!(s.phase, Phase::Cooldown { until: 120_000 });
        // Never longer than the configured cooldown from now (clock set back).
        let s = restore_az_state(&cfg(), &saved, 100_000, 10_000, 2, 2);
        assert_eq!(s.phase, Phase::Cooldown { until: 30_000 });
    }

    #[test]
    fn a_provisioning_backoff_carries_over_with_its_attempts() {
        let mut saved = AzState::new(1);
        saved.phase = Phase::ProvisionBackoff {
            retry_after: 160_000,
            attempt: 2,
        };
        let s = restore_az_state(&cfg(), &saved, 100_000, 110_000, 1, 1);
        assert_eq!(
            s.phase,
            Phase::ProvisionBackoff {
                retry_after: 160_000,
                attempt: 2
            }
        );
    }

    #[test]
    fn streaks_survive_only_when_no_sample_was_missed() {
        let mut saved = AzState::new(1);
        saved.phase = Phase::Evaluating {
            after: Some(100_000),
        };
        saved.out_streak = [1, 0, 0];
        saved.in_streak = 0;
        let s = restore_az_state(&cfg(), &saved, 100_000, 101_000, 1, 1);
        assert_eq!(s.out_streak, [1, 0, 0]);
        // Down for longer than an interval: the samples in between are missing.
        let s = restore_az_state(&cfg(), &saved, 100_000, 102_000, 1, 1);
        assert_eq!(s.out_streak, [0, 0, 0]);
        assert_eq!(
            s.phase,
            Phase::Evaluating {
                after: Some(100_000)
            }
        );
    }

    #[test]
    fn a_workflow_cut_short_is_left_to_the_resume_reconcile() {
        let mut saved = AzState::new(1);
        saved.provisioned = 2;
        saved.phase = Phase::Provisioning {
            requested_at: 100_000,
            attempt: 1,
        };
        // The reconcile finished the node: counts come from the store.
        let s = restore_az_state(&cfg(), &saved, 100_000, 104_000, 2, 2);
        assert_eq!(s.phase, Phase::Cooldown { until: 124_000 });
        assert_eq!((s.serving, s.provisioned), (2, 2));
        // The reconcile removed the half-made node: nothing was added, no cooldown.
        let s = restore_az_state(&cfg(), &saved, 100_000, 104_000, 1, 1);
        assert_eq!(
            s.phase,
            Phase::Evaluating {
                after: Some(104_000)
            }
        );

        let mut saved = AzState::new(1);
        saved.phase = Phase::Draining {
            since: 100_000,
            until: 102_000,
        };
        let s = restore_az_state(&cfg(), &saved, 100_000, 104_000, 1, 1);
        assert_eq!(
            s.phase,
            Phase::Evaluating {
                after: Some(104_000)
            }
        );
    }
}
