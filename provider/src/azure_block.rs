//! The provider's `azure` block: where the azure driver makes its resources
//! and how it gets its tokens. Every attribute falls back to the environment
//! (Azure's and the azurerm provider's variables, which is also where the
//! daemon takes them). The client secret is sensitive and never reaches the
//! store.

use crate::common::*;
use lbscale_cloud_azure::credentials::{Choice, ClientSecret};
use lbscale_cloud_azure::AzureSettings;
use lbscale_cloud_http::Url;
use serde::{Deserialize, Serialize};
use tf_provider::schema::{AttributeType, NestedBlock};
use tf_provider::value::Value;
use tf_provider::{AttributePath, Diagnostics};

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct AzureBlock {
    #[serde(default)]
    pub subscription_id: Value<String>,
    #[serde(default)]
    pub resource_group: Value<String>,
    #[serde(default)]
    pub location: Value<String>,
    #[serde(default)]
    pub tenant_id: Value<String>,
    #[serde(default)]
    pub client_id: Value<String>,
    #[serde(default)]
    pub client_secret: Value<String>,
    #[serde(default)]
    pub federated_token_file: Value<String>,
    #[serde(default)]
    pub use_managed_identity: Value<bool>,
    #[serde(default)]
    pub endpoint: Value<String>,
    #[serde(default)]
    pub authority_host: Value<String>,
    #[serde(default)]
    pub metadata_endpoint: Value<String>,
    #[serde(default)]
    pub ca_bundle: Value<String>,
}

pub fn schema() -> NestedBlock {
    NestedBlock::Optional(block(
        "Settings of the azure cloud: nodes are virtual machines, a `dns` distributor is a Traffic Manager profile (with a CNAME in Azure DNS), an `nlb` distributor a Standard Load Balancer with a frontend per zone. Each attribute falls back to the environment, which is also where `lbscale daemon` takes it.",
        vec![
            ("subscription_id", optional(AttributeType::String, "The subscription. Default: the environment's `ARM_SUBSCRIPTION_ID`, else `AZURE_SUBSCRIPTION_ID`.")),
            ("resource_group", optional(AttributeType::String, "The resource group (it must exist) where lbscale makes its VMs, network interfaces, Traffic Manager profiles and load balancers. Default: the environment's `LBSCALE_AZURE_RESOURCE_GROUP`.")),
            ("location", optional(AttributeType::String, "The region of the VMs and load balancers (`westeurope`); a group's `availability_zones` are its zones `1`, `2`, `3`. Default: the environment's `LBSCALE_AZURE_LOCATION`.")),
            ("tenant_id", optional(AttributeType::String, "The Microsoft Entra tenant of the service principal or workload identity. Default: `ARM_TENANT_ID`, else `AZURE_TENANT_ID`.")),
            ("client_id", optional(AttributeType::String, "The service principal's (or user-assigned managed identity's) client id. Default: `ARM_CLIENT_ID`, else `AZURE_CLIENT_ID`.")),
            (
                "client_secret",
                sensitive(optional(
                    AttributeType::String,
                    "The service principal's client secret (with `tenant_id` and `client_id`). Default: the credential chain: `ARM_CLIENT_SECRET` or `AZURE_CLIENT_SECRET`, then workload identity, then managed identity. Sensitive: never stored nor logged.",
                )),
            ),
            ("federated_token_file", optional(AttributeType::String, "Workload identity: a file holding a federated token (OIDC) exchanged for the client's token; read anew at each exchange. Default: `AZURE_FEDERATED_TOKEN_FILE`, else `ARM_OIDC_TOKEN_FILE_PATH`.")),
            ("use_managed_identity", optional(AttributeType::Bool, "Use the machine's managed identity (the instance metadata endpoint) even when a secret is in the environment. Default: `ARM_USE_MSI`; the chain falls back to it anyway.")),
            ("endpoint", optional(AttributeType::String, "Azure Resource Manager's URL, `https://HOST[:PORT]` (another Azure cloud, tests). Default: `LBSCALE_AZURE_ENDPOINT`, else `https://management.azure.com`.")),
            ("authority_host", optional(AttributeType::String, "The Microsoft Entra login endpoint. Default: `AZURE_AUTHORITY_HOST`, else `https://login.microsoftonline.com`.")),
            ("metadata_endpoint", optional(AttributeType::String, "The instance metadata endpoint of managed identity. Default: `AZURE_POD_IDENTITY_AUTHORITY_HOST`, else `http://169.254.169.254`.")),
            ("ca_bundle", optional(AttributeType::String, "PEM file of the certificate authorities to trust for Azure's endpoints instead of the system's. Default: `LBSCALE_AZURE_CA_BUNDLE`.")),
        ],
        vec![],
    ))
}

/// The `azure` block over the environment; a bad value is a diagnostic on
/// its attribute (the secret is never repeated).
pub fn settings(block: &Value<Vec<AzureBlock>>, diags: &mut Diagnostics) -> Option<AzureSettings> {
    let env = AzureSettings::from_env();
    let Some(az) = known(block).and_then(|v| v.first()) else {
        return Some(env);
    };
    let at = |a: &'static str| AttributePath::new("azure").index(0).attribute(a);
    let tenant_id = known(&az.tenant_id).cloned();
    let client_id = known(&az.client_id).cloned();
    let client_secret = match known(&az.client_secret) {
        None => None,
        Some(secret) => match (&tenant_id, &client_id) {
            (Some(t), Some(c)) => Some(ClientSecret {
                tenant_id: t.clone(),
                client_id: c.clone(),
                secret: secret.clone(),
            }),
            _ => {
                let missing = if tenant_id.is_none() {
                    "tenant_id"
                } else {
                    "client_id"
                };
                error(
                    diags,
                    at(missing),
                    format!("Missing {missing}"),
                    format!("client_secret needs tenant_id and client_id in the azure block; {missing} is not set."),
                );
                return None;
            }
        },
    };
    for (name, v) in [
        ("endpoint", &az.endpoint),
        ("authority_host", &az.authority_host),
        ("metadata_endpoint", &az.metadata_endpoint),
    ] {
        if let Some(u) = known(v) {
            if let Err(why) = Url::parse(u) {
                error(diags, at(name), format!("Invalid {name}"), why);
                return None;
            }
        }
    }
    let over = AzureSettings {
        subscription_id: known(&az.subscription_id).cloned(),
        resource_group: known(&az.resource_group).cloned(),
        location: known(&az.location).cloned(),
        endpoint: known(&az.endpoint).cloned(),
        ca_bundle: known(&az.ca_bundle).map(Into::into),
        credentials: Choice {
            client_secret,
            tenant_id,
            client_id,
            federated_token_file: known(&az.federated_token_file).cloned(),
            use_managed_identity: known(&az.use_managed_identity).copied().unwrap_or(false),
            authority_host: known(&az.authority_host).cloned(),
            metadata_endpoint: known(&az.metadata_endpoint).cloned(),
        },
        ..AzureSettings::default()
    };
    Some(env.overridden_by(over))
}
