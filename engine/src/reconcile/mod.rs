//! The engine that the provider, the daemon and the CLI embed.
//!
//! Level-triggered, like the best controllers: every call reads what is declared
//! (the store) and what is observed (the driver: which node processes still run,
//! what they serve), closes the gap, and records every step as an event. A run that
//! fails half-way leaves rows that say where it stopped; the next run picks up from
//! there. Side effects on a group happen only under the group's lease, so that the
//! provider and the daemon never act on one group at the same time.
//!
//! One module per job, each with its own `impl Engine` block:
//! - `leases`: the group's and the distributor's leases ([`KeptLease`]), and
//!   the wait of a destroy for what still uses an object;
//! - `groups`: autoscale groups (declare, update, delete, view) and the
//!   reconcile that brings one to its declared shape;
//! - `scale_out`: a node more in an AZ (provision);
//! - `scale_in`: nodes leaving (deregister, TTL, drain, deprovision);
//! - `join`: what a node runs and the push of it, and the rolling restart;
//! - `spans`: how many nodes of an AZ hold a vserver behind an `nlb`;
//! - `distributors`: traffic distributors and what they hand out;
//! - `se_groups`, `vservers`: the objects placed on a group;
//! - `resources`: a group's own cloud resources (an aws group's security group).

mod credentials;
mod distributors;
mod groups;
mod join;
mod leases;
mod resources;
mod scale_in;
mod scale_out;
mod se_groups;
mod spans;
mod vservers;

pub use distributors::DistributorView;
pub use groups::{GroupView, NodeView};
pub(crate) use join::stale_among;
pub use leases::{KeptLease, WORKFLOW_LEASE_TTL};
pub(crate) use spans::spans_of;
pub use spans::SpanView;

use crate::cloud::{Cloud, CloudError, Clouds, DriverStore, Registry};
use crate::model::{CloudName, Finding, Findings};
use crate::store::{Store, StoreError};
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Cloud(#[from] CloudError),
    /// The configuration cannot be applied as it stands (names the attribute).
    #[error("{}: {}", .0.summary, .0.detail)]
    Invalid(Finding),
    #[error("{0} not found in the store")]
    NotFound(String),
    #[error("{0}")]
    InUse(String),
    /// A wait ran past its deadline; `step` says which one.
    #[error("timed out after {after_s}s at step \"{step}\": {detail}")]
    Timeout {
        step: &'static str,
        after_s: u64,
        detail: String,
    },
    #[error("step \"{step}\" failed: {detail}")]
    Step { step: &'static str, detail: String },
    /// A node refused a configuration because it applied one with a higher
    /// fence meanwhile (another workflow's, read later): read it again.
    #[error("{0}")]
    Superseded(String),
}

/// The step of a publication to a traffic distributor, in [`EngineError::Step`].
pub const PUBLISH_STEP: &str = "register addresses with the distributor";

impl EngineError {
    /// A publication to a traffic distributor failed (and nothing else): it is
    /// level-triggered, so it is cheap and safe to try again soon.
    pub fn is_publication(&self) -> bool {
        matches!(self, EngineError::Step { step, .. } if *step == PUBLISH_STEP)
    }
}

pub type Result<T> = std::result::Result<T, EngineError>;

pub struct Engine {
    /// Private: the provider, the daemon and the CLI go through the engine's
    /// methods (tests through [`Engine::testing_store`]).
    pub(crate) store: Arc<Store>,
    /// The drivers by cloud name, as the embedding program registered them.
    clouds: Registry,
    pub(crate) holder: String,
    /// One operation per group at a time within this process. The store's lease
    /// excludes other processes, but it is held in this process's name, so two
    /// operations of one process (Terraform creating two vservers of a group in
    /// parallel) would both pass it and push configurations over each other.
    group_locks: std::sync::Mutex<BTreeMap<String, Arc<tokio::sync::Mutex<()>>>>,
    /// Each group's node API credentials, by group id
    /// ([`Engine::node_credentials`]).
    credentials: std::sync::Mutex<std::collections::HashMap<String, credentials::Kept>>,
}

fn new_id(prefix: &str) -> String {
    format!("{prefix}-{:08x}", rand::random::<u32>())
}

fn new_token() -> String {
    (0..32)
        .map(|_| format!("{:02x}", rand::random::<u8>()))
        .collect()
}

impl Engine {
    /// Opens the store at `state_url` (relative paths from `base_dir`), with
    /// the drivers of `clouds` (built on that store).
    pub fn open(state_url: &str, base_dir: &Path, clouds: Clouds) -> Result<Engine> {
        let store = Arc::new(Store::open_url(state_url, base_dir)?);
        let holder = format!(
            "provider-{}-{:04x}",
            std::process::id(),
            rand::random::<u16>()
        );
        Ok(Engine {
            clouds: clouds.open(DriverStore::new(store.clone())),
            store,
            holder,
            group_locks: std::sync::Mutex::new(BTreeMap::new()),
            credentials: Default::default(),
        })
    }

    /// Why `cloud` cannot be used now (for nodes too, with `nodes`), if it
    /// cannot: no driver registered by that name ([`CloudError::NoDriver`]),
    /// or settings missing from the provider and the environment. Said at
    /// plan time, before anything is created.
    pub fn cloud_unusable(&self, cloud: &str, nodes: bool) -> Option<CloudError> {
        self.clouds.unusable(cloud, nodes)
    }

    /// The store itself, for tests that check what no workflow shows (that
    /// nothing is left behind, a driver's runtime record) or set a fault up.
    #[cfg(any(test, feature = "testing"))]
    pub fn testing_store(&self) -> &Arc<Store> {
        &self.store
    }

    pub(crate) fn cloud(&self, name: CloudName) -> Result<&dyn Cloud> {
        Ok(self.clouds.nodes(name.as_str())?)
    }

    fn reject(findings: Findings) -> Result<()> {
        match findings
            .0
            .into_iter()
            .find(|f| f.severity == crate::model::Severity::Error)
        {
            Some(f) => Err(EngineError::Invalid(f)),
            None => Ok(()),
        }
    }
}
