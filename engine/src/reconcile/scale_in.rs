//! Scale-in and drain: nodes leave the distributor, wait one TTL, drain, and
//! are deprovisioned.

use super::leases::KeptLease;
use super::{Engine, EngineError, Result};
use crate::cloud::Cloud;
use crate::fault::fault_point;
use crate::model::GroupSpec;
use crate::nodeapi::{EngineCredentials, NodeClient};
use crate::store::{az_lease_key, NodeRow, NodeState, Row};
use std::time::{Duration, Instant};

impl Engine {
    /// The scale-in workflow for one AZ, under that AZ's lease (what the daemon
    /// runs when a breach is confirmed: another AZ's workflow runs meanwhile):
    /// the AZ's newest node leaves (out of the distributor, one TTL, drain,
    /// deprovision). Refused at min_nodes. Returns the node's id.
    pub async fn scale_in_one(&self, group_id: &str, az: &str, reason: &str) -> Result<String> {
        let group = self
            .store
            .group(group_id)?
            .ok_or_else(|| EngineError::NotFound(format!("autoscale group {group_id}")))?;
        let deadline = Instant::now()
            + group.spec.drain_timeout()
            + self.ttl_of(&group.spec)?
            + Duration::from_secs(60);
        let lease = self.lease(&az_lease_key(group_id, az), deadline).await?;
        let out = async {
            // As it is now, under the lease: a destroy may have ended meanwhile.
            let group = self.group_row(group_id)?;
            self.refuse_if_deleting(&group)?;
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
        let spec = &group.spec;
        let cloud = self.cloud(spec.cloud)?;
        let token = self.group_token(&group.id)?;
        let mut nodes = nodes;
        self.deregister(&group.id, &mut nodes, reason, lease)?;
        self.push_while_leaving(cloud, group, &token, deadline, lease)
            .await?;
        lease.check()?;
        self.publish(&spec.traffic_distributor_id).await?;
        if nodes.iter().any(|n| n.state == NodeState::Draining) {
            self.wait_one_ttl(group, deadline).await?;
        }
        let drain_until = (Instant::now() + spec.drain_timeout()).min(deadline);
        for n in nodes.iter_mut().filter(|n| n.state == NodeState::Draining) {
            lease.check()?;
            let drained = self.drain(cloud, n, &token, drain_until, deadline).await?;
            lease.check()?;
            self.store.record_event(
                &group.id,
                Some(&n.az),
                "drain_end",
                &format!("node {} {drained}", n.id),
            )?;
            n.state = NodeState::Deprovisioning;
            self.store.update_node_under(lease.lease(), n)?;
            fault_point("after_drain");
        }
        self.deprovision_and_forget(cloud, &group.id, &nodes, lease)
            .await
    }

    /// Step 1: the nodes leave the distributor (in the store; the caller
    /// publishes) and start draining, unless already past it.
    fn deregister(
        &self,
        group_id: &str,
        nodes: &mut [NodeRow],
        reason: &str,
        lease: &KeptLease,
    ) -> Result<()> {
        for n in nodes.iter_mut() {
            lease.check()?;
            if n.state.is_member() {
                self.store.record_event(
                    group_id,
                    Some(&n.az),
                    "scale_in",
                    &format!("node {}: {reason}", n.id),
                )?;
            }
            n.registered = false;
            if n.state != NodeState::Deprovisioning {
                n.state = NodeState::Draining;
            }
            self.store.update_node_under(lease.lease(), n)?;
        }
        fault_point("after_deregister");
        Ok(())
    }

    /// Step 2: primaries stop forwarding new connections to the nodes that
    /// leave. The ones they forwarded there stay open as long as the node's
    /// drain may take (not just vs_scalein_timeout: the node leaves the group,
    /// not only the vserver). Best effort, bounded: a member that does not
    /// answer must not hold up the scale-in; the daemon finds it stale and
    /// pushes it later.
    async fn push_while_leaving(
        &self,
        cloud: &dyn Cloud,
        group: &Row<GroupSpec>,
        token: &str,
        deadline: Instant,
        lease: &KeptLease,
    ) -> Result<()> {
        let push_deadline = (Instant::now() + CONFIG_PUSH_TIMEOUT).min(deadline);
        let floor = group.spec.drain_timeout();
        match self
            .push_configs_with(cloud, group, token, &[], floor, push_deadline, lease)
            .await
        {
            Err(e @ EngineError::Store(_)) => Err(e),
            Err(e) => Ok(self.store.record_event(
                &group.id,
                None,
                "config_push_failed",
                &format!("while nodes leave: {e} (retried by the next reconcile)"),
            )?),
            Ok(()) => Ok(()),
        }
    }

    /// Step 3 (`dns` distributors): clients may still resolve the name to the
    /// nodes that left until one TTL has passed.
    async fn wait_one_ttl(&self, group: &Row<GroupSpec>, deadline: Instant) -> Result<()> {
        let ttl = self.ttl_of(&group.spec)?;
        if ttl.is_zero() {
            return Ok(());
        }
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
            &group.id,
            None,
            "ttl_end",
            &format!("waited one DNS TTL ({}s)", ttl.as_secs()),
        )?;
        Ok(())
    }

    /// Step 4, one node: tells it to drain and waits until it has no
    /// connections left or `drain_until` passes. A node the cloud says is gone
    /// has nothing to drain. One that does not answer, or whose connections
    /// cannot be read, may still have clients: its count is unknown, not zero,
    /// and it is asked again until `drain_until`. Past the workflow's
    /// `deadline`, a node that may still have connections is a timeout.
    async fn drain(
        &self,
        cloud: &dyn Cloud,
        n: &NodeRow,
        token: &str,
        drain_until: Instant,
        deadline: Instant,
    ) -> Result<Drained> {
        let creds = self.node_credentials(&n.group_id, token)?;
        let mut api = DrainingNode {
            ip: &n.private_ip,
            port: cloud.api_port(n),
            node_id: &n.id,
            token,
            creds: &creds,
            client: None,
            told: false,
        };
        let mut unknown_logged = false;
        loop {
            let last = match api.connections(drain_until).await {
                Ok(0) => return Ok(Drained::Empty),
                Ok(count) => Drained::Left(count),
                Err(e) => {
                    if !cloud.is_alive(n).await.unwrap_or(true) {
                        return Ok(Drained::Gone);
                    }
                    if !unknown_logged {
                        unknown_logged = true;
                        tracing::warn!(node = %n.id, error = %e, "connections of a draining node unknown; asking again until the drain deadline");
                    }
                    Drained::Unknown(e)
                }
            };
            let now = Instant::now();
            if now >= drain_until {
                if drain_until >= deadline && now >= deadline {
                    return Err(EngineError::Timeout {
                        step: "drain the node",
                        after_s: 0,
                        detail: format!("node {} {last}", n.id),
                    });
                }
                return Ok(last);
            }
            let pause = match last {
                Drained::Unknown(_) => UNKNOWN_POLL,
                _ => DRAIN_POLL,
            };
            tokio::time::sleep_until((now + pause).min(drain_until).into()).await;
        }
    }

    /// Step 5: the nodes' processes stop, then their rows go.
    async fn deprovision_and_forget(
        &self,
        cloud: &dyn Cloud,
        group_id: &str,
        nodes: &[NodeRow],
        lease: &KeptLease,
    ) -> Result<()> {
        for n in nodes {
            lease.check()?;
            self.store.record_event(
                group_id,
                Some(&n.az),
                "deprovision_start",
                &format!("node {}", n.id),
            )?;
            cloud.deprovision(n).await?;
            fault_point("after_deprovision_before_delete");
            lease.check()?;
            self.store.delete_node_under(lease.lease(), &n.id)?;
            self.store.record_event(
                group_id,
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
/// How often a draining node's connections are read.
const DRAIN_POLL: Duration = Duration::from_millis(200);
/// How often they are read again while they cannot be (and the cloud asked
/// whether the node is still there).
const UNKNOWN_POLL: Duration = Duration::from_secs(1);
/// The least time one reading gets, even at the drain deadline.
const MIN_POLL_TIME: Duration = Duration::from_millis(500);

/// How one node's drain ended.
#[derive(Debug)]
enum Drained {
    /// No connections left.
    Empty,
    /// The cloud says the node is gone: nothing to drain.
    Gone,
    /// The drain deadline came with this many connections open.
    Left(u64),
    /// The drain deadline came while the connections could not be read (why).
    Unknown(String),
}

impl std::fmt::Display for Drained {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Drained::Empty => write!(f, "drained"),
            Drained::Gone => write!(f, "is gone: nothing to drain"),
            Drained::Left(n) => write!(f, "reached the drain deadline with {n} connection(s) open"),
            Drained::Unknown(e) => write!(
                f,
                "reached the drain deadline with its connections unknown ({e})"
            ),
        }
    }
}

/// The management API of a node that drains, connected to on first use and
/// again after an error.
struct DrainingNode<'a> {
    ip: &'a str,
    port: u16,
    node_id: &'a str,
    token: &'a str,
    creds: &'a EngineCredentials,
    client: Option<NodeClient>,
    /// Whether the node has acknowledged the drain request.
    told: bool,
}

impl DrainingNode<'_> {
    /// The node's open connections now, telling it to drain first until it
    /// has taken that. Bounded by `drain_until` (with at least
    /// [`MIN_POLL_TIME`]), so that a node that stalls does not hold the
    /// drain past its deadline.
    async fn connections(&mut self, drain_until: Instant) -> std::result::Result<u64, String> {
        let limit = drain_until
            .saturating_duration_since(Instant::now())
            .max(MIN_POLL_TIME);
        let read = async {
            // Kept only after an answer: after an error, a fresh connection
            // (this one may be what is broken).
            let mut client = match self.client.take() {
                Some(c) => c,
                None => NodeClient::connect_with(
                    self.creds,
                    self.ip,
                    self.port,
                    self.node_id,
                    self.token,
                )
                .await
                .map_err(|e| e.to_string())?,
            };
            let count = if self.told {
                client.stats().await.map(|s| s.active_connections)
            } else {
                let left = drain_until.saturating_duration_since(Instant::now());
                let count = client.drain(left).await;
                self.told = count.is_ok();
                count
            };
            let count = count.map_err(|e| e.to_string())?;
            self.client = Some(client);
            Ok(count)
        };
        match tokio::time::timeout(limit, read).await {
            Ok(out) => out,
            Err(_) => Err(format!(
                "node management API at {}:{} did not answer within {}ms",
                self.ip,
                self.port,
                limit.as_millis()
            )),
        }
    }
}
