//! Credentials from STS: `AssumeRole` (signed with the credentials under the
//! role) and `AssumeRoleWithWebIdentity` (unsigned: the token file is the
//! proof, read again at each fetch because it is rotated).

use super::{parse_time, AssumeRole, Context, EnvVars, Expiring, SharedCredentials, Source};
use crate::api::{AwsApi, Service};
use crate::sigv4::Credentials;
use crate::xml;
use std::path::PathBuf;
use std::sync::Arc;

const STS_VERSION: &str = "2011-06-15";

/// An STS client in the driver's region and endpoint, signing with `creds`
/// (None: for unsigned calls only).
pub fn client(ctx: &Context, creds: Option<Arc<SharedCredentials>>) -> AwsApi {
    let creds = creds.unwrap_or_else(|| Arc::new(SharedCredentials::new(Box::new(Unsigned))));
    AwsApi::new(
        ctx.region.clone(),
        ctx.endpoint.clone(),
        creds,
        ctx.tls.clone(),
    )
}

/// The credentials of a client that only makes unsigned calls.
struct Unsigned;

#[async_trait::async_trait]
impl Source for Unsigned {
    async fn fetch(&self) -> Result<Expiring, String> {
        Err("this STS client has no credentials (it only makes unsigned calls)".into())
    }
    fn describe(&self) -> String {
        "no credentials".into()
    }
}

/// A role assumed with `AssumeRole` over other credentials.
pub struct AssumeRoleSource {
    role: AssumeRole,
    base: Arc<SharedCredentials>,
    sts: AwsApi,
    origin: String,
}

impl AssumeRoleSource {
    /// `origin` says where the role was set (the provider, a profile).
    pub fn new(
        role: AssumeRole,
        base: Arc<SharedCredentials>,
        ctx: &Context,
        origin: &str,
    ) -> AssumeRoleSource {
        AssumeRoleSource {
            sts: client(ctx, Some(base.clone())),
            role,
            base,
            origin: origin.into(),
        }
    }
}

#[async_trait::async_trait]
impl Source for AssumeRoleSource {
    async fn fetch(&self) -> Result<Expiring, String> {
        let mut params = vec![
            ("RoleArn".to_string(), self.role.role_arn.clone()),
            (
                "RoleSessionName".to_string(),
                self.role.session_name_or_default(),
            ),
        ];
        if let Some(id) = &self.role.external_id {
            params.push(("ExternalId".into(), id.clone()));
        }
        if let Some(d) = self.role.duration {
            params.push(("DurationSeconds".into(), d.as_secs().to_string()));
        }
        let body = self
            .sts
            .query(Service::Sts, "AssumeRole", STS_VERSION, &params)
            .await
            .map_err(|e| e.to_string())?;
        credentials_of("sts AssumeRole", &body)
    }
    fn describe(&self) -> String {
        format!(
            "role {} ({}) assumed with {}",
            self.role.role_arn,
            self.origin,
            self.base.describe()
        )
    }
}

/// A role assumed with a web identity token (EKS's service accounts, CI
/// systems' OIDC tokens).
pub struct WebIdentitySource {
    pub role: AssumeRole,
    pub token_file: PathBuf,
    pub sts: AwsApi,
    pub origin: String,
}

impl WebIdentitySource {
    /// From `AWS_WEB_IDENTITY_TOKEN_FILE`, `AWS_ROLE_ARN` and
    /// `AWS_ROLE_SESSION_NAME`, when the first two are set.
    pub fn from_env(env: &EnvVars, ctx: &Context) -> Result<Option<WebIdentitySource>, String> {
        let (file, arn) = match (
            env.get("AWS_WEB_IDENTITY_TOKEN_FILE"),
            env.get("AWS_ROLE_ARN"),
        ) {
            (Some(f), Some(a)) => (f, a),
            (None, _) => return Ok(None),
            (Some(_), None) => {
                return Err(
                    "AWS_WEB_IDENTITY_TOKEN_FILE is set without AWS_ROLE_ARN, the role to assume with it"
                        .into(),
                )
            }
        };
        let role = AssumeRole {
            session_name: env.get("AWS_ROLE_SESSION_NAME").map(Into::into),
            ..AssumeRole::new(arn)
        };
        role.check()
            .map_err(|(field, why)| format!("web identity ({field}): {why}"))?;
        Ok(Some(WebIdentitySource {
            role,
            token_file: env.path(file),
            sts: client(ctx, None),
            origin: "the environment (AWS_WEB_IDENTITY_TOKEN_FILE)".into(),
        }))
    }
}

#[async_trait::async_trait]
impl Source for WebIdentitySource {
    async fn fetch(&self) -> Result<Expiring, String> {
        let token = tokio::fs::read_to_string(&self.token_file)
            .await
            .map_err(|e| {
                format!(
                    "cannot read the web identity token file {}: {e}",
                    self.token_file.display()
                )
            })?;
        let mut params = vec![
            ("RoleArn".to_string(), self.role.role_arn.clone()),
            (
                "RoleSessionName".to_string(),
                self.role.session_name_or_default(),
            ),
            ("WebIdentityToken".to_string(), token.trim().to_string()),
        ];
        if let Some(d) = self.role.duration {
            params.push(("DurationSeconds".into(), d.as_secs().to_string()));
        }
        let body = self
            .sts
            .query_unsigned(
                Service::Sts,
                "AssumeRoleWithWebIdentity",
                STS_VERSION,
                &params,
            )
            .await
            .map_err(|e| e.to_string().replace(token.trim(), "<redacted>"))?;
        credentials_of("sts AssumeRoleWithWebIdentity", &body)
    }
    fn describe(&self) -> String {
        format!(
            "role {} with the web identity token in {} ({})",
            self.role.role_arn,
            self.token_file.display(),
            self.origin
        )
    }
}

/// The `<Credentials>` of an STS answer.
fn credentials_of(what: &str, body: &str) -> Result<Expiring, String> {
    let doc = xml::parse(what, body).map_err(|e| e.to_string())?;
    let creds = xml::find(doc.root(), "Credentials")
        .ok_or_else(|| format!("AWS {what}: no Credentials in the answer"))?;
    let field = |name: &str| {
        xml::child_text(creds, name)
            .filter(|v| !v.is_empty())
            .ok_or_else(|| format!("AWS {what}: no {name} in the answer's Credentials"))
    };
    let expiration = field("Expiration")?;
    Ok(Expiring {
        credentials: Credentials {
            access_key_id: field("AccessKeyId")?,
            secret_access_key: field("SecretAccessKey")?,
            session_token: Some(field("SessionToken")?),
        },
        expires: Some(
            parse_time(&expiration).ok_or_else(|| {
                format!("AWS {what}: the Expiration {expiration:?} is not a time")
            })?,
        ),
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn an_answer_gives_its_credentials_and_expiry() {
        let body = r#"<AssumeRoleResponse xmlns="https://sts.amazonaws.com/doc/2011-06-15/"><AssumeRoleResult><Credentials><AccessKeyId>ASIAEXAMPLE</AccessKeyId><SecretAccessKey>sec</SecretAccessKey><SessionToken>tok</SessionToken><Expiration>2026-12-02T01:51:56.826893Z</Expiration></Credentials></AssumeRoleResult></AssumeRoleResponse>"#;
        let e = super::credentials_of("sts AssumeRole", body).unwrap();
        assert_eq!(e.credentials.access_key_id, "ASIAEXAMPLE");
        assert_eq!(e.credentials.session_token.as_deref(), Some("tok"));
        assert!(e.expires.is_some());
        let bad = body.replace("<SessionToken>tok</SessionToken>", "");
        let m = super::credentials_of("sts AssumeRole", &bad).unwrap_err();
        assert!(m.contains("SessionToken") && !m.contains("sec"), "{m}");
    }
}
