//! Native scale-out of an SE group: one vserver spread over several nodes of the
//! group, a primary and its secondaries. This module holds a vserver's scale-out
//! state (where new connections go, its secondaries, their statistics); the
//! listener (`listener`) acts on it.
//!
//! - **PRIMARY**: every client connection of the vserver arrives here. For each new
//!   connection the primary picks, by smooth weighted round robin over the shares
//!   (`primary_share` for itself, `share` for each secondary), whether to serve it
//!   itself or to forward it. Smooth round robin rather than a random draw: the
//!   counts then follow the shares to within about one connection at any moment,
//!   which is what the engine's CPU-equalising plan (lbscale-core `seplan`) assumes.
//!   Forwarding is L4: the primary opens a TCP connection to the secondary's
//!   address at the vserver's port and relays bytes both ways, whatever the
//!   vserver's type (an HTTP vserver's secondary terminates HTTP itself).
//! - **SECONDARY**: serves what it gets like any connection; it may also be reached
//!   directly. Nothing else differs.
//! - **Source NAT and the symmetric path**: every connection a node opens (to a
//!   service, or to a secondary) leaves from the node's own address (see
//!   `dial`). A service therefore sees the secondary's address, its
//!   reply returns to the secondary, which hands it back over the primary's
//!   forwarded connection to the client: the return path crosses the same nodes as
//!   the request (see `dial`). (An HTTP secondary's `X-Forwarded-For` names the client the
//!   primary announced, below.)
//! - **Unreachable secondary**: the connection is served on the primary (it counts
//!   as served there) and that secondary is skipped for [`PEER_RETRY`].
//! - **Scale-in**: a secondary dropped from the list (or every secondary, when the
//!   node stops being the primary or the vserver goes) gets no new connections; its
//!   forwarded connections stay open for `scalein_timeout_ms` (0: lbscale-core's
//!   default `vs_scalein_timeout`, 30 s), then the primary closes them. A secondary
//!   added back before that keeps them.
//! - **Statistics**: `forwarded` has one entry per secondary (total and active
//!   forwarded connections), dropped ones while they still have connections;
//!   `served_connections_total` counts, per vserver, the connections the node served
//!   itself (every vserver, scaled out or not; HTTP counts connections, not
//!   requests).
//!
//! - **The client's address**: every forwarded connection starts with a PROXY
//!   protocol v2 header naming the client. A node reads and removes it from the
//!   connections of its group's other nodes (`NodeConfig.group_peers`), whatever
//!   its role or the vserver's persistence, so it never reaches a service, even
//!   while a new configuration is being rolled out; nobody else's header is read.
//! - **SOURCEIP persistence**: the primary keeps each client IP on the node it was
//!   first routed to (itself or one secondary) while that node stays listed and
//!   reachable, with the vserver's persistence timeout; a secondary keys its own
//!   table by the client the header names, not by the primary. See
//!   `persist`.
//!
//! UDP vservers are scaled out the same way per flow (a client address): the
//! primary relays a forwarded flow's datagrams to the secondary from its own
//! address, both ways; an unreachable secondary cannot be detected at a flow's
//! first datagram, so there is no fallback (the flow ends on the ICMP error and the
//! client's next datagram opens a new one).

use std::collections::HashMap;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use lbscale_proto::ScaleoutRole;
use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;

use crate::dial::Dialer;
use crate::persist::{Table, MAX_ENTRIES};

/// How long the primary waits for a secondary to accept a forwarded connection.
/// Secondaries sit in the same AZ: a slow connect means a sick node, and the
/// client is better served by the primary than kept waiting.
pub const PEER_CONNECT_TIMEOUT: Duration = Duration::from_secs(1);
/// How long resolving a name may take when a configuration is applied.
pub const RESOLVE_TIMEOUT: Duration = Duration::from_secs(2);
/// How long an unreachable secondary is skipped before the primary tries it again.
pub const PEER_RETRY: Duration = Duration::from_secs(1);

/// One secondary of a primary, kept across configurations while it is listed or
/// still has forwarded connections.
pub struct Peer {
    /// As configured (`ScaleoutPeer.address`).
    pub address: String,
    port: u16,
    connections_total: AtomicU64,
    active: AtomicU64,
    /// Cancelled when the scale-in timeout closes the forwarded connections.
    kill: Mutex<CancellationToken>,
    /// Bumped whenever the secondary leaves or comes back: a scale-in timer only
    /// closes connections if nothing happened since it started.
    leave_gen: AtomicU64,
    leaving: std::sync::atomic::AtomicBool,
    /// Skipped until then after a failed connect.
    retry_at: Mutex<Option<Instant>>,
    /// A named secondary's UDP address, resolved when a configuration is
    /// applied ([`Scaleout::resolve_names`]).
    resolved: Mutex<Option<SocketAddr>>,
}

impl Peer {
    fn new(address: &str, port: u16) -> Peer {
        Peer {
            address: address.to_string(),
            port,
            connections_total: AtomicU64::new(0),
            active: AtomicU64::new(0),
            kill: Mutex::new(CancellationToken::new()),
            leave_gen: AtomicU64::new(0),
            leaving: std::sync::atomic::AtomicBool::new(false),
            retry_at: Mutex::new(None),
            resolved: Mutex::new(None),
        }
    }

    pub fn kill_token(&self) -> CancellationToken {
        self.kill.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn available(&self) -> bool {
        let r = self.retry_at.lock().unwrap_or_else(|e| e.into_inner());
        r.is_none_or(|t| Instant::now() >= t)
    }

    pub fn mark_unreachable(&self) {
        *self.retry_at.lock().unwrap_or_else(|e| e.into_inner()) =
            Some(Instant::now() + PEER_RETRY);
    }

    /// The secondary's address when it is configured as one (see
    /// [`Peer::connect`]).
    fn literal(&self) -> Option<SocketAddr> {
        if let Ok(a) = self.address.parse::<SocketAddr>() {
            return Some(a);
        }
        let ip = self.address.parse::<IpAddr>().ok()?;
        Some(SocketAddr::new(ip, self.port))
    }

    /// The secondary's UDP address: as configured, or its name as resolved
    /// when the configuration was applied (never resolved on a receive path).
    pub fn target(&self) -> Option<SocketAddr> {
        self.literal()
            .or_else(|| *self.resolved.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Counts one forwarded connection (or UDP flow) while the guard lives.
    pub fn track(self: &Arc<Self>) -> ActiveGuard {
        self.connections_total.fetch_add(1, Ordering::Relaxed);
        self.active.fetch_add(1, Ordering::Relaxed);
        ActiveGuard(self.clone())
    }

    /// The secondary's IP address, when it is configured as one (not a name).
    fn ip(&self) -> Option<IpAddr> {
        self.address
            .parse::<IpAddr>()
            .ok()
            .or_else(|| self.address.parse::<SocketAddr>().ok().map(|a| a.ip()))
    }

    /// The secondary's listener: `address` is an IP (or a name) listening on the
    /// vserver's port; an explicit `IP:PORT` is taken as is.
    pub async fn connect(&self, dialer: &Dialer) -> io::Result<TcpStream> {
        if let Ok(a) = self.address.parse::<SocketAddr>() {
            return dialer.connect(a).await;
        }
        if let Ok(ip) = self.address.parse::<IpAddr>() {
            return dialer.connect(SocketAddr::new(ip, self.port)).await;
        }
        dialer.connect_host(&self.address, self.port).await
    }
}

/// Where a new connection goes.
pub enum Route {
    Local,
    Forward(Arc<Peer>),
}

/// Smooth weighted round robin (nginx's): every pick adds each weight to its
/// running score, takes the highest score and lowers it by the total. Over any run
/// of picks each choice's count stays within about one of its exact share.
struct Smooth {
    /// Index 0 is the primary itself, then the secondaries in configuration order.
    weights: Vec<f64>,
    scores: Vec<f64>,
}

impl Smooth {
    fn pick(&mut self) -> Option<usize> {
        let total: f64 = self.weights.iter().sum();
        if total <= 0.0 {
            return None;
        }
        let mut best = 0;
        for i in 0..self.weights.len() {
            self.scores[i] += self.weights[i];
            if self.scores[i] > self.scores[best] {
                best = i;
            }
        }
        self.scores[best] -= total;
        Some(best)
    }
}

#[derive(Default)]
struct Inner {
    /// Listed secondaries (selection order) and their plan; empty unless PRIMARY.
    listed: Vec<Arc<Peer>>,
    smooth: Option<Smooth>,
    /// Secondaries dropped from the list, until their connections are gone.
    leaving: Vec<Arc<Peer>>,
}

impl Inner {
    /// The running smooth round-robin score of each choice, by address (the
    /// primary itself: "").
    fn scores_by_address(&self) -> HashMap<String, f64> {
        let Some(s) = &self.smooth else {
            return HashMap::new();
        };
        self.listed
            .iter()
            .enumerate()
            .map(|(i, p)| (p.address.clone(), s.scores[i + 1]))
            .chain(std::iter::once((String::new(), s.scores[0])))
            .collect()
    }

    /// The secondaries `c` lists, in order (the known ones kept, a leaving one
    /// back), and the weights of the primary and each of them.
    fn list(
        &self,
        vserver: &str,
        port: u16,
        c: &lbscale_proto::Scaleout,
    ) -> (Vec<Arc<Peer>>, Vec<f64>) {
        let mut listed = Vec::new();
        let mut weights = vec![c.primary_share];
        for sp in &c.secondaries {
            let known = self
                .listed
                .iter()
                .chain(self.leaving.iter())
                .find(|p| p.address == sp.address)
                .cloned();
            let peer = match known {
                Some(p) => {
                    if p.leaving.swap(false, Ordering::SeqCst) {
                        p.leave_gen.fetch_add(1, Ordering::SeqCst);
                        tracing::info!(vserver, secondary = %p.address, "secondary back before its scale-in timeout");
                    }
                    p
                }
                None => {
                    tracing::info!(vserver, secondary = %sp.address, share = sp.share, "secondary added");
                    Arc::new(Peer::new(&sp.address, port))
                }
            };
            listed.push(peer);
            weights.push(sp.share);
        }
        (listed, weights)
    }
}

/// A secondary dropped from the list: no new connections; its forwarded ones
/// close after `timeout` unless it comes back (or leaves again) before.
fn start_scale_in(p: &Arc<Peer>, vserver: &str, timeout: Duration) {
    p.leaving.store(true, Ordering::SeqCst);
    let gen = p.leave_gen.fetch_add(1, Ordering::SeqCst) + 1;
    tracing::info!(
        vserver,
        secondary = %p.address,
        connections = p.active.load(Ordering::Relaxed),
        timeout_ms = timeout.as_millis() as u64,
        "secondary leaving: no new connections; open ones close after the scale-in timeout"
    );
    let vserver = vserver.to_string();
    let peer = p.clone();
    tokio::spawn(async move {
        tokio::time::sleep(timeout).await;
        if peer.leave_gen.load(Ordering::SeqCst) != gen {
            return; // came back, or left again with a newer timer
        }
        let left = peer.active.load(Ordering::Relaxed);
        if left > 0 {
            tracing::info!(vserver, secondary = %peer.address, connections = left, "scale-in timeout: closing forwarded connections");
        }
        let mut k = peer.kill.lock().unwrap_or_else(|e| e.into_inner());
        k.cancel();
        *k = CancellationToken::new();
    });
}

/// The scale-out state of one vserver on this node; lives as long as its listener.
pub struct Scaleout {
    served: AtomicU64,
    inner: Mutex<Inner>,
    /// SOURCEIP on a primary: client IP → the node it was routed to (None: the
    /// primary itself, else the secondary's address).
    affinity: Table<IpAddr, Option<String>>,
}

/// Rejects a scale-out that cannot be applied: negative or non-finite shares, a
/// secondary listed twice, without an address, or that is this node (it would
/// forward to itself without end; `own` is this node's address).
pub fn validate(v: &lbscale_proto::Vserver, own: Option<IpAddr>) -> Result<(), String> {
    let Some(s) = &v.scaleout else { return Ok(()) };
    let bad = |what: String| Err(format!("vserver {}: scaleout: {what}", v.name));
    if !s.primary_share.is_finite() || s.primary_share < 0.0 {
        return bad(format!("primary_share {} must be >= 0", s.primary_share));
    }
    for (i, p) in s.secondaries.iter().enumerate() {
        if p.address.trim().is_empty() {
            return bad(format!("secondary {i} has no address"));
        }
        if !p.share.is_finite() || p.share < 0.0 {
            return bad(format!(
                "secondary {}: share {} must be >= 0",
                p.address, p.share
            ));
        }
        let is_self = match (p.address.parse::<IpAddr>(), p.address.parse::<SocketAddr>()) {
            (Ok(ip), _) => Some(ip) == own,
            (_, Ok(a)) => Some(a.ip()) == own && u32::from(a.port()) == v.port,
            _ => false,
        };
        if is_self {
            return bad(format!("secondary {} is this node", p.address));
        }
        if s.secondaries[..i].iter().any(|q| q.address == p.address) {
            return bad(format!("secondary {} is listed twice", p.address));
        }
    }
    Ok(())
}

impl Scaleout {
    /// `persistence_timeout`: how long a SOURCEIP client stays routed to one node
    /// without a new connection.
    pub fn new(persistence_timeout: Duration) -> Self {
        Scaleout {
            served: AtomicU64::new(0),
            inner: Mutex::new(Inner::default()),
            affinity: Table::new(persistence_timeout, MAX_ENTRIES),
        }
    }

    /// Resolves the listed secondaries given by name (UDP flows use the
    /// result), each within [`RESOLVE_TIMEOUT`]; an unresolved one is served on
    /// the primary.
    pub async fn resolve_names(&self) {
        let named: Vec<Arc<Peer>> = {
            let inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
            inner
                .listed
                .iter()
                .filter(|p| p.literal().is_none())
                .cloned()
                .collect()
        };
        for p in named {
            let found = tokio::time::timeout(
                RESOLVE_TIMEOUT,
                tokio::net::lookup_host((p.address.as_str(), p.port)),
            )
            .await;
            let a = match found {
                Ok(Ok(mut a)) => a.next(),
                Ok(Err(e)) => {
                    tracing::warn!(secondary = %p.address, error = %e, "secondary's name does not resolve");
                    None
                }
                Err(_) => {
                    tracing::warn!(secondary = %p.address, "secondary's name did not resolve in time");
                    None
                }
            };
            *p.resolved.lock().unwrap_or_else(|e| e.into_inner()) = a;
        }
    }

    /// Forgets where a SOURCEIP client was routed (its secondary failed).
    pub fn forget(&self, client: IpAddr) {
        self.affinity.remove(client);
    }

    /// Applies the vserver's scale-out settings (`None`: the vserver is on this node
    /// only, or is gone). Secondaries no longer listed start their scale-in.
    pub fn update(&self, vserver: &str, port: u16, cfg: Option<&lbscale_proto::Scaleout>) {
        let primary = cfg.filter(|c| c.role == ScaleoutRole::Primary as i32);
        let timeout = match cfg.map(|c| c.scalein_timeout_ms).unwrap_or(0) {
            0 => Duration::from_millis(lbscale_core::seplan::DEFAULT_VS_SCALEIN_TIMEOUT),
            ms => Duration::from_millis(ms),
        };
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let old_scores = inner.scores_by_address();
        let (listed, weights) = match primary {
            Some(c) => inner.list(vserver, port, c),
            None => (Vec::new(), Vec::new()),
        };
        let dropped: Vec<Arc<Peer>> = inner
            .listed
            .iter()
            .filter(|p| !listed.iter().any(|q| Arc::ptr_eq(p, q)))
            .cloned()
            .collect();
        inner.leaving.retain(|p| {
            p.leaving.load(Ordering::SeqCst) && !listed.iter().any(|q| Arc::ptr_eq(p, q))
        });
        for p in dropped {
            start_scale_in(&p, vserver, timeout);
            inner.leaving.push(p);
        }
        // Keep the running scores of choices that stay, so that re-sending the same
        // plan does not restart the sequence (which would favour the largest shares).
        inner.smooth = primary.map(|_| {
            let scores = std::iter::once(String::new())
                .chain(listed.iter().map(|p| p.address.clone()))
                .map(|k| old_scores.get(&k).copied().unwrap_or(0.0))
                .collect();
            Smooth { weights, scores }
        });
        inner.listed = listed;
    }

    /// Chooses where the next connection of the vserver, from `client`, goes. A
    /// connection that comes from one of this primary's own secondaries is served
    /// here: it is a joining secondary passing on what its services may not take
    /// yet under slow start (the primary is one of its ramp peers), and routing it
    /// by the shares again would send part of it back and forth.
    ///
    /// `sticky` (SOURCEIP): a client goes to the node it went to last time (this
    /// one or a secondary) while that node is still listed and reachable and the
    /// entry has not expired; otherwise it is routed by the shares and remembered.
    pub fn route(&self, client: IpAddr, sticky: bool) -> Route {
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        if inner
            .listed
            .iter()
            .chain(inner.leaving.iter())
            .any(|p| p.ip() == Some(client))
        {
            return Route::Local;
        }
        if inner.smooth.is_none() {
            return Route::Local;
        }
        if sticky {
            let kept = self.affinity.get(client, |to| match to {
                None => true,
                Some(a) => inner
                    .listed
                    .iter()
                    .any(|p| &p.address == a && p.available()),
            });
            match kept {
                Some(None) => return Route::Local,
                Some(Some(a)) => {
                    if let Some(p) = inner.listed.iter().find(|p| p.address == a) {
                        return Route::Forward(p.clone());
                    }
                }
                None => {}
            }
        }
        let route = self.route_by_shares(&mut inner);
        if sticky {
            let to = match &route {
                Route::Local => None,
                Route::Forward(p) => Some(p.address.clone()),
            };
            self.affinity.insert(client, to);
        }
        route
    }

    fn route_by_shares(&self, inner: &mut Inner) -> Route {
        let Some(i) = inner.smooth.as_mut().and_then(|s| s.pick()) else {
            return Route::Local;
        };
        match i {
            0 => Route::Local,
            i => {
                let p = &inner.listed[i - 1];
                if p.available() {
                    Route::Forward(p.clone())
                } else {
                    Route::Local
                }
            }
        }
    }

    /// Counts one connection (or UDP flow) served here.
    pub fn count_served(&self) {
        self.served.fetch_add(1, Ordering::Relaxed);
    }

    /// Connections this node served itself.
    pub fn served(&self) -> u64 {
        self.served.load(Ordering::Relaxed)
    }

    /// One entry per listed secondary, and per dropped one that still has
    /// connections.
    pub fn forward_stats(&self, vserver: &str) -> Vec<lbscale_proto::ForwardStats> {
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        inner
            .leaving
            .retain(|p| p.leaving.load(Ordering::SeqCst) && p.active.load(Ordering::Relaxed) > 0);
        inner
            .listed
            .iter()
            .chain(inner.leaving.iter())
            .map(|p| lbscale_proto::ForwardStats {
                vserver: vserver.to_string(),
                peer: p.address.clone(),
                connections_total: p.connections_total.load(Ordering::Relaxed),
                active_connections: p.active.load(Ordering::Relaxed),
            })
            .collect()
    }
}

/// Counts a forwarded connection as active while alive.
pub struct ActiveGuard(Arc<Peer>);

impl Drop for ActiveGuard {
    fn drop(&mut self) {
        self.0.active.fetch_sub(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn smooth(w: &[f64]) -> Smooth {
        Smooth {
            weights: w.to_vec(),
            scores: vec![0.0; w.len()],
        }
    }

    #[test]
    fn smooth_counts_follow_the_planned_shares_closely() {
        let plan = lbscale_core::seplan::plan(&lbscale_core::seplan::PlanParams::default(), 4);
        let mut s = smooth(&plan.shares);
        let mut counts = [0u32; 4];
        for n in 1..=1000u32 {
            counts[s.pick().unwrap()] += 1;
            for (i, c) in counts.iter().enumerate() {
                let want = plan.shares[i] * f64::from(n);
                assert!(
                    (f64::from(*c) - want).abs() <= 1.5,
                    "after {n}: {counts:?} vs {:?}",
                    plan.shares
                );
            }
        }
    }

    #[test]
    fn zero_shares_never_picked_and_all_zero_is_none() {
        let mut s = smooth(&[0.0, 1.0, 0.0]);
        assert!((0..50).all(|_| s.pick() == Some(1)));
        assert_eq!(smooth(&[0.0, 0.0]).pick(), None);
    }
}
