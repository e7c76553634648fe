//! Azure nodes: one virtual machine each (Microsoft.Compute), with its
//! network interface in the subnet that the group's `node.subnets` gives for
//! the node's zone (Azure's zones of a region are "1", "2", "3": a group's
//! `availability_zones` name them).
//!
//! - Names come from the node id (`lbscale-<node id>`, its interface
//!   `…-nic`), and the VM is tagged with the group and node ids: a
//!   provisioning step run again after a crash finds the VM it started.
//! - The VM starts from `node.image` (an image URN `publisher:offer:sku:version`
//!   or an image resource id) with `node.size`, `node.tags`, `node.identity`
//!   (a user-assigned managed identity) and `node.security_groups` (one
//!   network security group, on the interface). Its custom data is the boot
//!   recipe of the other clouds: the node's credentials written to
//!   `/etc/lbscale`, then `lbscale-node serve` on the node API port.
//! - Log-in: an SSH key whose private half is thrown away (no one logs in;
//!   Azure requires a credential on Linux VMs).
//! - A node gets a public IP address of its own (`…-pip`: Standard, static,
//!   in the node's zone, tagged like the VM) on its interface: a `dns`
//!   distributor's Traffic Manager endpoints are the nodes' public addresses.
//!   A node of a group behind an `nlb` gets none: clients reach it through
//!   the load balancer's public frontends, and an address of its own would
//!   let them past it (and costs while it exists).
//! - Without `node.security_groups`, the interface gets the group's own
//!   network security group ([`crate::security_group`]).
//! - The VM is deleted with its interface, OS disk and public IP
//!   (`deleteOption: Delete`); the interface and the public IP are deleted
//!   again by name, and public IPs tagged with the node id, in case the VM
//!   never took them (a crash in between).

use super::{arm, AzureCloud};
use base64::Engine as _;
use lbscale_engine::cloud::{CloudError, ProvisionRequest, Provisioned, Result};
use lbscale_engine::model::NodeSpec;
use lbscale_engine::store::NodeRow;
use serde_json::{json, Value};
use std::collections::BTreeMap;

const COMPUTE_VERSION: &str = "2025-04-01";
const NET_VERSION: &str = "2025-07-01";
/// The port of the node API on a VM.
pub const NODE_API_PORT: u16 = 9990;
/// The VM size when neither the group nor the settings give one.
const DEFAULT_SIZE: &str = "Standard_D2s_v5";
const NODE_TAG: &str = "lbscale-node-id";
const GROUP_TAG: &str = "lbscale-group-id";

/// What a node's handle holds.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
struct NodeHandle {
    vm: String,
    nic: String,
    /// Its public IP's name; none behind an `nlb` (and in handles of nodes
    /// made before nodes had one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pip: Option<String>,
}

impl AzureCloud {
    fn vm_name(node_id: &str) -> String {
        Self::name_of(node_id, 64)
    }

    fn nic_name(node_id: &str) -> String {
        format!("{}-nic", Self::name_of(node_id, 76))
    }

    fn pip_name(node_id: &str) -> String {
        format!("{}-pip", Self::name_of(node_id, 76))
    }

    /// Whether a node of `group_id` gets a public IP: not behind an `nlb`
    /// (clients come through the load balancer's frontends); behind a `dns`
    /// distributor, and when the group is not in the store (a driver used
    /// without the engine), it does.
    fn gets_public_ip(&self, group_id: &str) -> Result<bool> {
        Ok(!matches!(
            self.store.distributor_of_group(group_id)?,
            Some(d) if d.mode == lbscale_engine::model::DistributorMode::Nlb
        ))
    }

    fn vm_path(&self, name: &str) -> String {
        self.arm.in_group(
            &self.resource_group,
            &format!("Microsoft.Compute/virtualMachines/{name}"),
        )
    }

    fn nic_path(&self, name: &str) -> String {
        self.arm.in_group(
            &self.resource_group,
            &format!("Microsoft.Network/networkInterfaces/{name}"),
        )
    }

    pub(super) fn vm_unusable(&self, node: &NodeSpec) -> Option<String> {
        if node.image.is_none() && self.image.is_none() {
            return Some("no image for azure nodes: set node.image (an image URN publisher:offer:sku:version, or an image resource id) in the group, or LBSCALE_AZURE_IMAGE".into());
        }
        if node.subnets.is_empty() {
            return Some("azure nodes need a subnet in each zone: set node.subnets (zone -> subnet resource id) in the group".into());
        }
        None
    }

    /// The VMs of the resource group that lbscale made: name -> (node id, provisioningState).
    async fn lbscale_vms(&self) -> Result<BTreeMap<String, (String, String)>> {
        let path = self
            .arm
            .in_group(&self.resource_group, "Microsoft.Compute/virtualMachines");
        Ok(self
            .arm
            .list("virtual machines list", &path, COMPUTE_VERSION)
            .await?
            .into_iter()
            .filter_map(|v| {
                Some((
                    v["name"].as_str()?.to_string(),
                    (
                        v["tags"][NODE_TAG].as_str()?.to_string(),
                        v["properties"]["provisioningState"]
                            .as_str()
                            .unwrap_or("")
                            .to_string(),
                    ),
                ))
            })
            .collect())
    }

    pub(super) async fn provision_vm(&self, req: &ProvisionRequest) -> Result<Provisioned> {
        let image = req
            .node
            .image
            .clone()
            .or(self.image.clone())
            .ok_or_else(|| CloudError::Failed(self.vm_unusable(&req.node).unwrap_or_default()))?;
        let subnet = req.node.subnet_for(&req.az).ok_or_else(|| {
            CloudError::Failed(format!(
                "no subnet for zone {} in the group's node.subnets: an azure node's network interface is in its zone's subnet",
                req.az
            ))
        })?;
        let vm = Self::vm_name(&req.node_id);
        let nic = Self::nic_name(&req.node_id);
        let handle = NodeHandle {
            vm: vm.clone(),
            nic: nic.clone(),
            pip: self
                .gets_public_ip(&req.group_id)?
                .then(|| Self::pip_name(&req.node_id)),
        };
        let mut tags: BTreeMap<String, String> = req.node.tags.clone();
        tags.insert(NODE_TAG.into(), req.node_id.clone());
        tags.insert(GROUP_TAG.into(), req.group_id.clone());
        // A step run again after a crash: the VM it started, found by its tag.
        let existing = self
            .lbscale_vms()
            .await?
            .into_iter()
            .find(|(_, (node, state))| {
                node == &req.node_id && state != "Failed" && state != "Deleting"
            });
        if existing.is_none() {
            if let Err(e) = self.create_vm(req, &image, subnet, &handle, &tags).await {
                // The engine forgets a node whose provisioning failed: what
                // was made for it must not outlive it.
                if let Err(t) = self.delete_vm(&handle).await {
                    tracing::warn!(vm = %vm, error = %t, "could not delete the VM of a failed provisioning");
                }
                return Err(e);
            }
        }
        let nic_body = self
            .arm
            .get("network interface GET", &self.nic_path(&nic), NET_VERSION)
            .await?
            .ok_or_else(|| {
                CloudError::Failed(format!("the network interface {nic} of VM {vm} is gone"))
            })?
            .body;
        let ipc = &nic_body["properties"]["ipConfigurations"][0]["properties"];
        let ip = ipc["privateIPAddress"].as_str().ok_or_else(|| {
            CloudError::Failed(format!(
                "the network interface {nic} of VM {vm} has no private address"
            ))
        })?;
        // The interface's public IP, as it is (a VM found again keeps the
        // one it was made with).
        let public_ip = match ipc["publicIPAddress"]["id"].as_str() {
            Some(id) => Some(self.public_ip_address(id).await?.ok_or_else(|| {
                CloudError::Failed(format!(
                    "the public IP address {id} of VM {vm} is gone or has no address"
                ))
            })?),
            None => None,
        };
        Ok(Provisioned {
            private_ip: ip.to_string(),
            public_ip,
            api_port: NODE_API_PORT,
            handle: serde_json::to_value(&handle).expect("handle"),
        })
    }

    async fn create_vm(
        &self,
        req: &ProvisionRequest,
        image: &str,
        subnet: &str,
        h: &NodeHandle,
        tags: &BTreeMap<String, String>,
    ) -> Result<()> {
        let mut nic_props = json!({"ipConfigurations": [{"name": "ipconfig1", "properties": {
            "subnet": {"id": subnet}, "privateIPAllocationMethod": "Dynamic", "primary": true}}]});
        if let Some(pip) = &h.pip {
            let made = self.ensure_public_ip(pip, &req.az, tags).await?;
            nic_props["ipConfigurations"][0]["properties"]["publicIPAddress"] =
                json!({"id": made.id});
        }
        let nsg = match req.node.security_groups.first() {
            Some(nsg) => nsg.clone(),
            None => {
                self.made_security_group(&req.group_id, &req.group_name, &req.node)
                    .await?
            }
        };
        nic_props["networkSecurityGroup"] = json!({"id": nsg});
        let nic_body = json!({"location": self.location, "tags": tags, "properties": nic_props});
        let what = format!("network interface PUT {}", h.nic);
        let nic = self
            .arm
            .put(&what, &self.nic_path(&h.nic), NET_VERSION, &nic_body, &[])
            .await
            .map_err(|e| arm::failed(&what, e))?;
        let nic_id = nic["id"].as_str().unwrap_or_default().to_string();
        let mut body = json!({
            "location": self.location,
            "zones": [req.az],
            "tags": tags,
            "properties": {
                "hardwareProfile": {"vmSize": req.node.size.clone().or(self.size.clone()).unwrap_or_else(|| DEFAULT_SIZE.into())},
                "storageProfile": {
                    "imageReference": image_reference(image)?,
                    "osDisk": {"createOption": "FromImage", "deleteOption": "Delete",
                               "managedDisk": {"storageAccountType": "StandardSSD_LRS"}},
                },
                "osProfile": {
                    "computerName": Self::vm_name(&req.node_id),
                    "adminUsername": "lbscale",
                    "customData": base64::engine::general_purpose::STANDARD.encode(bootstrap(req)),
                    "linuxConfiguration": {
                        "disablePasswordAuthentication": true,
                        "ssh": {"publicKeys": [{"path": "/home/lbscale/.ssh/authorized_keys", "keyData": throwaway_ssh_key()?}]},
                    },
                },
                "networkProfile": {"networkInterfaces": [{"id": nic_id, "properties": {"primary": true, "deleteOption": "Delete"}}]},
            },
        });
        if let Some(identity) = &req.node.identity {
            body["identity"] =
                json!({"type": "UserAssigned", "userAssignedIdentities": {identity: {}}});
        }
        let what = format!("virtual machine PUT {}", h.vm);
        self.arm
            .put(&what, &self.vm_path(&h.vm), COMPUTE_VERSION, &body, &[])
            .await
            .map_err(|e| arm::failed(&what, e))?;
        Ok(())
    }

    async fn delete_vm(&self, h: &NodeHandle) -> Result<()> {
        self.arm
            .delete(
                &format!("virtual machine DELETE {}", h.vm),
                &self.vm_path(&h.vm),
                COMPUTE_VERSION,
            )
            .await?;
        self.arm
            .delete(
                &format!("network interface DELETE {}", h.nic),
                &self.nic_path(&h.nic),
                NET_VERSION,
            )
            .await?;
        // After the interface: Azure refuses to delete an address in use.
        if let Some(pip) = &h.pip {
            self.delete_public_ip(pip).await?;
        }
        Ok(())
    }

    pub(super) async fn deprovision_vm(&self, node: &NodeRow) -> Result<()> {
        let h = serde_json::from_value::<NodeHandle>(node.handle.clone()).unwrap_or(NodeHandle {
            vm: Self::vm_name(&node.id),
            nic: Self::nic_name(&node.id),
            pip: Some(Self::pip_name(&node.id)),
        });
        self.delete_vm(&h).await?;
        // Public IPs of this node that the handle does not name (a crash
        // between the address and the VM, or a handle lost).
        for name in self.public_ips_tagged(NODE_TAG, &node.id).await? {
            if Some(&name) != h.pip.as_ref() {
                self.delete_public_ip(&name).await?;
            }
        }
        // A VM of this node under another name (none is made so; a handle lost).
        for (name, (id, _)) in self.lbscale_vms().await? {
            if id == node.id && name != h.vm {
                self.arm
                    .delete(
                        "virtual machine DELETE",
                        &self.vm_path(&name),
                        COMPUTE_VERSION,
                    )
                    .await?;
            }
        }
        Ok(())
    }

    /// One list of the resource group's VMs for all of `nodes`.
    pub(super) async fn vms_alive(&self, nodes: &[NodeRow]) -> Result<Vec<bool>> {
        let vms = self.lbscale_vms().await?;
        Ok(nodes
            .iter()
            .map(|n| {
                vms.values().any(|(id, state)| {
                    id == &n.id && !matches!(state.as_str(), "Failed" | "Deleting")
                })
            })
            .collect())
    }
}

/// `publisher:offer:sku:version`, or an image (or gallery image version) id.
fn image_reference(image: &str) -> Result<Value> {
    if image.starts_with("/subscriptions/") {
        return Ok(json!({"id": image}));
    }
    match image.split(':').collect::<Vec<_>>()[..] {
        [publisher, offer, sku, version] if [publisher, offer, sku, version].iter().all(|p| !p.is_empty()) => {
            Ok(json!({"publisher": publisher, "offer": offer, "sku": sku, "version": version}))
        }
        _ => Err(CloudError::Failed(format!(
            "node.image {image:?} is neither an image URN (publisher:offer:sku:version) nor an image resource id (/subscriptions/…)"
        ))),
    }
}

/// An OpenSSH Ed25519 public key whose private key is dropped at once.
fn throwaway_ssh_key() -> Result<String> {
    use ring::signature::KeyPair as _;
    let rng = ring::rand::SystemRandom::new();
    let pkcs8 = ring::signature::Ed25519KeyPair::generate_pkcs8(&rng)
        .map_err(|_| CloudError::Failed("could not make an SSH key".into()))?;
    let pair = ring::signature::Ed25519KeyPair::from_pkcs8(pkcs8.as_ref())
        .map_err(|_| CloudError::Failed("could not read the SSH key made".into()))?;
    let mut blob = Vec::new();
    for part in [b"ssh-ed25519".as_slice(), pair.public_key().as_ref()] {
        blob.extend_from_slice(&(part.len() as u32).to_be_bytes());
        blob.extend_from_slice(part);
    }
    Ok(format!(
        "ssh-ed25519 {} lbscale-no-login",
        base64::engine::general_purpose::STANDARD.encode(blob)
    ))
}

/// The shell script a VM runs at first boot (its custom data): the node's
/// credentials in `/etc/lbscale`, its private address from the instance
/// metadata, then `lbscale-node serve`. `LBSCALE_NODE_ROOT`,
/// `LBSCALE_NODE_LISTEN_IP` and `LBSCALE_NODE_BIN`, unset on a real VM, let
/// the tests' fake ARM server run the same script on loopback.
fn bootstrap(req: &ProvisionRequest) -> String {
    let c = &req.credentials;
    let file = |name: &str, content: &str| {
        // PEM and `sha256:HEX` hold no quote: a quoted here-document keeps them as they are.
        format!(
            "cat > \"$dir/{name}\" <<'LBSCALE_END'\n{}\nLBSCALE_END\n",
            content.trim_end()
        )
    };
    format!(
        "#!/bin/sh\n\
         # lbscale node {node}: written by lbscale's azure driver.\n\
         set -e\n\
         umask 077\n\
         dir=\"${{LBSCALE_NODE_ROOT:-}}/etc/lbscale\"\n\
         mkdir -p \"$dir\"\n\
         {token}{ca}{cert}{key}\
         ip=${{LBSCALE_NODE_LISTEN_IP:-}}\n\
         listen=${{LBSCALE_NODE_LISTEN_IP:-0.0.0.0}}\n\
         for i in 1 2 3 4 5 6 7 8 9 10; do\n\
         [ -n \"$ip\" ] && break\n\
         ip=$(curl -sf -m 2 -H 'Metadata: true' 'http://169.254.169.254/metadata/instance/network/interface/0/ipv4/ipAddress/0/privateIpAddress?api-version=2021-02-01&format=text') && break\n\
         sleep 1\n\
         done\n\
         [ -n \"$ip\" ] || {{ echo 'lbscale: no private address from the instance metadata' >&2; exit 1; }}\n\
         exec \"${{LBSCALE_NODE_BIN:-lbscale-node}}\" serve --node-id {node} --listen-ip \"$listen\" --api-address \"$ip\" --api-port {port} \
         --token-file \"$dir/token\" --tls-ca \"$dir/ca.pem\" --tls-cert \"$dir/node.pem\" \
         --tls-key \"$dir/node-key.pem\" --memory-limit-mb {mem}\n",
        node = req.node_id,
        token = file("token", &c.token_file),
        ca = file("ca.pem", &c.ca_pem),
        cert = file("node.pem", &c.cert_pem),
        key = file("node-key.pem", &c.key_pem),
        port = NODE_API_PORT,
        mem = req.node.memory_limit_mb,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn images_are_urns_or_ids() {
        assert_eq!(
            image_reference("Canonical:ubuntu-24_04-lts:server:latest").unwrap()["offer"],
            "ubuntu-24_04-lts"
        );
        let id = "/subscriptions/s/resourceGroups/g/providers/Microsoft.Compute/images/lbscale";
        assert_eq!(image_reference(id).unwrap()["id"], id);
        for bad in ["ubuntu", "a:b:c", "a::c:d"] {
            let CloudError::Failed(e) = image_reference(bad).unwrap_err() else {
                panic!()
            };
            assert!(
                e.contains("node.image") && e.contains("publisher:offer:sku:version"),
                "{e}"
            );
        }
    }

    #[test]
    fn the_ssh_key_is_an_openssh_ed25519_key() {
        let k = throwaway_ssh_key().unwrap();
        let b64 = k.split(' ').nth(1).unwrap();
        let blob = base64::engine::general_purpose::STANDARD
            .decode(b64)
            .unwrap();
        assert_eq!(&blob[4..15], b"ssh-ed25519");
        assert_eq!(blob.len(), 4 + 11 + 4 + 32);
        assert_ne!(k, throwaway_ssh_key().unwrap());
    }
}
