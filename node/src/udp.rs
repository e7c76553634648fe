//! UDP vserver: one flow per client address, relayed through a connected socket
//! towards the chosen service; a flow ends after 30 s without a reply. A
//! scale-out primary relays a forwarded flow to its secondary instead (see
//! `scaleout`).

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::net::UdpSocket;
use tokio_util::sync::CancellationToken;

use crate::model::Vserver;
use crate::persist::Persistence;
use crate::scaleout::{Peer, Route};
use crate::service::ServiceRt;

const FLOW_IDLE: Duration = Duration::from_secs(30);

struct Flow {
    up: Arc<UdpSocket>,
    dead: AtomicBool,
    /// The service, when the flow is served here (none when forwarded).
    rt: Option<Arc<ServiceRt>>,
}

pub async fn serve(sock: UdpSocket, vs: Arc<Vserver>, ip: IpAddr) {
    let sock = Arc::new(sock);
    let mut flows: HashMap<SocketAddr, Arc<Flow>> = HashMap::new();
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
        let flow = match flows.get(&peer) {
            Some(f) if !f.dead.load(Ordering::Relaxed) => f.clone(),
            _ => {
                if flows.len() > 1024 {
                    flows.retain(|_, f| !f.dead.load(Ordering::Relaxed));
                }
                match open_flow(&sock, &vs, ip, peer).await {
                    Some(f) => {
                        flows.insert(peer, f.clone());
                        f
                    }
                    None => continue,
                }
            }
        };
        let _ = flow.up.send(&buf[..n]).await;
        if let Some(rt) = &flow.rt {
            rt.record_traffic(n as u64, 1);
        }
    }
}

/// Opens the flow of a new client: forwarded to a scale-out secondary when the
/// plan says so, else served here.
async fn open_flow(
    sock: &Arc<UdpSocket>,
    vs: &Arc<Vserver>,
    ip: IpAddr,
    client: SocketAddr,
) -> Option<Arc<Flow>> {
    let sticky = vs.state().persistence == Persistence::SourceIp;
    let forward = match vs.scaleout.route(client.ip(), sticky) {
        Route::Forward(p) => match p.resolve().await {
            Ok(a) => Some((p, a)),
            Err(e) => {
                tracing::warn!(secondary = %p.address, error = %e, "secondary unresolvable: serving on the primary");
                None
            }
        },
        Route::Local => None,
    };
    match forward {
        Some((peer, target)) => open_forwarded_flow(sock, vs, ip, client, peer, target).await,
        None => open_served_flow(sock, vs, ip, client).await,
    }
}

/// A flow served here: to the service the LB method (or SOURCEIP) picks.
async fn open_served_flow(
    sock: &Arc<UdpSocket>,
    vs: &Arc<Vserver>,
    ip: IpAddr,
    client: SocketAddr,
) -> Option<Arc<Flow>> {
    let st = vs.state();
    let idx = vs.pick_for(&st, client.ip(), None)?;
    let rt = st.services[idx].rt.clone();
    let target = match rt.addr {
        Some(a) => a,
        None => tokio::net::lookup_host((rt.host.as_str(), rt.port))
            .await
            .ok()?
            .next()?,
    };
    vs.scaleout.count_served();
    let up = connected_socket(ip, target).await?;
    let flow = Arc::new(Flow {
        up: Arc::new(up),
        dead: AtomicBool::new(false),
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

/// A socket from the node's own address (its source NAT) connected to `target`.
async fn connected_socket(ip: IpAddr, target: SocketAddr) -> Option<UdpSocket> {
    let bind_ip = if target.ip().is_loopback() || target.is_ipv4() == ip.is_ipv4() {
        ip
    } else if target.is_ipv4() {
        IpAddr::from([0, 0, 0, 0])
    } else {
        IpAddr::from([0u16; 8])
    };
    let up = UdpSocket::bind((bind_ip, 0)).await.ok()?;
    up.connect(target).await.ok()?;
    Some(up)
}

/// A flow the primary relays to a scale-out secondary: the secondary sees the
/// primary's address as the client and serves the flow like any other.
async fn open_forwarded_flow(
    sock: &Arc<UdpSocket>,
    vs: &Arc<Vserver>,
    ip: IpAddr,
    client: SocketAddr,
    peer: Arc<Peer>,
    target: SocketAddr,
) -> Option<Arc<Flow>> {
    let up = connected_socket(ip, target).await?;
    let flow = Arc::new(Flow {
        up: Arc::new(up),
        dead: AtomicBool::new(false),
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
/// `kill` (the service's drain or the secondary's scale-in timed out) or the
/// end of the node's drain; then the flow is dead.
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
            r = tokio::time::timeout(FLOW_IDLE, flow.up.recv(&mut buf)) => match r {
                Ok(Ok(n)) => {
                    vs.traffic.add_bytes(n);
                    if let Some(rt) = &flow.rt {
                        rt.record_traffic(n as u64, 1);
                    }
                    let _ = sock.send_to(&buf[..n], client).await;
                }
                Ok(Err(_)) | Err(_) => break,
            },
        }
    }
    flow.dead.store(true, Ordering::Relaxed);
}
