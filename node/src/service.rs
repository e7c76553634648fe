//! A backend service as the node runs it: its runtime ([`ServiceRt`]: counters,
//! load inputs, health, drain, idle connections), which survives a
//! reconfiguration that keeps the service's name, address and port, and its
//! entry in one configuration snapshot ([`SvcEntry`]: weight, enabled, cap).

use std::io;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use hyper::header::HeaderValue;
use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;

use crate::clock::now_ns;
use crate::dial::Dialer;
use crate::lb::{Candidate, Method, TokenBucket};
use crate::upstream::IdlePool;

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

/// How a service's health is checked (see `health`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HealthCheck {
    /// A TCP connect (TCP and HTTP vservers).
    Tcp,
    /// UDP, passive: what the node relays to the service must be answered.
    UdpPassive,
    /// UDP: this datagram, sent every interval, must be answered.
    UdpRequest(Arc<[u8]>),
}

/// Runtime of one backend service: counters, health, idle upstream connections.
/// Survives a reconfiguration that keeps the service's name, address and port.
pub struct ServiceRt {
    pub name: String,
    pub name_hv: HeaderValue,
    pub host: String,
    pub port: u16,
    /// Pre-resolved address when `host` is an IP literal.
    pub addr: Option<SocketAddr>,
    /// `host`'s address as resolved when the configuration was applied (a
    /// name; UDP flows use it, never resolving on their receive path).
    resolved: Mutex<Option<SocketAddr>>,
    /// How its health is checked; set by every configuration.
    check: Mutex<HealthCheck>,
    /// UDP, passive check: since when a datagram relayed to it waits for a
    /// reply (ns of `clock`; 0: none), the replies seen, and whether it
    /// refused one (ICMP port unreachable).
    udp_unanswered_since_ns: AtomicU64,
    udp_replies: AtomicU64,
    udp_refused: AtomicBool,
    /// In-flight requests (HTTP) or open connections (TCP) / flows (UDP).
    pub active: AtomicU64,
    pub requests_total: AtomicU64,
    pub resp_us_total: AtomicU64,
    pub resp_count: AtomicU64,
    /// The slow-start cap's bucket.
    bucket: TokenBucket,
    /// Idle keep-alive connections to this backend (HTTP).
    pub pool: IdlePool,
    // Sampler state.
    /// When the sampler last read this service (ns of `clock`; its creation at
    /// first): a service's rate is over its own time since, which is not the
    /// sampler's second when a configuration opened it earlier.
    pub last_sample_ns: AtomicU64,
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
    kill: Mutex<CancellationToken>,
    // Health.
    up: AtomicBool,
    /// When the service last came UP (ns of `clock`; creation time at first).
    up_since_ns: AtomicU64,
}

impl ServiceRt {
    pub fn new(name: &str, host: &str, port: u16) -> Self {
        let addr = host
            .parse::<IpAddr>()
            .ok()
            .map(|ip| SocketAddr::new(ip, port));
        ServiceRt {
            name: name.to_string(),
            name_hv: HeaderValue::from_str(name).unwrap_or(HeaderValue::from_static("invalid")),
            host: host.to_string(),
            port,
            addr,
            resolved: Mutex::new(None),
            check: Mutex::new(HealthCheck::Tcp),
            udp_unanswered_since_ns: AtomicU64::new(0),
            udp_replies: AtomicU64::new(0),
            udp_refused: AtomicBool::new(false),
            active: AtomicU64::new(0),
            requests_total: AtomicU64::new(0),
            resp_us_total: AtomicU64::new(0),
            resp_count: AtomicU64::new(0),
            bucket: TokenBucket::default(),
            pool: IdlePool::default(),
            last_sample_ns: AtomicU64::new(now_ns()),
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
            kill: Mutex::new(CancellationToken::new()),
            up: AtomicBool::new(true),
            up_since_ns: AtomicU64::new(now_ns()),
        }
    }

    /// Connects to the backend (TCP) from the node's address (see `dial`),
    /// resolving a host name if needed.
    pub async fn connect(&self, dialer: &Dialer) -> io::Result<TcpStream> {
        let s = match self.addr {
            Some(a) => dialer.connect(a).await?,
            None => dialer.connect_host(&self.host, self.port).await?,
        };
        let _ = s.set_nodelay(true);
        Ok(s)
    }

    /// The service's UDP address: its IP, or its name as resolved when the
    /// configuration was applied.
    pub fn target(&self) -> Option<SocketAddr> {
        self.addr
            .or_else(|| *self.resolved.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Whether `host` is a name (to resolve when a configuration is applied).
    pub fn is_named(&self) -> bool {
        self.addr.is_none()
    }

    pub fn set_resolved(&self, a: Option<SocketAddr>) {
        *self.resolved.lock().unwrap_or_else(|e| e.into_inner()) = a;
    }

    pub fn health_check(&self) -> HealthCheck {
        self.check.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    pub fn set_health_check(&self, c: HealthCheck) {
        *self.check.lock().unwrap_or_else(|e| e.into_inner()) = c;
    }

    /// UDP: a datagram was relayed to the service.
    #[inline]
    pub fn udp_sent(&self) {
        if self.udp_unanswered_since_ns.load(Ordering::Relaxed) == 0 {
            let _ = self.udp_unanswered_since_ns.compare_exchange(
                0,
                now_ns().max(1),
                Ordering::Relaxed,
                Ordering::Relaxed,
            );
        }
    }

    /// UDP: the service answered.
    #[inline]
    pub fn udp_replied(&self) {
        self.udp_replies.fetch_add(1, Ordering::Relaxed);
        if self.udp_unanswered_since_ns.load(Ordering::Relaxed) != 0 {
            self.udp_unanswered_since_ns.store(0, Ordering::Relaxed);
        }
    }

    /// UDP: the service's host said nothing listens there.
    pub fn udp_refused(&self) {
        self.udp_refused.store(true, Ordering::Relaxed);
    }

    /// UDP, passive check: (replies so far, since when a datagram waits for a
    /// reply (0: none), whether one was refused since the last call).
    pub fn udp_observed(&self) -> (u64, u64, bool) {
        (
            self.udp_replies.load(Ordering::Relaxed),
            self.udp_unanswered_since_ns.load(Ordering::Relaxed),
            self.udp_refused.swap(false, Ordering::Relaxed),
        )
    }

    /// UDP, passive check: forgets what waited for a reply (the service comes
    /// back UP for a new trial).
    pub fn udp_reset(&self) {
        self.udp_unanswered_since_ns.store(0, Ordering::Relaxed);
        self.udp_refused.store(false, Ordering::Relaxed);
    }

    /// [`ServiceRt::connect`] within `timeout` (an unanswered SYN would
    /// otherwise wait for the kernel's retries, minutes).
    pub async fn connect_within(
        &self,
        dialer: &Dialer,
        timeout: std::time::Duration,
    ) -> io::Result<TcpStream> {
        match tokio::time::timeout(timeout, self.connect(dialer)).await {
            Ok(r) => r,
            Err(_) => Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("connect timed out after {} ms", timeout.as_millis()),
            )),
        }
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
    pub fn kill_token(&self) -> CancellationToken {
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
        self.pool.clear();
        Some(self.drain_gen.fetch_add(1, Ordering::SeqCst) + 1)
    }

    /// Ends a drain (the service is enabled again): pending timeouts lapse.
    pub fn end_drain(&self) {
        if self.draining.swap(false, Ordering::SeqCst) {
            self.drain_gen.fetch_add(1, Ordering::SeqCst);
            let mut k = self.kill.lock().unwrap_or_else(|e| e.into_inner());
            if k.is_cancelled() {
                *k = CancellationToken::new();
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

    /// When the service last came UP (ns of `clock`).
    pub fn up_since_ns(&self) -> u64 {
        self.up_since_ns.load(Ordering::Relaxed)
    }

    pub fn record_monitor_rtt(&self, us: u64) {
        ewma_update(&self.mon_ewma_us, us.max(1) as f64);
    }

    /// The service's load for `method` (before dividing by the weight); the
    /// formulas are in `lb`'s module doc.
    pub fn load(&self, method: Method, now: u64) -> f64 {
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
}

/// `cap` value meaning "no cap".
const NO_CAP: u64 = u64::MAX;

/// A service in one configuration snapshot of a vserver.
pub struct SvcEntry {
    pub rt: Arc<ServiceRt>,
    pub weight: u32,
    pub enabled: bool,
    /// `cap_per_second` from the configuration: it overrides the node's slow start.
    pub explicit_cap: Option<f64>,
    /// CUSTOMLOAD value from the configuration; it overrides the load file's.
    pub custom_load: Option<f64>,
    /// A ramp peer: another node standing for the existing services (see `lb`);
    /// it takes only what the own services cannot.
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

    /// The same service in a new snapshot, without a cap in force yet.
    pub fn renewed(&self) -> Self {
        let mut c = SvcEntry::new(self.rt.clone(), self.weight, self.enabled);
        c.explicit_cap = self.explicit_cap;
        c.custom_load = self.custom_load;
        c
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
}

impl Candidate for SvcEntry {
    #[inline]
    fn weight(&self) -> u32 {
        self.weight
    }
    #[inline]
    fn enabled(&self) -> bool {
        self.enabled
    }
    #[inline]
    fn usable(&self) -> bool {
        SvcEntry::usable(self)
    }
    #[inline]
    fn is_peer(&self) -> bool {
        self.peer
    }
    #[inline]
    fn capped(&self) -> bool {
        self.cap().is_some()
    }
    #[inline]
    fn admits(&self) -> bool {
        self.cap().is_none_or(|c| self.rt.bucket.try_acquire(c))
    }
    #[inline]
    fn load(&self, method: Method, now: u64) -> f64 {
        self.rt.load(method, now)
    }
}
