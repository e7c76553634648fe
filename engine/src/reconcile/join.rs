//! Joining nodes and pushing their configuration: what each node runs (the
//! group's vservers with its scale-out roles), the push, and the rolling
//! restart that replaces every node surge first.

use super::leases::KeptLease;
use super::spans::Placements;
use super::{Engine, EngineError, Result};
use crate::cloud::Cloud;
use crate::fault::{fault_point, hold_point};
use crate::model::{GroupSpec, VserverSpec};
use crate::nodeapi::NodeClient;
use crate::placement;
use crate::store::{NlbRows, NodeRow, NodeState, Row, CONFIG_FENCE};
use std::time::{Duration, Instant};

impl Engine {
    /// Joins every member of the group that stays (not in `leaving`) and pushes
    /// each its configuration if it changed. Newest first: a new secondary serves
    /// before its primary starts forwarding to it, and the nodes of a new group
    /// (none active yet) do not ramp against each other.
    pub(crate) async fn push_configs(
        &self,
        cloud: &dyn Cloud,
        group: &Row<GroupSpec>,
        token: &str,
        leaving: &[String],
        deadline: Instant,
        lease: &KeptLease,
    ) -> Result<()> {
        self.push_configs_with(
            cloud,
            group,
            token,
            leaving,
            Duration::ZERO,
            deadline,
            lease,
        )
        .await
    }

    /// [`Engine::push_configs`], with the primaries keeping the connections they
    /// forwarded to a dropped secondary at least `scalein_floor`.
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn push_configs_with(
        &self,
        cloud: &dyn Cloud,
        group: &Row<GroupSpec>,
        token: &str,
        leaving: &[String],
        scalein_floor: Duration,
        deadline: Instant,
        lease: &KeptLease,
    ) -> Result<()> {
        // A node that took a newer workflow's configuration meanwhile refuses
        // ours: read it again (nodes that run it already are skipped).
        let mut attempts = 0;
        loop {
            attempts += 1;
            let pushed = async {
                let config = self.fenced_node_config(&group.id, lease)?;
                // Read once, after the fence was taken: a workflow of another
                // AZ that changes the members meanwhile pushes under a higher
                // fence, the nodes then refuse this push's, and it is read
                // again (Superseded below).
                let nodes = self.store.nodes_of_group(&group.id)?;
                let members = self.members(group, &nodes, leaving)?;
                for n in members.staying.iter().rev() {
                    self.join(
                        cloud,
                        group,
                        (*n).clone(),
                        token,
                        &config,
                        &members,
                        scalein_floor,
                        deadline,
                        lease,
                    )
                    .await?;
                }
                Ok(())
            };
            match pushed.await {
                Err(EngineError::Superseded(why)) if attempts < 5 => {
                    tracing::info!(group = %group.id, %why, "configuration superseded; reading it again");
                }
                other => return other,
            }
        }
    }

    /// The group's node configuration under a new fence, taken under `lease`
    /// before the configuration is read (see [`Store::next_config_fence`]).
    ///
    /// [`Store::next_config_fence`]: crate::store::Store::next_config_fence
    fn fenced_node_config(
        &self,
        group_id: &str,
        lease: &KeptLease,
    ) -> Result<lbscale_proto::NodeConfig> {
        lease.check()?;
        let fence = self.store.next_config_fence(group_id, lease.lease())?;
        let mut config = self.node_config(group_id, self.store.config_version(group_id)?)?;
        config.fence = fence;
        Ok(config)
    }

    /// Joins a node to its cluster: pushes its configuration (the group's vservers
    /// with this node's scale-out roles) if the node does not run it yet (then it
    /// is active), and marks it registered with the distributor (the caller
    /// publishes).
    #[allow(clippy::too_many_arguments)]
    async fn join(
        &self,
        cloud: &dyn Cloud,
        group: &Row<GroupSpec>,
        mut n: NodeRow,
        token: &str,
        base: &lbscale_proto::NodeConfig,
        members: &Members<'_>,
        scalein_floor: Duration,
        deadline: Instant,
        lease: &KeptLease,
    ) -> Result<()> {
        let group_id = group.id.as_str();
        let version = base.version;
        let mut config = placed_config(base, &n, members);
        // The floor matters only to the secondaries dropped by this push; the
        // configuration is otherwise the same (no re-push for it later).
        let fingerprint = config_fingerprint(&config);
        for v in &mut config.vservers {
            if let Some(so) = v.scaleout.as_mut() {
                so.scalein_timeout_ms = so.scalein_timeout_ms.max(scalein_floor.as_millis() as u64);
            }
        }
        let applied = n.handle.get("config_fingerprint").and_then(|v| v.as_str());
        if applied != Some(fingerprint.as_str()) || n.state != NodeState::Active {
            if n.state != NodeState::Active {
                self.add_ramp_peers(group_id, &n, &mut config)?;
            }
            lease.check()?;
            self.configure(cloud, &n, token, config, deadline).await?;
            fault_point("after_configure");
            hold_point("join_before_node_write", group_id).await;
            lease.check()?;
            n.handle["config_version"] = version.into();
            n.handle["config_fingerprint"] = fingerprint.into();
            n.handle[CONFIG_FENCE] = base.fence.into();
            if !self.store.record_config_under(lease.lease(), &n)? {
                row_moved_on(&n);
            }
            // Even when a newer push recorded its configuration instead: the
            // node runs one. Nothing is written if the node left its cluster,
            // nor by the second of two pushes that made it active.
            if n.state != NodeState::Active
                && self.store.activate_node_under(lease.lease(), &n.id)?
            {
                self.store.record_event(
                    group_id,
                    Some(&n.az),
                    "node_active",
                    &format!(
                        "node {} serves the group's vservers (configuration {version})",
                        n.id
                    ),
                )?;
            }
        }
        if !n.registered {
            self.register(group_id, &n, lease)?;
        }
        Ok(())
    }

    /// A joining node's services are new: they ramp under slow start against
    /// the nodes that already serve in its AZ. Only older nodes are peers, so
    /// forwarding between ramping nodes never loops; a node that is already
    /// active gets none (a vserver added to every node at once does not ramp
    /// anywhere).
    fn add_ramp_peers(
        &self,
        group_id: &str,
        n: &NodeRow,
        config: &mut lbscale_proto::NodeConfig,
    ) -> Result<()> {
        let peers: Vec<String> = self
            .store
            .nodes_of_group(group_id)?
            .into_iter()
            .filter(|p| {
                p.az == n.az && p.seq < n.seq && p.state == NodeState::Active && p.registered
            })
            .map(|p| p.private_ip)
            .collect();
        for v in &mut config.vservers {
            // Manual slow start (interval 0) would hold every new node at
            // new_service_request until an operator acts, so a scale-out would
            // add no capacity: a joining node ramps only automatically.
            let automatic = v
                .slow_start
                .as_ref()
                .is_some_and(|ss| ss.new_service_request > 0 && ss.increment_interval_s > 0);
            if automatic {
                v.ramp_peers = peers.clone();
            }
        }
        Ok(())
    }

    /// Marks the node registered with the distributor (the caller publishes),
    /// if it is active and not registered yet: its flag alone, so that a
    /// newer push's record of its configuration stays.
    fn register(&self, group_id: &str, n: &NodeRow, lease: &KeptLease) -> Result<()> {
        lease.check()?;
        if !self.store.register_node_under(lease.lease(), &n.id)? {
            tracing::debug!(node = %n.id, "not registered: no longer active, or registered already");
            return Ok(());
        }
        self.store.record_event(
            group_id,
            Some(&n.az),
            "node_registered",
            &format!(
                "node {} ({}) added to the traffic distributor",
                n.id, n.private_ip
            ),
        )?;
        fault_point("after_register");
        Ok(())
    }

    async fn configure(
        &self,
        cloud: &dyn Cloud,
        n: &NodeRow,
        token: &str,
        config: lbscale_proto::NodeConfig,
        deadline: Instant,
    ) -> Result<()> {
        let port = cloud.api_port(n);
        let creds = self.node_credentials(&n.group_id, token)?;
        let started = Instant::now();
        let mut last = String::new();
        while Instant::now() < deadline {
            let attempt = async {
                let mut c =
                    NodeClient::connect_with(&creds, &n.private_ip, port, &n.id, token).await?;
                c.configure(config.clone()).await
            };
            match attempt.await {
                Ok(_) => return Ok(()),
                Err(e @ crate::nodeapi::NodeApiError::Superseded { .. }) => {
                    return Err(EngineError::Superseded(format!("node {}: {e}", n.id)))
                }
                // A refusal (a port in use, say) will not fix itself: report it now.
                Err(e @ crate::nodeapi::NodeApiError::Refused { .. }) => {
                    return Err(EngineError::Step {
                        step: "push the vservers to the node",
                        detail: format!("node {}: {e}", n.id),
                    })
                }
                Err(e) => last = e.to_string(),
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        Err(EngineError::Timeout {
            step: "wait for the node to be active",
            after_s: started.elapsed().as_secs(),
            detail: format!("node {} did not take its configuration: {last}", n.id),
        })
    }

    /// The members of `nodes` that stay (not in `leaving`) and the placements
    /// over them.
    fn members<'a>(
        &self,
        group: &Row<GroupSpec>,
        nodes: &'a [NodeRow],
        leaving: &[String],
    ) -> Result<Members<'a>> {
        let staying = staying(nodes, leaving);
        let placements = self.placements(group, &staying)?;
        Ok(Members {
            staying,
            placements,
        })
    }

    /// The full configuration the group's nodes run: every vserver placed on it.
    fn node_config(&self, group_id: &str, version: u64) -> Result<lbscale_proto::NodeConfig> {
        Ok(node_config_of(
            self.store.vservers_of_group(group_id)?,
            version,
        ))
    }

    /// Active nodes of the group whose last pushed configuration is not the one
    /// they should run now (a push that failed half-way, e.g. a primary that did
    /// not take its new secondary). The daemon's resume reconcile pushes them.
    pub fn stale_configurations(&self, group_id: &str) -> Result<Vec<String>> {
        let Some(group) = self.store.group(group_id)? else {
            return Ok(Vec::new());
        };
        let version = self.store.config_version(group_id)?;
        let nlb = if self.behind_nlb(&group.spec)? {
            Some(self.store.nlb_rows(group_id)?)
        } else {
            None
        };
        let nodes = self.store.nodes_of_group(group_id)?;
        let vservers = self.store.vservers_of_group(group_id)?;
        Ok(stale_among(&group, version, nlb.as_ref(), &nodes, vservers))
    }

    /// Restarts every node of the group, one at a time and surge first: a new
    /// node joins and serves before the old one leaves (TTL, drain, gone). Used
    /// when a setting that nodes read only at start-up changes (`se_tunnel_mode`).
    pub async fn rolling_restart(&self, group_id: &str, reason: &str) -> Result<()> {
        let group = self
            .store
            .group(group_id)?
            .ok_or_else(|| EngineError::NotFound(format!("autoscale group {group_id}")))?;
        let old: Vec<NodeRow> = self
            .store
            .nodes_of_group(group_id)?
            .into_iter()
            .filter(|n| n.state.is_member())
            .collect();
        let per_node =
            group.spec.apply_timeout() + group.spec.drain_timeout() + self.ttl_of(&group.spec)?;
        let deadline = Instant::now() + per_node * (old.len() as u32).max(1);
        let lease = self.lease(group_id, deadline).await?;
        let out = async {
            let group = self.group_row(group_id)?;
            self.refuse_if_deleting(&group)?;
            let cloud = self.cloud(group.spec.cloud)?;
            let token = self.group_token(group_id)?;
            let config = self.fenced_node_config(group_id, &lease)?;
            self.store.record_event(
                group_id,
                None,
                "rolling_restart",
                &format!("{reason}: {} node(s), one at a time", old.len()),
            )?;
            // Newest first: the oldest node (every vserver's scale-out primary)
            // is replaced last, so the primary moves once, not at every step.
            for n in old.into_iter().rev() {
                self.replace_node(cloud, &group, n, &token, &config, deadline, &lease)
                    .await?;
            }
            Ok(())
        }
        .await;
        lease.release();
        out
    }

    /// One step of the rolling restart: a new node in `old`'s AZ joins and
    /// serves, the primaries learn of it, then `old` leaves (TTL, drain, gone).
    #[allow(clippy::too_many_arguments)]
    async fn replace_node(
        &self,
        cloud: &dyn Cloud,
        group: &Row<GroupSpec>,
        old: NodeRow,
        token: &str,
        config: &lbscale_proto::NodeConfig,
        deadline: Instant,
        lease: &KeptLease,
    ) -> Result<()> {
        let why = format!("replaces {} (rolling restart)", old.id);
        let fresh = self.provision(group, &old.az, token, lease, &why).await?;
        let nodes = self.store.nodes_of_group(&group.id)?;
        self.join(
            cloud,
            group,
            fresh,
            token,
            config,
            &self.members(group, &nodes, &[])?,
            Duration::ZERO,
            deadline,
            lease,
        )
        .await?;
        // The primaries learn of the new node before the old one leaves.
        let leaving = std::slice::from_ref(&old.id);
        self.push_configs(cloud, group, token, leaving, deadline, lease)
            .await?;
        lease.check()?;
        self.publish(&group.spec.traffic_distributor_id).await?;
        self.scale_in(
            group,
            vec![old],
            deadline,
            "replaced by the rolling restart",
            lease,
        )
        .await
    }
}

/// Identifies what a node was sent (ramp peers aside: they matter only while it
/// joins), so that a node is reconfigured exactly when its configuration changes.
fn config_fingerprint(config: &lbscale_proto::NodeConfig) -> String {
    use prost::Message;
    let mut c = config.clone();
    // What the node runs, not when it was read.
    c.fence = 0;
    for v in &mut c.vservers {
        v.ramp_peers.clear();
    }
    // FNV-1a: stable across Rust versions (std's hasher is not), so a toolchain
    // upgrade does not make every node look changed.
    let h = c
        .encode_to_vec()
        .iter()
        .fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
            (h ^ u64::from(*b)).wrapping_mul(0x0000_0100_0000_01b3)
        });
    format!("{h:016x}")
}

/// This push's copy of a node's row is outdated (see
/// [`Store::record_config_under`]): the node was taken out since (another AZ's
/// scale-in deregistered it), or a newer push configured it after this one.
/// Its record of the configuration is left as that workflow wrote it.
///
/// [`Store::record_config_under`]: crate::store::Store::record_config_under
fn row_moved_on(n: &NodeRow) {
    tracing::info!(node = %n.id, "node left its cluster or was configured by a newer push during this one; its configuration's record is left as it is");
}

/// The members of a group that stay, oldest first, and where its vservers
/// are placed over them: the scale-out roles of every node's configuration.
pub(crate) struct Members<'a> {
    staying: Vec<&'a NodeRow>,
    placements: Placements,
}

/// The reachable members among `nodes` not in `leaving`, in `nodes`' order.
/// A member still being provisioned by another AZ's workflow has no address
/// yet: it is not pushed to, placed, nor anyone's group peer.
fn staying<'a>(nodes: &'a [NodeRow], leaving: &[String]) -> Vec<&'a NodeRow> {
    nodes
        .iter()
        .filter(|m| m.is_reachable_member() && !leaving.contains(&m.id))
        .collect()
}

/// What node `n` runs: `base` (every vserver of the group) with its scale-out
/// role in each, as `members` place it.
fn placed_config(
    base: &lbscale_proto::NodeConfig,
    n: &NodeRow,
    members: &Members<'_>,
) -> lbscale_proto::NodeConfig {
    let Members {
        staying,
        placements,
    } = members;
    use lbscale_proto::{Scaleout, ScaleoutPeer, ScaleoutRole};
    let mut config = base.clone();

    if !placements.is_empty() {
        // Behind an nlb nodes forward to each other (a primary to its
        // secondaries) with a PROXY header naming the client.
        config.group_peers = staying
            .iter()
            .filter(|m| m.id != n.id)
            .map(|m| m.private_ip.clone())
            .collect();
    }
    for v in &mut config.vservers {
        let Some(p) = placements.get(&(v.name.clone(), n.az.clone())) else {
            continue;
        };
        let role = p.roles.iter().find(|(a, _)| *a == n.private_ip);
        v.scaleout = role.map(|(_, role)| match role {
            placement::Role::Primary {
                own_share,
                secondaries,
            } => Scaleout {
                role: ScaleoutRole::Primary as i32,
                primary_share: *own_share,
                secondaries: secondaries
                    .iter()
                    .map(|(address, share)| ScaleoutPeer {
                        address: address.clone(),
                        share: *share,
                    })
                    .collect(),
                scalein_timeout_ms: p.scalein_timeout_ms,
            },
            placement::Role::Secondary => Scaleout {
                role: ScaleoutRole::Secondary as i32,
                scalein_timeout_ms: p.scalein_timeout_ms,
                ..Default::default()
            },
        });
    }
    config
}

/// The full configuration the group's nodes run: `vservers`, every vserver placed on it.
fn node_config_of(vservers: Vec<Row<VserverSpec>>, version: u64) -> lbscale_proto::NodeConfig {
    use lbscale_proto::{LbMethod, Service, ServiceType, Vserver};
    let vservers = vservers
        .into_iter()
        .map(|v| {
            let s = v.spec;
            Vserver {
                name: s.name,
                service_type: match s.service_type.as_str() {
                    "HTTP" => ServiceType::Http,
                    "TCP" => ServiceType::Tcp,
                    _ => ServiceType::Udp,
                } as i32,
                port: s.port as u32,
                lb_method: LbMethod::from_str_name(&s.lb_method)
                    .unwrap_or(LbMethod::Leastconnection) as i32,
                persistence: s.persistence,
                // The node ramps new services itself (first bound there, or back
                // UP) with lbscale-core's model; the engine only says how.
                slow_start: s.slow_start.as_ref().map(|ss| lbscale_proto::SlowStart {
                    new_service_request: ss.new_service_request.max(0) as u32,
                    unit: if ss.unit == "PERCENT" {
                        lbscale_proto::SlowStartUnit::Percent
                    } else {
                        lbscale_proto::SlowStartUnit::PerSecond
                    } as i32,
                    increment_interval_s: ss.increment_interval.max(0) as u32,
                }),
                scaleout: None,
                ramp_peers: vec![],
                max_connections: s.max_connections.clamp(0, u32::MAX as i64) as u32,
                // Checked at plan time; a bad stored value is the passive check.
                udp_health_request: crate::model::udp_health_request_bytes(&s.udp_health_request)
                    .unwrap_or_default(),
                services: s
                    .services
                    .into_iter()
                    .map(|svc| Service {
                        name: svc.name,
                        address: svc.address,
                        port: svc.port as u32,
                        weight: svc.weight as u32,
                        enabled: svc.enabled,
                        cap_per_second: None,
                        custom_load: None,
                    })
                    .collect(),
            }
        })
        .collect();
    lbscale_proto::NodeConfig {
        version,
        vservers,
        group_peers: Vec::new(),
        fence: 0,
    }
}

/// [`Engine::stale_configurations`] of `group` whose configuration version
/// is `version`, stored nodes `nodes` and vservers `vservers`, and behind an
/// `nlb` its [`NlbRows`] (what the caller read already): reads nothing.
pub(crate) fn stale_among(
    group: &Row<GroupSpec>,
    version: u64,
    nlb: Option<&NlbRows>,
    nodes: &[NodeRow],
    vservers: Vec<Row<VserverSpec>>,
) -> Vec<String> {
    let staying = staying(nodes, &[]);
    let placements = nlb
        .map(|nlb| super::spans::placements_of(group, &staying, &vservers, nlb))
        .unwrap_or_default();
    let members = Members {
        staying,
        placements,
    };
    let base = node_config_of(vservers, version);
    nodes
        .iter()
        .filter(|n| n.state == NodeState::Active)
        .filter(|n| {
            let want = config_fingerprint(&placed_config(&base, n, &members));
            n.handle.get("config_fingerprint").and_then(|v| v.as_str()) != Some(want.as_str())
        })
        .map(|n| n.id.clone())
        .collect()
}
