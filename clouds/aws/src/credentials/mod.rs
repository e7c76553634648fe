//! Where the driver's AWS credentials come from, found the way AWS's own SDKs
//! find them, and kept fresh.
//!
//! The chain, in the SDKs' order, first that applies wins:
//! 1. the environment's `AWS_ACCESS_KEY_ID` and `AWS_SECRET_ACCESS_KEY` (and
//!    `AWS_SESSION_TOKEN`);
//! 2. the profile (`AWS_PROFILE`, else `default`) of the shared config and
//!    credentials files ([`profile`]), with its static keys or its role to
//!    assume (`role_arn` over `source_profile` or `credential_source`);
//! 3. web identity: `AWS_WEB_IDENTITY_TOKEN_FILE` and `AWS_ROLE_ARN`, through
//!    STS ([`sts`]);
//! 4. the container credential endpoint (`AWS_CONTAINER_CREDENTIALS_*`,
//!    [`metadata`]);
//! 5. the EC2 instance's role through IMDSv2 ([`metadata`]).
//!
//! Credentials given in the provider (`credentials`, `profile`) come before
//! the chain, and the provider's `assume_role` is assumed over whatever the
//! chain found. A [`SharedCredentials`] holds the current credentials for
//! every call and fetches new ones before the old expire.

pub mod metadata;
pub mod profile;
pub mod sts;

use crate::api::Endpoint;
use crate::sigv4::Credentials;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// How long before their expiry temporary credentials are replaced (or half
/// their lifetime when that is shorter).
pub const REFRESH_BEFORE_EXPIRY: Duration = Duration::from_secs(300);

/// Credentials with the time they stop working (None: they do not expire).
#[derive(Debug, Clone)]
pub struct Expiring {
    pub credentials: Credentials,
    pub expires: Option<SystemTime>,
}

/// One way of getting credentials. `fetch` has its own deadline.
#[async_trait::async_trait]
pub trait Source: Send + Sync {
    async fn fetch(&self) -> Result<Expiring, String>;
    /// What the source is, for errors and logs (never a secret).
    fn describe(&self) -> String;
}

/// Keys that do not change: the environment's, a profile's, the provider's.
pub struct Fixed {
    pub credentials: Credentials,
    pub origin: String,
}

#[async_trait::async_trait]
impl Source for Fixed {
    async fn fetch(&self) -> Result<Expiring, String> {
        Ok(Expiring {
            credentials: self.credentials.clone(),
            expires: None,
        })
    }
    fn describe(&self) -> String {
        self.origin.clone()
    }
}

/// The credentials of every call of a driver: fetched from their source at
/// the first call, kept while they are fresh, fetched again before they
/// expire. Callers wait for one fetch at a time.
pub struct SharedCredentials {
    source: Box<dyn Source>,
    current: tokio::sync::Mutex<Option<Held>>,
}

struct Held {
    creds: Expiring,
    fetched: SystemTime,
}

impl SharedCredentials {
    pub fn new(source: Box<dyn Source>) -> SharedCredentials {
        SharedCredentials {
            source,
            current: tokio::sync::Mutex::new(None),
        }
    }

    /// Keys that never change.
    pub fn fixed(credentials: Credentials, origin: &str) -> SharedCredentials {
        SharedCredentials::new(Box::new(Fixed {
            credentials,
            origin: origin.into(),
        }))
    }

    pub fn describe(&self) -> String {
        self.source.describe()
    }

    /// The current credentials, fetched anew when they are near their expiry.
    /// A failed fetch while the old ones still work keeps the old ones (and
    /// tries again at the next call).
    pub async fn get(&self) -> Result<Credentials, String> {
        let mut current = self.current.lock().await;
        let now = SystemTime::now();
        if let Some(held) = current.as_ref() {
            if fresh(&held.creds, held.fetched, now) {
                return Ok(held.creds.credentials.clone());
            }
        }
        match self.source.fetch().await {
            Ok(creds) => {
                tracing::debug!(
                    source = %self.source.describe(),
                    key = %creds.credentials.access_key_id,
                    expires = ?creds.expires.map(unix_seconds),
                    "fetched AWS credentials"
                );
                let c = creds.credentials.clone();
                *current = Some(Held {
                    creds,
                    fetched: now,
                });
                Ok(c)
            }
            Err(e) => match current.as_ref() {
                Some(held) if held.creds.expires.is_some_and(|t| now < t) => {
                    tracing::warn!(source = %self.source.describe(), error = %e, "could not refresh AWS credentials; using the current ones until they expire");
                    Ok(held.creds.credentials.clone())
                }
                _ => Err(format!(
                    "no AWS credentials from {}: {e}",
                    self.source.describe()
                )),
            },
        }
    }

    /// Forgets the current credentials (AWS said they expired): the next call
    /// fetches new ones.
    pub async fn invalidate(&self) {
        *self.current.lock().await = None;
    }
}

/// Whether credentials fetched at `fetched` are still to be used at `now`.
fn fresh(creds: &Expiring, fetched: SystemTime, now: SystemTime) -> bool {
    let Some(expires) = creds.expires else {
        return true;
    };
    let lifetime = expires.duration_since(fetched).unwrap_or_default();
    let margin = REFRESH_BEFORE_EXPIRY.min(lifetime / 2);
    now + margin < expires
}

fn unix_seconds(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// A role to assume: the provider's `assume_role`, or a profile's
/// `role_arn`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AssumeRole {
    pub role_arn: String,
    pub external_id: Option<String>,
    /// Default: `lbscale-<unix time>`.
    pub session_name: Option<String>,
    /// How long the role's credentials last. Default: STS's (one hour).
    pub duration: Option<Duration>,
}

impl AssumeRole {
    pub fn new(role_arn: &str) -> AssumeRole {
        AssumeRole {
            role_arn: role_arn.into(),
            external_id: None,
            session_name: None,
            duration: None,
        }
    }

    /// The field that is wrong and what it allows, as STS would refuse it.
    pub fn check(&self) -> Result<(), (&'static str, String)> {
        check_role_arn(&self.role_arn).map_err(|e| ("role_arn", e))?;
        if let Some(id) = &self.external_id {
            let ok = (2..=1224).contains(&id.len())
                && id
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || "+=,.@:/-_".contains(c));
            if !ok {
                return Err((
                    "external_id",
                    "external_id must be 2 to 1224 letters, digits or any of +=,.@:/-_ (the value is not shown)".into(),
                ));
            }
        }
        if let Some(name) = &self.session_name {
            check_session_name(name).map_err(|e| ("session_name", e))?;
        }
        if let Some(d) = self.duration {
            if !(900..=43_200).contains(&d.as_secs()) {
                return Err((
                    "duration",
                    format!("duration must be between 15m and 12h, got {}s", d.as_secs()),
                ));
            }
        }
        Ok(())
    }

    pub(crate) fn session_name_or_default(&self) -> String {
        self.session_name
            .clone()
            .unwrap_or_else(default_session_name)
    }
}

/// `arn:PARTITION:iam::ACCOUNT:role/NAME`.
pub fn check_role_arn(arn: &str) -> Result<(), String> {
    let parts: Vec<&str> = arn.splitn(6, ':').collect();
    let ok = parts.len() == 6
        && parts[0] == "arn"
        && !parts[1].is_empty()
        && parts[2] == "iam"
        && parts[3].is_empty()
        && parts[4].len() == 12
        && parts[4].bytes().all(|b| b.is_ascii_digit())
        && parts[5]
            .strip_prefix("role/")
            .is_some_and(|n| !n.is_empty());
    if ok {
        Ok(())
    } else {
        Err(format!(
            "role_arn must be a role's ARN, arn:aws:iam::ACCOUNT:role/NAME (ACCOUNT of 12 digits), got {arn:?}"
        ))
    }
}

/// 2 to 64 of letters, digits and `+=,.@-_`.
pub fn check_session_name(name: &str) -> Result<(), String> {
    let ok = (2..=64).contains(&name.len())
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "+=,.@-_".contains(c));
    if ok {
        Ok(())
    } else {
        Err(format!(
            "session_name must be 2 to 64 letters, digits or any of +=,.@-_, got {name:?}"
        ))
    }
}

fn default_session_name() -> String {
    format!("lbscale-{}", unix_seconds(SystemTime::now()))
}

/// The environment variables the chain reads, taken once (tests give their
/// own instead of changing the process's).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EnvVars(pub BTreeMap<String, String>);

impl EnvVars {
    /// This process's `AWS_*` variables and its home directory.
    pub fn from_process() -> EnvVars {
        EnvVars(
            std::env::vars()
                .filter(|(k, v)| {
                    !v.is_empty() && (k.starts_with("AWS_") || k == "HOME" || k == "USERPROFILE")
                })
                .collect(),
        )
    }

    pub fn of(pairs: &[(&str, &str)]) -> EnvVars {
        EnvVars(
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        )
    }

    pub fn get(&self, k: &str) -> Option<&str> {
        self.0.get(k).map(String::as_str).filter(|v| !v.is_empty())
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// `~/` expanded with the home directory.
    fn path(&self, p: &str) -> PathBuf {
        match (p.strip_prefix("~/"), self.home()) {
            (Some(rest), Some(home)) => home.join(rest),
            _ => PathBuf::from(p),
        }
    }

    fn home(&self) -> Option<PathBuf> {
        self.get("HOME")
            .or(self.get("USERPROFILE"))
            .map(PathBuf::from)
    }
}

/// What the chain needs besides the environment: where STS is and which
/// certificate authorities to trust.
#[derive(Clone)]
pub struct Context {
    pub region: String,
    pub endpoint: Option<Endpoint>,
    pub tls: Arc<rustls::ClientConfig>,
}

/// What the provider (or the daemon's environment) says about credentials.
#[derive(Debug, Clone, Default)]
pub struct Choice {
    /// Keys given outright (the provider's `credentials`).
    pub credentials: Option<Credentials>,
    /// A profile given outright (the provider's `profile`): used instead of
    /// the chain.
    pub profile: Option<String>,
    /// A role assumed over what the rest found.
    pub assume_role: Option<AssumeRole>,
}

/// The credentials of a driver: `choice` over the chain in `env`. An error
/// says what is wrong or missing (never a secret); credentials that need the
/// network are fetched at the first call.
pub fn resolve(
    choice: &Choice,
    env: &EnvVars,
    ctx: &Context,
) -> Result<Arc<SharedCredentials>, String> {
    let base = match (&choice.credentials, &choice.profile) {
        (Some(c), _) => Arc::new(SharedCredentials::fixed(
            c.clone(),
            "the provider's `credentials`",
        )),
        (None, Some(name)) => {
            let profiles = profile::Profiles::load(env)?;
            let plan = profiles
                .plan(name)?
                .ok_or_else(|| profiles.no_credentials(name))?;
            Arc::new(SharedCredentials::new(from_plan(plan, env, ctx)?))
        }
        (None, None) => Arc::new(SharedCredentials::new(chain(env, ctx)?)),
    };
    Ok(match &choice.assume_role {
        None => base,
        Some(role) => {
            role.check()
                .map_err(|(field, why)| format!("assume_role {field}: {why}"))?;
            Arc::new(SharedCredentials::new(Box::new(
                sts::AssumeRoleSource::new(role.clone(), base, ctx, "the provider's assume_role"),
            )))
        }
    })
}

/// The SDKs' default chain: the first source that `env` configures.
fn chain(env: &EnvVars, ctx: &Context) -> Result<Box<dyn Source>, String> {
    if let Some(c) = from_environment(env)? {
        return Ok(Box::new(Fixed {
            credentials: c,
            origin: "the environment (AWS_ACCESS_KEY_ID)".into(),
        }));
    }
    let profiles = profile::Profiles::load(env)?;
    let (name, named) = match env.get("AWS_PROFILE") {
        Some(p) => (p.to_string(), true),
        None => ("default".to_string(), false),
    };
    match profiles.plan(&name)? {
        Some(plan) => return from_plan(plan, env, ctx),
        None if named => return Err(profiles.no_credentials(&name)),
        None => {}
    }
    if let Some(source) = sts::WebIdentitySource::from_env(env, ctx)? {
        return Ok(Box::new(source));
    }
    if let Some(source) = metadata::ContainerSource::from_env(env, ctx)? {
        return Ok(Box::new(source));
    }
    if let Some(source) = metadata::InstanceSource::from_env(env, ctx) {
        return Ok(Box::new(source));
    }
    Err(format!(
        "no AWS credentials: none in the environment (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY), no profile {name:?} with credentials in {}, no web identity (AWS_WEB_IDENTITY_TOKEN_FILE and AWS_ROLE_ARN), no container credentials (AWS_CONTAINER_CREDENTIALS_RELATIVE_URI or _FULL_URI), and the instance metadata service is disabled (AWS_EC2_METADATA_DISABLED); or set `credentials`, `profile` or `assume_role` in the provider's aws block",
        profiles.files()
    ))
}

/// The environment's static keys, if it has them.
pub fn from_environment(env: &EnvVars) -> Result<Option<Credentials>, String> {
    match (
        env.get("AWS_ACCESS_KEY_ID"),
        env.get("AWS_SECRET_ACCESS_KEY"),
    ) {
        (Some(id), Some(secret)) => Ok(Some(Credentials {
            access_key_id: id.into(),
            secret_access_key: secret.into(),
            session_token: env.get("AWS_SESSION_TOKEN").map(Into::into),
        })),
        (None, None) => Ok(None),
        (Some(_), None) => Err(
            "AWS_ACCESS_KEY_ID is set without AWS_SECRET_ACCESS_KEY: set both, or neither".into(),
        ),
        (None, Some(_)) => Err(
            "AWS_SECRET_ACCESS_KEY is set without AWS_ACCESS_KEY_ID: set both, or neither".into(),
        ),
    }
}

/// The source of what a profile says.
fn from_plan(plan: profile::Plan, env: &EnvVars, ctx: &Context) -> Result<Box<dyn Source>, String> {
    use profile::Plan;
    Ok(match plan {
        Plan::Static {
            credentials,
            profile,
        } => Box::new(Fixed {
            credentials,
            origin: format!("profile {profile:?}"),
        }),
        Plan::Environment => Box::new(Fixed {
            credentials: from_environment(env)?.ok_or(
                "credential_source = Environment, but AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY are not set",
            )?,
            origin: "the environment (credential_source = Environment)".into(),
        }),
        Plan::Container => Box::new(metadata::ContainerSource::from_env(env, ctx)?.ok_or(
            "credential_source = EcsContainer, but neither AWS_CONTAINER_CREDENTIALS_RELATIVE_URI nor AWS_CONTAINER_CREDENTIALS_FULL_URI is set",
        )?),
        Plan::Instance => Box::new(metadata::InstanceSource::from_env(env, ctx).ok_or(
            "credential_source = Ec2InstanceMetadata, but AWS_EC2_METADATA_DISABLED is true",
        )?),
        Plan::WebIdentity {
            role,
            token_file,
            profile,
        } => Box::new(sts::WebIdentitySource {
            role,
            token_file: env.path(&token_file),
            sts: sts::client(ctx, None),
            origin: format!("profile {profile:?} (web identity)"),
        }),
        Plan::Role {
            role,
            base,
            profile,
        } => {
            let base = Arc::new(SharedCredentials::new(from_plan(*base, env, ctx)?));
            Box::new(sts::AssumeRoleSource::new(
                role,
                base,
                ctx,
                &format!("profile {profile:?}"),
            ))
        }
    })
}

/// An ISO 8601 / RFC 3339 time as AWS writes expiries
/// (`2026-12-02T01:51:56Z`, with fractions of a second or an offset).
pub fn parse_time(s: &str) -> Option<SystemTime> {
    let s = s.trim();
    let b = s.as_bytes();
    if b.len() < 20 || b[4] != b'-' || b[7] != b'-' || !matches!(b[10], b'T' | b't' | b' ') {
        return None;
    }
    let num = |r: std::ops::Range<usize>| s.get(r)?.parse::<i64>().ok();
    let (y, mo, d) = (num(0..4)?, num(5..7)?, num(8..10)?);
    let (h, mi, sec) = (num(11..13)?, num(14..16)?, num(17..19)?);
    if b[13] != b':' || b[16] != b':' || !(1..=12).contains(&mo) || !(1..=31).contains(&d) {
        return None;
    }
    let mut rest = &s[19..];
    if let Some(frac) = rest.strip_prefix('.') {
        let digits = frac.bytes().take_while(u8::is_ascii_digit).count();
        rest = &frac[digits..];
    }
    let offset = match rest {
        "Z" | "z" => 0,
        _ => {
            let sign = match rest.as_bytes().first()? {
                b'+' => 1,
                b'-' => -1,
                _ => return None,
            };
            let (oh, om) = rest[1..].split_once(':')?;
            sign * (oh.parse::<i64>().ok()? * 3600 + om.parse::<i64>().ok()? * 60)
        }
    };
    let secs = days_from_civil(y, mo, d) * 86_400 + h * 3600 + mi * 60 + sec - offset;
    Some(UNIX_EPOCH + Duration::from_secs(u64::try_from(secs).ok()?))
}

/// Days since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's
/// algorithm, the inverse of `lbscale_core::utc`'s).
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expiries_parse_as_aws_writes_them() {
        let t = |s| parse_time(s).map(unix_seconds);
        assert_eq!(t("1970-01-01T00:00:00Z"), Some(0));
        assert_eq!(t("2015-08-30T12:36:00Z"), Some(1_440_938_160));
        assert_eq!(t("2026-12-02T01:51:56.826893Z"), Some(1_796_176_316));
        assert_eq!(t("2026-12-02T03:51:56+02:00"), Some(1_796_176_316));
        assert_eq!(t("2000-02-29T00:00:00Z"), Some(951_782_400));
        for bad in [
            "",
            "2026-12-02",
            "2026-13-02T00:00:00Z",
            "2026-12-02T00:00:00",
        ] {
            assert_eq!(t(bad), None, "{bad}");
        }
    }

    fn creds(expires_in: Option<u64>, now: SystemTime) -> Expiring {
        Expiring {
            credentials: Credentials {
                access_key_id: "A".into(),
                secret_access_key: "S".into(),
                session_token: None,
            },
            expires: expires_in.map(|s| now + Duration::from_secs(s)),
        }
    }

    #[test]
    fn credentials_are_replaced_five_minutes_before_expiry_or_at_half_life() {
        let t0 = UNIX_EPOCH + Duration::from_secs(1_000_000);
        let hour = creds(Some(3600), t0);
        assert!(fresh(&hour, t0, t0 + Duration::from_secs(3600 - 301)));
        assert!(!fresh(&hour, t0, t0 + Duration::from_secs(3600 - 300)));
        let short = creds(Some(4), t0);
        assert!(fresh(&short, t0, t0 + Duration::from_secs(1)));
        assert!(!fresh(&short, t0, t0 + Duration::from_secs(2)));
        assert!(fresh(
            &creds(None, t0),
            t0,
            t0 + Duration::from_secs(1 << 40)
        ));
    }

    #[test]
    fn roles_and_session_names_are_checked_by_field() {
        let mut r = AssumeRole::new("arn:aws:iam::123456789012:role/app");
        assert_eq!(r.check(), Ok(()));
        r.role_arn = "arn:aws:iam::123:role/app".into();
        assert_eq!(r.check().unwrap_err().0, "role_arn");
        r.role_arn = "arn:aws-cn:iam::123456789012:role/path/app".into();
        assert_eq!(r.check(), Ok(()));
        r.session_name = Some("has space".into());
        assert_eq!(r.check().unwrap_err().0, "session_name");
        r.session_name = Some("lbscale@daemon-1".into());
        r.external_id = Some("x".into());
        let (field, why) = r.check().unwrap_err();
        assert_eq!(field, "external_id");
        assert!(!why.contains("\"x\""), "{why}");
        r.external_id = Some("ext-id-1".into());
        r.duration = Some(Duration::from_secs(60));
        assert_eq!(r.check().unwrap_err().0, "duration");
    }

    #[test]
    fn environment_keys_come_in_pairs() {
        let env = EnvVars::of(&[("AWS_ACCESS_KEY_ID", "AKID")]);
        let e = from_environment(&env).unwrap_err();
        assert!(e.contains("AWS_SECRET_ACCESS_KEY"), "{e}");
        let env = EnvVars::of(&[
            ("AWS_ACCESS_KEY_ID", "AKID"),
            ("AWS_SECRET_ACCESS_KEY", "sec"),
            ("AWS_SESSION_TOKEN", "tok"),
        ]);
        let c = from_environment(&env).unwrap().unwrap();
        assert_eq!(c.session_token.as_deref(), Some("tok"));
    }
}
