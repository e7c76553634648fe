//! Where each vserver runs inside an AZ, and who forwards to whom (SE scale-out).
//!
//! Pure: from the AZ's nodes and the SE group's settings to the scale-out role of
//! every node and the targets the `nlb` distributor sends each port to.
//!
//! * A vserver is held by the AZ's oldest `span` member nodes (join order); the
//!   oldest is its primary. The span is what the daemon sized from the holders'
//!   CPU (`lbscale_core::seplan::span_for_cpu`), between `min_scaleout_per_vs`
//!   and `max_scaleout_per_vs`; `min_scaleout_per_vs` until it has. Every node of
//!   the group still runs every vserver (a node reached directly serves it), but
//!   only the holders get its traffic from the distributor.
//! * `native`: the distributor sends the port to the primary (the other nodes,
//!   in join order, only if it does not accept connections); the primary serves
//!   its own share and
//!   forwards the others to the secondaries with the CPU-equalising shares of
//!   `lbscale_core::seplan`.
//! * `bgp`: the distributor spreads flows over every holder by a flow hash (the
//!   ECMP stand-in); no node forwards.
//! * `native_and_bgp`: up to `DEFAULT_ECMP_PATHS` heads take flows by hash; the
//!   other holders are dealt round robin to the heads as their secondaries, as in
//!   seplan's model.
//! * Behind a `dns` distributor clients reach every node directly, so there is no
//!   primary in the path: no roles, and DNS does the spreading.
//!
//! Adding an existing node to a vserver (a larger span) takes one configuration
//! push; when every node of the AZ holds it and they run hot, the group's own
//! scaling adds nodes.

use crate::cloud::Balance;
use lbscale_core::seplan::{self, PlanParams, ScalingMode, DEFAULT_ECMP_PATHS};

/// The SE group settings that placement needs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SeSettings {
    pub mode: ScalingMode,
    /// How many nodes hold the vserver (at most the AZ's).
    pub span: u32,
    pub forwarding_cost: f64,
    pub scalein_timeout_ms: u64,
}

/// One node's scale-out role for a vserver (mirrors the node API's `Scaleout`).
#[derive(Debug, Clone, PartialEq)]
pub enum Role {
    /// Serves `own_share` of the connections it gets and forwards the rest.
    Primary {
        own_share: f64,
        secondaries: Vec<(String, f64)>,
    },
    Secondary,
}

/// Placement of one vserver in one AZ.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct AzPlacement {
    /// Node address -> role (nodes without a role serve only what reaches them).
    pub roles: Vec<(String, Role)>,
    /// Where the distributor sends the vserver's port, in order of preference.
    pub targets: Vec<String>,
    /// How the distributor picks among them.
    pub balance: Balance,
    /// How long a secondary that leaves keeps its forwarded connections.
    pub scalein_timeout_ms: u64,
}

/// Places a vserver on `nodes`: the AZ's member nodes' addresses, oldest first.
pub fn place(settings: &SeSettings, nodes: &[String]) -> AzPlacement {
    let span = nodes.len().min(settings.span.max(1) as usize);
    let holders = &nodes[..span];
    if holders.is_empty() {
        return AzPlacement::default();
    }
    match settings.mode {
        ScalingMode::Bgp => AzPlacement {
            roles: Vec::new(),
            targets: holders.to_vec(),
            balance: Balance::FlowHash,
            scalein_timeout_ms: settings.scalein_timeout_ms,
        },
        ScalingMode::Native => AzPlacement {
            roles: native_roles(settings, holders),
            // The primary; the other nodes only if it does not accept (it
            // died): they serve what reaches them until the engine moves the
            // primary.
            targets: nodes.to_vec(),
            balance: Balance::First,
            scalein_timeout_ms: settings.scalein_timeout_ms,
        },
        ScalingMode::NativeAndBgp => {
            let heads = span.min(DEFAULT_ECMP_PATHS as usize);
            let mut groups: Vec<Vec<String>> =
                holders[..heads].iter().map(|h| vec![h.clone()]).collect();
            for (i, n) in holders[heads..].iter().enumerate() {
                groups[i % heads].push(n.clone());
            }
            AzPlacement {
                roles: groups
                    .iter()
                    .flat_map(|g| native_roles(settings, g))
                    .collect(),
                targets: holders[..heads].to_vec(),
                balance: Balance::FlowHash,
                scalein_timeout_ms: settings.scalein_timeout_ms,
            }
        }
    }
}

/// A primary (the first of `group`) forwarding to the others with seplan's
/// native shares; a group of one has no role.
fn native_roles(settings: &SeSettings, group: &[String]) -> Vec<(String, Role)> {
    if group.len() < 2 {
        return Vec::new();
    }
    let plan = seplan::plan(
        &PlanParams {
            mode: ScalingMode::Native,
            forwarding_cost: settings.forwarding_cost,
            ecmp_paths: DEFAULT_ECMP_PATHS,
        },
        group.len() as u32,
    );
    let mut roles = vec![(
        group[0].clone(),
        Role::Primary {
            own_share: plan.shares[0],
            secondaries: group[1..]
                .iter()
                .cloned()
                .zip(plan.shares[1..].iter().copied())
                .collect(),
        },
    )];
    roles.extend(group[1..].iter().map(|n| (n.clone(), Role::Secondary)));
    roles
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nodes(n: usize) -> Vec<String> {
        (1..=n).map(|i| format!("127.0.0.{i}")).collect()
    }

    fn settings(mode: ScalingMode, span: u32) -> SeSettings {
        SeSettings {
            mode,
            span,
            forwarding_cost: 0.3,
            scalein_timeout_ms: 30_000,
        }
    }

    #[test]
    fn native_sends_everything_to_the_primary_which_forwards_by_seplan_shares() {
        let p = place(&settings(ScalingMode::Native, 4), &nodes(4));
        assert_eq!(p.targets, nodes(4), "the primary first");
        assert_eq!(p.balance, Balance::First);
        let Role::Primary {
            own_share,
            secondaries,
        } = &p.roles[0].1
        else {
            panic!("the oldest node is the primary: {:?}", p.roles)
        };
        // docs/cli.md (se-plan): 4 nodes, cost 0.3 -> [0.032, 0.323, 0.323, 0.323].
        assert!((own_share - 0.032).abs() < 0.001, "{own_share}");
        assert_eq!(secondaries.len(), 3);
        for (_, s) in secondaries {
            assert!((s - 0.323).abs() < 0.001, "{s}");
        }
        let total: f64 = own_share + secondaries.iter().map(|(_, s)| s).sum::<f64>();
        assert!((total - 1.0).abs() < 1e-9);
        assert!(p.roles[1..].iter().all(|(_, r)| *r == Role::Secondary));
    }

    #[test]
    fn only_the_span_holds_the_vserver() {
        let p = place(&settings(ScalingMode::Native, 2), &nodes(5));
        assert_eq!(p.roles.len(), 2);
        // The other nodes stand behind the primary, should it not answer.
        assert_eq!(p.targets, nodes(5));
        let p = place(&settings(ScalingMode::Native, 1), &nodes(3));
        assert!(p.roles.is_empty(), "a span of one forwards nothing");
        let p = place(&settings(ScalingMode::Bgp, 3), &nodes(5));
        assert_eq!(p.targets, nodes(3));
        assert!(p.balance == Balance::FlowHash && p.roles.is_empty());
    }

    #[test]
    fn a_single_node_has_no_role() {
        let p = place(&settings(ScalingMode::Native, 4), &nodes(1));
        assert!(p.roles.is_empty());
        assert_eq!(p.targets, nodes(1));
        assert_eq!(
            place(&settings(ScalingMode::Native, 4), &[]),
            AzPlacement::default()
        );
    }

    #[test]
    fn native_and_bgp_deals_the_others_to_the_heads() {
        let all = nodes(10);
        let p = place(&settings(ScalingMode::NativeAndBgp, 10), &all);
        assert_eq!(p.targets, all[..8].to_vec());
        assert_eq!(p.balance, Balance::FlowHash);
        // Heads 1 and 2 get nodes 9 and 10 as secondaries; the other heads are alone.
        let primaries: Vec<&String> = p
            .roles
            .iter()
            .filter(|(_, r)| matches!(r, Role::Primary { .. }))
            .map(|(n, _)| n)
            .collect();
        assert_eq!(primaries, vec![&all[0], &all[1]]);
        assert_eq!(p.roles.len(), 4);
    }
}
