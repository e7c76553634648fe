//! What the daemon asks of the engine: its door to the store, and the
//! workflows it runs in one availability zone at a time (`Engine::scale_out`,
//! `Engine::scale_in_one`, under the AZ's lease).
//!
//! Who may act on a group is decided here, in [`Engine::daemon_turn`]: the
//! daemon's claim on the group (a lease with a fencing token: a second daemon
//! on the same store leaves the group alone), then the probe of the group's
//! own lease (an apply working on it). A daemon's workflow takes the lease of
//! its AZ only ([`az_lease_key`]), so that workflows in two AZs of one group
//! run at once; the store makes an AZ lease and the group's lease of another
//! holder exclude each other, so an apply never acts with the daemon on an AZ.

use crate::model::{DistributorSpec, GroupSpec, VserverSpec};
use crate::reconcile::{
    spans_of, stale_among, EngineError, GroupView, KeptLease, Result, SpanView,
};
use crate::store::{
    daemon_claim_key, GroupRows, Lease, NlbRows, NodeRow, PolicyStateRow, Row, StoreError,
};
use crate::Engine;
use lbscale_core::policy::{AzState, PolicyConfig};
use std::time::Duration;

/// Whether a daemon may act on a group now.
pub enum Turn {
    /// The daemon holds its claim (renewed while this is kept) and no apply
    /// holds the group.
    Ours(KeptLease),
    /// Another daemon evaluates the group.
    OtherDaemon { holder: String },
    /// An apply (or another process) holds the group's lease.
    Applying { holder: String },
}

/// Whether a daemon holds its claim on a group ([`Engine::daemon_claim`]).
pub enum Claim {
    /// It does (acquired or renewed now, for the TTL asked).
    Ours(Lease),
    /// Another daemon does.
    OtherDaemon { holder: String },
}

/// What one evaluation of the daemon reads of a group: the group's row with
/// its distributor, what the distributor serves, how many groups use it and
/// who holds the group's lease (one statement), its nodes (one more), its
/// vservers (one more) and, behind an `nlb`, its SE groups and spans (two
/// more), as [`Engine::group_snapshot`] read them.
pub struct GroupSnapshot {
    pub row: Row<GroupSpec>,
    pub version: i64,
    /// The group's destroy began and stopped half-way.
    pub deleting: bool,
    /// Who holds the group's own lease, other than this process (whose own
    /// workflows take it in the engine's name, as the daemon's resume does):
    /// an apply works on the group.
    pub applying: Option<String>,
    pub view: GroupView,
    pub rows: Vec<NodeRow>,
    vservers: Vec<Row<VserverSpec>>,
    config_version: u64,
    /// Read only behind an `nlb` distributor.
    nlb: Option<NlbRows>,
    distributor: Option<DistributorSpec>,
    /// What the distributor serves, as stored.
    served: Option<String>,
    /// The groups that use the distributor, this one included.
    distributor_groups: i64,
}

impl Engine {
    /// The group as one evaluation needs it (see [`GroupSnapshot`]); `None`
    /// when it is gone.
    pub async fn group_snapshot(&self, group_id: &str) -> Result<Option<GroupSnapshot>> {
        let Some(GroupRows {
            record: rec,
            nodes: rows,
            vservers,
            nlb,
        }) = self.store.group_rows(group_id).await?
        else {
            return Ok(None);
        };
        let view = self.view_of(rec.row.clone(), rows.clone()).await?;
        Ok(Some(GroupSnapshot {
            nlb,
            applying: rec.lease_holder.filter(|h| *h != self.holder),
            row: rec.row,
            version: rec.version,
            deleting: rec.deleting,
            config_version: rec.config_version,
            view,
            rows,
            vservers,
            distributor: rec.distributor,
            served: rec.served,
            distributor_groups: rec.distributor_groups,
        }))
    }

    /// [`Engine::stale_configurations`] of the snapshot's group, from what it
    /// read (nothing is read here).
    pub fn stale_configurations_in(&self, s: &GroupSnapshot) -> Vec<String> {
        stale_among(
            &s.row,
            s.config_version,
            s.nlb.as_ref(),
            &s.rows,
            s.vservers.clone(),
        )
    }

    /// Whether the group's distributor serves what the store says it must,
    /// told from the snapshot alone (no statement): `Some` for a `dns`
    /// distributor of this group only, the common case; `None` when the
    /// snapshot cannot tell (the distributor has other groups, or is an
    /// `nlb`, or is gone), and [`Engine::settle_publication`] must read it.
    pub fn publication_settled_in(&self, s: &GroupSnapshot) -> Result<Option<bool>> {
        let Some(distributor) = s.distributor.as_ref().filter(|_| s.distributor_groups == 1) else {
            return Ok(None);
        };
        Engine::dns_publication_settled(
            distributor,
            s.served.as_deref(),
            &s.row,
            &s.vservers,
            &s.rows,
        )
    }

    /// [`Engine::vserver_spans`] of the snapshot's group, from what it read
    /// (nothing is read here; empty behind `dns`: there is no span to size).
    pub fn vserver_spans_in(&self, s: &GroupSnapshot) -> Vec<SpanView> {
        match &s.nlb {
            Some(nlb) => spans_of(&s.row, &s.rows, &s.vservers, nlb),
            None => Vec::new(),
        }
    }

    /// Takes or renews `daemon`'s claim on the group for `ttl` (the lease
    /// [`daemon_claim_key`], with its fencing token). Unlike
    /// [`Engine::daemon_turn`], it neither probes the group's lease (the
    /// daemon reads that in [`Engine::group_snapshot`]) nor keeps renewing the
    /// claim: the daemon renews all its claims together
    /// ([`Engine::renew_daemon_claims`]).
    /// On PostgreSQL, awaited on the store connection's thread, as the
    /// snapshot is; on SQLite, as the blocking call.
    pub async fn daemon_claim(&self, group_id: &str, daemon: &str, ttl: Duration) -> Result<Claim> {
        match self
            .store
            .acquire_lease_async(&daemon_claim_key(group_id), daemon, ttl)
            .await
        {
            Ok(l) => Ok(Claim::Ours(l)),
            Err(StoreError::LeaseHeld { holder, .. }) => Ok(Claim::OtherDaemon { holder }),
            Err(e) => Err(e.into()),
        }
    }

    /// Renews `daemon`'s claims on `group_ids` for `ttl`, a few hundred per
    /// statement; returns the claims renewed (keyed [`daemon_claim_key`]). A
    /// group missing from the answer is no longer this daemon's (taken over,
    /// expired, released, or the group is gone).
    pub fn renew_daemon_claims(
        &self,
        daemon: &str,
        group_ids: &[String],
        ttl: Duration,
    ) -> Result<Vec<Lease>> {
        let keys: Vec<String> = group_ids.iter().map(|g| daemon_claim_key(g)).collect();
        Ok(self.store.renew_leases(daemon, &keys, ttl)?)
    }

    /// Every group's id and row version, oldest first: a version changes when
    /// the group's spec or its distributor's does.
    pub fn group_versions(&self) -> Result<Vec<(String, i64)>> {
        Ok(self.store.group_versions()?)
    }

    /// Every group, oldest first.
    pub fn all_groups(&self) -> Result<Vec<Row<GroupSpec>>> {
        Ok(self.store.all_groups()?)
    }

    /// The group named `name`, if there is one.
    pub fn group_named(&self, name: &str) -> Result<Option<Row<GroupSpec>>> {
        Ok(self.store.group_by_name(name)?)
    }

    /// The group with its row version.
    pub fn group_with_version(&self, id: &str) -> Result<Option<(Row<GroupSpec>, i64)>> {
        Ok(self.store.group_with_version(id)?)
    }

    /// The group's scaling policy, validated by core's rules (the same ones as
    /// `lbscale simulate`'s): `Ok(Err(why))` names the setting that does not
    /// pass them.
    pub fn group_policy(
        &self,
        spec: &GroupSpec,
    ) -> Result<std::result::Result<PolicyConfig, String>> {
        let distributor = self.store.distributor(&spec.traffic_distributor_id)?;
        Ok(lbscale_core::policy::validate_policy(
            &spec.policy_spec(distributor.as_ref().map(|d| &d.spec)),
        )
        .map(|(cfg, _)| cfg)
        .map_err(|errors| {
            errors
                .first()
                .map_or_else(|| "invalid policy".to_string(), |e| e.to_string())
        }))
    }

    /// Whether `daemon` may act on the group now (see the module's docs). Its
    /// claim lasts `ttl` past the last renewal: another daemon takes the group
    /// over that long after this one died.
    pub fn daemon_turn(&self, group_id: &str, daemon: &str, ttl: Duration) -> Result<Turn> {
        let claim = match self
            .store
            .acquire_lease(&daemon_claim_key(group_id), daemon, ttl)
        {
            Ok(l) => KeptLease::keep(self.store.clone(), l, ttl),
            Err(StoreError::LeaseHeld { holder, .. }) => return Ok(Turn::OtherDaemon { holder }),
            Err(e) => return Err(e.into()),
        };
        // This process's own workflows hold the group's lease in the engine's
        // name (the daemon's resume): not an apply.
        match self.store.lease_holder(group_id)? {
            Some(holder) if holder != self.holder => Ok(Turn::Applying { holder }),
            _ => Ok(Turn::Ours(claim)),
        }
    }

    /// Keeps renewing a claim that [`Engine::daemon_turn`] gave, while a
    /// workflow that outlives the evaluation runs.
    pub fn keep_claim(&self, claim: &Lease, ttl: Duration) -> KeptLease {
        KeptLease::keep(self.store.clone(), claim.clone(), ttl)
    }

    /// Gives up `daemon`'s claim on the group (shutdown, group gone).
    pub fn release_daemon_claim(&self, group_id: &str, daemon: &str) -> Result<()> {
        Ok(self
            .store
            .release_lease_of(&daemon_claim_key(group_id), daemon)?)
    }

    /// The group's nodes as stored (handles, registration), in creation order.
    pub fn node_rows(&self, group_id: &str) -> Result<Vec<NodeRow>> {
        Ok(self.store.nodes_of_group(group_id)?)
    }

    /// The group's node API token. Sensitive: never log or print it. A group
    /// without one (gone, or a row without its secret) is an error: an empty
    /// token is never used.
    pub fn group_token(&self, group_id: &str) -> Result<String> {
        self.store
            .group_token(group_id)?
            .filter(|t| !t.is_empty())
            .ok_or_else(|| EngineError::NotFound(format!("the node API token of group {group_id}")))
    }

    /// The AZs' persisted policy states.
    pub fn policy_states(&self, group_id: &str) -> Result<Vec<PolicyStateRow>> {
        Ok(self.store.policy_states(group_id)?)
    }

    /// Persists one AZ's policy state, fenced by the daemon's claim.
    pub async fn put_policy_state(
        &self,
        claim: &Lease,
        group_id: &str,
        az: &str,
        state: &AzState,
    ) -> Result<()> {
        Ok(self
            .store
            .put_policy_state(claim, group_id, az, state)
            .await?)
    }

    /// Records an event of the group (of one AZ with `az`), awaited on the
    /// store connection's thread on PostgreSQL (on SQLite, as the blocking
    /// call). A failure is logged, not returned: the event is lost, not the
    /// evaluation.
    pub async fn record_event(&self, group_id: &str, az: Option<&str>, kind: &str, reason: &str) {
        let recorded = self
            .store
            .record_event_async(group_id, az, kind, reason)
            .await;
        if let Err(e) = recorded {
            tracing::warn!(group = %group_id, kind, error = %e, "could not record an event");
        }
    }

    /// Where the store is (for logs).
    pub fn store_location(&self) -> &str {
        self.store.location()
    }

    /// Whether the store answers within `deadline` (the daemon's health).
    /// Blocks for at most about three times `deadline` (a free connection,
    /// opening one, the answer): call it off the async tasks.
    pub fn probe_store(&self, deadline: Duration) -> Result<()> {
        Ok(self.store.probe(deadline)?)
    }

    pub(crate) fn group_row(&self, group_id: &str) -> Result<Row<GroupSpec>> {
        self.store
            .group(group_id)?
            .ok_or_else(|| EngineError::NotFound(format!("autoscale group {group_id}")))
    }
}
