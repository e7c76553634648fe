//! The node's statistics (`GetStats`) and the sampler that keeps a snapshot of
//! its counters and measures its services' rates every second.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::Duration;

use lbscale_proto::{NodeStats, ServiceStats};

use super::Node;
use crate::clock::now_ns;
use crate::model::VsState;
use crate::service::{ServiceRt, SvcEntry};
use crate::window::Snapshot;

/// A service's counters, as every statistics entry has them.
fn counters(vserver: &str, rt: &ServiceRt) -> ServiceStats {
    ServiceStats {
        vserver: vserver.to_string(),
        service: rt.name.clone(),
        requests_total: rt.requests_total.load(Ordering::Relaxed),
        requests_per_second: f64::from_bits(rt.rps_bits.load(Ordering::Relaxed)),
        active_connections: rt.active.load(Ordering::Relaxed),
        avg_response_ms: avg_response_ms(rt),
        ..Default::default()
    }
}

/// The last second's average response time, or the lifetime one before the
/// sampler has measured a second with responses (the means of `stats` are
/// taken when asked, its per-service rates once a second).
fn avg_response_ms(rt: &ServiceRt) -> f64 {
    let avg = f64::from_bits(rt.avg_ms_bits.load(Ordering::Relaxed));
    let count = rt.resp_count.load(Ordering::Relaxed);
    if avg == 0.0 && count > 0 {
        rt.resp_us_total.load(Ordering::Relaxed) as f64 / count as f64 / 1000.0
    } else {
        avg
    }
}

/// A configured service's entry: counters, health, slow start.
fn service_stats(vserver: &str, e: &SvcEntry, uptime_ms: u64) -> ServiceStats {
    let rt = &e.rt;
    let cap = e.cap();
    // up_since is when it was bound or last came UP: when it last became new.
    let new_since_ms =
        uptime_ms.saturating_sub(now_ns().saturating_sub(rt.up_since_ns()) / 1_000_000);
    ServiceStats {
        health: if !e.enabled {
            "DISABLED"
        } else if rt.is_up() {
            "UP"
        } else {
            "DOWN"
        }
        .to_string(),
        // An explicit cap from the configuration is an operator's limit, not a
        // ramp.
        in_slow_start: cap.is_some() && e.explicit_cap.is_none() && !e.peer && e.usable(),
        cap_per_second: cap.unwrap_or(0.0),
        new_since_ms,
        ..counters(vserver, rt)
    }
}

impl Node {
    /// Removed services that still drain connections (and are not configured
    /// again under the same vserver).
    fn removed_still_draining(&self, states: &[Arc<VsState>]) -> Vec<(String, Arc<ServiceRt>)> {
        let mut r = self.removed.lock().unwrap_or_else(|e| e.into_inner());
        r.retain(|(vs, rt)| {
            rt.active.load(Ordering::Relaxed) > 0
                && !states
                    .iter()
                    .any(|s| s.name == *vs && s.services.iter().any(|e| Arc::ptr_eq(&e.rt, rt)))
        });
        r.clone()
    }

    /// Every second: a snapshot of CPU, memory and bytes for the means of
    /// `stats`, and the services' request rates.
    pub(super) async fn sampler(node: Weak<Node>) {
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            // The first tick is now: a young node's window starts at its start.
            tick.tick().await;
            let Some(node) = node.upgrade() else { return };
            let now = node.snapshot();
            node.window
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .keep(now);
            let states: Vec<Arc<VsState>> = node
                .published()
                .vservers
                .iter()
                .map(|vs| vs.state())
                .collect();
            // After the states: a service made before it was read is no younger.
            let t_ns = now_ns();
            for e in states.iter().flat_map(|st| &st.services) {
                sample_rates(&e.rt, t_ns);
            }
            // A removed service's last rate would otherwise stay while it drains.
            for (_, rt) in node.removed_still_draining(&states) {
                sample_rates(&rt, t_ns);
            }
        }
    }

    /// The counters now, continuing the kept snapshots.
    fn snapshot(&self) -> Snapshot {
        let t_ns = now_ns();
        let uptime_s = self.started.elapsed().as_secs_f64();
        let reading = self.kernel.reading(self.stats_source, uptime_s);
        let bytes = self.common.traffic.bytes();
        let window = self.window.lock().unwrap_or_else(|e| e.into_inner());
        window.snapshot(t_ns, reading, bytes)
    }

    /// The statistics, CPU, memory and throughput as their means over the
    /// last `window` (zero: the last second; see `crate::window`).
    pub async fn stats(&self, window: Duration) -> NodeStats {
        let now = self.snapshot();
        let means = self
            .window
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .means(&now, window.as_nanos().min(u64::MAX as u128) as u64);
        let published = self.published();
        let mut forwarded = Vec::new();
        let mut served_connections_total = HashMap::new();
        let mut states = Vec::with_capacity(published.vservers.len());
        for vs in &published.vservers {
            let st = vs.state();
            forwarded.extend(vs.scaleout.forward_stats(&st.name));
            served_connections_total.insert(st.name.clone(), vs.scaleout.served());
            states.push(st);
        }
        states.sort_by(|a, b| a.name.cmp(&b.name));
        let mut services: Vec<ServiceStats> = self
            .removed_still_draining(&states)
            .iter()
            .map(|(vs, rt)| counters(vs, rt))
            .collect();
        let uptime_ms = self.uptime_ms();
        for st in &states {
            services.extend(
                st.services
                    .iter()
                    .map(|e| service_stats(&st.name, e, uptime_ms)),
            );
        }
        let traffic = &self.common.traffic;
        NodeStats {
            node_id: self.id.clone(),
            state: self.state_name().to_string(),
            config_version: published.version,
            cpu_percent: means.cpu_percent,
            memory_percent: means.memory_percent,
            throughput_mbps: means.throughput_mbps,
            window_ms: means.window_ms,
            stats_source: self.stats_source.name().to_string(),
            active_connections: traffic.active_connections(),
            total_connections: traffic.total_connections(),
            services,
            uptime_ms: self.started.elapsed().as_millis() as u64,
            forwarded,
            served_connections_total,
        }
    }
}

/// A service's request rate and average response time since its last sample
/// (or its creation), as of `t_ns`.
fn sample_rates(rt: &ServiceRt, t_ns: u64) {
    let since_ns = rt.last_sample_ns.swap(t_ns, Ordering::Relaxed);
    let dt = (t_ns.saturating_sub(since_ns) as f64 / 1e9).max(1e-3);
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A service a configuration opened 2 s before its first sample (one that
    /// took that long) has its requests spread over those 2 s, not the
    /// sampler's last second.
    #[test]
    fn a_rate_is_over_the_services_own_time_since_its_last_sample() {
        let rt = ServiceRt::new("a", "127.0.0.1", 9);
        let t = rt.last_sample_ns.load(Ordering::Relaxed) + 2_000_000_000;
        rt.requests_total.store(200, Ordering::Relaxed);
        sample_rates(&rt, t);
        assert_eq!(f64::from_bits(rt.rps_bits.load(Ordering::Relaxed)), 100.0);
        rt.requests_total.store(250, Ordering::Relaxed);
        sample_rates(&rt, t + 500_000_000);
        assert_eq!(f64::from_bits(rt.rps_bits.load(Ordering::Relaxed)), 100.0);
    }
}
