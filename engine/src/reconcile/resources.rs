//! A group's own cloud resources (the security group lbscale makes for an aws
//! group): made or brought in step with the group's `node` block and
//! vservers at every apply and before a scale-out, deleted with the group.

use super::{Engine, Result};
use crate::cloud::{Cloud, CloudError, GroupResources, Listener, Transport};
use crate::model::{GroupSpec, NodeSpec};
use crate::store::Row;

impl Engine {
    /// What the driver needs to keep the group's own resources in step: its
    /// `node` block and the ports its vservers listen on.
    pub(crate) fn group_resources(&self, group: &Row<GroupSpec>) -> Result<GroupResources> {
        let mut listeners: Vec<Listener> = self
            .store
            .vservers_of_group(&group.id)?
            .iter()
            .filter_map(|v| {
                Some(Listener {
                    port: u16::try_from(v.spec.port).ok()?,
                    protocol: Transport::of_service_type(&v.spec.service_type),
                })
            })
            .collect();
        listeners.sort();
        listeners.dedup();
        Ok(GroupResources {
            group_id: group.id.clone(),
            group_name: group.spec.name.clone(),
            availability_zones: group.spec.availability_zones.clone(),
            node: group.spec.node_spec(),
            listeners,
        })
    }

    /// The driver's [`Cloud::prepare_group`] for the group as it is now.
    pub(crate) async fn prepare_group_resources(
        &self,
        cloud: &dyn Cloud,
        group: &Row<GroupSpec>,
    ) -> Result<()> {
        cloud
            .prepare_group(&self.group_resources(group)?)
            .await
            .map_err(|e| super::EngineError::Step {
                step: "prepare the group's cloud resources",
                detail: e.to_string(),
            })
    }

    /// Why nodes of a group with `node` on `cloud` cannot start now, if they
    /// cannot (no driver, settings missing, no image in the block nor the
    /// driver's settings). Said at plan time.
    pub fn node_unusable(&self, cloud: &str, node: &NodeSpec) -> Option<CloudError> {
        if let Some(e) = self.cloud_unusable(cloud, false) {
            return Some(e);
        }
        let driver = self.clouds.nodes(cloud).ok()?;
        driver.node_unusable(node).map(|why| CloudError::Unusable {
            cloud: cloud.into(),
            why,
        })
    }
}
