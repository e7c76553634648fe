//! Where the driver's OAuth 2 access tokens come from, found as Google's
//! client libraries find Application Default Credentials:
//!
//! 1. a service-account key given outright (the provider's `credentials`:
//!    the key's JSON, or the path of the file holding it);
//! 2. the key file named by `GOOGLE_APPLICATION_CREDENTIALS`;
//! 3. gcloud's application-default file
//!    (`$CLOUDSDK_CONFIG` or `~/.config/gcloud`, `application_default_credentials.json`)
//!    when it holds a service-account key;
//! 4. the metadata server of the Compute Engine instance the driver runs on
//!    (`GCE_METADATA_HOST`, default `metadata.google.internal`).
//!
//! A key is exchanged at its `token_uri` for a token with a JWT it signs
//! (RS256, [`ring`]); the metadata server hands tokens out itself. A token is
//! fetched again [`REFRESH_AHEAD`] before it expires, or when an API refuses
//! it. Neither a key nor a token is ever put in an error or a log.

use base64::Engine as _;
use lbscale_cloud_http::{self as http, Url};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tokio::sync::Mutex;

/// The scope of the driver's tokens.
pub const SCOPE: &str = "https://www.googleapis.com/auth/cloud-platform";
/// A token is fetched again this long before its expiry (or at half its
/// life, when it is given for less than twice this).
pub const REFRESH_AHEAD: Duration = Duration::from_secs(300);
const TOKEN_CALL_TIMEOUT: Duration = Duration::from_secs(20);
const DEFAULT_METADATA_HOST: &str = "metadata.google.internal";

/// The environment the chain reads: `GOOGLE_APPLICATION_CREDENTIALS`,
/// `GCE_METADATA_HOST`, `CLOUDSDK_CONFIG`, `HOME` (and the project's variables).
pub type Env = BTreeMap<String, String>;

/// The variables of [`Env`] from this process.
pub fn env_from_process() -> Env {
    [
        "GOOGLE_APPLICATION_CREDENTIALS",
        "GCE_METADATA_HOST",
        "CLOUDSDK_CONFIG",
        "HOME",
        "GOOGLE_CLOUD_PROJECT",
        "CLOUDSDK_CORE_PROJECT",
    ]
    .iter()
    .filter_map(|k| {
        std::env::var(k)
            .ok()
            .filter(|v| !v.is_empty())
            .map(|v| (k.to_string(), v))
    })
    .collect()
}

/// A service account's key, as Google's IAM hands it out (JSON).
#[derive(Clone, serde::Deserialize)]
pub struct ServiceAccountKey {
    #[serde(rename = "type")]
    pub kind: String,
    pub client_email: String,
    pub private_key_id: String,
    private_key: String,
    #[serde(default = "default_token_uri")]
    pub token_uri: String,
    #[serde(default)]
    pub project_id: Option<String>,
}

fn default_token_uri() -> String {
    "https://oauth2.googleapis.com/token".into()
}

impl std::fmt::Debug for ServiceAccountKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServiceAccountKey")
            .field("client_email", &self.client_email)
            .field("private_key_id", &self.private_key_id)
            .field("private_key", &"<redacted>")
            .finish_non_exhaustive()
    }
}

impl ServiceAccountKey {
    /// Parses a key's JSON; `from` names where it came from. The error
    /// never repeats the value.
    pub fn parse(json: &str, from: &str) -> Result<ServiceAccountKey, String> {
        let v: serde_json::Value = serde_json::from_str(json).map_err(|e| {
            format!("the GCP credentials from {from} are not JSON (line {}, column {}; the value is not shown)", e.line(), e.column())
        })?;
        match v.get("type").and_then(|t| t.as_str()) {
            Some("service_account") => {}
            Some(other) => {
                return Err(format!(
                    "the GCP credentials from {from} are of type {other:?}: only a service-account key (type \"service_account\") is built; user credentials and workload identity federation are not"
                ))
            }
            None => return Err(format!("the GCP credentials from {from} have no \"type\": expected a service-account key (type \"service_account\")")),
        }
        let key: ServiceAccountKey = serde_json::from_value(v).map_err(|e| {
            // serde names the missing field; never a value.
            format!(
                "the service-account key from {from} lacks a field: {}",
                e.to_string().split(" at line").next().unwrap_or("")
            )
        })?;
        key.signer()
            .map_err(|e| format!("the service-account key from {from}: {e}"))?;
        Ok(key)
    }

    fn signer(&self) -> Result<ring::signature::RsaKeyPair, String> {
        let body: String = self
            .private_key
            .lines()
            .filter(|l| !l.starts_with("-----"))
            .collect();
        let der = base64::engine::general_purpose::STANDARD
            .decode(body.trim())
            .map_err(|_| "private_key is not PEM (base64 between BEGIN/END lines)".to_string())?;
        ring::signature::RsaKeyPair::from_pkcs8(&der).map_err(|e| {
            format!("private_key is not an RSA key in PKCS#8 of 2048 bits or more ({e})")
        })
    }

    /// The signed JWT that asks `token_uri` for a token of [`SCOPE`], valid
    /// for an hour from `now` (seconds since the epoch).
    pub fn assertion(&self, now: u64) -> Result<String, String> {
        let b64 = |v: &serde_json::Value| {
            base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(v.to_string())
        };
        let header = serde_json::json!({"alg": "RS256", "typ": "JWT", "kid": self.private_key_id});
        let claims = serde_json::json!({
            "iss": self.client_email, "scope": SCOPE, "aud": self.token_uri,
            "iat": now, "exp": now + 3600,
        });
        let signing_input = format!("{}.{}", b64(&header), b64(&claims));
        let key = self.signer()?;
        let mut sig = vec![0u8; key.public().modulus_len()];
        key.sign(
            &ring::signature::RSA_PKCS1_SHA256,
            &ring::rand::SystemRandom::new(),
            signing_input.as_bytes(),
            &mut sig,
        )
        .map_err(|_| "signing the JWT failed".to_string())?;
        Ok(format!(
            "{signing_input}.{}",
            base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(sig)
        ))
    }
}

/// Where tokens come from.
#[derive(Debug, Clone)]
pub enum Source {
    /// A service-account key, and where it was found.
    Key {
        key: ServiceAccountKey,
        from: String,
    },
    /// The instance's metadata server (`host[:port]`).
    Metadata { host: String },
}

/// Finds the source as Google's libraries do (see the module's doc):
/// `explicit` is the provider's `credentials`.
pub fn resolve(explicit: Option<&str>, env: &Env) -> Result<Source, String> {
    let from_file = |path: &str, what: &str| -> Result<Source, String> {
        let json =
            std::fs::read_to_string(path).map_err(|e| format!("{what}: reading {path}: {e}"))?;
        let from = format!("{what} ({path})");
        Ok(Source::Key {
            key: ServiceAccountKey::parse(&json, &from)?,
            from,
        })
    };
    if let Some(c) = explicit.map(str::trim).filter(|c| !c.is_empty()) {
        if c.starts_with('{') {
            return Ok(Source::Key {
                key: ServiceAccountKey::parse(c, "the provider's gcp credentials")?,
                from: "the provider's gcp credentials".into(),
            });
        }
        return from_file(c, "the provider's gcp credentials file");
    }
    if let Some(path) = env.get("GOOGLE_APPLICATION_CREDENTIALS") {
        return from_file(path, "GOOGLE_APPLICATION_CREDENTIALS");
    }
    let gcloud_dir = env.get("CLOUDSDK_CONFIG").map(PathBuf::from).or_else(|| {
        env.get("HOME")
            .map(|h| PathBuf::from(h).join(".config/gcloud"))
    });
    if let Some(file) = gcloud_dir
        .map(|d| d.join("application_default_credentials.json"))
        .filter(|f| f.is_file())
    {
        return from_file(
            &file.to_string_lossy(),
            "gcloud's application default credentials",
        );
    }
    Ok(Source::Metadata {
        host: env
            .get("GCE_METADATA_HOST")
            .cloned()
            .unwrap_or_else(|| DEFAULT_METADATA_HOST.into()),
    })
}

impl Source {
    /// Who the driver calls Google as, and from where (no secret).
    pub fn describe(&self) -> String {
        match self {
            Source::Key { key, from } => format!(
                "service account {} (key {}) from {from}",
                key.client_email, key.private_key_id
            ),
            Source::Metadata { host } => {
                format!("the instance's service account (metadata server {host})")
            }
        }
    }

    /// A new token and how long it is valid.
    async fn fetch(&self, tls: &Arc<rustls::ClientConfig>) -> Result<(String, Duration), String> {
        let (answer, who) = match self {
            Source::Key { key, .. } => {
                let now = SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .map(|d| d.as_secs())
                    .unwrap_or(0);
                let body = format!(
                    "grant_type={}&assertion={}",
                    http::encode("urn:ietf:params:oauth:grant-type:jwt-bearer"),
                    key.assertion(now)?
                );
                let url =
                    Url::parse(&key.token_uri).map_err(|e| format!("the key's token_uri: {e}"))?;
                let a = http::send(
                    tls,
                    "POST",
                    &url,
                    &[],
                    Some(("application/x-www-form-urlencoded", body.into_bytes())),
                    TOKEN_CALL_TIMEOUT,
                )
                .await
                .map_err(|e| {
                    format!(
                        "asking {} for a token of {}: {e}",
                        key.token_uri, key.client_email
                    )
                })?;
                (a, format!("{} for {}", key.token_uri, key.client_email))
            }
            Source::Metadata { host } => {
                let url = Url::parse(&format!(
                    "http://{host}/computeMetadata/v1/instance/service-accounts/default/token"
                ))?;
                let headers = [("metadata-flavor", "Google")];
                let a = http::send(tls, "GET", &url, &headers, None, TOKEN_CALL_TIMEOUT)
                    .await
                    .map_err(|e| format!("asking the metadata server {host} for a token (is this a Compute Engine instance? else set GOOGLE_APPLICATION_CREDENTIALS): {e}"))?;
                (a, format!("the metadata server {host}"))
            }
        };
        let v: serde_json::Value = serde_json::from_slice(&answer.body).unwrap_or_default();
        if answer.status != 200 {
            // OAuth's error and its description; never the request.
            return Err(format!(
                "{who} refused a token (HTTP {}): {}: {}",
                answer.status,
                v["error"].as_str().unwrap_or("?"),
                v["error_description"].as_str().unwrap_or("")
            ));
        }
        let token = v["access_token"]
            .as_str()
            .filter(|t| !t.is_empty())
            .ok_or_else(|| format!("{who} answered without an access_token"))?;
        let lifetime = Duration::from_secs(v["expires_in"].as_u64().unwrap_or(3600));
        Ok((token.to_string(), lifetime))
    }
}

/// A token shared by every call, fetched again before it expires.
pub struct Tokens {
    source: Source,
    tls: Arc<rustls::ClientConfig>,
    cached: Mutex<Option<(String, Instant)>>,
    fetched: std::sync::atomic::AtomicU64,
}

impl Tokens {
    pub fn new(source: Source, tls: Arc<rustls::ClientConfig>) -> Tokens {
        Tokens {
            source,
            tls,
            cached: Mutex::new(None),
            fetched: Default::default(),
        }
    }

    pub fn source(&self) -> &Source {
        &self.source
    }

    /// How many tokens were fetched so far (for tests of the refresh).
    pub fn fetched(&self) -> u64 {
        self.fetched.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// A token valid for a while yet.
    pub async fn get(&self) -> Result<String, String> {
        let mut cached = self.cached.lock().await;
        if let Some((token, refresh_at)) = cached.as_ref() {
            if Instant::now() < *refresh_at {
                return Ok(token.clone());
            }
        }
        let (token, lifetime) = self.source.fetch(&self.tls).await?;
        self.fetched
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let ahead = REFRESH_AHEAD.min(lifetime / 2);
        *cached = Some((token.clone(), Instant::now() + lifetime - ahead));
        Ok(token)
    }

    /// Forgets the token (an API refused it): the next call fetches one.
    pub async fn invalidate(&self) {
        *self.cached.lock().await = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_chain_prefers_the_explicit_then_the_variable_then_gcloud_then_metadata() {
        let dir = std::env::temp_dir().join(format!("lbscale-gcp-chain-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("gcloud")).unwrap();
        let mut env = Env::new();
        env.insert(
            "CLOUDSDK_CONFIG".into(),
            dir.join("gcloud").display().to_string(),
        );
        env.insert("GCE_METADATA_HOST".into(), "127.0.0.1:9".into());
        match resolve(None, &env).unwrap() {
            Source::Metadata { host } => assert_eq!(host, "127.0.0.1:9"),
            s => panic!("{s:?}"),
        }
        // A user's gcloud login is not a service-account key: said by name.
        std::fs::write(
            dir.join("gcloud/application_default_credentials.json"),
            r#"{"type":"authorized_user","client_id":"x","client_secret":"SECRET","refresh_token":"R"}"#,
        )
        .unwrap();
        let e = resolve(None, &env).unwrap_err();
        assert!(
            e.contains("authorized_user") && !e.contains("SECRET"),
            "{e}"
        );
        env.insert(
            "GOOGLE_APPLICATION_CREDENTIALS".into(),
            dir.join("missing.json").display().to_string(),
        );
        let e = resolve(None, &env).unwrap_err();
        assert!(
            e.contains("GOOGLE_APPLICATION_CREDENTIALS") && e.contains("missing.json"),
            "{e}"
        );
        // Explicit JSON wins over everything; a bad key never echoes its value.
        let e = resolve(Some(r#"{"type":"service_account","client_email":"a@b","private_key_id":"k","private_key":"-----BEGIN PRIVATE KEY-----\nTOPSECRET\n-----END PRIVATE KEY-----"}"#), &env).unwrap_err();
        assert!(
            e.contains("provider's gcp credentials") && !e.contains("TOPSECRET"),
            "{e}"
        );
        let e = resolve(Some("{not json SECRETVALUE"), &env).unwrap_err();
        assert!(e.contains("not JSON") && !e.contains("SECRETVALUE"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
