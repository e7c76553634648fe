//! UDP vserver: one flow per client address, relayed through a connected socket
//! towards the chosen service; a flow ends after 30 s without a reply. A
//! scale-out primary relays a forwarded flow to its secondary instead (see
//! `scaleout`).
//!
//! Flows are bounded: each holds a descriptor, a task and a buffer, so a new
//! client past the vserver's `max_connections` or the node's descriptors
//! replaces the least recently used flow (a flood of spoofed sources then
//! costs the node its budget, never its management API). Names were resolved
//! when the configuration was applied: nothing on the receive path waits for
//! DNS. What a flow sees (answers, refusals) feeds the passive health check.

use std::collections::{BTreeMap, HashMap};
use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::net::UdpSocket;
use tokio_util::sync::CancellationToken;

use crate::bounds::{Admission, Refusals};
use crate::model::Vserver;
use crate::persist::Persistence;
use crate::scaleout::{Peer, Route};
use crate::service::ServiceRt;

const FLOW_IDLE: Duration = Duration::from_secs(30);

struct Flow {
    up: Arc<UdpSocket>,
    dead: AtomicBool,
    /// Cancelled when the flow is evicted: its reply task ends.
    stop: CancellationToken,
    /// The service, when the flow is served here (none when forwarded).
    rt: Option<Arc<ServiceRt>>,
}

/// A flow in the table: its use stamp and its room in the vserver's limit and
/// the node's descriptors (given back when it leaves the table).
struct Entry<F> {
    flow: F,
    used: u64,
    _admission: Option<Admission>,
}

/// A vserver's flows by client, least recently used first. Lives in its
/// receive loop's task: no lock.
struct Flows<F> {
    by_client: HashMap<SocketAddr, Entry<F>>,
    by_use: BTreeMap<u64, SocketAddr>,
    clock: u64,
}

impl<F> Default for Flows<F> {
    fn default() -> Self {
        Flows {
            by_client: HashMap::new(),
            by_use: BTreeMap::new(),
            clock: 0,
        }
    }
}

impl<F: Clone> Flows<F> {
    /// The flow of `client`, now the most recently used.
    fn touch(&mut self, client: SocketAddr) -> Option<F> {
        let e = self.by_client.get_mut(&client)?;
        self.clock += 1;
        self.by_use.remove(&e.used);
        e.used = self.clock;
        self.by_use.insert(self.clock, client);
        Some(e.flow.clone())
    }

    fn insert(&mut self, client: SocketAddr, flow: F, admission: Option<Admission>) {
        self.remove(client);
        self.clock += 1;
        self.by_use.insert(self.clock, client);
        self.by_client.insert(
            client,
            Entry {
                flow,
                used: self.clock,
                _admission: admission,
            },
        );
    }

    fn remove(&mut self, client: SocketAddr) -> Option<F> {
        let e = self.by_client.remove(&client)?;
        self.by_use.remove(&e.used);
        Some(e.flow)
    }

    /// Removes the least recently used flow.
    fn pop_oldest(&mut self) -> Option<F> {
        let (_, client) = self.by_use.pop_first()?;
        self.by_client.remove(&client).map(|e| e.flow)
    }

    fn len(&self) -> usize {
        self.by_client.len()
    }
}

impl Flows<Arc<Flow>> {
    /// Makes room for a new flow: ends the least recently used ones until the
    /// vserver and the node admit one more; None when no flow is left to end.
    fn admit(&mut self, vs: &Vserver) -> Option<Admission> {
        loop {
            if let Some(a) = vs.admit(1) {
                return Some(a);
            }
            self.pop_oldest()?.stop.cancel();
        }
    }
}

pub async fn serve(sock: UdpSocket, vs: Arc<Vserver>) {
    let sock = Arc::new(sock);
    let mut flows: Flows<Arc<Flow>> = Flows::default();
    let mut refused = Refusals::default();
    let mut buf = vec![0u8; 65536];
    loop {
        let (n, peer) = tokio::select! {
            _ = vs.closing.cancelled() => break,
            r = sock.recv_from(&mut buf) => match r {
                Ok(x) => x,
                Err(e) => {
                    tracing::debug!(error = %e, "udp recv failed");
                    continue;
                }
            },
        };
        vs.traffic.add_bytes(n);
        let flow = match flows.touch(peer) {
            Some(f) if !f.dead.load(Ordering::Relaxed) => f,
            _ => {
                flows.remove(peer);
                let Some(admission) = flows.admit(&vs) else {
                    if let Some(dropped) = refused.note() {
                        tracing::warn!(vserver = %vs.state().name, flows = flows.len(), dropped, "no descriptor left for a new UDP flow: datagram dropped");
                    }
                    continue;
                };
                match open_flow(&sock, &vs, peer).await {
                    Some(f) => {
                        flows.insert(peer, f.clone(), Some(admission));
                        f
                    }
                    None => continue,
                }
            }
        };
        let sent = flow.up.send(&buf[..n]).await;
        if let Some(rt) = &flow.rt {
            rt.record_traffic(n as u64, 1);
            match sent {
                Ok(_) => rt.udp_sent(),
                Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => rt.udp_refused(),
                Err(_) => {}
            }
        }
    }
    for (_, e) in flows.by_client.drain() {
        e.flow.stop.cancel();
    }
}

/// Opens the flow of a new client: forwarded to a scale-out secondary when the
/// plan says so, else served here.
async fn open_flow(
    sock: &Arc<UdpSocket>,
    vs: &Arc<Vserver>,
    client: SocketAddr,
) -> Option<Arc<Flow>> {
    let sticky = vs.state().persistence == Persistence::SourceIp;
    let forward = match vs.scaleout.route(client.ip(), sticky) {
        Route::Forward(p) => match p.target() {
            Some(a) => Some((p, a)),
            None => {
                tracing::warn!(secondary = %p.address, "secondary unresolved: serving on the primary");
                None
            }
        },
        Route::Local => None,
    };
    match forward {
        Some((peer, target)) => open_forwarded_flow(sock, vs, client, peer, target).await,
        None => open_served_flow(sock, vs, client).await,
    }
}

/// A flow served here: to the service the LB method (or SOURCEIP) picks.
async fn open_served_flow(
    sock: &Arc<UdpSocket>,
    vs: &Arc<Vserver>,
    client: SocketAddr,
) -> Option<Arc<Flow>> {
    let st = vs.state();
    let idx = vs.pick_for(&st, client.ip(), None)?;
    let rt = st.services[idx].rt.clone();
    let target = rt.target()?;
    vs.scaleout.count_served();
    let up = vs.dialer.udp_socket(target).await.ok()?;
    let flow = Arc::new(Flow {
        up: Arc::new(up),
        dead: AtomicBool::new(false),
        stop: CancellationToken::new(),
        rt: Some(rt.clone()),
    });
    rt.active.fetch_add(1, Ordering::Relaxed);
    let replies = relay_replies(
        flow.clone(),
        sock.clone(),
        client,
        vs.clone(),
        rt.kill_token(),
    );
    tokio::spawn(async move {
        replies.await;
        rt.active.fetch_sub(1, Ordering::Relaxed);
    });
    Some(flow)
}

/// A flow the primary relays to a scale-out secondary: the secondary sees the
/// primary's address as the client and serves the flow like any other.
async fn open_forwarded_flow(
    sock: &Arc<UdpSocket>,
    vs: &Arc<Vserver>,
    client: SocketAddr,
    peer: Arc<Peer>,
    target: SocketAddr,
) -> Option<Arc<Flow>> {
    let up = vs.dialer.udp_socket(target).await.ok()?;
    let flow = Arc::new(Flow {
        up: Arc::new(up),
        dead: AtomicBool::new(false),
        stop: CancellationToken::new(),
        rt: None,
    });
    let active = peer.track();
    let replies = relay_replies(
        flow.clone(),
        sock.clone(),
        client,
        vs.clone(),
        peer.kill_token(),
    );
    tokio::spawn(async move {
        let _active = active;
        replies.await;
    });
    Some(flow)
}

/// Relays the flow's replies to its client until none comes for [`FLOW_IDLE`],
/// `kill` (the service's drain or the secondary's scale-in timed out), the
/// flow's eviction or the end of the node's drain; then the flow is dead.
async fn relay_replies(
    flow: Arc<Flow>,
    sock: Arc<UdpSocket>,
    client: SocketAddr,
    vs: Arc<Vserver>,
    kill: CancellationToken,
) {
    let _g = vs.traffic.connection();
    let mut buf = vec![0u8; 65536];
    loop {
        tokio::select! {
            _ = kill.cancelled() => break,
            _ = vs.kill.cancelled() => break,
            _ = flow.stop.cancelled() => break,
            r = tokio::time::timeout(FLOW_IDLE, flow.up.recv(&mut buf)) => match r {
                Ok(Ok(n)) => {
                    vs.traffic.add_bytes(n);
                    if let Some(rt) = &flow.rt {
                        rt.udp_replied();
                        rt.record_traffic(n as u64, 1);
                    }
                    let _ = sock.send_to(&buf[..n], client).await;
                }
                Ok(Err(e)) => {
                    if let (Some(rt), io::ErrorKind::ConnectionRefused) = (&flow.rt, e.kind()) {
                        rt.udp_refused();
                    }
                    break;
                }
                Err(_) => break,
            },
        }
    }
    flow.dead.store(true, Ordering::Relaxed);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn client(port: u16) -> SocketAddr {
        SocketAddr::from(([192, 0, 2, 1], port))
    }

    #[test]
    fn the_least_recently_used_flow_goes_first() {
        let mut f: Flows<u16> = Flows::default();
        for p in 1..=3 {
            f.insert(client(p), p, None);
        }
        // 1 is used again: 2 is now the oldest.
        assert_eq!(f.touch(client(1)), Some(1));
        assert_eq!(f.pop_oldest(), Some(2));
        assert_eq!(f.pop_oldest(), Some(3));
        assert_eq!(f.pop_oldest(), Some(1));
        assert_eq!(f.pop_oldest(), None);
        assert_eq!(f.len(), 0);
    }

    #[test]
    fn a_replaced_or_removed_flow_leaves_no_stale_order() {
        let mut f: Flows<u16> = Flows::default();
        f.insert(client(1), 10, None);
        f.insert(client(2), 20, None);
        f.insert(client(1), 11, None);
        assert_eq!(f.len(), 2);
        assert_eq!(f.by_use.len(), 2);
        assert_eq!(f.remove(client(2)), Some(20));
        assert_eq!(f.pop_oldest(), Some(11));
        assert!(f.by_use.is_empty());
    }
}
