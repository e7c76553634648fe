//! The `lbscale` provider: where the store is, and how each cloud is reached.

use crate::common::*;
use crate::data_sources::{
    distributor::DistributorDataSource, group::GroupDataSource, simulation::SimulationDataSource,
};
use crate::resources::{
    distributor::Distributor, group::Group, managed::Managed, se_group::SeGroup, vserver::Vserver,
};
use async_trait::async_trait;
use lbscale_cloud_aws::credentials::AssumeRole;
use lbscale_cloud_aws::{api::Endpoint, parse_credentials, AwsSettings};
use lbscale_cloud_local::{check_address_prefix, LocalSettings};
use lbscale_engine::cloud::Clouds;
use lbscale_engine::store::{state_url_from_env, STATE_URL_ENV};
use lbscale_engine::Engine;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::sync::Arc;
use tf_provider::schema::{AttributeType, NestedBlock, Schema};
use tf_provider::value::Value;
use tf_provider::{AttributePath, Diagnostics, DynamicDataSource, DynamicResource, Provider};

pub const DEFAULT_STATE: &str = "sqlite://.lbscale/state.db";

#[derive(Default)]
pub struct LbscaleProvider {
    engine: EngineHandle,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct LocalBlock {
    #[serde(default)]
    pub address_prefix: Value<String>,
    #[serde(default)]
    pub dns_port: Value<Number>,
    #[serde(default)]
    pub node_api_port: Value<Number>,
    #[serde(default)]
    pub node_binary: Value<String>,
}

/// The `aws` block: where and how the aws driver calls AWS, and what nodes it
/// starts. Every attribute falls back to AWS's usual environment variables
/// (which is where the daemon takes them). Credentials are sensitive and never
/// reach the store.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct AwsBlock {
    #[serde(default)]
    pub region: Value<String>,
    #[serde(default)]
    pub endpoint: Value<String>,
    #[serde(default)]
    pub credentials: Value<String>,
    #[serde(default)]
    pub profile: Value<String>,
    #[serde(default)]
    pub assume_role: Value<Vec<AssumeRoleBlock>>,
    #[serde(default)]
    pub image_id: Value<String>,
    #[serde(default)]
    pub instance_type: Value<String>,
    #[serde(default)]
    pub ca_bundle: Value<String>,
}

/// The `aws` block's `assume_role`: a role assumed over the credentials found.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct AssumeRoleBlock {
    #[serde(default)]
    pub role_arn: Value<String>,
    #[serde(default)]
    pub external_id: Value<String>,
    #[serde(default)]
    pub session_name: Value<String>,
    #[serde(default)]
    pub duration: Value<String>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ProviderConfig {
    #[serde(default)]
    pub state: Value<String>,
    #[serde(default)]
    pub local: Value<Vec<LocalBlock>>,
    #[serde(default)]
    pub aws: Value<Vec<AwsBlock>>,
    #[serde(default)]
    pub azure: Value<Vec<crate::azure_block::AzureBlock>>,
    #[serde(default)]
    pub gcp: Value<Vec<crate::gcp_block::GcpBlock>>,
}

fn aws_block() -> NestedBlock {
    NestedBlock::Optional(block(
        "Settings of the aws cloud: nodes are EC2 instances, a `dns` distributor is a Route 53 record set. Each attribute falls back to AWS's usual environment variable, which is also where `lbscale daemon` takes it.",
        vec![
            ("region", optional(AttributeType::String, "Region of the nodes and load balancers. Default: the environment's `AWS_REGION`, else `AWS_DEFAULT_REGION`.")),
            ("endpoint", optional(AttributeType::String, "One endpoint for every AWS API, `https://HOST[:PORT]` (an API-compatible server, a private endpoint, tests). Default: the environment's `AWS_ENDPOINT_URL`, else AWS's public endpoints.")),
            (
                "credentials",
                sensitive(optional(
                    AttributeType::String,
                    "`ACCESS_KEY_ID:SECRET_ACCESS_KEY` or `ACCESS_KEY_ID:SECRET_ACCESS_KEY:SESSION_TOKEN`, used instead of the credential chain. Default: the chain of AWS's SDKs (the environment's `AWS_ACCESS_KEY_ID`, the profile of `AWS_PROFILE` in the shared config files, web identity, container credentials, the EC2 instance's role). Sensitive: never stored nor logged.",
                )),
            ),
            ("profile", optional(AttributeType::String, "A profile of the shared config and credentials files (`~/.aws/config`, `~/.aws/credentials`, or `AWS_CONFIG_FILE`, `AWS_SHARED_CREDENTIALS_FILE`), used instead of the credential chain: its keys, or its `role_arn` assumed over its `source_profile` or `credential_source`. Default: the chain, where `AWS_PROFILE` names the profile.")),
            ("image_id", optional(AttributeType::String, "The AMI of node instances: an image with `lbscale-node` on its PATH that runs its user data at boot (cloud-init). Default: the environment's `LBSCALE_AWS_IMAGE_ID`.")),
            ("instance_type", optional(AttributeType::String, "The instance type of nodes. Default: the environment's `LBSCALE_AWS_INSTANCE_TYPE`, else `c5.large`.")),
            ("ca_bundle", optional(AttributeType::String, "PEM file of the certificate authorities to trust for the AWS APIs instead of the system's. Default: the environment's `AWS_CA_BUNDLE`.")),
        ],
        vec![(
            "assume_role",
            NestedBlock::Optional(block(
                "A role that lbscale assumes (STS `AssumeRole`) with the credentials it found, and calls AWS as. Its credentials are renewed before they expire. Default: the environment's `LBSCALE_AWS_ROLE_ARN` (with `LBSCALE_AWS_EXTERNAL_ID`, `LBSCALE_AWS_ROLE_SESSION_NAME`), else none.",
                vec![
                    ("role_arn", required(AttributeType::String, "The role's ARN, `arn:aws:iam::ACCOUNT:role/NAME`.")),
                    ("external_id", optional(AttributeType::String, "The external ID that the role's trust policy asks for.")),
                    ("session_name", optional(AttributeType::String, "The session's name, seen in CloudTrail: 2 to 64 letters, digits or `+=,.@-_`. Default: `lbscale-<unix time>`.")),
                    ("duration", optional(AttributeType::String, "How long each set of the role's credentials lasts, `15m` to `12h` (and at most the role's maximum session duration). Default: STS's, one hour.")),
                ],
                vec![],
            )),
        )],
    ))
}

/// The `assume_role` block; a bad value is a diagnostic on its attribute.
fn assume_role(block: &AssumeRoleBlock, diags: &mut Diagnostics) -> Option<Option<AssumeRole>> {
    let at = |a: &'static str| {
        AttributePath::new("aws")
            .index(0)
            .attribute("assume_role")
            .index(0)
            .attribute(a)
    };
    let Some(arn) = known(&block.role_arn) else {
        // Unknown until apply: checked then.
        return Some(None);
    };
    let mut role = AssumeRole {
        external_id: known(&block.external_id).cloned(),
        session_name: known(&block.session_name).cloned(),
        ..AssumeRole::new(arn)
    };
    if let Some(d) = known(&block.duration) {
        match lbscale_core::duration::parse_duration(d) {
            Ok(d) => role.duration = Some(d),
            Err(e) => {
                error(
                    diags,
                    at("duration"),
                    "Invalid duration",
                    format!("duration {e}"),
                );
                return None;
            }
        }
    }
    if let Err((field, why)) = role.check() {
        error(diags, at(field), format!("Invalid {field}"), why);
        return None;
    }
    Some(Some(role))
}

/// The `aws` block over the environment; a bad value is a diagnostic on its
/// attribute (a bad credential is not repeated).
fn aws_settings(config: &ProviderConfig, diags: &mut Diagnostics) -> Option<AwsSettings> {
    let env = AwsSettings::from_env();
    let Some(aws) = known(&config.aws).and_then(|v| v.first()) else {
        return Some(env);
    };
    let at = |a: &'static str| AttributePath::new("aws").index(0).attribute(a);
    let mut over = AwsSettings {
        region: known(&aws.region).cloned(),
        endpoint: known(&aws.endpoint).cloned(),
        credentials: None,
        profile: known(&aws.profile).cloned(),
        assume_role: None,
        env: Default::default(),
        image_id: known(&aws.image_id).cloned(),
        instance_type: known(&aws.instance_type).cloned(),
        ca_bundle: known(&aws.ca_bundle).map(Into::into),
    };
    if let Some(block) = known(&aws.assume_role).and_then(|v| v.first()) {
        over.assume_role = assume_role(block, diags)?;
    }
    if let Some(e) = &over.endpoint {
        if let Err(why) = Endpoint::parse(e) {
            error(diags, at("endpoint"), "Invalid endpoint", why);
            return None;
        }
    }
    if let Some(c) = known(&aws.credentials) {
        match parse_credentials(c) {
            Ok(c) => over.credentials = Some(c),
            Err(why) => {
                error(diags, at("credentials"), "Invalid credentials", why);
                return None;
            }
        }
    }
    Some(env.overridden_by(over))
}

fn local_settings(config: &ProviderConfig, diags: &mut Diagnostics) -> Option<LocalSettings> {
    let mut s = LocalSettings::default();
    let Some(local) = known(&config.local).and_then(|v| v.first()) else {
        return Some(s);
    };
    let at = |a: &'static str| AttributePath::new("local").index(0).attribute(a);
    if let Some(p) = known(&local.address_prefix) {
        if let Err(e) = check_address_prefix(p) {
            error(diags, at("address_prefix"), "Invalid address_prefix", e);
            return None;
        }
        s.address_prefix = p.clone();
    }
    for (name, value, slot) in [
        ("dns_port", &local.dns_port, &mut s.dns_port),
        ("node_api_port", &local.node_api_port, &mut s.node_api_port),
    ] {
        if let Some(v) = known(value) {
            let Some(port) = v.whole().filter(|p| (1..=65535).contains(p)) else {
                let allowed = if v.whole().is_some() {
                    "between 1 and 65535"
                } else {
                    "a whole number"
                };
                error(
                    diags,
                    at(name),
                    format!("Invalid {name}"),
                    format!("{name} must be {allowed}, got {v}."),
                );
                return None;
            };
            *slot = port as u16;
        }
    }
    s.node_binary = known(&local.node_binary).map(Into::into);
    Some(s)
}

#[async_trait]
impl Provider for LbscaleProvider {
    type Config<'a> = ProviderConfig;
    type MetaState<'a> = Value<tf_provider::value::StructEmpty>;

    fn schema(&self, _diags: &mut Diagnostics) -> Option<Schema> {
        Some(Schema {
            version: 1,
            block: block(
                "lbscale: threshold-driven autoscaling of load-balancer fleets.",
                vec![(
                    "state",
                    sensitive(optional(
                        AttributeType::String,
                        "The store shared with the daemon: `sqlite://PATH` (relative to Terraform's working directory) or `postgres://USER[:PASSWORD]@HOST[:PORT]/DATABASE` (several daemons on several machines). Default: the environment's `LBSCALE_STATE`, else `sqlite://.lbscale/state.db`.",
                    )),
                )],
                vec![
                    (
                        "local",
                        NestedBlock::Optional(block(
                            "Settings of the local cloud (nodes are processes on this machine).",
                            vec![
                                ("address_prefix", optional(AttributeType::String, "Loopback prefix that node and distributor addresses are taken from. Default `127.0.`.")),
                                ("dns_port", optional(AttributeType::Number, "Port of the dns distributors' DNS servers. Default 10053.")),
                                ("node_api_port", optional(AttributeType::Number, "Port of each node's management API (on the node's own address). Default 9990.")),
                                ("node_binary", optional(AttributeType::String, "Path of `lbscale-node`. Default: next to the provider, then PATH.")),
                            ],
                            vec![],
                        )),
                    ),
                    ("aws", aws_block()),
                    ("azure", crate::azure_block::schema()),
                    ("gcp", crate::gcp_block::schema()),
                ],
            ),
        })
    }

    async fn validate<'a>(&self, diags: &mut Diagnostics, config: Self::Config<'a>) -> Option<()> {
        local_settings(&config, diags)?;
        aws_settings(&config, diags)?;
        crate::azure_block::settings(&config.azure, diags)?;
        crate::gcp_block::settings(&config.gcp, diags)?;
        Some(())
    }

    async fn configure<'a>(
        &self,
        diags: &mut Diagnostics,
        _tf: String,
        config: Self::Config<'a>,
    ) -> Option<()> {
        let local = local_settings(&config, diags)?;
        let aws = aws_settings(&config, diags)?;
        let azure = crate::azure_block::settings(&config.azure, diags)?;
        let gcp = crate::gcp_block::settings(&config.gcp, diags)?;
        if config.state.is_unknown() {
            error(
                diags,
                AttributePath::new("state"),
                "Unknown state",
                "state must be known at plan time.",
            );
            return None;
        }
        let (url, from) = match (known(&config.state), state_url_from_env()) {
            (Some(url), _) => (url.clone(), "the `state` argument".to_string()),
            (None, Some(url)) => (url, format!("the environment's {STATE_URL_ENV}")),
            (None, None) => (DEFAULT_STATE.to_string(), "the default".to_string()),
        };
        let cwd = std::env::current_dir().unwrap_or_else(|_| ".".into());
        let clouds = Clouds::new()
            .with("local", lbscale_cloud_local::drivers(local))
            .with("aws", lbscale_cloud_aws::drivers(aws))
            .with("azure", lbscale_cloud_azure::drivers(azure))
            .with("gcp", lbscale_cloud_gcp::drivers(gcp));
        match Engine::open(&url, &cwd, clouds) {
            Ok(e) => {
                let _ = self.engine.set(Arc::new(e));
                Some(())
            }
            Err(e) => {
                error(
                    diags,
                    AttributePath::new("state"),
                    "Cannot open the lbscale store",
                    format!("{e} (URL from {from})"),
                );
                None
            }
        }
    }

    fn get_resources(
        &self,
        _diags: &mut Diagnostics,
    ) -> Option<HashMap<String, Box<dyn DynamicResource>>> {
        let e = &self.engine;
        Some(HashMap::from([
            (
                "traffic_distributor".to_string(),
                Box::new(Managed::<Distributor>::new(e.clone())) as Box<dyn DynamicResource>,
            ),
            (
                "autoscale_group".to_string(),
                Box::new(Managed::<Group>::new(e.clone())) as Box<dyn DynamicResource>,
            ),
            (
                "se_group".to_string(),
                Box::new(Managed::<SeGroup>::new(e.clone())) as Box<dyn DynamicResource>,
            ),
            (
                "vserver".to_string(),
                Box::new(Managed::<Vserver>::new(e.clone())) as Box<dyn DynamicResource>,
            ),
        ]))
    }

    fn get_data_sources(
        &self,
        _diags: &mut Diagnostics,
    ) -> Option<HashMap<String, Box<dyn DynamicDataSource>>> {
        // tf-provider prefixes these names with "lbscale_".
        Some(HashMap::from([
            (
                "autoscale_group".to_string(),
                Box::new(GroupDataSource(self.engine.clone())) as Box<dyn DynamicDataSource>,
            ),
            (
                "traffic_distributor".to_string(),
                Box::new(DistributorDataSource(self.engine.clone())) as Box<dyn DynamicDataSource>,
            ),
            (
                "scaling_simulation".to_string(),
                Box::new(SimulationDataSource) as Box<dyn DynamicDataSource>,
            ),
        ]))
    }
}
