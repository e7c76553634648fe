//! Leases: who may act on a group or a distributor now, kept alive while the
//! work runs; and the wait of a destroy for the objects that still use it.

use super::{Engine, EngineError, Result};
use crate::store::{Lease, Store, StoreError};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long a workflow's lease lasts without renewal: a crashed holder's group
/// is free again this long after it died. A running workflow renews it every
/// third of this (see [`KeptLease`]), however long the workflow takes.
pub const WORKFLOW_LEASE_TTL: Duration = Duration::from_secs(10);

/// A lease kept alive by a background task (renewed every third of its TTL) while
/// the work it covers runs. A renewal that finds the lease taken over marks it
/// lost; so does a TTL without a successful renewal (the store unreachable or
/// stalled: the lease may have expired, and another holder may have it). Then
/// [`KeptLease::check`], called before every side effect, stops the work, at
/// once and without asking the store. Dropping it stops the renewals (the lease
/// then expires on its own).
pub struct KeptLease {
    lease: Lease,
    store: Arc<Store>,
    lost: Arc<AtomicBool>,
    /// Until when the lease is surely ours: the TTL from the moment the last
    /// successful renewal (or the acquisition) was sent, by this host's
    /// monotonic clock; the database set its expiry later than that.
    sure_until: Arc<std::sync::Mutex<Instant>>,
    renewer: tokio::task::JoinHandle<()>,
    /// This process's turn on the group (see `Engine::group_locks`), released
    /// with the lease.
    _turn: Option<tokio::sync::OwnedMutexGuard<()>>,
}

impl KeptLease {
    /// Starts renewing `lease` (just acquired with `ttl`) every `ttl / 3`.
    /// Starts renewing `lease` (just acquired with `ttl`) every `ttl / 3`. The
    /// lease counts as sure for `ttl` from now, less the time since it was
    /// acquired is unknown here: callers keep it at once.
    pub fn keep(store: Arc<Store>, lease: Lease, ttl: Duration) -> KeptLease {
        let lost = Arc::new(AtomicBool::new(false));
        let sure_until = Arc::new(std::sync::Mutex::new(Instant::now() + ttl));
        let renewer = {
            let (store, lease, lost, sure) = (
                store.clone(),
                lease.clone(),
                lost.clone(),
                sure_until.clone(),
            );
            tokio::spawn(async move {
                let every = (ttl / 3).max(Duration::from_millis(100));
                loop {
                    tokio::time::sleep(every).await;
                    let sent = Instant::now();
                    let (store2, lease2) = (store.clone(), lease.clone());
                    // On a thread of its own: a stalled store holds up this
                    // renewal only, and the TTL below still runs out.
                    // [`KeptLease::check`] sees the TTL run out meanwhile (every
                    // store call has a deadline, so this one ends too).
                    let outcome =
                        tokio::task::spawn_blocking(move || store2.renew_lease(&lease2, ttl))
                            .await
                            .ok();
                    match outcome {
                        Some(Ok(_)) => {
                            *sure.lock().unwrap_or_else(|e| e.into_inner()) = sent + ttl;
                        }
                        Some(Err(e @ StoreError::LeaseLost { .. })) => {
                            tracing::warn!(group = %lease.group_id, error = %e, "lease lost; the work it covers stops before its next step");
                            lost.store(true, Ordering::SeqCst);
                            return;
                        }
                        // A busy or unreachable store: try again at the next
                        // period, while the lease is still surely ours.
                        other => {
                            let why = match other {
                                Some(Err(e)) => e.to_string(),
                                _ => "the renewal panicked".to_string(),
                            };
                            if Instant::now() >= *sure.lock().unwrap_or_else(|e| e.into_inner()) {
                                tracing::warn!(group = %lease.group_id, error = %why, "the lease could not be renewed within its TTL; the work it covers stops before its next step");
                                lost.store(true, Ordering::SeqCst);
                                return;
                            }
                            tracing::warn!(group = %lease.group_id, error = %why, "could not renew the lease; retrying")
                        }
                    }
                }
            })
        };
        KeptLease {
            lease,
            store,
            lost,
            sure_until,
            renewer,
            _turn: None,
        }
    }

    /// Whether the lease was lost, or its TTL ran out without a renewal
    /// (asks nothing of the store).
    pub fn is_lost(&self) -> bool {
        self.lost.load(Ordering::SeqCst)
            || Instant::now() >= *self.sure_until.lock().unwrap_or_else(|e| e.into_inner())
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
                detail: "a renewal found it taken over, or none succeeded within its TTL".into(),
            });
        }
        if self.is_lost() {
            return Err(StoreError::LeaseLost {
                group: self.lease.group_id.clone(),
                detail: "no renewal succeeded within its TTL (the store is unreachable or stalled)"
                    .into(),
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
pub(super) async fn wait_unused(
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

impl Engine {
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
                // The group went while this waited for its turn: nothing to do
                // for it, and no lease row is left behind.
                Err(StoreError::GroupGone(group)) => {
                    return Err(EngineError::NotFound(format!("autoscale group {group}")))
                }
                Err(e) => return Err(e.into()),
            }
        }
    }
}
