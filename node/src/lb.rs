//! Load-balancing state of one vserver: service runtimes, weighted smooth round
//! robin (precomputed schedule + atomic cursor), the load-based methods
//! (LEASTCONNECTION, LEASTRESPONSETIME, LEASTBANDWIDTH, LEASTPACKETS, LRTM,
//! CUSTOMLOAD), health state, and slow-start caps (lock-free GCRA token bucket).
//!
//! # Methods
//!
//! Every method honours weights. The load-based methods choose the service with the
//! lowest `load / weight`; ties (e.g. no load at all) are broken by the weighted
//! round-robin schedule, so that an idle vserver still spreads by weight.
//!
//! * `LEASTCONNECTION`: in-flight requests (HTTP) / open connections (TCP, UDP flows).
//! * `LEASTRESPONSETIME`: `(active + 1) × average response time` (exponentially
//!   weighted; HTTP: request to end of response; TCP: connect time).
//! * `LRTM`: `(active + 1) × monitor response time` (the health check's connect
//!   time, exponentially weighted), falling back to the request response time
//!   while there is no probe result.
//! * `LEASTBANDWIDTH`: bytes per second through the service, both directions,
//!   decaying with a time constant of 1 s.
//! * `LEASTPACKETS`: packets per second, same decay. Packets are estimated: one
//!   per socket read in TCP, `1 + bytes / 1460` per direction per HTTP request.
//! * `CUSTOMLOAD`: a load value per service set from outside ([`ServiceRt::set_custom_load`];
//!   `serve`/`standalone --custom-load-file`). A service without a value counts 0.
//!
//! # Slow-start caps and where the leftover goes
//!
//! A capped service takes a request only when its token bucket allows it; a cap of
//! 0 holds it at no new requests. Caps change while the vserver runs (the node's
//! own slow start, `crate::slowstart`, sets them every tick), so they are atomics in
//! the snapshot. In round robin the main cursor offers each service its weighted
//! share; a share that a capped (or DOWN, or excluded) service cannot take goes to
//! the *uncapped* services through a second weighted cursor, so the leftover is
//! split by weight among the existing services, as core's `slowstart` model plans
//! it. Only when no uncapped service is available do capped services with tokens
//! left take it, and with no token anywhere the caps are ignored rather than
//! refusing.
//!
//! # Ramp peers
//!
//! While a joining node ramps against the nodes that served the vserver before it
//! (`crate::slowstart`), those nodes are entries too ([`SvcEntry::peer`]): they
//! stand for the existing services, so they take only what the node's own services
//! cannot (they are never offered a share of their own, and they are the overflow's
//! uncapped services, by weight, i.e. round robin among equal peers). The
//! load-based methods choose among the own services and use a peer only when none
//! of them may take the request.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use hyper::header::HeaderValue;

use crate::metrics::now_ns;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Method {
    RoundRobin,
    LeastConnection,
    LeastResponseTime,
    LeastBandwidth,
    LeastPackets,
    Lrtm,
    CustomLoad,
}

impl Method {
    /// Whether the method needs the per-service bandwidth/packet estimators.
    pub fn tracks_traffic(self) -> bool {
        matches!(self, Method::LeastBandwidth | Method::LeastPackets)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Http,
    Tcp,
    Udp,
}

/// Time constant of the bandwidth/packet rate estimators, ns.
const DECAY_TAU_NS: f64 = 1e9;
/// Weight of a new sample in the response-time averages.
const EWMA_ALPHA: f64 = 0.2;

/// An exponentially decaying rate estimator (events or bytes per second).
#[derive(Default)]
struct Decay {
    /// (accumulated value, ns of the last update)
    v: Mutex<(f64, u64)>,
}

impl Decay {
    fn add(&self, x: f64, now: u64) {
        let mut g = self.v.lock().unwrap_or_else(|e| e.into_inner());
        let dt = now.saturating_sub(g.1) as f64;
        g.0 = g.0 * (-dt / DECAY_TAU_NS).exp() + x;
        g.1 = now;
    }
    /// Per second.
    fn rate(&self, now: u64) -> f64 {
        let g = self.v.lock().unwrap_or_else(|e| e.into_inner());
        let dt = now.saturating_sub(g.1) as f64;
        g.0 * (-dt / DECAY_TAU_NS).exp() / (DECAY_TAU_NS / 1e9)
    }
}

fn ewma_update(cell: &AtomicU64, sample: f64) {
    let old = f64::from_bits(cell.load(Ordering::Relaxed));
    let new = if old <= 0.0 {
        sample
    } else {
        old + EWMA_ALPHA * (sample - old)
    };
    cell.store(new.to_bits(), Ordering::Relaxed);
}

/// Runtime of one backend service: counters, health, idle upstream connections.
/// Survives a reconfiguration that keeps the service's name, address and port.
pub struct ServiceRt {
    pub name: String,
    pub name_hv: HeaderValue,
    pub host: String,
    pub port: u16,
    /// Pre-resolved address when `host` is an IP literal.
    pub addr: Option<std::net::SocketAddr>,
    /// In-flight requests (HTTP) or open connections (TCP) / flows (UDP).
    pub active: AtomicU64,
    pub requests_total: AtomicU64,
    pub resp_us_total: AtomicU64,
    pub resp_count: AtomicU64,
    /// GCRA theoretical arrival time (ns since process start).
    tat: AtomicU64,
    /// Idle keep-alive connections to this backend (HTTP).
    pub pool: Mutex<Vec<hyper::client::conn::http1::SendRequest<crate::http::UpBody>>>,
    // Sampler state.
    pub last_total: AtomicU64,
    pub last_resp_us: AtomicU64,
    pub last_resp_count: AtomicU64,
    pub rps_bits: AtomicU64,
    pub avg_ms_bits: AtomicU64,
    // Load-method inputs.
    /// EWMA of the response time, µs (f64 bits).
    rt_ewma_us: AtomicU64,
    /// EWMA of the health monitor's connect time, µs (f64 bits); 0 = no probe yet.
    mon_ewma_us: AtomicU64,
    /// Operator/monitor-set load (f64 bits).
    custom_load: AtomicU64,
    /// Whether to feed the bandwidth/packet estimators (set by the vserver's method).
    pub track_traffic: AtomicBool,
    bw: Decay,
    pkts: Decay,
    // Drain (disabled or removed while connections remain).
    draining: AtomicBool,
    drain_gen: AtomicU64,
    /// Cancelled when a drain times out: the service's connections close.
    kill: Mutex<tokio_util::sync::CancellationToken>,
    // Health.
    up: AtomicBool,
    /// When the service last came UP (ns since process start; creation time at first).
    up_since_ns: AtomicU64,
}

impl ServiceRt {
    pub fn new(name: &str, host: &str, port: u16) -> Self {
        let addr = host
            .parse::<std::net::IpAddr>()
            .ok()
            .map(|ip| std::net::SocketAddr::new(ip, port));
        ServiceRt {
            name: name.to_string(),
            name_hv: HeaderValue::from_str(name).unwrap_or(HeaderValue::from_static("invalid")),
            host: host.to_string(),
            port,
            addr,
            active: AtomicU64::new(0),
            requests_total: AtomicU64::new(0),
            resp_us_total: AtomicU64::new(0),
            resp_count: AtomicU64::new(0),
            tat: AtomicU64::new(0),
            pool: Mutex::new(Vec::new()),
            last_total: AtomicU64::new(0),
            last_resp_us: AtomicU64::new(0),
            last_resp_count: AtomicU64::new(0),
            rps_bits: AtomicU64::new(0),
            avg_ms_bits: AtomicU64::new(0),
            rt_ewma_us: AtomicU64::new(0),
            mon_ewma_us: AtomicU64::new(0),
            custom_load: AtomicU64::new(0),
            track_traffic: AtomicBool::new(false),
            bw: Decay::default(),
            pkts: Decay::default(),
            draining: AtomicBool::new(false),
            drain_gen: AtomicU64::new(0),
            kill: Mutex::new(tokio_util::sync::CancellationToken::new()),
            up: AtomicBool::new(true),
            up_since_ns: AtomicU64::new(now_ns()),
        }
    }

    /// Connects to the backend (TCP), resolving a host name if needed.
    pub async fn connect(&self) -> std::io::Result<tokio::net::TcpStream> {
        // From the node's own address: the source NAT of scale-out (see scaleout.rs).
        let s = match self.addr {
            Some(a) => crate::scaleout::connect_from_node(a).await?,
            None => crate::scaleout::connect_host_from_node(&self.host, self.port).await?,
        };
        let _ = s.set_nodelay(true);
        Ok(s)
    }

    /// Records one finished request (HTTP) or connection set-up (TCP).
    #[inline]
    pub fn record_response(&self, us: u64) {
        self.resp_us_total.fetch_add(us, Ordering::Relaxed);
        self.resp_count.fetch_add(1, Ordering::Relaxed);
        ewma_update(&self.rt_ewma_us, us as f64);
    }

    /// Feeds the bandwidth and packet estimators (only when the method uses them).
    #[inline]
    pub fn record_traffic(&self, bytes: u64, packets: u64) {
        if self.track_traffic.load(Ordering::Relaxed) && (bytes > 0 || packets > 0) {
            let now = now_ns();
            self.bw.add(bytes as f64, now);
            self.pkts.add(packets as f64, now);
        }
    }

    pub fn set_custom_load(&self, load: f64) {
        let l = if load.is_finite() && load > 0.0 {
            load
        } else {
            0.0
        };
        self.custom_load.store(l.to_bits(), Ordering::Relaxed);
    }

    /// Cancelled when this service's connections must close (its drain timed out).
    pub fn kill_token(&self) -> tokio_util::sync::CancellationToken {
        self.kill.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Relaxed)
    }

    /// Starts draining (idempotent): idle upstream connections close now; returns
    /// the drain generation to pass to [`ServiceRt::drain_timed_out`], or None if
    /// it was already draining.
    pub fn begin_drain(&self) -> Option<u64> {
        if self.draining.swap(true, Ordering::SeqCst) {
            return None;
        }
        if let Ok(mut pool) = self.pool.lock() {
            pool.clear();
        }
        Some(self.drain_gen.fetch_add(1, Ordering::SeqCst) + 1)
    }

    /// Ends a drain (the service is enabled again): pending timeouts lapse.
    pub fn end_drain(&self) {
        if self.draining.swap(false, Ordering::SeqCst) {
            self.drain_gen.fetch_add(1, Ordering::SeqCst);
            let mut k = self.kill.lock().unwrap_or_else(|e| e.into_inner());
            if k.is_cancelled() {
                *k = tokio_util::sync::CancellationToken::new();
            }
        }
    }

    /// The drain started as generation `gen` timed out: closes the remaining
    /// connections unless the service was enabled again meanwhile. Returns whether
    /// it closed them.
    pub fn drain_timed_out(&self, gen: u64) -> bool {
        if self.is_draining() && self.drain_gen.load(Ordering::SeqCst) == gen {
            self.kill_token().cancel();
            true
        } else {
            false
        }
    }

    pub fn is_up(&self) -> bool {
        self.up.load(Ordering::Relaxed)
    }

    /// Sets the health state; returns true when it changed. Coming UP records the
    /// time (the service is new again for slow start).
    pub fn set_up(&self, up: bool) -> bool {
        let was = self.up.swap(up, Ordering::SeqCst);
        if up && !was {
            self.up_since_ns.store(now_ns(), Ordering::Relaxed);
        }
        was != up
    }

    /// ns since process start when the service last came UP.
    pub fn up_since_ns(&self) -> u64 {
        self.up_since_ns.load(Ordering::Relaxed)
    }

    pub fn record_monitor_rtt(&self, us: u64) {
        ewma_update(&self.mon_ewma_us, us.max(1) as f64);
    }

    /// The service's load for `method` (before dividing by the weight).
    fn load(&self, method: Method, now: u64) -> f64 {
        let active = self.active.load(Ordering::Relaxed) as f64;
        match method {
            Method::RoundRobin | Method::LeastConnection => active,
            Method::LeastResponseTime => {
                (active + 1.0) * f64::from_bits(self.rt_ewma_us.load(Ordering::Relaxed))
            }
            Method::Lrtm => {
                let m = f64::from_bits(self.mon_ewma_us.load(Ordering::Relaxed));
                let m = if m > 0.0 {
                    m
                } else {
                    f64::from_bits(self.rt_ewma_us.load(Ordering::Relaxed))
                };
                (active + 1.0) * m
            }
            Method::LeastBandwidth => self.bw.rate(now),
            Method::LeastPackets => self.pkts.rate(now),
            Method::CustomLoad => f64::from_bits(self.custom_load.load(Ordering::Relaxed)),
        }
    }

    /// Slow-start cap: takes one token if the rate allows it (GCRA). The tolerance
    /// is one interval, or 100 ms worth of requests when that is more, so that
    /// scheduling jitter does not cost the service part of its rate; a service
    /// kept busy receives exactly `cap_per_second` in the long run.
    fn try_acquire(&self, cap_per_second: f64) -> bool {
        if cap_per_second.is_nan() || cap_per_second <= 0.0 {
            return false;
        }
        let interval = (1e9 / cap_per_second).max(1.0) as u64;
        let tau = interval.max(100_000_000);
        let now = now_ns();
        let mut tat = self.tat.load(Ordering::Relaxed);
        loop {
            if tat > now + tau {
                return false;
            }
            let new = tat.max(now) + interval;
            match self
                .tat
                .compare_exchange_weak(tat, new, Ordering::AcqRel, Ordering::Relaxed)
            {
                Ok(_) => return true,
                Err(t) => tat = t,
            }
        }
    }
}

/// `cap` value meaning "no cap".
const NO_CAP: u64 = u64::MAX;

pub struct SvcEntry {
    pub rt: Arc<ServiceRt>,
    pub weight: u32,
    pub enabled: bool,
    /// `cap_per_second` from the configuration: it overrides the node's slow start.
    pub explicit_cap: Option<f64>,
    /// CUSTOMLOAD value from the configuration; it overrides the load file's.
    pub custom_load: Option<f64>,
    /// A ramp peer: another node standing for the existing services (see the
    /// module doc); it takes only what the own services cannot.
    pub peer: bool,
    /// Cap in force, req/s (f64 bits, [`NO_CAP`] for none).
    cap: AtomicU64,
}

impl SvcEntry {
    pub fn new(rt: Arc<ServiceRt>, weight: u32, enabled: bool) -> Self {
        SvcEntry {
            rt,
            weight,
            enabled,
            explicit_cap: None,
            custom_load: None,
            peer: false,
            cap: AtomicU64::new(NO_CAP),
        }
    }

    #[inline]
    pub fn usable(&self) -> bool {
        self.enabled && self.rt.is_up()
    }

    /// The cap in force, req/s.
    #[inline]
    pub fn cap(&self) -> Option<f64> {
        match self.cap.load(Ordering::Relaxed) {
            NO_CAP => None,
            bits => Some(f64::from_bits(bits)),
        }
    }

    pub fn set_cap(&self, cap: Option<f64>) {
        let bits = match cap {
            Some(c) if c.is_finite() => c.max(0.0).to_bits(),
            _ => NO_CAP,
        };
        self.cap.store(bits, Ordering::Relaxed);
    }

    /// Whether the service may take one more request now (takes a token if capped).
    #[inline]
    fn admits(&self) -> bool {
        self.cap().is_none_or(|c| self.rt.try_acquire(c))
    }
}

/// Immutable configuration snapshot of a vserver (swapped on Configure).
pub struct VsState {
    pub name: String,
    pub kind: Kind,
    pub method: Method,
    pub services: Vec<SvcEntry>,
    /// Smooth weighted round-robin order over enabled own services (indices).
    schedule: Vec<u32>,
    /// The same over enabled own services and ramp peers: the overflow's order.
    overflow_schedule: Vec<u32>,
    /// Offers each service its share.
    cursor: AtomicUsize,
    /// Hands out the shares that capped/DOWN services could not take.
    overflow: AtomicUsize,
    pub persistence: crate::persist::Persistence,
    /// COOKIE: the cookie's name, and each own service's token and `Set-Cookie`
    /// value (None for ramp peers).
    pub cookie_name: String,
    cookies: Vec<Option<(String, HeaderValue)>>,
    /// The group's other nodes: their connections start with a PROXY v2 header
    /// (a primary forwarding a client), which is read and removed.
    pub proxy_from: std::sync::Arc<std::collections::HashSet<std::net::IpAddr>>,
}

impl VsState {
    pub fn new(name: String, kind: Kind, method: Method, services: Vec<SvcEntry>) -> Self {
        let schedule = build_schedule(&services, false);
        let overflow_schedule = build_schedule(&services, true);
        for e in &services {
            e.rt.track_traffic
                .store(method.tracks_traffic(), Ordering::Relaxed);
        }
        VsState {
            name,
            kind,
            method,
            services,
            schedule,
            overflow_schedule,
            cursor: AtomicUsize::new(0),
            overflow: AtomicUsize::new(0),
            persistence: crate::persist::Persistence::None,
            cookie_name: String::new(),
            cookies: Vec::new(),
            proxy_from: Default::default(),
        }
    }

    /// Sets the addresses whose connections carry a PROXY header.
    pub fn with_proxy_from(
        mut self,
        peers: std::sync::Arc<std::collections::HashSet<std::net::IpAddr>>,
    ) -> Self {
        self.proxy_from = peers;
        self
    }

    /// Sets the vserver's persistence (see `crate::persist`). COOKIE applies to
    /// HTTP vservers only; elsewhere it is NONE.
    pub fn with_persistence(mut self, p: crate::persist::Persistence) -> Self {
        use crate::persist::{cookie_name, cookie_token, Persistence};
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

    /// Chooses a service, never `exclude`, never a disabled or DOWN one. Honours
    /// caps where another service can take the load; falls back to ignoring caps
    /// rather than refusing. Increments the chosen service's `requests_total`.
    pub fn pick(&self, exclude: Option<usize>) -> Option<usize> {
        let idx = match self.method {
            Method::RoundRobin => self.pick_rr(exclude),
            m => self.pick_least(m, exclude),
        }?;
        self.services[idx]
            .rt
            .requests_total
            .fetch_add(1, Ordering::Relaxed);
        Some(idx)
    }

    fn pick_rr(&self, exclude: Option<usize>) -> Option<usize> {
        let n = self.schedule.len();
        if n == 0 {
            return self.overflow_pick(exclude);
        }
        let pos = self.cursor.fetch_add(1, Ordering::Relaxed);
        let idx = self.schedule[pos % n] as usize;
        let e = &self.services[idx];
        if Some(idx) != exclude && e.usable() && e.admits() {
            return Some(idx);
        }
        self.overflow_pick(exclude)
            .or_else(|| self.capped_fallback(exclude))
    }

    /// The next uncapped own service or ramp peer, by weight.
    fn overflow_pick(&self, exclude: Option<usize>) -> Option<usize> {
        let n = self.overflow_schedule.len();
        for _ in 0..n {
            let p = self.overflow.fetch_add(1, Ordering::Relaxed);
            let j = self.overflow_schedule[p % n] as usize;
            let e = &self.services[j];
            if Some(j) != exclude && e.usable() && e.cap().is_none() {
                return Some(j);
            }
        }
        None
    }

    /// Only capped services are left: one with a token, else any (caps ignored).
    fn capped_fallback(&self, exclude: Option<usize>) -> Option<usize> {
        let n = self.services.len();
        let rot = self.overflow.fetch_add(1, Ordering::Relaxed);
        let mut fallback = None;
        for k in 0..n {
            let j = (rot + k) % n;
            let e = &self.services[j];
            if Some(j) == exclude || !e.usable() || e.peer {
                continue;
            }
            if e.admits() {
                return Some(j);
            }
            fallback.get_or_insert(j);
        }
        fallback
    }

    fn pick_least(&self, method: Method, exclude: Option<usize>) -> Option<usize> {
        let n = self.services.len();
        let slen = self.schedule.len();
        if n == 0 || slen == 0 {
            return self.overflow_pick(exclude);
        }
        // Ties go to the service the weighted schedule offers next.
        let start = self.schedule[self.cursor.fetch_add(1, Ordering::Relaxed) % slen] as usize;
        let now = if method.tracks_traffic() { now_ns() } else { 0 };
        let mut skipped: u128 = 0; // capped services without a token (first 128)
        let mut fallback = None;
        for _ in 0..n {
            let mut best: Option<(usize, f64)> = None;
            for k in 0..n {
                let idx = (start + k) % n;
                let e = &self.services[idx];
                if Some(idx) == exclude
                    || e.peer
                    || !e.usable()
                    || (idx < 128 && skipped & (1 << idx) != 0)
                {
                    continue;
                }
                let score = e.rt.load(method, now) / e.weight.max(1) as f64;
                match best {
                    Some((_, b)) if score >= b => {}
                    _ => best = Some((idx, score)),
                }
            }
            let Some((idx, _)) = best else { break };
            let e = &self.services[idx];
            if idx >= 128 || e.admits() {
                return Some(idx);
            }
            fallback.get_or_insert(idx);
            skipped |= 1 << idx;
        }
        self.overflow_pick(exclude).or(fallback)
    }
}

fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// nginx-style smooth weighted round robin, unrolled into a schedule; ramp peers
/// only in the overflow's.
fn build_schedule(services: &[SvcEntry], with_peers: bool) -> Vec<u32> {
    const MAX_LEN: u64 = 4096;
    let mut ws: Vec<(usize, u64)> = services
        .iter()
        .enumerate()
        .filter(|(_, e)| e.enabled && (with_peers || !e.peer))
        .map(|(i, e)| (i, e.weight.max(1) as u64))
        .collect();
    if ws.is_empty() {
        return Vec::new();
    }
    let g = ws.iter().fold(0, |g, (_, w)| gcd(g, *w));
    for (_, w) in ws.iter_mut() {
        *w /= g.max(1);
    }
    let sum: u64 = ws.iter().map(|(_, w)| *w).sum();
    if sum > MAX_LEN {
        for (_, w) in ws.iter_mut() {
            *w = (*w * MAX_LEN / sum).max(1);
        }
    }
    let total: i64 = ws.iter().map(|(_, w)| *w as i64).sum();
    let mut current = vec![0i64; ws.len()];
    let mut out = Vec::with_capacity(total as usize);
    for _ in 0..total {
        let mut best = 0;
        for j in 0..ws.len() {
            current[j] += ws[j].1 as i64;
            if current[j] > current[best] {
                best = j;
            }
        }
        current[best] -= total;
        out.push(ws[best].0 as u32);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `cap` 0.0: no cap (these tests were written before caps of 0 existed).
    fn entry(name: &str, weight: u32, enabled: bool, cap: f64) -> SvcEntry {
        let e = SvcEntry::new(
            Arc::new(ServiceRt::new(name, "127.0.0.1", 1)),
            weight,
            enabled,
        );
        e.set_cap((cap > 0.0).then_some(cap));
        e
    }

    #[test]
    fn smooth_weighted_round_robin() {
        let vs = VsState::new(
            "v".into(),
            Kind::Http,
            Method::RoundRobin,
            vec![
                entry("a", 5, true, 0.0),
                entry("b", 1, true, 0.0),
                entry("c", 1, true, 0.0),
                entry("d", 9, false, 0.0),
            ],
        );
        let picks: Vec<usize> = (0..7).map(|_| vs.pick(None).unwrap()).collect();
        assert_eq!(picks, vec![0, 0, 1, 0, 2, 0, 0]);
        assert!(!picks.contains(&3));
    }

    #[test]
    fn round_robin_exclude_and_empty() {
        let vs = VsState::new(
            "v".into(),
            Kind::Tcp,
            Method::RoundRobin,
            vec![entry("a", 1, true, 0.0), entry("b", 1, true, 0.0)],
        );
        for _ in 0..5 {
            assert_eq!(vs.pick(Some(0)), Some(1));
        }
        let vs = VsState::new(
            "v".into(),
            Kind::Tcp,
            Method::RoundRobin,
            vec![entry("a", 1, false, 0.0)],
        );
        assert_eq!(vs.pick(None), None);
    }

    #[test]
    fn least_connection_relative_to_weight() {
        let vs = VsState::new(
            "v".into(),
            Kind::Http,
            Method::LeastConnection,
            vec![entry("a", 1, true, 0.0), entry("b", 3, true, 0.0)],
        );
        vs.services[0].rt.active.store(1, Ordering::Relaxed);
        vs.services[1].rt.active.store(2, Ordering::Relaxed);
        assert_eq!(vs.pick(None), Some(1)); // 2/3 < 1/1
        vs.services[1].rt.active.store(4, Ordering::Relaxed);
        assert_eq!(vs.pick(None), Some(0)); // 1/1 < 4/3
    }

    #[test]
    fn cap_diverts_to_other_services() {
        let vs = VsState::new(
            "v".into(),
            Kind::Http,
            Method::RoundRobin,
            vec![entry("new", 1, true, 1.0), entry("old", 1, true, 0.0)],
        );
        let mut new = 0;
        for _ in 0..100 {
            if vs.pick(None) == Some(0) {
                new += 1;
            }
        }
        assert!(new <= 2, "capped service got {new} of 100 immediate picks");
        // Only capped services left: fall back instead of refusing.
        let vs = VsState::new(
            "v".into(),
            Kind::Http,
            Method::RoundRobin,
            vec![entry("new", 1, true, 1.0)],
        );
        for _ in 0..10 {
            assert_eq!(vs.pick(None), Some(0));
        }
    }

    fn vs_of(method: Method, entries: Vec<SvcEntry>) -> VsState {
        VsState::new("v".into(), Kind::Http, method, entries)
    }

    #[test]
    fn round_robin_leftover_of_a_capped_service_is_split_by_weight() {
        // Capped at ~0 after its first token: its share goes to the uncapped ones.
        let vs = vs_of(
            Method::RoundRobin,
            vec![
                entry("s1", 1, true, 0.0),
                entry("s2", 1, true, 0.0),
                entry("new", 1, true, 0.001),
            ],
        );
        let mut n = [0u32; 3];
        for _ in 0..300 {
            n[vs.pick(None).unwrap()] += 1;
        }
        assert!(n[2] <= 2, "capped service got {}", n[2]);
        assert!(
            n[0].abs_diff(n[1]) <= 2,
            "leftover must be split evenly between s1 and s2: {n:?}"
        );
        // With weights 1:3 the leftover follows the weights too.
        let vs = vs_of(
            Method::RoundRobin,
            vec![
                entry("s1", 1, true, 0.0),
                entry("s2", 3, true, 0.0),
                entry("new", 4, true, 0.001),
            ],
        );
        let mut n = [0u32; 3];
        for _ in 0..800 {
            n[vs.pick(None).unwrap()] += 1;
        }
        assert!(
            n[1].abs_diff(3 * n[0]) <= 8,
            "weights 1:3 for the leftover: {n:?}"
        );
    }

    #[test]
    fn a_cap_of_zero_holds_the_service_and_peers_take_only_the_overflow() {
        for m in [Method::RoundRobin, Method::LeastConnection] {
            let mut entries = vec![
                entry("own1", 1, true, 0.0),
                entry("own2", 1, true, 0.0),
                entry("peer:a", 2, true, 0.0),
                entry("peer:b", 2, true, 0.0),
            ];
            entries[2].peer = true;
            entries[3].peer = true;
            let vs = vs_of(m, entries);
            // Uncapped own services take everything: peers get nothing.
            for _ in 0..40 {
                assert!(vs.pick(None).unwrap() < 2, "{m:?}: a peer got a request");
            }
            // Held at 0: the peers take it, round robin.
            vs.services[0].set_cap(Some(0.0));
            vs.services[1].set_cap(Some(0.0));
            let mut n = [0u32; 4];
            for _ in 0..40 {
                n[vs.pick(None).unwrap()] += 1;
            }
            assert_eq!(n, [0, 0, 20, 20], "{m:?}");
            // Peers gone (DOWN): the caps are ignored rather than refusing.
            vs.services[2].rt.set_up(false);
            vs.services[3].rt.set_up(false);
            assert!(vs.pick(None).unwrap() < 2, "{m:?}");
        }
    }

    #[test]
    fn down_services_get_nothing_and_up_again_is_recorded() {
        for m in [
            Method::RoundRobin,
            Method::LeastConnection,
            Method::CustomLoad,
        ] {
            let vs = vs_of(m, vec![entry("a", 1, true, 0.0), entry("b", 5, true, 0.0)]);
            let before = vs.services[1].rt.up_since_ns();
            assert!(vs.services[1].rt.set_up(false));
            for _ in 0..20 {
                assert_eq!(
                    vs.pick(None),
                    Some(0),
                    "{m:?}: a DOWN service got a request"
                );
            }
            assert_eq!(vs.pick(Some(0)), None, "{m:?}: only a DOWN service left");
            std::thread::sleep(std::time::Duration::from_millis(2));
            assert!(vs.services[1].rt.set_up(true));
            assert!(vs.services[1].rt.up_since_ns() > before);
            assert!(
                (0..20).any(|_| vs.pick(None) == Some(1)),
                "{m:?}: UP again gets traffic"
            );
        }
    }

    #[test]
    fn least_response_time_and_lrtm() {
        let vs = vs_of(
            Method::LeastResponseTime,
            vec![entry("slow", 1, true, 0.0), entry("fast", 1, true, 0.0)],
        );
        vs.services[0].rt.record_response(1000);
        vs.services[1].rt.record_response(100);
        for _ in 0..5 {
            assert_eq!(vs.pick(None), Some(1));
        }
        // 21 in flight × 100 µs > 1 × 1000 µs.
        vs.services[1].rt.active.store(20, Ordering::Relaxed);
        assert_eq!(vs.pick(None), Some(0));
        // Weight 3 on the slow one: 1000/3 < 2100.
        let vs = vs_of(
            Method::Lrtm,
            vec![entry("a", 1, true, 0.0), entry("b", 1, true, 0.0)],
        );
        vs.services[0].rt.record_response(100);
        vs.services[1].rt.record_response(1000);
        assert_eq!(
            vs.pick(None),
            Some(0),
            "no probe yet: request response time"
        );
        // The monitor says otherwise: LRTM follows the monitor.
        vs.services[0].rt.record_monitor_rtt(900);
        vs.services[1].rt.record_monitor_rtt(50);
        assert_eq!(vs.pick(None), Some(1));
    }

    #[test]
    fn least_bandwidth_and_packets() {
        let vs = vs_of(
            Method::LeastBandwidth,
            vec![entry("a", 1, true, 0.0), entry("b", 2, true, 0.0)],
        );
        vs.services[0].rt.record_traffic(1_000, 100);
        vs.services[1].rt.record_traffic(1_500, 1);
        assert_eq!(vs.pick(None), Some(1), "1500/2 < 1000/1");
        vs.services[1].rt.record_traffic(1_000, 1);
        assert_eq!(vs.pick(None), Some(0), "2500/2 > 1000/1");
        let vs = vs_of(
            Method::LeastPackets,
            vec![entry("a", 1, true, 0.0), entry("b", 1, true, 0.0)],
        );
        vs.services[0].rt.record_traffic(10, 100);
        vs.services[1].rt.record_traffic(1_000_000, 10);
        assert_eq!(vs.pick(None), Some(1));
        // Not tracked under another method.
        let rr = vs_of(Method::RoundRobin, vec![entry("c", 1, true, 0.0)]);
        rr.services[0].rt.record_traffic(1_000, 1);
        assert_eq!(
            rr.services[0].rt.load(Method::LeastBandwidth, now_ns()),
            0.0
        );
    }

    #[test]
    fn custom_load_with_weights_and_ties_follow_weights() {
        let vs = vs_of(
            Method::CustomLoad,
            vec![entry("a", 1, true, 0.0), entry("b", 2, true, 0.0)],
        );
        vs.services[0].rt.set_custom_load(10.0);
        vs.services[1].rt.set_custom_load(15.0);
        for _ in 0..5 {
            assert_eq!(vs.pick(None), Some(1), "15/2 < 10/1");
        }
        vs.services[1].rt.set_custom_load(30.0);
        assert_eq!(vs.pick(None), Some(0));
        // Equal (zero) loads: the weighted schedule decides, 1:2.
        vs.services[0].rt.set_custom_load(0.0);
        vs.services[1].rt.set_custom_load(0.0);
        let mut n = [0u32; 2];
        for _ in 0..300 {
            n[vs.pick(None).unwrap()] += 1;
        }
        assert_eq!(n, [100, 200]);
    }
}
