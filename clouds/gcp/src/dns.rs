//! The `gcp` `dns` distributor: the `A` record set of its domain in the
//! project's public Cloud DNS managed zone that holds the domain (the
//! longest such zone), changed through `changes.create`. A `TXT` record at
//! `_lbscale.<domain>` naming the distributor marks the `A` record as
//! lbscale's: a record without it is never taken over nor deleted. The zone
//! is the operator's: lbscale never creates or deletes one.

use super::api::{failed, Service};
use super::GcpCloud;
use lbscale_engine::cloud::{CloudError, Distributor, Publication, Result};
use lbscale_engine::model::{DistributorMode, DistributorSpec};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// How long Cloud DNS gets to apply a change.
const CHANGE_TIMEOUT: Duration = Duration::from_secs(120);
const POLL: Duration = Duration::from_millis(500);

/// What the store keeps of a gcp distributor between calls.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub(crate) struct DistributorRuntime {
    /// `dns`: the managed zone's name, and the domain it was chosen for.
    pub managed_zone: Option<String>,
    pub domain: Option<String>,
    pub name_servers: Vec<String>,
    /// `nlb`: zone -> its VIP.
    pub nlb_addresses: BTreeMap<String, String>,
    /// `nlb`: the regions it may have made something in (saved before it
    /// makes anything there, so that a crash leaves nothing unknown).
    pub nlb_regions: std::collections::BTreeSet<String>,
}

/// A DNS name as Cloud DNS writes it: lowercase, with its final dot.
fn fqdn(name: &str) -> String {
    format!("{}.", name.trim_end_matches('.').to_ascii_lowercase())
}

/// Where a distributor marks the `A` record of `domain` as its own.
fn owner_name(domain: &str) -> String {
    fqdn(&format!("_lbscale.{}", domain.trim_end_matches('.')))
}

/// The owner record's value (a TXT value is a quoted string).
fn owner_value(id: &str) -> String {
    format!("\"lbscale distributor {id}\"")
}

/// A record set: its TTL and sorted values.
type RecordSet = (u64, Vec<String>);

fn record(name: &str, rtype: &str, (ttl, values): &RecordSet) -> Value {
    json!({"kind": "dns#resourceRecordSet", "name": name, "type": rtype, "ttl": ttl, "rrdatas": values})
}

impl GcpCloud {
    pub(crate) fn runtime(&self, id: &str) -> Result<DistributorRuntime> {
        self.store.load_runtime(id)
    }

    pub(crate) fn save_runtime(&self, id: &str, rt: &DistributorRuntime) -> Result<()> {
        self.store.save_runtime(id, rt)
    }

    /// The project's public managed zones: (name, dnsName with its dot, name servers).
    async fn managed_zones(&self) -> Result<Vec<(String, String, Vec<String>)>> {
        let mut out = Vec::new();
        let mut page: Option<String> = None;
        loop {
            let mut q = vec![];
            if let Some(p) = &page {
                q.push(("pageToken", p.clone()));
            }
            let v = self
                .api
                .json(
                    Service::Dns,
                    "dns.managedZones.list",
                    "GET",
                    "managedZones",
                    &q,
                    None,
                )
                .await?;
            for z in v["managedZones"].as_array().into_iter().flatten() {
                // A private zone answers only inside its networks, not to clients.
                if z["visibility"].as_str().unwrap_or("public") != "public" {
                    continue;
                }
                out.push((
                    z["name"].as_str().unwrap_or("").to_string(),
                    z["dnsName"].as_str().unwrap_or("").to_ascii_lowercase(),
                    z["nameServers"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .filter_map(|n| n.as_str().map(str::to_string))
                        .collect(),
                ));
            }
            page = v["nextPageToken"].as_str().map(str::to_string);
            if page.is_none() {
                return Ok(out);
            }
        }
    }

    /// The record set `name`/`rtype` of `zone`, if it exists.
    async fn record_set(&self, zone: &str, name: &str, rtype: &str) -> Result<Option<RecordSet>> {
        let v = self
            .api
            .json(
                Service::Dns,
                "dns.resourceRecordSets.list",
                "GET",
                &format!("managedZones/{zone}/rrsets"),
                &[("name", name.to_string()), ("type", rtype.to_string())],
                None,
            )
            .await?;
        Ok(v["rrsets"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|r| r["type"] == rtype)
            .map(|r| {
                let mut values: Vec<String> = r["rrdatas"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|d| d.as_str().map(str::to_string))
                    .collect();
                values.sort();
                (r["ttl"].as_u64().unwrap_or(0), values)
            }))
    }

    /// One change (applied whole or not at all), waited on until it is `done`.
    async fn change(&self, zone: &str, deletions: Vec<Value>, additions: Vec<Value>) -> Result<()> {
        let body = json!({"kind": "dns#change", "additions": additions, "deletions": deletions});
        let mut c = match self
            .api
            .call(Service::Dns, "dns.changes.create", "POST", &format!("managedZones/{zone}/changes"), &[], Some(&body))
            .await
        {
            Ok(c) => c,
            Err(e) if e.status == 412 => {
                return Err(CloudError::Failed(format!(
                    "GCP dns.changes.create in zone {zone}: a record changed since it was read (HTTP 412 {}: {}); the next publication reads it again",
                    e.reason, e.message
                )))
            }
            Err(e) => return Err(failed("dns.changes.create", e)),
        };
        let id = c["id"].as_str().unwrap_or_default().to_string();
        let deadline = Instant::now() + CHANGE_TIMEOUT;
        while c["status"] != "done" {
            if Instant::now() >= deadline {
                return Err(CloudError::Failed(format!(
                    "Cloud DNS change {id} in zone {zone} not done after {}s (status {})",
                    CHANGE_TIMEOUT.as_secs(),
                    c["status"]
                )));
            }
            tokio::time::sleep(POLL).await;
            c = self
                .api
                .json(
                    Service::Dns,
                    "dns.changes.get",
                    "GET",
                    &format!("managedZones/{zone}/changes/{id}"),
                    &[],
                    None,
                )
                .await?;
        }
        Ok(())
    }

    /// The zone of `domain` for distributor `id`, chosen and kept.
    async fn ensure_dns(&self, id: &str, spec: &DistributorSpec) -> Result<DistributorRuntime> {
        let domain = fqdn(spec.domain.as_deref().unwrap_or_default());
        let rt = self.runtime(id)?;
        if rt.managed_zone.is_some() && rt.domain.as_deref() == Some(domain.as_str()) {
            return Ok(rt);
        }
        if let (Some(_), Some(old)) = (&rt.managed_zone, &rt.domain) {
            // The domain changed: the old name's records go first.
            self.remove_records(id, old, &rt).await?;
        }
        let zones = self.managed_zones().await?;
        let Some((zone, _, ns)) = zones
            .iter()
            .filter(|(_, dns, _)| domain == *dns || domain.ends_with(&format!(".{dns}")))
            .max_by_key(|(_, dns, _)| dns.len())
        else {
            return Err(CloudError::Failed(format!(
                "no public Cloud DNS managed zone of project {} holds {domain}: create one for it or a parent domain (gcloud dns managed-zones create); lbscale never creates zones",
                self.api.project()
            )));
        };
        let rt = DistributorRuntime {
            managed_zone: Some(zone.clone()),
            domain: Some(domain),
            name_servers: ns.clone(),
            ..rt
        };
        self.save_runtime(id, &rt)?;
        Ok(rt)
    }

    async fn publish_dns(
        &self,
        id: &str,
        spec: &DistributorSpec,
        publication: &Publication,
    ) -> Result<()> {
        let rt = self.ensure_dns(id, spec).await?;
        let zone = rt.managed_zone.clone().unwrap_or_default();
        let domain = rt.domain.clone().unwrap_or_default();
        let owner = owner_name(&domain);
        let ttl = spec.ttl.get().as_secs();
        let mut want: Vec<String> = publication.endpoints.values().flatten().cloned().collect();
        want.sort();
        want.dedup();
        let current = self.record_set(&zone, &domain, "A").await?;
        let marker = self.record_set(&zone, &owner, "TXT").await?;
        let ours = marker
            .as_ref()
            .is_some_and(|(_, v)| v == &[owner_value(id)]);
        if (current.is_some() || marker.is_some()) && !ours {
            return Err(CloudError::Failed(format!(
                "an A record of {domain} (or its marker {owner}) already exists in managed zone {zone} and is not this distributor's (no TXT record {owner} naming it): delete it, or give the distributor another domain"
            )));
        }
        let mut deletions = vec![];
        let mut additions = vec![];
        if want.is_empty() {
            if let Some(a) = &current {
                deletions.push(record(&domain, "A", a));
            }
            if let Some(m) = &marker {
                deletions.push(record(&owner, "TXT", m));
            }
        } else {
            let wanted = (ttl, want);
            if current.as_ref() == Some(&wanted) {
                return Ok(());
            }
            // Cloud DNS deletes only the record set exactly as it is.
            if let Some(a) = &current {
                deletions.push(record(&domain, "A", a));
            }
            additions.push(record(&domain, "A", &wanted));
            if marker.is_none() {
                additions.push(record(&owner, "TXT", &(ttl, vec![owner_value(id)])));
            }
        }
        if deletions.is_empty() && additions.is_empty() {
            return Ok(());
        }
        self.change(&zone, deletions, additions).await
    }

    /// Deletes this distributor's `A` record of `domain` and its marker; an
    /// `A` record that is not this distributor's is left alone.
    async fn remove_records(&self, id: &str, domain: &str, rt: &DistributorRuntime) -> Result<()> {
        let Some(zone) = &rt.managed_zone else {
            return Ok(());
        };
        let owner = owner_name(domain);
        let marker = match self.record_set(zone, &owner, "TXT").await {
            Ok(m) => m,
            // The zone was deleted outside lbscale: nothing of ours is left.
            Err(CloudError::Failed(m)) if m.contains("HTTP 404") => return Ok(()),
            Err(e) => return Err(e),
        };
        let Some(marker) = marker.filter(|(_, v)| v == &[owner_value(id)]) else {
            return Ok(());
        };
        let mut deletions = vec![record(&owner, "TXT", &marker)];
        if let Some(a) = self.record_set(zone, domain, "A").await? {
            deletions.push(record(domain, "A", &a));
        }
        self.change(zone, deletions, vec![]).await
    }
}

#[async_trait::async_trait]
impl Distributor for GcpCloud {
    async fn ensure(&self, id: &str, spec: &DistributorSpec) -> Result<()> {
        if spec.mode == DistributorMode::Nlb {
            // Made at the first publication with a port: it needs the zones
            // of the groups, and it costs while it exists.
            return Ok(());
        }
        self.ensure_dns(id, spec).await.map(|_| ())
    }

    async fn publish(
        &self,
        id: &str,
        spec: &DistributorSpec,
        publication: &Publication,
    ) -> Result<()> {
        match spec.mode {
            DistributorMode::Nlb => self.publish_nlb(id, publication).await,
            DistributorMode::Dns => self.publish_dns(id, spec, publication).await,
        }
    }

    async fn remove(&self, id: &str) -> Result<()> {
        let Some(spec) = self.store.distributor(id)? else {
            return Ok(());
        };
        if spec.mode == DistributorMode::Nlb {
            return self.remove_nlb(id).await;
        }
        let rt = self.runtime(id)?;
        let domain = rt
            .domain
            .clone()
            .unwrap_or_else(|| fqdn(spec.domain.as_deref().unwrap_or_default()));
        self.remove_records(id, &domain, &rt).await
    }

    fn addresses(&self, id: &str, spec: &DistributorSpec) -> BTreeMap<String, String> {
        let rt = self.runtime(id).unwrap_or_default();
        if spec.mode == DistributorMode::Nlb {
            return rt.nlb_addresses;
        }
        rt.name_servers
            .first()
            .map(|ns| ("dns".to_string(), ns.trim_end_matches('.').to_string()))
            .into_iter()
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_fully_qualified_and_lowercase() {
        assert_eq!(fqdn("App.Example.com"), "app.example.com.");
        assert_eq!(fqdn("app.example.com."), "app.example.com.");
        assert_eq!(owner_name("app.example.com."), "_lbscale.app.example.com.");
    }
}
