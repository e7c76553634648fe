//! Public IP addresses (Microsoft.Network `publicIPAddresses`) that lbscale
//! makes: a node's own (on its network interface) and an `nlb`'s frontend
//! per zone. Each is Standard SKU (the only one a zonal address and a
//! Standard Load Balancer take), static, IPv4, in one zone, and tagged so
//! that a crash between its creation and the rest is cleaned up by tag.

use super::{arm, AzureCloud};
use lbscale_engine::cloud::{CloudError, Result};
use serde_json::{json, Value};
use std::collections::BTreeMap;

const NET_VERSION: &str = "2025-07-01";

/// A public IP as lbscale uses it.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct PublicIp {
    pub id: String,
    pub address: String,
}

impl AzureCloud {
    pub(crate) fn public_ip_path(&self, name: &str) -> String {
        self.arm.in_group(
            &self.resource_group,
            &format!("Microsoft.Network/publicIPAddresses/{name}"),
        )
    }

    /// The public IP `name` in `zone`: the one there (a step run again), else
    /// a new one with `tags`. An address in another zone is an error that
    /// says so (Azure cannot move an address between zones).
    pub(crate) async fn ensure_public_ip(
        &self,
        name: &str,
        zone: &str,
        tags: &BTreeMap<String, String>,
    ) -> Result<PublicIp> {
        let path = self.public_ip_path(name);
        let found = self
            .arm
            .get("public IP address GET", &path, NET_VERSION)
            .await?;
        let body = match found {
            Some(a) => {
                let zones: Vec<&str> = a.body["zones"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(Value::as_str)
                    .collect();
                if zones != [zone] {
                    return Err(CloudError::Failed(format!(
                        "the public IP address {name} exists in zone(s) {zones:?}, not in zone {zone}: delete it, lbscale makes it again"
                    )));
                }
                a.body
            }
            None => {
                let what = format!("public IP address PUT {name}");
                let body = json!({
                    "location": self.location,
                    "zones": [zone],
                    "sku": {"name": "Standard", "tier": "Regional"},
                    "tags": tags,
                    "properties": {
                        "publicIPAllocationMethod": "Static",
                        "publicIPAddressVersion": "IPv4",
                        // Goes when the VM that uses it is deleted (a node's).
                        "deleteOption": "Delete",
                    },
                });
                self.arm
                    .put(&what, &path, NET_VERSION, &body, &[("if-none-match", "*")])
                    .await
                    .or_else(|e| {
                        // Made in between (a step run twice at once): read it.
                        if e.status == 412 {
                            Ok(Value::Null)
                        } else {
                            Err(arm::failed(&what, e))
                        }
                    })?
            }
        };
        let body = if body.is_null() {
            self.arm
                .get("public IP address GET", &path, NET_VERSION)
                .await?
                .map(|a| a.body)
                .unwrap_or_default()
        } else {
            body
        };
        let address = body["properties"]["ipAddress"].as_str().ok_or_else(|| {
            CloudError::Failed(format!(
                "the public IP address {name} has no address (a static Standard address gets one when it is made)"
            ))
        })?;
        Ok(PublicIp {
            id: body["id"].as_str().unwrap_or(&path).to_string(),
            address: address.to_string(),
        })
    }

    /// The address of the public IP `id` (a resource id), if it exists.
    pub(crate) async fn public_ip_address(&self, id: &str) -> Result<Option<String>> {
        Ok(self
            .arm
            .get("public IP address GET", id, NET_VERSION)
            .await?
            .and_then(|a| {
                a.body["properties"]["ipAddress"]
                    .as_str()
                    .map(str::to_string)
            }))
    }

    /// The names of the resource group's public IPs whose tag `key` is `value`.
    pub(crate) async fn public_ips_tagged(&self, key: &str, value: &str) -> Result<Vec<String>> {
        let path = self
            .arm
            .in_group(&self.resource_group, "Microsoft.Network/publicIPAddresses");
        Ok(self
            .arm
            .list("public IP addresses list", &path, NET_VERSION)
            .await?
            .into_iter()
            .filter(|p| p["tags"][key].as_str() == Some(value))
            .filter_map(|p| p["name"].as_str().map(str::to_string))
            .collect())
    }

    /// Deletes the public IP `name`; one already gone is fine.
    pub(crate) async fn delete_public_ip(&self, name: &str) -> Result<()> {
        self.arm
            .delete(
                &format!("public IP address DELETE {name}"),
                &self.public_ip_path(name),
                NET_VERSION,
            )
            .await
    }
}
