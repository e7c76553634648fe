//! Where the driver's Azure access tokens come from, in the order Azure's SDKs
//! (`DefaultAzureCredential`) and the azurerm Terraform provider look:
//!
//! 1. a service principal's client secret given in the provider's `azure`
//!    block;
//! 2. the environment: `ARM_CLIENT_ID`, `ARM_CLIENT_SECRET`, `ARM_TENANT_ID`
//!    (the azurerm provider's names), else `AZURE_CLIENT_ID`,
//!    `AZURE_CLIENT_SECRET`, `AZURE_TENANT_ID` (the SDKs');
//! 3. workload identity: a federated token file (`AZURE_FEDERATED_TOKEN_FILE`
//!    or `ARM_OIDC_TOKEN_FILE_PATH`) exchanged for a token of the client
//!    (`AZURE_CLIENT_ID`/`ARM_CLIENT_ID`) in the tenant; the file is read
//!    anew at each exchange (Kubernetes rotates it);
//! 4. managed identity: the instance metadata endpoint (IMDS), at
//!    `AZURE_POD_IDENTITY_AUTHORITY_HOST` when set (tests), a user-assigned
//!    identity when a client id is given.
//!
//! Tokens come from the login endpoint (`AZURE_AUTHORITY_HOST`, default
//! `https://login.microsoftonline.com`) and are fetched again before they
//! expire. The secret is never logged nor shown: `Debug` and
//! [`Credentials::describe`] leave it out.

use lbscale_cloud_http::{self as http, Url};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::Mutex;

/// How long a token request may take.
const TOKEN_TIMEOUT: Duration = Duration::from_secs(30);
/// IMDS answers on the machine itself, or not at all: a short deadline, so a
/// machine without one fails fast.
const IMDS_TIMEOUT: Duration = Duration::from_secs(5);
/// A token is fetched again this long before it expires (the SDKs' margin),
/// or at half its life when it lives shorter than twice that.
const REFRESH_MARGIN: Duration = Duration::from_secs(300);
pub const DEFAULT_AUTHORITY: &str = "https://login.microsoftonline.com";
pub const DEFAULT_IMDS: &str = "http://169.254.169.254";
pub const ARM_SCOPE: &str = "https://management.azure.com/.default";
const ARM_RESOURCE: &str = "https://management.azure.com/";

/// The variables of the process environment that the chain reads, taken once
/// (tests give their own).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EnvVars(pub Vec<(String, String)>);

/// The variables the chain reads.
pub const VARIABLES: &[&str] = &[
    "ARM_CLIENT_ID",
    "ARM_CLIENT_SECRET",
    "ARM_TENANT_ID",
    "ARM_OIDC_TOKEN_FILE_PATH",
    "ARM_USE_MSI",
    "AZURE_CLIENT_ID",
    "AZURE_CLIENT_SECRET",
    "AZURE_TENANT_ID",
    "AZURE_FEDERATED_TOKEN_FILE",
    "AZURE_AUTHORITY_HOST",
    "AZURE_POD_IDENTITY_AUTHORITY_HOST",
];

impl EnvVars {
    pub fn from_process() -> EnvVars {
        EnvVars(
            VARIABLES
                .iter()
                .filter_map(|k| std::env::var(k).ok().map(|v| (k.to_string(), v)))
                .collect(),
        )
    }
    pub fn get(&self, k: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(n, _)| n == k)
            .map(|(_, v)| v.as_str())
            .filter(|v| !v.is_empty())
    }
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// A service principal's secret, given outright.
#[derive(Clone, PartialEq)]
pub struct ClientSecret {
    pub tenant_id: String,
    pub client_id: String,
    pub secret: String,
}

impl std::fmt::Debug for ClientSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientSecret")
            .field("tenant_id", &self.tenant_id)
            .field("client_id", &self.client_id)
            .field("secret", &"<redacted>")
            .finish()
    }
}

/// Where tokens come from.
#[derive(Clone, PartialEq)]
pub enum Source {
    ClientSecret(ClientSecret),
    WorkloadIdentity {
        tenant_id: String,
        client_id: String,
        token_file: String,
    },
    ManagedIdentity {
        client_id: Option<String>,
        endpoint: String,
    },
}

impl std::fmt::Debug for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.describe())
    }
}

impl Source {
    /// What it is, without the secret.
    pub fn describe(&self) -> String {
        match self {
            Source::ClientSecret(c) => format!(
                "client secret of service principal {} in tenant {}",
                c.client_id, c.tenant_id
            ),
            Source::WorkloadIdentity {
                tenant_id,
                client_id,
                token_file,
            } => format!(
                "workload identity of {client_id} in tenant {tenant_id} (federated token file {token_file})"
            ),
            Source::ManagedIdentity { client_id, endpoint } => match client_id {
                Some(id) => format!("user-assigned managed identity {id} (metadata endpoint {endpoint})"),
                None => format!("system-assigned managed identity (metadata endpoint {endpoint})"),
            },
        }
    }
}

/// What the provider block says about credentials (the rest is the chain's).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Choice {
    pub client_secret: Option<ClientSecret>,
    pub tenant_id: Option<String>,
    pub client_id: Option<String>,
    pub federated_token_file: Option<String>,
    pub use_managed_identity: bool,
    pub authority_host: Option<String>,
    pub metadata_endpoint: Option<String>,
}

/// The source the chain picks; an error says what is half given.
pub fn choose(choice: &Choice, env: &EnvVars) -> Result<(Source, String), String> {
    let authority = choice
        .authority_host
        .clone()
        .or(env.get("AZURE_AUTHORITY_HOST").map(str::to_string))
        .unwrap_or_else(|| DEFAULT_AUTHORITY.to_string());
    Url::parse(&authority).map_err(|e| format!("the Azure authority host: {e}"))?;
    let authority = authority.trim_end_matches('/').to_string();
    if let Some(c) = &choice.client_secret {
        return Ok((Source::ClientSecret(c.clone()), authority));
    }
    let tenant = |prefix: &str| {
        choice
            .tenant_id
            .clone()
            .or(env.get(&format!("{prefix}_TENANT_ID")).map(str::to_string))
    };
    let client = |prefix: &str| {
        choice
            .client_id
            .clone()
            .or(env.get(&format!("{prefix}_CLIENT_ID")).map(str::to_string))
    };
    if !choice.use_managed_identity && choice.federated_token_file.is_none() {
        for prefix in ["ARM", "AZURE"] {
            if let Some(secret) = env.get(&format!("{prefix}_CLIENT_SECRET")) {
                let (Some(tenant_id), Some(client_id)) = (tenant(prefix), client(prefix)) else {
                    return Err(format!(
                        "{prefix}_CLIENT_SECRET is set but {prefix}_TENANT_ID or {prefix}_CLIENT_ID is not: a client secret needs its tenant and client id"
                    ));
                };
                return Ok((
                    Source::ClientSecret(ClientSecret {
                        tenant_id,
                        client_id,
                        secret: secret.to_string(),
                    }),
                    authority,
                ));
            }
        }
    }
    if !choice.use_managed_identity {
        let file = choice
            .federated_token_file
            .clone()
            .map(|f| ("federated_token_file", f))
            .or(env
                .get("AZURE_FEDERATED_TOKEN_FILE")
                .map(|f| ("AZURE_FEDERATED_TOKEN_FILE", f.to_string())))
            .or(env
                .get("ARM_OIDC_TOKEN_FILE_PATH")
                .map(|f| ("ARM_OIDC_TOKEN_FILE_PATH", f.to_string())));
        if let Some((from, token_file)) = file {
            let (Some(tenant_id), Some(client_id)) = (
                tenant("AZURE").or(tenant("ARM")),
                client("AZURE").or(client("ARM")),
            ) else {
                return Err(format!(
                    "{from} is set but no tenant or client id (tenant_id and client_id, or AZURE_TENANT_ID and AZURE_CLIENT_ID): workload identity needs both"
                ));
            };
            return Ok((
                Source::WorkloadIdentity {
                    tenant_id,
                    client_id,
                    token_file,
                },
                authority,
            ));
        }
    }
    let endpoint = choice
        .metadata_endpoint
        .clone()
        .or(env
            .get("AZURE_POD_IDENTITY_AUTHORITY_HOST")
            .map(str::to_string))
        .unwrap_or_else(|| DEFAULT_IMDS.to_string());
    Url::parse(&endpoint).map_err(|e| format!("the instance metadata endpoint: {e}"))?;
    Ok((
        Source::ManagedIdentity {
            client_id: client("AZURE").or(client("ARM")),
            endpoint: endpoint.trim_end_matches('/').to_string(),
        },
        authority,
    ))
}

struct Token {
    value: String,
    refresh_at: Instant,
}

/// The tokens of one source, shared by every call of the driver.
pub struct Credentials {
    source: Source,
    authority: String,
    tls: Arc<rustls::ClientConfig>,
    token: Mutex<Option<Token>>,
}

impl Credentials {
    pub fn new(source: Source, authority: String, tls: Arc<rustls::ClientConfig>) -> Credentials {
        Credentials {
            source,
            authority,
            tls,
            token: Mutex::new(None),
        }
    }

    pub fn describe(&self) -> String {
        self.source.describe()
    }

    pub fn source(&self) -> &Source {
        &self.source
    }

    /// A token that is not about to expire (fetched when needed).
    pub async fn token(&self) -> Result<String, String> {
        let mut t = self.token.lock().await;
        if let Some(t) = t.as_ref().filter(|t| Instant::now() < t.refresh_at) {
            return Ok(t.value.clone());
        }
        let (value, lifetime) = self.fetch().await?;
        let margin = REFRESH_MARGIN.min(lifetime / 2);
        tracing::debug!(source = %self.source.describe(), lifetime_s = lifetime.as_secs(), "fetched an Azure access token");
        *t = Some(Token {
            value: value.clone(),
            refresh_at: Instant::now() + lifetime.saturating_sub(margin),
        });
        Ok(value)
    }

    /// Forgets the token (Azure found it expired before its time).
    pub async fn invalidate(&self) {
        *self.token.lock().await = None;
    }

    async fn fetch(&self) -> Result<(String, Duration), String> {
        match &self.source {
            Source::ClientSecret(c) => {
                self.login(&c.tenant_id, &c.client_id, &[("client_secret", &c.secret)])
                    .await
            }
            Source::WorkloadIdentity {
                tenant_id,
                client_id,
                token_file,
            } => {
                let assertion = std::fs::read_to_string(token_file).map_err(|e| {
                    format!(
                        "workload identity: cannot read the federated token file {token_file}: {e}"
                    )
                })?;
                self.login(
                    tenant_id,
                    client_id,
                    &[
                        (
                            "client_assertion_type",
                            "urn:ietf:params:oauth:client-assertion-type:jwt-bearer",
                        ),
                        ("client_assertion", assertion.trim()),
                    ],
                )
                .await
            }
            Source::ManagedIdentity {
                client_id,
                endpoint,
            } => {
                let mut path = format!(
                    "{endpoint}/metadata/identity/oauth2/token?api-version=2018-02-01&resource={}",
                    http::encode(ARM_RESOURCE)
                );
                if let Some(id) = client_id {
                    path.push_str(&format!("&client_id={}", http::encode(id)));
                }
                let url = Url::parse(&path)?;
                let r = http::send(
                    &self.tls,
                    "GET",
                    &url,
                    &[("metadata", "true")],
                    None,
                    IMDS_TIMEOUT,
                )
                .await
                .map_err(|e| format!("managed identity: {e}"))?;
                token_answer("managed identity (instance metadata)", r.status, &r.body)
            }
        }
    }

    /// The client-credentials grant at the tenant's token endpoint.
    async fn login(
        &self,
        tenant: &str,
        client: &str,
        proof: &[(&str, &str)],
    ) -> Result<(String, Duration), String> {
        let mut form = vec![
            ("grant_type", "client_credentials"),
            ("client_id", client),
            ("scope", ARM_SCOPE),
        ];
        form.extend_from_slice(proof);
        let body = form
            .iter()
            .map(|(k, v)| format!("{k}={}", http::encode(v)))
            .collect::<Vec<_>>()
            .join("&");
        let url = Url::parse(&format!(
            "{}/{}/oauth2/v2.0/token",
            self.authority,
            http::encode(tenant)
        ))?;
        let r = http::send(
            &self.tls,
            "POST",
            &url,
            &[("accept", "application/json")],
            Some(("application/x-www-form-urlencoded", body.into_bytes())),
            TOKEN_TIMEOUT,
        )
        .await
        .map_err(|e| format!("Azure login for {client} in tenant {tenant}: {e}"))?;
        token_answer(
            &format!("Azure login for {client} in tenant {tenant}"),
            r.status,
            &r.body,
        )
    }
}

/// The token and its lifetime from a token endpoint's answer (Entra ID's
/// `expires_in` is a number, IMDS's a string); an error quotes the
/// endpoint's `error` and `error_description`, never a token.
fn token_answer(what: &str, status: u16, body: &[u8]) -> Result<(String, Duration), String> {
    let v: serde_json::Value = serde_json::from_slice(body).map_err(|_| {
        format!(
            "{what}: HTTP {status} with an answer that is not JSON: {}",
            String::from_utf8_lossy(&body[..body.len().min(200)])
        )
    })?;
    if !(200..300).contains(&status) {
        return Err(format!(
            "{what}: HTTP {status}: {}: {}",
            v["error"].as_str().unwrap_or("error"),
            v["error_description"].as_str().unwrap_or("")
        ));
    }
    let token = v["access_token"]
        .as_str()
        .filter(|t| !t.is_empty())
        .ok_or_else(|| format!("{what}: no access_token in the answer"))?;
    let secs = match &v["expires_in"] {
        serde_json::Value::Number(n) => n.as_u64(),
        serde_json::Value::String(s) => s.parse().ok(),
        _ => None,
    }
    .ok_or_else(|| format!("{what}: no expires_in in the answer"))?;
    Ok((token.to_string(), Duration::from_secs(secs)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(v: &[(&str, &str)]) -> EnvVars {
        EnvVars(
            v.iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        )
    }

    #[test]
    fn the_chain_takes_the_first_source_given() {
        let given = ClientSecret {
            tenant_id: "t".into(),
            client_id: "c".into(),
            secret: "s3cret".into(),
        };
        let all = env(&[
            ("ARM_CLIENT_ID", "arm-c"),
            ("ARM_CLIENT_SECRET", "arm-s"),
            ("ARM_TENANT_ID", "arm-t"),
            ("AZURE_CLIENT_ID", "az-c"),
            ("AZURE_CLIENT_SECRET", "az-s"),
            ("AZURE_TENANT_ID", "az-t"),
            ("AZURE_FEDERATED_TOKEN_FILE", "/var/run/token"),
        ]);
        let choice = Choice {
            client_secret: Some(given.clone()),
            ..Choice::default()
        };
        assert_eq!(
            choose(&choice, &all).unwrap().0,
            Source::ClientSecret(given)
        );
        let (s, authority) = choose(&Choice::default(), &all).unwrap();
        assert_eq!(authority, DEFAULT_AUTHORITY);
        let Source::ClientSecret(c) = s else {
            panic!("{s:?}")
        };
        assert_eq!(
            (c.client_id.as_str(), c.tenant_id.as_str()),
            ("arm-c", "arm-t")
        );
        let azure = env(&all.0[3..]
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect::<Vec<_>>());
        let Source::ClientSecret(c) = choose(&Choice::default(), &azure).unwrap().0 else {
            panic!()
        };
        assert_eq!(c.secret, "az-s");
        let federated = env(&[
            ("AZURE_CLIENT_ID", "az-c"),
            ("AZURE_TENANT_ID", "az-t"),
            ("AZURE_FEDERATED_TOKEN_FILE", "/var/run/token"),
        ]);
        assert_eq!(
            choose(&Choice::default(), &federated).unwrap().0,
            Source::WorkloadIdentity {
                tenant_id: "az-t".into(),
                client_id: "az-c".into(),
                token_file: "/var/run/token".into()
            }
        );
        let oidc = env(&[
            ("ARM_CLIENT_ID", "arm-c"),
            ("ARM_TENANT_ID", "arm-t"),
            ("ARM_OIDC_TOKEN_FILE_PATH", "/t"),
        ]);
        assert!(matches!(
            choose(&Choice::default(), &oidc).unwrap().0,
            Source::WorkloadIdentity { .. }
        ));
        let msi = env(&[
            ("AZURE_CLIENT_ID", "uai"),
            ("AZURE_POD_IDENTITY_AUTHORITY_HOST", "https://127.0.0.1:1/"),
        ]);
        assert_eq!(
            choose(&Choice::default(), &msi).unwrap().0,
            Source::ManagedIdentity {
                client_id: Some("uai".into()),
                endpoint: "https://127.0.0.1:1".into()
            }
        );
        assert_eq!(
            choose(&Choice::default(), &EnvVars::default()).unwrap().0,
            Source::ManagedIdentity {
                client_id: None,
                endpoint: DEFAULT_IMDS.into()
            }
        );
        // Managed identity asked for outright wins over a secret in the environment.
        let choice = Choice {
            use_managed_identity: true,
            ..Choice::default()
        };
        assert!(matches!(
            choose(&choice, &all).unwrap().0,
            Source::ManagedIdentity { .. }
        ));
    }

    #[test]
    fn half_given_credentials_are_refused_by_name_without_the_secret() {
        let e = choose(&Choice::default(), &env(&[("ARM_CLIENT_SECRET", "s3cret")])).unwrap_err();
        assert!(e.contains("ARM_TENANT_ID") && !e.contains("s3cret"), "{e}");
        let e = choose(
            &Choice::default(),
            &env(&[("AZURE_FEDERATED_TOKEN_FILE", "/t")]),
        )
        .unwrap_err();
        assert!(
            e.contains("AZURE_FEDERATED_TOKEN_FILE") && e.contains("tenant"),
            "{e}"
        );
        let e = choose(
            &Choice::default(),
            &env(&[("AZURE_AUTHORITY_HOST", "login")]),
        )
        .unwrap_err();
        assert!(e.contains("authority host"), "{e}");
    }

    #[test]
    fn the_secret_is_never_in_debug_or_describe() {
        let s = Source::ClientSecret(ClientSecret {
            tenant_id: "t".into(),
            client_id: "c".into(),
            secret: "s3cret".into(),
        });
        assert!(!format!("{s:?}").contains("s3cret"));
        assert!(!s.describe().contains("s3cret"));
        let c = ClientSecret {
            tenant_id: "t".into(),
            client_id: "c".into(),
            secret: "s3cret".into(),
        };
        assert!(!format!("{c:?}").contains("s3cret"));
    }

    #[test]
    fn token_answers_of_both_shapes_read() {
        let (t, d) =
            token_answer("x", 200, br#"{"access_token":"abc","expires_in":3599}"#).unwrap();
        assert_eq!((t.as_str(), d.as_secs()), ("abc", 3599));
        let (_, d) =
            token_answer("x", 200, br#"{"access_token":"abc","expires_in":"86400"}"#).unwrap();
        assert_eq!(d.as_secs(), 86400);
        let e = token_answer(
            "login",
            401,
            br#"{"error":"invalid_client","error_description":"AADSTS7000215: Invalid client secret provided."}"#,
        )
        .unwrap_err();
        assert!(
            e.contains("invalid_client") && e.contains("AADSTS7000215") && e.contains("401"),
            "{e}"
        );
    }
}
