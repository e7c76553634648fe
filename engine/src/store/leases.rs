//! Leases: who may act on a group (an apply, a daemon's claim, an AZ's
//! workflow) or publish a distributor, fenced and timed by the database's clock.

use super::*;

/// A held lease: act on the group only while it is valid, and pass `fence` with
/// every side effect so that a stale holder can be told apart.
#[derive(Debug, Clone, PartialEq)]
pub struct Lease {
    pub group_id: String,
    pub holder: String,
    pub fence: i64,
    pub expires_ms: i64,
}

/// The lease by which a daemon claims a group for its evaluations (kept in the
/// `leases` table next to the group's own lease, which workflows take).
pub fn daemon_claim_key(group_id: &str) -> String {
    format!("daemon/{group_id}")
}

/// The lease by which a daemon announces itself on the store (see
/// [`Store::announce_daemon`]).
pub fn daemon_member_key(holder: &str) -> String {
    format!("daemons/{holder}")
}

/// The lease of one AZ of a group, which a daemon's workflow in that AZ takes so
/// that the group's other AZs scale meanwhile. It excludes the group's own
/// lease (an apply) held by another holder, and the other way round (see
/// [`Store::acquire_lease`]).
pub fn az_lease_key(group_id: &str, az: &str) -> String {
    format!("{group_id}/az/{az}")
}

/// The group an AZ lease belongs to, if `key` is one.
fn group_of_az_lease(key: &str) -> Option<&str> {
    let (group, rest) = key.split_once('/')?;
    (rest.starts_with("az/") && !group.is_empty()).then_some(group)
}

/// The group whose lease, AZ lease or daemon claim `key` is; None for the
/// leases of other things (a distributor's).
fn group_of_lease(key: &str) -> Option<&str> {
    if is_group_lease(key) {
        return Some(key);
    }
    key.strip_prefix("daemon/")
        .or_else(|| group_of_az_lease(key))
}

/// Whether `key` is a group's own lease (the one an apply takes): a group id,
/// which holds no `/`, unlike claims, AZ and distributor leases.
fn is_group_lease(key: &str) -> bool {
    !key.contains('/')
}

/// The lease under which one process at a time publishes a distributor's
/// configuration (the daemon and a Terraform apply may both be changing it).
pub fn distributor_lease_key(distributor_id: &str) -> String {
    format!("distributor/{distributor_id}")
}

impl Store {
    /// After a fenced write of `written` rows: Ok if it wrote, or if the lease
    /// is still live (the row was simply not there); else why it was refused.
    pub(super) fn fenced(&self, lease: &Lease, written: u64, what: &str) -> Result<()> {
        if written > 0 {
            return Ok(());
        }
        self.check_lease(lease).map_err(|e| match e {
            StoreError::LeaseLost { group, detail } => StoreError::LeaseLost {
                group,
                detail: format!("{what}: {detail}"),
            },
            other => other,
        })
    }

    // --- leases -----------------------------------------------------------------
    //
    // Every lease time is the database's clock (`NOW_MS` in the statement), never
    // the caller's: hosts whose clocks disagree still agree on who holds a lease.

    /// Takes the group's lease for `ttl` if it is free, expired, or already ours.
    /// A new holder gets a higher fencing token than every holder before it.
    /// A group's lease and the leases of its AZs ([`az_lease_key`]) exclude each
    /// other across holders: an apply never acts together with a daemon's
    /// workflow in one of the group's AZs, while workflows in two AZs may.
    pub fn acquire_lease(&self, group_id: &str, holder: &str, ttl: Duration) -> Result<Lease> {
        self.tx(|tx| lease_taken_in(tx, group_id, holder, ttl))
    }

    /// As [`Store::acquire_lease`], for a caller on an async runtime (see
    /// [`Store::tx_async`]): a daemon claims its groups so, thousands at its
    /// start or a takeover, without a worker thread blocked per claim.
    pub async fn acquire_lease_async(
        &self,
        group_id: &str,
        holder: &str,
        ttl: Duration,
    ) -> Result<Lease> {
        let (group_id, holder) = (group_id.to_string(), holder.to_string());
        self.tx_async(move |tx| lease_taken_in(tx, &group_id, &holder, ttl))
            .await
    }

    /// Announces daemon `holder` on the store for `ttl` (a lease
    /// `daemons/<holder>`, renewed by calling this again) and returns how many
    /// daemons are announced now, itself included: daemons that share a store
    /// each claim about their share of its groups. Rows of daemons that
    /// stopped announcing long ago are deleted.
    pub fn announce_daemon(&self, holder: &str, ttl: Duration) -> Result<i64> {
        self.acquire_lease(&daemon_member_key(holder), holder, ttl)?;
        self.with(|c| {
            c.execute(
                &format!(
                    "DELETE FROM leases WHERE group_id LIKE 'daemons/%' AND expires_ms < {NOW_MS} - 600000"
                ),
                &[],
            )?;
            c.int(
                &format!(
                    "SELECT count(*) FROM leases WHERE group_id LIKE 'daemons/%' AND expires_ms > {NOW_MS}"
                ),
                &[],
            )
        })
    }

    /// Takes daemon `holder` off the store (its shutdown): the others count
    /// one daemon fewer at once.
    pub fn withdraw_daemon(&self, holder: &str) -> Result<()> {
        self.with_leases(|c| {
            c.execute(
                "DELETE FROM leases WHERE group_id = ?1 AND holder = ?2",
                vals![daemon_member_key(holder), holder],
            )
        })?;
        Ok(())
    }

    /// Who holds the lease `key` now (unexpired), if anyone. A read: the
    /// daemon's probe of whether an apply works on a group writes nothing.
    pub fn lease_holder(&self, key: &str) -> Result<Option<String>> {
        Ok(self.with(|c| live_lease(c, key))?.map(|(h, _)| h))
    }

    /// Gives up whatever lease `holder` has on `key`, without knowing its fence;
    /// unlike acquiring it to learn the fence, this never creates a row (a group
    /// that is gone keeps no lease).
    pub fn release_lease_of(&self, key: &str, holder: &str) -> Result<()> {
        self.with_leases(|c| {
            c.execute(
                "UPDATE leases SET expires_ms = 0 WHERE group_id = ?1 AND holder = ?2",
                vals![key, holder],
            )
        })?;
        Ok(())
    }

    /// Gives the lease up at once (only if still ours).
    pub fn release_lease(&self, lease: &Lease) -> Result<()> {
        self.with_leases(|c| {
            c.execute(
                "UPDATE leases SET expires_ms = 0 WHERE group_id = ?1 AND holder = ?2 AND fence = ?3",
                vals![&lease.group_id, &lease.holder, lease.fence],
            )
        })?;
        Ok(())
    }

    /// Extends a lease that is still ours (same holder and fence, unexpired) to
    /// `ttl` from now; [`StoreError::LeaseLost`] when another holder took it
    /// over, it was released, or it expired (then another holder may have taken
    /// a lease that excludes it: the work it covered must stop). One statement,
    /// on the connections kept for leases.
    pub fn renew_lease(&self, lease: &Lease, ttl: Duration) -> Result<Lease> {
        let renewed = self.with_leases(|c| {
            c.one(
                &format!(
                    "UPDATE leases SET expires_ms = {NOW_MS} + ?4
                     WHERE group_id = ?1 AND holder = ?2 AND fence = ?3 AND expires_ms > {NOW_MS}
                     RETURNING expires_ms"
                ),
                vals![
                    &lease.group_id,
                    &lease.holder,
                    lease.fence,
                    ttl.as_millis() as i64
                ],
            )
        })?;
        match renewed {
            Some(r) => Ok(Lease {
                expires_ms: r.int(0)?,
                ..lease.clone()
            }),
            None => Err(StoreError::LeaseLost {
                group: lease.group_id.clone(),
                detail: format!(
                    "{} no longer holds it (fence {}), or it expired",
                    lease.holder, lease.fence
                ),
            }),
        }
    }

    /// Extends every lease of `keys` that `holder` still holds unexpired to
    /// `ttl` from now, [`RENEW_BATCH`] keys per statement (a daemon renews all
    /// its claims in a few statements, not one per group); returns the leases
    /// renewed. A key missing from the answer is lost (taken over, released,
    /// expired or deleted): the caller must stop acting under it. On the
    /// connections kept for leases.
    pub fn renew_leases(&self, holder: &str, keys: &[String], ttl: Duration) -> Result<Vec<Lease>> {
        static SQL: std::sync::OnceLock<String> = std::sync::OnceLock::new();
        let sql = SQL.get_or_init(|| {
            let list: Vec<String> = (3..RENEW_BATCH + 3).map(|i| format!("?{i}")).collect();
            format!(
                "UPDATE leases SET expires_ms = {NOW_MS} + ?2
                 WHERE holder = ?1 AND expires_ms > {NOW_MS} AND group_id IN ({})
                 RETURNING group_id, fence, expires_ms",
                list.join(", ")
            )
        });
        let mut out = Vec::with_capacity(keys.len());
        for chunk in keys.chunks(RENEW_BATCH) {
            // Always RENEW_BATCH parameters (NULL matches no key): one
            // statement text, prepared once per connection.
            let mut params = vec![Value::from(holder), Value::Int(ttl.as_millis() as i64)];
            params.extend(chunk.iter().map(Value::from));
            params.resize(RENEW_BATCH + 2, Value::Null);
            let rows = self.with_leases(|c| c.query(sql, &params))?;
            for r in rows {
                out.push(Lease {
                    group_id: r.text(0)?,
                    holder: holder.to_string(),
                    fence: r.int(1)?,
                    expires_ms: r.int(2)?,
                });
            }
        }
        Ok(out)
    }

    /// Whether `lease` is the key's current, unexpired lease (by the database's
    /// clock). A read, for a holder that wants to know before a step; a write
    /// under a lease is fenced in its own statement instead.
    pub fn check_lease(&self, lease: &Lease) -> Result<()> {
        let cur = self.with_leases(|c| {
            c.one(
                &format!(
                    "SELECT holder, fence, CASE WHEN expires_ms > {NOW_MS} THEN 1 ELSE 0 END
                     FROM leases WHERE group_id = ?1"
                ),
                vals![&lease.group_id],
            )?
            .map(|r| Ok((r.text(0)?, r.int(1)?, r.int(2)? != 0)))
            .transpose()
        })?;
        let lost = |detail: String| {
            Err(StoreError::LeaseLost {
                group: lease.group_id.clone(),
                detail,
            })
        };
        match cur {
            None => lost("the lease is gone".into()),
            Some((h, f, _)) if h != lease.holder || f != lease.fence => lost(format!(
                "{h} holds it now (fence {f}, ours was {})",
                lease.fence
            )),
            Some((_, _, false)) => lost("it expired".into()),
            Some(_) => Ok(()),
        }
    }
}

/// [`Store::acquire_lease`]'s transaction, in `tx`.
fn lease_taken_in(tx: &mut dyn Db, group_id: &str, holder: &str, ttl: Duration) -> Result<Lease> {
    let ttl_ms = ttl.as_millis() as i64;
    let held = |holder: String, expires_in_ms: i64| StoreError::LeaseHeld {
        group: group_id.into(),
        holder,
        expires_in_ms,
    };
    // A lease of a group that is gone (destroyed between a workflow
    // reading the group and taking its lease, or a daemon listing the
    // groups and claiming one) is refused and leaves no row.
    if let Some(group) = group_of_lease(group_id) {
        if tx
            .one("SELECT 1 FROM groups WHERE id = ?1", vals![group])?
            .is_none()
        {
            return Err(StoreError::GroupGone(group.to_string()));
        }
    }
    if let Some((h, left)) = conflicting_lease(tx, group_id, holder)? {
        return Err(held(h, left));
    }
    // Taken in the statement itself, where the row is free, expired by
    // the database's clock, or already this holder's.
    let won = tx.one(
        &format!(
            "INSERT INTO leases (group_id, holder, fence, expires_ms) VALUES (?1, ?2, 1, {NOW_MS} + ?3)
             ON CONFLICT (group_id) DO UPDATE SET holder = excluded.holder,
               fence = CASE WHEN leases.holder = excluded.holder THEN leases.fence ELSE leases.fence + 1 END,
               expires_ms = excluded.expires_ms
             WHERE leases.holder = excluded.holder OR leases.expires_ms <= {NOW_MS}
             RETURNING fence, expires_ms"
        ),
        vals![group_id, holder, ttl_ms],
    )?;
    match won {
        Some(r) => Ok(Lease {
            group_id: group_id.into(),
            holder: holder.into(),
            fence: r.int(0)?,
            expires_ms: r.int(1)?,
        }),
        None => {
            let (h, left) = live_lease(tx, group_id)?.unwrap_or_default();
            Err(held(h, left))
        }
    }
}

/// The condition that fences a write: the lease whose key, holder and fence
/// are the parameters `?first`, `?first+1`, `?first+2` is current and unexpired
/// by the database's clock.
pub(super) fn fence_clause(first: usize) -> String {
    format!(
        "EXISTS (SELECT 1 FROM leases WHERE group_id = ?{first} AND holder = ?{} \
         AND fence = CAST(?{} AS BIGINT) AND expires_ms > {NOW_MS})",
        first + 1,
        first + 2
    )
}

/// The holder of `key` and how long its lease has left (database clock), if
/// it is unexpired.
pub(super) fn live_lease(c: &mut dyn Db, key: &str) -> Result<Option<(String, i64)>> {
    c.one(
        &format!(
            "SELECT holder, expires_ms - {NOW_MS} FROM leases
             WHERE group_id = ?1 AND expires_ms > {NOW_MS}"
        ),
        vals![key],
    )?
    .map(|r| Ok((r.text(0)?, r.int(1)?)))
    .transpose()
}

/// A live lease of another holder that `key` may not be taken alongside: for an
/// AZ lease, its group's own lease; for a group's lease, any of its AZ leases.
/// Its holder and how long it has left.
fn conflicting_lease(c: &mut dyn Db, key: &str, holder: &str) -> Result<Option<(String, i64)>> {
    let live = format!("holder != ?2 AND expires_ms > {NOW_MS}");
    let rows = if let Some(group) = group_of_az_lease(key) {
        c.query(
            &format!(
                "SELECT holder, expires_ms - {NOW_MS} FROM leases WHERE group_id = ?1 AND {live}"
            ),
            vals![group, holder],
        )?
    } else if is_group_lease(key) {
        c.query(
            &format!("SELECT holder, expires_ms - {NOW_MS} FROM leases WHERE group_id LIKE ?1 AND {live}"),
            vals![az_lease_key(key, "%"), holder],
        )?
    } else {
        return Ok(None);
    };
    rows.first()
        .map(|r| Ok((r.text(0)?, r.int(1)?)))
        .transpose()
}
