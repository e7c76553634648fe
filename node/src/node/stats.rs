//! The node's statistics (`GetStats`) and the sampler that measures its rates
//! every second.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use lbscale_proto::{NodeStats, ServiceStats};

use super::{Node, Sample};
use crate::clock::now_ns;
use crate::metrics;
use crate::model::VsState;
use crate::service::{ServiceRt, SvcEntry};

/// A service's counters, as every statistics entry has them.
fn counters(vserver: &str, rt: &ServiceRt) -> ServiceStats {
    ServiceStats {
        vserver: vserver.to_string(),
        service: rt.name.clone(),
        requests_total: rt.requests_total.load(Ordering::Relaxed),
        requests_per_second: f64::from_bits(rt.rps_bits.load(Ordering::Relaxed)),
        active_connections: rt.active.load(Ordering::Relaxed),
        avg_response_ms: f64::from_bits(rt.avg_ms_bits.load(Ordering::Relaxed)),
        ..Default::default()
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

    /// Every second: CPU of this process, throughput, per-service rates.
    pub(super) async fn sampler(node: Weak<Node>) {
        let Some(traffic) = node.upgrade().map(|n| n.common.traffic.clone()) else {
            return;
        };
        let mut last_cpu = metrics::process_cpu_seconds().unwrap_or(0.0);
        let mut last_bytes = traffic.bytes();
        let mut last_t = Instant::now();
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tick.tick().await;
        loop {
            tick.tick().await;
            let Some(node) = node.upgrade() else { return };
            let dt = last_t.elapsed().as_secs_f64().max(1e-3);
            last_t = Instant::now();
            let cpu = metrics::process_cpu_seconds().unwrap_or(last_cpu);
            let bytes = traffic.bytes();
            let s = Sample {
                cpu_percent: ((cpu - last_cpu) / dt * 100.0).max(0.0),
                throughput_mbps: (bytes - last_bytes) as f64 * 8.0 / 1e6 / dt,
            };
            last_cpu = cpu;
            last_bytes = bytes;
            *node.sample.lock().unwrap_or_else(|e| e.into_inner()) = s;
            for st in node.states().await {
                for e in &st.services {
                    sample_rates(&e.rt, dt);
                }
            }
        }
    }

    pub async fn stats(&self) -> NodeStats {
        let sample = *self.sample.lock().unwrap_or_else(|e| e.into_inner());
        let memory_percent = match (metrics::process_rss_kb(), self.memory_limit_mb) {
            (Some(kb), lim) if lim > 0 => kb as f64 / (lim as f64 * 1024.0) * 100.0,
            _ => 0.0,
        };
        let mut forwarded = Vec::new();
        let mut served_connections_total = HashMap::new();
        let mut states = {
            let inner = self.inner.lock().await;
            for l in inner.listeners.values() {
                let name = l.vs.state().name.clone();
                forwarded.extend(l.vs.scaleout.forward_stats(&name));
                served_connections_total.insert(name, l.vs.scaleout.served());
            }
            inner
                .listeners
                .values()
                .map(|l| l.vs.state())
                .collect::<Vec<_>>()
        };
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
            config_version: self.version(),
            cpu_percent: sample.cpu_percent,
            memory_percent,
            throughput_mbps: sample.throughput_mbps,
            active_connections: traffic.active_connections(),
            total_connections: traffic.total_connections(),
            services,
            uptime_ms: self.started.elapsed().as_millis() as u64,
            forwarded,
            served_connections_total,
        }
    }
}

/// A service's request rate and average response time over the last `dt` s.
fn sample_rates(rt: &ServiceRt, dt: f64) {
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
