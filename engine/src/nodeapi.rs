//! The engine's side of the node management API (`proto/node.proto`).

use http_body_util::{BodyExt, Full};
use lbscale_proto::node_api_client::NodeApiClient;
use lbscale_proto::{stats_http, DrainRequest, NodeConfig, StatsRequest};
/// What a node reports (re-exported for the daemon, the CLI and the tests).
pub use lbscale_proto::{ForwardStats, NodeStats, ServiceStats};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::HandshakeKind;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tonic::body::BoxBody;
use tonic::codegen::Bytes;
use tonic::codegen::{http, http::Uri, BoxFuture, Context, Poll, Service};
use tonic::metadata::MetadataValue;
use tonic::service::interceptor::InterceptedService;

pub mod auth;
mod sessions;
pub mod stats;
mod wire;

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

type Authed = InterceptedService<NodeConn, BearerToken>;

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
    resumed: bool,
}

/// What the engine shows a group's nodes and trusts them by: the group CA's
/// certificate and an engine client certificate of that CA with its key, made
/// into one TLS client configuration. Deriving the CA and issuing a
/// certificate cost more than a TLS handshake, so the engine keeps one per
/// group for its connections to the group's nodes (`Engine::node_credentials`;
/// [`NodeClient::connect`] issues its own, for a one-off connection) and
/// issues it again once it is no longer [`EngineCredentials::fresh`]. The
/// configuration also keeps the session tickets the nodes give, so that the
/// next connection to a node resumes its TLS session instead of checking
/// certificates again. `Debug` leaves the key out.
pub struct EngineCredentials {
    tls: Arc<rustls::ClientConfig>,
    /// The same, asking for the statistics call over HTTP/1.1 first
    /// ([`stats::StatsClient`]); the two share the session tickets.
    stats_tls: Arc<rustls::ClientConfig>,
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
        let tls = client_config(&ca.cert_pem(), &cert_pem, &key_pem)?;
        let mut stats_tls = tls.clone();
        stats_tls.alpn_protocols = vec![stats_http::ALPN.to_vec(), b"h2".to_vec()];
        Ok(EngineCredentials {
            tls: Arc::new(tls),
            stats_tls: Arc::new(stats_tls),
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
    let roots = group_ca_roots(ca_pem)?;
    let cert = CertificateDer::from_pem_slice(cert_pem.as_bytes())
        .map_err(|e| format!("the engine's certificate: {e}"))?;
    let key = PrivateKeyDer::from_pem_slice(key_pem.as_bytes())
        .map_err(|e| format!("the engine's key: {e}"))?;
    let mut config = rustls::ClientConfig::builder_with_provider(crypto_provider())
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

/// The group CA as the only root either side trusts.
fn group_ca_roots(ca_pem: &str) -> Result<rustls::RootCertStore, String> {
    let bad = |e: &dyn std::fmt::Display| format!("the group CA's certificate: {e}");
    let ca = CertificateDer::from_pem_slice(ca_pem.as_bytes()).map_err(|e| bad(&e))?;
    let mut roots = rustls::RootCertStore::empty();
    roots.add(ca).map_err(|e| bad(&e))?;
    Ok(roots)
}

/// A node's TLS server for its API as `lbscale-node` makes it (there from
/// its PEM files): its certificate, and a client certificate that the group
/// CA issued required; the ALPN and tickets as a real node's (HTTP/1.1 for
/// the statistics first, then gRPC's HTTP/2; one session ticket per
/// handshake). For stand-ins of a node: the daemon's benchmark and tests.
pub fn node_server_config(
    ca_pem: &str,
    cert_pem: &str,
    key_pem: &str,
) -> Result<rustls::ServerConfig, String> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let roots = group_ca_roots(ca_pem)?;
    let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
        Arc::new(roots),
        provider.clone(),
    )
    .build()
    .map_err(|e| format!("the group CA's certificate: {e}"))?;
    let cert = CertificateDer::from_pem_slice(cert_pem.as_bytes())
        .map_err(|e| format!("the node's certificate: {e}"))?;
    let key = PrivateKeyDer::from_pem_slice(key_pem.as_bytes())
        .map_err(|e| format!("the node's key: {e}"))?;
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS protocol versions: {e}"))?
        .with_client_cert_verifier(verifier)
        .with_single_cert(vec![cert], key)
        .map_err(|e| format!("the node's certificate and key: {e}"))?;
    config.alpn_protocols = vec![stats_http::ALPN.to_vec(), b"h2".to_vec()];
    config.send_tls13_tickets = 1;
    Ok(config)
}

/// The engine's ciphers, one provider shared by every group's configuration
/// (the daemon holds 10,000 of them). AES-128-GCM with SHA-256 comes first
/// (the node follows the client's order): TLS 1.3's key schedule, a share of
/// every resumed handshake, then runs on the CPU's SHA-256 instructions;
/// SHA-384 has none.
fn crypto_provider() -> Arc<rustls::crypto::CryptoProvider> {
    static PROVIDER: std::sync::OnceLock<Arc<rustls::crypto::CryptoProvider>> =
        std::sync::OnceLock::new();
    PROVIDER
        .get_or_init(|| {
            let mut provider = rustls::crypto::ring::default_provider();
            provider
                .cipher_suites
                .sort_by_key(|s| s.suite() != rustls::CipherSuite::TLS13_AES_128_GCM_SHA256);
            Arc::new(provider)
        })
        .clone()
}

/// One HTTP/2 connection to a node's API, as the generated client calls it.
/// A connection serves one client, a call at a time (the provider's and the
/// daemon's workflows; the daemon's samples only for a node that offers no
/// HTTP/1.1, [`stats::StatsClient`]), and each call drives the
/// connection itself until it has the whole answer: no task of its own, no
/// buffer task and no reconnect, unlike hyper's connection or tonic's
/// channel, whose tasks and wakeups cost more than a sample's one call. A
/// call that fails to reach the node is `Unavailable`, which [`NodeClient`]
/// reports as unreachable; a call the node resets (any RST_STREAM but
/// REFUSED_STREAM) is `Internal`, reported as a refusal ([`status_of`]).
pub struct NodeConn(Arc<tokio::sync::Mutex<H2>>);

type NodeIo = wire::Wire<tokio_rustls::client::TlsStream<tokio::net::TcpStream>>;

/// The connection's two halves: streams are opened by `send`, and bytes move
/// only while `conn` is polled. (Generic over its stream for the tests.)
struct H2<T = NodeIo> {
    send: h2::client::SendRequest<Bytes>,
    conn: h2::client::Connection<T, Bytes>,
    /// Why the connection ended, once it has (it is not polled again).
    ended: Option<String>,
}

/// What an HTTP/2 error of a call tells: the node reset this call's stream
/// (it had the request: a new connection would hear the same, a refusal),
/// or the connection failed, the node would not take the call
/// (`REFUSED_STREAM`: not processed) or h2 found its answer malformed, which
/// is Unavailable, worth one new connection.
fn status_of(e: &h2::Error) -> tonic::Status {
    let refused_stream = e.reason() == Some(h2::Reason::REFUSED_STREAM);
    if e.is_reset() && e.is_remote() && !refused_stream {
        tonic::Status::internal(format!("the node reset the call: {}", chain(e)))
    } else {
        tonic::Status::unavailable(chain(e))
    }
}

impl Service<http::Request<BoxBody>> for NodeConn {
    type Response = http::Response<BoxBody>;
    type Error = Box<dyn std::error::Error + Send + Sync>;
    type Future = BoxFuture<Self::Response, Self::Error>;

    /// Always ready: a closed connection fails in `call`, which reports it
    /// as Unavailable. (The generated client turns an error here into
    /// Unknown, which would read as a refusal.)
    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<BoxBody>) -> Self::Future {
        let h2 = self.0.clone();
        // The whole call, answer body included, is bounded by the client
        // ([`NodeClient`]'s `CALL_TIMEOUT`).
        Box::pin(async move {
            // The whole request (one message) first: it then goes out as
            // HEADERS and one DATA frame that ends the stream.
            let (parts, body) = req.into_parts();
            let body = body
                .collect()
                .await
                .map_err(|s| Box::new(s) as Self::Error)?
                .to_bytes();
            let mut h2 = h2.lock_owned().await;
            h2.exchange(http::Request::from_parts(parts, ()), body)
                .await
                .map_err(|s| Box::new(s) as Self::Error)
        })
    }
}

impl<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin> H2<T> {
    /// Sends one request and reads its whole answer, trailers (the gRPC
    /// status) included, polling the connection all along.
    async fn exchange(
        &mut self,
        req: http::Request<()>,
        body: Bytes,
    ) -> Result<http::Response<BoxBody>, tonic::Status> {
        let mut send = self.send.clone();
        // Without polling the connection when a stream can open at once: a
        // poll here would send the preface and SETTINGS of a new connection
        // in a flight of their own, not with the request. A closed kept
        // connection then fails at the answer, as Unavailable too.
        let ready = std::future::poll_fn(|cx| Poll::Ready(send.poll_ready(cx))).await;
        match ready {
            Poll::Ready(r) => r.map_err(|e| self.failed(&e))?,
            Poll::Pending => self
                .driving(std::future::poll_fn(|cx| send.poll_ready(cx)))
                .await?
                .map_err(|e| self.failed(&e))?,
        }
        let (answer, mut stream) = send
            .send_request(req, body.is_empty())
            .map_err(|e| self.failed(&e))?;
        if !body.is_empty() {
            stream.send_data(body, true).map_err(|e| self.failed(&e))?;
        }
        let answer = self.driving(answer).await?.map_err(|e| self.failed(&e))?;
        let (parts, mut recv) = answer.into_parts();
        let mut data = bytes::BytesMut::new();
        while let Some(chunk) = self.driving(recv.data()).await? {
            let chunk = chunk.map_err(|e| self.failed(&e))?;
            let _ = recv.flow_control().release_capacity(chunk.len());
            data.extend_from_slice(&chunk);
        }
        let trailers = self
            .driving(recv.trailers())
            .await?
            .map_err(|e| self.failed(&e))?;
        let body = Full::new(data.freeze()).with_trailers(std::future::ready(trailers.map(Ok)));
        Ok(http::Response::from_parts(parts, tonic::body::boxed(body)))
    }

    /// A step's HTTP/2 error as a status ([`status_of`]), with why the
    /// connection ended when it has: a stream's own error only says that
    /// its connection went.
    fn failed(&self, e: &h2::Error) -> tonic::Status {
        let status = status_of(e);
        match &self.ended {
            Some(why) if !status.message().contains(why.as_str()) => {
                tonic::Status::new(status.code(), format!("{}: {why}", status.message()))
            }
            _ => status,
        }
    }

    /// `step`'s output, the connection polled meanwhile: first, so that
    /// what it reads is there when `step` is polled. Once the connection
    /// has ended, a step that cannot complete fails with the reason it
    /// ended (kept for the steps after the one it ended on).
    async fn driving<F: Future>(&mut self, step: F) -> Result<F::Output, tonic::Status> {
        let mut step = std::pin::pin!(step);
        std::future::poll_fn(|cx| {
            if self.ended.is_none() {
                match std::pin::Pin::new(&mut self.conn).poll(cx) {
                    Poll::Ready(Ok(())) => {
                        self.ended = Some("the node closed the connection".to_string())
                    }
                    Poll::Ready(Err(e)) => self.ended = Some(chain(&e)),
                    Poll::Pending => {}
                }
            }
            match step.as_mut().poll(cx) {
                Poll::Ready(out) => Poll::Ready(Ok(out)),
                Poll::Pending => match &self.ended {
                    Some(why) => Poll::Ready(Err(tonic::Status::unavailable(why.clone()))),
                    None => Poll::Pending,
                },
            }
        })
        .await
    }
}

type NodeTls = tokio_rustls::client::TlsStream<tokio::net::TcpStream>;

/// Dials one node: TCP to its address, then TLS with the group's client
/// configuration `tls` for the node's certificate name, within
/// [`CONNECT_TIMEOUT`]. The socket, with zero linger, is reset rather than
/// left in TIME_WAIT when it is dropped: the daemon opens a connection per
/// sample to the nodes past its limit of kept connections.
async fn dial_tls(
    tls: Arc<rustls::ClientConfig>,
    ip: &str,
    port: u16,
    node_id: &str,
) -> Result<(String, NodeTls), NodeApiError> {
    let addr = format!("{ip}:{port}");
    let unreachable = |detail: String| NodeApiError::Unreachable {
        addr: addr.clone(),
        detail,
    };
    let name = ServerName::try_from(auth::node_name(node_id))
        .map_err(|e| unreachable(format!("node name: {e}")))?;
    let dial = async {
        let tcp = tokio::net::TcpStream::connect(&addr)
            .await
            .map_err(|e| e.to_string())?;
        tcp.set_nodelay(true).map_err(|e| e.to_string())?;
        tcp.set_zero_linger().map_err(|e| e.to_string())?;
        tokio_rustls::TlsConnector::from(tls)
            .connect(name, tcp)
            .await
            .map_err(|e| chain(&e))
    };
    match tokio::time::timeout(CONNECT_TIMEOUT, dial).await {
        Ok(Ok(s)) => Ok((addr, s)),
        Ok(Err(e)) => Err(unreachable(format!(
            "{e} (expected node {node_id}'s certificate)"
        ))),
        Err(_) => Err(unreachable(format!(
            "no connection within {} s",
            CONNECT_TIMEOUT.as_secs()
        ))),
    }
}

fn resumed(tls: &NodeTls) -> bool {
    tls.get_ref().1.handshake_kind() == Some(HandshakeKind::Resumed)
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
        let (addr, tls) = dial_tls(creds.tls.clone(), ip, port, node_id).await?;
        NodeClient::over(addr, tls, node_id, group_secret).await
    }

    /// A client over `tls`, a connection to `addr` that chose HTTP/2. The
    /// preface and SETTINGS are only gathered here: they go out with the
    /// first request. HTTP/2 writes through a [`wire::Wire`], a flight at a
    /// time, and nothing is written once the client is dropped.
    async fn over(
        addr: String,
        tls: NodeTls,
        node_id: &str,
        group_secret: &str,
    ) -> Result<NodeClient, NodeApiError> {
        let unreachable = |detail: String| NodeApiError::Unreachable {
            addr: addr.clone(),
            detail,
        };
        // `http`: the connection is TLS already; the origin names the node.
        let origin: Uri = format!("http://{addr}")
            .parse()
            .map_err(|e: http::uri::InvalidUri| unreachable(e.to_string()))?;
        let resumed = resumed(&tls);
        let (send, conn) = h2::client::Builder::new()
            .enable_push(false)
            .handshake(wire::Wire::new(tls))
            .await
            .map_err(|e| unreachable(chain(&e)))?;
        let conn = NodeConn(Arc::new(tokio::sync::Mutex::new(H2 {
            send,
            conn,
            ended: None,
        })));
        // The token is hex, so it is always valid ASCII metadata; never log it.
        let value: MetadataValue<_> = auth::bearer(group_secret, node_id)
            .parse()
            .map_err(|_| unreachable("token is not printable ASCII".into()))?;
        Ok(NodeClient {
            inner: NodeApiClient::with_origin(
                InterceptedService::new(conn, BearerToken(value)),
                origin,
            ),
            addr,
            resumed,
        })
    }

    /// Whether the connection's TLS handshake resumed a session of the same
    /// credentials with this node (no certificates checked again), rather
    /// than a full handshake.
    pub fn resumed_session(&self) -> bool {
        self.resumed
    }

    /// A call's answer, or why there is none: at most [`CALL_TIMEOUT`] for
    /// the whole call (its answer's body included), then unreachable.
    fn answer<T>(
        &self,
        call: &'static str,
        r: Result<Result<tonic::Response<T>, tonic::Status>, tokio::time::error::Elapsed>,
    ) -> Result<T, NodeApiError> {
        match r {
            Ok(Ok(r)) => Ok(r.into_inner()),
            Ok(Err(s)) => Err(self.refused(call, s)),
            Err(_) => Err(NodeApiError::Unreachable {
                addr: self.addr.clone(),
                detail: format!("{call}: no answer within {} s", CALL_TIMEOUT.as_secs()),
            }),
        }
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
        let r = tokio::time::timeout(CALL_TIMEOUT, self.inner.configure(config)).await;
        self.answer("Configure", r).map(|r| r.applied_version)
    }

    pub async fn drain(&mut self, timeout: Duration) -> Result<u64, NodeApiError> {
        let req = DrainRequest {
            timeout_ms: timeout.as_millis() as u64,
        };
        let r = tokio::time::timeout(CALL_TIMEOUT, self.inner.drain(req)).await;
        self.answer("Drain", r).map(|r| r.active_connections)
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
        let r = tokio::time::timeout(CALL_TIMEOUT, self.inner.get_stats(req)).await;
        self.answer("GetStats", r)
    }
}

/// An error with its causes: a TLS or HTTP/2 error's reason (a certificate
/// refused, say) is often only in its sources.
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

    /// An HTTP/2 client connection to a server on the far side of a pipe,
    /// which answers the first request with `answer`, then, with `end`,
    /// ends the connection with that error once the answer has gone out,
    /// and keeps its end of the pipe open until the test is over.
    async fn h2_against(
        answer: impl FnOnce(&mut h2::server::SendResponse<Bytes>) + Send + 'static,
        end: Option<h2::Reason>,
    ) -> H2<tokio::io::DuplexStream> {
        let (near, far) = tokio::io::duplex(1 << 16);
        tokio::spawn(async move {
            let mut conn = h2::server::handshake(far).await.unwrap();
            let Some(Ok((_req, mut respond))) = conn.accept().await else {
                return;
            };
            answer(&mut respond);
            // Polled for a moment: what `answer` queued goes out.
            let _ = tokio::time::timeout(Duration::from_millis(100), conn.accept()).await;
            if let Some(reason) = end {
                conn.abrupt_shutdown(reason);
            }
            while let Some(Ok(_)) = conn.accept().await {}
            // `conn` and `respond` live as long as this task: the pipe stays open.
            std::future::pending::<()>().await;
        });
        let (send, conn) = h2::client::handshake(near).await.unwrap();
        H2 {
            send,
            conn,
            ended: None,
        }
    }

    async fn call(h2: &mut H2<tokio::io::DuplexStream>) -> tonic::Status {
        let req = http::Request::post("http://node/lbscale.NodeApi/GetStats")
            .body(())
            .unwrap();
        let r = h2.exchange(req, Bytes::from_static(b"request")).await;
        r.expect_err("the call fails")
    }

    fn head(r: &mut h2::server::SendResponse<Bytes>) {
        r.send_response(http::Response::new(()), false).unwrap();
    }

    #[tokio::test]
    async fn a_call_the_node_resets_is_refused_and_one_it_refuses_to_take_is_unavailable() {
        let reset =
            |r: &mut h2::server::SendResponse<Bytes>| r.send_reset(h2::Reason::INTERNAL_ERROR);
        let s = call(&mut h2_against(reset, None).await).await;
        assert_eq!(s.code(), tonic::Code::Internal, "{s:?}");
        assert!(s.message().contains("the node reset the call"), "{s:?}");

        // Reset after the answer's head, while its body is read: the same.
        let later = |r: &mut h2::server::SendResponse<Bytes>| {
            let mut body = r.send_response(http::Response::new(()), false).unwrap();
            body.send_reset(h2::Reason::INTERNAL_ERROR);
        };
        let s = call(&mut h2_against(later, None).await).await;
        assert_eq!(s.code(), tonic::Code::Internal, "{s:?}");

        // REFUSED_STREAM: the node did not process it, a new connection may.
        let refused =
            |r: &mut h2::server::SendResponse<Bytes>| r.send_reset(h2::Reason::REFUSED_STREAM);
        let s = call(&mut h2_against(refused, None).await).await;
        assert_eq!(s.code(), tonic::Code::Unavailable, "{s:?}");
    }

    #[tokio::test]
    async fn a_connection_that_ends_mid_answer_is_unavailable_and_says_why_at_every_step() {
        let mut h2 = h2_against(head, Some(h2::Reason::ENHANCE_YOUR_CALM)).await;
        let first = call(&mut h2).await;
        assert_eq!(first.code(), tonic::Code::Unavailable, "{first:?}");
        let why = h2.ended.clone().expect("the connection has ended");
        assert!(why.contains("excessive load"), "{why}");
        assert!(first.message().contains("excessive load"), "{first:?}");
        // A step after the end fails with the same reason, not a generic one.
        let next = h2
            .driving(std::future::pending::<()>())
            .await
            .expect_err("the connection has ended");
        assert_eq!(next.code(), tonic::Code::Unavailable);
        assert_eq!(next.message(), why);
    }

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
