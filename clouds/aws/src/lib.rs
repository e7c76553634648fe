//! The `aws` cloud: nodes are EC2 instances, a `dns` distributor is a Route 53
//! record set.
//!
//! - [`sigv4`] signs requests, [`api`] sends them (TLS, deadlines, retries of
//!   throttled calls) and [`xml`] reads the answers.
//! - A node is an instance started from the operator's image (the group's
//!   `node.image`, else the provider's `image_id`; with `lbscale-node`
//!   installed) whose user data starts `lbscale-node serve` on the node API
//!   port, placed as the group's `node` block says ([`placement`]: subnet per
//!   AZ, security groups or the one lbscale makes ([`security_group`]),
//!   instance profile, tags). Its instance id is the node's handle. `RunInstances`
//!   carries the node id as its client token, so a provisioning step that is
//!   run again after a crash finds the instance it started instead of starting
//!   a second one.
//! - A `dns` distributor answers for its domain with an `A` record of every
//!   serving node's public address, in the longest hosted zone of the account
//!   that contains the domain, or in a zone it creates for the domain (and then
//!   deletes with the distributor). Each publication waits until Route 53
//!   reports the change `INSYNC`.
//! - An `nlb` distributor is an ELBv2 network load balancer ([`elb`]).
//!
//! Settings come from the provider's `aws` block, else from AWS's usual
//! environment variables (`AWS_REGION`, `AWS_PROFILE`, ...), which is where
//! the daemon takes them. Credentials are found as AWS's SDKs find them and
//! refreshed before they expire ([`credentials`]).

pub mod api;
pub mod credentials;
mod elb;
#[cfg(feature = "testing")]
pub mod moto_testing;
mod placement;
mod security_group;
pub mod sigv4;
pub mod xml;

use api::{AwsApi, Endpoint, Service};
use base64::Engine as _;
use credentials::{AssumeRole, EnvVars};
use lbscale_engine::cloud::{
    Cloud, CloudError, Distributor, DriverStore, GroupResources, ProvisionRequest, Provisioned,
    Publication, Result,
};
use lbscale_engine::model::{DistributorMode, DistributorSpec, NodeSpec};
use lbscale_engine::store::NodeRow;
use serde::{Deserialize, Serialize};
use sigv4::Credentials;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

const EC2_VERSION: &str = "2016-11-15";
const ROUTE53: &str = "/2013-04-01";
const ROUTE53_NS: &str = "https://route53.amazonaws.com/doc/2013-04-01/";
/// How long a new instance gets to reach `running` with its addresses.
const RUNNING_TIMEOUT: Duration = Duration::from_secs(300);
/// How long Route 53 gets to apply a change everywhere.
const INSYNC_TIMEOUT: Duration = Duration::from_secs(120);
const POLL: Duration = Duration::from_secs(2);
/// The port of the node API on an instance.
pub const NODE_API_PORT: u16 = 9990;
/// The instance type when none is set.
const DEFAULT_INSTANCE_TYPE: &str = "c5.large";

/// The `aws` cloud's settings.
#[derive(Debug, Clone, Default)]
pub struct AwsSettings {
    pub region: Option<String>,
    /// One endpoint for every service (tests, private endpoints).
    pub endpoint: Option<String>,
    /// Keys given outright: used instead of the credential chain.
    pub credentials: Option<Credentials>,
    /// A profile of the shared config files given outright: used instead of
    /// the chain (`AWS_PROFILE` is the chain's own).
    pub profile: Option<String>,
    /// A role assumed over the credentials found.
    pub assume_role: Option<AssumeRole>,
    /// The environment the credential chain reads (`AWS_*`, `HOME`).
    pub env: EnvVars,
    /// The image of node instances: one with `lbscale-node` on its PATH.
    pub image_id: Option<String>,
    pub instance_type: Option<String>,
    /// PEM file of the certificate authorities to trust instead of the system's.
    pub ca_bundle: Option<PathBuf>,
}

impl AwsSettings {
    /// From AWS's usual environment variables: `AWS_REGION` (or
    /// `AWS_DEFAULT_REGION`), `AWS_ENDPOINT_URL`, `AWS_CA_BUNDLE` and those of
    /// the credential chain ([`credentials`]); and lbscale's
    /// `LBSCALE_AWS_IMAGE_ID`, `LBSCALE_AWS_INSTANCE_TYPE` and the role to
    /// assume, `LBSCALE_AWS_ROLE_ARN` (with `LBSCALE_AWS_EXTERNAL_ID`,
    /// `LBSCALE_AWS_ROLE_SESSION_NAME`): the daemon's `assume_role`.
    pub fn from_env() -> AwsSettings {
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        let assume_role = var("LBSCALE_AWS_ROLE_ARN").map(|arn| AssumeRole {
            external_id: var("LBSCALE_AWS_EXTERNAL_ID"),
            session_name: var("LBSCALE_AWS_ROLE_SESSION_NAME"),
            ..AssumeRole::new(&arn)
        });
        AwsSettings {
            region: var("AWS_REGION").or_else(|| var("AWS_DEFAULT_REGION")),
            endpoint: var("AWS_ENDPOINT_URL"),
            credentials: None,
            profile: None,
            assume_role,
            env: EnvVars::from_process(),
            image_id: var("LBSCALE_AWS_IMAGE_ID"),
            instance_type: var("LBSCALE_AWS_INSTANCE_TYPE"),
            ca_bundle: var("AWS_CA_BUNDLE").map(PathBuf::from),
        }
    }

    /// `over`'s values where it has them, else these.
    pub fn overridden_by(self, over: AwsSettings) -> AwsSettings {
        AwsSettings {
            region: over.region.or(self.region),
            endpoint: over.endpoint.or(self.endpoint),
            credentials: over.credentials.or(self.credentials),
            profile: over.profile.or(self.profile),
            assume_role: over.assume_role.or(self.assume_role),
            env: if over.env.is_empty() {
                self.env
            } else {
                over.env
            },
            image_id: over.image_id.or(self.image_id),
            instance_type: over.instance_type.or(self.instance_type),
            ca_bundle: over.ca_bundle.or(self.ca_bundle),
        }
    }
}

/// Parses the provider's `credentials` for AWS: `ACCESS_KEY_ID:SECRET_ACCESS_KEY`
/// or `ACCESS_KEY_ID:SECRET_ACCESS_KEY:SESSION_TOKEN`. The error never
/// repeats the value.
pub fn parse_credentials(s: &str) -> std::result::Result<Credentials, String> {
    let mut parts = s.splitn(3, ':');
    let id = parts.next().unwrap_or("").trim();
    let secret = parts.next().unwrap_or("").trim();
    let token = parts.next().map(|t| t.trim().to_string());
    if id.is_empty() || secret.is_empty() || token.as_deref() == Some("") {
        return Err("expected ACCESS_KEY_ID:SECRET_ACCESS_KEY or ACCESS_KEY_ID:SECRET_ACCESS_KEY:SESSION_TOKEN (the value is not shown)".into());
    }
    Ok(Credentials {
        access_key_id: id.into(),
        secret_access_key: secret.into(),
        session_token: token,
    })
}

/// The region of the profile the credentials come from, when no region is set.
fn profile_region(settings: &AwsSettings) -> std::result::Result<Option<String>, String> {
    let name = settings
        .profile
        .as_deref()
        .or(settings.env.get("AWS_PROFILE"))
        .unwrap_or("default");
    let profiles = credentials::profile::Profiles::load(&settings.env)?;
    Ok(profiles.value(name, "region").map(str::to_string))
}

/// The EC2 and Route 53 driver.
pub struct AwsCloud {
    api: AwsApi,
    image_id: Option<String>,
    instance_type: String,
    store: DriverStore,
}

/// What a node's handle holds.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct NodeHandle {
    instance_id: String,
}

/// What the store keeps of an AWS distributor between calls (`{}` before the
/// first call).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
struct DistributorRuntime {
    /// `Z...`, without the `/hostedzone/` prefix.
    zone_id: Option<String>,
    /// Whether lbscale created the zone (and so deletes it with the distributor).
    created_zone: bool,
    name_servers: Vec<String>,
    /// The domain the zone was chosen for: a new domain chooses again.
    #[serde(default)]
    domain: Option<String>,
    /// `nlb`: where clients go in each AZ (the load balancer's address there,
    /// else its DNS name).
    #[serde(default)]
    nlb_addresses: BTreeMap<String, String>,
}

/// The aws cloud's drivers with `settings`, to register (see [`lbscale_engine::cloud::Clouds`]);
/// settings that lack a region or credentials make a cloud that says so when used.
pub fn drivers(
    settings: AwsSettings,
) -> impl FnOnce(DriverStore) -> std::result::Result<lbscale_engine::cloud::Drivers, String>
       + Send
       + 'static {
    move |store| AwsCloud::new(settings, store).map(lbscale_engine::cloud::Drivers::of)
}

impl AwsCloud {
    /// A driver from `settings`; an error names what is missing or wrong.
    /// Credentials that come over the network (a role, the instance's) are
    /// fetched at the first call.
    pub fn new(settings: AwsSettings, store: DriverStore) -> std::result::Result<AwsCloud, String> {
        let region = match settings.region.clone() {
            Some(r) => r,
            None => profile_region(&settings)?.ok_or(
                "no AWS region: set `region` in the provider's aws block, or AWS_REGION (or `region` in the AWS profile)",
            )?,
        };
        let endpoint = settings
            .endpoint
            .as_deref()
            .map(Endpoint::parse)
            .transpose()?;
        let tls = lbscale_cloud_http::client_tls(settings.ca_bundle.as_deref(), "AWS")?;
        let credentials = credentials::resolve(
            &credentials::Choice {
                credentials: settings.credentials,
                profile: settings.profile,
                assume_role: settings.assume_role,
            },
            &settings.env,
            &credentials::Context {
                region: region.clone(),
                endpoint: endpoint.clone(),
                tls: tls.clone(),
            },
        )?;
        Ok(AwsCloud {
            api: AwsApi::new(region, endpoint, credentials, tls),
            image_id: settings.image_id,
            instance_type: settings
                .instance_type
                .unwrap_or_else(|| DEFAULT_INSTANCE_TYPE.into()),
            store,
        })
    }

    /// Who the driver calls AWS as (STS `GetCallerIdentity`): the ARN of the
    /// user or of the assumed role's session.
    pub async fn caller_identity(&self) -> Result<String> {
        let body = self
            .api
            .query(Service::Sts, "GetCallerIdentity", "2011-06-15", &[])
            .await?;
        let doc = xml::parse("sts GetCallerIdentity", &body)?;
        xml::text(doc.root(), "Arn").ok_or_else(|| {
            CloudError::Failed("AWS sts GetCallerIdentity: no Arn in the answer".into())
        })
    }

    /// Where the driver's credentials come from (no secret).
    pub fn credential_source(&self) -> String {
        self.api.credentials().describe()
    }

    /// Whether nodes can be started without an image in their group's
    /// `node` block: the provider's is set.
    pub fn has_image(&self) -> bool {
        self.image_id.is_some()
    }

    async fn ec2(&self, action: &str, params: Vec<(String, String)>) -> Result<String> {
        self.api
            .query(Service::Ec2, action, EC2_VERSION, &params)
            .await
    }

    /// The instance's state name and addresses, or None when EC2 does not know it.
    async fn describe(&self, instance_id: &str) -> Result<Option<InstanceInfo>> {
        let body = match self
            .ec2(
                "DescribeInstances",
                vec![("InstanceId.1".into(), instance_id.into())],
            )
            .await
        {
            Ok(b) => b,
            Err(CloudError::Failed(m)) if m.contains("InvalidInstanceID.NotFound") => {
                return Ok(None)
            }
            Err(e) => return Err(e),
        };
        let doc = xml::parse("ec2 DescribeInstances", &body)?;
        let Some(item) = xml::find_all(doc.root(), "instancesSet")
            .flat_map(|set| set.children().filter(|c| c.is_element()))
            .find(|i| xml::child_text(*i, "instanceId").as_deref() == Some(instance_id))
        else {
            return Ok(None);
        };
        let state = xml::find(item, "instanceState")
            .and_then(|s| xml::child_text(s, "name"))
            .unwrap_or_default();
        Ok(Some(InstanceInfo {
            state,
            private_ip: xml::child_text(item, "privateIpAddress").filter(|s| !s.is_empty()),
            public_ip: xml::child_text(item, "ipAddress").filter(|s| !s.is_empty()),
        }))
    }

    /// What the store keeps of distributor `id`; for what is shown only
    /// (`addresses`), where a store error shows nothing.
    fn runtime(&self, id: &str) -> DistributorRuntime {
        self.runtime_checked(id).unwrap_or_default()
    }

    /// As [`Self::runtime`], for what acts on it: a store error is an error,
    /// not an empty runtime (which would forget a zone that exists).
    fn runtime_checked(&self, id: &str) -> Result<DistributorRuntime> {
        self.store.load_runtime(id)
    }

    fn save_runtime(&self, id: &str, rt: &DistributorRuntime) -> Result<()> {
        self.store.save_runtime(id, rt)
    }

    async fn route53(
        &self,
        what: &str,
        method: &str,
        path: &str,
        body: Option<String>,
    ) -> Result<String> {
        self.api
            .rest(Service::Route53, what, method, path, body)
            .await
            .map_err(|e| api::failed(Service::Route53, what, e))
    }

    /// The account's public hosted zones: (id without prefix, name with its
    /// final dot, caller reference). A private zone is only seen from its VPCs,
    /// not by the clients of a distributor.
    async fn hosted_zones(&self) -> Result<Vec<(String, String, String)>> {
        let mut zones = Vec::new();
        let mut marker: Option<String> = None;
        loop {
            let path = match &marker {
                Some(m) => format!("{ROUTE53}/hostedzone?marker={}", sigv4::uri_encode(m)),
                None => format!("{ROUTE53}/hostedzone"),
            };
            let body = self.route53("ListHostedZones", "GET", &path, None).await?;
            let doc = xml::parse("route53 ListHostedZones", &body)?;
            for z in xml::find_all(doc.root(), "HostedZone") {
                if xml::text(z, "PrivateZone").as_deref() == Some("true") {
                    continue;
                }
                let id = xml::child_text(z, "Id").unwrap_or_default();
                zones.push((
                    id.trim_start_matches("/hostedzone/").to_string(),
                    xml::child_text(z, "Name").unwrap_or_default(),
                    xml::child_text(z, "CallerReference").unwrap_or_default(),
                ));
            }
            let truncated = xml::text(doc.root(), "IsTruncated").as_deref() == Some("true");
            marker = xml::text(doc.root(), "NextMarker");
            if !truncated || marker.is_none() {
                return Ok(zones);
            }
        }
    }

    /// The record set of `name` and `rtype` in `zone`: its TTL and values, if
    /// it exists.
    async fn record(
        &self,
        zone: &str,
        name: &str,
        rtype: &str,
    ) -> Result<Option<(u64, Vec<String>)>> {
        let path = format!(
            "{ROUTE53}/hostedzone/{zone}/rrset?name={}&type={rtype}&maxitems=1",
            sigv4::uri_encode(name)
        );
        let body = self
            .route53("ListResourceRecordSets", "GET", &path, None)
            .await?;
        let doc = xml::parse("route53 ListResourceRecordSets", &body)?;
        let Some(set) = xml::find_all(doc.root(), "ResourceRecordSet").find(|s| {
            xml::child_text(*s, "Type").as_deref() == Some(rtype)
                && xml::child_text(*s, "Name").is_some_and(|n| same_name(&n, name))
        }) else {
            return Ok(None);
        };
        let ttl = xml::child_text(set, "TTL")
            .and_then(|t| t.parse().ok())
            .unwrap_or(0);
        let mut values: Vec<String> = xml::find_all(set, "Value")
            .map(|v| v.text().unwrap_or("").trim().to_string())
            .collect();
        values.sort();
        Ok(Some((ttl, values)))
    }

    /// Whether the `A` record of `domain` in `zone` is this distributor's:
    /// its owner record (`_lbscale.<domain>`, TXT) names the distributor.
    async fn owns(&self, zone: &str, domain: &str, id: &str) -> Result<bool> {
        Ok(self
            .record(zone, &owner_name(domain), "TXT")
            .await?
            .is_some_and(|(_, values)| values == [owner_value(id)]))
    }

    /// Sends one batch of changes (applied together or not at all) and waits
    /// until Route 53 has them everywhere.
    async fn change_records(&self, zone: &str, changes: &[RecordChange<'_>]) -> Result<()> {
        let changes_xml: String = changes
            .iter()
            .map(|c| {
                let records: String = c
                    .values
                    .iter()
                    .map(|v| format!("<ResourceRecord><Value>{}</Value></ResourceRecord>", xml::escape(v)))
                    .collect();
                format!(
                    "<Change><Action>{}</Action><ResourceRecordSet><Name>{}</Name><Type>{}</Type><TTL>{}</TTL><ResourceRecords>{records}</ResourceRecords></ResourceRecordSet></Change>",
                    c.action,
                    xml::escape(c.name),
                    c.rtype,
                    c.ttl
                )
            })
            .collect();
        let body = format!(
            r#"<?xml version="1.0" encoding="UTF-8"?><ChangeResourceRecordSetsRequest xmlns="{ROUTE53_NS}"><ChangeBatch><Comment>lbscale</Comment><Changes>{changes_xml}</Changes></ChangeBatch></ChangeResourceRecordSetsRequest>"#
        );
        let name = changes.first().map(|c| c.name).unwrap_or_default();
        let answer = self
            .route53(
                "ChangeResourceRecordSets",
                "POST",
                &format!("{ROUTE53}/hostedzone/{zone}/rrset"),
                Some(body),
            )
            .await?;
        let doc = xml::parse("route53 ChangeResourceRecordSets", &answer)?;
        let change = xml::text(doc.root(), "Id").unwrap_or_default();
        let mut status = xml::text(doc.root(), "Status").unwrap_or_default();
        let change = change.trim_start_matches("/change/").to_string();
        let deadline = Instant::now() + INSYNC_TIMEOUT;
        while status != "INSYNC" && !change.is_empty() {
            if Instant::now() >= deadline {
                return Err(CloudError::Failed(format!(
                    "Route 53 change {change} of {name} not INSYNC after {}s (last status {status:?})",
                    INSYNC_TIMEOUT.as_secs()
                )));
            }
            tokio::time::sleep(POLL).await;
            let body = self
                .route53(
                    "GetChange",
                    "GET",
                    &format!("{ROUTE53}/change/{change}"),
                    None,
                )
                .await?;
            status = xml::text(xml::parse("route53 GetChange", &body)?.root(), "Status")
                .unwrap_or_default();
        }
        Ok(())
    }

    /// Deletes this distributor's `A` record of `domain` and its owner record.
    /// An `A` record that is not this distributor's is left alone.
    async fn delete_owned(&self, zone: &str, domain: &str, id: &str) -> Result<()> {
        let owner = owner_name(domain);
        let Some((owner_ttl, owner_values)) = self.record(zone, &owner, "TXT").await? else {
            return Ok(());
        };
        if owner_values != [owner_value(id)] {
            return Ok(());
        }
        let mut changes = vec![RecordChange {
            action: "DELETE",
            name: &owner,
            rtype: "TXT",
            ttl: owner_ttl,
            values: owner_values.clone(),
        }];
        if let Some((ttl, values)) = self.record(zone, domain, "A").await? {
            changes.push(RecordChange {
                action: "DELETE",
                name: domain,
                rtype: "A",
                ttl,
                values,
            });
        }
        self.change_records(zone, &changes).await
    }
}

/// One change of a record set.
struct RecordChange<'a> {
    action: &'static str,
    name: &'a str,
    rtype: &'static str,
    ttl: u64,
    values: Vec<String>,
}

/// Where a distributor marks the `A` record of `domain` as its own.
fn owner_name(domain: &str) -> String {
    format!("_lbscale.{}", domain.trim_end_matches('.'))
}

/// The owner record's value (a TXT value is a quoted string).
fn owner_value(id: &str) -> String {
    format!("\"lbscale distributor {id}\"")
}

impl AwsCloud {
    /// Deletes this distributor's `A` record of `domain` and, if lbscale
    /// created it, the zone. A zone that the store lost track of (a crash before it was
    /// saved) is found by its caller reference.
    async fn remove_dns(&self, id: &str, domain: &str, rt: &DistributorRuntime) -> Result<()> {
        let (zone, created) = match &rt.zone_id {
            Some(z) => (z.clone(), rt.created_zone),
            None => {
                let reference = format!("lbscale-{id}");
                match self
                    .hosted_zones()
                    .await?
                    .into_iter()
                    .find(|(_, _, caller)| caller == &reference)
                {
                    Some((z, _, _)) => (z, true),
                    None => return Ok(()),
                }
            }
        };
        match self.delete_owned(&zone, domain, id).await {
            Ok(()) => {}
            Err(CloudError::Failed(m)) if m.contains("NoSuchHostedZone") => return Ok(()),
            Err(e) => return Err(e),
        }
        if created {
            match self
                .route53(
                    "DeleteHostedZone",
                    "DELETE",
                    &format!("{ROUTE53}/hostedzone/{zone}"),
                    None,
                )
                .await
            {
                Ok(_) => {}
                Err(CloudError::Failed(m)) if m.contains("NoSuchHostedZone") => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }
}

struct InstanceInfo {
    state: String,
    private_ip: Option<String>,
    public_ip: Option<String>,
}

/// DNS names compare without case and without their final dot.
fn same_name(a: &str, b: &str) -> bool {
    a.trim_end_matches('.')
        .eq_ignore_ascii_case(b.trim_end_matches('.'))
}

/// The zone among `zones` (names with or without their final dot) that holds
/// `domain`: the longest one that is the domain or one of its parents.
fn zone_for<'z>(
    zones: &'z [(String, String, String)],
    domain: &str,
) -> Option<&'z (String, String, String)> {
    let domain = domain.trim_end_matches('.').to_ascii_lowercase();
    zones
        .iter()
        .filter(|(_, name, _)| {
            let zone = name.trim_end_matches('.').to_ascii_lowercase();
            domain == zone || domain.ends_with(&format!(".{zone}"))
        })
        .max_by_key(|(_, name, _)| name.trim_end_matches('.').len())
}

/// The node's user data: a shell script that writes the management API's files
/// under /etc/lbscale (mode 0600) and runs `lbscale-node serve` with them.
/// User data is readable by whoever may describe the instance and by every
/// process on it that reaches the instance metadata (docs/security.md): it holds
/// the node's token's SHA-256 (which the node checks the presented token
/// against), never the token; the group CA's certificate; and the node's own
/// certificate and key, which prove only that node's name. The node's API
/// answers at its private address only, read from the instance metadata
/// (IMDSv2) at boot; without it the node does not start.
fn bootstrap(req: &ProvisionRequest) -> String {
    let c = &req.credentials;
    let file = |name: &str, content: &str| {
        // PEM and `sha256:HEX` hold no quote, so a quoted here-document keeps them as they are.
        format!(
            "cat > /etc/lbscale/{name} <<'LBSCALE_END'\n{}\nLBSCALE_END\n",
            content.trim_end()
        )
    };
    format!(
        "#!/bin/sh\n\
         # lbscale node {node}: written by lbscale's aws driver.\n\
         set -e\n\
         umask 077\n\
         mkdir -p /etc/lbscale\n\
         {token}{ca}{cert}{key}\
         imds=http://169.254.169.254/latest\n\
         ip=\n\
         for i in 1 2 3 4 5 6 7 8 9 10; do\n\
         t=$(curl -sf -m 2 -X PUT -H 'X-aws-ec2-metadata-token-ttl-seconds: 60' $imds/api/token) && \
         ip=$(curl -sf -m 2 -H \"X-aws-ec2-metadata-token: $t\" $imds/meta-data/local-ipv4) && break\n\
         sleep 1\n\
         done\n\
         [ -n \"$ip\" ] || {{ echo 'lbscale: no private address from the instance metadata' >&2; exit 1; }}\n\
         printf 'LBSCALE_NODE_ID=%s\\nLBSCALE_LISTEN_IP=0.0.0.0\\nLBSCALE_API_ADDRESS=%s\\nLBSCALE_API_PORT=%s\\n' {node} \"$ip\" {port} > /etc/lbscale/node.env\n\
         # An image made with examples/cloud-init has the unit: systemd runs the\n\
         # node (restarted on failure, started again at boot). Otherwise, run it here.\n\
         if [ -d /run/systemd/system ] && [ -f /etc/systemd/system/lbscale-node.service ]; then\n\
         systemctl start lbscale-node.service; exit 0\n\
         fi\n\
         exec lbscale-node serve --node-id {node} --listen-ip 0.0.0.0 --api-address \"$ip\" --api-port {port} \
         --token-file /etc/lbscale/token --tls-ca /etc/lbscale/ca.pem --tls-cert /etc/lbscale/node.pem \
         --tls-key /etc/lbscale/node-key.pem --memory-limit-mb {mem}\n",
        node = req.node_id,
        token = file("token", &c.token_file),
        ca = file("ca.pem", &c.ca_pem),
        cert = file("node.pem", &c.cert_pem),
        key = file("node-key.pem", &c.key_pem),
        port = NODE_API_PORT,
        mem = req.node.memory_limit_mb,
    )
}

#[async_trait::async_trait]
impl Cloud for AwsCloud {
    async fn provision(&self, req: &ProvisionRequest) -> Result<Provisioned> {
        let mut params = self.placement_params(req).await?;
        params.extend([
            // Idempotent: the same node id never starts a second instance.
            // (A client token is at most 64 characters; a node id may be more.)
            (
                "ClientToken".into(),
                sigv4::sha256_hex(req.node_id.as_bytes()),
            ),
            (
                "UserData".into(),
                base64::engine::general_purpose::STANDARD.encode(bootstrap(req)),
            ),
        ]);
        // A provisioning step run again (after a crash) finds the instance it
        // started by its tag instead of starting a second one. The client
        // token does the same inside EC2, but not every EC2-compatible API
        // honours it.
        let existing = self
            .instances_of_node(&req.node_id)
            .await?
            .into_iter()
            .find(|(_, state)| matches!(state.as_str(), "pending" | "running"));
        let instance_id = match existing {
            Some((id, _)) => id,
            None => {
                let body = self.ec2("RunInstances", params).await.map_err(|e| {
                    security_group::in_context(
                        e,
                        &format!("instance of node {} in {}", req.node_id, req.az),
                    )
                })?;
                let doc = xml::parse("ec2 RunInstances", &body)?;
                xml::text(doc.root(), "instanceId").ok_or_else(|| {
                    CloudError::Failed("AWS ec2 RunInstances: no instanceId in the answer".into())
                })?
            }
        };
        match self.wait_running(&instance_id, &req.node_id).await {
            Ok(p) => Ok(p),
            Err(e) => {
                // The engine forgets a node whose provisioning failed: the
                // instance must not outlive it.
                if let Err(t) = self
                    .ec2(
                        "TerminateInstances",
                        vec![("InstanceId.1".into(), instance_id.clone())],
                    )
                    .await
                {
                    tracing::warn!(instance = %instance_id, error = %t, "could not terminate the instance of a failed provisioning");
                }
                Err(e)
            }
        }
    }

    async fn deprovision(&self, node: &NodeRow) -> Result<()> {
        let Ok(h) = serde_json::from_value::<NodeHandle>(node.handle.clone()) else {
            // Provisioning never got an instance id: find it by the client token.
            return self.terminate_by_node_id(&node.id).await;
        };
        match self
            .ec2(
                "TerminateInstances",
                vec![("InstanceId.1".into(), h.instance_id)],
            )
            .await
        {
            Ok(_) => Ok(()),
            Err(CloudError::Failed(m)) if m.contains("InvalidInstanceID.NotFound") => Ok(()),
            Err(e) => Err(e),
        }
    }

    async fn is_alive(&self, node: &NodeRow) -> Result<bool> {
        let Ok(h) = serde_json::from_value::<NodeHandle>(node.handle.clone()) else {
            return Ok(false);
        };
        Ok(self
            .describe(&h.instance_id)
            .await?
            .is_some_and(|i| matches!(i.state.as_str(), "pending" | "running")))
    }

    /// One `DescribeInstances` for all of them.
    async fn alive(&self, nodes: &[NodeRow]) -> Result<Vec<bool>> {
        let ids: Vec<Option<String>> = nodes
            .iter()
            .map(|n| {
                serde_json::from_value::<NodeHandle>(n.handle.clone())
                    .ok()
                    .map(|h| h.instance_id)
            })
            .collect();
        let known: Vec<&String> = ids.iter().flatten().collect();
        let mut running = std::collections::BTreeSet::new();
        // EC2 takes up to 1,000 instance ids per call.
        for chunk in known.chunks(500) {
            // By filter, not InstanceId.N: an id EC2 no longer knows must not
            // fail the whole call (InvalidInstanceID.NotFound).
            let mut params = vec![("Filter.1.Name".to_string(), "instance-id".to_string())];
            for (i, id) in chunk.iter().enumerate() {
                params.push((format!("Filter.1.Value.{}", i + 1), id.to_string()));
            }
            let body = self.ec2("DescribeInstances", params).await?;
            let doc = xml::parse("ec2 DescribeInstances", &body)?;
            for item in xml::find_all(doc.root(), "instancesSet")
                .flat_map(|set| set.children().filter(|c| c.is_element()))
            {
                let state =
                    xml::find(item, "instanceState").and_then(|s| xml::child_text(s, "name"));
                if matches!(state.as_deref(), Some("pending") | Some("running")) {
                    if let Some(id) = xml::child_text(item, "instanceId") {
                        running.insert(id);
                    }
                }
            }
        }
        Ok(ids
            .iter()
            .map(|id| id.as_ref().is_some_and(|id| running.contains(id)))
            .collect())
    }

    fn api_port(&self, _node: &NodeRow) -> u16 {
        NODE_API_PORT
    }

    /// An image is the group's (`node.image`) or the provider's.
    fn node_unusable(&self, node: &NodeSpec) -> Option<String> {
        self.image_for(node).is_none().then(|| {
            "no image for AWS nodes: set `image` in the group's node block, or image_id in the provider's aws block (or LBSCALE_AWS_IMAGE_ID)".into()
        })
    }

    async fn prepare_group(&self, group: &GroupResources) -> Result<()> {
        self.prepare_security_group(group).await
    }

    async fn release_group(&self, group_id: &str) -> Result<()> {
        self.release_security_groups(group_id).await
    }
}

impl AwsCloud {
    /// Waits until the instance runs and has its private address.
    async fn wait_running(&self, instance_id: &str, node_id: &str) -> Result<Provisioned> {
        let instance_id = instance_id.to_string();
        let deadline = Instant::now() + RUNNING_TIMEOUT;
        loop {
            let info = self.describe(&instance_id).await?;
            match info {
                Some(i) if i.state == "running" && i.private_ip.is_some() => {
                    return Ok(Provisioned {
                        private_ip: i.private_ip.unwrap_or_default(),
                        public_ip: i.public_ip,
                        api_port: NODE_API_PORT,
                        handle: serde_json::to_value(NodeHandle { instance_id }).expect("handle"),
                    });
                }
                Some(i)
                    if matches!(i.state.as_str(), "shutting-down" | "terminated" | "stopped") =>
                {
                    return Err(CloudError::Failed(format!(
                        "instance {instance_id} of node {} is {} instead of running",
                        node_id, i.state
                    )));
                }
                last => {
                    if Instant::now() >= deadline {
                        return Err(CloudError::Failed(format!(
                            "instance {instance_id} of node {} not running with an address after {}s (state {:?})",
                            node_id,
                            RUNNING_TIMEOUT.as_secs(),
                            last.map(|i| i.state)
                        )));
                    }
                    tokio::time::sleep(POLL).await;
                }
            }
        }
    }

    /// The instances tagged with `node_id`, with their state names.
    async fn instances_of_node(&self, node_id: &str) -> Result<Vec<(String, String)>> {
        let body = self
            .ec2(
                "DescribeInstances",
                vec![
                    ("Filter.1.Name".into(), "tag:lbscale:node-id".into()),
                    ("Filter.1.Value.1".into(), node_id.into()),
                ],
            )
            .await?;
        let doc = xml::parse("ec2 DescribeInstances", &body)?;
        Ok(xml::find_all(doc.root(), "instancesSet")
            .flat_map(|set| set.children().filter(|c| c.is_element()))
            .filter_map(|i| {
                let state = xml::find(i, "instanceState").and_then(|s| xml::child_text(s, "name"));
                Some((xml::child_text(i, "instanceId")?, state.unwrap_or_default()))
            })
            .collect())
    }

    /// Terminates whatever instance carries `node_id`'s tag (a provisioning
    /// step cut short before its instance id was stored).
    async fn terminate_by_node_id(&self, node_id: &str) -> Result<()> {
        for (id, state) in self.instances_of_node(node_id).await? {
            if state != "terminated" {
                self.ec2("TerminateInstances", vec![("InstanceId.1".into(), id)])
                    .await?;
            }
        }
        Ok(())
    }
}

#[async_trait::async_trait]
impl Distributor for AwsCloud {
    async fn ensure(&self, id: &str, spec: &DistributorSpec) -> Result<()> {
        if spec.mode == DistributorMode::Nlb {
            // The load balancer is made at the first publication with a port:
            // it needs the AZs of the groups, and it costs while it exists.
            return Ok(());
        }
        let mut rt = self.runtime_checked(id)?;
        let domain = spec.domain.clone().unwrap_or_default();
        match (&rt.zone_id, &rt.domain) {
            (Some(_), Some(d)) if same_name(d, &domain) => return Ok(()),
            // A store written before the domain was kept: the zone is for it.
            (Some(_), None) => {
                rt.domain = Some(domain);
                return self.save_runtime(id, &rt);
            }
            // The domain changed: its record and zone go, and a zone is
            // chosen for the new one.
            (Some(_), Some(old)) => {
                let old = old.clone();
                self.remove_dns(id, &old, &rt).await?;
                rt = DistributorRuntime::default();
                self.save_runtime(id, &rt)?;
            }
            (None, _) => {}
        }
        let reference = format!("lbscale-{id}");
        let zones = self.hosted_zones().await?;
        let (zone_id, created) = match zone_for(&zones, &domain) {
            Some((zid, _, caller)) => (zid.clone(), caller == &reference),
            None => {
                let body = format!(
                    r#"<?xml version="1.0" encoding="UTF-8"?><CreateHostedZoneRequest xmlns="{ROUTE53_NS}"><Name>{}</Name><CallerReference>{}</CallerReference><HostedZoneConfig><Comment>lbscale distributor {}</Comment></HostedZoneConfig></CreateHostedZoneRequest>"#,
                    xml::escape(&domain),
                    xml::escape(&reference),
                    xml::escape(&spec.name)
                );
                let answer = self
                    .route53(
                        "CreateHostedZone",
                        "POST",
                        &format!("{ROUTE53}/hostedzone"),
                        Some(body),
                    )
                    .await?;
                let doc = xml::parse("route53 CreateHostedZone", &answer)?;
                let zid = xml::find(doc.root(), "HostedZone")
                    .and_then(|z| xml::child_text(z, "Id"))
                    .unwrap_or_default();
                (zid.trim_start_matches("/hostedzone/").to_string(), true)
            }
        };
        let answer = self
            .route53(
                "GetHostedZone",
                "GET",
                &format!("{ROUTE53}/hostedzone/{zone_id}"),
                None,
            )
            .await?;
        let doc = xml::parse("route53 GetHostedZone", &answer)?;
        rt.name_servers = xml::find_all(doc.root(), "NameServer")
            .map(|n| n.text().unwrap_or("").trim().to_string())
            .collect();
        rt.zone_id = Some(zone_id);
        rt.created_zone = created;
        rt.domain = Some(domain);
        self.save_runtime(id, &rt)
    }

    async fn publish(
        &self,
        id: &str,
        spec: &DistributorSpec,
        publication: &Publication,
    ) -> Result<()> {
        if spec.mode == DistributorMode::Nlb {
            return self.publish_nlb(id, publication).await;
        }
        self.ensure(id, spec).await?;
        let zone = self.runtime_checked(id)?.zone_id.unwrap_or_default();
        let domain = spec.domain.clone().unwrap_or_default();
        let ttl = spec.ttl.get().as_secs();
        let mut addresses: Vec<String> =
            publication.endpoints.values().flatten().cloned().collect();
        addresses.sort();
        addresses.dedup();
        let current = match self.record(&zone, &domain, "A").await {
            Ok(c) => c,
            Err(CloudError::Failed(m)) if m.contains("NoSuchHostedZone") => {
                // Deleted outside lbscale: choose (or make) a zone again next time.
                self.save_runtime(id, &DistributorRuntime::default())?;
                return Err(CloudError::Failed(format!(
                    "the hosted zone {zone} of {domain} is gone (deleted outside lbscale); the next publication chooses a zone again: {m}"
                )));
            }
            Err(e) => return Err(e),
        };
        // Never take over (nor later delete) a record someone else wrote.
        if current.is_some() && !self.owns(&zone, &domain, id).await? {
            return Err(CloudError::Failed(format!(
                "an A record of {domain} already exists in hosted zone {zone} and is not this distributor's (no TXT record {} naming it): delete it, or give the distributor another domain",
                owner_name(&domain)
            )));
        }
        let owner = owner_name(&domain);
        match (current, addresses.is_empty()) {
            (Some((t, values)), _) if t == ttl && values == addresses => Ok(()),
            (Some(_), true) => self.delete_owned(&zone, &domain, id).await,
            (None, true) => Ok(()),
            (_, false) => {
                let changes = [
                    RecordChange {
                        action: "UPSERT",
                        name: &domain,
                        rtype: "A",
                        ttl,
                        values: addresses,
                    },
                    RecordChange {
                        action: "UPSERT",
                        name: &owner,
                        rtype: "TXT",
                        ttl,
                        values: vec![owner_value(id)],
                    },
                ];
                self.change_records(&zone, &changes).await
            }
        }
    }

    async fn remove(&self, id: &str) -> Result<()> {
        let Some(spec) = self.store.distributor(id)? else {
            return Ok(());
        };
        if spec.mode == DistributorMode::Nlb {
            return self.remove_nlb(id).await;
        }
        let rt = self.runtime_checked(id)?;
        let domain = rt
            .domain
            .clone()
            .or(spec.domain.clone())
            .unwrap_or_default();
        self.remove_dns(id, &domain, &rt).await
    }

    fn addresses(&self, id: &str, spec: &DistributorSpec) -> BTreeMap<String, String> {
        if spec.mode == DistributorMode::Nlb {
            return self.runtime(id).nlb_addresses;
        }
        self.runtime(id)
            .name_servers
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
    fn the_longest_zone_that_holds_the_domain() {
        let zones = vec![
            ("Z1".into(), "example.com.".into(), "x".into()),
            ("Z2".into(), "shop.example.com.".into(), "y".into()),
            ("Z3".into(), "ample.com.".into(), "z".into()),
        ];
        assert_eq!(zone_for(&zones, "www.shop.example.com").unwrap().0, "Z2");
        assert_eq!(zone_for(&zones, "Shop.Example.com.").unwrap().0, "Z2");
        assert_eq!(zone_for(&zones, "api.example.com").unwrap().0, "Z1");
        assert!(zone_for(&zones, "example.org").is_none());
        // A suffix that is not a parent domain does not count.
        assert_eq!(zone_for(&zones, "xample.com"), None);
    }

    #[test]
    fn credentials_parse_without_echoing() {
        let c = parse_credentials("AKID:s3cret").unwrap();
        assert_eq!((c.access_key_id.as_str(), c.session_token), ("AKID", None));
        let c = parse_credentials("AKID:s3cret:tok").unwrap();
        assert_eq!(c.session_token.as_deref(), Some("tok"));
        for bad in ["", "AKID", "AKID:", ":s3cret", "AKID:s3cret:"] {
            let e = parse_credentials(bad).unwrap_err();
            assert!(
                !bad.is_empty() && !e.contains("s3cret") || bad.is_empty(),
                "{e}"
            );
        }
    }
}
