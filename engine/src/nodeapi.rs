//! The engine's side of the node management API (`proto/node.proto`).

use lbscale_proto::node_api_client::NodeApiClient;
use lbscale_proto::{DrainRequest, NodeConfig, StatsRequest};
/// What a node reports (re-exported for the daemon, the CLI and the tests).
pub use lbscale_proto::{ForwardStats, NodeStats, ServiceStats};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::HandshakeKind;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tonic::codegen::{http::Uri, BoxFuture, Context, Poll, Service};
use tonic::metadata::MetadataValue;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, Endpoint};

pub mod auth;
mod sessions;

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
    resumed: Arc<AtomicBool>,
}

/// What the engine shows a group's nodes and trusts them by: the group CA's
/// certificate and an engine client certificate of that CA with its key, made
/// into one TLS client configuration. Deriving the CA and issuing a
/// certificate cost more than a TLS handshake, so a caller that dials a
/// group's nodes often (the daemon, at every sample) keeps one per group and
/// issues it again once it is no longer [`EngineCredentials::fresh`]. The
/// configuration also keeps the session tickets the nodes give, so that the
/// next connection to a node resumes its TLS session instead of checking
/// certificates again. `Debug` leaves the key out.
pub struct EngineCredentials {
    tls: Arc<rustls::ClientConfig>,
    issued: std::time::Instant,
    issued_at: std::time::SystemTime,
}

impl std::fmt::Debug for EngineCredentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineCredentials")
            .field("key", &"<redacted>")
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
            tls: Arc::new(client_config(&ca.cert_pem(), &cert_pem, &key_pem)?),
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

/// The engine's TLS client for a group's nodes: only the group CA is trusted,
/// the engine's certificate is shown, gRPC's HTTP/2 is asked for, and the
/// nodes' session tickets are kept for resumption, one per node
/// ([`sessions::NodeSessions`]).
fn client_config(
    ca_pem: &str,
    cert_pem: &str,
    key_pem: &str,
) -> Result<rustls::ClientConfig, String> {
    // AES-128-GCM with SHA-256 first (the node follows the client's order):
    // TLS 1.3's key schedule, a share of every resumed handshake, then runs
    // on the CPU's SHA-256 instructions; SHA-384 has none.
    let mut provider = rustls::crypto::ring::default_provider();
    provider
        .cipher_suites
        .sort_by_key(|s| s.suite() != rustls::CipherSuite::TLS13_AES_128_GCM_SHA256);
    let provider = Arc::new(provider);
    let mut roots = rustls::RootCertStore::empty();
    let ca = CertificateDer::from_pem_slice(ca_pem.as_bytes())
        .map_err(|e| format!("the group CA's certificate: {e}"))?;
    roots
        .add(ca)
        .map_err(|e| format!("the group CA's certificate: {e}"))?;
    let cert = CertificateDer::from_pem_slice(cert_pem.as_bytes())
        .map_err(|e| format!("the engine's certificate: {e}"))?;
    let key = PrivateKeyDer::from_pem_slice(key_pem.as_bytes())
        .map_err(|e| format!("the engine's key: {e}"))?;
    let mut config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS protocol versions: {e}"))?
        .with_root_certificates(roots)
        .with_client_auth_cert(vec![cert], key)
        .map_err(|e| format!("the engine's certificate and key: {e}"))?;
    config.alpn_protocols = vec![b"h2".to_vec()];
    config.resumption =
        rustls::client::Resumption::store(Arc::new(sessions::NodeSessions::default()));
    Ok(config)
}

/// Dials one node: TCP to its address, then TLS with the group's client
/// configuration for the node's certificate name. The channel's connect
/// timeout bounds both.
#[derive(Clone)]
struct NodeConnector {
    addr: String,
    tls: tokio_rustls::TlsConnector,
    name: ServerName<'static>,
    /// Whether the last handshake resumed a session.
    resumed: Arc<AtomicBool>,
}

impl Service<Uri> for NodeConnector {
    type Response = hyper_util::rt::TokioIo<tokio_rustls::client::TlsStream<tokio::net::TcpStream>>;
    type Error = std::io::Error;
    type Future = BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _: Uri) -> Self::Future {
        let this = self.clone();
        Box::pin(async move {
            let tcp = tokio::net::TcpStream::connect(&this.addr).await?;
            tcp.set_nodelay(true)?;
            let tls = this.tls.connect(this.name, tcp).await?;
            let kind = tls.get_ref().1.handshake_kind();
            this.resumed
                .store(kind == Some(HandshakeKind::Resumed), Ordering::Relaxed);
            Ok(hyper_util::rt::TokioIo::new(tls))
        })
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
        let name = ServerName::try_from(auth::node_name(node_id))
            .map_err(|e| unreachable(format!("node name: {e}")))?;
        let resumed = Arc::new(AtomicBool::new(false));
        let connector = NodeConnector {
            addr: addr.clone(),
            tls: tokio_rustls::TlsConnector::from(creds.tls.clone()),
            name,
            resumed: resumed.clone(),
        };
        // `http`: the connector does the TLS, not tonic.
        let channel = Endpoint::from_shared(format!("http://{addr}"))
            .map_err(|e| unreachable(e.to_string()))?
            .connect_timeout(CONNECT_TIMEOUT)
            .timeout(CALL_TIMEOUT)
            .connect_with_connector(connector)
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
            resumed,
        })
    }

    /// Whether the connection's TLS handshake resumed a session of the same
    /// credentials with this node (no certificates checked again), rather
    /// than a full handshake.
    pub fn resumed_session(&self) -> bool {
        self.resumed.load(Ordering::Relaxed)
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
