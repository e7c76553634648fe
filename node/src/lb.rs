//! Load-balancing state of one vserver: service runtimes, weighted smooth round
//! robin (precomputed schedule + atomic cursor), least connection, slow-start caps
//! (lock-free GCRA token bucket).

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use hyper::header::HeaderValue;

use crate::metrics::now_ns;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Method {
    RoundRobin,
    LeastConnection,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Http,
    Tcp,
    Udp,
}

/// Runtime of one backend service: counters, idle upstream connections. Survives
/// a reconfiguration that keeps the service's name, address and port.
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
        }
    }

    /// Connects to the backend (TCP), resolving a host name if needed.
    pub async fn connect(&self) -> std::io::Result<tokio::net::TcpStream> {
        let s = match self.addr {
            Some(a) => tokio::net::TcpStream::connect(a).await?,
            None => tokio::net::TcpStream::connect((self.host.as_str(), self.port)).await?,
        };
        let _ = s.set_nodelay(true);
        Ok(s)
    }

    /// Slow-start cap: takes one token if the rate allows it (GCRA, tolerance of
    /// one interval so that jittery arrivals still get the full rate).
    fn try_acquire(&self, cap_per_second: f64) -> bool {
        if cap_per_second <= 0.0 {
            return true;
        }
        let interval = (1e9 / cap_per_second).max(1.0) as u64;
        let tau = interval;
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

pub struct SvcEntry {
    pub rt: Arc<ServiceRt>,
    pub weight: u32,
    pub enabled: bool,
    pub cap: f64,
}

/// Immutable configuration snapshot of a vserver (swapped on Configure).
pub struct VsState {
    pub name: String,
    pub kind: Kind,
    pub method: Method,
    pub services: Vec<SvcEntry>,
    /// Smooth weighted round-robin order over enabled services (indices).
    schedule: Vec<u32>,
    cursor: AtomicUsize,
}

impl VsState {
    pub fn new(name: String, kind: Kind, method: Method, services: Vec<SvcEntry>) -> Self {
        let schedule = build_schedule(&services);
        VsState {
            name,
            kind,
            method,
            services,
            schedule,
            cursor: AtomicUsize::new(0),
        }
    }

    /// Chooses a service, never `exclude`. Honours caps where another service can
    /// take the load; falls back to ignoring caps rather than refusing.
    /// Increments the chosen service's `requests_total`.
    pub fn pick(&self, exclude: Option<usize>) -> Option<usize> {
        let idx = match self.method {
            Method::RoundRobin => self.pick_rr(exclude),
            Method::LeastConnection => self.pick_lc(exclude),
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
            return None;
        }
        let mut fallback = None;
        for _ in 0..n {
            let pos = self.cursor.fetch_add(1, Ordering::Relaxed);
            let idx = self.schedule[pos % n] as usize;
            if Some(idx) == exclude {
                continue;
            }
            let e = &self.services[idx];
            if e.rt.try_acquire(e.cap) {
                return Some(idx);
            }
            if fallback.is_none() {
                fallback = Some(idx);
            }
        }
        fallback
    }

    fn pick_lc(&self, exclude: Option<usize>) -> Option<usize> {
        let n = self.services.len();
        if n == 0 {
            return None;
        }
        let rot = self.cursor.fetch_add(1, Ordering::Relaxed);
        let mut skipped: u128 = 0; // capped services (first 128)
        let mut fallback = None;
        for _ in 0..n {
            let mut best: Option<(usize, u64, u64)> = None; // (idx, active, weight)
            for k in 0..n {
                let idx = (rot + k) % n;
                let e = &self.services[idx];
                if !e.enabled || Some(idx) == exclude || (idx < 128 && skipped & (1 << idx) != 0) {
                    continue;
                }
                let a = e.rt.active.load(Ordering::Relaxed);
                let w = e.weight.max(1) as u64;
                match best {
                    // a/w < ba/bw  <=>  a*bw < ba*w
                    Some((_, ba, bw)) if a * bw >= ba * w => {}
                    _ => best = Some((idx, a, w)),
                }
            }
            let (idx, _, _) = best?;
            let e = &self.services[idx];
            if e.cap <= 0.0 || idx >= 128 || e.rt.try_acquire(e.cap) {
                return Some(idx);
            }
            if fallback.is_none() {
                fallback = Some(idx);
            }
            skipped |= 1 << idx;
        }
        fallback
    }
}

fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// nginx-style smooth weighted round robin, unrolled into a schedule.
fn build_schedule(services: &[SvcEntry]) -> Vec<u32> {
    const MAX_LEN: u64 = 4096;
    let mut ws: Vec<(usize, u64)> = services
        .iter()
        .enumerate()
        .filter(|(_, e)| e.enabled)
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

    fn entry(name: &str, weight: u32, enabled: bool, cap: f64) -> SvcEntry {
        SvcEntry {
            rt: Arc::new(ServiceRt::new(name, "127.0.0.1", 1)),
            weight,
            enabled,
            cap,
        }
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
}
