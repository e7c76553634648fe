//! Choosing a vserver's service: weighted smooth round robin (precomputed
//! schedule + atomic cursor), the load-based methods (LEASTCONNECTION,
//! LEASTRESPONSETIME, LEASTBANDWIDTH, LEASTPACKETS, LRTM, CUSTOMLOAD), and
//! slow-start caps (lock-free GCRA token bucket). It sees services only through
//! [`Candidate`]: what each one measures is the service model's business.
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
//! * `CUSTOMLOAD`: a load value per service set from outside (`serve`/`standalone
//!   --custom-load-file`, or the configuration). A service without a value counts 0.
//!
//! # Slow-start caps and where the leftover goes
//!
//! A capped service takes a request only when its token bucket allows it; a cap of
//! 0 holds it at no new requests. Caps change while the vserver runs (the node's
//! own slow start sets them every tick), so they are atomics in the snapshot. In
//! round robin the main cursor offers each service its weighted share; a share
//! that a capped (or DOWN, or excluded) service cannot take goes to the
//! *uncapped* services through a second weighted cursor, so the leftover is split
//! by weight among the existing services, as core's `slowstart` model plans it.
//! Only when no uncapped service is available do capped services with tokens left
//! take it, and with no token anywhere the caps are ignored rather than refusing.
//!
//! # Ramp peers
//!
//! While a joining node ramps against the nodes that served the vserver before it
//! (see `slowstart`), those nodes are candidates too ([`Candidate::is_peer`]):
//! they stand for the existing services, so they take only what the node's own
//! services cannot (they are never offered a share of their own, and they are the
//! overflow's uncapped services, by weight, i.e. round robin among equal peers).
//! The load-based methods choose among the own services and use a peer only when
//! none of them may take the request.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use crate::clock::now_ns;

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

/// What balancing needs to know of one service of a vserver.
pub trait Candidate {
    fn weight(&self) -> u32;
    /// Enabled in the configuration (a disabled one is never chosen).
    fn enabled(&self) -> bool;
    /// Enabled and UP.
    fn usable(&self) -> bool;
    /// A ramp peer (another node standing for the existing services).
    fn is_peer(&self) -> bool;
    /// Whether a cap is in force.
    fn capped(&self) -> bool;
    /// Whether it may take one more request now (takes a token if capped).
    fn admits(&self) -> bool;
    /// Its load under `method` at `now` (ns), before dividing by the weight.
    fn load(&self, method: Method, now: u64) -> f64;
}

/// A slow-start cap's token bucket (GCRA): lock-free, one atomic per service.
#[derive(Default)]
pub struct TokenBucket {
    /// Theoretical arrival time, ns of `clock`.
    tat: AtomicU64,
}

impl TokenBucket {
    /// Takes one token if `cap_per_second` allows it. The tolerance is one
    /// interval, or 100 ms worth of requests when that is more, so that
    /// scheduling jitter does not cost the service part of its rate; a service
    /// kept busy receives exactly `cap_per_second` in the long run.
    pub fn try_acquire(&self, cap_per_second: f64) -> bool {
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

/// The balancing state of one configuration snapshot of a vserver: the order in
/// which it offers its candidates (given to every call, same slice as at
/// [`Balancer::new`]) and the cursors into it.
pub struct Balancer {
    method: Method,
    /// Smooth weighted round-robin order over enabled own services (indices).
    schedule: Vec<u32>,
    /// The same over enabled own services and ramp peers: the overflow's order.
    overflow_schedule: Vec<u32>,
    /// Offers each service its share.
    cursor: AtomicUsize,
    /// Hands out the shares that capped/DOWN services could not take.
    overflow: AtomicUsize,
}

impl Balancer {
    pub fn new<C: Candidate>(method: Method, services: &[C]) -> Self {
        Balancer {
            method,
            schedule: build_schedule(services, false),
            overflow_schedule: build_schedule(services, true),
            cursor: AtomicUsize::new(0),
            overflow: AtomicUsize::new(0),
        }
    }

    pub fn method(&self) -> Method {
        self.method
    }

    /// Chooses a service, never `exclude`, never a disabled or DOWN one. Honours
    /// caps where another service can take the load; falls back to ignoring caps
    /// rather than refusing.
    #[inline]
    pub fn pick<C: Candidate>(&self, services: &[C], exclude: Option<usize>) -> Option<usize> {
        match self.method {
            Method::RoundRobin => self.pick_rr(services, exclude),
            m => self.pick_least(services, m, exclude),
        }
    }

    fn pick_rr<C: Candidate>(&self, services: &[C], exclude: Option<usize>) -> Option<usize> {
        let n = self.schedule.len();
        if n == 0 {
            return self.overflow_pick(services, exclude);
        }
        let pos = self.cursor.fetch_add(1, Ordering::Relaxed);
        let idx = self.schedule[pos % n] as usize;
        let e = &services[idx];
        if Some(idx) != exclude && e.usable() && e.admits() {
            return Some(idx);
        }
        self.overflow_pick(services, exclude)
            .or_else(|| self.own_fallback(services, exclude.as_slice()))
    }

    /// The next uncapped own service or ramp peer, by weight.
    fn overflow_pick<C: Candidate>(&self, services: &[C], exclude: Option<usize>) -> Option<usize> {
        let n = self.overflow_schedule.len();
        for _ in 0..n {
            let p = self.overflow.fetch_add(1, Ordering::Relaxed);
            let j = self.overflow_schedule[p % n] as usize;
            let e = &services[j];
            if Some(j) != exclude && e.usable() && !e.capped() {
                return Some(j);
            }
        }
        None
    }

    /// An own service (never a ramp peer) outside `skip`: one with a token, else
    /// any (caps ignored). Where only capped services are left, and where the
    /// choices in `skip` could not be connected to.
    pub fn own_fallback<C: Candidate>(&self, services: &[C], skip: &[usize]) -> Option<usize> {
        let n = services.len();
        let rot = self.overflow.fetch_add(1, Ordering::Relaxed);
        let mut fallback = None;
        for k in 0..n {
            let j = (rot + k) % n;
            let e = &services[j];
            if skip.contains(&j) || !e.usable() || e.is_peer() {
                continue;
            }
            if e.admits() {
                return Some(j);
            }
            fallback.get_or_insert(j);
        }
        fallback
    }

    fn pick_least<C: Candidate>(
        &self,
        services: &[C],
        method: Method,
        exclude: Option<usize>,
    ) -> Option<usize> {
        let n = services.len();
        let slen = self.schedule.len();
        if n == 0 || slen == 0 {
            return self.overflow_pick(services, exclude);
        }
        // Ties go to the service the weighted schedule offers next.
        let start = self.schedule[self.cursor.fetch_add(1, Ordering::Relaxed) % slen] as usize;
        let now = if method.tracks_traffic() { now_ns() } else { 0 };
        let mut skipped: u128 = 0; // capped services without a token (first 128)
        let mut fallback = None;
        for _ in 0..n {
            let Some(idx) = least_loaded(services, method, now, start, exclude, skipped) else {
                break;
            };
            if idx >= 128 || services[idx].admits() {
                return Some(idx);
            }
            fallback.get_or_insert(idx);
            skipped |= 1 << idx;
        }
        self.overflow_pick(services, exclude).or(fallback)
    }
}

/// The own usable service with the lowest `load / weight`, scanning from `start`
/// (the first of equal scores wins), skipping `exclude` and the `skipped` bits.
#[inline]
fn least_loaded<C: Candidate>(
    services: &[C],
    method: Method,
    now: u64,
    start: usize,
    exclude: Option<usize>,
    skipped: u128,
) -> Option<usize> {
    let n = services.len();
    let mut best: Option<(usize, f64)> = None;
    for k in 0..n {
        let idx = (start + k) % n;
        let e = &services[idx];
        if Some(idx) == exclude
            || e.is_peer()
            || !e.usable()
            || (idx < 128 && skipped & (1 << idx) != 0)
        {
            continue;
        }
        let score = e.load(method, now) / e.weight().max(1) as f64;
        match best {
            Some((_, b)) if score >= b => {}
            _ => best = Some((idx, score)),
        }
    }
    best.map(|(idx, _)| idx)
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
fn build_schedule<C: Candidate>(services: &[C], with_peers: bool) -> Vec<u32> {
    const MAX_LEN: u64 = 4096;
    let mut ws: Vec<(usize, u64)> = services
        .iter()
        .enumerate()
        .filter(|(_, e)| e.enabled() && (with_peers || !e.is_peer()))
        .map(|(i, e)| (i, e.weight().max(1) as u64))
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
