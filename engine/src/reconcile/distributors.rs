//! Traffic distributors: create, update, delete, view, and the publication of
//! what each hands out (the registered nodes and the vservers' ports).
//!
//! Publication is level-triggered (docs/design.md, section 3): what a
//! distributor must hand out is computed from the store, what it serves is what
//! its driver last confirmed (kept in the store only after the driver returns),
//! and while the two differ there is unfinished work, which the daemon retries
//! with back-off ([`Engine::settle_publication`]). A node row leaves the store
//! only after a publication without it was confirmed.

use super::leases::KeptLease;
use super::{new_id, Engine, EngineError, Result};
use crate::cloud::{Distributor, Publication};
use crate::model::{CloudName, DistributorMode, DistributorSpec, GroupSpec, VserverSpec};
use crate::store::{distributor_lease_key, NodeRow, Row};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

#[derive(Debug, Clone)]
pub struct DistributorView {
    pub id: String,
    pub spec: DistributorSpec,
    pub endpoints: Vec<String>,
    pub address: BTreeMap<String, String>,
}

/// What a distributor's driver last confirmed: the settings it was published
/// with (a TTL or domain change is a publication too) and what it hands out.
#[derive(Debug, PartialEq, serde::Serialize, serde::Deserialize)]
struct Served {
    spec: DistributorSpec,
    publication: Publication,
}

/// How long a publication waits for another process's publication to the same
/// distributor (each takes at most the driver's own publish timeout: a Route 53
/// change may take two minutes to be in sync, plus its calls' retries).
const PUBLISH_LEASE_WAIT: Duration = Duration::from_secs(300);

impl Engine {
    fn distributor_driver(&self, cloud: CloudName) -> Result<&dyn Distributor> {
        Ok(self.clouds.distributors(cloud.as_str())?)
    }

    /// Creates the distributor and starts it with nothing to hand out. One
    /// with the same name and settings already in the store (an apply that
    /// stopped after recording it, before Terraform saved it) is adopted and
    /// finished, not refused as a name taken.
    pub async fn create_distributor(&self, spec: &DistributorSpec) -> Result<String> {
        self.distributor_driver(spec.cloud)?;
        let id = match self.store.distributor_by_name(&spec.name)? {
            Some(existing) if existing.spec == *spec => existing.id,
            _ => {
                let id = new_id("td");
                self.store.insert_distributor(&id, spec)?;
                id
            }
        };
        self.publish(&id).await?;
        Ok(id)
    }

    pub async fn update_distributor(&self, id: &str, spec: &DistributorSpec) -> Result<()> {
        self.store.update_distributor(id, spec)?;
        self.publish(id).await
    }

    /// Stops the distributor and forgets it. Groups that still name it keep
    /// serving through their nodes; Terraform replaces a distributor by destroying
    /// it before the groups move to the new one, so this is not refused. A group
    /// left pointing at a distributor that is gone gets a plan-time error.
    pub async fn delete_distributor(&self, id: &str) -> Result<()> {
        let Some(row) = self.store.distributor(id)? else {
            return Ok(());
        };
        for g in self.store.groups_of_distributor(id)? {
            self.store.record_event(
                &g.id,
                None,
                "distributor_removed",
                &format!("traffic distributor {:?} destroyed", row.spec.name),
            )?;
        }
        // Under the distributor's lease: a publication in flight (the daemon's)
        // must not restart the process that this removes.
        let turn = self
            .lease(
                &distributor_lease_key(id),
                Instant::now() + PUBLISH_LEASE_WAIT,
            )
            .await?;
        self.distributor_driver(row.spec.cloud)?.remove(id).await?;
        // Deletes the lease row too.
        self.store.delete_distributor(id)?;
        drop(turn);
        Ok(())
    }

    /// The distributor named `name`, if there is one.
    pub fn distributor_named(&self, name: &str) -> Result<Option<Row<DistributorSpec>>> {
        Ok(self.store.distributor_by_name(name)?)
    }

    pub fn distributor_view(&self, id: &str) -> Result<Option<DistributorView>> {
        let Some(row) = self.store.distributor(id)? else {
            return Ok(None);
        };
        let driver = self.distributor_driver(row.spec.cloud)?;
        let served = self.served(id)?.map(|s| s.publication).unwrap_or_default();
        Ok(Some(DistributorView {
            endpoints: served.endpoints.values().flatten().cloned().collect(),
            address: driver.addresses(id, &row.spec),
            id: row.id,
            spec: row.spec,
        }))
    }

    /// What the distributor's driver last confirmed it hands out; `None` before
    /// its first confirmed publication.
    fn served(&self, distributor_id: &str) -> Result<Option<Served>> {
        Self::served_from(self.store.served_publication(distributor_id)?.as_deref())
    }

    /// [`Engine::served`] from the stored text.
    fn served_from(json: Option<&str>) -> Result<Option<Served>> {
        let Some(json) = json else {
            return Ok(None);
        };
        serde_json::from_str(json)
            .map(Some)
            .map_err(|e| EngineError::Step {
                step: "read what the distributor serves",
                detail: e.to_string(),
            })
    }

    /// Publishes when what the distributor serves is not what the store says
    /// it must hand out (a publication that failed, or one never made);
    /// returns whether it did. The daemon calls it for every distributor, so a
    /// failed publication is retried until it is served.
    pub async fn settle_publication(&self, distributor_id: &str) -> Result<bool> {
        let Some((row, served)) = self.store.distributor_and_served(distributor_id)? else {
            return Ok(false);
        };
        let publication = self.publication_of(&row)?;
        let wanted = Served {
            spec: row.spec,
            publication,
        };
        if Self::served_from(served.as_deref())?.as_ref() == Some(&wanted) {
            return Ok(false);
        }
        self.publish(distributor_id).await?;
        Ok(true)
    }

    /// Whether what the distributor serves (`served`, as stored) is what it
    /// must hand out when its only group is `group`, with these vservers and
    /// stored nodes (what an evaluation of the daemon read already); `None`
    /// when the inputs cannot tell: an `nlb` (its port targets need the
    /// placements). Nothing is read.
    pub(crate) fn dns_publication_settled(
        distributor: &DistributorSpec,
        served: Option<&str>,
        group: &Row<GroupSpec>,
        vservers: &[Row<VserverSpec>],
        nodes: &[NodeRow],
    ) -> Result<Option<bool>> {
        if distributor.mode != DistributorMode::Dns {
            return Ok(None);
        }
        let mut publication = Publication::default();
        add_group(&mut publication, group, vservers, nodes, true);
        let wanted = Served {
            spec: distributor.clone(),
            publication,
        };
        Ok(Some(Self::served_from(served)?.as_ref() == Some(&wanted)))
    }

    /// What the distributor must hand out now: every registered node of every group
    /// that uses it, and the ports of the vservers placed on those groups.
    fn publication_of(&self, row: &Row<DistributorSpec>) -> Result<Publication> {
        let mut p = Publication::default();
        let dns = row.spec.mode == DistributorMode::Dns;
        let nlb = row.spec.mode == DistributorMode::Nlb;
        for g in self.store.groups_of_distributor(&row.id)? {
            let vservers = self.store.vservers_of_group(&g.id)?;
            let nodes = self.store.nodes_of_group(&g.id)?;
            let registered = add_group(&mut p, &g, &vservers, &nodes, dns);
            if nlb {
                self.add_port_targets(&mut p, &g, &registered, vservers)?;
            }
        }
        Ok(p)
    }

    /// SE scale-out: a port of the group's vservers goes to its primary, or to
    /// its holders by flow hash. Vservers of several groups on one port share it.
    fn add_port_targets(
        &self,
        p: &mut Publication,
        g: &Row<GroupSpec>,
        registered: &[&NodeRow],
        vservers: Vec<Row<VserverSpec>>,
    ) -> Result<()> {
        let nlb = self.store.nlb_rows(&g.id)?;
        let placements = super::spans::placements_of(g, registered, &vservers, &nlb);
        let ports_of: BTreeMap<String, u16> = vservers
            .into_iter()
            .filter(|v| v.spec.service_type != "UDP")
            .map(|v| (v.spec.name, v.spec.port as u16))
            .collect();
        for ((vserver, az), placed) in placements {
            let Some(port) = ports_of.get(&vserver) else {
                continue;
            };
            let t = p
                .port_targets
                .entry(az)
                .or_default()
                .entry(*port)
                .or_default();
            for a in placed.targets {
                if !t.addresses.contains(&a) {
                    t.addresses.push(a);
                }
            }
            // Groups sharing a port: flow hash wins over primary-first, which
            // wins over round robin.
            t.balance = t.balance.max(placed.balance);
        }
        Ok(())
    }

    /// Makes the distributor hand out what the store says now; a distributor
    /// that is gone (destroyed for a replacement) has nothing left to update.
    ///
    /// One publication at a time per distributor, across processes (the
    /// distributor's lease): the daemon and a Terraform apply, or two groups of
    /// one apply, may change what a distributor hands out at the same moment.
    /// Each reads the store and bumps the distributor's configuration version;
    /// interleaved, the later write could carry the earlier view under the same
    /// version and a registration would be lost until the next publication.
    pub(crate) async fn publish(&self, distributor_id: &str) -> Result<()> {
        // A distributor destroyed under its groups (to be replaced) has nothing
        // to publish, and must not get a lease row that nothing would delete.
        if self.store.distributor(distributor_id)?.is_none() {
            return Ok(());
        }
        let turn = self
            .lease(
                &distributor_lease_key(distributor_id),
                Instant::now() + PUBLISH_LEASE_WAIT,
            )
            .await?;
        let r = self.publish_holding_lease(distributor_id, &turn).await;
        turn.release();
        r
    }

    /// Publishes under `turn`, the distributor's lease: checked before the
    /// driver is called, its fence given to the driver (which may refuse a
    /// publication older than one it applied) and in the statement that
    /// records what is served, so a holder that lost the lease unawares
    /// neither overwrites its successor's publication nor records its own.
    async fn publish_holding_lease(&self, distributor_id: &str, turn: &KeptLease) -> Result<()> {
        let Some(row) = self.store.distributor(distributor_id)? else {
            return Ok(());
        };
        let publication = self.publication_of(&row)?;
        turn.check()?;
        self.distributor_driver(row.spec.cloud)?
            .publish_fenced(distributor_id, &row.spec, &publication, turn.lease().fence)
            .await
            .map_err(|e| EngineError::Step {
                step: super::PUBLISH_STEP,
                detail: e.to_string(),
            })?;
        // Only now, confirmed by the driver, is it what the distributor serves.
        let served = Served {
            spec: row.spec,
            publication,
        };
        let served = serde_json::to_string(&served).expect("publications serialise");
        self.store
            .set_served_publication_under(turn.lease(), distributor_id, &served)?;
        Ok(())
    }
}

/// Adds one group of the distributor to `p`: its AZs' subnets, the ports of
/// its vservers (UDP has no port to forward), and its registered nodes'
/// addresses, public ones behind `dns` (where the cloud gives them) and
/// private ones behind an `nlb`. Returns those nodes.
fn add_group<'a>(
    p: &mut Publication,
    g: &Row<GroupSpec>,
    vservers: &[Row<VserverSpec>],
    nodes: &'a [NodeRow],
    dns: bool,
) -> Vec<&'a NodeRow> {
    let mut ports: Vec<u16> = vservers
        .iter()
        .filter(|v| v.spec.service_type != "UDP")
        .map(|v| v.spec.port as u16)
        .collect();
    ports.sort_unstable();
    ports.dedup();
    for az in &g.spec.availability_zones {
        if let Some(subnet) = g.spec.node.as_ref().and_then(|n| n.subnet_for(az)) {
            p.subnets
                .entry(az.clone())
                .or_default()
                .insert(subnet.to_string());
        }
        p.endpoints.entry(az.clone()).or_default();
        let e = p.ports.entry(az.clone()).or_default();
        e.extend(&ports);
        e.sort_unstable();
        e.dedup();
    }
    let registered: Vec<&NodeRow> = nodes.iter().filter(|n| n.registered).collect();
    for n in &registered {
        p.endpoints
            .entry(n.az.clone())
            .or_default()
            .push(match (&n.public_ip, dns) {
                (Some(public), true) => public.clone(),
                _ => n.private_ip.clone(),
            });
    }
    registered
}
