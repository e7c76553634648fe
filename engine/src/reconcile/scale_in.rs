//! Scale-in and drain: nodes leave the distributor, wait one TTL, drain, and
//! are deprovisioned.

use super::leases::KeptLease;
use super::{Engine, EngineError, Result};
use crate::fault::fault_point;
use crate::model::GroupSpec;
use crate::nodeapi::NodeClient;
use crate::store::{NodeRow, NodeState, Row};
use std::time::{Duration, Instant};

impl Engine {
    /// The scale-in workflow for one AZ: the newest node leaves (out of the
    /// distributor, one TTL, drain, deprovision). Refused at min_nodes.
    pub async fn scale_in_one(&self, group_id: &str, az: &str, reason: &str) -> Result<String> {
        let group = self
            .store
            .group(group_id)?
            .ok_or_else(|| EngineError::NotFound(format!("autoscale group {group_id}")))?;
        let deadline = Instant::now()
            + group.spec.drain_timeout()
            + self.ttl_of(&group.spec)?
            + Duration::from_secs(60);
        let lease = self.lease(group_id, deadline).await?;
        let out = async {
            let members: Vec<NodeRow> = self
                .store
                .nodes_of_group(group_id)?
                .into_iter()
                .filter(|n| n.az == az && n.state.is_member())
                .collect();
            if members.len() as i64 <= group.spec.min_nodes {
                return Err(EngineError::Step {
                    step: "scale in",
                    detail: format!(
                        "{az} has {} node(s), min_nodes is {}",
                        members.len(),
                        group.spec.min_nodes
                    ),
                });
            }
            // Nodes are in creation order: the newest leaves.
            let leaving = members
                .last()
                .cloned()
                .expect("more than min_nodes members");
            let id = leaving.id.clone();
            self.scale_in(&group, vec![leaving], deadline, reason, &lease)
                .await?;
            Ok(id)
        }
        .await;
        lease.release();
        out
    }

    /// Removes `nodes` from the group: deregister, wait one TTL (dns), drain (ends
    /// early when the node has no connections left; at most drain_timeout), then
    /// deprovision and forget.
    pub(crate) async fn scale_in(
        &self,
        group: &Row<GroupSpec>,
        nodes: Vec<NodeRow>,
        deadline: Instant,
        reason: &str,
        lease: &KeptLease,
    ) -> Result<()> {
        if nodes.is_empty() {
            lease.check()?;
            self.publish(&group.spec.traffic_distributor_id).await?;
            return Ok(());
        }
        let (id, spec) = (&group.id, &group.spec);
        let cloud = self.cloud(&spec.cloud)?;
        let token = self.store.group_token(id)?.unwrap_or_default();
        let mut nodes = nodes;
        for n in nodes.iter_mut() {
            lease.check()?;
            if n.state.is_member() {
                self.store.record_event(
                    id,
                    Some(&n.az),
                    "scale_in",
                    &format!("node {}: {reason}", n.id),
                )?;
            }
            n.registered = false;
            if n.state != NodeState::Deprovisioning {
                n.state = NodeState::Draining;
            }
            self.store.update_node(n)?;
        }
        fault_point("after_deregister");
        // Primaries stop forwarding new connections to the nodes that leave. The
        // ones they forwarded there stay open as long as the node's drain may take
        // (not just vs_scalein_timeout: the node leaves the group, not only the
        // vserver). Best effort, bounded: a member that does not answer must not
        // hold up the scale-in; the daemon finds it stale and pushes it later.
        let push_deadline = (Instant::now() + CONFIG_PUSH_TIMEOUT).min(deadline);
        let floor = spec.drain_timeout();
        match self
            .push_configs_with(cloud, group, &token, &[], floor, push_deadline, lease)
            .await
        {
            Err(e @ EngineError::Store(_)) => return Err(e),
            Err(e) => self.store.record_event(
                id,
                None,
                "config_push_failed",
                &format!("while nodes leave: {e} (retried by the next reconcile)"),
            )?,
            Ok(()) => {}
        }
        lease.check()?;
        self.publish(&spec.traffic_distributor_id).await?;

        let ttl = self.ttl_of(spec)?;
        if !ttl.is_zero() && nodes.iter().any(|n| n.state == NodeState::Draining) {
            let until = (Instant::now() + ttl).min(deadline);
            tokio::time::sleep_until(until.into()).await;
            if Instant::now() >= deadline {
                return Err(EngineError::Timeout {
                    step: "wait one DNS TTL",
                    after_s: 0,
                    detail: format!("TTL {}s", ttl.as_secs()),
                });
            }
            self.store.record_event(
                id,
                None,
                "ttl_end",
                &format!("waited one DNS TTL ({}s)", ttl.as_secs()),
            )?;
        }

        let drain_until = (Instant::now() + spec.drain_timeout()).min(deadline);
        for n in nodes.iter_mut().filter(|n| n.state == NodeState::Draining) {
            lease.check()?;
            let port = cloud.api_port(n);
            if cloud.is_alive(n).await.unwrap_or(true) {
                if let Ok(mut c) = NodeClient::connect(&n.private_ip, port, &token).await {
                    let left = drain_until.saturating_duration_since(Instant::now());
                    let _ = c.drain(left).await;
                    loop {
                        let conns = c.stats().await.map(|s| s.active_connections).unwrap_or(0);
                        if conns == 0 {
                            break;
                        }
                        if Instant::now() >= drain_until {
                            if drain_until >= deadline && Instant::now() >= deadline {
                                return Err(EngineError::Timeout {
                                    step: "drain the node",
                                    after_s: 0,
                                    detail: format!(
                                        "node {} still had {conns} connection(s)",
                                        n.id
                                    ),
                                });
                            }
                            break;
                        }
                        tokio::time::sleep(Duration::from_millis(200)).await;
                    }
                }
            }
            lease.check()?;
            self.store.record_event(
                id,
                Some(&n.az),
                "drain_end",
                &format!("node {} drained", n.id),
            )?;
            n.state = NodeState::Deprovisioning;
            self.store.update_node(n)?;
            fault_point("after_drain");
        }

        for n in &nodes {
            lease.check()?;
            self.store.record_event(
                id,
                Some(&n.az),
                "deprovision_start",
                &format!("node {}", n.id),
            )?;
            cloud.deprovision(n).await?;
            fault_point("after_deprovision_before_delete");
            lease.check()?;
            self.store.delete_node(&n.id)?;
            self.store.record_event(
                id,
                Some(&n.az),
                "node_removed",
                &format!("node {} removed", n.id),
            )?;
        }
        Ok(())
    }
}

/// How long a best-effort configuration push (while nodes leave) may take.
const CONFIG_PUSH_TIMEOUT: Duration = Duration::from_secs(10);
