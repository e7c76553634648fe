//! gRPC management API (`NodeApi`) with bearer-token authentication.

use std::sync::Arc;
use std::time::Duration;

use lbscale_proto::node_api_server::NodeApi;
use lbscale_proto::{
    ConfigureReply, DrainReply, DrainRequest, NodeConfig, NodeStats, StatsRequest, AUTH_HEADER,
};
use tonic::{Request, Response, Status};

use crate::node::Node;

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

    async fn get_stats(&self, _req: Request<StatsRequest>) -> Result<Response<NodeStats>, Status> {
        Ok(Response::new(self.node.stats().await))
    }
}

/// Constant-time comparison (the length is not secret).
fn ct_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[allow(clippy::result_large_err)] // tonic's interceptor signature
pub fn interceptor(
    token: String,
) -> impl FnMut(Request<()>) -> Result<Request<()>, Status> + Send + Sync + Clone + 'static {
    let expected: Arc<Vec<u8>> = Arc::new(format!("Bearer {token}").into_bytes());
    move |req: Request<()>| {
        let ok = req
            .metadata()
            .get(AUTH_HEADER)
            .map(|v| ct_eq(v.as_bytes(), &expected))
            .unwrap_or(false);
        if ok {
            Ok(req)
        } else {
            Err(Status::unauthenticated("missing or invalid bearer token"))
        }
    }
}
