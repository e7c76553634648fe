//! A data-plane node: its vservers (listeners), configuration diffing, drain and
//! statistics.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use hyper::header::HeaderValue;
use lbscale_proto::{LbMethod, NodeConfig, ServiceType};
use tokio::net::{TcpListener, UdpSocket};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tonic::Status;

use crate::lb::{Kind, Method, ServiceRt, SvcEntry, VsState};
use crate::metrics::{self, ACTIVE_CONNS, BYTES, TOTAL_CONNS};

/// One listening vserver. Its configuration snapshot is swapped in place.
pub struct Vserver {
    state: RwLock<Arc<VsState>>,
    /// Bumped at every swap: connections cache the snapshot and re-read it only
    /// when this changes (one relaxed load per request instead of a lock).
    generation: AtomicU64,
    /// Cancelled when this vserver stops taking connections (removed, or drain).
    pub closing: CancellationToken,
    /// Cancelled when the node closes every connection (end of drain).
    pub kill: CancellationToken,
    pub node_hv: HeaderValue,
    /// Native scale-out: where new connections go, forwarding statistics.
    pub scaleout: crate::scaleout::Scaleout,
    /// SOURCEIP persistence: client IP → service (kept across configurations).
    pub sources: crate::persist::SourceTable,
}

impl Vserver {
    #[inline]
    pub fn state(&self) -> Arc<VsState> {
        self.state.read().unwrap_or_else(|e| e.into_inner()).clone()
    }
    pub(crate) fn set_state(&self, s: Arc<VsState>) {
        *self.state.write().unwrap_or_else(|e| e.into_inner()) = s;
        self.generation.fetch_add(1, Ordering::Release);
    }

    #[inline]
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// Picks a service for a new request (HTTP), connection (TCP) or flow (UDP)
    /// from `client`, never `exclude`, honouring SOURCEIP persistence.
    pub fn pick_for(&self, st: &VsState, client: IpAddr, exclude: Option<usize>) -> Option<usize> {
        if st.persistence == crate::persist::Persistence::SourceIp {
            crate::persist::pick_for_source(st, &self.sources, client, exclude)
        } else {
            st.pick(exclude)
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

enum Bound {
    Tcp(TcpListener),
    Udp(UdpSocket),
}

#[derive(Default)]
struct Inner {
    listeners: HashMap<(u16, Transport), Listener>,
}

#[derive(Default, Clone, Copy)]
struct Sample {
    cpu_percent: f64,
    throughput_mbps: f64,
}

pub struct Node {
    pub id: String,
    pub ip: IpAddr,
    node_hv: HeaderValue,
    memory_limit_mb: u64,
    drain: CancellationToken,
    kill: CancellationToken,
    draining: AtomicBool,
    version: AtomicU64,
    inner: tokio::sync::Mutex<Inner>,
    sample: Mutex<Sample>,
    started: Instant,
    opts: NodeOpts,
    /// CUSTOMLOAD values: key `vserver/service` or `service`.
    custom_loads: Mutex<HashMap<String, f64>>,
    /// The node's own slow start of every vserver.
    ramps: crate::slowstart::Ramps,
    /// Services removed from the configuration while draining: (vserver, runtime).
    removed: Mutex<Vec<(String, Arc<ServiceRt>)>>,
}

fn kind_of(t: i32) -> Option<Kind> {
    match ServiceType::try_from(t).ok()? {
        ServiceType::Http => Some(Kind::Http),
        ServiceType::Tcp => Some(Kind::Tcp),
        ServiceType::Udp => Some(Kind::Udp),
        ServiceType::Unspecified => None,
    }
}

/// ROUNDROBIN, unspecified and unknown values → round robin.
fn method_of(m: i32) -> Method {
    match LbMethod::try_from(m) {
        Ok(LbMethod::Roundrobin) | Ok(LbMethod::Unspecified) | Err(_) => Method::RoundRobin,
        Ok(LbMethod::Leastconnection) => Method::LeastConnection,
        Ok(LbMethod::Leastresponsetime) => Method::LeastResponseTime,
        Ok(LbMethod::Leastbandwidth) => Method::LeastBandwidth,
        Ok(LbMethod::Leastpackets) => Method::LeastPackets,
        Ok(LbMethod::Lrtm) => Method::Lrtm,
        Ok(LbMethod::Customload) => Method::CustomLoad,
    }
}

/// Active health checks of services: a TCP connect every `interval`; DOWN after
/// `fall` consecutive failures, UP again after `rise` consecutive successes.
/// `interval` zero turns them off (every service is UP).
#[derive(Clone, Copy, Debug)]
pub struct HealthCfg {
    pub interval: Duration,
    pub fall: u32,
    pub rise: u32,
}

impl Default for HealthCfg {
    fn default() -> Self {
        HealthCfg {
            interval: Duration::from_millis(1000),
            fall: 3,
            rise: 2,
        }
    }
}

/// Node options that the management API does not carry.
#[derive(Clone, Debug)]
pub struct NodeOpts {
    pub health: HealthCfg,
    /// How long a disabled or removed service's connections may go on.
    pub service_drain: Duration,
    /// SOURCEIP persistence: how long a client's entry lives without being used.
    pub persistence_timeout: Duration,
}

impl Default for NodeOpts {
    fn default() -> Self {
        NodeOpts {
            health: HealthCfg::default(),
            service_drain: Duration::from_secs(30),
            persistence_timeout: crate::persist::DEFAULT_TIMEOUT,
        }
    }
}

/// Probes one service until it is dropped from every configuration.
pub(crate) async fn health_loop(rt: std::sync::Weak<ServiceRt>, cfg: HealthCfg, vserver: String) {
    let mut fails = 0u32;
    let mut oks = 0u32;
    let probe_timeout = cfg
        .interval
        .clamp(Duration::from_millis(100), Duration::from_secs(2));
    let mut tick = tokio::time::interval(cfg.interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let Some(r) = rt.upgrade() else { return };
        let start = Instant::now();
        let ok = matches!(
            tokio::time::timeout(probe_timeout, r.connect()).await,
            Ok(Ok(_))
        );
        if ok {
            r.record_monitor_rtt(start.elapsed().as_micros() as u64);
            oks += 1;
            fails = 0;
            if !r.is_up() && oks >= cfg.rise.max(1) && r.set_up(true) {
                tracing::info!(
                    vserver = %vserver,
                    service = %r.name,
                    up_since_ms = r.up_since_ns() / 1_000_000,
                    "service UP (new for slow start)"
                );
                crate::slowstart::WAKE.notify_one();
            }
        } else {
            fails += 1;
            oks = 0;
            if r.is_up() && fails >= cfg.fall.max(1) && r.set_up(false) {
                tracing::warn!(vserver = %vserver, service = %r.name, failures = fails, "service DOWN");
                if let Ok(mut pool) = r.pool.lock() {
                    pool.clear();
                }
            }
        }
    }
}

impl Node {
    pub fn new(id: String, ip: IpAddr, memory_limit_mb: u64, opts: NodeOpts) -> Arc<Self> {
        let node_hv = HeaderValue::from_str(&id).unwrap_or(HeaderValue::from_static("node"));
        let node = Arc::new(Node {
            id,
            ip,
            node_hv,
            memory_limit_mb,
            drain: CancellationToken::new(),
            kill: CancellationToken::new(),
            draining: AtomicBool::new(false),
            version: AtomicU64::new(0),
            inner: tokio::sync::Mutex::new(Inner::default()),
            sample: Mutex::new(Sample::default()),
            started: Instant::now(),
            ramps: crate::slowstart::Ramps::new(opts.health, ip),
            opts,
            custom_loads: Mutex::new(HashMap::new()),
            removed: Mutex::new(Vec::new()),
        });
        metrics::start_instant();
        crate::scaleout::set_source_ip(ip);
        tokio::spawn(sampler(Arc::downgrade(&node)));
        tokio::spawn(slow_start_loop(Arc::downgrade(&node)));
        node
    }

    pub fn version(&self) -> u64 {
        self.version.load(Ordering::Relaxed)
    }

    /// Applies a full configuration. On error nothing changes.
    pub async fn configure(&self, cfg: NodeConfig) -> Result<u64, Status> {
        // Validate first.
        let mut peers = std::collections::HashSet::new();
        for p in &cfg.group_peers {
            let ip: IpAddr = p.parse().map_err(|_| {
                Status::invalid_argument(format!("group_peers: must be IP addresses, got {p:?}"))
            })?;
            peers.insert(ip);
        }
        let peers = Arc::new(peers);
        let mut desired: Vec<((u16, Transport), Kind, &lbscale_proto::Vserver)> = Vec::new();
        for v in &cfg.vservers {
            let kind = kind_of(v.service_type).ok_or_else(|| {
                Status::invalid_argument(format!(
                    "vserver {}: service_type must be HTTP, TCP or UDP",
                    v.name
                ))
            })?;
            if v.port == 0 || v.port > 65535 {
                return Err(Status::invalid_argument(format!(
                    "vserver {}: port {} is not in 1..65535",
                    v.name, v.port
                )));
            }
            for s in &v.services {
                if s.port == 0 || s.port > 65535 || s.address.is_empty() {
                    return Err(Status::invalid_argument(format!(
                        "vserver {}: service {} has an invalid address {}:{}",
                        v.name, s.name, s.address, s.port
                    )));
                }
                if s.cap_per_second.is_some_and(|c| !c.is_finite() || c < 0.0) {
                    return Err(Status::invalid_argument(format!(
                        "vserver {}: service {}: cap_per_second must be >= 0",
                        v.name, s.name
                    )));
                }
                if s.custom_load.is_some_and(|c| !c.is_finite()) {
                    return Err(Status::invalid_argument(format!(
                        "vserver {}: service {}: custom_load must be a finite number",
                        v.name, s.name
                    )));
                }
            }
            if let Some(ss) = &v.slow_start {
                let max = lbscale_core::slowstart::MAX_INCREMENT_INTERVAL;
                if ss.increment_interval_s > max {
                    return Err(Status::invalid_argument(format!(
                        "vserver {}: slow_start.increment_interval_s must be 0-{max} (0 is manual slow start), got {}",
                        v.name, ss.increment_interval_s
                    )));
                }
            }
            let t = if kind == Kind::Udp {
                Transport::Udp
            } else {
                Transport::Tcp
            };
            crate::scaleout::validate(v).map_err(Status::invalid_argument)?;
            let p = crate::persist::parse(&v.persistence)
                .map_err(|e| Status::invalid_argument(format!("vserver {}: {e}", v.name)))?;
            if p == crate::persist::Persistence::Cookie && kind != Kind::Http {
                // Refused at plan time; a configuration stored before that rule
                // still deploys, without persistence.
                tracing::warn!(vserver = %v.name, "COOKIE persistence needs an HTTP vserver: ignored");
            }
            let key = (v.port as u16, t);
            if let Some((_, _, other)) = desired.iter().find(|(k, _, _)| *k == key) {
                return Err(Status::invalid_argument(format!(
                    "vservers {} and {} both use port {}",
                    other.name, v.name, v.port
                )));
            }
            desired.push((key, kind, v));
        }

        let mut inner = self.inner.lock().await;
        if self.draining.load(Ordering::Relaxed) {
            // A draining node takes no new connections: record the version only.
            self.version.store(cfg.version, Ordering::Relaxed);
            return Ok(cfg.version);
        }

        // Bind every new listener before touching the running ones.
        let mut bound: HashMap<(u16, Transport), Bound> = HashMap::new();
        for (key, _, v) in &desired {
            if inner.listeners.contains_key(key) {
                continue;
            }
            let addr = SocketAddr::new(self.ip, key.0);
            let r = match key.1 {
                Transport::Tcp => TcpListener::bind(addr).await.map(Bound::Tcp),
                Transport::Udp => UdpSocket::bind(addr).await.map(Bound::Udp),
            };
            match r {
                Ok(b) => {
                    bound.insert(*key, b);
                }
                Err(e) => {
                    tracing::warn!(vserver = %v.name, %addr, error = %e, "bind failed; keeping the previous configuration");
                    return Err(Status::failed_precondition(format!(
                        "vserver {}: cannot listen on {}: {}",
                        v.name, addr, e
                    )));
                }
            }
        }

        // Close removed listeners.
        let keep: Vec<(u16, Transport)> = desired.iter().map(|(k, _, _)| *k).collect();
        let removed: Vec<(u16, Transport)> = inner
            .listeners
            .keys()
            .filter(|k| !keep.contains(k))
            .copied()
            .collect();
        for key in removed {
            if let Some(l) = inner.listeners.remove(&key) {
                let st = l.vs.state();
                self.service_drains(&st.name, Some(&st), None);
                l.vs.scaleout.update(&st.name, key.0, None);
                l.vs.closing.cancel();
                let _ = l.task.await;
                tracing::info!(port = key.0, "vserver closed");
            }
        }

        // Update kept ones in place, open new ones.
        for (key, kind, v) in &desired {
            let prev = inner.listeners.get(key).map(|l| l.vs.state());
            let state = Arc::new(
                self.build_state(v, *kind, prev.as_deref())
                    .with_proxy_from(peers.clone()),
            );
            self.service_drains(&v.name, prev.as_deref(), Some(&state));
            if let Some(l) = inner.listeners.get(key) {
                l.vs.set_state(state);
                l.vs.scaleout.update(&v.name, key.0, v.scaleout.as_ref());
                continue;
            }
            let vs = Arc::new(Vserver {
                state: RwLock::new(state),
                generation: AtomicU64::new(0),
                closing: self.drain.child_token(),
                kill: self.kill.clone(),
                node_hv: self.node_hv.clone(),
                scaleout: crate::scaleout::Scaleout::new(self.opts.persistence_timeout),
                sources: crate::persist::Table::new(
                    self.opts.persistence_timeout,
                    crate::persist::MAX_ENTRIES,
                ),
            });
            vs.scaleout.update(&v.name, key.0, v.scaleout.as_ref());
            let task = match bound.remove(key) {
                Some(Bound::Tcp(l)) => tokio::spawn(accept_loop(l, vs.clone())),
                Some(Bound::Udp(s)) => tokio::spawn(crate::udp::serve(s, vs.clone(), self.ip)),
                None => continue,
            };
            tracing::info!(vserver = %v.name, addr = %SocketAddr::new(self.ip, key.0), kind = ?kind, "vserver listening");
            inner.listeners.insert(*key, Listener { vs, task });
        }
        let names: std::collections::HashSet<&str> =
            desired.iter().map(|(_, _, v)| v.name.as_str()).collect();
        self.ramps.retain(&names);
        self.version.store(cfg.version, Ordering::Relaxed);
        Ok(cfg.version)
    }

    /// Starts draining (idempotent): closes every listener, lets connections finish
    /// until `timeout`, then closes them. Waits briefly for idle connections to go.
    pub async fn drain(self: &Arc<Self>, timeout: Duration) -> u64 {
        if !self.draining.swap(true, Ordering::SeqCst) {
            tracing::info!(timeout_ms = timeout.as_millis() as u64, "draining");
            self.drain.cancel();
            let kill = self.kill.clone();
            tokio::spawn(async move {
                tokio::time::sleep(timeout).await;
                let left = ACTIVE_CONNS.load(Ordering::Relaxed);
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
        while ACTIVE_CONNS.load(Ordering::Relaxed) > 0 && Instant::now() < settle {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        ACTIVE_CONNS.load(Ordering::Relaxed)
    }

    /// Builds the snapshot of a vserver, keeping the runtime (counters, health,
    /// idle connections) of services whose name, address and port did not change.
    /// New services start UP, with a health check when those are on.
    fn build_state(
        &self,
        v: &lbscale_proto::Vserver,
        kind: Kind,
        prev: Option<&VsState>,
    ) -> VsState {
        let loads = self
            .custom_loads
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        let services = v
            .services
            .iter()
            .map(|s| {
                let rt = prev
                    .and_then(|p| {
                        p.services.iter().find(|e| {
                            !e.peer
                                && e.rt.name == s.name
                                && e.rt.host == s.address
                                && e.rt.port as u32 == s.port
                        })
                    })
                    .map(|e| e.rt.clone())
                    .unwrap_or_else(|| {
                        let rt = Arc::new(ServiceRt::new(&s.name, &s.address, s.port as u16));
                        if !self.opts.health.interval.is_zero() {
                            tokio::spawn(health_loop(
                                Arc::downgrade(&rt),
                                self.opts.health,
                                v.name.clone(),
                            ));
                        }
                        rt
                    });
                // The configuration's CUSTOMLOAD value takes precedence over the file's.
                rt.set_custom_load(
                    s.custom_load
                        .or_else(|| custom_load_for(&loads, &v.name, &s.name))
                        .unwrap_or(0.0),
                );
                let mut e = SvcEntry::new(rt, s.weight.max(1), s.enabled);
                e.explicit_cap = s.cap_per_second;
                e.custom_load = s.custom_load;
                e
            })
            .collect();
        let services = self.ramps.configure(v, kind, services, self.uptime_ms());
        // Validated in `configure`.
        let persistence = crate::persist::parse(&v.persistence).unwrap_or_default();
        VsState::new(v.name.clone(), kind, method_of(v.lb_method), services)
            .with_persistence(persistence)
    }

    /// Node uptime, ms: the clock of the slow-start model.
    pub fn uptime_ms(&self) -> u64 {
        self.started.elapsed().as_millis() as u64
    }

    /// Services that stop taking new connections (disabled, or removed with their
    /// vserver or alone) drain: their connections may go on for
    /// `opts.service_drain`, then close. Enabled ones stop draining. Removed ones
    /// stay in the statistics while they have connections.
    fn service_drains(&self, vserver: &str, prev: Option<&VsState>, next: Option<&VsState>) {
        if let Some(n) = next {
            for e in n.services.iter().filter(|e| e.enabled) {
                e.rt.end_drain();
            }
        }
        let Some(p) = prev else { return };
        for e in &p.services {
            let kept = next.and_then(|n| n.services.iter().find(|x| Arc::ptr_eq(&x.rt, &e.rt)));
            if kept.is_some_and(|x| x.enabled) {
                continue;
            }
            if kept.is_none() {
                self.removed
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push((vserver.to_string(), e.rt.clone()));
            }
            let Some(gen) = e.rt.begin_drain() else {
                continue;
            };
            let rt = e.rt.clone();
            let timeout = self.opts.service_drain;
            let vserver = vserver.to_string();
            tracing::info!(vserver = %vserver, service = %rt.name, connections = rt.active.load(Ordering::Relaxed), "service draining");
            tokio::spawn(async move {
                tokio::time::sleep(timeout).await;
                let left = rt.active.load(Ordering::Relaxed);
                if rt.drain_timed_out(gen) && left > 0 {
                    tracing::info!(vserver = %vserver, service = %rt.name, connections = left, "service drain timeout: closing its connections");
                }
            });
        }
    }

    /// Replaces the CUSTOMLOAD values (keys `vserver/service` or `service`; a
    /// service without a value has load 0) and applies them at once.
    pub async fn set_custom_loads(&self, loads: HashMap<String, f64>) {
        let states: Vec<Arc<VsState>> = {
            let inner = self.inner.lock().await;
            inner.listeners.values().map(|l| l.vs.state()).collect()
        };
        for st in &states {
            for e in st.services.iter().filter(|e| e.custom_load.is_none()) {
                e.rt.set_custom_load(custom_load_for(&loads, &st.name, &e.rt.name).unwrap_or(0.0));
            }
        }
        *self.custom_loads.lock().unwrap_or_else(|e| e.into_inner()) = loads;
    }

    pub fn state_name(&self) -> &'static str {
        if !self.draining.load(Ordering::Relaxed) {
            "active"
        } else if ACTIVE_CONNS.load(Ordering::Relaxed) == 0 {
            "drained"
        } else {
            "draining"
        }
    }

    pub async fn stats(&self) -> lbscale_proto::NodeStats {
        let sample = *self.sample.lock().unwrap_or_else(|e| e.into_inner());
        let memory_percent = match (metrics::process_rss_kb(), self.memory_limit_mb) {
            (Some(kb), lim) if lim > 0 => kb as f64 / (lim as f64 * 1024.0) * 100.0,
            _ => 0.0,
        };
        let mut services = Vec::new();
        let inner = self.inner.lock().await;
        let mut forwarded = Vec::new();
        let mut served_connections_total = HashMap::new();
        for l in inner.listeners.values() {
            let name = l.vs.state().name.clone();
            forwarded.extend(l.vs.scaleout.forward_stats(&name));
            served_connections_total.insert(name, l.vs.scaleout.served());
        }
        let mut states: Vec<Arc<VsState>> =
            inner.listeners.values().map(|l| l.vs.state()).collect();
        drop(inner);
        states.sort_by(|a, b| a.name.cmp(&b.name));
        // Removed services still draining connections.
        let removed: Vec<(String, Arc<ServiceRt>)> = {
            let mut r = self.removed.lock().unwrap_or_else(|e| e.into_inner());
            r.retain(|(vs, rt)| {
                rt.active.load(Ordering::Relaxed) > 0
                    && !states
                        .iter()
                        .any(|s| s.name == *vs && s.services.iter().any(|e| Arc::ptr_eq(&e.rt, rt)))
            });
            r.clone()
        };
        for (vs, rt) in removed {
            services.push(lbscale_proto::ServiceStats {
                vserver: vs,
                service: rt.name.clone(),
                requests_total: rt.requests_total.load(Ordering::Relaxed),
                requests_per_second: f64::from_bits(rt.rps_bits.load(Ordering::Relaxed)),
                active_connections: rt.active.load(Ordering::Relaxed),
                avg_response_ms: f64::from_bits(rt.avg_ms_bits.load(Ordering::Relaxed)),
                ..Default::default()
            });
        }
        let uptime_ms = self.uptime_ms();
        for st in states {
            for e in &st.services {
                let rt = &e.rt;
                let cap = e.cap();
                // up_since (ns since process start) is when it was bound or last
                // came UP: when it last became new.
                let new_since_ms = uptime_ms
                    .saturating_sub(metrics::now_ns().saturating_sub(rt.up_since_ns()) / 1_000_000);
                services.push(lbscale_proto::ServiceStats {
                    vserver: st.name.clone(),
                    service: rt.name.clone(),
                    requests_total: rt.requests_total.load(Ordering::Relaxed),
                    requests_per_second: f64::from_bits(rt.rps_bits.load(Ordering::Relaxed)),
                    active_connections: rt.active.load(Ordering::Relaxed),
                    avg_response_ms: f64::from_bits(rt.avg_ms_bits.load(Ordering::Relaxed)),
                    health: if !e.enabled {
                        "DISABLED"
                    } else if rt.is_up() {
                        "UP"
                    } else {
                        "DOWN"
                    }
                    .to_string(),
                    // An explicit cap from the configuration is an operator's
                    // limit, not a ramp.
                    in_slow_start: cap.is_some()
                        && e.explicit_cap.is_none()
                        && !e.peer
                        && e.usable(),
                    cap_per_second: cap.unwrap_or(0.0),
                    new_since_ms,
                });
            }
        }
        lbscale_proto::NodeStats {
            node_id: self.id.clone(),
            state: self.state_name().to_string(),
            config_version: self.version(),
            cpu_percent: sample.cpu_percent,
            memory_percent,
            throughput_mbps: sample.throughput_mbps,
            active_connections: ACTIVE_CONNS.load(Ordering::Relaxed),
            total_connections: TOTAL_CONNS.load(Ordering::Relaxed),
            services,
            uptime_ms: self.started.elapsed().as_millis() as u64,
            forwarded,
            served_connections_total,
        }
    }
}

fn custom_load_for(loads: &HashMap<String, f64>, vserver: &str, service: &str) -> Option<f64> {
    loads
        .get(&format!("{vserver}/{service}"))
        .or_else(|| loads.get(service))
        .copied()
}

/// Polls `path` (a JSON object of load values, keys `vserver/service` or
/// `service`) every 200 ms and applies it when it changes.
pub async fn watch_custom_loads(node: Arc<Node>, path: std::path::PathBuf) {
    let mut last: Option<Vec<u8>> = None;
    let mut tick = tokio::time::interval(Duration::from_millis(200));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let Ok(b) = tokio::fs::read(&path).await else {
            continue;
        };
        if last.as_ref() == Some(&b) {
            continue;
        }
        match serde_json::from_slice::<HashMap<String, f64>>(&b) {
            Ok(m) => {
                tracing::info!(path = %path.display(), services = m.len(), "custom loads applied");
                node.set_custom_loads(m).await;
            }
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "invalid custom load file; keeping the previous values")
            }
        }
        last = Some(b);
    }
}

async fn accept_loop(listener: TcpListener, vs: Arc<Vserver>) {
    loop {
        tokio::select! {
            _ = vs.closing.cancelled() => break,
            r = listener.accept() => match r {
                Ok((stream, peer)) => {
                    // Served here, or forwarded to a scale-out secondary.
                    tokio::spawn(crate::scaleout::accept(stream, peer, vs.clone()));
                }
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
        }
    }
}

/// Runs the node's own slow start (`crate::slowstart`): a tick every 100 ms and at
/// every increment boundary, serialised with Configure by the listeners' lock.
async fn slow_start_loop(node: std::sync::Weak<Node>) {
    loop {
        let wait = {
            let Some(node) = node.upgrade() else { return };
            let inner = node.inner.lock().await;
            let vservers: Vec<&Vserver> = inner.listeners.values().map(|l| &*l.vs).collect();
            let next = node.ramps.tick(&vservers, node.uptime_ms());
            // One ms late rather than early: the boundary must have passed.
            (next + 1).saturating_sub(node.uptime_ms())
        };
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(wait)) => {}
            _ = crate::slowstart::WAKE.notified() => {}
        }
    }
}

/// Every second: CPU of this process, throughput, per-service rates.
async fn sampler(node: std::sync::Weak<Node>) {
    let mut last_cpu = metrics::process_cpu_seconds().unwrap_or(0.0);
    let mut last_bytes = BYTES.load(Ordering::Relaxed);
    let mut last_t = Instant::now();
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    loop {
        tick.tick().await;
        let Some(node) = node.upgrade() else { return };
        let dt = last_t.elapsed().as_secs_f64().max(1e-3);
        last_t = Instant::now();
        let cpu = metrics::process_cpu_seconds().unwrap_or(last_cpu);
        let bytes = BYTES.load(Ordering::Relaxed);
        let s = Sample {
            cpu_percent: ((cpu - last_cpu) / dt * 100.0).max(0.0),
            throughput_mbps: (bytes - last_bytes) as f64 * 8.0 / 1e6 / dt,
        };
        last_cpu = cpu;
        last_bytes = bytes;
        *node.sample.lock().unwrap_or_else(|e| e.into_inner()) = s;
        let states: Vec<Arc<VsState>> = {
            let inner = node.inner.lock().await;
            inner.listeners.values().map(|l| l.vs.state()).collect()
        };
        for st in states {
            for e in &st.services {
                let rt = &e.rt;
                let total = rt.requests_total.load(Ordering::Relaxed);
                let prev = rt.last_total.swap(total, Ordering::Relaxed);
                rt.rps_bits
                    .store(((total - prev) as f64 / dt).to_bits(), Ordering::Relaxed);
                let us = rt.resp_us_total.load(Ordering::Relaxed);
                let cnt = rt.resp_count.load(Ordering::Relaxed);
                let pus = rt.last_resp_us.swap(us, Ordering::Relaxed);
                let pcnt = rt.last_resp_count.swap(cnt, Ordering::Relaxed);
                // Average over the window; the lifetime average when the window is empty.
                let avg = if cnt > pcnt {
                    (us - pus) as f64 / (cnt - pcnt) as f64 / 1000.0
                } else if cnt > 0 {
                    us as f64 / cnt as f64 / 1000.0
                } else {
                    0.0
                };
                rt.avg_ms_bits.store(avg.to_bits(), Ordering::Relaxed);
            }
        }
    }
}
