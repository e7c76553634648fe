//! `lbscale-node nlb`: the local cloud's L4 forwarder (network load balancer).
//!
//! Its JSON configuration (written by the local cloud, re-read when it changes):
//!
//! ```json
//! {"version": 7, "listeners": [
//!   {"vip": "127.0.9.1", "port": 80, "targets": ["127.0.1.2:80", "127.0.1.3:80"],
//!    "balance": "flow_hash", "weights": {"127.0.1.3:80": 0.5}}
//! ]}
//! ```
//!
//! Per listener:
//! - `balance` (optional): `"round_robin"` (the default) deals new connections to
//!   the targets in turn; `"flow_hash"` is the ECMP stand-in of BGP scale-out: the
//!   target follows from a hash of the client's flow (source IP and port), the same
//!   for every connection of that flow and spread evenly over the targets, with no
//!   node forwarding to another (no primary in the path); `"first"` sends every
//!   connection to the first target that accepts it, in the order written (native
//!   scale-out: the vserver's primary, then the other holders should it be down).
//!   Unknown values: round robin, with a warning.
//! - `weights` (optional): target (as written in `targets`) → weight from 0 to 1
//!   (default 1; values outside are clamped, with a warning). Round robin becomes
//!   smooth weighted round robin; `flow_hash` becomes weighted rendezvous hashing
//!   (each flow goes to the target with the highest `-w / ln(h)`, `h` the flow and
//!   target's hash in (0, 1)), so a target's share of flows is its weight over the
//!   total and changing one weight moves only the flows that must move. A target
//!   of weight 0 gets no connection.
//!
//! A target that refuses a connection (or takes over 3 s) is skipped: the next
//! one in the listener's order of preference (round robin: the following targets;
//! `flow_hash`: the next highest scores) gets the connection.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use serde::Deserialize;
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

use crate::watch::{self, Applied};

#[derive(Deserialize)]
pub struct NlbConfig {
    #[serde(default)]
    pub version: u64,
    #[serde(default)]
    pub listeners: Vec<ListenerConfig>,
}

#[derive(Deserialize)]
pub struct ListenerConfig {
    pub vip: String,
    pub port: u16,
    #[serde(default)]
    pub targets: Vec<String>,
    #[serde(default)]
    pub balance: Option<String>,
    #[serde(default)]
    pub weights: HashMap<String, f64>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Balance {
    RoundRobin,
    FlowHash,
    First,
}

/// A listener's targets as configured: address, weight.
struct Pool {
    balance: Balance,
    targets: Vec<(SocketAddr, f64)>,
    /// Every weight is 1: plain round robin, as before weights existed.
    unweighted: bool,
}

struct Targets {
    list: RwLock<Arc<Pool>>,
    rr: AtomicUsize,
    /// Smooth weighted round robin scores, one per target of `list`.
    scores: Mutex<Vec<f64>>,
}

impl Targets {
    fn set(&self, pool: Pool) {
        let mut list = self.list.write().unwrap_or_else(|e| e.into_inner());
        let mut scores = self.scores.lock().unwrap_or_else(|e| e.into_inner());
        *scores = vec![0.0; pool.targets.len()];
        *list = Arc::new(pool);
    }

    /// The targets to try for a connection from `client`, best first; targets of
    /// weight 0 are left out.
    fn order(&self, client: SocketAddr) -> Vec<SocketAddr> {
        let pool = self.list.read().unwrap_or_else(|e| e.into_inner()).clone();
        let n = pool.targets.len();
        let live = |i: &usize| pool.targets[*i].1 > 0.0;
        match pool.balance {
            Balance::FlowHash => flow_order(client, &pool.targets),
            Balance::First => (0..n).filter(live).map(|i| pool.targets[i].0).collect(),
            Balance::RoundRobin if pool.unweighted => {
                let start = self.rr.fetch_add(1, Ordering::Relaxed);
                (0..n).map(|i| pool.targets[(start + i) % n].0).collect()
            }
            Balance::RoundRobin => {
                let first = {
                    let mut scores = self.scores.lock().unwrap_or_else(|e| e.into_inner());
                    smooth_pick(&mut scores, &pool.targets)
                };
                let Some(first) = first else {
                    return Vec::new();
                };
                (0..n)
                    .map(|i| (first + i) % n)
                    .filter(live)
                    .map(|i| pool.targets[i].0)
                    .collect()
            }
        }
    }
}

/// Smooth weighted round robin: each pick adds every weight to its score, takes
/// the highest and lowers it by the total. `None` when every weight is 0.
fn smooth_pick(scores: &mut [f64], targets: &[(SocketAddr, f64)]) -> Option<usize> {
    let total: f64 = targets.iter().map(|t| t.1).sum();
    if total <= 0.0 || scores.len() != targets.len() {
        return None;
    }
    let mut best = 0;
    for (i, t) in targets.iter().enumerate() {
        scores[i] += t.1;
        if scores[i] > scores[best] {
            best = i;
        }
    }
    scores[best] -= total;
    Some(best)
}

/// A 64-bit hash of `bytes` that does not depend on the Rust version or a random
/// seed (FNV-1a, then the SplitMix64 finaliser to spread FNV's weak low bits): a
/// flow keeps its target across restarts of the distributor.
fn stable_hash(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h ^= h >> 30;
    h = h.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    h ^= h >> 27;
    h = h.wrapping_mul(0x94d0_49bb_1331_11eb);
    h ^ (h >> 31)
}

fn addr_bytes(a: SocketAddr, out: &mut Vec<u8>) {
    match a.ip() {
        std::net::IpAddr::V4(ip) => out.extend_from_slice(&ip.octets()),
        std::net::IpAddr::V6(ip) => out.extend_from_slice(&ip.octets()),
    }
    out.extend_from_slice(&a.port().to_be_bytes());
}

/// Rendezvous score of `target` for `flow`: `-w / ln(h)` with `h` in (0, 1).
/// Unweighted this is a plain highest-random-weight choice; weighted, each target
/// wins a fraction of flows equal to its weight over the total.
fn flow_score(flow: SocketAddr, target: SocketAddr, weight: f64) -> f64 {
    if weight <= 0.0 {
        return 0.0;
    }
    let mut b = Vec::with_capacity(36);
    addr_bytes(flow, &mut b);
    addr_bytes(target, &mut b);
    // 53 bits, shifted off zero: h in (0, 1), so ln(h) < 0.
    let h = ((stable_hash(&b) >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
    -weight / h.ln()
}

/// The targets of weight > 0 by decreasing rendezvous score for `flow`.
fn flow_order(flow: SocketAddr, targets: &[(SocketAddr, f64)]) -> Vec<SocketAddr> {
    let mut scored: Vec<(f64, SocketAddr)> = targets
        .iter()
        .filter(|t| t.1 > 0.0)
        .map(|t| (flow_score(flow, t.0, t.1), t.0))
        .collect();
    scored.sort_by(|a, b| b.0.total_cmp(&a.0));
    scored.into_iter().map(|s| s.1).collect()
}

struct Listener {
    targets: Arc<Targets>,
    task: JoinHandle<()>,
}

impl Drop for Listener {
    fn drop(&mut self) {
        self.task.abort();
    }
}

const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);

async fn accept_loop(l: TcpListener, targets: Arc<Targets>) {
    let mut backoff = crate::bounds::Backoff::default();
    loop {
        match l.accept().await {
            Ok((client, peer)) => {
                backoff.reset();
                let t = targets.clone();
                tokio::spawn(async move {
                    let order = t.order(peer);
                    if order.is_empty() {
                        return; // no target: close the client connection
                    }
                    for target in order {
                        match tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(target))
                            .await
                        {
                            Ok(Ok(backend)) => {
                                let _ = client.set_nodelay(true);
                                let _ = backend.set_nodelay(true);
                                let (mut c, mut b) = (client, backend);
                                let _ = tokio::io::copy_bidirectional(&mut c, &mut b).await;
                                return;
                            }
                            Ok(Err(e)) => tracing::debug!(%target, error = %e, "target refused"),
                            Err(_) => tracing::debug!(%target, "target connect timed out"),
                        }
                    }
                    tracing::warn!("no target reachable; closing client connection");
                });
            }
            Err(e) => tokio::time::sleep(backoff.failed("nlb", &e)).await,
        }
    }
}

/// Reads one listener's targets, balance and weights, skipping what is invalid.
fn pool_of(l: &ListenerConfig) -> Pool {
    let balance = match l.balance.as_deref() {
        None | Some("round_robin") => Balance::RoundRobin,
        Some("flow_hash") => Balance::FlowHash,
        Some("first") => Balance::First,
        Some(other) => {
            tracing::warn!(vip = %l.vip, port = l.port, balance = other, "unknown balance (want round_robin, flow_hash or first); round robin");
            Balance::RoundRobin
        }
    };
    for t in l.weights.keys() {
        if !l.targets.contains(t) {
            tracing::warn!(vip = %l.vip, port = l.port, target = %t, "weight for a target that is not listed; ignored");
        }
    }
    let mut targets = Vec::new();
    for t in &l.targets {
        let Ok(a) = t.parse::<SocketAddr>() else {
            tracing::warn!(target = %t, "invalid target (want IP:PORT); skipped");
            continue;
        };
        let w = l.weights.get(t).copied().unwrap_or(1.0);
        let clamped = if w.is_nan() { 1.0 } else { w.clamp(0.0, 1.0) };
        if clamped != w {
            tracing::warn!(target = %t, weight = w, used = clamped, "weight must be from 0 to 1");
        }
        targets.push((a, clamped));
    }
    let unweighted = targets.iter().all(|t| t.1 == 1.0);
    Pool {
        balance,
        targets,
        unweighted,
    }
}

fn bind(addr: SocketAddr) -> std::io::Result<TcpListener> {
    let l = std::net::TcpListener::bind(addr)?;
    l.set_nonblocking(true)?;
    TcpListener::from_std(l)
}

pub async fn run(config: PathBuf, status: PathBuf) -> ! {
    let mut listeners: HashMap<SocketAddr, Listener> = HashMap::new();
    watch::run(config, status, move |cfg: NlbConfig| {
        let mut complete = true;
        let mut wanted: HashMap<SocketAddr, Pool> = HashMap::new();
        for l in &cfg.listeners {
            let Ok(ip) = l.vip.parse::<std::net::IpAddr>() else {
                tracing::warn!(vip = %l.vip, "invalid vip; listener skipped");
                continue;
            };
            wanted.insert(SocketAddr::new(ip, l.port), pool_of(l));
        }
        listeners.retain(|addr, _| {
            let keep = wanted.contains_key(addr);
            if !keep {
                tracing::info!(%addr, "listener closed");
            }
            keep
        });
        for (addr, targets) in wanted {
            if let Some(l) = listeners.get(&addr) {
                l.targets.set(targets);
                continue;
            }
            match bind(addr) {
                Ok(tl) => {
                    tracing::info!(%addr, targets = targets.targets.len(), balance = ?targets.balance, "listener open");
                    let t = Arc::new(Targets {
                        list: RwLock::new(Arc::new(Pool {
                            balance: Balance::RoundRobin,
                            targets: Vec::new(),
                            unweighted: true,
                        })),
                        rr: AtomicUsize::new(0),
                        scores: Mutex::new(Vec::new()),
                    });
                    t.set(targets);
                    let task = tokio::spawn(accept_loop(tl, t.clone()));
                    listeners.insert(addr, Listener { targets: t, task });
                }
                Err(e) => {
                    tracing::warn!(%addr, error = %e, "cannot listen; will retry");
                    complete = false;
                }
            }
        }
        Applied {
            version: cfg.version,
            complete,
        }
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn targets(n: u8) -> Vec<(SocketAddr, f64)> {
        (0..n)
            .map(|i| (SocketAddr::from(([127, 0, 1, 10 + i], 8080)), 1.0))
            .collect()
    }

    fn flow(i: u32) -> SocketAddr {
        SocketAddr::from((
            [10, 0, (i >> 16) as u8, (i >> 8) as u8],
            1024 + (i & 0xff) as u16 * 7,
        ))
    }

    #[test]
    fn a_flow_keeps_its_target() {
        let t = targets(3);
        for i in 0..1000 {
            assert_eq!(flow_order(flow(i), &t), flow_order(flow(i), &t));
        }
        // Fixed values: the hash must not change between builds or Rust versions.
        // (Reference values computed independently, in Python.)
        assert_eq!(stable_hash(b""), 0xf52a_15e9_a9b5_e89b);
        assert_eq!(stable_hash(b"lbscale"), 0x1c0f_b8b2_7281_8a5a);
    }

    #[test]
    fn flows_spread_evenly() {
        let t = targets(3);
        let mut counts = HashMap::new();
        let n = 30_000;
        for i in 0..n {
            *counts.entry(flow_order(flow(i), &t)[0]).or_insert(0u32) += 1;
        }
        for (a, c) in &counts {
            let dev = (f64::from(*c) / (f64::from(n) / 3.0) - 1.0).abs();
            assert!(dev < 0.03, "{a}: {c} of {n}");
        }
        // Consecutive source ports of one client spread too.
        let mut counts = HashMap::new();
        for p in 40_000..43_000u16 {
            let f = SocketAddr::from(([127, 0, 0, 1], p));
            *counts.entry(flow_order(f, &t)[0]).or_insert(0u32) += 1;
        }
        assert_eq!(counts.len(), 3);
        assert!(
            counts.values().all(|c| (900..=1100).contains(c)),
            "{counts:?}"
        );
    }

    #[test]
    fn weighted_hashing_follows_weights_and_moves_few_flows() {
        let mut t = targets(3);
        t[2].1 = 0.5;
        let n = 30_000;
        let mut counts = [0u32; 3];
        for i in 0..n {
            let first = flow_order(flow(i), &t)[0];
            counts[t.iter().position(|x| x.0 == first).unwrap()] += 1;
        }
        let want = [0.4, 0.4, 0.2];
        for k in 0..3 {
            let got = f64::from(counts[k]) / f64::from(n);
            assert!((got - want[k]).abs() < 0.015, "{counts:?}");
        }
        // Weight 0: never chosen, not even as a fallback; the others keep their flows.
        let mut z = targets(3);
        z[1].1 = 0.0;
        let full = targets(3);
        for i in 0..3000 {
            let order = flow_order(flow(i), &z);
            assert_eq!(order.len(), 2);
            assert!(!order.contains(&z[1].0));
            let before = flow_order(flow(i), &full)[0];
            if before != z[1].0 {
                assert_eq!(order[0], before, "a flow moved off a target that stayed");
            }
        }
    }

    #[test]
    fn smooth_round_robin_follows_weights() {
        let mut t = targets(3);
        t[0].1 = 1.0;
        t[1].1 = 0.5;
        t[2].1 = 0.0;
        let mut scores = vec![0.0; 3];
        let mut counts = [0u32; 3];
        for _ in 0..300 {
            counts[smooth_pick(&mut scores, &t).unwrap()] += 1;
        }
        assert_eq!(counts, [200, 100, 0]);
        assert_eq!(smooth_pick(&mut [0.0], &[(t[2].0, 0.0)]), None);
    }

    #[test]
    fn old_configs_still_read() {
        let c: NlbConfig = serde_json::from_str(
            r#"{"version": 2, "listeners": [{"vip": "127.0.0.1", "port": 80, "targets": ["127.0.0.2:80"]}]}"#,
        )
        .unwrap();
        let p = pool_of(&c.listeners[0]);
        assert_eq!(p.balance, Balance::RoundRobin);
        assert!(p.unweighted);
        let c: NlbConfig = serde_json::from_str(
            r#"{"listeners": [{"vip": "127.0.0.1", "port": 80, "targets": ["127.0.0.2:80", "127.0.0.3:80"], "balance": "flow_hash", "weights": {"127.0.0.3:80": 7}}]}"#,
        )
        .unwrap();
        let p = pool_of(&c.listeners[0]);
        assert_eq!(p.balance, Balance::FlowHash);
        assert_eq!(p.targets[1].1, 1.0);
    }
}
