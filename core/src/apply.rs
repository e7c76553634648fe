//! Apply's own decisions (docs/design.md, "Apply"): from a group's declared shape
//! and the nodes observed, which nodes are removed at once, which leave through
//! the scale-in workflow and how many start in each AZ.
//!
//! Like [`crate::policy::step`], a pure function: the engine observes (the store,
//! the cloud), calls [`plan`], and carries out what it returns.

use std::collections::BTreeMap;

/// Where a node stands, as the engine observed it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Life {
    /// Provisioning, joining or active, and its machine is there.
    Member,
    /// On its way out (draining, deprovisioning): an earlier run started to
    /// remove it, and this one finishes.
    Leaving,
    /// Marked failed, or a member whose machine is gone: nothing to drain.
    Failed,
}

/// One node of the group, as observed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObservedNode {
    pub id: String,
    pub az: String,
    /// Creation order within the group: larger is newer.
    pub seq: i64,
    pub life: Life,
}

/// What the group declares.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Shape {
    pub availability_zones: Vec<String>,
    pub min_nodes: u32,
    pub max_nodes: u32,
}

/// Why a node leaves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaveReason {
    /// An earlier run had started to remove it.
    AlreadyLeaving,
    /// Its AZ is no longer declared.
    AzRemoved,
    /// Its AZ has more than `max_nodes` members.
    OverMax,
}

/// What an apply does.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Plan {
    /// Failed nodes: removed at once, without a drain.
    pub remove_failed: Vec<String>,
    /// Nodes that leave through the scale-in workflow, with why.
    pub leave: Vec<(String, LeaveReason)>,
    /// Nodes to start per declared AZ, to reach `min_nodes` (AZs needing none are
    /// left out).
    pub start: BTreeMap<String, u32>,
}

impl Plan {
    /// Whether the apply has nothing to add or remove.
    pub fn is_empty(&self) -> bool {
        self.remove_failed.is_empty() && self.leave.is_empty() && self.start.is_empty()
    }
}

/// The apply's plan for `nodes` (any order). A count between `min_nodes` and
/// `max_nodes` (the daemon's) is kept as it is: only nodes over `max_nodes`
/// leave, the newest first, and only AZs under `min_nodes` get new nodes.
pub fn plan(shape: &Shape, nodes: &[ObservedNode]) -> Plan {
    let mut nodes: Vec<&ObservedNode> = nodes.iter().collect();
    nodes.sort_by(|a, b| a.seq.cmp(&b.seq).then_with(|| a.id.cmp(&b.id)));
    let declared = |az: &str| shape.availability_zones.iter().any(|z| z == az);

    let mut out = Plan::default();
    for n in &nodes {
        match n.life {
            Life::Failed => out.remove_failed.push(n.id.clone()),
            Life::Leaving => out.leave.push((n.id.clone(), LeaveReason::AlreadyLeaving)),
            Life::Member if !declared(&n.az) => {
                out.leave.push((n.id.clone(), LeaveReason::AzRemoved))
            }
            Life::Member => {}
        }
    }
    for az in &shape.availability_zones {
        let members: Vec<&&ObservedNode> = nodes
            .iter()
            .filter(|n| n.life == Life::Member && &n.az == az)
            .collect();
        let extra = members.len().saturating_sub(shape.max_nodes as usize);
        let leaving = members.iter().rev().take(extra);
        out.leave
            .extend(leaving.map(|n| (n.id.clone(), LeaveReason::OverMax)));
        let staying = (members.len() - extra) as u32;
        if staying < shape.min_nodes {
            out.start.insert(az.clone(), shape.min_nodes - staying);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(azs: &[&str], min: u32, max: u32) -> Shape {
        Shape {
            availability_zones: azs.iter().map(|s| s.to_string()).collect(),
            min_nodes: min,
            max_nodes: max,
        }
    }

    fn node(id: &str, az: &str, seq: i64, life: Life) -> ObservedNode {
        ObservedNode {
            id: id.into(),
            az: az.into(),
            seq,
            life,
        }
    }

    #[test]
    fn a_new_group_starts_min_nodes_in_every_az() {
        let p = plan(&shape(&["az1", "az2"], 2, 4), &[]);
        assert_eq!(
            p.start,
            BTreeMap::from([("az1".into(), 2), ("az2".into(), 2)])
        );
        assert!(p.leave.is_empty() && p.remove_failed.is_empty());
    }

    #[test]
    fn a_count_the_daemon_set_within_bounds_is_kept() {
        let nodes = [
            node("a", "az1", 1, Life::Member),
            node("b", "az1", 2, Life::Member),
            node("c", "az1", 3, Life::Member),
        ];
        assert!(plan(&shape(&["az1"], 1, 4), &nodes).is_empty());
    }

    #[test]
    fn over_max_the_newest_leave_whatever_the_input_order() {
        let nodes = [
            node("c", "az1", 3, Life::Member),
            node("a", "az1", 1, Life::Member),
            node("b", "az1", 2, Life::Member),
        ];
        let p = plan(&shape(&["az1"], 1, 1), &nodes);
        assert_eq!(
            p.leave,
            vec![
                ("c".into(), LeaveReason::OverMax),
                ("b".into(), LeaveReason::OverMax)
            ]
        );
        assert!(p.start.is_empty());
    }

    #[test]
    fn a_removed_az_leaves_whole_and_a_failed_node_is_replaced() {
        let nodes = [
            node("a", "az1", 1, Life::Failed),
            node("b", "az2", 2, Life::Member),
            node("c", "az1", 3, Life::Leaving),
        ];
        let p = plan(&shape(&["az1"], 1, 2), &nodes);
        assert_eq!(p.remove_failed, vec!["a".to_string()]);
        assert_eq!(
            p.leave,
            vec![
                ("b".into(), LeaveReason::AzRemoved),
                ("c".into(), LeaveReason::AlreadyLeaving)
            ]
        );
        // Neither the failed nor the leaving node counts: az1 needs one new node.
        assert_eq!(p.start, BTreeMap::from([("az1".into(), 1)]));
    }
}
