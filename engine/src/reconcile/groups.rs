//! Autoscale groups: declare, update, delete and view them, and reconcile one
//! to its declared shape (the core decides, the engine carries it out).

use super::leases::{wait_unused, KeptLease};
use super::{new_id, new_token, Engine, EngineError, Result};
use crate::cloud::Cloud;
use crate::model::{Finding, Findings, GroupSpec, PathStep};
use crate::store::{az_lease_key, NodeRow, NodeState, Row};
use lbscale_core::apply;
use std::collections::BTreeSet;
use std::time::{Duration, Instant};

/// One node as Terraform and the CLI show it: its stored row with the state that
/// is observed now (a node whose process died shows as `failed`).
#[derive(Debug, Clone, PartialEq)]
pub struct NodeView {
    pub id: String,
    pub availability_zone: String,
    pub private_ip: String,
    pub public_ip: Option<String>,
    pub state: String,
    pub serving: bool,
}

#[derive(Debug, Clone)]
pub struct GroupView {
    pub id: String,
    pub spec: GroupSpec,
    pub nodes: Vec<NodeView>,
}

impl GroupView {
    /// Nodes serving now: active, registered with the distributor, and alive.
    pub fn node_count(&self) -> i64 {
        self.nodes.iter().filter(|n| n.serving).count() as i64
    }
    /// `ok` when every AZ has at least `min_nodes` serving, else what is missing.
    pub fn status(&self) -> String {
        let short: Vec<String> = self
            .spec
            .availability_zones
            .iter()
            .filter_map(|az| {
                let n = self
                    .nodes
                    .iter()
                    .filter(|n| n.serving && &n.availability_zone == az)
                    .count() as i64;
                (n < self.spec.min_nodes)
                    .then(|| format!("{az}: {n}/{} serving", self.spec.min_nodes))
            })
            .collect();
        if short.is_empty() {
            "ok".into()
        } else {
            format!("degraded ({})", short.join(", "))
        }
    }
}

impl Engine {
    /// Rules that need the store: the distributor exists and is on the same cloud.
    pub fn check_group(&self, spec: &GroupSpec) -> Result<Findings> {
        let mut f = Findings::default();
        match self.store.distributor(&spec.traffic_distributor_id)? {
            None => f.0.push(Finding::error(
                vec![PathStep::Attr("traffic_distributor_id")],
                "Unknown traffic distributor",
                format!(
                    "no traffic distributor has id {:?}.",
                    spec.traffic_distributor_id
                ),
            )),
            Some(d) if d.spec.cloud != spec.cloud => f.0.push(Finding::error(
                vec![PathStep::Attr("cloud")],
                "Cloud mismatch",
                format!(
                    "cloud must equal the traffic distributor's cloud (\"{}\"), got \"{}\".",
                    d.spec.cloud, spec.cloud
                ),
            )),
            Some(_) => {}
        }
        Ok(f)
    }

    /// Declares the group in the store (after the store-backed checks) and
    /// returns its id; [`Engine::reconcile_group`] then brings it up. Two steps,
    /// so that a group whose bring-up fails is still known (and can be retried
    /// or destroyed) rather than orphaned. One with the same name and settings
    /// already in the store, and not being destroyed (an apply that stopped
    /// after recording it, before Terraform saved it), is adopted: its id is
    /// returned and the reconcile finishes it.
    pub fn declare_group(&self, spec: &GroupSpec) -> Result<String> {
        Self::reject(self.check_group(spec)?)?;
        self.cloud(spec.cloud)?;
        if let Some(existing) = self.store.group_by_name(&spec.name)? {
            if existing.spec == *spec && !self.store.group_deleting(&existing.id)? {
                self.store.record_event(
                    &existing.id,
                    None,
                    "group_adopted",
                    "declared again with the same settings by terraform apply",
                )?;
                return Ok(existing.id);
            }
        }
        let id = new_id("asg");
        self.store.insert_group(&id, spec, &new_token())?;
        self.store
            .record_event(&id, None, "group_created", "declared by terraform apply")?;
        Ok(id)
    }

    pub async fn update_group(&self, id: &str, spec: &GroupSpec) -> Result<()> {
        Self::reject(self.check_group(spec)?)?;
        let old = self
            .store
            .group(id)?
            .ok_or_else(|| EngineError::NotFound(format!("autoscale group {id}")))?;
        self.store.update_group(id, spec)?;
        self.reconcile_group(id).await?;
        if old.spec.traffic_distributor_id != spec.traffic_distributor_id {
            self.publish(&old.spec.traffic_distributor_id).await?;
        }
        Ok(())
    }

    pub async fn delete_group(&self, id: &str) -> Result<()> {
        let Some(group) = self.store.group(id)? else {
            return Ok(());
        };
        let name = &group.spec.name;
        wait_unused(format!("autoscale group {name:?}"), "SE group", || {
            Ok(self
                .store
                .se_groups_of_group(id)?
                .into_iter()
                .map(|s| s.spec.name)
                .collect())
        })
        .await?;
        // Destroy may take the TTL plus a full drain: bound it by those, not apply_timeout.
        let budget =
            group.spec.drain_timeout() + self.ttl_of(&group.spec)? + Duration::from_secs(60);
        // Another destroy (the daemon finishing this one) may have deleted it
        // meanwhile: then its lease is refused, or it is gone under the lease.
        let lease = match self.lease(id, Instant::now() + budget).await {
            Err(EngineError::NotFound(_)) => return Ok(()),
            other => other?,
        };
        let Some(group) = self.store.group(id)? else {
            lease.release();
            return Ok(());
        };
        // From here on the group is on its way out: a destroy that stops (its
        // process killed mid-drain) is finished by the next destroy or by the
        // daemon, never undone by a resume (docs/design.md, section 3).
        self.store.mark_group_deleting(id)?;
        // Every AZ's lease too, so that a daemon's workflow in an AZ (a
        // scale-out waiting for its turn, say) ends before the nodes go, and
        // finds the group gone when it re-reads it (docs/design.md, section 4).
        let mut azs: BTreeSet<String> = group.spec.availability_zones.iter().cloned().collect();
        azs.extend(self.store.nodes_of_group(id)?.into_iter().map(|n| n.az));
        let mut az_leases = Vec::new();
        for az in &azs {
            match self
                .lease(&az_lease_key(id, az), Instant::now() + budget)
                .await
            {
                Ok(l) => az_leases.push(l),
                Err(e) => {
                    az_leases.into_iter().for_each(KeptLease::release);
                    lease.release();
                    return Err(e);
                }
            }
        }
        let deadline = Instant::now() + budget;
        let nodes = self.store.nodes_of_group(id)?;
        let out = async {
            self.scale_in(&group, nodes, deadline, "group destroyed", &lease)
                .await?;
            lease.check()?;
            // The nodes are gone: what the cloud made for the group goes too.
            self.cloud(group.spec.cloud)?
                .release_group(id)
                .await
                .map_err(|e| EngineError::Step {
                    step: "delete the group's cloud resources",
                    detail: e.to_string(),
                })?;
            // Deleted while the leases are held: nothing acts on it in between.
            self.store.delete_group(id)?;
            self.forget_node_credentials(id);
            self.store.release_addresses(id)?;
            Ok(())
        }
        .await;
        az_leases.into_iter().for_each(KeptLease::release);
        lease.release();
        out
    }

    /// The group and its nodes as they are now. A node whose liveness the
    /// cloud could not tell is shown as the store has it.
    pub async fn group_view(&self, id: &str) -> Result<Option<GroupView>> {
        let Some(row) = self.store.group(id)? else {
            return Ok(None);
        };
        let rows = self.store.nodes_of_group(id)?;
        self.view_of(row, rows).await.map(Some)
    }

    /// The view of group `row` whose stored nodes are `rows`: the state each
    /// node is observed in (its driver says whether its process still runs).
    pub(crate) async fn view_of(
        &self,
        row: Row<GroupSpec>,
        rows: Vec<NodeRow>,
    ) -> Result<GroupView> {
        let cloud = self.cloud(row.spec.cloud)?;
        let alive = cloud
            .alive(&rows)
            .await
            .unwrap_or_else(|_| vec![true; rows.len()]);
        let mut nodes = Vec::new();
        for (n, alive) in rows.into_iter().zip(alive) {
            nodes.push({
                let state = if n.state.is_member() && n.state != NodeState::Provisioning && !alive {
                    NodeState::Failed
                } else {
                    n.state
                };
                NodeView {
                    serving: alive && n.registered && state == NodeState::Active,
                    id: n.id,
                    availability_zone: n.az,
                    private_ip: n.private_ip,
                    public_ip: n.public_ip,
                    state: state.as_str().to_string(),
                }
            });
        }
        Ok(GroupView {
            id: row.id,
            spec: row.spec,
            nodes,
        })
    }

    pub(crate) fn ttl_of(&self, spec: &GroupSpec) -> Result<Duration> {
        let d = self.store.distributor(&spec.traffic_distributor_id)?;
        Ok(d.map_or(Duration::ZERO, |d| d.spec.answer_ttl()))
    }

    /// Brings the group to its declared shape, bounded by `apply_timeout`:
    /// failed nodes replaced, every AZ between `min_nodes` and `max_nodes`, every
    /// node running the group's vservers, every active node registered with the
    /// distributor, removed AZs and extra nodes drained and removed. A count that
    /// the daemon set inside the bounds is left as it is.
    pub async fn reconcile_group(&self, id: &str) -> Result<()> {
        let group = self
            .store
            .group(id)?
            .ok_or_else(|| EngineError::NotFound(format!("autoscale group {id}")))?;
        self.refuse_if_deleting(&group)?;
        let started = Instant::now();
        let deadline = started + group.spec.apply_timeout();
        let lease = self.lease(id, deadline).await?;
        let out = self.reconcile_locked(&group, deadline, &lease).await;
        lease.release();
        out.map_err(|e| match e {
            EngineError::Timeout { step, detail, .. } => EngineError::Timeout {
                step,
                after_s: started.elapsed().as_secs(),
                detail,
            },
            other => other,
        })
    }

    pub(super) async fn reconcile_locked(
        &self,
        group: &Row<GroupSpec>,
        deadline: Instant,
        lease: &KeptLease,
    ) -> Result<()> {
        let (id, spec) = (&group.id, &group.spec);
        let cloud = self.cloud(spec.cloud)?;
        let token = self.group_token(id)?;

        // 1. Observe, then let the core decide (docs/design.md, "Apply").
        let rows = self.store.nodes_of_group(id)?;
        let alive = cloud.alive(&rows).await?;
        let shape = apply::Shape {
            availability_zones: spec.availability_zones.clone(),
            min_nodes: spec.min_nodes.max(0) as u32,
            max_nodes: spec.max_nodes.max(0) as u32,
        };
        let plan = apply::plan(&shape, &observed(&rows, &alive));

        // 2. Failed nodes: nothing to drain, removed at once.
        self.remove_failed(cloud, group, &rows, &plan.remove_failed, lease)
            .await?;
        // (Registrations made in step 4 are published at its end.)
        let leaving: Vec<NodeRow> = plan
            .leave
            .iter()
            .filter_map(|(leaver, _)| rows.iter().find(|n| &n.id == leaver).cloned())
            .collect();

        // 3. The group's own cloud resources in step (a made security group
        //    follows the vservers), then provision up to min_nodes in every AZ.
        self.prepare_group_resources(cloud, group).await?;
        for (az, count) in &plan.start {
            for _ in 0..*count {
                self.provision(
                    group,
                    az,
                    &token,
                    lease,
                    &format!("below min_nodes ({})", group.spec.min_nodes),
                )
                .await?;
            }
        }

        // 4. Configure every staying node with the group's vservers; a node that
        //    runs the current configuration is active.
        let leaving_ids: Vec<String> = leaving.iter().map(|n| n.id.clone()).collect();
        self.push_configs(cloud, group, &token, &leaving_ids, deadline, lease)
            .await?;
        // Ports may have changed even when no node did (a vserver was added).
        lease.check()?;
        self.publish(&spec.traffic_distributor_id).await?;

        // 5. Remove the nodes that leave: out of the distributor, TTL, drain, gone.
        if !leaving.is_empty() {
            self.scale_in(
                group,
                leaving,
                deadline,
                "over max_nodes or in a removed availability zone",
                lease,
            )
            .await?;
        }
        Ok(())
    }

    /// Whether the group's destroy began and has not finished (the daemon
    /// then finishes it with [`Engine::delete_group`]).
    pub fn group_being_deleted(&self, id: &str) -> Result<bool> {
        Ok(self.store.group_deleting(id)?)
    }

    /// Nothing but the deletion acts on a group whose destroy began.
    pub(super) fn refuse_if_deleting(&self, group: &Row<GroupSpec>) -> Result<()> {
        if self.store.group_deleting(&group.id)? {
            return Err(EngineError::Step {
                step: "act on the group",
                detail: format!(
                    "autoscale group {:?} is being destroyed; the daemon or the next `terraform destroy` finishes it",
                    group.spec.name
                ),
            });
        }
        Ok(())
    }

    /// Removes the nodes whose process is gone (`failed`: the core's
    /// `remove_failed`): each is marked failed and out of the distributor, the
    /// distributor is republished without them, and only once it confirmed
    /// are they deprovisioned and their rows deleted (a failed publication
    /// leaves the rows for the next run, which publishes again).
    async fn remove_failed(
        &self,
        cloud: &dyn Cloud,
        group: &Row<GroupSpec>,
        rows: &[NodeRow],
        failed: &[String],
        lease: &KeptLease,
    ) -> Result<()> {
        let id = &group.id;
        let mut dead = Vec::new();
        for mut n in rows.iter().filter(|n| failed.contains(&n.id)).cloned() {
            lease.check()?;
            if n.state != NodeState::Failed || n.registered {
                n.state = NodeState::Failed;
                n.registered = false;
                self.store.update_node_under(lease.lease(), &n)?;
                self.store.record_event(
                    id,
                    Some(&n.az),
                    "node_failed",
                    &format!("node {} is not running", n.id),
                )?;
            }
            dead.push(n);
        }
        if dead.is_empty() {
            return Ok(());
        }
        lease.check()?;
        self.publish(&group.spec.traffic_distributor_id).await?;
        for n in dead {
            lease.check()?;
            cloud.deprovision(&n).await?;
            self.store.delete_node_under(lease.lease(), &n.id)?;
            self.store.record_event(
                id,
                Some(&n.az),
                "node_removed",
                &format!("failed node {} removed", n.id),
            )?;
        }
        Ok(())
    }

    pub fn events(&self, group_id: &str, limit: usize) -> Result<Vec<crate::store::Event>> {
        Ok(self.store.events_of_group(group_id, limit)?)
    }
}

/// The nodes as the core's apply plan reads them: a member whose process is
/// gone counts as failed.
fn observed(rows: &[NodeRow], alive: &[bool]) -> Vec<apply::ObservedNode> {
    rows.iter()
        .zip(alive)
        .map(|(n, alive)| apply::ObservedNode {
            id: n.id.clone(),
            az: n.az.clone(),
            seq: n.seq,
            life: match n.state {
                NodeState::Failed => apply::Life::Failed,
                s if s.is_member() && !alive => apply::Life::Failed,
                s if s.is_member() => apply::Life::Member,
                _ => apply::Life::Leaving,
            },
        })
        .collect()
}
