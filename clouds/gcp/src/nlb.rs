//! The `gcp` `nlb` distributor: an external passthrough network load
//! balancer made of target pools, with one VIP per zone.
//!
//! Per zone of its groups: a static external address in the zone's region
//! (the zone's VIP); per zone and vserver port, a target pool of the nodes
//! placed on that port and a forwarding rule from the VIP's port to it.
//! Target pools rather than a regional backend service over zonal instance
//! groups: a pool takes instances directly, so the port's placement (the
//! primary only, or the holders) is one pool's membership, changed with
//! `addInstance` and `removeInstance`; a backend service would need an
//! instance group per zone and port, and a health check before it sends
//! anything. What target pools lack (IPv6, per-backend capacity) lbscale
//! does not use. Every resource's description names the distributor, which
//! is how a later publication or the removal finds what is stale.

use super::api::{failed, Service};
use super::nodes::instance_name;
use super::{region_of, request_id, GcpCloud};
use lbscale_engine::cloud::{Balance, CloudError, Publication, Result};
use serde_json::{json, Value};
use std::collections::{BTreeMap, BTreeSet};

/// The description of every resource of distributor `id` starts with this.
fn marker(id: &str) -> String {
    format!("lbscale distributor {id}:")
}

/// The address (VIP) of the distributor's zone.
fn address_name(id: &str, zone: &str) -> String {
    instance_name(&format!("{id}-{zone}"))
}

/// The target pool and forwarding rule of the distributor's zone and port.
fn port_name(id: &str, zone: &str, port: u16) -> String {
    instance_name(&format!("{id}-{zone}-{port}"))
}

/// Port -> targets (node addresses) per zone, as the placement says.
fn wanted(publication: &Publication) -> BTreeMap<String, BTreeMap<u16, BTreeSet<String>>> {
    let mut out: BTreeMap<String, BTreeMap<u16, BTreeSet<String>>> = BTreeMap::new();
    for (zone, ports) in &publication.ports {
        let nodes = publication.endpoints.get(zone).cloned().unwrap_or_default();
        for port in ports {
            let placed = publication.port_targets.get(zone).and_then(|p| p.get(port));
            let targets: Vec<String> = match placed {
                // A pool has no ordered failover: the primary only; the
                // engine republishes when it fails.
                Some(t) if t.balance == Balance::First => {
                    t.addresses.iter().take(1).cloned().collect()
                }
                Some(t) => t.addresses.clone(),
                None => nodes.clone(),
            };
            out.entry(zone.clone())
                .or_default()
                .entry(*port)
                .or_default()
                .extend(targets);
        }
    }
    out
}

impl GcpCloud {
    /// The regional resources (`addresses`, `targetPools`, `forwardingRules`)
    /// of distributor `id` in `region`: name -> resource.
    async fn ours(&self, id: &str, region: &str, kind: &str) -> Result<BTreeMap<String, Value>> {
        let what = format!("compute.{kind}.list");
        let mut out = BTreeMap::new();
        let mut page: Option<String> = None;
        loop {
            let mut q = vec![("maxResults", "500".to_string())];
            if let Some(p) = &page {
                q.push(("pageToken", p.clone()));
            }
            let v = self
                .api
                .json(
                    Service::Compute,
                    &what,
                    "GET",
                    &format!("regions/{region}/{kind}"),
                    &q,
                    None,
                )
                .await?;
            for r in v["items"].as_array().into_iter().flatten() {
                if r["description"]
                    .as_str()
                    .is_some_and(|d| d.starts_with(&marker(id)))
                {
                    out.insert(r["name"].as_str().unwrap_or("").to_string(), r.clone());
                }
            }
            page = v["nextPageToken"].as_str().map(str::to_string);
            if page.is_none() {
                return Ok(out);
            }
        }
    }

    /// Inserts `body` into `regions/{region}/{kind}` and waits until it is made.
    async fn insert_regional(&self, region: &str, kind: &str, body: Value) -> Result<()> {
        let what = format!("compute.{kind}.insert");
        let op = self
            .api
            .json(
                Service::Compute,
                &what,
                "POST",
                &format!("regions/{region}/{kind}"),
                &[("requestId", request_id())],
                Some(&body),
            )
            .await?;
        self.api.wait(&what, op).await.map(|_| ())
    }

    /// Deletes `regions/{region}/{kind}/{name}` and waits; gone is fine.
    async fn delete_regional(&self, region: &str, kind: &str, name: &str) -> Result<()> {
        let what = format!("compute.{kind}.delete");
        match self
            .api
            .call(
                Service::Compute,
                &what,
                "DELETE",
                &format!("regions/{region}/{kind}/{name}"),
                &[("requestId", request_id())],
                None,
            )
            .await
        {
            Ok(op) => self.api.wait(&what, op).await.map(|_| ()),
            Err(e) if e.not_found() => Ok(()),
            Err(e) => Err(failed(&what, e)),
        }
    }

    /// Address -> the URL of the instance that has it (private or external), in `zone`.
    async fn instances_by_address(&self, zone: &str) -> Result<BTreeMap<String, String>> {
        let mut out = BTreeMap::new();
        let mut page: Option<String> = None;
        loop {
            let mut q = vec![("maxResults", "500".to_string())];
            if let Some(p) = &page {
                q.push(("pageToken", p.clone()));
            }
            let v = self
                .api
                .json(
                    Service::Compute,
                    "compute.instances.list",
                    "GET",
                    &format!("zones/{zone}/instances"),
                    &q,
                    None,
                )
                .await?;
            for i in v["items"].as_array().into_iter().flatten() {
                let url = self.api.compute_url(&format!(
                    "zones/{zone}/instances/{}",
                    i["name"].as_str().unwrap_or("")
                ));
                for nic in i["networkInterfaces"].as_array().into_iter().flatten() {
                    if let Some(ip) = nic["networkIP"].as_str() {
                        out.insert(ip.to_string(), url.clone());
                    }
                    for ac in nic["accessConfigs"].as_array().into_iter().flatten() {
                        if let Some(ip) = ac["natIP"].as_str() {
                            out.insert(ip.to_string(), url.clone());
                        }
                    }
                }
            }
            page = v["nextPageToken"].as_str().map(str::to_string);
            if page.is_none() {
                return Ok(out);
            }
        }
    }

    /// Makes the load balancer hand out `publication`: a VIP in each zone
    /// with ports, a pool and a rule per port, exactly the targets wanted,
    /// and nothing else of this distributor's.
    pub(super) async fn publish_nlb(&self, id: &str, publication: &Publication) -> Result<()> {
        let wanted: BTreeMap<_, _> = wanted(publication)
            .into_iter()
            .filter(|(_, p)| !p.is_empty())
            .collect();
        let mut rt = self.runtime(id)?;
        let regions_now: BTreeSet<String> =
            wanted.keys().map(|z| region_of(z).to_string()).collect();
        if !regions_now.is_subset(&rt.nlb_regions) {
            rt.nlb_regions.extend(regions_now.iter().cloned());
            self.save_runtime(id, &rt)?;
        }
        let wanted_rules: BTreeSet<String> = wanted
            .iter()
            .flat_map(|(z, ports)| ports.keys().map(move |p| port_name(id, z, *p)))
            .collect();
        let wanted_addresses: BTreeSet<String> =
            wanted.keys().map(|z| address_name(id, z)).collect();
        // What is no longer wanted goes first (rules before their pools and addresses).
        for region in rt.nlb_regions.clone() {
            for kind in ["forwardingRules", "targetPools"] {
                for name in self.ours(id, &region, kind).await?.keys() {
                    if !wanted_rules.contains(name) {
                        self.delete_regional(&region, kind, name).await?;
                    }
                }
            }
            for name in self.ours(id, &region, "addresses").await?.keys() {
                if !wanted_addresses.contains(name) {
                    self.delete_regional(&region, "addresses", name).await?;
                }
            }
        }
        let mut vips = BTreeMap::new();
        for (zone, ports) in &wanted {
            let region = region_of(zone);
            let vip = self.zone_address(id, zone).await?;
            let instances = self.instances_by_address(zone).await?;
            let pools = self.ours(id, region, "targetPools").await?;
            let rules = self.ours(id, region, "forwardingRules").await?;
            for (port, targets) in ports {
                let name = port_name(id, zone, *port);
                let members: BTreeSet<String> = targets
                    .iter()
                    .map(|ip| {
                        instances.get(ip).cloned().ok_or_else(|| {
                            CloudError::Failed(format!(
                                "no instance in {zone} has the address {ip} that the nlb distributor {id} must send port {port} to"
                            ))
                        })
                    })
                    .collect::<Result<_>>()?;
                self.pool_members(id, zone, *port, &name, pools.get(&name), &members)
                    .await?;
                if !rules.contains_key(&name) {
                    self.insert_regional(
                        region,
                        "forwardingRules",
                        json!({
                            "name": name,
                            "description": format!("{} zone {zone} port {port}", marker(id)),
                            "IPAddress": vip, "IPProtocol": "TCP", "portRange": format!("{port}-{port}"),
                            "loadBalancingScheme": "EXTERNAL",
                            "target": self.api.compute_url(&format!("regions/{region}/targetPools/{name}")),
                        }),
                    )
                    .await?;
                }
            }
            vips.insert(zone.clone(), vip);
        }
        rt.nlb_addresses = vips;
        rt.nlb_regions = regions_now;
        self.save_runtime(id, &rt)
    }

    /// The VIP of `zone`, reserved when it is not yet.
    async fn zone_address(&self, id: &str, zone: &str) -> Result<String> {
        let region = region_of(zone);
        let name = address_name(id, zone);
        let path = format!("regions/{region}/addresses/{name}");
        let get = || {
            self.api.call(
                Service::Compute,
                "compute.addresses.get",
                "GET",
                &path,
                &[],
                None,
            )
        };
        let a = match get().await {
            Ok(a) => a,
            Err(e) if e.not_found() => {
                self.insert_regional(
                    region,
                    "addresses",
                    json!({"name": name, "addressType": "EXTERNAL",
                           "description": format!("{} zone {zone}", marker(id))}),
                )
                .await?;
                get()
                    .await
                    .map_err(|e| failed("compute.addresses.get", e))?
            }
            Err(e) => return Err(failed("compute.addresses.get", e)),
        };
        a["address"].as_str().map(str::to_string).ok_or_else(|| {
            CloudError::Failed(format!(
                "GCP compute.addresses.get: address {name} has no IP"
            ))
        })
    }

    /// Makes pool `name` hold exactly `members` (instance URLs).
    async fn pool_members(
        &self,
        id: &str,
        zone: &str,
        port: u16,
        name: &str,
        pool: Option<&Value>,
        members: &BTreeSet<String>,
    ) -> Result<()> {
        let region = region_of(zone);
        let Some(pool) = pool else {
            return self
                .insert_regional(
                    region,
                    "targetPools",
                    json!({"name": name, "description": format!("{} zone {zone} port {port}", marker(id)),
                           "instances": members, "sessionAffinity": "NONE"}),
                )
                .await;
        };
        // Compared without the URL's host: the API may name them under another base.
        let path = |u: &str| u.split("/projects/").nth(1).unwrap_or(u).to_string();
        let now: BTreeMap<String, String> = pool["instances"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|u| u.as_str().map(|u| (path(u), u.to_string())))
            .collect();
        let want: BTreeMap<String, String> = members.iter().map(|u| (path(u), u.clone())).collect();
        let add: Vec<Value> = want
            .iter()
            .filter(|(k, _)| !now.contains_key(*k))
            .map(|(_, u)| json!({"instance": u}))
            .collect();
        let remove: Vec<Value> = now
            .iter()
            .filter(|(k, _)| !want.contains_key(*k))
            .map(|(_, u)| json!({"instance": u}))
            .collect();
        for (verb, list) in [("addInstance", add), ("removeInstance", remove)] {
            if list.is_empty() {
                continue;
            }
            let what = format!("compute.targetPools.{verb}");
            let op = self
                .api
                .json(
                    Service::Compute,
                    &what,
                    "POST",
                    &format!("regions/{region}/targetPools/{name}/{verb}"),
                    &[("requestId", request_id())],
                    Some(&json!({"instances": list})),
                )
                .await?;
            self.api.wait(&what, op).await?;
        }
        Ok(())
    }

    /// Deletes every rule, pool and address of distributor `id`.
    pub(super) async fn remove_nlb(&self, id: &str) -> Result<()> {
        let mut rt = self.runtime(id)?;
        for region in rt.nlb_regions.clone() {
            for kind in ["forwardingRules", "targetPools", "addresses"] {
                for name in self.ours(id, &region, kind).await?.keys() {
                    self.delete_regional(&region, kind, name).await?;
                }
            }
        }
        rt.nlb_addresses.clear();
        rt.nlb_regions.clear();
        self.save_runtime(id, &rt)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lbscale_engine::cloud::PortTargets;

    #[test]
    fn pools_follow_the_placement() {
        let mut p = Publication::default();
        p.endpoints.insert(
            "us-central1-a".into(),
            vec!["10.0.0.1".into(), "10.0.0.2".into()],
        );
        p.ports.insert("us-central1-a".into(), vec![80, 443, 53]);
        let mut placed = BTreeMap::new();
        placed.insert(
            443,
            PortTargets {
                addresses: vec!["10.0.0.2".into(), "10.0.0.1".into()],
                balance: Balance::First,
            },
        );
        placed.insert(
            53,
            PortTargets {
                addresses: vec!["10.0.0.1".into()],
                balance: Balance::FlowHash,
            },
        );
        p.port_targets.insert("us-central1-a".into(), placed);
        let w = &wanted(&p)["us-central1-a"];
        let ips = |port: u16| w[&port].iter().cloned().collect::<Vec<_>>();
        assert_eq!(ips(80), ["10.0.0.1", "10.0.0.2"]);
        assert_eq!(ips(443), ["10.0.0.2"]);
        assert_eq!(ips(53), ["10.0.0.1"]);
        assert_ne!(
            port_name("d", "us-central1-a", 80),
            port_name("d", "us-central1-a", 8080)
        );
    }
}
