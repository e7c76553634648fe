//! Generated types and client/server of the node management API (`proto/node.proto`).

pub mod node {
    pub mod v1 {
        tonic::include_proto!("lbscale.node.v1");
    }
}

pub use node::v1::*;

pub mod stats_http;

/// The metadata key that carries the group's secret: `authorization: Bearer <token>`.
pub const AUTH_HEADER: &str = "authorization";
