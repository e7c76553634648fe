//! The group's own firewall rules, when `node.security_groups` gives none:
//! on the nodes' network, for the network tag `lbscale-<group id>` that every
//! node carries, one rule that lets clients reach the vservers' ports (from
//! anywhere) and one that lets lbscale reach the node API port (from
//! `node.management_cidrs`, default: the ranges of the groups' subnetworks).
//! Kept exactly so at every apply; deleted with the group.

use super::api::{failed, Service};
use super::nodes::{instance_name, label_value, NODE_API_PORT};
use super::{region_of, request_id, GcpCloud};
use lbscale_engine::cloud::{CloudError, GroupResources, Result, Transport};
use serde_json::{json, Value};
use std::collections::BTreeSet;

/// The network tag of a group's nodes.
pub(crate) fn group_tag(group_id: &str) -> String {
    format!("lbscale-{}", label_value(group_id))
}

fn rule_names(group_id: &str) -> [String; 2] {
    [
        instance_name(&format!("{group_id}-serve")),
        instance_name(&format!("{group_id}-api")),
    ]
}

impl GcpCloud {
    /// The groups' subnetworks' network and ranges.
    async fn network_and_ranges(&self, group: &GroupResources) -> Result<(String, Vec<String>)> {
        let mut networks = BTreeSet::new();
        let mut ranges = BTreeSet::new();
        for zone in &group.availability_zones {
            let sub = super::nodes::subnetwork(&group.node, zone)
                .unwrap_or_else(|| format!("regions/{}/subnetworks/default", region_of(zone)));
            let path = sub.split("/projects/").last().unwrap_or(&sub);
            let path = path
                .split_once("/regions/")
                .map(|(_, r)| format!("regions/{r}"))
                .unwrap_or(path.to_string());
            let s = self
                .api
                .json(
                    Service::Compute,
                    "compute.subnetworks.get",
                    "GET",
                    &path,
                    &[],
                    None,
                )
                .await?;
            networks.insert(s["network"].as_str().unwrap_or("").to_string());
            ranges.insert(s["ipCidrRange"].as_str().unwrap_or("").to_string());
        }
        if networks.len() > 1 {
            return Err(CloudError::Failed(format!(
                "the subnetworks of group {} are in more than one network ({}): its firewall rules need one",
                group.group_name,
                networks.into_iter().collect::<Vec<_>>().join(", ")
            )));
        }
        Ok((
            networks.into_iter().next().unwrap_or_default(),
            ranges.into_iter().collect(),
        ))
    }

    /// Makes rule `name` exactly `want` (None: no such rule).
    async fn firewall(&self, name: &str, want: Option<Value>) -> Result<()> {
        let path = format!("global/firewalls/{name}");
        let have = match self
            .api
            .call(
                Service::Compute,
                "compute.firewalls.get",
                "GET",
                &path,
                &[],
                None,
            )
            .await
        {
            Ok(v) => Some(v),
            Err(e) if e.not_found() => None,
            Err(e) => return Err(failed("compute.firewalls.get", e)),
        };
        let same = |h: &Value, w: &Value| {
            ["allowed", "sourceRanges", "targetTags"]
                .iter()
                .all(|k| h[*k] == w[*k])
        };
        let (what, method, at, body) = match (&have, want) {
            (None, None) => return Ok(()),
            (Some(h), Some(w)) if same(h, &w) => return Ok(()),
            (Some(_), Some(w)) => ("compute.firewalls.patch", "PATCH", path, Some(w)),
            (None, Some(w)) => (
                "compute.firewalls.insert",
                "POST",
                "global/firewalls".to_string(),
                Some(w),
            ),
            (Some(_), None) => ("compute.firewalls.delete", "DELETE", path, None),
        };
        let op = match self
            .api
            .call(
                Service::Compute,
                what,
                method,
                &at,
                &[("requestId", request_id())],
                body.as_ref(),
            )
            .await
        {
            Ok(op) => op,
            Err(e) if e.not_found() && method == "DELETE" => return Ok(()),
            Err(e) => return Err(failed(what, e)),
        };
        self.api.wait(what, op).await.map(|_| ())
    }

    pub(super) async fn prepare_firewall(&self, group: &GroupResources) -> Result<()> {
        let [serve, api] = rule_names(&group.group_id);
        if !group.node.makes_security_group() {
            // The operator's rules (given tags): none of lbscale's.
            self.firewall(&serve, None).await?;
            return self.firewall(&api, None).await;
        }
        let (network, subnet_ranges) = self.network_and_ranges(group).await?;
        let tag = group_tag(&group.group_id);
        let description = format!("lbscale group {} ({})", group.group_name, group.group_id);
        let mut allowed = vec![];
        for (proto, transport) in [("tcp", Transport::Tcp), ("udp", Transport::Udp)] {
            let ports: BTreeSet<u16> = group
                .listeners
                .iter()
                .filter(|l| l.protocol == transport)
                .map(|l| l.port)
                .collect();
            if !ports.is_empty() {
                allowed.push(json!({"IPProtocol": proto, "ports": ports.iter().map(|p| p.to_string()).collect::<Vec<_>>()}));
            }
        }
        let serve_rule = (!allowed.is_empty()).then(|| {
            json!({"name": serve, "description": description, "network": network, "direction": "INGRESS",
                   "allowed": allowed, "sourceRanges": ["0.0.0.0/0"], "targetTags": [tag]})
        });
        self.firewall(&serve, serve_rule).await?;
        let sources = if group.node.management_cidrs.is_empty() {
            subnet_ranges
        } else {
            group.node.management_cidrs.clone()
        };
        self.firewall(
            &api,
            Some(json!({"name": api, "description": description, "network": network, "direction": "INGRESS",
                        "allowed": [{"IPProtocol": "tcp", "ports": [NODE_API_PORT.to_string()]}],
                        "sourceRanges": sources, "targetTags": [tag]})),
        )
        .await
    }

    pub(super) async fn release_firewall(&self, group_id: &str) -> Result<()> {
        for name in rule_names(group_id) {
            self.firewall(&name, None).await?;
        }
        Ok(())
    }
}
