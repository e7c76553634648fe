//! Active health checks of services: a TCP connect every `interval`; DOWN after
//! `fall` consecutive failures, UP again after `rise` consecutive successes.

use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use tokio::sync::Notify;

use crate::dial::Dialer;
use crate::service::ServiceRt;

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
    loop {
        tick.tick().await;
        let Some(r) = rt.upgrade() else { return };
        let start = Instant::now();
        let ok = matches!(
            tokio::time::timeout(probe_timeout, r.connect(&p.dialer)).await,
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
                p.up.notify_one();
            }
        } else {
            fails += 1;
            oks = 0;
            if r.is_up() && fails >= cfg.fall.max(1) && r.set_up(false) {
                tracing::warn!(vserver = %vserver, service = %r.name, failures = fails, "service DOWN");
                r.pool.clear();
            }
        }
    }
}
