//! The daemon's claims on its groups, renewed together.
//!
//! A claim is a lease (`daemon/<group id>`, with a fencing token) that lasts
//! [`claim_ttl`] (five stats intervals, at least 10 s). An evaluation takes it
//! once; from then on one task renews every claim this daemon holds, a few
//! hundred per statement ([`lbscale_engine::Engine::renew_daemon_claims`]),
//! instead of one transaction per group per evaluation. An evaluation uses a
//! held claim while it is surely still this daemon's (renewed less than two
//! thirds of its TTL ago, by this host's monotonic clock); otherwise it takes
//! it again. Whatever the daemon believes, every write under a claim is
//! fenced in its own statement (the policy state, a span): a daemon that lost
//! a claim without noticing writes nothing under it.
//!
//! A claim is renewed only while its group is looked after: an evaluation of
//! it runs, or one took its turn with the claim within two thirds of its TTL.
//! Claims of a daemon whose evaluations stopped (a wedged loop, every
//! evaluation slot stuck) are left to expire, so other daemons take the
//! groups over, as when the daemon dies.

use crate::Shared;
use lbscale_engine::store::Lease;
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How often the renewal task looks for claims due.
const SWEEP_EVERY: Duration = Duration::from_secs(1);

/// How long this daemon's claim on a group lasts between renewals: another
/// daemon takes the group over this long after this one stopped renewing it.
pub(crate) fn claim_ttl(interval: Duration) -> Duration {
    (interval * 5).max(Duration::from_secs(10))
}

struct Held {
    lease: Lease,
    ttl: Duration,
    /// When the acquisition or the last successful renewal was sent: the
    /// claim is this daemon's until at least `renewed + ttl`.
    renewed: Instant,
    /// When an evaluation last took its turn with it.
    used: Instant,
}

impl Held {
    /// Renewed a third of its TTL ago or more.
    fn due(&self, now: Instant) -> bool {
        now >= self.renewed + self.ttl / 3
    }
    /// Used by an evaluation within two thirds of its TTL (more than three
    /// stats intervals: a daemon behind its schedule keeps its groups).
    fn looked_after(&self, now: Instant) -> bool {
        now < self.used + self.ttl * 2 / 3
    }
    /// Surely this daemon's for a while yet (a third of its TTL at least).
    fn usable(&self, now: Instant) -> bool {
        now < self.renewed + self.ttl * 2 / 3
    }
}

/// The claims this daemon holds, by group id.
#[derive(Default)]
pub(crate) struct Claims {
    held: Mutex<HashMap<String, Held>>,
    /// The groups whose evaluation runs now.
    evaluating: Mutex<HashSet<String>>,
}

/// Marks a group's evaluation as running while it lives.
pub(crate) struct Evaluating<'a> {
    claims: &'a Claims,
    group_id: String,
}

impl Drop for Evaluating<'_> {
    fn drop(&mut self) {
        self.claims.running().remove(&self.group_id);
    }
}

impl Claims {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Held>> {
        self.held.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn running(&self) -> std::sync::MutexGuard<'_, HashSet<String>> {
        self.evaluating.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The group's evaluation runs until the guard is dropped: its claim is
    /// renewed meanwhile, however long it takes (a resume that provisions).
    pub fn evaluating(&self, group_id: &str) -> Evaluating<'_> {
        self.running().insert(group_id.to_string());
        Evaluating {
            claims: self,
            group_id: group_id.to_string(),
        }
    }

    /// The group's claim if this daemon holds it for `ttl` and it is surely
    /// still its own; the evaluation that gets it takes its turn with it.
    pub fn usable(&self, group_id: &str, ttl: Duration) -> Option<Lease> {
        let now = Instant::now();
        self.lock()
            .get_mut(group_id)
            .filter(|h| h.ttl == ttl && h.usable(now))
            .map(|h| {
                h.used = now;
                h.lease.clone()
            })
    }

    /// Records a claim just taken (the request was sent at `sent`).
    pub fn insert(&self, group_id: &str, lease: Lease, ttl: Duration, sent: Instant) {
        self.lock().insert(
            group_id.to_string(),
            Held {
                lease,
                ttl,
                renewed: sent,
                used: sent,
            },
        );
    }

    /// Forgets the group's claim (released, lost, or the group is gone): it
    /// is renewed no more.
    pub fn remove(&self, group_id: &str) {
        self.lock().remove(group_id);
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.lock().len()
    }

    /// The claims due for renewal, grouped by TTL: those of groups looked
    /// after (see the module's docs).
    fn due(&self, now: Instant) -> HashMap<Duration, Vec<String>> {
        let running = self.running().clone();
        let mut out: HashMap<Duration, Vec<String>> = HashMap::new();
        for (id, h) in self.lock().iter() {
            if h.due(now) && (h.looked_after(now) || running.contains(id)) {
                out.entry(h.ttl).or_default().push(id.clone());
            }
        }
        out
    }

    /// After a renewal of `asked` (sent at `sent`): the claims renewed are
    /// this daemon's until `sent + ttl`; the others are lost and forgotten
    /// (unless taken again meanwhile). Returns the groups lost.
    fn renewed(&self, asked: &[String], renewed: &[Lease], sent: Instant) -> Vec<String> {
        let by_key: HashMap<&str, &Lease> =
            renewed.iter().map(|l| (l.group_id.as_str(), l)).collect();
        let mut held = self.lock();
        let mut lost = Vec::new();
        for id in asked {
            let Some(h) = held.get_mut(id) else { continue };
            // Taken again since the renewal was sent: that is newer.
            if h.renewed > sent {
                continue;
            }
            match by_key.get(h.lease.group_id.as_str()) {
                Some(l) if l.fence == h.lease.fence => {
                    h.renewed = sent;
                    h.lease.expires_ms = l.expires_ms;
                }
                _ => {
                    held.remove(id);
                    lost.push(id.clone());
                }
            }
        }
        lost
    }
}

/// Renews the daemon's claims as they fall due, until the process ends (or
/// the task is aborted). A renewal that fails (the store busy or unreachable)
/// is tried again at the next sweep; a claim that is not renewed in time
/// stops being usable, and its group's next evaluation takes it again.
pub(crate) async fn keep_renewed(shared: Arc<Shared>) {
    let mut sweep = tokio::time::interval(SWEEP_EVERY);
    sweep.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        sweep.tick().await;
        for (ttl, ids) in shared.claims.due(Instant::now()) {
            let sent = Instant::now();
            let s = shared.clone();
            let asked = ids.clone();
            let r = tokio::task::spawn_blocking(move || {
                s.engine.renew_daemon_claims(&s.holder, &asked, ttl)
            })
            .await;
            match r {
                Ok(Ok(renewed)) => {
                    for id in shared.claims.renewed(&ids, &renewed, sent) {
                        tracing::info!(group_id = %id, "this daemon's claim on the group was lost (taken over, expired or the group is gone); its next evaluation takes it again if it can");
                        shared.disown(&id);
                    }
                }
                Ok(Err(e)) => {
                    tracing::warn!(error = %e, claims = ids.len(), "cannot renew this daemon's claims; retrying")
                }
                Err(e) => tracing::error!(error = %e, "the claims' renewal panicked"),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lease(id: &str, fence: i64) -> Lease {
        Lease {
            group_id: format!("daemon/{id}"),
            holder: "d".into(),
            fence,
            expires_ms: 0,
        }
    }

    #[test]
    fn a_claim_is_due_after_a_third_of_its_ttl_and_usable_for_two_thirds() {
        let c = Claims::default();
        let ttl = Duration::from_secs(30);
        let t0 = Instant::now();
        c.insert("g", lease("g", 1), ttl, t0);
        assert!(c.due(t0 + Duration::from_secs(9)).is_empty());
        assert_eq!(
            c.due(t0 + Duration::from_secs(10)).get(&ttl),
            Some(&vec!["g".to_string()])
        );
        assert!(c.lock()["g"].usable(t0 + Duration::from_secs(19)));
        assert!(!c.lock()["g"].usable(t0 + Duration::from_secs(20)));
        // Another TTL (the group's interval changed): taken again.
        assert!(c.usable("g", Duration::from_secs(60)).is_none());
    }

    #[test]
    fn a_claim_is_renewed_while_its_group_is_looked_after_only() {
        let c = Claims::default();
        let ttl = Duration::from_secs(30);
        let t0 = Instant::now();
        for id in ["idle", "used", "long"] {
            c.insert(id, lease(id, 1), ttl, t0);
        }
        let all = |t: Instant| {
            let mut v = c.due(t).remove(&ttl).unwrap_or_default();
            v.sort();
            v
        };
        assert_eq!(all(t0 + Duration::from_secs(10)), ["idle", "long", "used"]);
        // "used": an evaluation took its turn with it at 14 s; "long": its
        // evaluation has run since before and still runs; "idle": neither.
        c.lock().get_mut("used").unwrap().used = t0 + Duration::from_secs(14);
        let running = c.evaluating("long");
        assert_eq!(all(t0 + Duration::from_secs(21)), ["long", "used"]);
        drop(running);
        assert_eq!(all(t0 + Duration::from_secs(21)), ["used"]);
        // Two thirds of a TTL after its last use, "used" is renewed no more.
        assert!(all(t0 + Duration::from_secs(35)).is_empty());
        // An evaluation that takes its turn with it marks it used again.
        let before = c.lock()["idle"].used;
        std::thread::sleep(Duration::from_millis(2));
        assert!(c.usable("idle", ttl).is_some());
        assert!(c.lock()["idle"].used > before);
    }

    #[test]
    fn a_claim_missing_from_a_renewal_or_with_another_fence_is_lost() {
        let c = Claims::default();
        let ttl = Duration::from_secs(30);
        let t0 = Instant::now();
        for (id, fence) in [("a", 1), ("b", 1), ("c", 1)] {
            c.insert(id, lease(id, fence), ttl, t0);
        }
        let sent = t0 + Duration::from_secs(10);
        let asked: Vec<String> = ["a", "b", "c"].iter().map(|s| s.to_string()).collect();
        // a renewed; b renewed under another fence (not ours any more); c not.
        let lost = c.renewed(&asked, &[lease("a", 1), lease("b", 2)], sent);
        assert_eq!(lost, vec!["b".to_string(), "c".to_string()]);
        assert_eq!(c.len(), 1);
        assert_eq!(c.lock()["a"].renewed, sent);
    }
}
