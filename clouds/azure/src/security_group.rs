//! The network security group that lbscale makes for a group whose `node`
//! block gives no `security_groups`, as the aws driver makes a security
//! group: `lbscale-<group id>` in the location, tagged `lbscale-group-id`,
//! on every node's network interface. Its inbound rules are exactly:
//!
//! - each vserver's port (TCP or UDP as the vserver says) from anywhere
//!   (`*`), priorities from 100;
//! - the node API port (9990) from `node.management_cidrs` only (default: the
//!   address spaces of the virtual networks of the group's `node.subnets`),
//!   priority 1000;
//! - the node API port denied from anywhere else, priority 4000: Azure's
//!   default rules allow everything from the virtual network (65000), which
//!   would open the API to the whole network otherwise.
//!
//! Azure's default rules stay under them (the load balancer's probes are
//! allowed; the rest of the Internet is denied). Every apply brings the rules
//! back to these (the group is written with `If-Match` of the ETag read), and
//! the group's destroy deletes it once its nodes' interfaces are gone.

use super::{AzureCloud, NODE_API_PORT};
use lbscale_engine::cloud::{CloudError, GroupResources, Listener, Result, Transport};
use serde_json::{json, Value};
use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

const NET_VERSION: &str = "2025-07-01";
/// How long a destroy waits for the deleted nodes' interfaces to let go of
/// the group's security group (Azure refuses to delete one in use).
const RELEASE_TIMEOUT: Duration = Duration::from_secs(300);
const RELEASE_POLL: Duration = Duration::from_secs(5);
const GROUP_TAG: &str = "lbscale-group-id";

/// One inbound rule as lbscale writes and compares it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct Rule {
    pub name: String,
    pub priority: i64,
    /// `Tcp` or `Udp`.
    pub protocol: String,
    /// `Allow` or `Deny`.
    pub access: String,
    pub port: u16,
    /// Sorted; `["*"]` for anywhere.
    pub sources: Vec<String>,
}

/// The rules of a made group: each listener from anywhere, the node API
/// port from `management` only.
pub(crate) fn wanted_rules(listeners: &[Listener], management: &[String]) -> BTreeSet<Rule> {
    let mut listeners = listeners.to_vec();
    listeners.sort();
    listeners.dedup();
    let mut rules: BTreeSet<Rule> = listeners
        .iter()
        .enumerate()
        .map(|(i, l)| {
            let protocol = match l.protocol {
                Transport::Tcp => "Tcp",
                Transport::Udp => "Udp",
            };
            Rule {
                name: format!("vserver-{}-{}", protocol.to_ascii_lowercase(), l.port),
                priority: 100 + i as i64,
                protocol: protocol.into(),
                access: "Allow".into(),
                port: l.port,
                sources: vec!["*".into()],
            }
        })
        .collect();
    let mut sources: Vec<String> = management.to_vec();
    sources.sort();
    sources.dedup();
    if !sources.is_empty() {
        rules.insert(Rule {
            name: "node-api".into(),
            priority: 1000,
            protocol: "Tcp".into(),
            access: "Allow".into(),
            port: NODE_API_PORT,
            sources,
        });
    }
    rules.insert(Rule {
        name: "node-api-deny".into(),
        priority: 4000,
        protocol: "Tcp".into(),
        access: "Deny".into(),
        port: NODE_API_PORT,
        sources: vec!["*".into()],
    });
    rules
}

fn rule_body(r: &Rule) -> Value {
    let mut p = json!({
        "protocol": r.protocol,
        "access": r.access,
        "priority": r.priority,
        "direction": "Inbound",
        "sourcePortRange": "*",
        "destinationAddressPrefix": "*",
        "destinationPortRange": r.port.to_string(),
    });
    if r.sources == ["*"] {
        p["sourceAddressPrefix"] = json!("*");
    } else {
        p["sourceAddressPrefixes"] = json!(r.sources);
    }
    json!({"name": r.name, "properties": p})
}

/// The inbound rules of an NSG as ARM returns it (rules of other shapes,
/// which lbscale never writes, read as ones that differ).
fn rules_of(nsg: &Value) -> BTreeSet<Rule> {
    nsg["properties"]["securityRules"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|r| {
            let p = &r["properties"];
            let mut sources: Vec<String> = match p["sourceAddressPrefix"].as_str() {
                Some(s) if !s.is_empty() => vec![s.to_string()],
                _ => p["sourceAddressPrefixes"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|s| s.as_str().map(str::to_string))
                    .collect(),
            };
            sources.sort();
            let direction = p["direction"].as_str().unwrap_or("");
            Rule {
                name: r["name"].as_str().unwrap_or("").to_string(),
                priority: p["priority"].as_i64().unwrap_or(0),
                protocol: if direction.eq_ignore_ascii_case("Inbound") {
                    p["protocol"].as_str().unwrap_or("").to_string()
                } else {
                    format!("{direction}:{}", p["protocol"].as_str().unwrap_or(""))
                },
                access: p["access"].as_str().unwrap_or("").to_string(),
                port: p["destinationPortRange"]
                    .as_str()
                    .and_then(|s| s.parse().ok())
                    .unwrap_or(0),
                sources,
            }
        })
        .collect()
}

pub(crate) fn nsg_name(group_id: &str) -> String {
    AzureCloud::name_of(group_id, 80)
}

/// The virtual network of a subnet id (`…/virtualNetworks/V/subnets/S`).
fn vnet_of(subnet: &str) -> Option<&str> {
    let i = subnet.to_ascii_lowercase().rfind("/subnets/")?;
    Some(&subnet[..i])
}

impl AzureCloud {
    fn nsg_path(&self, group_id: &str) -> String {
        self.arm.in_group(
            &self.resource_group,
            &format!(
                "Microsoft.Network/networkSecurityGroups/{}",
                nsg_name(group_id)
            ),
        )
    }

    /// The id of the group's made NSG for a node's interface: `prepare_group`
    /// made it before any provisioning; one that is missing (deleted outside
    /// lbscale, or a driver used without the engine) is made here with the
    /// node API rules, and the group's next apply opens the vservers' ports.
    pub(crate) async fn made_security_group(
        &self,
        group_id: &str,
        group_name: &str,
        node: &lbscale_engine::model::NodeSpec,
    ) -> Result<String> {
        if let Some(a) = self
            .arm
            .get(
                "network security group GET",
                &self.nsg_path(group_id),
                NET_VERSION,
            )
            .await?
        {
            return Ok(a.body["id"].as_str().unwrap_or_default().to_string());
        }
        self.prepare_security_group(&GroupResources {
            group_id: group_id.into(),
            group_name: group_name.into(),
            availability_zones: vec![],
            node: node.clone(),
            listeners: vec![],
        })
        .await?;
        Ok(self.nsg_path(group_id))
    }

    /// Makes the group's NSG, or brings its rules back to the wanted ones;
    /// with `security_groups` given, deletes one made earlier (once no
    /// interface uses it: until then it is left, and said).
    pub(crate) async fn prepare_security_group(&self, g: &GroupResources) -> Result<()> {
        let path = self.nsg_path(&g.group_id);
        if !g.node.makes_security_group() {
            let what = format!("network security group DELETE {}", nsg_name(&g.group_id));
            match self.arm.delete(&what, &path, NET_VERSION).await {
                Ok(()) => {}
                Err(CloudError::Failed(e)) if e.contains("InUse") => {
                    tracing::warn!(nsg = %nsg_name(&g.group_id), "the group's own network security group is still on interfaces of nodes made before node.security_groups was set; it is deleted with the group");
                }
                Err(e) => return Err(e),
            }
            return Ok(());
        }
        let sources = if g.node.management_cidrs.is_empty() {
            self.vnet_ranges(&g.node).await?
        } else {
            g.node.management_cidrs.clone()
        };
        let wanted = wanted_rules(&g.listeners, &sources);
        let body = |current: Option<&Value>| {
            // The tags an operator added are kept.
            let mut tags: BTreeMap<String, String> = current
                .and_then(|c| serde_json::from_value(c["tags"].clone()).ok())
                .unwrap_or_default();
            tags.insert(GROUP_TAG.into(), g.group_id.clone());
            json!({
                "location": self.location,
                "tags": tags,
                "properties": {"securityRules": wanted.iter().map(rule_body).collect::<Vec<_>>()},
            })
        };
        self.arm
            .converge(
                "network security group",
                &nsg_name(&g.group_id),
                &path,
                NET_VERSION,
                &wanted,
                rules_of,
                body,
            )
            .await
    }

    /// The address spaces of the virtual networks of `node.subnets`.
    async fn vnet_ranges(&self, node: &lbscale_engine::model::NodeSpec) -> Result<Vec<String>> {
        let vnets: BTreeSet<&str> = node.subnets.values().filter_map(|s| vnet_of(s)).collect();
        let mut out = BTreeSet::new();
        for v in vnets {
            let a = self
                .arm
                .get("virtual network GET", v, NET_VERSION)
                .await?
                .ok_or_else(|| {
                    CloudError::Failed(format!(
                        "the virtual network {v} of the group's node.subnets does not exist (its address space is where the node API is open from, without node.management_cidrs)"
                    ))
                })?;
            out.extend(
                a.body["properties"]["addressSpace"]["addressPrefixes"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|p| p.as_str().map(str::to_string)),
            );
        }
        Ok(out.into_iter().collect())
    }

    /// Deletes the group's made NSG, waiting (bounded) for the interfaces of
    /// its deleted nodes to let go of it.
    pub(crate) async fn release_security_group(&self, group_id: &str) -> Result<()> {
        let path = self.nsg_path(group_id);
        let what = format!("network security group DELETE {}", nsg_name(group_id));
        let deadline = Instant::now() + RELEASE_TIMEOUT;
        loop {
            match self.arm.delete(&what, &path, NET_VERSION).await {
                Err(CloudError::Failed(e)) if e.contains("InUse") && Instant::now() < deadline => {
                    tokio::time::sleep(RELEASE_POLL).await;
                }
                r => return r,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rules_open_the_vservers_and_the_api_to_management_only() {
        let l = |port, protocol| Listener { port, protocol };
        let r = wanted_rules(
            &[
                l(443, Transport::Tcp),
                l(53, Transport::Udp),
                l(443, Transport::Tcp),
            ],
            &["10.1.0.0/16".into(), "10.0.0.0/16".into()],
        );
        let by_name: BTreeMap<&str, &Rule> = r.iter().map(|r| (r.name.as_str(), r)).collect();
        assert_eq!(by_name.len(), 4, "{r:?}");
        assert_eq!(by_name["vserver-udp-53"].priority, 100);
        assert_eq!(by_name["vserver-tcp-443"].sources, ["*"]);
        assert_eq!(by_name["node-api"].sources, ["10.0.0.0/16", "10.1.0.0/16"]);
        assert_eq!(by_name["node-api-deny"].access, "Deny");
        assert!(by_name["node-api"].priority < by_name["node-api-deny"].priority);
        // What is written reads back as the same rules.
        let nsg =
            json!({"properties": {"securityRules": r.iter().map(rule_body).collect::<Vec<_>>()}});
        assert_eq!(rules_of(&nsg), r);
        // No management sources: the API is denied from everywhere.
        let none = wanted_rules(&[], &[]);
        assert_eq!(none.len(), 1);
        assert_eq!(none.iter().next().unwrap().access, "Deny");
    }
}
