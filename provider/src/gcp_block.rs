//! The provider's `gcp` block: where and how the gcp driver calls Google
//! Cloud. Every attribute falls back to Google's usual environment variables
//! (which is where the daemon takes them). Credentials are sensitive and
//! never reach the store.

use crate::common::*;
use lbscale_cloud_gcp::GcpSettings;
use lbscale_cloud_http::Url;
use serde::{Deserialize, Serialize};
use tf_provider::schema::{AttributeType, NestedBlock};
use tf_provider::value::Value;
use tf_provider::{AttributePath, Diagnostics};

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct GcpBlock {
    #[serde(default)]
    pub project: Value<String>,
    #[serde(default)]
    pub region: Value<String>,
    #[serde(default)]
    pub endpoint: Value<String>,
    #[serde(default)]
    pub credentials: Value<String>,
    #[serde(default)]
    pub ca_bundle: Value<String>,
}

pub fn schema() -> NestedBlock {
    NestedBlock::Optional(block(
        "Settings of the gcp cloud: nodes are Compute Engine instances, a `dns` distributor is a Cloud DNS record set, an `nlb` distributor a network load balancer with a VIP per zone. Each attribute falls back to Google's usual environment variable, which is also where `lbscale daemon` takes it.",
        vec![
            ("project", optional(AttributeType::String, "The project of the nodes, load balancers and managed zones. Default: the environment's `GOOGLE_CLOUD_PROJECT`, else `CLOUDSDK_CORE_PROJECT`, else the service-account key's `project_id`.")),
            ("region", optional(AttributeType::String, "When set, every zone of a group must be in this region (a check; each zone's resources go in the zone's own region). Default: the environment's `CLOUDSDK_COMPUTE_REGION`, else no check.")),
            ("endpoint", optional(AttributeType::String, "One endpoint for Compute Engine and Cloud DNS, `https://HOST[:PORT]` (private endpoints, tests); the APIs are under `/compute/v1/` and `/dns/v1/`. Default: the environment's `LBSCALE_GCP_ENDPOINT`, else Google's public endpoints.")),
            (
                "credentials",
                sensitive(optional(
                    AttributeType::String,
                    "A service-account key: its JSON, or the path of its file. Default: Google's Application Default Credentials (the file of `GOOGLE_APPLICATION_CREDENTIALS`, gcloud's application-default file when it holds a service-account key, the instance's metadata server). Sensitive: never stored nor logged.",
                )),
            ),
            ("ca_bundle", optional(AttributeType::String, "PEM file of the certificate authorities to trust for Google's APIs and token endpoint instead of the system's. Default: the environment's `LBSCALE_GCP_CA_BUNDLE`.")),
        ],
        vec![],
    ))
}

/// The `gcp` block over the environment; a bad value is a diagnostic on its
/// attribute (a credential is never repeated).
pub fn settings(block: &Value<Vec<GcpBlock>>, diags: &mut Diagnostics) -> Option<GcpSettings> {
    let env = GcpSettings::from_env();
    let Some(gcp) = known(block).and_then(|v| v.first()) else {
        return Some(env);
    };
    let at = |a: &'static str| AttributePath::new("gcp").index(0).attribute(a);
    let over = GcpSettings {
        project: known(&gcp.project).cloned(),
        region: known(&gcp.region).cloned(),
        endpoint: known(&gcp.endpoint).cloned(),
        credentials: known(&gcp.credentials).cloned(),
        env: Default::default(),
        ca_bundle: known(&gcp.ca_bundle).map(Into::into),
    };
    if let Some(e) = &over.endpoint {
        if let Err(why) = Url::parse(e) {
            error(diags, at("endpoint"), "Invalid endpoint", why);
            return None;
        }
    }
    if let Some(c) = &over.credentials {
        // Checked here so that a bad key is said on its attribute.
        if let Err(why) = lbscale_cloud_gcp::credentials::resolve(Some(c), &Default::default()) {
            error(diags, at("credentials"), "Invalid credentials", why);
            return None;
        }
    }
    Some(env.overridden_by(over))
}
