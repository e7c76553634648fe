//! Authorized JSON calls to Compute Engine v1 and Cloud DNS v1, with
//! deadlines, retries of throttled and failed calls, Google's errors read
//! from their envelope, and operations waited on until they are done.

use crate::credentials::Tokens;
use lbscale_cloud_http::{self as http, Url};
use lbscale_engine::cloud::CloudError;
use serde_json::Value;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long one ordinary call may take.
const CALL_TIMEOUT: Duration = Duration::from_secs(30);
/// `operations.wait` answers within two minutes (Google's own bound).
const WAIT_CALL_TIMEOUT: Duration = Duration::from_secs(150);
/// How long an operation (an instance's start, a forwarding rule) may take.
pub const OPERATION_TIMEOUT: Duration = Duration::from_secs(600);
/// Attempts of a call that Google throttled, failed (5xx) or that got no answer.
const ATTEMPTS: u32 = 5;

/// The two APIs the driver calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Service {
    Compute,
    Dns,
}

/// A call Google refused: its HTTP status, the first error's reason and the message.
#[derive(Debug, Clone)]
pub struct GoogleError {
    pub status: u16,
    pub reason: String,
    pub message: String,
}

impl GoogleError {
    pub fn not_found(&self) -> bool {
        self.status == 404
    }

    fn retryable(&self) -> bool {
        self.status == 0
            || self.status == 429
            || self.status >= 500
            || matches!(
                self.reason.as_str(),
                "rateLimitExceeded" | "userRateLimitExceeded" | "backendError" | "internalError"
            )
    }
}

/// A refused call as the engine reports it: the call, Google's status,
/// reason and message.
pub fn failed(what: &str, e: GoogleError) -> CloudError {
    let status = if e.status > 0 {
        format!(" (HTTP {})", e.status)
    } else {
        String::new()
    };
    CloudError::Failed(format!("GCP {what}{status}: {}: {}", e.reason, e.message))
}

/// A client of one project's Compute Engine and Cloud DNS.
pub struct GcpApi {
    /// `https://compute.googleapis.com/compute/v1/` (or a test endpoint's).
    compute: String,
    /// `https://dns.googleapis.com/dns/v1/`.
    dns: String,
    project: String,
    tokens: Arc<Tokens>,
    tls: Arc<rustls::ClientConfig>,
}

impl GcpApi {
    /// `endpoint`: one `https://HOST[:PORT]` for both APIs (tests), else Google's.
    pub fn new(
        project: String,
        endpoint: Option<&str>,
        tokens: Arc<Tokens>,
        tls: Arc<rustls::ClientConfig>,
    ) -> GcpApi {
        let (compute, dns) = match endpoint.map(|e| e.trim_end_matches('/')) {
            Some(e) => (format!("{e}/compute/v1/"), format!("{e}/dns/v1/")),
            None => (
                "https://compute.googleapis.com/compute/v1/".into(),
                "https://dns.googleapis.com/dns/v1/".into(),
            ),
        };
        GcpApi {
            compute,
            dns,
            project,
            tokens,
            tls,
        }
    }

    pub fn project(&self) -> &str {
        &self.project
    }

    pub fn tokens(&self) -> &Arc<Tokens> {
        &self.tokens
    }

    /// The URL of `path` (under `projects/PROJECT/`) of the Compute API, as
    /// resources refer to each other.
    pub fn compute_url(&self, path: &str) -> String {
        format!("{}projects/{}/{path}", self.compute, self.project)
    }

    /// `method` on `path` (under `projects/PROJECT/`) with `query` and a JSON
    /// body; `what` (the method's discovery id) names the call in errors.
    pub async fn call(
        &self,
        service: Service,
        what: &str,
        method: &str,
        path: &str,
        query: &[(&str, String)],
        body: Option<&Value>,
    ) -> Result<Value, GoogleError> {
        let base = match service {
            Service::Compute => &self.compute,
            Service::Dns => &self.dns,
        };
        let mut url = format!("{base}projects/{}/{path}", self.project);
        for (i, (k, v)) in query.iter().enumerate() {
            url.push(if i == 0 { '?' } else { '&' });
            url.push_str(&format!("{k}={}", http::encode(v)));
        }
        let url = Url::parse(&url).map_err(|message| GoogleError {
            status: 0,
            reason: "badEndpoint".into(),
            message,
        })?;
        let deadline = if what.ends_with("Operations.wait") {
            WAIT_CALL_TIMEOUT
        } else {
            CALL_TIMEOUT
        };
        let content = body.map(|b| b.to_string().into_bytes());
        let mut delay = Duration::from_millis(250);
        let mut attempt = 1;
        let mut renewed = false;
        loop {
            let token = self.tokens.get().await.map_err(|message| GoogleError {
                status: 0,
                reason: "noCredentials".into(),
                message,
            })?;
            let bearer = format!("Bearer {token}");
            let headers = [("authorization", bearer.as_str())];
            let content = content.clone().map(|c| ("application/json", c));
            let r = match http::send(&self.tls, method, &url, &headers, content, deadline).await {
                Err(message) => Err(GoogleError {
                    status: 0,
                    reason: "transport".into(),
                    message,
                }),
                Ok(a) if (200..300).contains(&a.status) => {
                    if a.body.is_empty() {
                        Ok(Value::Null)
                    } else {
                        serde_json::from_slice(&a.body).map_err(|e| GoogleError {
                            status: a.status,
                            reason: "badAnswer".into(),
                            message: format!("the answer is not JSON: {e}"),
                        })
                    }
                }
                Ok(a) => Err(envelope(a.status, &a.body)),
            };
            match r {
                // A token refused before its time (revoked, a clock ahead): fetched anew, once.
                Err(e) if e.status == 401 && !renewed => {
                    tracing::debug!(
                        call = what,
                        "GCP refused the access token; fetching a new one"
                    );
                    self.tokens.invalidate().await;
                    renewed = true;
                }
                Err(e) if attempt < ATTEMPTS && e.retryable() => {
                    tracing::debug!(call = what, attempt, status = e.status, reason = %e.reason, "retrying a GCP call");
                    tokio::time::sleep(delay).await;
                    delay = (delay * 2).min(Duration::from_secs(8));
                    attempt += 1;
                }
                other => return other,
            }
        }
    }

    /// As [`Self::call`], a refusal made the engine's error.
    pub async fn json(
        &self,
        service: Service,
        what: &str,
        method: &str,
        path: &str,
        query: &[(&str, String)],
        body: Option<&Value>,
    ) -> lbscale_engine::cloud::Result<Value> {
        self.call(service, what, method, path, query, body)
            .await
            .map_err(|e| failed(what, e))
    }

    /// Waits until the Compute operation `op` (an insert's or delete's answer)
    /// is done, through its zone's or region's `operations.wait`; its error,
    /// if it failed, is the call's.
    pub async fn wait(&self, what: &str, mut op: Value) -> lbscale_engine::cloud::Result<Value> {
        let name = op["name"].as_str().unwrap_or_default().to_string();
        let last = |v: &Value| {
            v.as_str()
                .and_then(|s| s.rsplit('/').next())
                .map(str::to_string)
        };
        let (scope, wait_id) = match (last(&op["zone"]), last(&op["region"])) {
            (Some(z), _) => (format!("zones/{z}"), "compute.zoneOperations.wait"),
            (None, Some(r)) => (format!("regions/{r}"), "compute.regionOperations.wait"),
            (None, None) if op["kind"] == "compute#operation" => {
                ("global".to_string(), "compute.globalOperations.wait")
            }
            _ => {
                return Err(CloudError::Failed(format!(
                    "GCP {what}: the answer is not an operation: {}",
                    op.to_string().chars().take(200).collect::<String>()
                )))
            }
        };
        let deadline = Instant::now() + OPERATION_TIMEOUT;
        while op["status"] != "DONE" {
            if Instant::now() >= deadline {
                return Err(CloudError::Failed(format!(
                    "GCP {what}: operation {name} in {scope} not done after {}s (status {})",
                    OPERATION_TIMEOUT.as_secs(),
                    op["status"]
                )));
            }
            op = self
                .json(
                    Service::Compute,
                    wait_id,
                    "POST",
                    &format!("{scope}/operations/{name}/wait"),
                    &[],
                    None,
                )
                .await?;
        }
        if let Some(errors) = op["error"]["errors"].as_array().filter(|e| !e.is_empty()) {
            let said: Vec<String> = errors
                .iter()
                .map(|e| {
                    format!(
                        "{}: {}",
                        e["code"].as_str().unwrap_or("?"),
                        e["message"].as_str().unwrap_or("")
                    )
                })
                .collect();
            return Err(CloudError::Failed(format!(
                "GCP {what}: operation {name} failed: {}",
                said.join("; ")
            )));
        }
        Ok(op)
    }
}

/// Google's JSON error envelope: `{"error": {"code", "message", "errors":
/// [{"reason", ...}], "status"}}`; an answer that is not one is shown cut short.
fn envelope(status: u16, body: &[u8]) -> GoogleError {
    let v: Value = serde_json::from_slice(body).unwrap_or_default();
    let e = &v["error"];
    let reason = e["errors"][0]["reason"]
        .as_str()
        .or(e["status"].as_str())
        .unwrap_or("unknown")
        .to_string();
    let message = e["message"]
        .as_str()
        .map(str::to_string)
        .unwrap_or_else(|| String::from_utf8_lossy(body).chars().take(200).collect());
    GoogleError {
        status,
        reason,
        message,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_envelope_gives_the_reason_and_message() {
        let e = envelope(
            429,
            br#"{"error":{"code":429,"message":"Quota exceeded","status":"RESOURCE_EXHAUSTED","errors":[{"message":"Quota exceeded","domain":"usageLimits","reason":"rateLimitExceeded"}]}}"#,
        );
        assert_eq!(
            (e.status, e.reason.as_str(), e.message.as_str()),
            (429, "rateLimitExceeded", "Quota exceeded")
        );
        assert!(e.retryable());
        let e = envelope(
            403,
            br#"{"error":{"code":403,"message":"denied","status":"PERMISSION_DENIED"}}"#,
        );
        assert_eq!(e.reason, "PERMISSION_DENIED");
        assert!(!e.retryable());
        let e = envelope(502, b"<html>bad gateway</html>");
        assert!(e.message.contains("bad gateway") && e.retryable());
        let f = failed("compute.instances.insert", envelope(400, br#"{"error":{"code":400,"message":"Invalid value","errors":[{"reason":"invalid"}]}}"#));
        assert_eq!(
            f.to_string(),
            "GCP compute.instances.insert (HTTP 400): invalid: Invalid value"
        );
    }
}
