//! The node's own slow start of a vserver's new services, run with lbscale-core's
//! model ([`lbscale_core::slowstart::Vserver`]) from the vserver's `slow_start`
//! settings, and the join ramp against `ramp_peers`.
//!
//! # New services
//!
//! A service is new when it is bound to the vserver on this node (a name not seen
//! before, or the same name at another address) and when its active health check
//! takes it from DOWN to UP; its ramp starts at that moment (node uptime, ms, the
//! model's clock). A vserver configured for the first time has only new services:
//! core's rule ("only new services: no ramp") lets them share the load at once. A
//! service that is disabled or DOWN is out of the model (the vserver's requests are
//! shared among the others); enabling it again does not make it new (only binding
//! and DOWN → UP do), coming UP does.
//!
//! # Every tick
//!
//! Every [`TICK`] and at every increment boundary: the vserver's request rate is
//! measured over the last [`RATE_WINDOW_MS`] (requests it handed to services and
//! peers), the services that got requests are recorded (the quiet-interval exit
//! rule), health changes are applied, the model advances, and its caps become the
//! entries' caps, which the token buckets of `lb` enforce (what a capped
//! service cannot take goes to the others). `cap_per_second` in the configuration
//! overrides the model for its service.
//!
//! # Join ramp
//!
//! When the node first gets a vserver whose configuration has `ramp_peers` and slow
//! start on, its own services are new (from that configuration on) and ramp against
//! the peers, which stand for the vserver's existing services: the model holds the
//! own services plus one existing pseudo-service for the peers, of weight
//! `Σ own weights × peers`, and the request rate is the node's own rate ×
//! `(peers + 1)`: the AZ's rate, assuming the distributor spreads it evenly over
//! the nodes. An own service's full share is then exactly its share of the node's
//! own traffic, and what the own services may not take yet is forwarded to the
//! peers, round robin: HTTP requests over HTTP to `peer:port` (peers are nodes
//! serving the same vserver), TCP connections and UDP flows likewise to
//! `peer:port`. The peers are entries named `peer:<address>:<port>` while the ramp
//! lasts (their request counts are in the statistics). When no own service is in
//! slow start any more the ramp is over: the peers are dropped and later
//! `ramp_peers` are ignored for that vserver. While it lasts, a configuration with
//! other (non-empty) `ramp_peers` replaces the peers; an empty list keeps them (the
//! engine sends the peers only while the node joins).
//!
//! A join ramp starts with the node's first request, not with its configuration:
//! clients find a new node only once the distributor hands out its address (and,
//! behind DNS, their cached answers expire). Until then the own services' ramps
//! are held at their start, so that the model, which sees a vserver without any
//! traffic, neither counts increments nor ends them for a full share of 0.

use std::collections::{HashMap, HashSet, VecDeque};
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};

use lbscale_core::slowstart::{
    LbMethod as ModelMethod, Ramp, Service as ModelService, SlowStartConfig, Unit, Vserver as Model,
};
use lbscale_proto as pb;

use crate::clock::now_ns;
use crate::health::Prober;
use crate::model::{Kind, Vserver};
use crate::service::{ServiceRt, SvcEntry};

/// Longest time between two ticks, ms.
pub const TICK_MS: u64 = 100;
/// Window over which a vserver's request rate is measured, ms.
pub const RATE_WINDOW_MS: u64 = 1000;
/// The peers' pseudo-service in the model (a NUL cannot come from an operator).
const PEERS: &str = "\u{0}ramp-peers";

/// The model's settings from the configuration; absent = off.
pub fn settings(ss: Option<&pb::SlowStart>) -> SlowStartConfig {
    match ss {
        None => SlowStartConfig {
            new_service_request: 0,
            unit: Unit::PerSecond,
            increment_interval: 0,
        },
        Some(s) => SlowStartConfig {
            new_service_request: s.new_service_request,
            unit: if s.unit == pb::SlowStartUnit::Percent as i32 {
                Unit::Percent
            } else {
                Unit::PerSecond
            },
            increment_interval: s.increment_interval_s,
        },
    }
}

fn model_method(m: i32) -> ModelMethod {
    match pb::LbMethod::try_from(m) {
        Ok(pb::LbMethod::Leastconnection) => ModelMethod::LeastConnection,
        Ok(pb::LbMethod::Leastresponsetime) => ModelMethod::LeastResponseTime,
        Ok(pb::LbMethod::Leastbandwidth) => ModelMethod::LeastBandwidth,
        Ok(pb::LbMethod::Leastpackets) => ModelMethod::LeastPackets,
        Ok(pb::LbMethod::Lrtm) => ModelMethod::Lrtm,
        Ok(pb::LbMethod::Customload) => ModelMethod::CustomLoad,
        _ => ModelMethod::RoundRobin,
    }
}

/// What the model last saw of an own service.
struct Seen {
    rt: Arc<ServiceRt>,
    up_since_ns: u64,
}

/// A join ramp in progress.
struct Join {
    /// Peer addresses as configured, to notice a change.
    configured: Vec<String>,
    peers: Vec<Arc<ServiceRt>>,
}

/// Slow-start state of one vserver.
struct VsRamp {
    model: Model,
    seen: HashMap<String, Seen>,
    join: Option<Join>,
    /// Requests counted per service runtime (own and peers), to take differences.
    last_totals: HashMap<usize, (std::sync::Weak<ServiceRt>, u64)>,
    /// Requests the vserver handed out, cumulative, and (time, count) samples.
    handed: u64,
    samples: VecDeque<(u64, u64)>,
    /// The vserver's own measured request rate, req/s.
    own_rate: f64,
}

/// The slow-start state of every vserver of the node.
pub struct Ramps {
    by_vs: Mutex<HashMap<String, VsRamp>>,
    /// Health checks of the ramp peers.
    prober: Prober,
    /// The node's address (a peer that is this node is skipped).
    ip: IpAddr,
}

impl Ramps {
    pub fn new(prober: Prober, ip: IpAddr) -> Self {
        Ramps {
            by_vs: Mutex::new(HashMap::new()),
            prober,
            ip,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, VsRamp>> {
        self.by_vs.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A Configure: the vserver's settings and services go into its model; returns
    /// `entries` with the caps in force and, during a join ramp, the peers.
    pub fn configure(
        &self,
        v: &pb::Vserver,
        kind: Kind,
        entries: Vec<SvcEntry>,
        now: u64,
    ) -> Vec<SvcEntry> {
        let mut all = self.lock();
        let first = !all.contains_key(&v.name);
        let r = all.entry(v.name.clone()).or_insert_with(|| VsRamp {
            model: Model {
                lb_method: model_method(v.lb_method),
                request_rate: 0.0,
                slow_start: settings(None),
                services: Vec::new(),
            },
            seen: HashMap::new(),
            join: None,
            last_totals: HashMap::new(),
            handed: 0,
            samples: VecDeque::new(),
            own_rate: 0.0,
        });
        // Increments due now are taken with the settings in force until now.
        r.observe(&entries, now);
        r.model.advance(now);
        r.model.slow_start = settings(v.slow_start.as_ref());
        r.model.lb_method = model_method(v.lb_method);
        let ramping = r.model.slow_start.new_service_request > 0;
        if first && ramping && !v.ramp_peers.is_empty() {
            tracing::info!(vserver = %v.name, peers = ?v.ramp_peers, "join ramp: the services ramp against the peers");
        }
        if (first && ramping) || r.join.is_some() {
            self.set_peers(r, v, kind);
        }
        r.sync(&entries, now);
        r.hold_join_until_traffic(now);
        r.model.advance(now);
        r.end_join_if_over(&v.name);
        r.apply_caps(&entries, now);
        let mut entries = entries;
        if let Some(j) = &r.join {
            let weight = r.own_weight().max(1);
            entries.extend(j.peers.iter().map(|rt| {
                let mut e = SvcEntry::new(rt.clone(), weight, true);
                e.peer = true;
                e
            }));
        }
        entries
    }

    /// Starts the join ramp, or follows a change of its peers (an empty list keeps
    /// them).
    fn set_peers(&self, r: &mut VsRamp, v: &pb::Vserver, kind: Kind) {
        if v.ramp_peers.is_empty()
            || r.join
                .as_ref()
                .is_some_and(|j| j.configured == v.ramp_peers)
        {
            return;
        }
        let old = r.join.take().map(|j| j.peers).unwrap_or_default();
        let mut peers: Vec<Arc<ServiceRt>> = Vec::new();
        for p in &v.ramp_peers {
            let (host, port) = match p.parse::<SocketAddr>() {
                Ok(a) => (a.ip().to_string(), a.port()),
                Err(_) => (p.clone(), v.port as u16),
            };
            if host.parse::<IpAddr>().ok() == Some(self.ip) && port == v.port as u16 {
                // Forwarding to itself would loop.
                continue;
            }
            let name = format!("peer:{host}:{port}");
            if peers.iter().any(|x| x.name == name) {
                continue;
            }
            let rt = old
                .iter()
                .find(|x| x.name == name)
                .cloned()
                .unwrap_or_else(|| {
                    let rt = Arc::new(ServiceRt::new(&name, &host, port));
                    // UDP has no connection to probe: UDP peers are not checked.
                    if kind != Kind::Udp {
                        self.prober.watch(&rt, &v.name);
                    }
                    rt
                });
            peers.push(rt);
        }
        r.join = (!peers.is_empty()).then(|| Join {
            configured: v.ramp_peers.clone(),
            peers,
        });
    }

    /// Forgets the vservers that are no longer configured.
    pub fn retain(&self, names: &HashSet<&str>) {
        self.lock().retain(|n, _| names.contains(n.as_str()));
    }

    /// One tick over the node's vservers at `now`; returns when the next one is
    /// due (node uptime, ms): [`TICK_MS`] later, or an increment boundary before.
    pub fn tick(&self, vservers: &[&Vserver], now: u64) -> u64 {
        let mut all = self.lock();
        let mut next = now + TICK_MS;
        for vs in vservers {
            let st = vs.state();
            let Some(r) = all.get_mut(&st.name) else {
                continue;
            };
            r.observe(&st.services, now);
            r.sync(&st.services, now);
            r.hold_join_until_traffic(now);
            r.model.advance(now);
            let joined = r.join.is_some();
            r.end_join_if_over(&st.name);
            if joined && r.join.is_none() {
                // The peers leave the snapshot: the node serves everything itself.
                let new = st.without_peers();
                r.apply_caps(&new.services, now);
                vs.set_state(Arc::new(new));
            } else {
                r.apply_caps(&st.services, now);
            }
            if let Some(b) = r.model.next_boundary(now) {
                next = next.min(b);
            }
        }
        next
    }
}

impl VsRamp {
    fn own_weight(&self) -> u32 {
        self.model
            .services
            .iter()
            .filter(|s| s.name != PEERS)
            .map(|s| s.weight)
            .sum()
    }

    /// Counts the requests handed out since the last call: the vserver's rate over
    /// the window, and which services got traffic (recorded into the model).
    fn observe(&mut self, entries: &[SvcEntry], now: u64) {
        let mut got: HashSet<&str> = HashSet::new();
        let mut handed = 0u64;
        for e in entries {
            let key = Arc::as_ptr(&e.rt) as usize;
            let total =
                e.rt.requests_total
                    .load(std::sync::atomic::Ordering::Relaxed);
            let last = match self.last_totals.get(&key) {
                Some((w, t)) if w.upgrade().is_some_and(|x| Arc::ptr_eq(&x, &e.rt)) => *t,
                // First seen: bound just now, so every request it has is new.
                _ => 0,
            };
            self.last_totals.insert(key, (Arc::downgrade(&e.rt), total));
            let d = total.saturating_sub(last);
            handed += d;
            if d > 0 {
                got.insert(if e.peer { PEERS } else { e.rt.name.as_str() });
            }
        }
        // Kept while the runtime lives: a Configure's entries lack the peers, whose
        // requests are then counted at the next tick.
        self.last_totals.retain(|_, (w, _)| w.strong_count() > 0);
        self.handed += handed;
        // Keep one sample older than the window: the rate spans a whole window.
        while self.samples.len() >= 2 && self.samples[1].0 + RATE_WINDOW_MS <= now {
            self.samples.pop_front();
        }
        if let Some(&(t0, n0)) = self.samples.front() {
            if now > t0 {
                self.own_rate = (self.handed - n0) as f64 * 1000.0 / (now - t0) as f64;
            }
        }
        self.samples.push_back((now, self.handed));
        let flags: Vec<bool> = self
            .model
            .services
            .iter()
            .map(|s| got.contains(s.name.as_str()))
            .collect();
        self.model.record_traffic(&flags);
        let peers = self.join.as_ref().map_or(0, |j| j.peers.len());
        self.model.request_rate = self.own_rate * (peers + 1) as f64;
    }

    /// Brings the model's services in line with the entries: bound and removed
    /// services, weights, health (DOWN leaves the model, UP again is new),
    /// disabled ones, and the peers' pseudo-service.
    fn sync(&mut self, entries: &[SvcEntry], now: u64) {
        let now_ns = now_ns();
        let mut present: HashSet<&str> = HashSet::new();
        for e in entries.iter().filter(|e| !e.peer) {
            let name = e.rt.name.as_str();
            present.insert(name);
            let up_since_ns = e.rt.up_since_ns();
            let (bound, back_up) = match self.seen.get(name) {
                Some(s) if Arc::ptr_eq(&s.rt, &e.rt) => (false, s.up_since_ns != up_since_ns),
                _ => (true, false),
            };
            self.seen.insert(
                name.to_string(),
                Seen {
                    rt: e.rt.clone(),
                    up_since_ns,
                },
            );
            let pos = self.model.services.iter().position(|s| s.name == name);
            match (e.usable(), pos) {
                (true, _) if bound => self.model.add_service(name, e.weight, now),
                (true, _) if back_up => {
                    // The ramp starts when the health check saw it UP.
                    let since = now.saturating_sub(now_ns.saturating_sub(up_since_ns) / 1_000_000);
                    tracing::info!(service = %name, since_ms = since, "service UP again: new for slow start");
                    self.model.add_service(name, e.weight, since);
                }
                (true, Some(i)) => self.model.services[i].weight = e.weight,
                (true, None) => self.model.services.push(ModelService {
                    name: name.to_string(),
                    weight: e.weight,
                    ramp: None,
                }),
                (false, Some(i)) => {
                    self.model.services.remove(i);
                }
                (false, None) => {}
            }
        }
        self.seen.retain(|n, _| present.contains(n.as_str()));
        self.model
            .services
            .retain(|s| s.name == PEERS || present.contains(s.name.as_str()));
        let peers = self.join.as_ref().map_or(0, |j| j.peers.len() as u32);
        let weight = (self.own_weight() * peers).max(1);
        match self.model.services.iter_mut().find(|s| s.name == PEERS) {
            Some(p) if peers > 0 => p.weight = weight,
            Some(_) => self.model.services.retain(|s| s.name != PEERS),
            None if peers > 0 => self.model.services.push(ModelService {
                name: PEERS.into(),
                weight,
                ramp: None,
            }),
            None => {}
        }
    }

    /// During a join ramp, before the vserver's first request: every own ramp
    /// starts now (see the module doc).
    fn hold_join_until_traffic(&mut self, now: u64) {
        if self.join.is_none() || self.handed > 0 {
            return;
        }
        for s in &mut self.model.services {
            if s.name != PEERS && s.ramp.is_some() {
                s.ramp = Some(Ramp::new(now));
            }
        }
    }

    fn end_join_if_over(&mut self, vserver: &str) {
        if self.join.is_some()
            && !self
                .model
                .services
                .iter()
                .any(|s| s.name != PEERS && s.ramp.is_some())
        {
            self.join = None;
            self.model.services.retain(|s| s.name != PEERS);
            tracing::info!(vserver = %vserver, "join ramp over: the node serves the vserver itself");
        }
    }

    /// The model's caps, unless the configuration sets one, become the entries'.
    /// With slow start on, a DOWN service is held at 0: when its health check
    /// brings it UP it is new, and it must not take requests before the next tick
    /// gives it its ramp's cap (a service that comes UP alone is served anyway: the
    /// data plane ignores caps rather than refusing).
    fn apply_caps(&self, entries: &[SvcEntry], now: u64) {
        let caps = self.model.caps(now);
        let on = self.model.slow_start.new_service_request > 0;
        for e in entries.iter().filter(|e| !e.peer) {
            let model = self
                .model
                .services
                .iter()
                .zip(&caps)
                .find(|(s, _)| s.name == e.rt.name)
                .and_then(|(_, c)| *c);
            let down = on && e.enabled && !e.rt.is_up();
            e.set_cap(e.explicit_cap.or(model).or(down.then_some(0.0)));
        }
    }
}
