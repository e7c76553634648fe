//! A connection for a node's statistics, the call the daemon makes to every
//! node at every sample: HTTP/1.1 where the node offers it
//! ([`lbscale_proto::stats_http`]), so that a connection kept between
//! samples holds only its TLS session; gRPC over HTTP/2 to a node that
//! offers only that (an older `lbscale-node`).

use super::{auth, dial_tls, resumed, EngineCredentials, NodeApiError, NodeClient, NodeTls};
use super::{NodeStats, CALL_TIMEOUT};
use lbscale_proto::stats_http;
use prost::Message;
use std::time::Duration;
use tokio::io::AsyncWriteExt;

/// The longest refusal text kept from a node's answer.
const MAX_REASON: usize = 512;

/// One node's statistics connection, a call at a time.
pub struct StatsClient {
    addr: String,
    resumed: bool,
    conn: Conn,
}

#[allow(clippy::large_enum_variant)] // HTTP/1.1 is the common one
enum Conn {
    Http1 {
        io: NodeTls,
        host: String,
        /// `Bearer TOKEN`: a secret, never logged (the client has no `Debug`).
        authorization: String,
        /// The node said it closes the connection, or a call failed midway.
        done: bool,
        /// TCP keepalive is set ([`StatsClient::probe_while_idle`]).
        probed: bool,
    },
    Grpc(NodeClient),
}

impl StatsClient {
    /// Dials node `node_id` at `ip:port` with the group's engine
    /// credentials `creds` (those of `group_secret`'s group).
    pub async fn connect(
        creds: &EngineCredentials,
        ip: &str,
        port: u16,
        node_id: &str,
        group_secret: &str,
    ) -> Result<StatsClient, NodeApiError> {
        let (addr, tls) = dial_tls(creds.stats_tls.clone(), ip, port, node_id).await?;
        let resumed = resumed(&tls);
        let conn = if tls.get_ref().1.alpn_protocol() == Some(stats_http::ALPN) {
            Conn::Http1 {
                io: tls,
                host: auth::node_name(node_id),
                authorization: auth::bearer(group_secret, node_id),
                done: false,
                probed: false,
            }
        } else {
            Conn::Grpc(NodeClient::over(addr.clone(), tls, node_id, group_secret).await?)
        };
        Ok(StatsClient {
            addr,
            resumed,
            conn,
        })
    }

    /// Whether the TLS handshake resumed a session with this node.
    pub fn resumed_session(&self) -> bool {
        self.resumed
    }

    /// Over HTTP/1.1: cheap to keep between samples (no buffers while idle).
    pub fn lean(&self) -> bool {
        matches!(self.conn, Conn::Http1 { .. })
    }

    /// Has the kernel probe an HTTP/1.1 connection while it idles between
    /// samples (after 30 s, every 10 s, 3 times), so that the connection to
    /// a node gone without a word is closed after about a minute rather than
    /// held. Once per connection; a gRPC one is left as it is.
    pub fn probe_while_idle(&mut self) {
        let tcp = match &mut self.conn {
            Conn::Http1 { probed: true, .. } | Conn::Grpc(_) => return,
            Conn::Http1 { io, probed, .. } => {
                *probed = true;
                io.get_ref().0
            }
        };
        let probes = socket2::TcpKeepalive::new()
            .with_time(Duration::from_secs(30))
            .with_interval(Duration::from_secs(10))
            .with_retries(3);
        if let Err(e) = socket2::SockRef::from(tcp).set_tcp_keepalive(&probes) {
            tracing::debug!(addr = %self.addr, error = %e, "TCP keepalive not set");
        }
    }

    /// Whether another call may go over this connection.
    pub fn reusable(&self) -> bool {
        !matches!(self.conn, Conn::Http1 { done: true, .. })
    }

    /// The node's statistics, CPU, memory and throughput as their means over
    /// the last `window`, within [`CALL_TIMEOUT`]. A connection that failed
    /// (closed, reset, cut short) is `Unreachable`: a new one may do.
    pub async fn stats_over(&mut self, window: Duration) -> Result<NodeStats, NodeApiError> {
        let (io, host, authorization, done) = match &mut self.conn {
            Conn::Grpc(client) => return client.stats_over(window).await,
            Conn::Http1 {
                io,
                host,
                authorization,
                done,
                ..
            } => (io, host, authorization, done),
        };
        let unreachable = |detail: String| NodeApiError::Unreachable {
            addr: self.addr.clone(),
            detail,
        };
        if *done {
            return Err(unreachable("the connection is closed".into()));
        }
        // Until the whole answer is in, the connection is of no further use.
        *done = true;
        let call = async {
            io.write_all(&stats_http::request(host, window, authorization))
                .await?;
            io.flush().await?;
            stats_http::read_answer(io).await
        };
        let refused = |status: String, message: String| NodeApiError::Refused {
            addr: self.addr.clone(),
            call: "GetStats",
            status,
            message,
        };
        let answer = match tokio::time::timeout(CALL_TIMEOUT, call).await {
            Ok(Ok(a)) => a,
            // The node answered, with what is not an answer: a new
            // connection would hear the same.
            Ok(Err(e)) if e.kind() == std::io::ErrorKind::InvalidData => {
                return Err(refused("malformed".into(), e.to_string()))
            }
            Ok(Err(e)) => return Err(unreachable(format!("GetStats: {e}"))),
            Err(_) => {
                return Err(unreachable(format!(
                    "GetStats: no answer within {} s",
                    CALL_TIMEOUT.as_secs()
                )))
            }
        };
        // A 1xx head is not the final answer, which would still be unread:
        // such a connection is not used again.
        *done = !answer.keep_alive || answer.status < 200;
        if answer.status != 200 {
            let why: String = String::from_utf8_lossy(&answer.body)
                .chars()
                .take(MAX_REASON)
                .collect();
            return Err(refused(format!("HTTP {}", answer.status), why));
        }
        NodeStats::decode(answer.body.as_slice())
            .map_err(|e| refused("HTTP 200".into(), format!("not a NodeStats message: {e}")))
    }
}
