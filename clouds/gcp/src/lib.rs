//! The `gcp` cloud: nodes are Compute Engine instances, a `dns` distributor
//! is an `A` record set in a Cloud DNS managed zone, an `nlb` distributor is
//! an external passthrough network load balancer (target pools).
//!
//! - [`credentials`] finds the OAuth 2 tokens as Google's libraries do,
//!   [`api`] sends the calls (TLS, deadlines, retries, Google's error
//!   envelope, operations waited on), over [`http`].
//! - A node ([`nodes`]) is an instance named after its node id in its zone,
//!   from the group's `node.image` and `node.size` (a machine type), in the
//!   zone's subnetwork of `node.subnets`, labelled with the group and the
//!   node; its metadata's `startup-script` starts `lbscale-node serve` on the
//!   node API port. The name is the node's: a provisioning step run again
//!   after a crash finds the instance it started.
//! - A `dns` distributor ([`dns`]) writes its domain's `A` record in the
//!   project's public managed zone that holds the domain, through
//!   `changes.create`, next to a `TXT` record that marks it as lbscale's.
//! - An `nlb` distributor ([`nlb`]) has a static address (its VIP) in each
//!   zone's region and, per zone and port, a forwarding rule to a target pool
//!   of the nodes placed on that port.
//!
//! Settings come from the provider's `gcp` block, else from Google's usual
//! environment variables, which is where the daemon takes them.

pub mod api;
pub mod credentials;
mod dns;
#[cfg(feature = "testing")]
pub mod fake_testing;
mod firewall;
mod nlb;
mod nodes;

pub use nodes::{instance_name, label_value, NODE_API_PORT};

use api::GcpApi;
use credentials::{Env, Tokens};
use lbscale_engine::cloud::DriverStore;
use std::path::PathBuf;
use std::sync::Arc;

/// The machine type when the group's `node.size` is not given.
pub const DEFAULT_MACHINE_TYPE: &str = "e2-standard-2";

/// The `gcp` cloud's settings.
#[derive(Debug, Clone, Default)]
pub struct GcpSettings {
    pub project: Option<String>,
    /// When set, every zone a group names must be in it.
    pub region: Option<String>,
    /// One `https://HOST[:PORT]` for Compute Engine and Cloud DNS (tests,
    /// private endpoints); Google's public endpoints otherwise.
    pub endpoint: Option<String>,
    /// A service-account key (its JSON, or the path of its file), used
    /// instead of the chain. Sensitive.
    pub credentials: Option<String>,
    /// The environment the credential chain reads ([`credentials::Env`]).
    pub env: Env,
    /// PEM file of the certificate authorities to trust instead of the system's.
    pub ca_bundle: Option<PathBuf>,
}

impl GcpSettings {
    /// From Google's usual environment variables: the project from
    /// `GOOGLE_CLOUD_PROJECT` (or `CLOUDSDK_CORE_PROJECT`), the region from
    /// `CLOUDSDK_COMPUTE_REGION`, those of the credential chain, and
    /// lbscale's `LBSCALE_GCP_ENDPOINT` and `LBSCALE_GCP_CA_BUNDLE`.
    pub fn from_env() -> GcpSettings {
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        GcpSettings {
            project: var("GOOGLE_CLOUD_PROJECT").or_else(|| var("CLOUDSDK_CORE_PROJECT")),
            region: var("CLOUDSDK_COMPUTE_REGION"),
            endpoint: var("LBSCALE_GCP_ENDPOINT"),
            credentials: None,
            env: credentials::env_from_process(),
            ca_bundle: var("LBSCALE_GCP_CA_BUNDLE").map(PathBuf::from),
        }
    }

    /// `over`'s values where it has them, else these.
    pub fn overridden_by(self, over: GcpSettings) -> GcpSettings {
        GcpSettings {
            project: over.project.or(self.project),
            region: over.region.or(self.region),
            endpoint: over.endpoint.or(self.endpoint),
            credentials: over.credentials.or(self.credentials),
            env: if over.env.is_empty() {
                self.env
            } else {
                over.env
            },
            ca_bundle: over.ca_bundle.or(self.ca_bundle),
        }
    }
}

/// The Compute Engine and Cloud DNS driver.
pub struct GcpCloud {
    api: GcpApi,
    region: Option<String>,
    store: DriverStore,
}

/// The gcp cloud's drivers with `settings`, to register (see
/// [`lbscale_engine::cloud::Clouds`]); settings that lack a project or
/// credentials make a cloud that says so when used.
pub fn drivers(
    settings: GcpSettings,
) -> impl FnOnce(DriverStore) -> std::result::Result<lbscale_engine::cloud::Drivers, String>
       + Send
       + 'static {
    move |store| GcpCloud::new(settings, store).map(lbscale_engine::cloud::Drivers::of)
}

impl GcpCloud {
    /// A driver from `settings`; an error names what is missing or wrong.
    /// Tokens are fetched at the first call.
    pub fn new(settings: GcpSettings, store: DriverStore) -> std::result::Result<GcpCloud, String> {
        let source = credentials::resolve(settings.credentials.as_deref(), &settings.env)?;
        let key_project = match &source {
            credentials::Source::Key { key, .. } => key.project_id.clone(),
            credentials::Source::Metadata { .. } => None,
        };
        let project = settings
            .project
            .clone()
            .or_else(|| settings.env.get("GOOGLE_CLOUD_PROJECT").cloned())
            .or_else(|| settings.env.get("CLOUDSDK_CORE_PROJECT").cloned())
            .or(key_project)
            .ok_or("no GCP project: set `project` in the provider's gcp block, or GOOGLE_CLOUD_PROJECT (or use a service-account key, whose project_id is taken)")?;
        if let Some(e) = &settings.endpoint {
            lbscale_cloud_http::Url::parse(e).map_err(|e| format!("the gcp endpoint: {e}"))?;
        }
        let tls = lbscale_cloud_http::client_tls(settings.ca_bundle.as_deref(), "GCP")?;
        let tokens = Arc::new(Tokens::new(source, tls.clone()));
        Ok(GcpCloud {
            api: GcpApi::new(project, settings.endpoint.as_deref(), tokens, tls),
            region: settings.region,
            store,
        })
    }

    /// Where the driver's credentials come from (no secret).
    pub fn credential_source(&self) -> String {
        self.api.tokens().source().describe()
    }

    /// How many access tokens the driver fetched so far.
    pub fn tokens_fetched(&self) -> u64 {
        self.api.tokens().fetched()
    }

    pub fn project(&self) -> &str {
        self.api.project()
    }
}

/// The region of a zone (`europe-west1-b` -> `europe-west1`).
pub fn region_of(zone: &str) -> &str {
    zone.rsplit_once('-').map(|(r, _)| r).unwrap_or(zone)
}

/// SHA-256 of `data`, hex.
fn sha256_hex(data: &[u8]) -> String {
    ring::digest::digest(&ring::digest::SHA256, data)
        .as_ref()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// A random UUID (v4), for a call's `requestId`: a retried insert is
/// recognised by Compute Engine instead of made twice.
fn request_id() -> String {
    use ring::rand::SecureRandom;
    let mut b = [0u8; 16];
    ring::rand::SystemRandom::new()
        .fill(&mut b)
        .expect("the system's random numbers");
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    let h: String = b.iter().map(|x| format!("{x:02x}")).collect();
    format!(
        "{}-{}-{}-{}-{}",
        &h[..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..]
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zones_have_regions_and_request_ids_are_uuids() {
        assert_eq!(region_of("europe-west1-b"), "europe-west1");
        assert_eq!(region_of("us-central1-a"), "us-central1");
        let id = request_id();
        assert_eq!(id.len(), 36);
        assert_eq!(&id[14..15], "4");
        assert_ne!(id, request_id());
    }
}
