//! Vservers: create, update, delete (each a redeploy of its group) and where
//! clients reach them.

use super::{new_id, Engine, EngineError, Result};
use crate::model::{
    check_vserver_placement, DistributorMode, Finding, Findings, PathStep, VserverSpec,
};
use crate::store::Row;
use std::collections::BTreeMap;

impl Engine {
    pub fn vserver(&self, id: &str) -> Result<Option<Row<VserverSpec>>> {
        Ok(self.store.vserver(id)?)
    }

    /// The vserver named `name`, if there is one.
    pub fn vserver_named(&self, name: &str) -> Result<Option<Row<VserverSpec>>> {
        Ok(self.store.vserver_by_name(name)?)
    }

    /// Rules that need the store: the SE group exists; UDP needs a dns distributor;
    /// SOURCEIP persistence across AZs is a warning.
    pub fn check_vserver(&self, spec: &VserverSpec) -> Result<Findings> {
        let mut f = Findings::default();
        // The provider's schema says so too; the engine has other callers.
        if !matches!(spec.service_type.as_str(), "HTTP" | "TCP" | "UDP") {
            f.0.push(Finding::error(
                vec![PathStep::Attr("service_type")],
                "Unknown service type",
                format!(
                    "service_type {:?} is not one of HTTP, TCP or UDP.",
                    spec.service_type
                ),
            ));
            return Ok(f);
        }
        let Some(se) = self.store.se_group(&spec.se_group_id)? else {
            f.0.push(Finding::error(
                vec![PathStep::Attr("se_group_id")],
                "Unknown SE group",
                format!("no SE group has id {:?}.", spec.se_group_id),
            ));
            return Ok(f);
        };
        if let Some(g) = self.store.group(&se.spec.autoscale_group_id)? {
            if let Some(d) = self.store.distributor(&g.spec.traffic_distributor_id)? {
                check_vserver_placement(
                    &mut f,
                    &spec.service_type,
                    &spec.persistence,
                    d.spec.mode.as_str(),
                    g.spec.availability_zones.len(),
                );
            }
        }
        Ok(f)
    }

    fn group_of_se_group(&self, se_group_id: &str) -> Result<Option<String>> {
        Ok(self
            .store
            .se_group(se_group_id)?
            .map(|s| s.spec.autoscale_group_id))
    }

    pub(super) async fn redeploy(&self, group_id: Option<String>) -> Result<()> {
        if let Some(g) = group_id {
            if self.store.group(&g)?.is_some() {
                self.store.bump_config_version(&g)?;
                self.reconcile_group(&g).await?;
            }
        }
        Ok(())
    }

    /// Records the vserver and deploys it to its group's nodes; a vserver that
    /// cannot be deployed is taken back out. One with the same name and
    /// settings already in the store (an apply that stopped after recording
    /// it, before Terraform saved it) is adopted: deployed again, its id returned.
    pub async fn create_vserver(&self, spec: &VserverSpec) -> Result<String> {
        Self::reject(self.check_vserver(spec)?)?;
        if let Some(existing) = self.store.vserver_by_name(&spec.name)? {
            if existing.spec == *spec {
                self.redeploy(self.group_of_se_group(&spec.se_group_id)?)
                    .await?;
                return Ok(existing.id);
            }
        }
        let id = new_id("vs");
        self.store.insert_vserver(&id, spec)?;
        if let Err(e) = self
            .redeploy(self.group_of_se_group(&spec.se_group_id)?)
            .await
        {
            // Not deployed: take the row back so that the store says what runs.
            self.store.delete_vserver(&id)?;
            let _ = self
                .redeploy(self.group_of_se_group(&spec.se_group_id)?)
                .await;
            return Err(e);
        }
        Ok(id)
    }

    pub async fn update_vserver(&self, id: &str, spec: &VserverSpec) -> Result<()> {
        Self::reject(self.check_vserver(spec)?)?;
        let old = self
            .store
            .vserver(id)?
            .ok_or_else(|| EngineError::NotFound(format!("vserver {id}")))?;
        self.store.update_vserver(id, spec)?;
        let old_group = self.group_of_se_group(&old.spec.se_group_id)?;
        let new_group = self.group_of_se_group(&spec.se_group_id)?;
        if old_group != new_group {
            self.redeploy(old_group).await?;
        }
        self.redeploy(new_group).await
    }

    pub async fn delete_vserver(&self, id: &str) -> Result<()> {
        let Some(row) = self.store.vserver(id)? else {
            return Ok(());
        };
        self.store.delete_vserver(id)?;
        self.redeploy(self.group_of_se_group(&row.spec.se_group_id)?)
            .await
    }

    /// Where clients reach the vserver in each AZ: the AZ's VIP (`nlb`) or the
    /// application's domain (`dns`), with the vserver's port.
    pub fn vserver_vips(&self, spec: &VserverSpec) -> Result<BTreeMap<String, String>> {
        let mut out = BTreeMap::new();
        let Some(se) = self.store.se_group(&spec.se_group_id)? else {
            return Ok(out);
        };
        let Some(g) = self.store.group(&se.spec.autoscale_group_id)? else {
            return Ok(out);
        };
        let Some(d) = self.distributor_view(&g.spec.traffic_distributor_id)? else {
            return Ok(out);
        };
        for az in &g.spec.availability_zones {
            let host = if d.spec.mode == DistributorMode::Dns {
                d.spec.domain.clone().unwrap_or_default()
            } else {
                match d.address.get(az) {
                    Some(v) => v.clone(),
                    None => continue,
                }
            };
            out.insert(az.clone(), format!("{host}:{}", spec.port));
        }
        Ok(out)
    }
}
