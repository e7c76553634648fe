//! The shared config and credentials files, as AWS's SDKs and CLI read them:
//! `AWS_CONFIG_FILE` (default `~/.aws/config`, sections `[default]` and
//! `[profile NAME]`) and `AWS_SHARED_CREDENTIALS_FILE` (default
//! `~/.aws/credentials`, sections `[NAME]`), whose values win over the config
//! file's for the same profile.
//!
//! A profile gives static keys (`aws_access_key_id`, `aws_secret_access_key`,
//! `aws_session_token`) or a role to assume (`role_arn`, with `external_id`,
//! `role_session_name`, `duration_seconds`) over the credentials of
//! `source_profile` or of `credential_source` (`Environment`,
//! `Ec2InstanceMetadata`, `EcsContainer`), or a web identity
//! (`role_arn` with `web_identity_token_file`). What lbscale does not do
//! (`credential_process`, SSO, MFA) is an error naming the key.

use super::{AssumeRole, EnvVars};
use crate::sigv4::Credentials;
use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::time::Duration;

/// Every profile of both files, merged.
#[derive(Debug, Default)]
pub struct Profiles {
    profiles: BTreeMap<String, BTreeMap<String, String>>,
    config: Option<PathBuf>,
    credentials: Option<PathBuf>,
}

/// Where a profile's credentials come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Plan {
    Static {
        credentials: Credentials,
        profile: String,
    },
    Environment,
    Instance,
    Container,
    WebIdentity {
        role: AssumeRole,
        token_file: String,
        profile: String,
    },
    Role {
        role: AssumeRole,
        base: Box<Plan>,
        profile: String,
    },
}

/// How deep `source_profile` may chain.
const MAX_CHAIN: usize = 8;

impl Profiles {
    /// Both files as the environment names them; a file that does not exist
    /// has no profiles, one that cannot be read is an error.
    pub fn load(env: &EnvVars) -> Result<Profiles, String> {
        let config = env
            .get("AWS_CONFIG_FILE")
            .map(|p| env.path(p))
            .or_else(|| env.home().map(|h| h.join(".aws/config")));
        let credentials = env
            .get("AWS_SHARED_CREDENTIALS_FILE")
            .map(|p| env.path(p))
            .or_else(|| env.home().map(|h| h.join(".aws/credentials")));
        let mut p = Profiles {
            config: config.clone(),
            credentials: credentials.clone(),
            ..Profiles::default()
        };
        if let Some(text) = read(config.as_ref())? {
            p.merge(&text, true);
        }
        if let Some(text) = read(credentials.as_ref())? {
            p.merge(&text, false);
        }
        Ok(p)
    }

    /// From the files' texts (tests).
    pub fn parse(config: &str, credentials: &str) -> Profiles {
        let mut p = Profiles::default();
        p.merge(config, true);
        p.merge(credentials, false);
        p
    }

    /// The files read, for messages.
    pub fn files(&self) -> String {
        let show = |p: &Option<PathBuf>| {
            p.as_ref()
                .map(|p| p.display().to_string())
                .unwrap_or_else(|| "(no home directory)".into())
        };
        format!("{} and {}", show(&self.config), show(&self.credentials))
    }

    pub fn no_credentials(&self, name: &str) -> String {
        if self.profiles.contains_key(name) {
            format!(
                "AWS profile {name:?} has no credentials (no aws_access_key_id, role_arn or credential_source) in {}",
                self.files()
            )
        } else {
            format!("no AWS profile {name:?} in {}", self.files())
        }
    }

    /// The profile's value of `key`.
    pub fn value(&self, name: &str, key: &str) -> Option<&str> {
        self.profiles
            .get(name)?
            .get(key)
            .map(String::as_str)
            .filter(|v| !v.is_empty())
    }

    /// Where profile `name`'s credentials come from: None when the profile
    /// does not exist or has none; an error for what cannot work.
    pub fn plan(&self, name: &str) -> Result<Option<Plan>, String> {
        if !self.profiles.contains_key(name) {
            return Ok(None);
        }
        self.plan_of(name, &mut BTreeSet::new())
    }

    fn plan_of(&self, name: &str, seen: &mut BTreeSet<String>) -> Result<Option<Plan>, String> {
        let at = |key: &str, why: &str| format!("AWS profile {name:?}, {key}: {why}");
        if !self.profiles.contains_key(name) {
            return Err(format!(
                "no AWS profile {name:?} (a source_profile) in {}",
                self.files()
            ));
        }
        if seen.len() >= MAX_CHAIN || !seen.insert(name.to_string()) {
            return Err(at(
                "source_profile",
                "the profiles' source_profile settings go round in a loop",
            ));
        }
        for key in ["credential_process", "sso_session", "sso_start_url"] {
            if self.value(name, key).is_some() && self.value(name, "role_arn").is_none() {
                return Err(at(
                    key,
                    "not supported by lbscale; give the profile static keys or a role_arn, or use `aws configure export-credentials` into the environment",
                ));
            }
        }
        let Some(role_arn) = self.value(name, "role_arn") else {
            return Ok(self.static_keys(name)?.map(|credentials| Plan::Static {
                credentials,
                profile: name.into(),
            }));
        };
        if self.value(name, "mfa_serial").is_some() {
            return Err(at(
                "mfa_serial",
                "a role that needs an MFA code cannot be assumed by a program that runs unattended",
            ));
        }
        let role = AssumeRole {
            role_arn: role_arn.into(),
            external_id: self.value(name, "external_id").map(Into::into),
            session_name: self.value(name, "role_session_name").map(Into::into),
            duration: match self.value(name, "duration_seconds") {
                None => None,
                Some(d) => Some(Duration::from_secs(d.parse().map_err(|_| {
                    at(
                        "duration_seconds",
                        &format!("must be a whole number of seconds, got {d:?}"),
                    )
                })?)),
            },
        };
        role.check().map_err(|(field, why)| {
            let key = match field {
                "session_name" => "role_session_name",
                "duration" => "duration_seconds",
                other => other,
            };
            at(key, &why)
        })?;
        if let Some(file) = self.value(name, "web_identity_token_file") {
            return Ok(Some(Plan::WebIdentity {
                role,
                token_file: file.into(),
                profile: name.into(),
            }));
        }
        let base = match (
            self.value(name, "source_profile"),
            self.value(name, "credential_source"),
        ) {
            (Some(_), Some(_)) => {
                return Err(at(
                    "source_profile",
                    "set source_profile or credential_source, not both",
                ))
            }
            (None, None) => {
                return Err(at(
                    "role_arn",
                    "a role needs source_profile or credential_source (or web_identity_token_file) for the credentials that assume it",
                ))
            }
            (None, Some(source)) => match source {
                "Environment" => Plan::Environment,
                "Ec2InstanceMetadata" => Plan::Instance,
                "EcsContainer" => Plan::Container,
                other => {
                    return Err(at(
                        "credential_source",
                        &format!("must be Environment, Ec2InstanceMetadata or EcsContainer, got {other:?}"),
                    ))
                }
            },
            // A profile that is its own source uses its own keys.
            (Some(source), None) if source == name => {
                self.static_keys(name)?.map(|credentials| Plan::Static {
                    credentials,
                    profile: name.into(),
                }).ok_or_else(|| at("source_profile", "the profile is its own source but has no aws_access_key_id"))?
            }
            (Some(source), None) => self
                .plan_of(source, seen)?
                .ok_or_else(|| {
                    at(
                        "source_profile",
                        &format!("profile {source:?} has no credentials"),
                    )
                })?,
        };
        Ok(Some(Plan::Role {
            role,
            base: Box::new(base),
            profile: name.into(),
        }))
    }

    fn static_keys(&self, name: &str) -> Result<Option<Credentials>, String> {
        match (
            self.value(name, "aws_access_key_id"),
            self.value(name, "aws_secret_access_key"),
        ) {
            (Some(id), Some(secret)) => Ok(Some(Credentials {
                access_key_id: id.into(),
                secret_access_key: secret.into(),
                session_token: self.value(name, "aws_session_token").map(Into::into),
            })),
            (None, None) => Ok(None),
            _ => Err(format!(
                "AWS profile {name:?}: aws_access_key_id and aws_secret_access_key go together"
            )),
        }
    }

    /// Adds the sections of one file; `config`: the config file's section
    /// names (`[profile NAME]`, `[default]`).
    fn merge(&mut self, text: &str, config: bool) {
        let mut section: Option<String> = None;
        for line in text.lines() {
            let trimmed = line.trim();
            if trimmed.is_empty() || trimmed.starts_with('#') || trimmed.starts_with(';') {
                continue;
            }
            if let Some(header) = trimmed.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
                let header = header.trim();
                section = if !config {
                    Some(header.to_string())
                } else if header == "default" {
                    Some("default".into())
                } else {
                    // Other sections ([sso-session], [services]) are not profiles.
                    header
                        .strip_prefix("profile")
                        .filter(|r| r.starts_with(char::is_whitespace))
                        .map(|r| r.trim().to_string())
                };
                if let Some(s) = &section {
                    self.profiles.entry(s.clone()).or_default();
                }
                continue;
            }
            // An indented line continues a nested setting (`s3 =` and its
            // keys), which is not about credentials.
            if line.starts_with(char::is_whitespace) {
                continue;
            }
            let (Some(s), Some((k, v))) = (&section, trimmed.split_once('=')) else {
                continue;
            };
            let entry = self.profiles.entry(s.clone()).or_default();
            let key = k.trim().to_ascii_lowercase();
            // The credentials file wins: it is read second.
            entry.insert(key, v.trim().to_string());
        }
    }
}

fn read(path: Option<&PathBuf>) -> Result<Option<String>, String> {
    let Some(path) = path else { return Ok(None) };
    match std::fs::read_to_string(path) {
        Ok(t) => Ok(Some(t)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(format!("cannot read {}: {e}", path.display())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CONFIG: &str = "
# a comment
[default]
region = eu-west-1

[profile base]
region = us-east-1
s3 =
  max_concurrent_requests = 10

[profile app]
role_arn = arn:aws:iam::123456789012:role/app
source_profile = base
external_id = ext-1
role_session_name = lbscale-test

[profile deep]
role_arn = arn:aws:iam::123456789012:role/deep
source_profile = app

[profile on-ec2]
role_arn = arn:aws:iam::123456789012:role/ec2
credential_source = Ec2InstanceMetadata

[profile web]
role_arn = arn:aws:iam::123456789012:role/web
web_identity_token_file = /var/run/token

[profile loop-a]
role_arn = arn:aws:iam::123456789012:role/a
source_profile = loop-b

[profile loop-b]
role_arn = arn:aws:iam::123456789012:role/b
source_profile = loop-a

[profile sso]
sso_start_url = https://example.awsapps.com/start

[sso-session corp]
sso_region = us-east-1

[notaprofile]
aws_access_key_id = NOPE
";

    const CREDENTIALS: &str = "
[base]
aws_access_key_id = AKIDBASE
aws_secret_access_key = base-secret

[default]
aws_access_key_id = AKIDDEFAULT
aws_secret_access_key = default-secret
aws_session_token = default-token
";

    fn plan(name: &str) -> Result<Option<Plan>, String> {
        Profiles::parse(CONFIG, CREDENTIALS).plan(name)
    }

    #[test]
    fn static_keys_come_from_the_credentials_file() {
        let Some(Plan::Static { credentials, .. }) = plan("default").unwrap() else {
            panic!()
        };
        assert_eq!(credentials.access_key_id, "AKIDDEFAULT");
        assert_eq!(credentials.session_token.as_deref(), Some("default-token"));
        let p = Profiles::parse(CONFIG, CREDENTIALS);
        assert_eq!(p.value("default", "region"), Some("eu-west-1"));
        assert_eq!(p.value("base", "max_concurrent_requests"), None);
        assert_eq!(plan("notaprofile").unwrap(), None);
        assert_eq!(plan("corp").unwrap(), None);
    }

    #[test]
    fn roles_chain_through_source_profiles() {
        let Some(Plan::Role { role, base, .. }) = plan("deep").unwrap() else {
            panic!()
        };
        assert_eq!(role.role_arn, "arn:aws:iam::123456789012:role/deep");
        let Plan::Role { role, base, .. } = *base else {
            panic!()
        };
        assert_eq!(role.external_id.as_deref(), Some("ext-1"));
        assert_eq!(role.session_name.as_deref(), Some("lbscale-test"));
        assert!(
            matches!(*base, Plan::Static { ref credentials, .. } if credentials.access_key_id == "AKIDBASE")
        );
        assert!(matches!(
            plan("on-ec2").unwrap(),
            Some(Plan::Role { base, .. }) if *base == Plan::Instance
        ));
        assert!(matches!(
            plan("web").unwrap(),
            Some(Plan::WebIdentity { token_file, .. }) if token_file == "/var/run/token"
        ));
    }

    #[test]
    fn what_cannot_work_is_named() {
        let e = plan("loop-a").unwrap_err();
        assert!(e.contains("loop"), "{e}");
        let e = plan("sso").unwrap_err();
        assert!(
            e.contains("sso_start_url") && e.contains("not supported"),
            "{e}"
        );
        let p = Profiles::parse(
            "[profile r]\nrole_arn = arn:aws:iam::123456789012:role/r\n[profile bad]\nrole_arn = nope\nsource_profile = r\n[profile s]\nrole_arn = arn:aws:iam::123456789012:role/r\nsource_profile = missing\n",
            "[half]\naws_access_key_id = AKID\n",
        );
        assert!(p
            .plan("r")
            .unwrap_err()
            .contains("source_profile or credential_source"));
        assert!(p.plan("bad").unwrap_err().contains("role_arn"));
        assert!(p
            .plan("s")
            .unwrap_err()
            .contains("no AWS profile \"missing\""));
        let e = p.plan("half").unwrap_err();
        assert!(e.contains("go together"), "{e}");
        assert!(p
            .no_credentials("nobody")
            .contains("no AWS profile \"nobody\""));
    }
}
