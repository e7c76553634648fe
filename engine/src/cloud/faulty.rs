//! A test cloud: a real driver whose chosen calls misbehave on purpose.
//!
//! [`Faults::wrap`] puts a real cloud's drivers (the local one, in the
//! engine's tests) behind the driver traits, and [`Faults::inject`] makes the
//! next calls of one kind refuse, time out, answer late or lose their answer.
//! Every call is logged with what it got, so that a test can say how often and
//! how far apart the engine made it. Only for tests (the `testing` feature).

use super::{
    Cloud, CloudError, Distributor, DriverStore, Drivers, GroupResources, ProvisionRequest,
    Provisioned, Publication, Result,
};
use crate::model::{DistributorSpec, NodeSpec};
use crate::store::NodeRow;
use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A call of the driver traits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Call {
    Provision,
    Deprovision,
    /// [`Cloud::alive`] and [`Cloud::is_alive`].
    Alive,
    Ensure,
    Publish,
    Remove,
}

/// How one call misbehaves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// The cloud refuses at once; nothing is done.
    Refuse,
    /// No answer for this long, then a timeout error; nothing is done.
    Timeout(Duration),
    /// The call is done, and its answer comes this much later.
    Late(Duration),
    /// The call is done, and its answer is lost: the caller gets an error.
    Lost,
    /// A provisioning is done and answers without the node's private address
    /// (a cloud that has not given it one yet). Other calls are done as asked.
    NoAddress,
}

/// One call as the test cloud saw it.
#[derive(Debug, Clone)]
pub struct Logged {
    pub call: Call,
    pub at: Instant,
    /// The fault it got, if any.
    pub fault: Option<Fault>,
    /// Whether the caller got an error.
    pub failed: bool,
}

/// The faults to come and the calls made; shared by the test and its clouds.
#[derive(Clone, Default)]
pub struct Faults {
    state: Arc<Mutex<State>>,
}

#[derive(Default)]
struct State {
    planned: BTreeMap<Call, VecDeque<Fault>>,
    log: Vec<Logged>,
}

impl Faults {
    pub fn new() -> Faults {
        Faults::default()
    }

    /// The next `times` calls of `call` get `fault` (after any planned before).
    pub fn inject(&self, call: Call, fault: Fault, times: usize) {
        let mut s = self.state.lock().unwrap();
        let q = s.planned.entry(call).or_default();
        q.extend(std::iter::repeat_n(fault, times));
    }

    /// Forgets the faults not yet used.
    pub fn clear(&self) {
        self.state.lock().unwrap().planned.clear();
    }

    /// Every call so far, in order.
    pub fn log(&self) -> Vec<Logged> {
        self.state.lock().unwrap().log.clone()
    }

    /// The calls of `call` so far.
    pub fn calls(&self, call: Call) -> Vec<Logged> {
        self.log().into_iter().filter(|l| l.call == call).collect()
    }

    /// Forgets the calls logged so far.
    pub fn forget_log(&self) {
        self.state.lock().unwrap().log.clear();
    }

    /// A cloud to register (see [`super::Clouds::with`]): `make`'s drivers
    /// behind these faults.
    pub fn wrap(
        &self,
        make: impl FnOnce(DriverStore) -> std::result::Result<Drivers, String> + Send + 'static,
    ) -> impl FnOnce(DriverStore) -> std::result::Result<Drivers, String> + Send + 'static {
        let faults = self.clone();
        move |store| {
            let inner = make(store)?;
            let c = Arc::new(FaultyCloud { inner, faults });
            Ok(Drivers {
                nodes: c.clone(),
                distributors: c,
            })
        }
    }

    /// Takes `fault` if it is the next one planned for `call`.
    fn take(&self, call: Call, fault: Fault) -> bool {
        let mut s = self.state.lock().unwrap();
        let q = s.planned.entry(call).or_default();
        let next = q.front() == Some(&fault);
        if next {
            q.pop_front();
        }
        next
    }

    fn next(&self, call: Call) -> Option<Fault> {
        self.state
            .lock()
            .unwrap()
            .planned
            .get_mut(&call)
            .and_then(VecDeque::pop_front)
    }

    fn record(&self, call: Call, at: Instant, fault: Option<Fault>, failed: bool) {
        self.state.lock().unwrap().log.push(Logged {
            call,
            at,
            fault,
            failed,
        });
    }

    /// Runs `real` as the next fault of `call` says.
    async fn call<T, F>(&self, call: Call, real: F) -> Result<T>
    where
        F: std::future::Future<Output = Result<T>>,
    {
        let at = Instant::now();
        let fault = self.next(call);
        let out = match fault {
            None => real.await,
            Some(Fault::Refuse) => Err(CloudError::Failed(format!("test cloud: {call:?} refused"))),
            Some(Fault::Timeout(d)) => {
                tokio::time::sleep(d).await;
                Err(CloudError::Failed(format!(
                    "test cloud: {call:?} timed out after {}ms",
                    d.as_millis()
                )))
            }
            Some(Fault::Late(d)) => {
                let r = real.await;
                tokio::time::sleep(d).await;
                r
            }
            Some(Fault::NoAddress) => real.await,
            Some(Fault::Lost) => {
                let _ = real.await;
                Err(CloudError::Failed(format!(
                    "test cloud: the answer to {call:?} was lost"
                )))
            }
        };
        self.record(call, at, fault, out.is_err());
        out
    }
}

struct FaultyCloud {
    inner: Drivers,
    faults: Faults,
}

#[async_trait::async_trait]
impl Cloud for FaultyCloud {
    async fn provision(&self, req: &ProvisionRequest) -> Result<Provisioned> {
        if self.faults.take(Call::Provision, Fault::NoAddress) {
            let at = Instant::now();
            let out = self.inner.nodes.provision(req).await.map(|mut p| {
                p.private_ip.clear();
                p
            });
            let failed = out.is_err();
            self.faults
                .record(Call::Provision, at, Some(Fault::NoAddress), failed);
            return out;
        }
        self.faults
            .call(Call::Provision, self.inner.nodes.provision(req))
            .await
    }
    async fn deprovision(&self, node: &NodeRow) -> Result<()> {
        self.faults
            .call(Call::Deprovision, self.inner.nodes.deprovision(node))
            .await
    }
    async fn is_alive(&self, node: &NodeRow) -> Result<bool> {
        self.faults
            .call(Call::Alive, self.inner.nodes.is_alive(node))
            .await
    }
    async fn alive(&self, nodes: &[NodeRow]) -> Result<Vec<bool>> {
        self.faults
            .call(Call::Alive, self.inner.nodes.alive(nodes))
            .await
    }
    fn api_port(&self, node: &NodeRow) -> u16 {
        self.inner.nodes.api_port(node)
    }
    fn unusable(&self) -> Option<String> {
        self.inner.nodes.unusable()
    }
    fn node_unusable(&self, node: &NodeSpec) -> Option<String> {
        self.inner.nodes.node_unusable(node)
    }
    // Not a fault target: passed through as they are.
    async fn prepare_group(&self, group: &GroupResources) -> Result<()> {
        self.inner.nodes.prepare_group(group).await
    }
    async fn release_group(&self, group_id: &str) -> Result<()> {
        self.inner.nodes.release_group(group_id).await
    }
}

#[async_trait::async_trait]
impl Distributor for FaultyCloud {
    async fn ensure(&self, id: &str, spec: &DistributorSpec) -> Result<()> {
        self.faults
            .call(Call::Ensure, self.inner.distributors.ensure(id, spec))
            .await
    }
    async fn publish(
        &self,
        id: &str,
        spec: &DistributorSpec,
        publication: &Publication,
    ) -> Result<()> {
        self.faults
            .call(
                Call::Publish,
                self.inner.distributors.publish(id, spec, publication),
            )
            .await
    }
    async fn publish_fenced(
        &self,
        id: &str,
        spec: &DistributorSpec,
        publication: &Publication,
        fence: i64,
    ) -> Result<()> {
        self.faults
            .call(
                Call::Publish,
                self.inner
                    .distributors
                    .publish_fenced(id, spec, publication, fence),
            )
            .await
    }
    async fn remove(&self, id: &str) -> Result<()> {
        self.faults
            .call(Call::Remove, self.inner.distributors.remove(id))
            .await
    }
    fn addresses(&self, id: &str, spec: &DistributorSpec) -> BTreeMap<String, String> {
        self.inner.distributors.addresses(id, spec)
    }
    fn unusable(&self) -> Option<String> {
        self.inner.distributors.unusable()
    }
}
