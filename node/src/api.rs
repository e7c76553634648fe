//! gRPC management API (`NodeApi`) over TLS with the engine's client
//! certificate, a bearer token of this node's own, and calls made to this
//! node's private address only (docs/security.md).

use sha2::Digest;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use lbscale_proto::node_api_server::NodeApi;
use lbscale_proto::stats_http;
use lbscale_proto::{
    ConfigureReply, DrainReply, DrainRequest, NodeConfig, NodeStats, StatsRequest, AUTH_HEADER,
};
use tonic::{Request, Response, Status};

use crate::bounds::{accept, Backoff};
use crate::node::Node;

/// How long a client gets to finish its TLS handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

type ApiStream = tokio_rustls::server::TlsStream<tokio::net::TcpStream>;

/// How long a statistics connection (HTTP/1.1) may stay idle between
/// requests: the daemon asks at every stats interval and keeps it between.
const STATS_IDLE: Duration = Duration::from_secs(15 * 60);

/// The management API's connections, TLS done. An accept error (no descriptor
/// left) is logged and waited out, and a failed or stalled handshake ends that
/// connection only: the API never stops listening, where tonic's own listener
/// ends the server on either. A connection that chose HTTP/1.1 (ALPN) is the
/// statistics call's ([`lbscale_proto::stats_http`]) and is served here by
/// `stats`; the others are gRPC's.
pub fn incoming(
    listener: tokio::net::TcpListener,
    tls: rustls::ServerConfig,
    stats: StatsCall,
) -> tokio_stream::wrappers::ReceiverStream<std::io::Result<ApiStream>> {
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(tls));
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    tokio::spawn(async move {
        let mut backoff = Backoff::default();
        loop {
            let (s, peer) = accept(&listener, &mut backoff, "api").await;
            let _ = s.set_nodelay(true);
            let (acceptor, conns, stats) = (acceptor.clone(), tx.clone(), stats.clone());
            tokio::spawn(async move {
                match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(s)).await {
                    Ok(Ok(s)) if s.get_ref().1.alpn_protocol() == Some(stats_http::ALPN) => {
                        if let Err(e) = stats.serve(s).await {
                            tracing::debug!(%peer, error = %e, "api: statistics connection ended");
                        }
                    }
                    Ok(Ok(s)) => {
                        let _ = conns.send(Ok(s)).await;
                    }
                    Ok(Err(e)) => tracing::warn!(%peer, error = %e, "api: TLS handshake refused"),
                    Err(_) => {
                        tracing::warn!(%peer, "api: TLS handshake not done within {HANDSHAKE_TIMEOUT:?}")
                    }
                }
            });
            if tx.is_closed() {
                return;
            }
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(rx)
}

/// The statistics call over HTTP/1.1, under the same checks as gRPC's
/// ([`interceptor`]): made to the node's private address, with its token.
#[derive(Clone)]
pub struct StatsCall {
    pub node: Arc<Node>,
    pub expected: ExpectedToken,
    pub address: IpAddr,
}

impl StatsCall {
    async fn serve(self, s: ApiStream) -> std::io::Result<()> {
        let local = s.get_ref().0.local_addr().ok();
        stats_http::serve(s, STATS_IDLE, move |asked| {
            let call = self.clone();
            async move {
                if let Err(why) = made_to(local, call.address) {
                    return stats_http::Reply::Refused(403, why);
                }
                let ok = asked
                    .authorization
                    .is_some_and(|v| call.expected.accepts(&v));
                if !ok {
                    return stats_http::Reply::Refused(401, NO_TOKEN.into());
                }
                stats_http::Reply::Stats(call.node.stats(asked.window).await)
            }
        })
        .await
    }
}

const NO_TOKEN: &str = "missing or invalid bearer token";

/// Whether a call came in at `local`, the node's private `address`.
fn made_to(local: Option<std::net::SocketAddr>, address: IpAddr) -> Result<(), String> {
    match local {
        Some(a) if a.ip() == address => Ok(()),
        to => Err(format!(
            "this node's API answers calls made to its private address {address} only, not to {}",
            to.map_or("an unknown address".into(), |a| a.ip().to_string())
        )),
    }
}

pub struct Api {
    pub node: Arc<Node>,
}

#[tonic::async_trait]
impl NodeApi for Api {
    async fn configure(
        &self,
        req: Request<NodeConfig>,
    ) -> Result<Response<ConfigureReply>, Status> {
        let cfg = req.into_inner();
        let version = cfg.version;
        let n = cfg.vservers.len();
        match self.node.configure(cfg).await {
            Ok(v) => {
                tracing::info!(version = v, vservers = n, "configuration applied");
                Ok(Response::new(ConfigureReply { applied_version: v }))
            }
            Err(e) => {
                tracing::warn!(version, error = %e.message(), "configuration refused");
                Err(e)
            }
        }
    }

    async fn drain(&self, req: Request<DrainRequest>) -> Result<Response<DrainReply>, Status> {
        let timeout = Duration::from_millis(req.into_inner().timeout_ms);
        let active = self.node.drain(timeout).await;
        Ok(Response::new(DrainReply {
            active_connections: active,
        }))
    }

    async fn get_stats(&self, req: Request<StatsRequest>) -> Result<Response<NodeStats>, Status> {
        let window = Duration::from_millis(req.into_inner().window_ms);
        Ok(Response::new(self.node.stats(window).await))
    }
}

/// Constant-time comparison (the length is not secret).
fn ct_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// What the token file holds: the token itself, or `sha256:HEX`, the SHA-256 of
/// the token, so that a node whose configuration others can read (a cloud
/// instance's user data) never holds the secret itself.
#[derive(Clone)]
pub enum ExpectedToken {
    /// `Bearer TOKEN`, as the header carries it.
    Plain(Arc<Vec<u8>>),
    Sha256([u8; 32]),
}

impl ExpectedToken {
    /// From the token file's (trimmed) content; an error says what is wrong.
    pub fn parse(content: &str) -> Result<ExpectedToken, String> {
        let Some(hex) = content.strip_prefix("sha256:") else {
            return Ok(ExpectedToken::Plain(Arc::new(
                format!("Bearer {content}").into_bytes(),
            )));
        };
        let bytes: Vec<u8> = (0..hex.len())
            .step_by(2)
            .filter_map(|i| {
                hex.get(i..i + 2)
                    .and_then(|b| u8::from_str_radix(b, 16).ok())
            })
            .collect();
        match <[u8; 32]>::try_from(bytes.as_slice()) {
            Ok(h) if hex.len() == 64 => Ok(ExpectedToken::Sha256(h)),
            _ => Err("sha256: must be followed by 64 hex digits".into()),
        }
    }

    fn accepts(&self, header: &[u8]) -> bool {
        match self {
            ExpectedToken::Plain(expected) => ct_eq(header, expected),
            ExpectedToken::Sha256(hash) => header
                .strip_prefix(b"Bearer ")
                .is_some_and(|token| ct_eq(&sha2::Sha256::digest(token), hash)),
        }
    }
}

/// Accepts a call made to `address` (the node's private address: its token
/// is bound to it) that carries this node's token.
#[allow(clippy::result_large_err)] // tonic's interceptor signature
pub fn interceptor(
    expected: ExpectedToken,
    address: IpAddr,
) -> impl FnMut(Request<()>) -> Result<Request<()>, Status> + Send + Sync + Clone + 'static {
    move |req: Request<()>| {
        made_to(req.local_addr(), address).map_err(Status::permission_denied)?;
        let ok = req
            .metadata()
            .get(AUTH_HEADER)
            .map(|v| expected.accepts(v.as_bytes()))
            .unwrap_or(false);
        if ok {
            Ok(req)
        } else {
            Err(Status::unauthenticated(NO_TOKEN))
        }
    }
}
