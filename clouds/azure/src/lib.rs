//! The `azure` cloud: nodes are virtual machines, a `dns` distributor is an
//! Azure Traffic Manager profile (with a CNAME in Azure DNS), an `nlb`
//! distributor is a Standard Load Balancer.
//!
//! - [`arm`] calls Azure Resource Manager (tokens, deadlines, retries,
//!   long-running operations) over [`http`]; [`credentials`] finds the
//!   tokens as Azure's SDKs do.
//! - [`vm`]: a node is a VM with its network interface in the subnet that
//!   the group's `node.subnets` gives for its zone and a public IP of its own
//!   (not behind an `nlb`), tagged with the group and node ids, started from
//!   `node.image` with custom data that starts `lbscale-node`; deleted with
//!   its interface, disk and public IP.
//! - [`security_group`]: the group's own network security group when its
//!   `node` block gives none.
//! - [`traffic_manager`]: the `dns` distributor.
//! - [`load_balancer`]: the `nlb` distributor, public (a zonal public IP
//!   frontend per zone), as the aws `nlb` is internet-facing.
//!
//! Everything lbscale makes is in the resource group of the settings, in
//! their location (Traffic Manager profiles are global).

pub mod arm;
pub mod credentials;
#[cfg(feature = "testing")]
pub mod fake_testing;
mod load_balancer;
mod public_ip;
mod security_group;
mod traffic_manager;
mod vm;

use arm::Arm;
use credentials::{Choice, Credentials, EnvVars};
use lbscale_cloud_http as http;
use lbscale_engine::cloud::{
    Cloud, Distributor, DriverStore, GroupResources, ProvisionRequest, Provisioned, Publication,
    Result,
};
use lbscale_engine::model::{DistributorMode, DistributorSpec, NodeSpec};
use lbscale_engine::store::NodeRow;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

pub use vm::NODE_API_PORT;

/// Azure's public cloud.
pub const DEFAULT_ENDPOINT: &str = "https://management.azure.com";

/// The `azure` cloud's settings.
#[derive(Debug, Clone, Default)]
pub struct AzureSettings {
    pub subscription_id: Option<String>,
    /// Where lbscale makes its resources.
    pub resource_group: Option<String>,
    /// The region of the VMs and load balancers (`westeurope`).
    pub location: Option<String>,
    /// ARM's URL (another cloud, a test server). Default: Azure's public cloud.
    pub endpoint: Option<String>,
    /// PEM file of the certificate authorities to trust instead of the system's.
    pub ca_bundle: Option<PathBuf>,
    /// What the provider block says about credentials.
    pub credentials: Choice,
    /// The environment the credential chain reads.
    pub env: EnvVars,
    /// Nodes' image and size when the group's `node` block gives none.
    pub image: Option<String>,
    pub size: Option<String>,
}

/// Every variable [`AzureSettings::from_env`] reads (`lbscale daemon --help`
/// lists them; cli/tests/daemon_reference.rs checks that it does).
pub const ENV_VARIABLES: &[&str] = &[
    "ARM_SUBSCRIPTION_ID",
    "AZURE_SUBSCRIPTION_ID",
    "LBSCALE_AZURE_RESOURCE_GROUP",
    "LBSCALE_AZURE_LOCATION",
    "LBSCALE_AZURE_ENDPOINT",
    "LBSCALE_AZURE_CA_BUNDLE",
    "LBSCALE_AZURE_IMAGE",
    "LBSCALE_AZURE_VM_SIZE",
    "ARM_USE_MSI",
];

impl AzureSettings {
    /// From the environment: `ARM_SUBSCRIPTION_ID` (or `AZURE_SUBSCRIPTION_ID`),
    /// lbscale's `LBSCALE_AZURE_RESOURCE_GROUP`, `LBSCALE_AZURE_LOCATION`,
    /// `LBSCALE_AZURE_ENDPOINT`, `LBSCALE_AZURE_CA_BUNDLE`,
    /// `LBSCALE_AZURE_IMAGE`, `LBSCALE_AZURE_VM_SIZE`, and the credential
    /// chain's variables ([`credentials`]).
    pub fn from_env() -> AzureSettings {
        let var = |k: &str| {
            debug_assert!(ENV_VARIABLES.contains(&k), "{k} is not in ENV_VARIABLES");
            std::env::var(k).ok().filter(|v| !v.is_empty())
        };
        AzureSettings {
            subscription_id: var("ARM_SUBSCRIPTION_ID").or_else(|| var("AZURE_SUBSCRIPTION_ID")),
            resource_group: var("LBSCALE_AZURE_RESOURCE_GROUP"),
            location: var("LBSCALE_AZURE_LOCATION"),
            endpoint: var("LBSCALE_AZURE_ENDPOINT"),
            ca_bundle: var("LBSCALE_AZURE_CA_BUNDLE").map(PathBuf::from),
            credentials: Choice {
                use_managed_identity: var("ARM_USE_MSI").as_deref() == Some("true"),
                ..Choice::default()
            },
            env: EnvVars::from_process(),
            image: var("LBSCALE_AZURE_IMAGE"),
            size: var("LBSCALE_AZURE_VM_SIZE"),
        }
    }

    /// `over`'s values where it has them, else these.
    pub fn overridden_by(self, over: AzureSettings) -> AzureSettings {
        let c = over.credentials;
        let b = self.credentials;
        AzureSettings {
            subscription_id: over.subscription_id.or(self.subscription_id),
            resource_group: over.resource_group.or(self.resource_group),
            location: over.location.or(self.location),
            endpoint: over.endpoint.or(self.endpoint),
            ca_bundle: over.ca_bundle.or(self.ca_bundle),
            credentials: Choice {
                client_secret: c.client_secret.or(b.client_secret),
                tenant_id: c.tenant_id.or(b.tenant_id),
                client_id: c.client_id.or(b.client_id),
                federated_token_file: c.federated_token_file.or(b.federated_token_file),
                use_managed_identity: c.use_managed_identity || b.use_managed_identity,
                authority_host: c.authority_host.or(b.authority_host),
                metadata_endpoint: c.metadata_endpoint.or(b.metadata_endpoint),
            },
            env: if over.env.is_empty() {
                self.env
            } else {
                over.env
            },
            image: over.image.or(self.image),
            size: over.size.or(self.size),
        }
    }
}

/// The azure cloud's drivers with `settings`, to register (see
/// [`lbscale_engine::cloud::Clouds`]); settings that lack a subscription,
/// resource group or location make a cloud that says so when used.
pub fn drivers(
    settings: AzureSettings,
) -> impl FnOnce(DriverStore) -> std::result::Result<lbscale_engine::cloud::Drivers, String>
       + Send
       + 'static {
    move |store| AzureCloud::new(settings, store).map(lbscale_engine::cloud::Drivers::of)
}

/// The VM, Traffic Manager and load balancer driver.
pub struct AzureCloud {
    arm: Arm,
    resource_group: String,
    location: String,
    image: Option<String>,
    size: Option<String>,
    store: DriverStore,
}

/// What the store keeps of an azure distributor between calls.
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
#[serde(default)]
struct DistributorRuntime {
    /// `dns`: the Traffic Manager profile's DNS name.
    fqdn: Option<String>,
    /// `dns`: the record set lbscale made for the domain (its id), if any.
    record: Option<String>,
    /// `dns`: the domain that record is for.
    domain: Option<String>,
    /// `nlb`: each zone's frontend address.
    nlb_addresses: BTreeMap<String, String>,
}

impl AzureCloud {
    /// A driver from `settings`; an error names what is missing or wrong.
    /// Tokens are fetched at the first call.
    pub fn new(
        settings: AzureSettings,
        store: DriverStore,
    ) -> std::result::Result<AzureCloud, String> {
        let missing = |what: &str, var: &str| {
            format!("no Azure {what}: set `{what}` in the provider's azure block, or {var}")
        };
        let subscription = settings
            .subscription_id
            .clone()
            .ok_or_else(|| missing("subscription_id", "ARM_SUBSCRIPTION_ID"))?;
        let resource_group = settings
            .resource_group
            .clone()
            .ok_or_else(|| missing("resource_group", "LBSCALE_AZURE_RESOURCE_GROUP"))?;
        let location = settings
            .location
            .clone()
            .ok_or_else(|| missing("location", "LBSCALE_AZURE_LOCATION"))?;
        let base = http::Url::parse(settings.endpoint.as_deref().unwrap_or(DEFAULT_ENDPOINT))
            .map_err(|e| format!("the Azure endpoint: {e}"))?;
        let tls = http::client_tls(settings.ca_bundle.as_deref(), "Azure")?;
        let (source, authority) = credentials::choose(&settings.credentials, &settings.env)?;
        let creds = Arc::new(Credentials::new(source, authority, tls.clone()));
        Ok(AzureCloud {
            arm: Arm::new(
                http::Url {
                    path: "/".into(),
                    ..base
                },
                subscription,
                creds,
                tls,
            ),
            resource_group,
            location,
            image: settings.image,
            size: settings.size,
            store,
        })
    }

    /// Where the driver's tokens come from (no secret).
    pub fn credential_source(&self) -> String {
        self.arm.credentials().describe()
    }

    /// A token from the chain (to check the credentials work).
    pub async fn check_credentials(&self) -> Result<()> {
        self.arm
            .credentials()
            .token()
            .await
            .map(|_| ())
            .map_err(lbscale_engine::cloud::CloudError::Failed)
    }

    fn runtime(&self, id: &str) -> DistributorRuntime {
        self.store.load_runtime(id).unwrap_or_default()
    }

    fn runtime_checked(&self, id: &str) -> Result<DistributorRuntime> {
        self.store.load_runtime(id)
    }

    fn save_runtime(&self, id: &str, rt: &DistributorRuntime) -> Result<()> {
        self.store.save_runtime(id, rt)
    }

    /// `lbscale-` and `id`, cut to `max` characters of what Azure names allow.
    fn name_of(id: &str, max: usize) -> String {
        let clean: String = format!("lbscale-{id}")
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '-' {
                    c
                } else {
                    '-'
                }
            })
            .collect();
        clean
            .chars()
            .take(max)
            .collect::<String>()
            .trim_end_matches('-')
            .to_string()
    }
}

#[async_trait::async_trait]
impl Cloud for AzureCloud {
    async fn provision(&self, req: &ProvisionRequest) -> Result<Provisioned> {
        self.provision_vm(req).await
    }

    async fn deprovision(&self, node: &NodeRow) -> Result<()> {
        self.deprovision_vm(node).await
    }

    async fn is_alive(&self, node: &NodeRow) -> Result<bool> {
        Ok(self.alive(std::slice::from_ref(node)).await?[0])
    }

    async fn alive(&self, nodes: &[NodeRow]) -> Result<Vec<bool>> {
        self.vms_alive(nodes).await
    }

    fn api_port(&self, _node: &NodeRow) -> u16 {
        NODE_API_PORT
    }

    fn node_unusable(&self, node: &NodeSpec) -> Option<String> {
        self.vm_unusable(node)
    }

    async fn prepare_group(&self, group: &GroupResources) -> Result<()> {
        self.prepare_security_group(group).await
    }

    async fn release_group(&self, group_id: &str) -> Result<()> {
        self.release_security_group(group_id).await
    }
}

#[async_trait::async_trait]
impl Distributor for AzureCloud {
    async fn ensure(&self, id: &str, spec: &DistributorSpec) -> Result<()> {
        match spec.mode {
            // Made at the first publication with a port: it needs the zones
            // and subnets of the groups.
            DistributorMode::Nlb => Ok(()),
            DistributorMode::Dns => self.ensure_profile(id, spec).await,
        }
    }

    async fn publish(
        &self,
        id: &str,
        spec: &DistributorSpec,
        publication: &Publication,
    ) -> Result<()> {
        match spec.mode {
            DistributorMode::Nlb => self.publish_nlb(id, publication).await,
            DistributorMode::Dns => self.publish_profile(id, spec, publication).await,
        }
    }

    async fn remove(&self, id: &str) -> Result<()> {
        let Some(spec) = self.store.distributor(id)? else {
            return Ok(());
        };
        match spec.mode {
            DistributorMode::Nlb => self.remove_nlb(id).await,
            DistributorMode::Dns => self.remove_profile(id, &spec).await,
        }
    }

    fn addresses(&self, id: &str, spec: &DistributorSpec) -> BTreeMap<String, String> {
        let rt = self.runtime(id);
        match spec.mode {
            DistributorMode::Nlb => rt.nlb_addresses,
            DistributorMode::Dns => rt
                .fqdn
                .map(|f| ("dns".to_string(), f))
                .into_iter()
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_keep_to_what_azure_allows() {
        assert_eq!(AzureCloud::name_of("d_1.x", 80), "lbscale-d-1-x");
        assert_eq!(AzureCloud::name_of("abcdef", 10), "lbscale-ab");
        assert_eq!(AzureCloud::name_of("a-", 9), "lbscale-a");
    }

    #[test]
    fn settings_name_what_is_missing() {
        let dir =
            std::env::temp_dir().join(format!("lbscale-azure-settings-{}", std::process::id()));
        let store = Arc::new(lbscale_engine::store::Store::open(&dir.join("s.db")).unwrap());
        let e = AzureCloud::new(AzureSettings::default(), DriverStore::new(store.clone()))
            .err()
            .unwrap();
        assert!(
            e.contains("subscription_id") && e.contains("ARM_SUBSCRIPTION_ID"),
            "{e}"
        );
        let e = AzureCloud::new(
            AzureSettings {
                subscription_id: Some("s".into()),
                resource_group: Some("g".into()),
                ..AzureSettings::default()
            },
            DriverStore::new(store),
        )
        .err()
        .unwrap();
        assert!(
            e.contains("location") && e.contains("LBSCALE_AZURE_LOCATION"),
            "{e}"
        );
    }
}
