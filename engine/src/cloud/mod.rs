//! Cloud drivers: where nodes come from and how clients reach them.
//!
//! Two small traits keep the engine free of any one cloud:
//! - [`Cloud`] provisions and deprovisions nodes and says whether one still exists;
//! - [`Distributor`] runs a traffic distributor and publishes the addresses that it
//!   hands out.
//!
//! `local` is the embedded default: nodes are `lbscale-node` processes on loopback
//! addresses of this machine, the `dns` distributor is an authoritative DNS server
//! process and the `nlb` distributor an L4 forwarder process. [`aws`] runs nodes
//! on EC2 and `dns` distributors on Route 53.

pub mod aws;
pub mod local;

use crate::model::DistributorSpec;
use crate::store::NodeRow;
use std::collections::BTreeMap;

#[derive(Debug, thiserror::Error)]
pub enum CloudError {
    #[error("{0}")]
    Failed(String),
    #[error("the {0} cloud driver is not built yet; only \"local\" works in this version")]
    NotBuilt(String),
}

pub type Result<T> = std::result::Result<T, CloudError>;

/// What a driver keeps of distributor `id` between calls, from the store
/// (the default before the first save). A store error, or a record that does
/// not read, is an error: an empty one would forget what exists.
pub(crate) fn load_runtime<T: serde::de::DeserializeOwned + Default>(
    store: &crate::store::Store,
    id: &str,
) -> Result<T> {
    let v = store
        .distributor_runtime(id)
        .map_err(|e| CloudError::Failed(e.to_string()))?;
    if v.is_null() {
        return Ok(T::default());
    }
    serde_json::from_value(v).map_err(|e| {
        CloudError::Failed(format!(
            "the stored runtime of distributor {id} does not read: {e}"
        ))
    })
}

/// Saves what a driver keeps of distributor `id`.
pub(crate) fn save_runtime<T: serde::Serialize>(
    store: &crate::store::Store,
    id: &str,
    runtime: &T,
) -> Result<()> {
    store
        .set_distributor_runtime(
            id,
            &serde_json::to_value(runtime).expect("runtime serialises"),
        )
        .map_err(|e| CloudError::Failed(e.to_string()))
}

/// What the engine asks for when it needs a node.
#[derive(Debug, Clone)]
pub struct ProvisionRequest {
    pub node_id: String,
    pub group_id: String,
    pub az: String,
    pub memory_limit_mb: i64,
    /// The group's node API token (sensitive).
    pub token: String,
}

/// A node that exists in the cloud.
#[derive(Debug, Clone)]
pub struct Provisioned {
    pub private_ip: String,
    pub public_ip: Option<String>,
    /// Where its management API listens.
    pub api_port: u16,
    /// Driver-specific handle, kept in the store.
    pub handle: serde_json::Value,
}

#[async_trait::async_trait]
pub trait Cloud: Send + Sync {
    /// Creates the node and returns once it exists (not necessarily serving yet).
    async fn provision(&self, req: &ProvisionRequest) -> Result<Provisioned>;
    /// Removes the node; idempotent (a node that is already gone is fine).
    async fn deprovision(&self, node: &NodeRow) -> Result<()>;
    /// Whether the node still exists and runs. An error (the cloud could not
    /// be asked) says nothing either way: the engine does not count the node dead.
    async fn is_alive(&self, node: &NodeRow) -> Result<bool>;
    /// [`Cloud::is_alive`] of each of `nodes`, in order. A cloud whose answer
    /// is an API call asks once for all of them.
    async fn alive(&self, nodes: &[NodeRow]) -> Result<Vec<bool>> {
        let mut out = Vec::with_capacity(nodes.len());
        for n in nodes {
            out.push(self.is_alive(n).await?);
        }
        Ok(out)
    }
    /// The port of the node's management API.
    fn api_port(&self, node: &NodeRow) -> u16;
}

/// What a distributor must hand out: per AZ, the serving nodes' addresses, and the
/// vserver ports (an `nlb` forwards each port of each AZ's VIP).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Publication {
    /// AZ -> addresses of the nodes registered in that AZ.
    pub endpoints: BTreeMap<String, Vec<String>>,
    /// AZ -> TCP ports to forward (vservers placed on groups in that AZ).
    pub ports: BTreeMap<String, Vec<u16>>,
    /// AZ -> port -> where an `nlb` sends that port when it is not every endpoint
    /// of the AZ (SE scale-out: the primary only, or the holders by flow hash).
    pub port_targets: BTreeMap<String, BTreeMap<u16, PortTargets>>,
}

/// The targets of one `nlb` port (see [`crate::placement`]).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PortTargets {
    pub addresses: Vec<String>,
    pub balance: Balance,
}

/// How an `nlb` picks among a port's targets.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord)]
pub enum Balance {
    /// In turn.
    #[default]
    RoundRobin,
    /// The first target that accepts, in order (a native primary, then the
    /// other holders should it be down).
    First,
    /// By a hash of the client's flow (the ECMP stand-in).
    FlowHash,
}

#[async_trait::async_trait]
pub trait Distributor: Send + Sync {
    /// Starts the distributor if it does not run (idempotent).
    async fn ensure(&self, id: &str, spec: &DistributorSpec) -> Result<()>;
    /// Makes the distributor hand out exactly `publication`, and returns once it does.
    /// The engine calls it for one distributor at a time across processes (under
    /// the distributor's lease in the store), never two at once.
    async fn publish(
        &self,
        id: &str,
        spec: &DistributorSpec,
        publication: &Publication,
    ) -> Result<()>;
    /// Stops the distributor and frees what it held (idempotent).
    async fn remove(&self, id: &str) -> Result<()>;
    /// Where clients go: the DNS server (`dns`) or each AZ's VIP (`nlb`).
    fn addresses(&self, id: &str, spec: &DistributorSpec) -> BTreeMap<String, String>;
}
