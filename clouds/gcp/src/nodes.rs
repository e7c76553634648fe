//! Nodes as Compute Engine instances.
//!
//! An instance's name is made from its node id ([`instance_name`]), so a
//! provisioning step run again after a crash finds (by name, in the node's
//! zone) the instance it started instead of starting a second one; the
//! instance's labels (`lbscale-group`, `lbscale-node`) find a group's
//! instances in one call. The boot recipe is the aws driver's: the
//! startup script writes the node's credentials and starts `lbscale-node
//! serve` on the node API port, its address from the metadata server.

use super::api::{failed, Service};
use super::{region_of, request_id, sha256_hex, GcpCloud, DEFAULT_MACHINE_TYPE};
use lbscale_engine::cloud::{Cloud, CloudError, ProvisionRequest, Provisioned, Result};
use lbscale_engine::model::NodeSpec;
use lbscale_engine::store::NodeRow;
use serde_json::{json, Value};
use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

/// The port of the node API on an instance.
pub const NODE_API_PORT: u16 = 9990;
/// How long a new instance gets to run with its address.
const RUNNING_TIMEOUT: Duration = Duration::from_secs(300);
const POLL: Duration = Duration::from_secs(1);
/// Instance states in which the node is there (or about to be).
const ALIVE: &[&str] = &["PROVISIONING", "STAGING", "RUNNING"];

/// A Compute Engine name (`[a-z]([-a-z0-9]{0,61}[a-z0-9])?`) for `id` made
/// with `prefix`: the id lowercased, other characters made `-`; an id that
/// had to change, or is too long, gets its hash's first 8 hex digits so that
/// two ids never share a name.
fn resource_name(prefix: &str, id: &str) -> String {
    let clean: String = id
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '-'
            }
        })
        .collect();
    let mut name = format!("{prefix}{clean}");
    if clean != id || name.len() > 63 {
        name.truncate(54);
        name = format!(
            "{}-{}",
            name.trim_end_matches('-'),
            &sha256_hex(id.as_bytes())[..8]
        );
    }
    name.trim_end_matches('-').to_string()
}

/// The name of the instance of node `node_id`.
pub fn instance_name(node_id: &str) -> String {
    resource_name("lbscale-", node_id)
}

/// `value` as a label value (`[a-z0-9_-]{0,63}`), hashed as [`instance_name`] when it must change.
pub fn label_value(value: &str) -> String {
    let ok = value.len() <= 63
        && value
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '_');
    if ok {
        value.to_string()
    } else {
        resource_name("", value)
    }
}

/// What a node's handle holds.
#[derive(serde::Serialize, serde::Deserialize)]
struct NodeHandle {
    zone: String,
    instance: String,
}

/// The shell script that an instance runs at boot (its `startup-script`):
/// the same recipe as the aws driver's user data. Metadata is readable by
/// whoever may get the instance: the token file holds the token's hash.
fn startup_script(req: &ProvisionRequest) -> String {
    let c = &req.credentials;
    let file = |name: &str, content: &str| {
        // PEM and `sha256:HEX` hold no quote, so a quoted here-document keeps them as they are.
        format!(
            "cat > /etc/lbscale/{name} <<'LBSCALE_END'\n{}\nLBSCALE_END\n",
            content.trim_end()
        )
    };
    format!(
        "#!/bin/sh\n\
         # lbscale node {node}: written by lbscale's gcp driver.\n\
         set -e\n\
         umask 077\n\
         mkdir -p /etc/lbscale\n\
         {token}{ca}{cert}{key}\
         md=http://metadata.google.internal/computeMetadata/v1\n\
         ip=\n\
         for i in 1 2 3 4 5 6 7 8 9 10; do\n\
         ip=$(curl -sf -m 2 -H 'Metadata-Flavor: Google' $md/instance/network-interfaces/0/ip) && break\n\
         sleep 1\n\
         done\n\
         [ -n \"$ip\" ] || {{ echo 'lbscale: no private address from the metadata server' >&2; exit 1; }}\n\
         exec lbscale-node serve --node-id {node} --listen-ip 0.0.0.0 --api-address \"$ip\" --api-port {port} \
         --token-file /etc/lbscale/token --tls-ca /etc/lbscale/ca.pem --tls-cert /etc/lbscale/node.pem \
         --tls-key /etc/lbscale/node-key.pem --memory-limit-mb {mem}\n",
        node = req.node_id,
        token = file("token", &c.token_file),
        ca = file("ca.pem", &c.ca_pem),
        cert = file("node.pem", &c.cert_pem),
        key = file("node-key.pem", &c.key_pem),
        port = NODE_API_PORT,
        mem = req.node.memory_limit_mb,
    )
}

/// The image as `sourceImage` takes it: a URL or `projects/...` as given, a
/// bare name in the project's own images.
fn source_image(image: &str) -> String {
    if image.contains('/') {
        image.to_string()
    } else {
        format!("global/images/{image}")
    }
}

/// The subnetwork of `node.subnets` for `zone`, as `subnetwork` takes it
/// (a URL, `projects/P/regions/R/subnetworks/N`, or a name in the zone's
/// region); None: the default network's.
pub(crate) fn subnetwork(node: &NodeSpec, zone: &str) -> Option<String> {
    node.subnet_for(zone).map(|s| {
        if s.contains('/') {
            s.to_string()
        } else {
            format!("regions/{}/subnetworks/{s}", region_of(zone))
        }
    })
}

impl GcpCloud {
    /// The instance body of `req`.
    fn instance_body(&self, req: &ProvisionRequest, image: &str) -> Result<Value> {
        let node = &req.node;
        let mut labels = BTreeMap::new();
        for (k, v) in &node.tags {
            if k.starts_with("lbscale-") {
                return Err(CloudError::Failed(format!(
                    "node.tags: the label {k:?} is lbscale's own (keys starting with lbscale- are reserved)"
                )));
            }
            labels.insert(k.clone(), v.clone());
        }
        labels.insert("lbscale-group".to_string(), label_value(&req.group_id));
        labels.insert("lbscale-node".to_string(), label_value(&req.node_id));
        // The operator's tags, else the group's own, which the firewall
        // rules lbscale makes target (see firewall.rs).
        let network_tags = if node.security_groups.is_empty() {
            vec![crate::firewall::group_tag(&req.group_id)]
        } else {
            node.security_groups.clone()
        };
        let mut nic =
            json!({"accessConfigs": [{"type": "ONE_TO_ONE_NAT", "name": "External NAT"}]});
        if let Some(s) = subnetwork(node, &req.az) {
            nic["subnetwork"] = json!(s);
        }
        let machine = node
            .size
            .clone()
            .unwrap_or_else(|| DEFAULT_MACHINE_TYPE.into());
        let mut body = json!({
            "name": instance_name(&req.node_id),
            "description": format!("lbscale node {} of group {}", req.node_id, req.group_name),
            "machineType": format!("zones/{}/machineTypes/{machine}", req.az),
            "labels": labels,
            "tags": {"items": network_tags},
            "metadata": {"items": [
                {"key": "startup-script", "value": startup_script(req)},
                {"key": "lbscale-node-id", "value": req.node_id},
                {"key": "lbscale-group-id", "value": req.group_id},
            ]},
            "disks": [{"boot": true, "autoDelete": true,
                       "initializeParams": {"sourceImage": source_image(image)}}],
            "networkInterfaces": [nic],
        });
        if let Some(email) = &node.identity {
            body["serviceAccounts"] =
                json!([{"email": email, "scopes": [crate::credentials::SCOPE]}]);
        }
        Ok(body)
    }

    /// The instance `name` in `zone`, or None when Compute Engine does not know it.
    async fn instance(&self, zone: &str, name: &str) -> Result<Option<Value>> {
        match self
            .api
            .call(
                Service::Compute,
                "compute.instances.get",
                "GET",
                &format!("zones/{zone}/instances/{name}"),
                &[],
                None,
            )
            .await
        {
            Ok(v) => Ok(Some(v)),
            Err(e) if e.not_found() => Ok(None),
            Err(e) => Err(failed("compute.instances.get", e)),
        }
    }

    /// Waits until the instance runs with its private address.
    async fn wait_running(&self, zone: &str, name: &str, node_id: &str) -> Result<Provisioned> {
        let deadline = Instant::now() + RUNNING_TIMEOUT;
        loop {
            let i = self.instance(zone, name).await?;
            let status = i
                .as_ref()
                .map(|i| i["status"].as_str().unwrap_or("").to_string());
            match (&i, status.as_deref()) {
                (Some(i), Some("RUNNING"))
                    if i["networkInterfaces"][0]["networkIP"].is_string() =>
                {
                    let nic = &i["networkInterfaces"][0];
                    return Ok(Provisioned {
                        private_ip: nic["networkIP"].as_str().unwrap_or_default().to_string(),
                        public_ip: nic["accessConfigs"][0]["natIP"]
                            .as_str()
                            .map(str::to_string),
                        api_port: NODE_API_PORT,
                        handle: serde_json::to_value(NodeHandle {
                            zone: zone.to_string(),
                            instance: name.to_string(),
                        })
                        .expect("handle"),
                    });
                }
                (_, Some(s))
                    if matches!(
                        s,
                        "STOPPING" | "STOPPED" | "SUSPENDING" | "SUSPENDED" | "TERMINATED"
                    ) =>
                {
                    return Err(CloudError::Failed(format!(
                        "instance {name} in {zone} of node {node_id} is {s} instead of RUNNING"
                    )));
                }
                (None, _) => {
                    return Err(CloudError::Failed(format!(
                        "instance {name} in {zone} of node {node_id} is gone (deleted while it started)"
                    )));
                }
                _ => {
                    if Instant::now() >= deadline {
                        return Err(CloudError::Failed(format!(
                            "instance {name} in {zone} of node {node_id} not RUNNING with an address after {}s (status {status:?})",
                            RUNNING_TIMEOUT.as_secs()
                        )));
                    }
                    tokio::time::sleep(POLL).await;
                }
            }
        }
    }

    /// Deletes instance `name` in `zone` and waits until it is gone; one
    /// already gone is fine.
    async fn delete_instance(&self, zone: &str, name: &str) -> Result<()> {
        let op = match self
            .api
            .call(
                Service::Compute,
                "compute.instances.delete",
                "DELETE",
                &format!("zones/{zone}/instances/{name}"),
                &[("requestId", request_id())],
                None,
            )
            .await
        {
            Ok(op) => op,
            Err(e) if e.not_found() => return Ok(()),
            Err(e) => return Err(failed("compute.instances.delete", e)),
        };
        self.api
            .wait("compute.instances.delete", op)
            .await
            .map(|_| ())
    }

    /// The names of the instances labelled with group `group_id` that are
    /// there (provisioning, staging or running), over every zone.
    async fn alive_instances(&self, group_id: &str) -> Result<BTreeSet<(String, String)>> {
        let filter = format!("labels.lbscale-group = \"{}\"", label_value(group_id));
        let mut out = BTreeSet::new();
        let mut page: Option<String> = None;
        loop {
            let mut q = vec![
                ("filter", filter.clone()),
                ("maxResults", "500".to_string()),
            ];
            if let Some(p) = &page {
                q.push(("pageToken", p.clone()));
            }
            let v = self
                .api
                .json(
                    Service::Compute,
                    "compute.instances.aggregatedList",
                    "GET",
                    "aggregated/instances",
                    &q,
                    None,
                )
                .await?;
            for (scope, list) in v["items"].as_object().into_iter().flatten() {
                let zone = scope.trim_start_matches("zones/");
                for i in list["instances"].as_array().into_iter().flatten() {
                    if ALIVE.contains(&i["status"].as_str().unwrap_or("")) {
                        out.insert((
                            zone.to_string(),
                            i["name"].as_str().unwrap_or("").to_string(),
                        ));
                    }
                }
            }
            page = v["nextPageToken"].as_str().map(str::to_string);
            if page.is_none() {
                return Ok(out);
            }
        }
    }

    fn check_zone(&self, zone: &str) -> Result<()> {
        match &self.region {
            Some(r) if region_of(zone) != r => Err(CloudError::Failed(format!(
                "zone {zone} is not in the provider's gcp region {r}"
            ))),
            _ => Ok(()),
        }
    }
}

/// Where a node's instance is: its handle, else its zone and its node id's name.
fn located(node: &NodeRow) -> (String, String) {
    match serde_json::from_value::<NodeHandle>(node.handle.clone()) {
        Ok(h) => (h.zone, h.instance),
        Err(_) => (node.az.clone(), instance_name(&node.id)),
    }
}

#[async_trait::async_trait]
impl Cloud for GcpCloud {
    async fn provision(&self, req: &ProvisionRequest) -> Result<Provisioned> {
        let image = req.node.image.clone().ok_or_else(|| {
            CloudError::Failed("no image for GCP nodes: set node.image in the group".into())
        })?;
        self.check_zone(&req.az)?;
        let zone = req.az.as_str();
        let name = instance_name(&req.node_id);
        match self.instance(zone, &name).await? {
            // A step run again after a crash: the instance it started.
            Some(_) => {}
            None => {
                let body = self.instance_body(req, &image)?;
                let started = async {
                    let op = self
                        .api
                        .json(
                            Service::Compute,
                            "compute.instances.insert",
                            "POST",
                            &format!("zones/{zone}/instances"),
                            &[("requestId", request_id())],
                            Some(&body),
                        )
                        .await?;
                    self.api.wait("compute.instances.insert", op).await
                };
                if let Err(e) = started.await {
                    self.forget_failed(zone, &name).await;
                    return Err(e);
                }
            }
        }
        match self.wait_running(zone, &name, &req.node_id).await {
            Ok(p) => Ok(p),
            Err(e) => {
                self.forget_failed(zone, &name).await;
                Err(e)
            }
        }
    }

    async fn deprovision(&self, node: &NodeRow) -> Result<()> {
        let (zone, name) = located(node);
        self.delete_instance(&zone, &name).await
    }

    async fn is_alive(&self, node: &NodeRow) -> Result<bool> {
        let (zone, name) = located(node);
        Ok(self
            .instance(&zone, &name)
            .await?
            .is_some_and(|i| ALIVE.contains(&i["status"].as_str().unwrap_or(""))))
    }

    /// One aggregated list per group for all of them.
    async fn alive(&self, nodes: &[NodeRow]) -> Result<Vec<bool>> {
        let groups: BTreeSet<&str> = nodes.iter().map(|n| n.group_id.as_str()).collect();
        let mut alive = BTreeSet::new();
        for g in groups {
            alive.extend(self.alive_instances(g).await?);
        }
        Ok(nodes.iter().map(|n| alive.contains(&located(n))).collect())
    }

    fn api_port(&self, _node: &NodeRow) -> u16 {
        NODE_API_PORT
    }

    async fn prepare_group(&self, group: &lbscale_engine::cloud::GroupResources) -> Result<()> {
        self.prepare_firewall(group).await
    }

    async fn release_group(&self, group_id: &str) -> Result<()> {
        self.release_firewall(group_id).await
    }

    fn node_unusable(&self, node: &NodeSpec) -> Option<String> {
        if node.image.is_none() {
            return Some("no image for GCP nodes: set node.image in the group (projects/P/global/images/NAME or projects/P/global/images/family/F)".into());
        }
        None
    }
}

impl GcpCloud {
    /// The engine forgets a node whose provisioning failed: its instance
    /// must not outlive it.
    async fn forget_failed(&self, zone: &str, name: &str) {
        if let Err(e) = self.delete_instance(zone, name).await {
            tracing::warn!(instance = %name, zone, error = %e, "could not delete the instance of a failed provisioning");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_compute_engine_rules_and_never_collide() {
        assert_eq!(
            instance_name("web-us-central1-a-3"),
            "lbscale-web-us-central1-a-3"
        );
        let a = instance_name("Web_1");
        let b = instance_name("web-1");
        assert_ne!(a, b);
        assert!(
            a.starts_with("lbscale-web-1-") && a.len() == "lbscale-web-1-".len() + 8,
            "{a}"
        );
        let long = instance_name(&"x".repeat(100));
        assert!(long.len() <= 63, "{long}");
        let re = |s: &str| {
            s.len() <= 63
                && s.starts_with(|c: char| c.is_ascii_lowercase())
                && !s.ends_with('-')
                && s.chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
        };
        for n in [a, b, long, instance_name("a-"), instance_name("ÄÖ")] {
            assert!(re(&n), "{n}");
        }
        assert_eq!(label_value("g-1_x"), "g-1_x");
        assert_ne!(label_value("G1"), label_value("g1"));
        assert!(label_value(&"y".repeat(80)).len() <= 63);
    }

    #[test]
    fn images_and_subnetworks_take_names_or_paths() {
        assert_eq!(source_image("lbscale-node"), "global/images/lbscale-node");
        assert_eq!(
            source_image("projects/p/global/images/family/f"),
            "projects/p/global/images/family/f"
        );
        let mut node = NodeSpec::default();
        assert_eq!(subnetwork(&node, "europe-west1-b"), None);
        node.subnets.insert("europe-west1-b".into(), "edge".into());
        node.subnets.insert(
            "europe-west1-c".into(),
            "projects/p/regions/europe-west1/subnetworks/s".into(),
        );
        assert_eq!(
            subnetwork(&node, "europe-west1-b").unwrap(),
            "regions/europe-west1/subnetworks/edge"
        );
        assert_eq!(
            subnetwork(&node, "europe-west1-c").unwrap(),
            "projects/p/regions/europe-west1/subnetworks/s"
        );
    }
}
