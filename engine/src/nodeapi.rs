//! The engine's side of the node management API (`proto/node.proto`).

use lbscale_proto::node_api_client::NodeApiClient;
use lbscale_proto::{DrainRequest, NodeConfig, StatsRequest};
/// What a node reports (re-exported for the daemon, the CLI and the tests).
pub use lbscale_proto::{ForwardStats, NodeStats, ServiceStats};
use std::time::Duration;
use tonic::metadata::MetadataValue;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;

const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
const CALL_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Debug, thiserror::Error)]
pub enum NodeApiError {
    #[error("node management API at {addr} unreachable: {detail}")]
    Unreachable { addr: String, detail: String },
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

/// A connection to one node's management API, authenticated with the group's token.
pub struct NodeClient {
    addr: String,
    inner: NodeApiClient<Authed>,
}

impl NodeClient {
    pub async fn connect(ip: &str, port: u16, token: &str) -> Result<NodeClient, NodeApiError> {
        let addr = format!("{ip}:{port}");
        let unreachable = |detail: String| NodeApiError::Unreachable {
            addr: addr.clone(),
            detail,
        };
        let channel = Channel::from_shared(format!("http://{addr}"))
            .map_err(|e| unreachable(e.to_string()))?
            .connect_timeout(CONNECT_TIMEOUT)
            .timeout(CALL_TIMEOUT)
            .connect()
            .await
            .map_err(|e| unreachable(e.to_string()))?;
        // The token is hex, so it is always valid ASCII metadata; never log it.
        let value: MetadataValue<_> = format!("Bearer {token}")
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
