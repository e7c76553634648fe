//! Scale-out: one node more in an AZ, and the provisioning of a node (its row
//! first, so that a crash never forgets it).

use super::leases::KeptLease;
use super::{Engine, EngineError, Result};
use crate::cloud::{Cloud, ProvisionRequest};
use crate::fault::fault_point;
use crate::model::GroupSpec;
use crate::store::{az_lease_key, now_ms, NodeRow, NodeState, Row};
use std::time::Instant;

impl Engine {
    /// The scale-out workflow in one AZ, under that AZ's lease: provision a
    /// node, join it and the AZ's other members (their configuration may place
    /// it), register it and publish the distributor. Refused at `max_nodes`.
    /// Returns the new node's id. The group's other AZs are not touched.
    pub async fn scale_out(&self, group_id: &str, az: &str, reason: &str) -> Result<String> {
        let group = self.group_row(group_id)?;
        let deadline = Instant::now() + group.spec.apply_timeout();
        crate::fault::hold_point("scale_out_before_lease", group_id).await;
        let lease = self.lease(&az_lease_key(group_id, az), deadline).await?;
        let out = async {
            // As it is now, under the lease: a destroy may have ended meanwhile
            // (docs/design.md, section 4), and a node for a group that is gone
            // would run forever.
            let group = self.group_row(group_id)?;
            self.refuse_if_deleting(&group)?;
            let nodes = self.store.nodes_of_group(group_id)?;
            let members = nodes
                .iter()
                .filter(|n| n.az == az && n.state.is_member())
                .count() as i64;
            if !group.spec.availability_zones.iter().any(|z| z == az)
                || members >= group.spec.max_nodes
            {
                return Err(EngineError::Step {
                    step: "scale out",
                    detail: format!(
                        "{az} has {members} node(s), max_nodes is {} (or the AZ is not declared)",
                        group.spec.max_nodes
                    ),
                });
            }
            lease.check()?;
            self.store
                .record_event(group_id, Some(az), "scale_out", reason)?;
            let before: Vec<String> = nodes.iter().map(|n| n.id.clone()).collect();
            let token = self.group_token(group_id)?;
            self.prepare_group_resources(self.cloud(group.spec.cloud)?, &group)
                .await?;
            self.provision(&group, az, &token, &lease, "scale-out")
                .await?;
            // Only this AZ's members are pushed: the others (passed as left
            // alone) may be in another AZ's workflow. A placement is per AZ, so
            // leaving them out changes no configuration of this AZ.
            let other_azs: Vec<String> = self
                .store
                .nodes_of_group(group_id)?
                .into_iter()
                .filter(|n| n.az != az)
                .map(|n| n.id)
                .collect();
            let cloud = self.cloud(group.spec.cloud)?;
            self.push_configs(cloud, &group, &token, &other_azs, deadline, &lease)
                .await?;
            lease.check()?;
            self.publish(&group.spec.traffic_distributor_id).await?;
            self.store
                .nodes_of_group(group_id)?
                .into_iter()
                .find(|n| n.az == az && !before.contains(&n.id))
                .map(|n| n.id)
                .ok_or_else(|| EngineError::Step {
                    step: "scale out",
                    detail: "the new node disappeared".into(),
                })
        }
        .await;
        lease.release();
        out
    }

    pub(crate) async fn provision(
        &self,
        group: &Row<GroupSpec>,
        az: &str,
        token: &str,
        lease: &KeptLease,
        why: &str,
    ) -> Result<NodeRow> {
        let (id, spec) = (&group.id, &group.spec);
        let cloud = self.cloud(spec.cloud)?;
        let seq = self.store.next_node_seq(id)?;
        let node_id = format!("{}-{}-{}-{:04x}", spec.name, az, seq, rand::random::<u16>());
        let credentials =
            crate::nodeapi::auth::node_credentials(token, &node_id).map_err(|detail| {
                EngineError::Step {
                    step: "issue the node's credentials",
                    detail,
                }
            })?;
        // The row exists before the side effect, so that a crash never forgets a node.
        let mut row = NodeRow {
            id: node_id.clone(),
            group_id: id.clone(),
            az: az.to_string(),
            seq,
            state: NodeState::Provisioning,
            private_ip: String::new(),
            public_ip: None,
            registered: false,
            handle: serde_json::json!({}),
            created_at: now_ms(),
        };
        lease.check()?;
        self.store.insert_node_under(lease.lease(), &row)?;
        self.store.record_event(
            id,
            Some(az),
            "node_provisioning",
            &format!("node {node_id}: {why}"),
        )?;
        fault_point("after_node_row");
        lease.check()?;
        let req = ProvisionRequest {
            node_id: node_id.clone(),
            group_id: id.clone(),
            group_name: spec.name.clone(),
            az: az.to_string(),
            node: spec.node_spec(),
            credentials,
        };
        // Not cut short by the apply deadline: a node that exists must be recorded,
        // or it would be orphaned. The driver bounds its own start-up wait.
        let p = match cloud.provision(&req).await {
            Ok(p) => p,
            Err(e) => {
                self.undo_provision(cloud, row, lease).await?;
                return Err(EngineError::Step {
                    step: "provision node",
                    detail: e.to_string(),
                });
            }
        };
        fault_point("after_provision");
        row.private_ip = p.private_ip;
        row.public_ip = p.public_ip;
        row.handle = p.handle;
        // A node without an address could be neither configured nor reached;
        // the handle the cloud gave names it exactly for the removal.
        if row.private_ip.is_empty() {
            self.undo_provision(cloud, row, lease).await?;
            return Err(EngineError::Step {
                step: "provision node",
                detail: format!("the cloud gave node {node_id} no private address"),
            });
        }
        if let Err(e) = lease.check() {
            // Another holder owns the group now and may already have given up
            // on this row: stop the process that only this run knows of.
            let _ = cloud.deprovision(&row).await;
            return Err(e.into());
        }
        row.state = NodeState::Joining;
        self.store.update_node_under(lease.lease(), &row)?;
        self.store.record_event(
            id,
            Some(az),
            "node_joining",
            &format!("node {node_id} is up at {}", row.private_ip),
        )?;
        Ok(row)
    }

    /// After a failed provisioning: the cloud may have made the node before
    /// failing (an answer lost, a start that timed out), so whatever carries
    /// its id is removed before the row is forgotten. If that fails too, the
    /// row stays as failed, and the next reconcile removes it.
    async fn undo_provision(
        &self,
        cloud: &dyn Cloud,
        mut row: NodeRow,
        lease: &KeptLease,
    ) -> Result<()> {
        match cloud.deprovision(&row).await {
            Ok(()) => self.store.delete_node_under(lease.lease(), &row.id)?,
            Err(cleanup) => {
                row.state = NodeState::Failed;
                self.store.update_node_under(lease.lease(), &row)?;
                tracing::warn!(node = %row.id, error = %cleanup, "could not remove what a failed provisioning left; the next reconcile retries");
            }
        }
        Ok(())
    }
}
