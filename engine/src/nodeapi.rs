//! The engine's side of the node management API (`proto/node.proto`).

use lbscale_proto::node_api_client::NodeApiClient;
use lbscale_proto::{DrainRequest, NodeConfig, StatsRequest};
/// What a node reports (re-exported for the daemon, the CLI and the tests).
pub use lbscale_proto::{ForwardStats, NodeStats, ServiceStats};
use std::time::Duration;
use tonic::metadata::MetadataValue;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Identity};

pub mod auth;

const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// How long the engine's client certificate for a group is used before a new
/// one is issued (it is valid from a day before its issue to a day after).
const ENGINE_CERT_REUSE: Duration = Duration::from_secs(3600);
const CALL_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Debug, thiserror::Error)]
pub enum NodeApiError {
    #[error("node management API at {addr} unreachable: {detail}")]
    Unreachable { addr: String, detail: String },
    /// The node applied a configuration with a higher fence (`Aborted`).
    #[error("node at {addr} has a newer configuration: {message}")]
    Superseded { addr: String, message: String },
    #[error("node at {addr} refused {call}: {status}: {message}")]
    Refused {
        addr: String,
        call: &'static str,
        status: String,
        message: String,
    },
}

type Authed = InterceptedService<Channel, BearerToken>;

#[derive(Clone)]
pub struct BearerToken(MetadataValue<tonic::metadata::Ascii>);

impl tonic::service::Interceptor for BearerToken {
    fn call(&mut self, mut req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        req.metadata_mut()
            .insert(lbscale_proto::AUTH_HEADER, self.0.clone());
        Ok(req)
    }
}

/// A connection to one node's management API: over TLS, the node proving it
/// is node `node_id` of the group (a certificate of the group's CA for
/// [`auth::node_name`]), the engine showing a client certificate of that CA,
/// and every call carrying the node's own token (docs/security.md).
pub struct NodeClient {
    addr: String,
    inner: NodeApiClient<Authed>,
}

/// What the engine shows a group's nodes and trusts them by: the group CA's
/// certificate and an engine client certificate of that CA with its key.
/// Deriving the CA and issuing a certificate cost more than a TLS handshake,
/// so a caller that dials a group's nodes often (the daemon, at every sample)
/// keeps one per group and issues it again once it is no longer
/// [`EngineCredentials::fresh`]. `Debug` leaves the key out.
pub struct EngineCredentials {
    ca_pem: String,
    cert_pem: String,
    key_pem: String,
    issued: std::time::Instant,
    issued_at: std::time::SystemTime,
}

impl std::fmt::Debug for EngineCredentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineCredentials")
            .field("key_pem", &"<redacted>")
            .finish_non_exhaustive()
    }
}

impl EngineCredentials {
    /// The group CA (derived from `group_secret`) and a new engine
    /// certificate of it, with a fresh key.
    pub fn issue(group_secret: &str) -> Result<EngineCredentials, String> {
        let ca = auth::GroupCa::derive(group_secret)?;
        let (cert_pem, key_pem) = ca.issue_engine()?;
        Ok(EngineCredentials {
            ca_pem: ca.cert_pem(),
            cert_pem,
            key_pem,
            issued: std::time::Instant::now(),
            issued_at: std::time::SystemTime::now(),
        })
    }

    /// Issued less than an hour ago: far within its validity (a day either
    /// side of its issue). By both clocks: the monotonic one stands still
    /// while the machine is suspended, the wall clock can be set back.
    pub fn fresh(&self) -> bool {
        let wall = std::time::SystemTime::now()
            .duration_since(self.issued_at)
            .is_ok_and(|d| d < ENGINE_CERT_REUSE);
        self.issued.elapsed() < ENGINE_CERT_REUSE && wall
    }
}

impl NodeClient {
    /// Dials `ip` (the private address that the cloud gave node `node_id`) for
    /// node `node_id` of the group whose secret is `group_secret`.
    pub async fn connect(
        ip: &str,
        port: u16,
        node_id: &str,
        group_secret: &str,
    ) -> Result<NodeClient, NodeApiError> {
        let creds =
            EngineCredentials::issue(group_secret).map_err(|detail| NodeApiError::Unreachable {
                addr: format!("{ip}:{port}"),
                detail,
            })?;
        Self::connect_with(&creds, ip, port, node_id, group_secret).await
    }

    /// [`NodeClient::connect`] with the group's engine credentials as the
    /// caller keeps them (`creds` must be those of `group_secret`'s group).
    pub async fn connect_with(
        creds: &EngineCredentials,
        ip: &str,
        port: u16,
        node_id: &str,
        group_secret: &str,
    ) -> Result<NodeClient, NodeApiError> {
        let addr = format!("{ip}:{port}");
        let unreachable = |detail: String| NodeApiError::Unreachable {
            addr: addr.clone(),
            detail,
        };
        let tls = ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(&creds.ca_pem))
            .identity(Identity::from_pem(&creds.cert_pem, &creds.key_pem))
            .domain_name(auth::node_name(node_id));
        let channel = Channel::from_shared(format!("https://{addr}"))
            .map_err(|e| unreachable(e.to_string()))?
            .tls_config(tls)
            .map_err(|e| unreachable(chain(&e)))?
            .connect_timeout(CONNECT_TIMEOUT)
            .timeout(CALL_TIMEOUT)
            .connect()
            .await
            .map_err(|e| {
                unreachable(format!(
                    "{} (expected node {node_id}'s certificate)",
                    chain(&e)
                ))
            })?;
        // The token is hex, so it is always valid ASCII metadata; never log it.
        let value: MetadataValue<_> = format!("Bearer {}", auth::node_token(group_secret, node_id))
            .parse()
            .map_err(|_| unreachable("token is not printable ASCII".into()))?;
        Ok(NodeClient {
            inner: NodeApiClient::with_interceptor(channel, BearerToken(value)),
            addr,
        })
    }

    fn refused(&self, call: &'static str, s: tonic::Status) -> NodeApiError {
        if s.code() == tonic::Code::Unavailable {
            return NodeApiError::Unreachable {
                addr: self.addr.clone(),
                detail: s.message().to_string(),
            };
        }
        if s.code() == tonic::Code::Aborted {
            return NodeApiError::Superseded {
                addr: self.addr.clone(),
                message: s.message().to_string(),
            };
        }
        NodeApiError::Refused {
            addr: self.addr.clone(),
            call,
            status: format!("{:?}", s.code()),
            message: s.message().to_string(),
        }
    }

    pub async fn configure(&mut self, config: NodeConfig) -> Result<u64, NodeApiError> {
        match self.inner.configure(config).await {
            Ok(r) => Ok(r.into_inner().applied_version),
            Err(s) => Err(self.refused("Configure", s)),
        }
    }

    pub async fn drain(&mut self, timeout: Duration) -> Result<u64, NodeApiError> {
        match self
            .inner
            .drain(DrainRequest {
                timeout_ms: timeout.as_millis() as u64,
            })
            .await
        {
            Ok(r) => Ok(r.into_inner().active_connections),
            Err(s) => Err(self.refused("Drain", s)),
        }
    }

    /// The node's statistics, CPU, memory and throughput over the last second.
    pub async fn stats(&mut self) -> Result<NodeStats, NodeApiError> {
        self.stats_over(Duration::ZERO).await
    }

    /// The node's statistics, CPU, memory and throughput as their means over
    /// the last `window` (the group's `stats_interval`).
    pub async fn stats_over(&mut self, window: Duration) -> Result<NodeStats, NodeApiError> {
        let req = StatsRequest {
            window_ms: window.as_millis() as u64,
        };
        match self.inner.get_stats(req).await {
            Ok(r) => Ok(r.into_inner()),
            Err(s) => Err(self.refused("GetStats", s)),
        }
    }
}

/// An error with its causes: tonic's transport error says only "transport
/// error", the reason (a certificate refused, say) is in its sources.
fn chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        out.push_str(": ");
        out.push_str(&s.to_string());
        source = s.source();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, SystemTime};

    #[test]
    fn engine_credentials_are_fresh_for_an_hour_by_both_clocks() {
        let mut c = EngineCredentials::issue("a group secret for the test").unwrap();
        assert!(c.fresh());
        // A machine suspended for two hours: the monotonic clock stood still.
        c.issued_at = SystemTime::now() - Duration::from_secs(2 * 3600);
        assert!(!c.fresh());
        // The wall clock set back past the issue.
        c.issued_at = SystemTime::now() + Duration::from_secs(60);
        assert!(!c.fresh());
        assert!(!format!("{c:?}").contains("PRIVATE KEY"));
    }
}
