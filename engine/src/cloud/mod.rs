//! Cloud drivers: where nodes come from and how clients reach them.
//!
//! Two small traits keep the engine free of any one cloud:
//! - [`Cloud`] provisions and deprovisions nodes and says whether one still exists;
//! - [`Distributor`] runs a traffic distributor and publishes the addresses that it
//!   hands out.
//!
//! The engine knows no cloud by name: the program that embeds it (the provider,
//! the daemon, the CLI) registers the drivers it is built with in [`Clouds`],
//! and the engine looks a group's or distributor's `cloud` up there. Drivers
//! are crates of their own (`lbscale-cloud-local`: processes on this machine;
//! `lbscale-cloud-aws`: EC2, Route 53, ELBv2), which keep what they need in the
//! store through [`DriverStore`].

#[cfg(feature = "testing")]
pub mod faulty;
mod retry;

pub use retry::Backoff;

use crate::model::{DistributorSpec, NodeSpec};
use crate::store::{NodeRow, Store};
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::Arc;

#[derive(Debug, thiserror::Error)]
pub enum CloudError {
    #[error("{0}")]
    Failed(String),
    /// No driver of that name was given to the engine (see [`Clouds`]).
    #[error("the {cloud} cloud driver is not built into this lbscale (no driver registered for cloud {cloud:?}); {} work", known_list(.known))]
    NoDriver { cloud: String, known: Vec<String> },
    /// The driver exists but its settings do not let it work (or not for nodes).
    #[error("the {cloud} cloud is not usable: {why}")]
    Unusable { cloud: String, why: String },
}

/// `"a"`, `"a" and "b"`, `"a", "b" and "c"`.
fn known_list(known: &[String]) -> String {
    let q: Vec<String> = known.iter().map(|k| format!("{k:?}")).collect();
    match q.split_last() {
        None => "no cloud drivers".into(),
        Some((last, [])) => last.clone(),
        Some((last, rest)) => format!("{} and {last}", rest.join(", ")),
    }
}

pub type Result<T> = std::result::Result<T, CloudError>;

/// What a driver may keep in the engine's store: a directory of its own, the
/// loopback addresses it hands out, and per distributor a runtime record. The
/// rest of the store is the engine's.
#[derive(Clone)]
pub struct DriverStore {
    store: Arc<Store>,
}

impl DriverStore {
    pub fn new(store: Arc<Store>) -> DriverStore {
        DriverStore { store }
    }

    /// The store's directory (a SQLite store's, or the base directory).
    pub fn dir(&self) -> &Path {
        self.store.local_dir()
    }

    /// The first of `candidates` that is `usable` and not reserved by another
    /// owner, now reserved by `owner` (None when none is left).
    pub fn reserve_address(
        &self,
        owner: &str,
        candidates: impl Iterator<Item = String>,
        usable: impl FnMut(&str) -> bool,
    ) -> Result<Option<String>> {
        self.store
            .reserve_address(owner, candidates, usable)
            .map_err(|e| CloudError::Failed(e.to_string()))
    }

    /// Frees every address `owner` holds.
    pub fn release_addresses(&self, owner: &str) -> Result<()> {
        self.store
            .release_addresses(owner)
            .map_err(|e| CloudError::Failed(e.to_string()))
    }

    /// The declared settings of distributor `id`, if it is still in the store.
    pub fn distributor(&self, id: &str) -> Result<Option<DistributorSpec>> {
        self.store
            .distributor(id)
            .map(|r| r.map(|r| r.spec))
            .map_err(|e| CloudError::Failed(e.to_string()))
    }

    /// The declared settings of the distributor that group `group_id` uses
    /// now (None when the group or its distributor is not in the store).
    pub fn distributor_of_group(&self, group_id: &str) -> Result<Option<DistributorSpec>> {
        let group = self
            .store
            .group(group_id)
            .map_err(|e| CloudError::Failed(e.to_string()))?;
        match group {
            Some(g) => self.distributor(&g.spec.traffic_distributor_id),
            None => Ok(None),
        }
    }

    /// What the driver keeps of distributor `id` between calls (the default
    /// before the first save). A store error, or a record that does not read,
    /// is an error: an empty one would forget what exists.
    pub fn load_runtime<T: serde::de::DeserializeOwned + Default>(&self, id: &str) -> Result<T> {
        let v = self
            .store
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

    /// Saves what the driver keeps of distributor `id`.
    pub fn save_runtime<T: serde::Serialize>(&self, id: &str, runtime: &T) -> Result<()> {
        self.store
            .set_distributor_runtime(
                id,
                &serde_json::to_value(runtime).expect("runtime serialises"),
            )
            .map_err(|e| CloudError::Failed(e.to_string()))
    }
}

/// One cloud's drivers: its nodes and its distributors.
#[derive(Clone)]
pub struct Drivers {
    pub nodes: Arc<dyn Cloud>,
    pub distributors: Arc<dyn Distributor>,
}

impl Drivers {
    /// The drivers of a cloud whose one type does both.
    pub fn of<T: Cloud + Distributor + 'static>(driver: T) -> Drivers {
        let d = Arc::new(driver);
        Drivers {
            nodes: d.clone(),
            distributors: d,
        }
    }
}

/// Builds a cloud's drivers on the engine's store, or says why the cloud
/// cannot be used with the settings it was given.
pub type MakeDrivers = Box<dyn FnOnce(DriverStore) -> std::result::Result<Drivers, String> + Send>;

/// The clouds an engine can use, by the name that groups and distributors
/// give in `cloud`. The program that embeds the engine (the provider, the
/// daemon, the CLI) registers the drivers it is built with, from its own
/// configuration; the engine knows no cloud by name.
#[derive(Default)]
pub struct Clouds {
    /// In registration order (the order error messages list them in).
    make: Vec<(String, MakeDrivers)>,
    /// How a failed idempotent call is made again (see [`Backoff`]).
    backoff: Backoff,
}

impl Clouds {
    pub fn new() -> Clouds {
        Clouds::default()
    }

    /// Registers cloud `name`; `make` runs when the engine opens its store.
    /// An error from it is said when the cloud is used, not at open.
    pub fn with(
        mut self,
        name: &str,
        make: impl FnOnce(DriverStore) -> std::result::Result<Drivers, String> + Send + 'static,
    ) -> Clouds {
        self.make.retain(|(n, _)| n != name);
        self.make.push((name.to_string(), Box::new(make)));
        self
    }

    /// Retries failed idempotent driver calls as `backoff` says (default:
    /// [`Backoff::default`]).
    pub fn backoff(mut self, backoff: Backoff) -> Clouds {
        self.backoff = backoff;
        self
    }

    /// The names registered, in order.
    pub fn names(&self) -> Vec<String> {
        self.make.iter().map(|(n, _)| n.clone()).collect()
    }

    /// Builds every driver on `store`, its idempotent calls retried.
    pub(crate) fn open(self, store: DriverStore) -> Registry {
        let backoff = self.backoff;
        Registry {
            clouds: self
                .make
                .into_iter()
                .map(|(name, make)| {
                    let drivers = make(store.clone()).map(|d| backoff.wrap(d));
                    (name, drivers)
                })
                .collect(),
        }
    }
}

/// The engine's drivers, built: per cloud name, its drivers or why it cannot
/// be used.
pub(crate) struct Registry {
    clouds: Vec<(String, std::result::Result<Drivers, String>)>,
}

impl Registry {
    fn drivers(&self, cloud: &str) -> Result<&Drivers> {
        match self.clouds.iter().find(|(n, _)| n == cloud) {
            Some((_, Ok(d))) => Ok(d),
            Some((_, Err(why))) => Err(CloudError::Unusable {
                cloud: cloud.into(),
                why: why.clone(),
            }),
            None => Err(CloudError::NoDriver {
                cloud: cloud.into(),
                known: self.clouds.iter().map(|(n, _)| n.clone()).collect(),
            }),
        }
    }

    pub(crate) fn nodes(&self, cloud: &str) -> Result<&dyn Cloud> {
        Ok(self.drivers(cloud)?.nodes.as_ref())
    }

    pub(crate) fn distributors(&self, cloud: &str) -> Result<&dyn Distributor> {
        Ok(self.drivers(cloud)?.distributors.as_ref())
    }

    /// Why `cloud` cannot be used now (for nodes too, with `nodes`), if it
    /// cannot: no driver of that name, or settings that the driver lacks.
    pub(crate) fn unusable(&self, cloud: &str, nodes: bool) -> Option<CloudError> {
        let d = match self.drivers(cloud) {
            Ok(d) => d,
            Err(e) => return Some(e),
        };
        let why = d
            .distributors
            .unusable()
            .or_else(|| nodes.then(|| d.nodes.unusable()).flatten())?;
        Some(CloudError::Unusable {
            cloud: cloud.into(),
            why,
        })
    }
}

/// What the engine asks for when it needs a node.
#[derive(Debug, Clone)]
pub struct ProvisionRequest {
    pub node_id: String,
    pub group_id: String,
    pub group_name: String,
    pub az: String,
    /// The group's whole `node` block (its defaults when it has none): the
    /// driver takes what its cloud supports (docs/resources/autoscale_group.md).
    pub node: NodeSpec,
    /// What the node is given for its management API: its token's hash, the
    /// group CA's certificate, its own certificate and key (docs/security.md).
    pub credentials: crate::nodeapi::auth::NodeCredentials,
}

/// What a driver needs to keep a group's own cloud resources (the aws
/// security group lbscale makes for it) in step with the group.
#[derive(Debug, Clone, PartialEq)]
pub struct GroupResources {
    pub group_id: String,
    pub group_name: String,
    pub availability_zones: Vec<String>,
    pub node: NodeSpec,
    /// The ports that the group's vservers listen on, as clients reach them.
    pub listeners: Vec<Listener>,
}

/// A port that clients reach the nodes on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Listener {
    pub port: u16,
    pub protocol: Transport,
}

/// The transport of a vserver's port: HTTP and TCP vservers are TCP.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Transport {
    Tcp,
    Udp,
}

impl Transport {
    /// The transport of a vserver's `service_type` (`HTTP`, `TCP`, `UDP`).
    pub fn of_service_type(service_type: &str) -> Transport {
        if service_type == "UDP" {
            Transport::Udp
        } else {
            Transport::Tcp
        }
    }
    pub fn as_str(self) -> &'static str {
        match self {
            Transport::Tcp => "tcp",
            Transport::Udp => "udp",
        }
    }
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
    /// Why nodes cannot be started with this driver's settings (an image
    /// missing, say), if they cannot: said at plan time, before anything is made.
    fn unusable(&self) -> Option<String> {
        None
    }
    /// Why nodes of a group with this `node` block cannot be started (no
    /// image in the block nor in the driver's settings, say), if they cannot.
    fn node_unusable(&self, _node: &NodeSpec) -> Option<String> {
        self.unusable()
    }
    /// Makes the group's own cloud resources, or brings them in step with
    /// `group` (the security group lbscale makes for a group: its rules
    /// follow the vservers). Idempotent; the engine calls it at every apply of
    /// the group, before provisioning, and before a scale-out.
    async fn prepare_group(&self, _group: &GroupResources) -> Result<()> {
        Ok(())
    }
    /// Deletes what [`Cloud::prepare_group`] made; called once the group's
    /// nodes are gone. Idempotent: what is already gone is fine.
    async fn release_group(&self, _group_id: &str) -> Result<()> {
        Ok(())
    }
}

/// What a distributor must hand out: per AZ, the serving nodes' addresses, and the
/// vserver ports (an `nlb` forwards each port of each AZ's VIP).
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Publication {
    /// AZ -> addresses of the nodes registered in that AZ.
    pub endpoints: BTreeMap<String, Vec<String>>,
    /// AZ -> TCP ports to forward (vservers placed on groups in that AZ).
    pub ports: BTreeMap<String, Vec<u16>>,
    /// AZ -> port -> where an `nlb` sends that port when it is not every endpoint
    /// of the AZ (SE scale-out: the primary only, or the holders by flow hash).
    pub port_targets: BTreeMap<String, BTreeMap<u16, PortTargets>>,
    /// AZ -> the subnets that the distributor's groups give there
    /// (`node.subnets`); an AZ without one: the cloud's default subnet. An
    /// `nlb` puts its load balancer in them.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub subnets: BTreeMap<String, BTreeSet<String>>,
}

/// The targets of one `nlb` port (see [`crate::placement`]).
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct PortTargets {
    pub addresses: Vec<String>,
    pub balance: Balance,
}

/// How an `nlb` picks among a port's targets.
#[derive(
    Debug,
    Clone,
    Copy,
    Default,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    serde::Serialize,
    serde::Deserialize,
)]
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
    /// [`Distributor::publish`] by the holder of the distributor's lease whose
    /// fence is `fence` (fences grow with each new holder). A driver that can
    /// keeps the highest fence it applied and refuses a lower one: a holder
    /// that lost its lease without knowing must not undo its successor's
    /// publication. Default: a plain publish (the lease alone fences).
    async fn publish_fenced(
        &self,
        id: &str,
        spec: &DistributorSpec,
        publication: &Publication,
        fence: i64,
    ) -> Result<()> {
        let _ = fence;
        self.publish(id, spec, publication).await
    }
    /// Stops the distributor and frees what it held (idempotent).
    async fn remove(&self, id: &str) -> Result<()>;
    /// Where clients go: the DNS server (`dns`) or each AZ's VIP (`nlb`).
    fn addresses(&self, id: &str, spec: &DistributorSpec) -> BTreeMap<String, String>;
    /// Why distributors cannot run with this driver's settings, if they cannot.
    fn unusable(&self) -> Option<String> {
        None
    }
}
