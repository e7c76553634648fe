//! Nodes: the rows of a group's nodes and the addresses held for them.

use super::*;

/// The key in a node's handle of the configuration fence of the push that
/// last recorded its configuration there (see [`Store::record_config_under`]).
pub const CONFIG_FENCE: &str = "config_fence";

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeRow {
    pub id: String,
    pub group_id: String,
    pub az: String,
    /// Creation order within the group: the newest node has the highest `seq`.
    pub seq: i64,
    pub state: NodeState,
    pub private_ip: String,
    pub public_ip: Option<String>,
    /// Whether the node's address is in the traffic distributor.
    pub registered: bool,
    /// Driver-specific handle (for `local`: the process id and paths).
    pub handle: serde_json::Value,
    pub created_at: i64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum NodeState {
    Provisioning,
    Joining,
    Active,
    Draining,
    Deprovisioning,
    Gone,
    Failed,
}

impl NodeRow {
    /// A member that has its address: what a push configures and placements
    /// place. A member another workflow is still provisioning has none yet.
    pub fn is_reachable_member(&self) -> bool {
        self.state.is_member() && !self.private_ip.is_empty()
    }
}

impl NodeState {
    pub fn as_str(self) -> &'static str {
        match self {
            NodeState::Provisioning => "provisioning",
            NodeState::Joining => "joining",
            NodeState::Active => "active",
            NodeState::Draining => "draining",
            NodeState::Deprovisioning => "deprovisioning",
            NodeState::Gone => "gone",
            NodeState::Failed => "failed",
        }
    }
    fn parse(s: &str) -> Result<Self> {
        serde_json::from_value(serde_json::Value::String(s.into())).map_err(|e| {
            StoreError::Decode {
                what: "node state",
                detail: e.to_string(),
            }
        })
    }
    /// The states that count towards the cluster size (not on its way out).
    const MEMBERS: [NodeState; 3] = [
        NodeState::Provisioning,
        NodeState::Joining,
        NodeState::Active,
    ];

    /// Counts towards the cluster size (not on its way out).
    pub fn is_member(self) -> bool {
        Self::MEMBERS.contains(&self)
    }
}

/// `states` as the list of an SQL `IN (...)`.
fn in_list(states: &[NodeState]) -> String {
    let quoted: Vec<String> = states.iter().map(|s| format!("'{}'", s.as_str())).collect();
    quoted.join(", ")
}

impl Store {
    pub fn next_node_seq(&self, group_id: &str) -> Result<i64> {
        self.with(|c| {
            c.int(
                "SELECT coalesce(max(seq), 0) + 1 FROM nodes WHERE group_id = ?1",
                vals![group_id],
            )
        })
    }
    pub fn insert_node(&self, n: &NodeRow) -> Result<()> {
        self.with(|c| {
            c.execute(
                "INSERT INTO nodes (id, group_id, az, seq, state, private_ip, public_ip, registered, handle, created_at, updated_at)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?10)",
                vals![
                    &n.id, &n.group_id, &n.az, n.seq, n.state.as_str(), &n.private_ip, &n.public_ip,
                    n.registered, n.handle.to_string(), n.created_at
                ],
            )
        })?;
        Ok(())
    }
    pub fn update_node(&self, n: &NodeRow) -> Result<()> {
        self.with(|c| {
            c.execute(
                "UPDATE nodes SET state = ?2, registered = ?3, handle = ?4, updated_at = ?5,
                 private_ip = ?6, public_ip = ?7 WHERE id = ?1",
                vals![
                    &n.id,
                    n.state.as_str(),
                    n.registered,
                    n.handle.to_string(),
                    self.now(),
                    &n.private_ip,
                    &n.public_ip
                ],
            )
        })?;
        Ok(())
    }
    pub fn delete_node(&self, id: &str) -> Result<()> {
        self.with(|c| c.execute("DELETE FROM nodes WHERE id = ?1", vals![id]))?;
        Ok(())
    }
    /// As [`Store::insert_node`], fenced by `lease` in the statement itself:
    /// the row is written only while `lease` is its key's current lease (this
    /// holder, this fence, unexpired by the database's clock); else
    /// [`StoreError::LeaseLost`] and nothing is written.
    pub fn insert_node_under(&self, lease: &Lease, n: &NodeRow) -> Result<()> {
        let written = self.with(|c| {
            c.execute(
                &format!(
                    "INSERT INTO nodes (id, group_id, az, seq, state, private_ip, public_ip, registered, handle, created_at, updated_at)
                     SELECT ?1, ?2, ?3, CAST(?4 AS BIGINT), ?5, ?6, CAST(?7 AS TEXT), CAST(?8 AS BIGINT), ?9,
                            CAST(?10 AS BIGINT), CAST(?10 AS BIGINT)
                     WHERE {}",
                    fence_clause(11)
                ),
                vals![
                    &n.id, &n.group_id, &n.az, n.seq, n.state.as_str(), &n.private_ip, &n.public_ip,
                    n.registered, n.handle.to_string(), n.created_at,
                    &lease.group_id, &lease.holder, lease.fence
                ],
            )
        })?;
        self.fenced(lease, written, "node row not inserted")
    }

    /// As [`Store::update_node`], fenced by `lease` in the statement itself
    /// (see [`Store::insert_node_under`]); a node that is gone is no error.
    pub fn update_node_under(&self, lease: &Lease, n: &NodeRow) -> Result<()> {
        let written = self.node_written_under(lease, n)?;
        self.fenced(lease, written, "node row not updated")
    }

    /// Records under `lease` the configuration a push gave a member of its
    /// cluster (provisioning, joining or active): `n`'s handle, with the push's
    /// `config_fence`, and nothing else (its state and registration have
    /// writes of their own). Written only if the node is still a member and
    /// no push under a higher fence recorded its configuration since (a
    /// handle without one counts as 0). False, with nothing written, when
    /// the push's copy is outdated: another workflow took the node out (a
    /// scale-in of another AZ, which deregisters and drains it), which a copy
    /// read before must not undo; or a newer push configured it after this
    /// one did, whose record of what the node runs must stay.
    pub fn record_config_under(&self, lease: &Lease, n: &NodeRow) -> Result<bool> {
        let fence = match n.handle.get(CONFIG_FENCE) {
            None => 0,
            Some(f) => f.as_i64().ok_or_else(|| StoreError::Decode {
                what: "node handle",
                detail: format!("{CONFIG_FENCE} of node {} is not a whole number: {f}", n.id),
            })?,
        };
        let written = self.with(|c| {
            // The fence is a parameter, so that the statement's text (and what
            // PostgreSQL prepared for it) is the same for every push.
            c.execute(
                &format!(
                    "UPDATE nodes SET handle = ?2, updated_at = ?3
                     WHERE id = ?1 AND state IN ({}) AND coalesce({}, 0) <= CAST(?4 AS BIGINT)
                     AND {}",
                    in_list(&NodeState::MEMBERS),
                    c.dialect().json_number("handle", CONFIG_FENCE),
                    fence_clause(5)
                ),
                vals![
                    &n.id,
                    n.handle.to_string(),
                    self.now(),
                    fence,
                    &lease.group_id,
                    &lease.holder,
                    lease.fence
                ],
            )
        })?;
        self.fenced(lease, written, "node configuration not recorded")?;
        Ok(written > 0)
    }

    /// Makes a provisioning or joining node active, under `lease`: whether it
    /// was (false once it is active already, or left its cluster), so that
    /// of two pushes that configured it only one tells of it.
    pub fn activate_node_under(&self, lease: &Lease, id: &str) -> Result<bool> {
        let set = format!("state = '{}'", NodeState::Active.as_str());
        let joining = in_list(&[NodeState::Provisioning, NodeState::Joining]);
        let condition = format!("state IN ({joining})");
        self.node_set_under(lease, id, &set, &condition, "node not made active")
    }

    /// Marks an active node registered with its distributor, under `lease`:
    /// whether it was (false when the node is not active, having left its
    /// cluster since, or is registered already).
    pub fn register_node_under(&self, lease: &Lease, id: &str) -> Result<bool> {
        let condition = format!(
            "state = '{}' AND registered = 0",
            NodeState::Active.as_str()
        );
        self.node_set_under(
            lease,
            id,
            "registered = 1",
            &condition,
            "node not registered",
        )
    }

    /// Sets `set` (SQL) on node `id` under `lease`, where `condition` (SQL on
    /// its row) holds: whether it did.
    fn node_set_under(
        &self,
        lease: &Lease,
        id: &str,
        set: &str,
        condition: &str,
        what: &str,
    ) -> Result<bool> {
        let written = self.with(|c| {
            c.execute(
                &format!(
                    "UPDATE nodes SET {set}, updated_at = ?2 WHERE id = ?1 AND {condition} AND {}",
                    fence_clause(3)
                ),
                vals![id, self.now(), &lease.group_id, &lease.holder, lease.fence],
            )
        })?;
        self.fenced(lease, written, what)?;
        Ok(written > 0)
    }

    /// Writes `n` over its row under `lease`: the rows written.
    fn node_written_under(&self, lease: &Lease, n: &NodeRow) -> Result<u64> {
        self.with(|c| {
            c.execute(
                &format!(
                    "UPDATE nodes SET state = ?2, registered = ?3, handle = ?4, updated_at = ?5,
                     private_ip = ?6, public_ip = ?7 WHERE id = ?1 AND {}",
                    fence_clause(8)
                ),
                vals![
                    &n.id,
                    n.state.as_str(),
                    n.registered,
                    n.handle.to_string(),
                    self.now(),
                    &n.private_ip,
                    &n.public_ip,
                    &lease.group_id,
                    &lease.holder,
                    lease.fence
                ],
            )
        })
    }

    /// As [`Store::delete_node`], fenced by `lease` in the statement itself
    /// (see [`Store::insert_node_under`]); a node that is gone is no error.
    pub fn delete_node_under(&self, lease: &Lease, id: &str) -> Result<()> {
        let written = self.with(|c| {
            c.execute(
                &format!("DELETE FROM nodes WHERE id = ?1 AND {}", fence_clause(2)),
                vals![id, &lease.group_id, &lease.holder, lease.fence],
            )
        })?;
        self.fenced(lease, written, "node row not deleted")
    }

    /// The group's nodes, oldest first.
    pub fn nodes_of_group(&self, group_id: &str) -> Result<Vec<NodeRow>> {
        self.with(|c| nodes_of_group_in(c, group_id))
    }

    /// Every node's id, group and private address, for a tool that serves many
    /// nodes' APIs from one process (the daemon's benchmark) and tells them
    /// apart by address.
    pub fn node_addresses(&self) -> Result<Vec<(String, String, String)>> {
        self.with(|c| {
            c.query("SELECT id, group_id, private_ip FROM nodes", &[])?
                .iter()
                .map(|r| Ok((r.text(0)?, r.text(1)?, r.text(2)?)))
                .collect()
        })
    }

    // --- addresses --------------------------------------------------------------

    /// Reserves the first free address that `candidate` accepts, in the order given.
    pub fn reserve_address(
        &self,
        owner: &str,
        candidates: impl Iterator<Item = String>,
        mut usable: impl FnMut(&str) -> bool,
    ) -> Result<Option<String>> {
        for addr in candidates {
            let taken = self.with(|c| {
                c.int(
                    "SELECT count(*) FROM addresses WHERE address = ?1",
                    vals![&addr],
                )
            })? > 0;
            if taken || !usable(&addr) {
                continue;
            }
            let inserted = self.with(|c| {
                c.execute(
                    "INSERT INTO addresses (address, owner) VALUES (?1, ?2) ON CONFLICT (address) DO NOTHING",
                    vals![&addr, owner],
                )
            })?;
            if inserted == 1 {
                return Ok(Some(addr));
            }
        }
        Ok(None)
    }
    pub fn release_addresses(&self, owner: &str) -> Result<()> {
        self.with(|c| c.execute("DELETE FROM addresses WHERE owner = ?1", vals![owner]))?;
        Ok(())
    }
}

/// The group's nodes, in their order of creation: one statement.
pub(super) fn nodes_of_group_in(c: &mut dyn Db, group_id: &str) -> Result<Vec<NodeRow>> {
    let rows = c.query(
        "SELECT id, group_id, az, seq, state, private_ip, public_ip, registered, handle, created_at
         FROM nodes WHERE group_id = ?1 ORDER BY seq",
        vals![group_id],
    )?;
    rows.into_iter()
        .map(|r| {
            Ok(NodeRow {
                id: r.text(0)?,
                group_id: r.text(1)?,
                az: r.text(2)?,
                seq: r.int(3)?,
                state: NodeState::parse(&r.text(4)?)?,
                private_ip: r.text(5)?,
                public_ip: r.opt_text(6)?,
                registered: r.int(7)? != 0,
                handle: decode("node handle", &r.text(8)?)?,
                created_at: r.int(9)?,
            })
        })
        .collect()
}
