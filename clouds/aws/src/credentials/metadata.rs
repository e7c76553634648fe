//! Credentials from the machine the driver runs on: the EC2 instance's role
//! through the instance metadata service (IMDSv2 only: a session token is
//! asked for with a `PUT` first, which a request forwarded from outside the
//! instance cannot do), and a container's role through the ECS/EKS container
//! credential endpoint.

use super::{parse_time, Context, EnvVars, Expiring, Source};
use crate::api;
use crate::sigv4::Credentials;
use serde::Deserialize;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// The instance metadata service, over IPv4 and over IPv6 (Nitro instances).
pub const IMDS_ENDPOINT: &str = "http://169.254.169.254";
pub const IMDS_ENDPOINT_IPV6: &str = "http://[fd00:ec2::254]";
/// How long each request to the instance metadata service may take: short,
/// since off EC2 nothing answers and the chain ends there.
pub const IMDS_TIMEOUT: Duration = Duration::from_secs(1);
/// How long the session token asked for lasts (seconds; it is asked anew at
/// each fetch of credentials, which is rare).
const IMDS_TOKEN_TTL: &str = "21600";
/// The ECS container credential endpoint of a relative URI.
pub const CONTAINER_HOST: &str = "http://169.254.170.2";
pub const CONTAINER_TIMEOUT: Duration = Duration::from_secs(5);

/// The credentials JSON that both endpoints answer with.
#[derive(Deserialize)]
#[serde(rename_all = "PascalCase")]
struct CredentialsJson {
    #[serde(default)]
    code: Option<String>,
    #[serde(default)]
    message: Option<String>,
    access_key_id: Option<String>,
    secret_access_key: Option<String>,
    token: Option<String>,
    expiration: Option<String>,
}

fn credentials_of(what: &str, body: &str) -> Result<Expiring, String> {
    // Not echoed: the body holds the secret when it is almost right.
    let j: CredentialsJson = serde_json::from_str(body)
        .map_err(|e| format!("{what}: the answer is not the credentials JSON ({e})"))?;
    if let Some(code) = j.code.as_deref().filter(|c| *c != "Success") {
        return Err(format!("{what}: {code}: {}", j.message.unwrap_or_default()));
    }
    let (Some(id), Some(secret)) = (j.access_key_id, j.secret_access_key) else {
        return Err(format!(
            "{what}: no AccessKeyId and SecretAccessKey in the answer"
        ));
    };
    let expires = match j.expiration {
        Some(e) => Some(
            parse_time(&e).ok_or_else(|| format!("{what}: the Expiration {e:?} is not a time"))?,
        ),
        None => None,
    };
    Ok(Expiring {
        credentials: Credentials {
            access_key_id: id,
            secret_access_key: secret,
            session_token: j.token.filter(|t| !t.is_empty()),
        },
        expires,
    })
}

/// The EC2 instance's role.
pub struct InstanceSource {
    endpoint: String,
    timeout: Duration,
    tls: Arc<rustls::ClientConfig>,
}

impl InstanceSource {
    /// The service at `AWS_EC2_METADATA_SERVICE_ENDPOINT` (else IPv4's, or
    /// IPv6's with `AWS_EC2_METADATA_SERVICE_ENDPOINT_MODE=IPv6`), with
    /// `AWS_METADATA_SERVICE_TIMEOUT` seconds per request (else 1 s); None
    /// when `AWS_EC2_METADATA_DISABLED=true`.
    pub fn from_env(env: &EnvVars, ctx: &Context) -> Option<InstanceSource> {
        if env
            .get("AWS_EC2_METADATA_DISABLED")
            .is_some_and(|v| v.eq_ignore_ascii_case("true"))
        {
            return None;
        }
        let endpoint = match env.get("AWS_EC2_METADATA_SERVICE_ENDPOINT") {
            Some(e) => e.trim_end_matches('/').to_string(),
            None => match env.get("AWS_EC2_METADATA_SERVICE_ENDPOINT_MODE") {
                Some(m) if m.eq_ignore_ascii_case("ipv6") => IMDS_ENDPOINT_IPV6.into(),
                _ => IMDS_ENDPOINT.into(),
            },
        };
        let timeout = env
            .get("AWS_METADATA_SERVICE_TIMEOUT")
            .and_then(|t| t.parse::<f64>().ok())
            .filter(|t| *t > 0.0 && *t <= 60.0)
            .map(Duration::from_secs_f64)
            .unwrap_or(IMDS_TIMEOUT);
        Some(InstanceSource {
            endpoint,
            timeout,
            tls: ctx.tls.clone(),
        })
    }

    async fn call(
        &self,
        method: &str,
        path: &str,
        header: (&str, &str),
    ) -> Result<(u16, String), String> {
        let url = format!("{}{path}", self.endpoint);
        api::fetch(&self.tls, method, &url, &[header], self.timeout).await
    }
}

#[async_trait::async_trait]
impl Source for InstanceSource {
    async fn fetch(&self) -> Result<Expiring, String> {
        let (status, token) = self
            .call(
                "PUT",
                "/latest/api/token",
                ("x-aws-ec2-metadata-token-ttl-seconds", IMDS_TOKEN_TTL),
            )
            .await?;
        if status != 200 {
            return Err(format!(
                "the instance metadata service refused a session token (HTTP {status}); lbscale uses IMDSv2 only"
            ));
        }
        let auth = ("x-aws-ec2-metadata-token", token.trim());
        let base = "/latest/meta-data/iam/security-credentials/";
        let (status, roles) = self.call("GET", base, auth).await?;
        let role = roles.lines().map(str::trim).find(|l| !l.is_empty());
        let role = match (status, role) {
            (200, Some(r)) => r.to_string(),
            (200 | 404, _) => {
                return Err("the instance has no role: attach an instance profile to it".into())
            }
            (s, _) => return Err(format!("GET {base}: HTTP {s}")),
        };
        let (status, body) = self.call("GET", &format!("{base}{role}"), auth).await?;
        if status != 200 {
            return Err(format!("GET {base}{role}: HTTP {status}"));
        }
        credentials_of(&format!("the instance role {role}"), &body)
    }
    fn describe(&self) -> String {
        format!(
            "the EC2 instance's role (instance metadata at {})",
            self.endpoint
        )
    }
}

/// A container's role (ECS tasks, EKS Pod Identity).
pub struct ContainerSource {
    url: String,
    token: Option<String>,
    token_file: Option<PathBuf>,
    tls: Arc<rustls::ClientConfig>,
}

impl ContainerSource {
    /// From `AWS_CONTAINER_CREDENTIALS_RELATIVE_URI` (on ECS's endpoint) or
    /// `AWS_CONTAINER_CREDENTIALS_FULL_URI` (HTTPS, or HTTP to a loopback or
    /// ECS/EKS address only), with `AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE`
    /// or `AWS_CONTAINER_AUTHORIZATION_TOKEN` as the `Authorization` header.
    pub fn from_env(env: &EnvVars, ctx: &Context) -> Result<Option<ContainerSource>, String> {
        let url = if let Some(rel) = env.get("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI") {
            let rel = if rel.starts_with('/') {
                rel.to_string()
            } else {
                format!("/{rel}")
            };
            format!("{CONTAINER_HOST}{rel}")
        } else if let Some(full) = env.get("AWS_CONTAINER_CREDENTIALS_FULL_URI") {
            check_full_uri(full)?;
            full.to_string()
        } else {
            return Ok(None);
        };
        Ok(Some(ContainerSource {
            url,
            token: env.get("AWS_CONTAINER_AUTHORIZATION_TOKEN").map(Into::into),
            token_file: env
                .get("AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE")
                .map(|f| env.path(f)),
            tls: ctx.tls.clone(),
        }))
    }
}

/// Plain HTTP only to where nobody else can answer: loopback, or the
/// addresses of ECS's and EKS's credential agents.
fn check_full_uri(url: &str) -> Result<(), String> {
    let (endpoint, _) = api::Endpoint::parse_url(url)
        .map_err(|e| format!("AWS_CONTAINER_CREDENTIALS_FULL_URI: {e}"))?;
    if endpoint.tls {
        return Ok(());
    }
    let host = endpoint.host.as_str();
    let allowed = host == "localhost"
        || matches!(host, "169.254.170.2" | "169.254.170.23" | "fd00:ec2::23")
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback());
    if allowed {
        Ok(())
    } else {
        Err(format!(
            "AWS_CONTAINER_CREDENTIALS_FULL_URI: plain http only to a loopback address or the ECS/EKS agents' (169.254.170.2, 169.254.170.23, fd00:ec2::23); use https for {host}"
        ))
    }
}

#[async_trait::async_trait]
impl Source for ContainerSource {
    async fn fetch(&self) -> Result<Expiring, String> {
        let token = match &self.token_file {
            Some(f) => Some(tokio::fs::read_to_string(f).await.map_err(|e| {
                format!(
                    "cannot read AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE {}: {e}",
                    f.display()
                )
            })?),
            None => self.token.clone(),
        };
        let token = token.map(|t| t.trim().to_string());
        if token.as_deref().is_some_and(|t| t.contains(['\r', '\n'])) {
            return Err("the container authorization token has a line break".into());
        }
        let headers: Vec<(&str, &str)> = token
            .as_deref()
            .map(|t| vec![("authorization", t)])
            .unwrap_or_default();
        let (status, body) =
            api::fetch(&self.tls, "GET", &self.url, &headers, CONTAINER_TIMEOUT).await?;
        if status != 200 {
            return Err(format!("GET {}: HTTP {status}", self.url));
        }
        credentials_of(&format!("the container endpoint {}", self.url), &body)
    }
    fn describe(&self) -> String {
        format!("the container's role (credentials at {})", self.url)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_local_agents_are_asked_in_plain_http() {
        for ok in [
            "https://creds.example/x",
            "http://127.0.0.1:8080/creds",
            "http://localhost/creds",
            "http://[::1]:9/c",
            "http://169.254.170.23/v1/credentials",
        ] {
            assert_eq!(check_full_uri(ok), Ok(()), "{ok}");
        }
        let e = check_full_uri("http://10.0.0.1/creds").unwrap_err();
        assert!(e.contains("use https for 10.0.0.1"), "{e}");
    }

    #[test]
    fn answers_give_credentials_or_say_why_not() {
        let ok = r#"{"Code":"Success","AccessKeyId":"ASIA1","SecretAccessKey":"sec","Token":"tok","Expiration":"2026-12-02T01:51:56Z"}"#;
        let e = credentials_of("x", ok).unwrap();
        assert_eq!(e.credentials.session_token.as_deref(), Some("tok"));
        let e = credentials_of(
            "x",
            r#"{"Code":"AssumeRoleUnauthorizedAccess","Message":"no"}"#,
        )
        .unwrap_err();
        assert!(e.contains("AssumeRoleUnauthorizedAccess"), "{e}");
        let e = credentials_of("x", r#"{"AccessKeyId":"A","SecretAccessKey":"sec""#).unwrap_err();
        assert!(!e.contains("sec\""), "{e}");
    }
}
