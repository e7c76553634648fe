//! Calls to Azure Resource Manager: a bearer token on each, a deadline on
//! each, 429 and 5xx retried with back-off (at least the `Retry-After` that
//! ARM asks for), and long-running operations followed as Azure documents
//! them: the `Azure-AsyncOperation` URL polled until its `status` is
//! terminal, else the `Location` URL until it stops answering 202, else the
//! resource's own `provisioningState`; each poll waits its `Retry-After`.
//! Every error names the operation, the HTTP status and Azure's error code
//! and message.

use crate::credentials::Credentials;
use lbscale_cloud_http::{self as http, Url};
use lbscale_engine::cloud::CloudError;
use serde_json::Value;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long one call may take.
const CALL_TIMEOUT: Duration = Duration::from_secs(30);
/// Attempts of a call that was throttled, failed on Azure's side or could
/// not connect.
const ATTEMPTS: u32 = 5;
/// The first back-off, doubled at each attempt, and the longest.
const FIRST_BACKOFF: Duration = Duration::from_millis(500);
const MAX_BACKOFF: Duration = Duration::from_secs(30);
/// How long a long-running operation may take (a VM's creation is the longest).
const OPERATION_TIMEOUT: Duration = Duration::from_secs(900);
/// The poll interval when ARM gives no `Retry-After`.
const DEFAULT_POLL: Duration = Duration::from_secs(5);
/// Tries of a read-modify-write that other writers keep beating.
const ETAG_ATTEMPTS: u32 = 5;

/// A refused or failed call.
#[derive(Debug, Clone)]
pub struct ArmError {
    /// 0: no answer (transport, deadline).
    pub status: u16,
    pub code: String,
    pub message: String,
}

impl ArmError {
    pub fn is_not_found(&self) -> bool {
        self.status == 404
    }
}

/// An answer that ARM accepted.
#[derive(Debug, Clone)]
pub struct Answer {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Value,
}

impl Answer {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// An error as the engine reports it.
pub fn failed(what: &str, e: ArmError) -> CloudError {
    let status = if e.status > 0 {
        format!(" (HTTP {})", e.status)
    } else {
        String::new()
    };
    CloudError::Failed(format!("Azure {what}{status}: {}: {}", e.code, e.message))
}

/// A client of ARM in one subscription.
pub struct Arm {
    base: Url,
    subscription: String,
    credentials: Arc<Credentials>,
    tls: Arc<rustls::ClientConfig>,
}

impl Arm {
    pub fn new(
        base: Url,
        subscription: String,
        credentials: Arc<Credentials>,
        tls: Arc<rustls::ClientConfig>,
    ) -> Arm {
        Arm {
            base,
            subscription,
            credentials,
            tls,
        }
    }

    pub fn subscription(&self) -> &str {
        &self.subscription
    }

    pub fn credentials(&self) -> &Arc<Credentials> {
        &self.credentials
    }

    /// `/subscriptions/S/resourceGroups/G/providers/` + `rest`.
    pub fn in_group(&self, group: &str, rest: &str) -> String {
        format!(
            "/subscriptions/{}/resourceGroups/{group}/providers/{rest}",
            self.subscription
        )
    }

    fn url(&self, path_or_url: &str, api_version: Option<&str>) -> Result<Url, ArmError> {
        let mut url = if path_or_url.starts_with('/') {
            Url {
                path: path_or_url.to_string(),
                ..self.base.clone()
            }
        } else {
            Url::parse(path_or_url).map_err(|message| ArmError {
                status: 0,
                code: "BadUrl".into(),
                message,
            })?
        };
        if let Some(v) = api_version {
            let sep = if url.path.contains('?') { '&' } else { '?' };
            url.path = format!("{}{sep}api-version={v}", url.path);
        }
        Ok(url)
    }

    /// One call, retried as the module says; `headers` are extra (`If-Match`).
    pub async fn call(
        &self,
        method: &str,
        path_or_url: &str,
        api_version: Option<&str>,
        body: Option<&Value>,
        headers: &[(&str, &str)],
    ) -> Result<Answer, ArmError> {
        let url = self.url(path_or_url, api_version)?;
        let content = body.map(|b| serde_json::to_vec(b).expect("JSON"));
        let mut delay = FIRST_BACKOFF;
        let mut renewed = false;
        let mut attempt = 1;
        loop {
            let token = self.credentials.token().await.map_err(|message| ArmError {
                status: 0,
                code: "NoCredentials".into(),
                message,
            })?;
            let auth = format!("Bearer {token}");
            let mut h: Vec<(&str, &str)> =
                vec![("authorization", &auth), ("accept", "application/json")];
            h.extend_from_slice(headers);
            let r = http::send(
                &self.tls,
                method,
                &url,
                &h,
                content.clone().map(|c| ("application/json", c)),
                CALL_TIMEOUT,
            )
            .await;
            let (e, retry_after) = match r {
                Ok(resp) if (200..300).contains(&resp.status) => {
                    let body = if resp.body.is_empty() {
                        Value::Null
                    } else {
                        serde_json::from_slice(&resp.body).map_err(|e| ArmError {
                            status: resp.status,
                            code: "InvalidResponse".into(),
                            message: format!("the answer is not JSON: {e}"),
                        })?
                    };
                    return Ok(Answer {
                        status: resp.status,
                        headers: resp.headers,
                        body,
                    });
                }
                Ok(resp) => {
                    let retry_after = resp
                        .header("retry-after")
                        .and_then(|s| s.trim().parse::<u64>().ok());
                    (error_of(resp.status, &resp.body), retry_after)
                }
                Err(message) => (
                    ArmError {
                        status: 0,
                        code: "Transport".into(),
                        message,
                    },
                    None,
                ),
            };
            if e.status == 401 && !renewed && e.code == "ExpiredAuthenticationToken" {
                // Expired before its stated time (a clock behind): fetched anew, once.
                self.credentials.invalidate().await;
                renewed = true;
                continue;
            }
            let retryable = e.status == 0 || e.status == 429 || e.status >= 500;
            if !retryable || attempt >= ATTEMPTS {
                return Err(e);
            }
            let wait = retry_after
                .map(Duration::from_secs)
                .unwrap_or(delay)
                .min(MAX_BACKOFF);
            tracing::debug!(method, path = %url.path.split('?').next().unwrap_or(""), attempt, status = e.status, code = %e.code, wait_ms = wait.as_millis() as u64, "retrying an Azure call");
            tokio::time::sleep(wait).await;
            delay = (delay * 2).min(MAX_BACKOFF);
            attempt += 1;
        }
    }

    /// GET of a resource; None when ARM says it does not exist.
    pub async fn get(
        &self,
        what: &str,
        path: &str,
        api_version: &str,
    ) -> Result<Option<Answer>, CloudError> {
        match self.call("GET", path, Some(api_version), None, &[]).await {
            Ok(a) => Ok(Some(a)),
            Err(e) if e.is_not_found() => Ok(None),
            Err(e) => Err(failed(what, e)),
        }
    }

    /// Every item of a list, following `nextLink`.
    pub async fn list(
        &self,
        what: &str,
        path: &str,
        api_version: &str,
    ) -> Result<Vec<Value>, CloudError> {
        let mut out = Vec::new();
        let mut next: Option<String> = None;
        loop {
            let a = match &next {
                Some(link) => self.call("GET", link, None, None, &[]).await,
                None => self.call("GET", path, Some(api_version), None, &[]).await,
            }
            .map_err(|e| failed(what, e))?;
            if let Some(items) = a.body["value"].as_array() {
                out.extend(items.iter().cloned());
            }
            match a.body["nextLink"].as_str() {
                Some(l) if !l.is_empty() => next = Some(l.to_string()),
                _ => return Ok(out),
            }
        }
    }

    /// Makes the resource at `path` (`kind`, e.g. "load balancer", and `name`
    /// name it in errors) have `wanted` as its `shape`, by the read-modify-write
    /// that a resource with several writers needs: it is read, left alone when
    /// it already has it, else `body(current)` is put with `If-Match` of the
    /// ETag read (`If-None-Match: *` when there was none), and a 412 (someone
    /// wrote in between) reads it again, up to [`ETAG_ATTEMPTS`] times. What
    /// the PUT leaves must have `wanted`.
    #[allow(clippy::too_many_arguments)]
    pub async fn converge<S: PartialEq + std::fmt::Debug>(
        &self,
        kind: &str,
        name: &str,
        path: &str,
        api_version: &str,
        wanted: &S,
        shape: impl Fn(&Value) -> S,
        body: impl Fn(Option<&Value>) -> Value,
    ) -> Result<(), CloudError> {
        let what = format!("{kind} PUT {name}");
        let mut attempt = 1;
        loop {
            let current = self.get(&format!("{kind} GET"), path, api_version).await?;
            let current = current.map(|c| c.body);
            if current.as_ref().is_some_and(|c| shape(c) == *wanted) {
                return Ok(());
            }
            let etag = current
                .as_ref()
                .and_then(|c| c["etag"].as_str())
                .map(str::to_string);
            let condition = match &etag {
                Some(e) => ("if-match", e.as_str()),
                None => ("if-none-match", "*"),
            };
            let put = body(current.as_ref());
            match self.put(&what, path, api_version, &put, &[condition]).await {
                Ok(after) if shape(&after) == *wanted => return Ok(()),
                Ok(after) => {
                    return Err(CloudError::Failed(format!(
                        "Azure {what}: after the PUT the {kind} is not what was put (it has {:?}, wanted {wanted:?})",
                        shape(&after)
                    )))
                }
                Err(e) if e.status == 412 && attempt < ETAG_ATTEMPTS => {
                    tracing::debug!(%name, attempt, "the {kind} changed since it was read; reading it again");
                    attempt += 1;
                }
                Err(e) => return Err(failed(&what, e)),
            }
        }
    }

    /// PUT of a resource, followed to its end: the resource as it is then.
    /// `conditions` are `If-Match`/`If-None-Match`; a 412 is returned as such
    /// (the caller reads again).
    pub async fn put(
        &self,
        what: &str,
        path: &str,
        api_version: &str,
        body: &Value,
        conditions: &[(&str, &str)],
    ) -> Result<Value, ArmError> {
        let a = self
            .call("PUT", path, Some(api_version), Some(body), conditions)
            .await?;
        self.follow(what, &a, path, api_version, false).await?;
        let done = self.call("GET", path, Some(api_version), None, &[]).await?;
        match provisioning_state(&done.body) {
            Some(s) if s.eq_ignore_ascii_case("Failed") || s.eq_ignore_ascii_case("Canceled") => {
                Err(ArmError {
                    status: done.status,
                    code: format!("Provisioning{s}"),
                    message: format!("{what}: the resource's provisioningState is {s}"),
                })
            }
            _ => Ok(done.body),
        }
    }

    /// DELETE of a resource, followed to its end; one already gone is fine.
    pub async fn delete(
        &self,
        what: &str,
        path: &str,
        api_version: &str,
    ) -> Result<(), CloudError> {
        self.delete_if(what, path, api_version, &[]).await
    }

    /// DELETE under `conditions` (`If-Match`).
    pub async fn delete_if(
        &self,
        what: &str,
        path: &str,
        api_version: &str,
        conditions: &[(&str, &str)],
    ) -> Result<(), CloudError> {
        let a = match self
            .call("DELETE", path, Some(api_version), None, conditions)
            .await
        {
            Ok(a) => a,
            Err(e) if e.is_not_found() => return Ok(()),
            Err(e) => return Err(failed(what, e)),
        };
        self.follow(what, &a, path, api_version, true)
            .await
            .map_err(|e| failed(what, e))
    }

    /// Waits until the operation that `first` started is over.
    async fn follow(
        &self,
        what: &str,
        first: &Answer,
        path: &str,
        api_version: &str,
        deleting: bool,
    ) -> Result<(), ArmError> {
        let deadline = Instant::now() + OPERATION_TIMEOUT;
        let mut wait = poll_interval(first);
        if let Some(url) = first.header("azure-asyncoperation").map(str::to_string) {
            loop {
                self.pause(what, wait, deadline).await?;
                let a = self.call("GET", &url, None, None, &[]).await?;
                wait = poll_interval(&a);
                match a.body["status"].as_str().unwrap_or("") {
                    s if s.eq_ignore_ascii_case("Succeeded") => return Ok(()),
                    s if s.eq_ignore_ascii_case("Failed") || s.eq_ignore_ascii_case("Canceled") => {
                        return Err(ArmError {
                            status: a.status,
                            code: a.body["error"]["code"].as_str().unwrap_or(s).to_string(),
                            message: format!(
                                "the long-running operation {s}: {}",
                                a.body["error"]["message"]
                                    .as_str()
                                    .unwrap_or("(no message)")
                            ),
                        })
                    }
                    _ => {}
                }
            }
        }
        if first.status == 202 {
            if let Some(url) = first.header("location").map(str::to_string) {
                loop {
                    self.pause(what, wait, deadline).await?;
                    let a = self.call("GET", &url, None, None, &[]).await?;
                    if a.status != 202 {
                        return Ok(());
                    }
                    wait = poll_interval(&a);
                }
            }
        }
        if deleting {
            return Ok(());
        }
        // No operation URL: the resource's own provisioningState.
        let mut state = provisioning_state(&first.body).map(str::to_string);
        while state.as_deref().is_some_and(|s| !terminal(s)) {
            self.pause(what, wait, deadline).await?;
            let a = self.call("GET", path, Some(api_version), None, &[]).await?;
            wait = poll_interval(&a);
            state = provisioning_state(&a.body).map(str::to_string);
        }
        Ok(())
    }

    async fn pause(&self, what: &str, wait: Duration, deadline: Instant) -> Result<(), ArmError> {
        if Instant::now() + wait > deadline {
            return Err(ArmError {
                status: 0,
                code: "OperationTimeout".into(),
                message: format!(
                    "{what}: the long-running operation did not finish within {}s",
                    OPERATION_TIMEOUT.as_secs()
                ),
            });
        }
        tokio::time::sleep(wait).await;
        Ok(())
    }
}

fn provisioning_state(body: &Value) -> Option<&str> {
    body["properties"]["provisioningState"].as_str()
}

fn terminal(state: &str) -> bool {
    ["Succeeded", "Failed", "Canceled"]
        .iter()
        .any(|t| t.eq_ignore_ascii_case(state))
}

/// The `Retry-After` of an answer (seconds), else the default, at most 60 s.
fn poll_interval(a: &Answer) -> Duration {
    a.header("retry-after")
        .and_then(|s| s.trim().parse::<u64>().ok())
        .map(Duration::from_secs)
        .unwrap_or(DEFAULT_POLL)
        .min(Duration::from_secs(60))
}

/// ARM's error envelope (`{"error": {"code", "message"}}`, or the older
/// `{"code", "message"}`), else the start of the body.
fn error_of(status: u16, body: &[u8]) -> ArmError {
    let v: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
    let e = if v["error"].is_object() {
        &v["error"]
    } else {
        &v
    };
    match (e["code"].as_str(), e["message"].as_str()) {
        (Some(code), message) => ArmError {
            status,
            code: code.to_string(),
            message: message.unwrap_or("").to_string(),
        },
        _ => ArmError {
            status,
            code: format!("HTTP{status}"),
            message: String::from_utf8_lossy(&body[..body.len().min(200)]).into_owned(),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_read_from_both_envelopes_and_name_the_operation() {
        let e = error_of(409, br#"{"error":{"code":"Conflict","message":"in use"}}"#);
        assert_eq!(
            (e.code.as_str(), e.message.as_str()),
            ("Conflict", "in use")
        );
        let e = error_of(400, br#"{"code":"BadRequest","message":"nope"}"#);
        assert_eq!(e.code, "BadRequest");
        let e = error_of(502, b"<html>bad gateway</html>");
        assert_eq!(
            (e.code.as_str(), e.message.as_str()),
            ("HTTP502", "<html>bad gateway</html>")
        );
        let CloudError::Failed(m) = failed(
            "load balancer PUT lbscale-d1",
            error_of(
                412,
                br#"{"error":{"code":"PreconditionFailed","message":"etag"}}"#,
            ),
        ) else {
            panic!()
        };
        assert_eq!(
            m,
            "Azure load balancer PUT lbscale-d1 (HTTP 412): PreconditionFailed: etag"
        );
    }

    #[test]
    fn polls_wait_what_azure_asks_within_bounds() {
        let a = |h: &[(&str, &str)]| Answer {
            status: 202,
            headers: h
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            body: Value::Null,
        };
        assert_eq!(
            poll_interval(&a(&[("retry-after", "3")])),
            Duration::from_secs(3)
        );
        assert_eq!(poll_interval(&a(&[])), DEFAULT_POLL);
        assert_eq!(
            poll_interval(&a(&[("Retry-After", "3600")])),
            Duration::from_secs(60)
        );
        assert!(terminal("succeeded") && !terminal("Updating"));
    }
}
