//! The vserver model the protocol modules share: a vserver's configuration
//! snapshot ([`VsState`]: its services, balancing, persistence, who may send a
//! PROXY header) and the live vserver ([`Vserver`]) that swaps snapshots in
//! place while its listener runs.

use std::collections::HashSet;
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock, Weak};
use std::time::Duration;

use hyper::header::HeaderValue;
use tokio_util::sync::CancellationToken;

use crate::bounds::{admit, Admission, Budget, Limits, DEFAULT_MAX_CONNECTIONS};
use crate::dial::Dialer;
use crate::lb::{Balancer, Method};
use crate::metrics::Traffic;
use crate::persist::{cookie_name, cookie_token, Persistence, Table, MAX_ENTRIES};
use crate::scaleout::Scaleout;
use crate::service::{ServiceRt, SvcEntry};

/// A vserver's type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Http,
    Tcp,
    Udp,
}

/// Immutable configuration snapshot of a vserver (swapped on Configure).
pub struct VsState {
    pub name: String,
    pub kind: Kind,
    pub services: Vec<SvcEntry>,
    balancer: Balancer,
    pub persistence: Persistence,
    /// COOKIE: the cookie's name, and each own service's token and `Set-Cookie`
    /// value (None for ramp peers).
    pub cookie_name: String,
    cookies: Vec<Option<(String, HeaderValue)>>,
    /// The group's other nodes: their connections start with a PROXY v2 header
    /// (a primary forwarding a client), which is read and removed.
    pub proxy_from: Arc<HashSet<IpAddr>>,
}

impl VsState {
    pub fn new(name: String, kind: Kind, method: Method, services: Vec<SvcEntry>) -> Self {
        for e in &services {
            e.rt.track_traffic
                .store(method.tracks_traffic(), Ordering::Relaxed);
        }
        VsState {
            name,
            kind,
            balancer: Balancer::new(method, &services),
            services,
            persistence: Persistence::None,
            cookie_name: String::new(),
            cookies: Vec::new(),
            proxy_from: Default::default(),
        }
    }

    pub fn method(&self) -> Method {
        self.balancer.method()
    }

    /// The same vserver with its own services only (a join ramp is over), their
    /// caps to be set again.
    pub fn without_peers(&self) -> VsState {
        let own = self
            .services
            .iter()
            .filter(|e| !e.peer)
            .map(SvcEntry::renewed)
            .collect();
        VsState::new(self.name.clone(), self.kind, self.method(), own)
            .with_persistence(self.persistence)
            .with_proxy_from(self.proxy_from.clone())
    }

    /// Sets the addresses whose connections carry a PROXY header.
    pub fn with_proxy_from(mut self, peers: Arc<HashSet<IpAddr>>) -> Self {
        self.proxy_from = peers;
        self
    }

    /// Sets the vserver's persistence (see `persist`). COOKIE applies to HTTP
    /// vservers only; elsewhere it is NONE.
    pub fn with_persistence(mut self, p: Persistence) -> Self {
        let p = match p {
            Persistence::Cookie if self.kind != Kind::Http => Persistence::None,
            p => p,
        };
        self.persistence = p;
        if p == Persistence::Cookie {
            self.cookie_name = cookie_name(&self.name);
            self.cookies = self
                .services
                .iter()
                .map(|e| {
                    if e.peer {
                        return None;
                    }
                    let t = cookie_token(&e.rt.name, &e.rt.host, e.rt.port);
                    let v = format!("{}={t}; Path=/; HttpOnly", self.cookie_name);
                    HeaderValue::from_str(&v).ok().map(|v| (t, v))
                })
                .collect();
        }
        self
    }

    /// COOKIE: the own service whose token is `token`.
    pub fn service_of_token(&self, token: &str) -> Option<usize> {
        self.cookies
            .iter()
            .position(|c| c.as_ref().is_some_and(|(t, _)| t == token))
    }

    /// COOKIE: the `Set-Cookie` value that keeps a client on service `idx`.
    pub fn set_cookie(&self, idx: usize) -> Option<&HeaderValue> {
        self.cookies.get(idx)?.as_ref().map(|(_, v)| v)
    }

    /// The index of the (own) service whose runtime is `rt`.
    pub fn index_of(&self, rt: &Arc<ServiceRt>) -> Option<usize> {
        self.services
            .iter()
            .position(|e| !e.peer && Arc::ptr_eq(&e.rt, rt))
    }

    /// A persistent client's service `idx`, if it may still take it: an own
    /// service, enabled, UP and not draining. Bypasses the LB method and the
    /// slow-start cap (a persistent session is not new load) but counts in the
    /// service's `requests_total`.
    pub fn pick_persistent(&self, idx: usize) -> Option<usize> {
        let e = self.services.get(idx)?;
        if e.peer || !e.usable() || e.rt.is_draining() {
            return None;
        }
        e.rt.requests_total.fetch_add(1, Ordering::Relaxed);
        Some(idx)
    }

    /// An own service not in `tried` (see [`Balancer::own_fallback`]); counted in
    /// its `requests_total`.
    fn pick_own_untried(&self, tried: &[usize]) -> Option<usize> {
        let idx = self.balancer.own_fallback(&self.services, tried)?;
        self.services[idx]
            .rt
            .requests_total
            .fetch_add(1, Ordering::Relaxed);
        Some(idx)
    }

    /// Chooses a service by the LB method (see `lb`), never `exclude`.
    /// Increments the chosen service's `requests_total`.
    #[inline]
    pub fn pick(&self, exclude: Option<usize>) -> Option<usize> {
        let idx = self.balancer.pick(&self.services, exclude)?;
        self.services[idx]
            .rt
            .requests_total
            .fetch_add(1, Ordering::Relaxed);
        Some(idx)
    }
}

/// A vserver's SOURCEIP table: client IP → service runtime (weak: a removed
/// service's runtime is not kept alive by it).
pub type SourceTable = Table<IpAddr, Weak<ServiceRt>>;

/// What every vserver of a node shares with it.
#[derive(Clone)]
pub struct Common {
    /// Cancelled when the node closes every connection (end of drain).
    pub kill: CancellationToken,
    /// The node's id, as the `X-LBSCALE-Node` header carries it.
    pub node_hv: HeaderValue,
    pub traffic: Arc<Traffic>,
    pub dialer: Dialer,
    pub limits: Limits,
    /// The node's descriptors that connections and flows may use.
    pub descriptors: Arc<Budget>,
}

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
    pub traffic: Arc<Traffic>,
    /// Opens the connections to services and secondaries.
    pub dialer: Dialer,
    /// Native scale-out: where new connections go, forwarding statistics.
    pub scaleout: Scaleout,
    /// SOURCEIP persistence: client IP → service (kept across configurations).
    pub sources: SourceTable,
    pub limits: Limits,
    /// This vserver's open connections (or UDP flows) against its limit.
    connections: Arc<Budget>,
    descriptors: Arc<Budget>,
}

impl Vserver {
    /// `persistence_timeout`: how long a SOURCEIP client's entry lives unused.
    pub fn new(
        state: Arc<VsState>,
        closing: CancellationToken,
        common: &Common,
        persistence_timeout: Duration,
    ) -> Self {
        Vserver {
            state: RwLock::new(state),
            generation: AtomicU64::new(0),
            closing,
            kill: common.kill.clone(),
            node_hv: common.node_hv.clone(),
            traffic: common.traffic.clone(),
            dialer: common.dialer,
            scaleout: Scaleout::new(persistence_timeout),
            sources: Table::new(persistence_timeout, MAX_ENTRIES),
            limits: common.limits,
            connections: Budget::new(DEFAULT_MAX_CONNECTIONS),
            descriptors: common.descriptors.clone(),
        }
    }

    /// Sets the vserver's connection limit (0: the default).
    pub fn set_max_connections(&self, n: u32) {
        let n = if n == 0 {
            DEFAULT_MAX_CONNECTIONS
        } else {
            n as usize
        };
        self.connections.set_limit(n);
    }

    /// Admits a new connection or UDP flow holding `fds` descriptors, when the
    /// vserver's limit and the node's descriptors allow it.
    #[inline]
    pub fn admit(&self, fds: usize) -> Option<Admission> {
        admit(&self.connections, &self.descriptors, fds)
    }

    /// Open connections or flows, and the limit.
    pub fn connections(&self) -> (usize, usize) {
        (self.connections.used(), self.connections.limit())
    }

    #[inline]
    pub fn state(&self) -> Arc<VsState> {
        self.state.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    pub fn set_state(&self, s: Arc<VsState>) {
        *self.state.write().unwrap_or_else(|e| e.into_inner()) = s;
        self.generation.fetch_add(1, Ordering::Release);
    }

    #[inline]
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// Picks a service for a new request (HTTP), connection (TCP) or flow (UDP)
    /// from `client`, never `exclude`, honouring SOURCEIP persistence.
    #[inline]
    pub fn pick_for(&self, st: &VsState, client: IpAddr, exclude: Option<usize>) -> Option<usize> {
        if st.persistence == Persistence::SourceIp {
            pick_for_source(st, &self.sources, client, exclude)
        } else {
            st.pick(exclude)
        }
    }

    /// The entry to try after those in `tried` (in order) could not be connected
    /// to: the LB method's choice without the last one, unless it was tried
    /// already or is a ramp peer after a peer failed; else an own service not
    /// tried yet, caps ignored. A ramp peer can be a node deleted a moment ago
    /// (its health check marks it DOWN only after `fall` probes): while an own
    /// service can take the request, such a peer must not fail it.
    pub fn pick_after_failure(
        &self,
        st: &VsState,
        client: IpAddr,
        tried: &[usize],
    ) -> Option<usize> {
        let last = *tried.last()?;
        let after_peer = st.services[last].peer;
        match self.pick_for(st, client, Some(last)) {
            Some(j) if !tried.contains(&j) && !(after_peer && st.services[j].peer) => Some(j),
            _ => st.pick_own_untried(tried),
        }
    }
}

/// SOURCEIP: the service for `client`: the one it is kept on if that may still
/// take it (and is not `exclude`), else the LB method's choice, remembered (ramp
/// peers, which stand for other nodes, are not).
fn pick_for_source(
    st: &VsState,
    table: &SourceTable,
    client: IpAddr,
    exclude: Option<usize>,
) -> Option<usize> {
    let sticky = table
        .get(client, |w| w.strong_count() > 0)
        .and_then(|w| w.upgrade());
    if let Some(rt) = sticky {
        let kept = st
            .index_of(&rt)
            .filter(|i| Some(*i) != exclude)
            .and_then(|i| st.pick_persistent(i));
        if kept.is_some() {
            return kept;
        }
        table.remove(client);
    }
    let i = st.pick(exclude)?;
    if !st.services[i].peer {
        table.insert(client, Arc::downgrade(&st.services[i].rt));
    }
    Some(i)
}
