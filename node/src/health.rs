//! Health checks of services, every `interval`; DOWN after `fall` consecutive
//! failures, UP again after `rise` consecutive successes. How a service is
//! checked follows its vserver ([`HealthCheck`]):
//!
//! - TCP and HTTP: a TCP connect.
//! - UDP with a request datagram: the datagram is sent from the node's address
//!   and any answer within the probe timeout is a success; none, or an ICMP port
//!   unreachable, a failure.
//! - UDP without one (passive): what the node relays to the service is watched.
//!   A datagram still unanswered after the probe timeout, or refused (ICMP port
//!   unreachable), is a failure; an answer since the last check a success; no
//!   traffic changes nothing. A DOWN service gets no traffic to judge it by: it
//!   comes back UP for a new trial after [`PASSIVE_RETRY_CHECKS`] checks.

use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use tokio::sync::Notify;

use crate::clock::now_ns;
use crate::dial::Dialer;
use crate::service::{HealthCheck, ServiceRt};

/// Passive UDP check: a DOWN service is tried again after this many checks
/// (10 s at the default interval).
pub const PASSIVE_RETRY_CHECKS: u32 = 10;

/// The health-check settings; `interval` zero turns them off (every service is
/// UP).
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

/// Starts the health checks of a node's services.
#[derive(Clone)]
pub struct Prober {
    cfg: HealthCfg,
    dialer: Dialer,
    /// Notified when a service comes UP: it is new for slow start at once.
    up: Arc<Notify>,
}

impl Prober {
    pub fn new(cfg: HealthCfg, dialer: Dialer, up: Arc<Notify>) -> Self {
        Prober { cfg, dialer, up }
    }

    /// Probes `rt` (of `vserver`) until it is dropped from every configuration;
    /// nothing when health checks are off.
    pub fn watch(&self, rt: &Arc<ServiceRt>, vserver: &str) {
        if !self.cfg.interval.is_zero() {
            tokio::spawn(probe_loop(
                Arc::downgrade(rt),
                self.clone(),
                vserver.to_string(),
            ));
        }
    }
}

async fn probe_loop(rt: Weak<ServiceRt>, p: Prober, vserver: String) {
    let cfg = p.cfg;
    let mut fails = 0u32;
    let mut oks = 0u32;
    let probe_timeout = cfg
        .interval
        .clamp(Duration::from_millis(100), Duration::from_secs(2));
    let mut tick = tokio::time::interval(cfg.interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut passive = Passive::default();
    loop {
        tick.tick().await;
        let Some(r) = rt.upgrade() else { return };
        let start = Instant::now();
        let ok = match r.health_check() {
            HealthCheck::Tcp => matches!(
                tokio::time::timeout(probe_timeout, r.connect(&p.dialer)).await,
                Ok(Ok(_))
            ),
            HealthCheck::UdpRequest(req) => udp_probe(&r, &p.dialer, &req, probe_timeout).await,
            HealthCheck::UdpPassive => match passive.check(&r, probe_timeout) {
                Some(ok) => ok,
                None => {
                    if !r.is_up() && passive.retry_due() && r.set_up(true) {
                        r.udp_reset();
                        fails = 0;
                        tracing::info!(vserver = %vserver, service = %r.name, "service UP again for a trial (passive UDP check)");
                        p.up.notify_one();
                    }
                    continue;
                }
            },
        };
        if ok {
            if !matches!(r.health_check(), HealthCheck::UdpPassive) {
                r.record_monitor_rtt(start.elapsed().as_micros() as u64);
            }
            oks += 1;
            fails = 0;
            if !r.is_up() && oks >= cfg.rise.max(1) && r.set_up(true) {
                tracing::info!(
                    vserver = %vserver,
                    service = %r.name,
                    up_since_ms = r.up_since_ns() / 1_000_000,
                    "service UP (new for slow start)"
                );
                p.up.notify_one();
            }
        } else {
            fails += 1;
            oks = 0;
            if r.is_up() && fails >= cfg.fall.max(1) && r.set_up(false) {
                tracing::warn!(vserver = %vserver, service = %r.name, failures = fails, "service DOWN");
                r.pool.clear();
                passive.down();
            }
        }
    }
}

/// UDP: sends `req` to the service from the node's address; any answer within
/// `timeout` is a success.
async fn udp_probe(r: &ServiceRt, dialer: &Dialer, req: &[u8], timeout: Duration) -> bool {
    let Some(target) = r.target() else {
        return false;
    };
    let probe = async {
        let s = dialer.udp_socket(target).await?;
        s.send(req).await?;
        let mut buf = [0u8; 1500];
        s.recv(&mut buf).await
    };
    matches!(tokio::time::timeout(timeout, probe).await, Ok(Ok(_)))
}

/// The passive UDP check's memory between checks.
#[derive(Default)]
struct Passive {
    replies: u64,
    /// Checks since the service went DOWN.
    down_checks: u32,
}

impl Passive {
    /// A failure (an unanswered datagram older than `timeout`, or a refusal),
    /// a success (an answer since the last check), or None (no traffic).
    fn check(&mut self, r: &ServiceRt, timeout: Duration) -> Option<bool> {
        let (replies, waiting_since, refused) = r.udp_observed();
        let answered = replies != self.replies;
        self.replies = replies;
        let overdue = waiting_since != 0
            && now_ns().saturating_sub(waiting_since) > timeout.as_nanos() as u64;
        if refused || overdue {
            Some(false)
        } else if answered {
            Some(true)
        } else {
            None
        }
    }

    fn down(&mut self) {
        self.down_checks = 0;
    }

    /// Counts a check while DOWN; true when the service is due for a trial.
    fn retry_due(&mut self) -> bool {
        self.down_checks += 1;
        self.down_checks >= PASSIVE_RETRY_CHECKS
    }
}
