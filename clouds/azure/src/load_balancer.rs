//! The azure `nlb` distributor: one Standard Load Balancer per distributor,
//! public as the aws `nlb` is internet-facing.
//!
//! - one frontend per availability zone on a public IP of its own
//!   (`lbscale-<id>-fe-<zone>`: Standard, static, in that zone, tagged
//!   `lbscale-distributor-id`): one VIP per zone, as the local and aws `nlb`.
//!   A public frontend takes its zone from its address (Azure refuses
//!   `zones` on it). Addresses of zones no longer served are deleted after
//!   the load balancer lets go of them;
//! - a backend pool per zone of the zone's serving nodes (by address); a
//!   port whose targets are not all of them (SE scale-out) gets a pool of its
//!   own in the zone: the native primary only (`First`: the load balancer
//!   has no ordered failover, and the engine republishes when the primary
//!   fails), or the holders (`FlowHash`: the load balancer's 5-tuple hash);
//! - a TCP health probe and a rule per published port and zone.
//!
//! The load balancer is one resource that other writers may change too: it
//! is read, the whole wanted body is put with `If-Match` of the ETag read,
//! and a 412 (someone wrote in between) reads it again.

use super::AzureCloud;
use lbscale_engine::cloud::{Balance, CloudError, Publication, Result};
use serde_json::{json, Value};
use std::collections::{BTreeMap, BTreeSet};

const NET_VERSION: &str = "2025-07-01";

/// What the load balancer must be: frontends, pools, probes and rules.
#[derive(Debug, Clone, Eq, Default)]
struct Shape {
    /// Frontend name -> its public IP's id, lower case.
    frontends: BTreeMap<String, String>,
    /// Zone -> the virtual network of its backend addresses (not compared:
    /// ARM keeps it in each address).
    vnets: BTreeMap<String, String>,
    /// Pool name -> addresses.
    pools: BTreeMap<String, BTreeSet<String>>,
    /// Probe name -> port.
    probes: BTreeMap<String, i64>,
    /// Rule name -> (frontend, pool, probe, port).
    rules: BTreeMap<String, (String, String, String, i64)>,
}

impl PartialEq for Shape {
    fn eq(&self, o: &Shape) -> bool {
        (&self.frontends, &self.pools, &self.probes, &self.rules)
            == (&o.frontends, &o.pools, &o.probes, &o.rules)
    }
}

const DISTRIBUTOR_TAG: &str = "lbscale-distributor-id";

impl AzureCloud {
    /// The public IP of the frontend of zone `zone`.
    fn frontend_ip_name(id: &str, zone: &str) -> String {
        format!("{}-fe-{}", Self::name_of(id, 70), zone)
    }

    fn lb_path(&self, id: &str) -> String {
        self.arm.in_group(
            &self.resource_group,
            &format!("Microsoft.Network/loadBalancers/{}", Self::name_of(id, 80)),
        )
    }

    /// Makes the load balancer hand out `publication` (none when nothing is
    /// published: it costs while it exists).
    pub(super) async fn publish_nlb(&self, id: &str, publication: &Publication) -> Result<()> {
        let wanted = wanted_shape(publication, |zone| {
            self.public_ip_path(&Self::frontend_ip_name(id, zone))
                .to_ascii_lowercase()
        })?;
        if wanted.frontends.is_empty() {
            self.remove_nlb(id).await?;
            return Ok(());
        }
        // Each zone's address first: the frontends refer to them.
        let tags: BTreeMap<String, String> = [(DISTRIBUTOR_TAG.to_string(), id.to_string())].into();
        let mut vips = BTreeMap::new();
        for zone in wanted.vnets.keys() {
            let ip = self
                .ensure_public_ip(&Self::frontend_ip_name(id, zone), zone, &tags)
                .await?;
            vips.insert(zone.clone(), ip.address);
        }
        let path = self.lb_path(id);
        self.arm
            .converge(
                "load balancer",
                &Self::name_of(id, 80),
                &path,
                NET_VERSION,
                &wanted,
                shape_of,
                |_| self.lb_body(id, &path, &wanted),
            )
            .await?;
        let mut rt = self.runtime_checked(id)?;
        rt.nlb_addresses = vips;
        self.save_runtime(id, &rt)?;
        // Addresses of zones the load balancer no longer serves.
        let keep: BTreeSet<String> = wanted
            .vnets
            .keys()
            .map(|z| Self::frontend_ip_name(id, z))
            .collect();
        for name in self.public_ips_tagged(DISTRIBUTOR_TAG, id).await? {
            if !keep.contains(&name) {
                self.delete_public_ip(&name).await?;
            }
        }
        Ok(())
    }

    pub(super) async fn remove_nlb(&self, id: &str) -> Result<()> {
        self.arm
            .delete(
                &format!("load balancer DELETE {}", Self::name_of(id, 80)),
                &self.lb_path(id),
                NET_VERSION,
            )
            .await?;
        let mut rt = self.runtime_checked(id)?;
        rt.nlb_addresses.clear();
        self.save_runtime(id, &rt)?;
        // Its frontends' addresses, once it let go of them.
        for name in self.public_ips_tagged(DISTRIBUTOR_TAG, id).await? {
            self.delete_public_ip(&name).await?;
        }
        Ok(())
    }

    /// The whole load balancer of `shape`.
    fn lb_body(&self, id: &str, path: &str, shape: &Shape) -> Value {
        let vnets = &shape.vnets;
        let frontends: Vec<Value> = shape
            .frontends
            .iter()
            .map(
                |(name, pip)| json!({"name": name, "properties": {"publicIPAddress": {"id": pip}}}),
            )
            .collect();
        let pools: Vec<Value> = shape
            .pools
            .iter()
            .map(|(name, addresses)| {
                let zone = zone_of_pool(name);
                let vnet = vnets.get(zone).cloned().unwrap_or_default();
                let members: Vec<Value> = addresses
                    .iter()
                    .map(|ip| {
                        json!({"name": format!("a-{}", ip.replace(['.', ':'], "-")),
                               "properties": {"ipAddress": ip, "virtualNetwork": {"id": vnet}}})
                    })
                    .collect();
                json!({"name": name, "properties": {"loadBalancerBackendAddresses": members}})
            })
            .collect();
        let probes: Vec<Value> = shape
            .probes
            .iter()
            .map(|(name, port)| {
                json!({"name": name, "properties": {"protocol": "Tcp", "port": port, "intervalInSeconds": 5, "numberOfProbes": 2}})
            })
            .collect();
        let rules: Vec<Value> = shape
            .rules
            .iter()
            .map(|(name, (fe, pool, probe, port))| {
                json!({"name": name, "properties": {
                    "frontendIPConfiguration": {"id": format!("{path}/frontendIPConfigurations/{fe}")},
                    "backendAddressPool": {"id": format!("{path}/backendAddressPools/{pool}")},
                    "probe": {"id": format!("{path}/probes/{probe}")},
                    "protocol": "Tcp",
                    "frontendPort": port,
                    "backendPort": port,
                    "enableFloatingIP": false,
                    "idleTimeoutInMinutes": 4,
                    "loadDistribution": "Default",
                    "disableOutboundSnat": true,
                }})
            })
            .collect();
        json!({
            "location": self.location,
            "sku": {"name": "Standard", "tier": "Regional"},
            "tags": {DISTRIBUTOR_TAG: id},
            "properties": {
                "frontendIPConfigurations": frontends,
                "backendAddressPools": pools,
                "probes": probes,
                "loadBalancingRules": rules,
            },
        })
    }
}

/// The load balancer that `publication` asks for, with `public_ip(zone)`
/// the id of the zone's frontend address; an error names a zone whose
/// subnets are not of one virtual network.
fn wanted_shape(publication: &Publication, public_ip: impl Fn(&str) -> String) -> Result<Shape> {
    let mut shape = Shape::default();
    for (zone, ports) in publication.ports.iter().filter(|(_, p)| !p.is_empty()) {
        let subnets = publication.subnets.get(zone).cloned().unwrap_or_default();
        let vnets: BTreeSet<String> = subnets.iter().map(|s| vnet_of(s)).collect();
        let vnet = match vnets.len() {
            1 => vnets.into_iter().next().unwrap_or_default(),
            0 => {
                return Err(CloudError::Failed(format!(
                    "an azure nlb distributor needs the subnet of zone {zone} (its backend addresses are in that subnet's virtual network): give it in the groups' node.subnets"
                )))
            }
            _ => {
                return Err(CloudError::Failed(format!(
                    "the groups of this azure nlb distributor give subnets of different virtual networks in zone {zone} ({}): the zone's backend pool takes addresses of one",
                    subnets.into_iter().collect::<Vec<_>>().join(", ")
                )))
            }
        };
        shape.vnets.insert(zone.clone(), vnet);
        let fe = format!("fe-{zone}");
        shape.frontends.insert(fe.clone(), public_ip(zone));
        let nodes: BTreeSet<String> = publication
            .endpoints
            .get(zone)
            .into_iter()
            .flatten()
            .cloned()
            .collect();
        for port in ports {
            let placed = publication.port_targets.get(zone).and_then(|p| p.get(port));
            let targets: BTreeSet<String> = match placed {
                Some(t) if t.balance == Balance::First => {
                    t.addresses.iter().take(1).cloned().collect()
                }
                Some(t) => t.addresses.iter().cloned().collect(),
                None => nodes.clone(),
            };
            let pool = if targets == nodes {
                format!("z{zone}")
            } else {
                format!("z{zone}-p{port}")
            };
            shape.pools.insert(pool.clone(), targets);
            let probe = format!("p{port}");
            shape.probes.insert(probe.clone(), *port as i64);
            shape.rules.insert(
                format!("z{zone}-p{port}"),
                (fe.clone(), pool, probe, *port as i64),
            );
        }
    }
    Ok(shape)
}

/// The shape of a load balancer as ARM returns it.
fn shape_of(lb: &Value) -> Shape {
    let p = &lb["properties"];
    let items = |k: &str| p[k].as_array().cloned().unwrap_or_default();
    let last = |v: &Value| {
        v["id"]
            .as_str()
            .and_then(|s| s.rsplit('/').next())
            .unwrap_or("")
            .to_string()
    };
    Shape {
        frontends: items("frontendIPConfigurations")
            .iter()
            .map(|f| {
                (
                    f["name"].as_str().unwrap_or("").to_string(),
                    f["properties"]["publicIPAddress"]["id"]
                        .as_str()
                        .unwrap_or("")
                        .to_ascii_lowercase(),
                )
            })
            .collect(),
        vnets: BTreeMap::new(),
        pools: items("backendAddressPools")
            .iter()
            .map(|b| {
                (
                    b["name"].as_str().unwrap_or("").to_string(),
                    b["properties"]["loadBalancerBackendAddresses"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .filter_map(|a| a["properties"]["ipAddress"].as_str().map(str::to_string))
                        .collect(),
                )
            })
            .collect(),
        probes: items("probes")
            .iter()
            .map(|r| {
                (
                    r["name"].as_str().unwrap_or("").to_string(),
                    r["properties"]["port"].as_i64().unwrap_or(0),
                )
            })
            .collect(),
        rules: items("loadBalancingRules")
            .iter()
            .map(|r| {
                let rp = &r["properties"];
                (
                    r["name"].as_str().unwrap_or("").to_string(),
                    (
                        last(&rp["frontendIPConfiguration"]),
                        last(&rp["backendAddressPool"]),
                        last(&rp["probe"]),
                        rp["frontendPort"].as_i64().unwrap_or(0),
                    ),
                )
            })
            .collect(),
    }
}

/// The zone of a pool named `z<zone>` or `z<zone>-p<port>`.
fn zone_of_pool(name: &str) -> &str {
    let z = name.strip_prefix('z').unwrap_or(name);
    match z.rfind("-p") {
        Some(i) if z[i + 2..].chars().all(|c| c.is_ascii_digit()) && i + 2 < z.len() => &z[..i],
        _ => z,
    }
}

/// The virtual network of a subnet id (`…/virtualNetworks/V/subnets/S`).
fn vnet_of(subnet: &str) -> String {
    let low = subnet.to_ascii_lowercase();
    match low.rfind("/subnets/") {
        Some(i) => subnet[..i].to_string(),
        None => subnet.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lbscale_engine::cloud::PortTargets;

    fn pip(zone: &str) -> String {
        format!("pip-{zone}")
    }

    fn publication() -> Publication {
        let mut p = Publication::default();
        for (z, ips) in [("1", vec!["10.0.1.4", "10.0.1.5"]), ("2", vec!["10.0.2.4"])] {
            p.endpoints
                .insert(z.into(), ips.into_iter().map(String::from).collect());
            p.ports.insert(z.into(), vec![80, 443]);
            p.subnets.insert(
                z.into(),
                [format!("/subscriptions/s/resourceGroups/g/providers/Microsoft.Network/virtualNetworks/v/subnets/z{z}")]
                    .into_iter()
                    .collect(),
            );
        }
        p
    }

    #[test]
    fn a_pool_per_zone_and_a_rule_per_port_and_zone() {
        let s = wanted_shape(&publication(), pip).unwrap();
        assert_eq!(s.frontends.len(), 2);
        assert_eq!(s.frontends["fe-1"], "pip-1");
        assert_eq!(
            s.vnets["2"],
            "/subscriptions/s/resourceGroups/g/providers/Microsoft.Network/virtualNetworks/v"
        );
        assert_eq!(s.pools.keys().collect::<Vec<_>>(), ["z1", "z2"]);
        assert_eq!(s.pools["z1"].len(), 2);
        assert_eq!(
            s.rules["z2-p443"],
            ("fe-2".into(), "z2".into(), "p443".into(), 443)
        );
        assert_eq!(s.probes.keys().collect::<Vec<_>>(), ["p443", "p80"]);
    }

    #[test]
    fn placement_gets_pools_of_its_own() {
        let mut p = publication();
        p.port_targets.entry("1".into()).or_default().insert(
            443,
            PortTargets {
                addresses: vec!["10.0.1.5".into(), "10.0.1.4".into()],
                balance: Balance::First,
            },
        );
        p.port_targets.entry("1".into()).or_default().insert(
            80,
            PortTargets {
                addresses: vec!["10.0.1.4".into(), "10.0.1.5".into()],
                balance: Balance::FlowHash,
            },
        );
        let s = wanted_shape(&p, pip).unwrap();
        // The native primary only.
        assert_eq!(s.pools["z1-p443"].iter().collect::<Vec<_>>(), ["10.0.1.5"]);
        assert_eq!(s.rules["z1-p443"].1, "z1-p443");
        // Every holder: the zone's pool.
        assert_eq!(s.rules["z1-p80"].1, "z1");
        assert_eq!(zone_of_pool("z1-p443"), "1");
        assert_eq!(zone_of_pool("zeastus-2"), "eastus-2");
    }

    #[test]
    fn a_zone_needs_one_subnet() {
        let mut p = publication();
        p.subnets.remove("2");
        let CloudError::Failed(e) = wanted_shape(&p, pip).unwrap_err() else {
            panic!()
        };
        assert!(e.contains("zone 2") && e.contains("node.subnets"), "{e}");
        let mut p = publication();
        p.subnets
            .get_mut("2")
            .unwrap()
            .insert("/x/subnets/other".into());
        let CloudError::Failed(e) = wanted_shape(&p, pip).unwrap_err() else {
            panic!()
        };
        assert!(e.contains("different virtual networks in zone 2"), "{e}");
        // Two subnets of one network in a zone are fine.
        let mut p = publication();
        p.subnets.get_mut("2").unwrap().insert(
            "/subscriptions/s/resourceGroups/g/providers/Microsoft.Network/virtualNetworks/v/subnets/more".into(),
        );
        assert!(wanted_shape(&p, pip).is_ok());
    }

    #[test]
    fn subnet_ids_give_their_network() {
        assert_eq!(
            vnet_of("/s/virtualNetworks/v/subnets/a"),
            "/s/virtualNetworks/v"
        );
    }
}
