//! A data-plane node: its vservers' listeners, drain and background loops.
//! Applying a configuration is in `configure`, the statistics in `stats`, the
//! CUSTOMLOAD values in `custom_load`.

mod configure;
mod custom_load;
mod stats;
#[cfg(test)]
mod tests;

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use hyper::header::HeaderValue;
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::bounds::{descriptor_budget, open_files_limit, Limits};
use crate::dial::Dialer;
use crate::health::{HealthCfg, Prober};
use crate::metrics::Traffic;
use crate::model::{Common, VsState, Vserver};
use crate::service::ServiceRt;
use crate::slowstart::Ramps;
use crate::usage::{Kernel, Source};
use crate::window::Window;

/// Node options that the management API does not carry.
#[derive(Clone, Debug)]
pub struct NodeOpts {
    pub health: HealthCfg,
    /// How long a disabled or removed service's connections may go on.
    pub service_drain: Duration,
    /// SOURCEIP persistence: how long a client's entry lives without being used.
    pub persistence_timeout: Duration,
    /// Timeouts towards services and the request head's size.
    pub limits: Limits,
}

impl Default for NodeOpts {
    fn default() -> Self {
        NodeOpts {
            health: HealthCfg::default(),
            service_drain: Duration::from_secs(30),
            persistence_timeout: crate::persist::DEFAULT_TIMEOUT,
            limits: Limits::default(),
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
enum Transport {
    Tcp,
    Udp,
}

struct Listener {
    vs: Arc<Vserver>,
    task: JoinHandle<()>,
}

#[derive(Default)]
struct Inner {
    listeners: HashMap<(u16, Transport), Listener>,
    /// The highest configuration fence applied (proto `NodeConfig.fence`).
    fence: u64,
}

/// The vservers and version of the last configuration applied, for the readers
/// that must not wait while a configuration binds, closes listeners or resolves
/// names under the listeners' lock: the statistics and the sampler.
#[derive(Default)]
struct Published {
    version: u64,
    vservers: Vec<Arc<Vserver>>,
}

pub struct Node {
    pub id: String,
    pub ip: IpAddr,
    /// Whose CPU and memory `stats` reports.
    stats_source: Source,
    kernel: Kernel,
    /// What every vserver shares with the node (kill token, counters, dialer).
    common: Common,
    /// Cancelled when the node drains: every listener closes.
    drain: CancellationToken,
    draining: AtomicBool,
    inner: tokio::sync::Mutex<Inner>,
    /// See [`Node::publish`].
    published: Mutex<Arc<Published>>,
    /// The snapshots `stats` takes its means from (the sampler keeps one a second).
    window: Mutex<Window>,
    started: Instant,
    opts: NodeOpts,
    /// Health checks of the services (they wake `slow_start_loop`).
    prober: Prober,
    /// Notified when a service comes UP.
    service_up: Arc<Notify>,
    /// CUSTOMLOAD values: key `vserver/service` or `service`.
    custom_loads: Mutex<HashMap<String, f64>>,
    /// The node's own slow start of every vserver.
    ramps: Ramps,
    /// Services removed from the configuration while draining: (vserver, runtime).
    removed: Mutex<Vec<(String, Arc<ServiceRt>)>>,
}

impl Node {
    pub fn new(id: String, ip: IpAddr, stats_source: Source, opts: NodeOpts) -> Arc<Self> {
        let node_hv = HeaderValue::from_str(&id).unwrap_or(HeaderValue::from_static("node"));
        let dialer = Dialer::from_node(ip);
        let service_up = Arc::new(Notify::new());
        let prober = Prober::new(opts.health, dialer, service_up.clone());
        let node = Arc::new(Node {
            id,
            ip,
            stats_source,
            kernel: Kernel::default(),
            common: Common {
                kill: CancellationToken::new(),
                node_hv,
                traffic: Arc::new(Traffic::default()),
                dialer,
                limits: opts.limits,
                descriptors: descriptor_budget(open_files_limit()),
            },
            drain: CancellationToken::new(),
            draining: AtomicBool::new(false),
            inner: tokio::sync::Mutex::new(Inner::default()),
            published: Mutex::new(Arc::default()),
            window: Mutex::new(Window::default()),
            started: Instant::now(),
            ramps: Ramps::new(prober.clone(), ip),
            prober,
            service_up,
            opts,
            custom_loads: Mutex::new(HashMap::new()),
            removed: Mutex::new(Vec::new()),
        });
        tokio::spawn(Node::sampler(Arc::downgrade(&node)));
        tokio::spawn(slow_start_loop(Arc::downgrade(&node)));
        node
    }

    /// The last configuration applied, without waiting for one in progress.
    fn published(&self) -> Arc<Published> {
        self.published
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Makes `inner`'s listeners and `version` what readers of the last
    /// configuration see; called with `inner` held, so publications keep
    /// Configure's order.
    fn publish(&self, inner: &Inner, version: u64) {
        let vservers = inner.listeners.values().map(|l| l.vs.clone()).collect();
        *self.published.lock().unwrap_or_else(|e| e.into_inner()) =
            Arc::new(Published { version, vservers });
    }

    /// Node uptime, ms: the clock of the slow-start model.
    pub fn uptime_ms(&self) -> u64 {
        self.started.elapsed().as_millis() as u64
    }

    /// The snapshots of every listening vserver, after a configuration in
    /// progress.
    async fn states(&self) -> Vec<Arc<VsState>> {
        let inner = self.inner.lock().await;
        inner.listeners.values().map(|l| l.vs.state()).collect()
    }

    fn active_connections(&self) -> u64 {
        self.common.traffic.active_connections()
    }

    pub fn state_name(&self) -> &'static str {
        if !self.draining.load(Ordering::Relaxed) {
            "active"
        } else if self.active_connections() == 0 {
            "drained"
        } else {
            "draining"
        }
    }

    /// Starts draining (idempotent): closes every listener, lets connections finish
    /// until `timeout`, then closes them. Waits briefly for idle connections to go.
    pub async fn drain(self: &Arc<Self>, timeout: Duration) -> u64 {
        if !self.draining.swap(true, Ordering::SeqCst) {
            tracing::info!(timeout_ms = timeout.as_millis() as u64, "draining");
            self.drain.cancel();
            let kill = self.common.kill.clone();
            let traffic = self.common.traffic.clone();
            tokio::spawn(async move {
                tokio::time::sleep(timeout).await;
                let left = traffic.active_connections();
                if left > 0 {
                    tracing::info!(
                        connections = left,
                        "drain timeout: closing remaining connections"
                    );
                }
                kill.cancel();
            });
        }
        let settle = Instant::now() + timeout.min(Duration::from_millis(200));
        while self.active_connections() > 0 && Instant::now() < settle {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        self.active_connections()
    }
}

/// Runs the node's own slow start (`slowstart`): a tick every 100 ms, at every
/// increment boundary and when a service comes UP, serialised with Configure by
/// the listeners' lock.
async fn slow_start_loop(node: Weak<Node>) {
    loop {
        let (wait, up) = {
            let Some(node) = node.upgrade() else { return };
            let inner = node.inner.lock().await;
            let vservers: Vec<&Vserver> = inner.listeners.values().map(|l| &*l.vs).collect();
            let next = node.ramps.tick(&vservers, node.uptime_ms());
            // One ms late rather than early: the boundary must have passed.
            let wait = (next + 1).saturating_sub(node.uptime_ms());
            (wait, node.service_up.clone())
        };
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(wait)) => {}
            _ = up.notified() => {}
        }
    }
}
