//! The azure `dns` distributor: an Azure Traffic Manager profile (Azure's
//! DNS-based load balancer) of its own.
//!
//! - `MultiValue` routing: each answer holds up to 8 healthy endpoints, as the
//!   other clouds' `dns` distributors answer with every serving node;
//! - the distributor's TTL is the profile's DNS TTL;
//! - one external endpoint per serving node (its public address, else its
//!   private one), named after the address;
//! - endpoint monitoring over TCP on the vserver port (the lowest, when the
//!   groups have several), so Traffic Manager stops handing out a node that
//!   does not answer before lbscale notices;
//! - when the distributor's `domain` lies in an Azure DNS zone of the
//!   subscription: a CNAME record set from the domain to the profile's name
//!   (at a zone's apex, an alias `A` record set to the profile), marked as
//!   lbscale's in its metadata. A record set that lbscale did not make is
//!   never changed nor deleted: it is created with `If-None-Match: *` and
//!   changed with `If-Match` of the one read.
//!
//! Every change is read back before the workflow goes on.

use super::{arm, AzureCloud, DistributorRuntime};
use lbscale_engine::cloud::{CloudError, Publication, Result};
use lbscale_engine::model::DistributorSpec;
use serde_json::{json, Value};

const TM_VERSION: &str = "2026-09-01";
const DNS_VERSION: &str = "2018-05-01";
/// The metadata key of the record sets lbscale makes; its value is the
/// distributor's id.
const OWNER_KEY: &str = "lbscale_distributor";
/// The most endpoints a `MultiValue` answer may hold.
const MAX_RETURN: i64 = 8;
/// The monitor's port before the first publication says the vservers' one.
const DEFAULT_MONITOR_PORT: i64 = 80;

impl AzureCloud {
    fn profile_path(&self, id: &str) -> String {
        self.arm.in_group(
            &self.resource_group,
            &format!(
                "Microsoft.Network/trafficmanagerprofiles/{}",
                Self::name_of(id, 63)
            ),
        )
    }

    /// The profile's label under `trafficmanager.net`, unique worldwide: the
    /// distributor's name and a hash of the subscription.
    fn relative_name(&self, id: &str) -> String {
        format!(
            "{}-{:08x}",
            Self::name_of(id, 54).to_ascii_lowercase(),
            fnv32(self.arm.subscription())
        )
    }

    async fn read_profile(&self, id: &str) -> Result<Option<Value>> {
        Ok(self
            .arm
            .get(
                "Traffic Manager profile GET",
                &self.profile_path(id),
                TM_VERSION,
            )
            .await?
            .map(|a| a.body))
    }

    fn profile_body(&self, id: &str, ttl: i64, port: i64, targets: &[String]) -> Value {
        let endpoints: Vec<Value> = targets
            .iter()
            .map(|t| {
                json!({
                    "name": endpoint_name(t),
                    "type": "Microsoft.Network/trafficManagerProfiles/externalEndpoints",
                    "properties": {"target": t, "endpointStatus": "Enabled"},
                })
            })
            .collect();
        json!({
            "location": "global",
            "tags": {"lbscale-distributor-id": id},
            "properties": {
                "profileStatus": "Enabled",
                "trafficRoutingMethod": "MultiValue",
                "maxReturn": MAX_RETURN,
                "dnsConfig": {"relativeName": self.relative_name(id), "ttl": ttl},
                "monitorConfig": {
                    "protocol": "TCP",
                    "port": port,
                    // Traffic Manager's fast probing: a node that stops
                    // answering leaves the answers in about 15 s.
                    "intervalInSeconds": 10,
                    "timeoutInSeconds": 5,
                    "toleratedNumberOfFailures": 1,
                },
                "endpoints": endpoints,
            },
        })
    }

    /// Makes the profile, with no endpoint, when it does not exist; and the
    /// domain's record set.
    pub(super) async fn ensure_profile(&self, id: &str, spec: &DistributorSpec) -> Result<()> {
        let profile = match self.read_profile(id).await? {
            Some(p) => p,
            None => {
                let body = self.profile_body(id, ttl_of(spec), DEFAULT_MONITOR_PORT, &[]);
                self.put_profile(id, &body).await?
            }
        };
        self.after_profile(id, spec, &profile).await
    }

    async fn put_profile(&self, id: &str, body: &Value) -> Result<Value> {
        let what = format!("Traffic Manager profile PUT {}", Self::name_of(id, 63));
        self.arm
            .put(&what, &self.profile_path(id), TM_VERSION, body, &[])
            .await
            .map_err(|e| arm::failed(&what, e))
    }

    /// The profile's name kept, and the domain's record set in step.
    async fn after_profile(&self, id: &str, spec: &DistributorSpec, profile: &Value) -> Result<()> {
        let fqdn = profile["properties"]["dnsConfig"]["fqdn"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        let mut rt = self.runtime_checked(id)?;
        let domain = spec.domain.clone().filter(|d| !d.is_empty());
        if rt.domain.is_some() && rt.domain != domain {
            // The domain changed: the old one's record set goes.
            if let Some(record) = rt.record.take() {
                self.delete_record(id, &record).await?;
            }
            rt.domain = None;
            self.save_runtime(id, &rt)?;
        }
        rt.fqdn = Some(fqdn.clone());
        if let Some(domain) = &domain {
            rt.record = self
                .ensure_record(id, domain, &fqdn, &self.profile_path(id), ttl_of(spec))
                .await?;
            rt.domain = Some(domain.clone());
        }
        self.save_runtime(id, &rt)
    }

    /// Makes the profile hand out exactly the publication's addresses, and
    /// reads it back.
    pub(super) async fn publish_profile(
        &self,
        id: &str,
        spec: &DistributorSpec,
        publication: &Publication,
    ) -> Result<()> {
        let mut targets: Vec<String> = publication.endpoints.values().flatten().cloned().collect();
        targets.sort();
        targets.dedup();
        let current = self.read_profile(id).await?;
        let port = publication
            .ports
            .values()
            .flatten()
            .min()
            .map(|p| *p as i64)
            .or_else(|| {
                current
                    .as_ref()
                    .and_then(|c| c["properties"]["monitorConfig"]["port"].as_i64())
            })
            .unwrap_or(DEFAULT_MONITOR_PORT);
        let ttl = ttl_of(spec);
        let profile = match current {
            Some(c) if serves(&c, ttl, port, &targets) => c,
            _ => {
                let body = self.profile_body(id, ttl, port, &targets);
                let after = self.put_profile(id, &body).await?;
                if !serves(&after, ttl, port, &targets) {
                    return Err(CloudError::Failed(format!(
                        "Azure Traffic Manager profile {}: after the PUT it does not hand out {targets:?} with TTL {ttl} and monitor port {port} (it has {})",
                        Self::name_of(id, 63),
                        after["properties"]
                    )));
                }
                after
            }
        };
        self.after_profile(id, spec, &profile).await
    }

    pub(super) async fn remove_profile(&self, id: &str, spec: &DistributorSpec) -> Result<()> {
        let rt = self.runtime_checked(id)?;
        match rt.record.clone() {
            Some(record) => self.delete_record(id, &record).await?,
            // Lost track of (a crash before it was saved): found by the domain.
            None => {
                if let Some(domain) = rt.domain.clone().or(spec.domain.clone()) {
                    if let Some((path, _)) = self.record_path(&domain).await? {
                        self.delete_record(id, &path).await?;
                    }
                }
            }
        }
        self.arm
            .delete(
                &format!("Traffic Manager profile DELETE {}", Self::name_of(id, 63)),
                &self.profile_path(id),
                TM_VERSION,
            )
            .await?;
        self.save_runtime(id, &DistributorRuntime::default())
    }

    /// The public DNS zones of the subscription: (id, name).
    async fn zones(&self) -> Result<Vec<(String, String)>> {
        let path = format!(
            "/subscriptions/{}/providers/Microsoft.Network/dnszones",
            self.arm.subscription()
        );
        Ok(self
            .arm
            .list("DNS zones list", &path, DNS_VERSION)
            .await?
            .into_iter()
            .filter(|z| z["properties"]["zoneType"].as_str().unwrap_or("Public") == "Public")
            .filter_map(|z| {
                Some((
                    z["id"].as_str()?.to_string(),
                    z["name"].as_str()?.to_string(),
                ))
            })
            .collect())
    }

    /// The record set path for `domain` in the longest zone that holds it,
    /// and whether it is the zone's apex; None when no zone holds it.
    async fn record_path(&self, domain: &str) -> Result<Option<(String, bool)>> {
        let zones = self.zones().await?;
        let Some((zone_id, zone)) = zone_for(&zones, domain) else {
            return Ok(None);
        };
        let domain = domain.trim_end_matches('.').to_ascii_lowercase();
        let zone = zone.trim_end_matches('.').to_ascii_lowercase();
        Ok(Some(if domain == zone {
            (format!("{zone_id}/A/@"), true)
        } else {
            let relative = &domain[..domain.len() - zone.len() - 1];
            (format!("{zone_id}/CNAME/{relative}"), false)
        }))
    }

    /// The domain's record set pointing at the profile: made or brought in
    /// step when it is lbscale's, refused when it is someone else's. Its
    /// path, or None when no zone of the subscription holds the domain.
    async fn ensure_record(
        &self,
        id: &str,
        domain: &str,
        fqdn: &str,
        profile_id: &str,
        ttl: i64,
    ) -> Result<Option<String>> {
        let Some((path, apex)) = self.record_path(domain).await? else {
            return Ok(None);
        };
        let what = format!("DNS record set PUT {domain}");
        let mut props = json!({"TTL": ttl, "metadata": {OWNER_KEY: id}});
        if apex {
            props["targetResource"] = json!({"id": profile_id});
        } else {
            props["CNAMERecord"] = json!({"cname": fqdn});
        }
        let body = json!({"properties": props});
        let current = self
            .arm
            .get("DNS record set GET", &path, DNS_VERSION)
            .await?;
        let written = match current {
            None => self
                .arm
                .put(&what, &path, DNS_VERSION, &body, &[("if-none-match", "*")])
                .await
                .map_err(|e| {
                    if e.status == 412 {
                        not_ours(domain, id)
                    } else {
                        arm::failed(&what, e)
                    }
                })?,
            Some(c) if c.body["properties"]["metadata"][OWNER_KEY].as_str() != Some(id) => {
                return Err(not_ours(domain, id));
            }
            Some(c) if points_at(&c.body, apex, fqdn, profile_id, ttl) => c.body,
            Some(c) => {
                let etag = c.body["etag"].as_str().unwrap_or("*").to_string();
                self.arm
                    .put(&what, &path, DNS_VERSION, &body, &[("if-match", &etag)])
                    .await
                    .map_err(|e| arm::failed(&what, e))?
            }
        };
        if !points_at(&written, apex, fqdn, profile_id, ttl) {
            return Err(CloudError::Failed(format!(
                "Azure DNS record set {domain}: after the PUT it does not point at {fqdn} with TTL {ttl}"
            )));
        }
        Ok(Some(path))
    }

    /// Deletes the record set at `path` if it is this distributor's.
    async fn delete_record(&self, id: &str, path: &str) -> Result<()> {
        let Some(current) = self
            .arm
            .get("DNS record set GET", path, DNS_VERSION)
            .await?
        else {
            return Ok(());
        };
        if current.body["properties"]["metadata"][OWNER_KEY].as_str() != Some(id) {
            return Ok(());
        }
        let etag = current.body["etag"].as_str().unwrap_or("*").to_string();
        self.arm
            .delete_if(
                "DNS record set DELETE",
                path,
                DNS_VERSION,
                &[("if-match", &etag)],
            )
            .await
    }
}

fn ttl_of(spec: &DistributorSpec) -> i64 {
    spec.ttl.get().as_secs().max(1) as i64
}

fn not_ours(domain: &str, id: &str) -> CloudError {
    CloudError::Failed(format!(
        "a DNS record set for {domain} already exists and is not this distributor's (no metadata {OWNER_KEY}={id}): delete it, or give the distributor another domain"
    ))
}

/// Whether the profile hands out exactly `targets` with `ttl`, monitoring `port`.
fn serves(profile: &Value, ttl: i64, port: i64, targets: &[String]) -> bool {
    let p = &profile["properties"];
    let mut have: Vec<String> = p["endpoints"]
        .as_array()
        .map(|e| {
            e.iter()
                .filter(|e| e["properties"]["endpointStatus"].as_str() != Some("Disabled"))
                .filter_map(|e| e["properties"]["target"].as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default();
    have.sort();
    let all = p["endpoints"].as_array().map(Vec::len).unwrap_or(0);
    have == targets
        && all == targets.len()
        && p["dnsConfig"]["ttl"].as_i64() == Some(ttl)
        && p["monitorConfig"]["port"].as_i64() == Some(port)
        && p["trafficRoutingMethod"].as_str() == Some("MultiValue")
}

fn points_at(record: &Value, apex: bool, fqdn: &str, profile_id: &str, ttl: i64) -> bool {
    let p = &record["properties"];
    let target = if apex {
        p["targetResource"]["id"]
            .as_str()
            .is_some_and(|t| t.eq_ignore_ascii_case(profile_id))
    } else {
        p["CNAMERecord"]["cname"].as_str().is_some_and(|c| {
            c.trim_end_matches('.')
                .eq_ignore_ascii_case(fqdn.trim_end_matches('.'))
        })
    };
    target && p["TTL"].as_i64() == Some(ttl)
}

/// An endpoint's name: its address, with what a name cannot hold as `-`.
fn endpoint_name(target: &str) -> String {
    format!(
        "n-{}",
        target
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
            .collect::<String>()
    )
}

/// The zone among `zones` that holds `domain`: the longest that is the
/// domain or one of its parents.
fn zone_for<'z>(zones: &'z [(String, String)], domain: &str) -> Option<&'z (String, String)> {
    let domain = domain.trim_end_matches('.').to_ascii_lowercase();
    zones
        .iter()
        .filter(|(_, name)| {
            let zone = name.trim_end_matches('.').to_ascii_lowercase();
            domain == zone || domain.ends_with(&format!(".{zone}"))
        })
        .max_by_key(|(_, name)| name.trim_end_matches('.').len())
}

/// FNV-1a, 32 bits: a short stable hash for a name.
fn fnv32(s: &str) -> u32 {
    s.bytes().fold(0x811c_9dc5u32, |h, b| {
        (h ^ b as u32).wrapping_mul(0x0100_0193)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_longest_zone_that_holds_the_domain() {
        let zones = vec![
            ("Z1".to_string(), "example.com".to_string()),
            ("Z2".to_string(), "shop.example.com".to_string()),
        ];
        assert_eq!(zone_for(&zones, "www.Shop.example.com.").unwrap().0, "Z2");
        assert_eq!(zone_for(&zones, "example.com").unwrap().0, "Z1");
        assert!(zone_for(&zones, "xample.com").is_none());
    }

    #[test]
    fn a_profile_serves_only_its_exact_endpoints_ttl_and_port() {
        let p = json!({"properties": {"trafficRoutingMethod": "MultiValue", "dnsConfig": {"ttl": 30}, "monitorConfig": {"port": 80},
            "endpoints": [{"properties": {"target": "10.0.0.2", "endpointStatus": "Enabled"}},
                          {"properties": {"target": "10.0.0.1"}}]}});
        let t = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert!(serves(&p, 30, 80, &t(&["10.0.0.1", "10.0.0.2"])));
        assert!(!serves(&p, 60, 80, &t(&["10.0.0.1", "10.0.0.2"])));
        assert!(!serves(&p, 30, 8080, &t(&["10.0.0.1", "10.0.0.2"])));
        assert!(!serves(&p, 30, 80, &t(&["10.0.0.1"])));
        assert_eq!(endpoint_name("10.0.0.1"), "n-10-0-0-1");
        assert_eq!(endpoint_name("2001:db8::1"), "n-2001-db8--1");
    }
}
