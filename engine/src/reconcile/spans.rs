//! Spans: the placement of each vserver over the nodes of an AZ behind an
//! `nlb` (primary and secondaries), and how many nodes hold it.

use super::{Engine, Result};
use crate::model::{DistributorMode, GroupSpec, SeGroupSpec, VserverSpec};
use crate::placement;
use crate::store::{NlbRows, NodeRow, Row};
use lbscale_core::seplan::ScalingMode;
use std::collections::BTreeMap;

/// One vserver in one AZ behind an `nlb`: the nodes that hold it now and what
/// its span may be, for the daemon to size it from their CPU.
#[derive(Debug, Clone)]
pub struct SpanView {
    pub vserver_id: String,
    pub vserver: String,
    pub az: String,
    /// Node ids, the primary first; as many as the span (or the AZ has).
    pub holders: Vec<String>,
    pub span: u32,
    pub min: u32,
    pub max: u32,
    pub plan: lbscale_core::seplan::PlanParams,
}

impl Engine {
    /// The vservers' placements in the group's AZs over `nodes` (oldest first),
    /// keyed by (vserver, AZ). Empty unless the distributor is an `nlb`: behind
    /// DNS, clients reach every node directly and no node forwards.
    pub(super) fn placements(
        &self,
        group: &Row<GroupSpec>,
        nodes: &[&NodeRow],
    ) -> Result<Placements> {
        if !self.behind_nlb(&group.spec)? {
            return Ok(BTreeMap::new());
        }
        self.placements_behind_nlb(group, nodes)
    }

    /// [`Engine::placements`] of a group known to be behind an `nlb`.
    pub(super) fn placements_behind_nlb(
        &self,
        group: &Row<GroupSpec>,
        nodes: &[&NodeRow],
    ) -> Result<Placements> {
        let vservers = self.store.vservers_of_group(&group.id)?;
        let nlb = self.store.nlb_rows(&group.id)?;
        Ok(placements_of(group, nodes, &vservers, &nlb))
    }

    /// Whether the group's distributor is an `nlb`: only behind one does a
    /// vserver have a span, a primary and secondaries.
    pub(super) fn behind_nlb(&self, group: &GroupSpec) -> Result<bool> {
        Ok(self
            .store
            .distributor(&group.traffic_distributor_id)?
            .is_some_and(|d| d.spec.mode == DistributorMode::Nlb))
    }

    /// Every vserver of the group in every AZ behind an `nlb` distributor, with
    /// the nodes that hold it (what `Engine::placements` places over). Empty
    /// behind `dns`: clients reach every node, there is no span to size.
    pub fn vserver_spans(&self, group_id: &str) -> Result<Vec<SpanView>> {
        let Some(group) = self.store.group(group_id)? else {
            return Ok(Vec::new());
        };
        if !self.behind_nlb(&group.spec)? {
            return Ok(Vec::new());
        }
        let nodes = self.store.nodes_of_group(group_id)?;
        let vservers = self.store.vservers_of_group(group_id)?;
        let nlb = self.store.nlb_rows(group_id)?;
        Ok(spans_of(&group, &nodes, &vservers, &nlb))
    }

    /// Sets how many nodes of `az` hold the vserver, records why, and pushes the
    /// new roles and shares to the nodes and the new targets to the distributor
    /// (adding an existing node to a vserver takes one push, not a new node).
    /// `claim`: the daemon's claim on the group, which the write is fenced by.
    pub async fn set_vserver_span(
        &self,
        group_id: &str,
        vserver_id: &str,
        az: &str,
        span: u32,
        reason: &str,
        claim: Option<&crate::store::Lease>,
    ) -> Result<()> {
        self.store.set_vserver_span(vserver_id, az, span, claim)?;
        self.store
            .record_event(group_id, Some(az), "vserver_span", reason)?;
        self.redeploy(Some(group_id.to_string())).await
    }
}

/// `min_scaleout_per_vs` .. `max_scaleout_per_vs`, at least one node.
fn span_bounds(se: &SeGroupSpec) -> (u32, u32) {
    let min = se.min_scaleout_per_vs.clamp(1, i64::from(u32::MAX)) as u32;
    let max = (se.max_scaleout_per_vs.clamp(1, i64::from(u32::MAX)) as u32).max(min);
    (min, max)
}

/// Where each vserver is placed in each AZ, by (vserver name, AZ).
pub(crate) type Placements = BTreeMap<(String, String), placement::AzPlacement>;

/// The vservers' placements in the group's AZs over `nodes` (oldest first),
/// keyed by (vserver, AZ), from what the store holds of them (`vservers`,
/// `nlb`): reads nothing.
pub(crate) fn placements_of(
    group: &Row<GroupSpec>,
    nodes: &[&NodeRow],
    vservers: &[Row<VserverSpec>],
    nlb: &NlbRows,
) -> Placements {
    let mut out = BTreeMap::new();
    for (v, se) in with_se_groups(vservers, nlb) {
        for az in &group.spec.availability_zones {
            let settings = placement::SeSettings {
                mode: ScalingMode::parse(&se.scaling_mode).unwrap_or(ScalingMode::Native),
                span: span_in(nlb, &v.id, az, se),
                forwarding_cost: se.primary_forwarding_cost,
                scalein_timeout_ms: se.vs_scalein_timeout.get().as_millis() as u64,
            };
            let mut in_az: Vec<&&NodeRow> = nodes.iter().filter(|n| &n.az == az).collect();
            in_az.sort_by_key(|n| n.seq);
            let addresses: Vec<String> = in_az.iter().map(|n| n.private_ip.clone()).collect();
            out.insert(
                (v.spec.name.clone(), az.clone()),
                placement::place(&settings, &addresses),
            );
        }
    }
    out
}

/// Every vserver of the group in every AZ with the nodes that hold it, from
/// what the store holds (`nodes`, `vservers`, `nlb`): reads nothing.
pub(crate) fn spans_of(
    group: &Row<GroupSpec>,
    nodes: &[NodeRow],
    vservers: &[Row<VserverSpec>],
    nlb: &NlbRows,
) -> Vec<SpanView> {
    let mut members: Vec<&NodeRow> = nodes.iter().filter(|n| n.is_reachable_member()).collect();
    members.sort_by_key(|n| n.seq);
    let mut out = Vec::new();
    for (v, se) in with_se_groups(vservers, nlb) {
        let (min, max) = span_bounds(se);
        let plan = lbscale_core::seplan::PlanParams {
            mode: ScalingMode::parse(&se.scaling_mode).unwrap_or(ScalingMode::Native),
            forwarding_cost: se.primary_forwarding_cost,
            ..Default::default()
        };
        for az in &group.spec.availability_zones {
            let span = span_in(nlb, &v.id, az, se);
            let holders = members
                .iter()
                .filter(|n| &n.az == az)
                .take(span as usize)
                .map(|n| n.id.clone())
                .collect();
            out.push(SpanView {
                vserver_id: v.id.clone(),
                vserver: v.spec.name.clone(),
                az: az.clone(),
                holders,
                span,
                min,
                max,
                plan,
            });
        }
    }
    out
}

/// Each vserver with its SE group (one whose SE group is gone has none to
/// place it by, and is left out).
fn with_se_groups<'a>(
    vservers: &'a [Row<VserverSpec>],
    nlb: &'a NlbRows,
) -> impl Iterator<Item = (&'a Row<VserverSpec>, &'a SeGroupSpec)> {
    vservers.iter().filter_map(|v| {
        let se = nlb.se_groups.iter().find(|s| s.id == v.spec.se_group_id)?;
        Some((v, &se.spec))
    })
}

/// How many nodes of `az` hold the vserver: as the daemon sized it, else
/// `min_scaleout_per_vs`; within the SE group's bounds.
fn span_in(nlb: &NlbRows, vserver_id: &str, az: &str, se: &SeGroupSpec) -> u32 {
    let (min, max) = span_bounds(se);
    nlb.spans
        .get(&(vserver_id.to_string(), az.to_string()))
        .copied()
        .unwrap_or(min)
        .clamp(min, max)
}
