//! SE groups: the scale-out settings of the vservers placed on a group.

use super::leases::wait_unused;
use super::{new_id, Engine, EngineError, Result};
use crate::model::{Finding, Findings, PathStep, SeGroupSpec};
use crate::store::Row;

impl Engine {
    pub fn se_group(&self, id: &str) -> Result<Option<Row<SeGroupSpec>>> {
        Ok(self.store.se_group(id)?)
    }

    /// The SE group named `name`, if there is one.
    pub fn se_group_named(&self, name: &str) -> Result<Option<Row<SeGroupSpec>>> {
        Ok(self.store.se_group_by_name(name)?)
    }

    pub fn check_se_group(&self, spec: &SeGroupSpec) -> Result<Findings> {
        let mut f = Findings::default();
        if self.store.group(&spec.autoscale_group_id)?.is_none() {
            f.0.push(Finding::error(
                vec![PathStep::Attr("autoscale_group_id")],
                "Unknown autoscale group",
                format!("no autoscale group has id {:?}.", spec.autoscale_group_id),
            ));
        }
        Ok(f)
    }

    /// Records the SE group. One with the same name and settings already in
    /// the store (an apply that stopped after recording it, before Terraform
    /// saved it) is adopted: its id is returned.
    pub async fn create_se_group(&self, spec: &SeGroupSpec) -> Result<String> {
        Self::reject(self.check_se_group(spec)?)?;
        if let Some(existing) = self.store.se_group_by_name(&spec.name)? {
            if existing.spec == *spec {
                return Ok(existing.id);
            }
        }
        let id = new_id("seg");
        self.store.insert_se_group(&id, spec)?;
        Ok(id)
    }

    pub async fn update_se_group(&self, id: &str, spec: &SeGroupSpec) -> Result<()> {
        Self::reject(self.check_se_group(spec)?)?;
        let old = self
            .store
            .se_group(id)?
            .ok_or_else(|| EngineError::NotFound(format!("SE group {id}")))?;
        self.store.update_se_group(id, spec)?;
        if old.spec.se_tunnel_mode != spec.se_tunnel_mode
            && old.spec.autoscale_group_id == spec.autoscale_group_id
        {
            // Nodes read the tunnel mode only when they start.
            self.rolling_restart(
                &spec.autoscale_group_id,
                &format!(
                    "se_tunnel_mode {} -> {}",
                    old.spec.se_tunnel_mode, spec.se_tunnel_mode
                ),
            )
            .await?;
        }
        let placement_changed = old.spec.scaling_mode != spec.scaling_mode
            || old.spec.min_scaleout_per_vs != spec.min_scaleout_per_vs
            || old.spec.max_scaleout_per_vs != spec.max_scaleout_per_vs
            || old.spec.primary_forwarding_cost != spec.primary_forwarding_cost
            || old.spec.vs_scalein_timeout != spec.vs_scalein_timeout;
        if placement_changed && old.spec.autoscale_group_id == spec.autoscale_group_id {
            // New roles and shares on the nodes, new targets in the distributor.
            self.redeploy(Some(spec.autoscale_group_id.clone())).await?;
        }
        if old.spec.autoscale_group_id != spec.autoscale_group_id {
            // Its vservers move with it.
            for g in [&old.spec.autoscale_group_id, &spec.autoscale_group_id] {
                if self.store.group(g)?.is_some() {
                    self.store.bump_config_version(g)?;
                    self.reconcile_group(g).await?;
                }
            }
        }
        Ok(())
    }

    pub async fn delete_se_group(&self, id: &str) -> Result<()> {
        let Some(row) = self.store.se_group(id)? else {
            return Ok(());
        };
        wait_unused(format!("SE group {:?}", row.spec.name), "vserver", || {
            Ok(self
                .store
                .vservers_of_se_group(id)?
                .into_iter()
                .map(|v| v.spec.name)
                .collect())
        })
        .await?;
        self.store.delete_se_group(id)?;
        Ok(())
    }
}
