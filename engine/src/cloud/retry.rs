//! A driver's idempotent calls, retried with back-off.
//!
//! A cloud's API fails now and then (a timeout, a refused connection, a
//! throttled call beyond the driver's own retries). Every call of the driver
//! traits but [`Cloud::provision`] is idempotent by contract, so the engine
//! makes it again after a pause that doubles each time, a few times, before
//! the error reaches the workflow (which stops at that step; the next run
//! resumes there). A provisioning is not repeated in place: its failure
//! removes whatever carries the node's id, and the next run starts another.

use super::{
    Cloud, Distributor, Drivers, GroupResources, ProvisionRequest, Provisioned, Publication, Result,
};
use crate::model::{DistributorSpec, NodeSpec};
use crate::store::NodeRow;
use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

/// How often and how patiently a failed call is made again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    /// Calls in all, the first included.
    pub attempts: u32,
    /// The pause after the first failure; each next pause is twice the last.
    pub first: Duration,
}

impl Default for Backoff {
    /// Four calls, 0.25 s, 0.5 s and 1 s apart: a blip of a few seconds is
    /// ridden out; a longer outage is the workflow's error, said at once.
    fn default() -> Backoff {
        Backoff {
            attempts: 4,
            first: Duration::from_millis(250),
        }
    }
}

impl Backoff {
    /// `call` until it succeeds or `attempts` calls failed (the last error).
    async fn run<T, F, Fut>(&self, what: &str, mut call: F) -> Result<T>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T>>,
    {
        let mut pause = self.first;
        let mut attempt = 1;
        loop {
            match call().await {
                Ok(v) => return Ok(v),
                Err(e) if attempt < self.attempts => {
                    tracing::warn!(call = what, attempt, error = %e, retry_in_ms = pause.as_millis() as u64, "cloud call failed; retrying");
                    tokio::time::sleep(pause).await;
                    pause *= 2;
                    attempt += 1;
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// `drivers` with their idempotent calls retried.
    pub(crate) fn wrap(self, drivers: Drivers) -> Drivers {
        Drivers {
            nodes: Arc::new(RetryingCloud {
                inner: drivers.nodes,
                backoff: self,
            }),
            distributors: Arc::new(RetryingDistributor {
                inner: drivers.distributors,
                backoff: self,
            }),
        }
    }
}

struct RetryingCloud {
    inner: Arc<dyn Cloud>,
    backoff: Backoff,
}

#[async_trait::async_trait]
impl Cloud for RetryingCloud {
    async fn provision(&self, req: &ProvisionRequest) -> Result<Provisioned> {
        self.inner.provision(req).await
    }
    async fn deprovision(&self, node: &NodeRow) -> Result<()> {
        self.backoff
            .run("deprovision", || self.inner.deprovision(node))
            .await
    }
    async fn is_alive(&self, node: &NodeRow) -> Result<bool> {
        self.backoff
            .run("is_alive", || self.inner.is_alive(node))
            .await
    }
    async fn alive(&self, nodes: &[NodeRow]) -> Result<Vec<bool>> {
        self.backoff.run("alive", || self.inner.alive(nodes)).await
    }
    fn api_port(&self, node: &NodeRow) -> u16 {
        self.inner.api_port(node)
    }
    fn unusable(&self) -> Option<String> {
        self.inner.unusable()
    }
    fn node_unusable(&self, node: &NodeSpec) -> Option<String> {
        self.inner.node_unusable(node)
    }
    async fn prepare_group(&self, group: &GroupResources) -> Result<()> {
        self.backoff
            .run("prepare_group", || self.inner.prepare_group(group))
            .await
    }
    async fn release_group(&self, group_id: &str) -> Result<()> {
        self.backoff
            .run("release_group", || self.inner.release_group(group_id))
            .await
    }
}

struct RetryingDistributor {
    inner: Arc<dyn Distributor>,
    backoff: Backoff,
}

#[async_trait::async_trait]
impl Distributor for RetryingDistributor {
    async fn ensure(&self, id: &str, spec: &DistributorSpec) -> Result<()> {
        self.backoff
            .run("ensure", || self.inner.ensure(id, spec))
            .await
    }
    async fn publish(
        &self,
        id: &str,
        spec: &DistributorSpec,
        publication: &Publication,
    ) -> Result<()> {
        self.backoff
            .run("publish", || self.inner.publish(id, spec, publication))
            .await
    }
    async fn publish_fenced(
        &self,
        id: &str,
        spec: &DistributorSpec,
        publication: &Publication,
        fence: i64,
    ) -> Result<()> {
        self.backoff
            .run("publish", || {
                self.inner.publish_fenced(id, spec, publication, fence)
            })
            .await
    }
    async fn remove(&self, id: &str) -> Result<()> {
        self.backoff.run("remove", || self.inner.remove(id)).await
    }
    fn addresses(&self, id: &str, spec: &DistributorSpec) -> BTreeMap<String, String> {
        self.inner.addresses(id, spec)
    }
    fn unusable(&self) -> Option<String> {
        self.inner.unusable()
    }
}
