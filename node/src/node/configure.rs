//! Applying a full configuration to the node: validate it, bind the new
//! listeners, close the removed ones, swap the kept vservers' snapshots in
//! place, and drain the services that stop taking connections.

use std::collections::{HashMap, HashSet};
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use lbscale_proto::{LbMethod, NodeConfig, ServiceType};
use tokio::net::{TcpListener, UdpSocket};
use tonic::Status;

use super::custom_load::custom_load_for;
use super::{Inner, Listener, Node, Transport};
use crate::lb::Method;
use crate::model::{Kind, VsState, Vserver};
use crate::persist::{self, Persistence};
use crate::scaleout::RESOLVE_TIMEOUT;
use crate::service::{HealthCheck, ServiceRt, SvcEntry};

/// A vserver of the configuration: its listener's key, its type, its settings.
type Desired<'a> = ((u16, Transport), Kind, &'a lbscale_proto::Vserver);

/// The services' names (host, port) as resolved when the configuration is
/// applied.
type Resolved = HashMap<(String, u16), Option<SocketAddr>>;

/// Resolves every service given by name, all at once, each within
/// [`RESOLVE_TIMEOUT`]: UDP flows use the result and never resolve on their
/// receive path. A name that does not resolve is logged; its UDP flows are not
/// opened until a configuration resolves it.
async fn resolve_names(cfg: &NodeConfig) -> Resolved {
    let mut tasks = tokio::task::JoinSet::new();
    let mut seen = HashSet::new();
    for s in cfg.vservers.iter().flat_map(|v| &v.services) {
        let key = (s.address.clone(), s.port as u16);
        if s.address.parse::<IpAddr>().is_ok() || !seen.insert(key.clone()) {
            continue;
        }
        tasks.spawn(async move {
            let lookup = tokio::net::lookup_host((key.0.clone(), key.1));
            let r = tokio::time::timeout(RESOLVE_TIMEOUT, lookup).await;
            let a = match r {
                Ok(Ok(mut a)) => a.next(),
                Ok(Err(e)) => {
                    tracing::warn!(service = %key.0, error = %e, "service name does not resolve");
                    None
                }
                Err(_) => {
                    tracing::warn!(service = %key.0, "service name did not resolve in time");
                    None
                }
            };
            (key, a)
        });
    }
    let mut out = HashMap::new();
    while let Some(r) = tasks.join_next().await {
        if let Ok((k, a)) = r {
            out.insert(k, a);
        }
    }
    out
}

/// How a service of vserver `v` of type `kind` is health-checked.
fn health_check_of(v: &lbscale_proto::Vserver, kind: Kind) -> HealthCheck {
    match kind {
        Kind::Udp if v.udp_health_request.is_empty() => HealthCheck::UdpPassive,
        Kind::Udp => HealthCheck::UdpRequest(v.udp_health_request.as_slice().into()),
        _ => HealthCheck::Tcp,
    }
}

enum Bound {
    Tcp(TcpListener),
    Udp(UdpSocket),
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

/// The largest UDP payload over IPv4.
const MAX_UDP_PAYLOAD: usize = 65507;

// The checks return the message of an invalid-argument error: the
// configuration is refused whole, naming the field and what is allowed.

fn invalid(v: &lbscale_proto::Vserver, what: String) -> String {
    format!("vserver {}: {what}", v.name)
}

/// The group's other nodes, whose connections carry a PROXY header.
fn group_peers(cfg: &NodeConfig) -> Result<Arc<HashSet<IpAddr>>, String> {
    let mut peers = HashSet::new();
    for p in &cfg.group_peers {
        let ip: IpAddr = p
            .parse()
            .map_err(|_| format!("group_peers: must be IP addresses, got {p:?}"))?;
        peers.insert(ip);
    }
    Ok(Arc::new(peers))
}

fn validate_services(v: &lbscale_proto::Vserver) -> Result<(), String> {
    for s in &v.services {
        if s.port == 0 || s.port > 65535 || s.address.is_empty() {
            return Err(invalid(
                v,
                format!(
                    "service {} has an invalid address {}:{}",
                    s.name, s.address, s.port
                ),
            ));
        }
        if s.cap_per_second.is_some_and(|c| !c.is_finite() || c < 0.0) {
            return Err(invalid(
                v,
                format!("service {}: cap_per_second must be >= 0", s.name),
            ));
        }
        if s.custom_load.is_some_and(|c| !c.is_finite()) {
            return Err(invalid(
                v,
                format!("service {}: custom_load must be a finite number", s.name),
            ));
        }
    }
    Ok(())
}

/// Checks one vserver; returns its type. `own` is this node's address.
fn validate_vserver(v: &lbscale_proto::Vserver, own: Option<IpAddr>) -> Result<Kind, String> {
    let kind = kind_of(v.service_type)
        .ok_or_else(|| invalid(v, "service_type must be HTTP, TCP or UDP".into()))?;
    if v.port == 0 || v.port > 65535 {
        return Err(invalid(v, format!("port {} is not in 1..65535", v.port)));
    }
    validate_services(v)?;
    if let Some(ss) = &v.slow_start {
        let max = lbscale_core::slowstart::MAX_INCREMENT_INTERVAL;
        if ss.increment_interval_s > max {
            return Err(invalid(
                v,
                format!(
                    "slow_start.increment_interval_s must be 0-{max} (0 is manual slow start), got {}",
                    ss.increment_interval_s
                ),
            ));
        }
    }
    if v.udp_health_request.len() > MAX_UDP_PAYLOAD {
        return Err(invalid(
            v,
            format!(
                "udp_health_request must be at most {MAX_UDP_PAYLOAD} bytes, got {}",
                v.udp_health_request.len()
            ),
        ));
    }
    crate::scaleout::validate(v, own)?;
    let p = persist::parse(&v.persistence).map_err(|e| invalid(v, e))?;
    if p == Persistence::Cookie && kind != Kind::Http {
        // Refused at plan time; a configuration stored before that rule
        // still deploys, without persistence.
        tracing::warn!(vserver = %v.name, "COOKIE persistence needs an HTTP vserver: ignored");
    }
    Ok(kind)
}

/// The configuration's vservers, checked, with their listeners' keys (two
/// vservers may not share a port and transport).
fn validate(cfg: &NodeConfig, own: Option<IpAddr>) -> Result<Vec<Desired<'_>>, String> {
    let mut desired: Vec<Desired<'_>> = Vec::new();
    for v in &cfg.vservers {
        let kind = validate_vserver(v, own)?;
        let t = if kind == Kind::Udp {
            Transport::Udp
        } else {
            Transport::Tcp
        };
        let key = (v.port as u16, t);
        if let Some((_, _, other)) = desired.iter().find(|(k, _, _)| *k == key) {
            return Err(format!(
                "vservers {} and {} both use port {}",
                other.name, v.name, v.port
            ));
        }
        desired.push((key, kind, v));
    }
    Ok(desired)
}

impl Node {
    /// Applies a full configuration. On error nothing changes.
    pub async fn configure(&self, cfg: NodeConfig) -> Result<u64, Status> {
        let peers = group_peers(&cfg).map_err(Status::invalid_argument)?;
        let desired =
            validate(&cfg, self.common.dialer.source()).map_err(Status::invalid_argument)?;
        let resolved = resolve_names(&cfg).await;
        let mut inner = self.inner.lock().await;
        // Under the lock: of two pushes at once, the older fence never lands
        // after the newer one.
        if cfg.fence < inner.fence {
            return Err(Status::aborted(format!(
                "configuration fence {} is older than {}, which this node applied: a newer holder configured it",
                cfg.fence, inner.fence
            )));
        }
        if self.draining.load(Ordering::Relaxed) {
            // A draining node takes no new connections: record the version only.
            inner.fence = cfg.fence;
            self.publish(&inner, cfg.version);
            return Ok(cfg.version);
        }
        let mut bound = self.bind_new(&inner, &desired).await?;
        self.close_removed(&mut inner, &desired).await;
        for (key, kind, v) in &desired {
            let prev = inner.listeners.get(key).map(|l| l.vs.state());
            let state = Arc::new(
                self.build_state(v, *kind, prev.as_deref(), &resolved)
                    .with_proxy_from(peers.clone()),
            );
            self.service_drains(&v.name, prev.as_deref(), Some(&state));
            if let Some(l) = inner.listeners.get(key) {
                l.vs.set_state(state);
                l.vs.set_max_connections(v.max_connections);
                l.vs.scaleout.update(&v.name, key.0, v.scaleout.as_ref());
            } else if let Some(b) = bound.remove(key) {
                let l = self.open(v, key.0, state, b);
                tracing::info!(vserver = %v.name, addr = %SocketAddr::new(self.ip, key.0), kind = ?kind, "vserver listening");
                inner.listeners.insert(*key, l);
            }
            if let Some(l) = inner.listeners.get(key) {
                l.vs.scaleout.resolve_names().await;
            }
        }
        let names: HashSet<&str> = desired.iter().map(|(_, _, v)| v.name.as_str()).collect();
        self.ramps.retain(&names);
        inner.fence = cfg.fence;
        self.publish(&inner, cfg.version);
        Ok(cfg.version)
    }

    /// Binds every new listener before touching the running ones: a port that
    /// cannot be bound refuses the whole configuration.
    async fn bind_new(
        &self,
        inner: &Inner,
        desired: &[Desired<'_>],
    ) -> Result<HashMap<(u16, Transport), Bound>, Status> {
        let mut bound = HashMap::new();
        for (key, _, v) in desired {
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
        Ok(bound)
    }

    /// Closes the listeners of vservers no longer configured.
    async fn close_removed(&self, inner: &mut Inner, desired: &[Desired<'_>]) {
        let removed: Vec<(u16, Transport)> = inner
            .listeners
            .keys()
            .filter(|k| !desired.iter().any(|(d, _, _)| d == *k))
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
    }

    /// A new vserver on its bound socket.
    fn open(
        &self,
        v: &lbscale_proto::Vserver,
        port: u16,
        state: Arc<VsState>,
        b: Bound,
    ) -> Listener {
        let vs = Arc::new(Vserver::new(
            state,
            self.drain.child_token(),
            &self.common,
            self.opts.persistence_timeout,
        ));
        vs.scaleout.update(&v.name, port, v.scaleout.as_ref());
        vs.set_max_connections(v.max_connections);
        let task = match b {
            Bound::Tcp(l) => tokio::spawn(crate::listener::accept_loop(l, vs.clone())),
            Bound::Udp(s) => tokio::spawn(crate::udp::serve(s, vs.clone())),
        };
        Listener { vs, task }
    }

    /// Builds the snapshot of a vserver, keeping the runtime (counters, health,
    /// idle connections) of services whose name, address and port did not change.
    /// New services start UP, with a health check when those are on.
    fn build_state(
        &self,
        v: &lbscale_proto::Vserver,
        kind: Kind,
        prev: Option<&VsState>,
        resolved: &Resolved,
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
                let rt = self.service_rt(v, kind, s, prev);
                if rt.is_named() {
                    let key = (s.address.clone(), s.port as u16);
                    rt.set_resolved(resolved.get(&key).copied().flatten());
                }
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
        let persistence = persist::parse(&v.persistence).unwrap_or_default();
        VsState::new(v.name.clone(), kind, method_of(v.lb_method), services)
            .with_persistence(persistence)
    }

    /// The runtime of service `s`: the previous snapshot's when its name, address
    /// and port are the same, else a new one (UP, health-checked).
    fn service_rt(
        &self,
        v: &lbscale_proto::Vserver,
        kind: Kind,
        s: &lbscale_proto::Service,
        prev: Option<&VsState>,
    ) -> Arc<ServiceRt> {
        let kept = prev.and_then(|p| {
            p.services.iter().find(|e| {
                !e.peer
                    && e.rt.name == s.name
                    && e.rt.host == s.address
                    && e.rt.port as u32 == s.port
            })
        });
        let check = health_check_of(v, kind);
        if let Some(e) = kept {
            e.rt.set_health_check(check);
            return e.rt.clone();
        }
        let rt = Arc::new(ServiceRt::new(&s.name, &s.address, s.port as u16));
        rt.set_health_check(check);
        self.prober.watch(&rt, &v.name);
        rt
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
            if let Some(gen) = e.rt.begin_drain() {
                self.drain_service(vserver, e.rt.clone(), gen);
            }
        }
    }

    /// Closes the connections of a draining service after `opts.service_drain`,
    /// unless it was enabled again meanwhile.
    fn drain_service(&self, vserver: &str, rt: Arc<ServiceRt>, gen: u64) {
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
