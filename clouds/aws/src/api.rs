//! Signed calls to AWS's APIs over HTTP/1.1 (TLS unless the endpoint says
//! `http://`, which only a test endpoint such as moto's server does).
//!
//! Two shapes cover the driver: the query APIs of EC2 and ELBv2 (a form-encoded
//! `POST /` with `Action` and `Version`) and Route 53's REST API (XML bodies).
//! Every call has a deadline and names its action in errors; throttling answers
//! are retried with back-off. The response is the body's XML, parsed later by
//! [`super::xml`]. The credentials of each call come from a shared
//! [`SharedCredentials`], which refreshes temporary ones before they expire.
//! [`fetch`] is the same transport without a signature, for the instance and
//! container credential endpoints.

use super::credentials::SharedCredentials;
use super::sigv4::{self, Credentials};
use lbscale_cloud_http::{self as http, Bytes, Url};
use lbscale_engine::cloud::{CloudError, Result};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// How long one call (connection, request and the whole answer) may take.
const CALL_TIMEOUT: Duration = Duration::from_secs(30);
/// Attempts of a call that AWS throttled or that could not connect.
const ATTEMPTS: u32 = 4;

/// The AWS services the driver calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Service {
    Ec2,
    Elb,
    Route53,
    Sts,
}

impl Service {
    /// The name in the signature's scope.
    fn signing_name(self) -> &'static str {
        match self {
            Service::Ec2 => "ec2",
            Service::Elb => "elasticloadbalancing",
            Service::Route53 => "route53",
            Service::Sts => "sts",
        }
    }
    /// Route 53 is global within a partition: signed for the partition's
    /// first region whatever the region.
    fn signing_region(self, region: &str) -> String {
        match (self, Partition::of(region)) {
            (Service::Route53, Partition::Aws) => "us-east-1".into(),
            (Service::Route53, Partition::China) => "cn-northwest-1".into(),
            (Service::Route53, Partition::GovCloud) => "us-gov-west-1".into(),
            _ => region.into(),
        }
    }
    fn default_host(self, region: &str) -> String {
        let suffix = match Partition::of(region) {
            Partition::China => "amazonaws.com.cn",
            _ => "amazonaws.com",
        };
        match (self, Partition::of(region)) {
            (Service::Ec2, _) => format!("ec2.{region}.{suffix}"),
            (Service::Elb, _) => format!("elasticloadbalancing.{region}.{suffix}"),
            // The regional endpoint, as AWS's SDKs use now.
            (Service::Sts, _) => format!("sts.{region}.{suffix}"),
            (Service::Route53, Partition::Aws) => "route53.amazonaws.com".into(),
            (Service::Route53, Partition::China) => "route53.amazonaws.com.cn".into(),
            (Service::Route53, Partition::GovCloud) => "route53.us-gov.amazonaws.com".into(),
        }
    }
}

/// AWS's partitions: their own endpoints and their own global region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Partition {
    Aws,
    China,
    GovCloud,
}

impl Partition {
    fn of(region: &str) -> Partition {
        if region.starts_with("cn-") {
            Partition::China
        } else if region.starts_with("us-gov-") {
            Partition::GovCloud
        } else {
            Partition::Aws
        }
    }
}

/// Where calls go: AWS's public endpoint of each service, or one endpoint for
/// all of them (`endpoint` in the provider's `aws` block, `AWS_ENDPOINT_URL`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    pub tls: bool,
    pub host: String,
    pub port: u16,
}

impl Endpoint {
    /// Parses `http://HOST[:PORT]` or `https://HOST[:PORT]` (a trailing `/` is
    /// fine; no path).
    pub fn parse(url: &str) -> std::result::Result<Endpoint, String> {
        let (endpoint, path) = Endpoint::parse_url(url)?;
        if path != "/" {
            return Err(format!(
                "endpoint {url:?}: a host, and nothing after it but a port; expected http(s)://HOST[:PORT]"
            ));
        }
        Ok(endpoint)
    }

    /// Parses `http(s)://HOST[:PORT][/PATH]`: the endpoint and the path (`/`
    /// when there is none), for the credential endpoints' URLs.
    pub fn parse_url(url: &str) -> std::result::Result<(Endpoint, String), String> {
        let u = Url::parse(url).map_err(|e| format!("endpoint: {e}"))?;
        Ok((
            Endpoint {
                tls: u.tls,
                host: u.host,
                port: u.port,
            },
            u.path,
        ))
    }

    /// The `Host` header: the port only when it is not the scheme's default.
    fn host_header(&self) -> String {
        http::host_header(self.tls, &self.host, self.port)
    }
}

/// An answer that AWS refused, with AWS's error code and message.
#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: u16,
    pub code: String,
    pub message: String,
}

/// A client of the AWS APIs in one region with one source of credentials,
/// shared by all its calls.
pub struct AwsApi {
    region: String,
    endpoint: Option<Endpoint>,
    credentials: Arc<SharedCredentials>,
    tls: Arc<rustls::ClientConfig>,
}

impl AwsApi {
    pub fn new(
        region: String,
        endpoint: Option<Endpoint>,
        credentials: Arc<SharedCredentials>,
        tls: Arc<rustls::ClientConfig>,
    ) -> AwsApi {
        AwsApi {
            region,
            endpoint,
            credentials,
            tls,
        }
    }

    pub fn region(&self) -> &str {
        &self.region
    }

    /// The credentials that calls are signed with.
    pub fn credentials(&self) -> &Arc<SharedCredentials> {
        &self.credentials
    }

    /// An AWS error message as it may be shown: a signature mismatch quotes the
    /// canonical request (with the session token) and is cut there, and the
    /// secret and the token of `creds` (those the call was signed with) never
    /// appear.
    fn redacted(message: String, creds: Option<&Credentials>) -> String {
        let mut m = match message.find("The Canonical String") {
            Some(at) => format!("{}(canonical request not shown)", &message[..at]),
            None => message,
        };
        let secrets = [
            creds.map(|c| c.secret_access_key.as_str()),
            creds.and_then(|c| c.session_token.as_deref()),
        ];
        for secret in secrets.into_iter().flatten().filter(|s| !s.is_empty()) {
            m = m.replace(secret, "<redacted>");
        }
        m
    }

    /// A query-API call (EC2, ELBv2): `Action` with `params`; the body of the
    /// answer, or an error naming the action and AWS's code.
    pub async fn query(
        &self,
        service: Service,
        action: &str,
        version: &str,
        params: &[(String, String)],
    ) -> Result<String> {
        self.query_as(true, service, action, version, params).await
    }

    /// A query-API call sent without a signature (STS's
    /// `AssumeRoleWithWebIdentity`, whose token is the proof).
    pub async fn query_unsigned(
        &self,
        service: Service,
        action: &str,
        version: &str,
        params: &[(String, String)],
    ) -> Result<String> {
        self.query_as(false, service, action, version, params).await
    }

    async fn query_as(
        &self,
        signed: bool,
        service: Service,
        action: &str,
        version: &str,
        params: &[(String, String)],
    ) -> Result<String> {
        let mut form = vec![
            ("Action".to_string(), action.to_string()),
            ("Version".to_string(), version.to_string()),
        ];
        form.extend(params.iter().cloned());
        let body = form
            .iter()
            .map(|(k, v)| format!("{}={}", sigv4::uri_encode(k), sigv4::uri_encode(v)))
            .collect::<Vec<_>>()
            .join("&");
        self.call(
            signed,
            service,
            action,
            "POST",
            "/",
            Some(("application/x-www-form-urlencoded; charset=utf-8", body)),
        )
        .await
        .map_err(|e| failed(service, action, e))
    }

    /// A REST call (Route 53): `method` on `path` with an optional XML body.
    /// `what` names the call in errors.
    pub async fn rest(
        &self,
        service: Service,
        what: &str,
        method: &str,
        path: &str,
        xml: Option<String>,
    ) -> std::result::Result<String, ApiError> {
        self.call(
            true,
            service,
            what,
            method,
            path,
            xml.map(|b| ("text/xml", b)),
        )
        .await
    }

    async fn call(
        &self,
        signed: bool,
        service: Service,
        what: &str,
        method: &str,
        path: &str,
        body: Option<(&str, String)>,
    ) -> std::result::Result<String, ApiError> {
        let endpoint = match &self.endpoint {
            Some(e) => e.clone(),
            None => Endpoint {
                tls: true,
                host: service.default_host(&self.region),
                port: 443,
            },
        };
        let mut delay = Duration::from_millis(200);
        let mut attempt = 1;
        let mut renewed = false;
        loop {
            let creds = if signed {
                Some(self.credentials.get().await.map_err(|message| ApiError {
                    status: 0,
                    code: "NoCredentials".into(),
                    message,
                })?)
            } else {
                None
            };
            let r = tokio::time::timeout(
                CALL_TIMEOUT,
                self.once(
                    service,
                    &endpoint,
                    method,
                    path,
                    body.as_ref(),
                    creds.as_ref(),
                ),
            )
            .await
            .unwrap_or_else(|_| {
                Err(ApiError {
                    status: 0,
                    code: "Timeout".into(),
                    message: format!(
                        "no answer from {}:{} within {}s",
                        endpoint.host,
                        endpoint.port,
                        CALL_TIMEOUT.as_secs()
                    ),
                })
            });
            match r {
                // Temporary credentials that AWS finds expired before their
                // stated time (a clock ahead): fetched anew, once.
                Err(e) if signed && !renewed && expired(&e) => {
                    tracing::debug!(call = what, code = %e.code, "AWS credentials expired early; fetching new ones");
                    self.credentials.invalidate().await;
                    renewed = true;
                }
                Err(e) if attempt < ATTEMPTS && retryable(&e) => {
                    tracing::debug!(call = what, attempt, code = %e.code, "retrying an AWS call");
                    tokio::time::sleep(delay).await;
                    delay *= 2;
                    attempt += 1;
                }
                other => return other,
            }
        }
    }

    async fn once(
        &self,
        service: Service,
        endpoint: &Endpoint,
        method: &str,
        path: &str,
        body: Option<&(&str, String)>,
        creds: Option<&Credentials>,
    ) -> std::result::Result<String, ApiError> {
        let host = endpoint.host_header();
        let content: &[u8] = body.map(|(_, b)| b.as_bytes()).unwrap_or(b"");
        let headers: Vec<(String, String)> = body
            .map(|(ct, _)| vec![("content-type".to_string(), ct.to_string())])
            .unwrap_or_default();
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs() as i64)
            .unwrap_or(0);
        // The query is signed as its parameters, and sent as it was signed.
        let (path, query) = sigv4::split_query(path);
        let uri = if query.is_empty() {
            path.clone()
        } else {
            format!("{path}?{}", sigv4::canonical_query(&query))
        };
        let request = sigv4::Request {
            method,
            host: &host,
            path: &path,
            query: &query,
            headers: &headers,
            body: content,
        };
        let signed = match creds {
            Some(creds) => sigv4::sign(
                &request,
                creds,
                &service.signing_region(&self.region),
                service.signing_name(),
                now,
            ),
            None => {
                let mut h = headers.clone();
                h.push(("host".into(), host.clone()));
                h
            }
        };
        let mut req = http::request().method(method).uri(uri);
        for (k, v) in &signed {
            req = req.header(k.as_str(), v.as_str());
        }
        let req = req
            .header("content-length", content.len())
            .body(Bytes::copy_from_slice(content).into())
            .map_err(|e| transport(format!("building the request: {e}")))?;
        let answer = http::round_trip(&self.tls, endpoint.tls, &endpoint.host, endpoint.port, req)
            .await
            .map_err(transport)?;
        let status = answer.status;
        let text = String::from_utf8_lossy(&answer.body).into_owned();
        if (200..300).contains(&status) {
            return Ok(text);
        }
        let (code, message) = super::xml::error_code_and_message(&text).unwrap_or_else(|| {
            (
                format!("HTTP{status}"),
                text.chars().take(200).collect::<String>(),
            )
        });
        let message = AwsApi::redacted(message, creds);
        Err(ApiError {
            status,
            code,
            message,
        })
    }
}

/// An unsigned request to `url` (`http(s)://HOST[:PORT]/PATH`) with
/// `headers`, answered within `deadline`: the status and the body. For the
/// instance metadata service and the container credential endpoint; the
/// error names the URL and what went wrong, never a header's value.
pub async fn fetch(
    tls: &Arc<rustls::ClientConfig>,
    method: &str,
    url: &str,
    headers: &[(&str, &str)],
    deadline: Duration,
) -> std::result::Result<(u16, String), String> {
    let url = Url::parse(url)?;
    let r = http::send(tls, method, &url, headers, None, deadline).await?;
    Ok((r.status, String::from_utf8_lossy(&r.body).into_owned()))
}

fn transport(message: String) -> ApiError {
    ApiError {
        status: 0,
        code: "Transport".into(),
        message,
    }
}

/// Throttling, AWS's own transient failures and connections that failed.
fn retryable(e: &ApiError) -> bool {
    // A call that timed out is retried too: every call the driver makes is
    // idempotent (RunInstances carries a client token).
    matches!(
        e.code.as_str(),
        "Timeout"
            | "Throttling"
            | "ThrottlingException"
            | "RequestLimitExceeded"
            | "PriorRequestNotComplete"
            | "ServiceUnavailable"
            | "InternalError"
            | "Transport"
    ) || e.status >= 500
}

/// AWS's answer to temporary credentials past their expiry.
fn expired(e: &ApiError) -> bool {
    matches!(
        e.code.as_str(),
        "ExpiredToken" | "ExpiredTokenException" | "RequestExpired"
    )
}

/// A refused call as the engine reports it: the service, the call, AWS's code
/// and message.
pub fn failed(service: Service, what: &str, e: ApiError) -> CloudError {
    let status = if e.status > 0 {
        format!(" (HTTP {})", e.status)
    } else {
        String::new()
    };
    CloudError::Failed(format!(
        "AWS {} {what}{status}: {}: {}",
        service.signing_name(),
        e.code,
        e.message
    ))
}

#[cfg(test)]
mod tests {
    use super::{AwsApi, Credentials, Endpoint, Service};

    #[test]
    fn each_partition_has_its_endpoints_and_route53_region() {
        assert_eq!(
            Service::Ec2.default_host("eu-west-1"),
            "ec2.eu-west-1.amazonaws.com"
        );
        assert_eq!(Service::Route53.signing_region("eu-west-1"), "us-east-1");
        assert_eq!(
            Service::Ec2.default_host("cn-north-1"),
            "ec2.cn-north-1.amazonaws.com.cn"
        );
        assert_eq!(
            Service::Route53.default_host("cn-north-1"),
            "route53.amazonaws.com.cn"
        );
        assert_eq!(
            Service::Route53.signing_region("cn-north-1"),
            "cn-northwest-1"
        );
        assert_eq!(
            Service::Route53.default_host("us-gov-east-1"),
            "route53.us-gov.amazonaws.com"
        );
        assert_eq!(
            Service::Route53.signing_region("us-gov-east-1"),
            "us-gov-west-1"
        );
        assert_eq!(
            Service::Elb.signing_region("us-gov-east-1"),
            "us-gov-east-1"
        );
        assert_eq!(
            Service::Sts.default_host("eu-west-1"),
            "sts.eu-west-1.amazonaws.com"
        );
        assert_eq!(
            Service::Sts.default_host("cn-north-1"),
            "sts.cn-north-1.amazonaws.com.cn"
        );
    }

    #[test]
    fn error_messages_never_show_the_secret_or_the_token() {
        let creds = Credentials {
            access_key_id: "AKID".into(),
            secret_access_key: "SECRETKEY".into(),
            session_token: Some("TOKENVALUE".into()),
        };
        let m = AwsApi::redacted(
            "The request signature we calculated does not match. The Canonical String for this request should have been\n'GET\nx-amz-security-token:TOKENVALUE'".into(),
            Some(&creds),
        );
        assert!(
            !m.contains("TOKENVALUE") && m.contains("does not match"),
            "{m}"
        );
        let m = AwsApi::redacted("echoed SECRETKEY and TOKENVALUE".into(), Some(&creds));
        assert_eq!(m, "echoed <redacted> and <redacted>");
    }

    #[test]
    fn endpoints_parse_and_refuse_by_name() {
        assert_eq!(
            Endpoint::parse("http://127.0.0.1:5000/").unwrap(),
            Endpoint {
                tls: false,
                host: "127.0.0.1".into(),
                port: 5000
            }
        );
        assert_eq!(Endpoint::parse("https://aws.example").unwrap().port, 443);
        let v6 = Endpoint::parse("http://[::1]:5000").unwrap();
        assert_eq!((v6.host.as_str(), v6.port), ("::1", 5000));
        assert_eq!(v6.host_header(), "[::1]:5000");
        assert_eq!(
            Endpoint::parse("https://[::1]").unwrap().host_header(),
            "[::1]"
        );
        let (e, path) = Endpoint::parse_url("http://169.254.170.2/v2/credentials/abc?x=1").unwrap();
        assert_eq!(
            (e.host.as_str(), e.port, path.as_str()),
            ("169.254.170.2", 80, "/v2/credentials/abc?x=1")
        );
        let (e, path) = Endpoint::parse_url("http://[fd00:ec2::254]").unwrap();
        assert_eq!((e.host.as_str(), path.as_str()), ("fd00:ec2::254", "/"));
        for bad in [
            "ftp://x",
            "http://",
            "http://h:99999",
            "https://h/path",
            "127.0.0.1:5000",
        ] {
            let e = Endpoint::parse(bad).unwrap_err();
            assert!(
                e.contains("endpoint") && e.contains("http(s)://HOST[:PORT]"),
                "{e}"
            );
        }
    }
}
