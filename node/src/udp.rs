//! UDP vserver: one flow per client address, relayed through a connected socket
//! towards the chosen service; a flow ends after 30 s without a reply.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::net::UdpSocket;

use crate::metrics::{add_bytes, ConnGuard};
use crate::node::Vserver;

const FLOW_IDLE: Duration = Duration::from_secs(30);

struct Flow {
    up: Arc<UdpSocket>,
    dead: AtomicBool,
    rt: Arc<crate::lb::ServiceRt>,
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
        add_bytes(n);
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
        flow.rt.record_traffic(n as u64, 1);
    }
}

async fn open_flow(
    sock: &Arc<UdpSocket>,
    vs: &Arc<Vserver>,
    ip: IpAddr,
    peer: SocketAddr,
) -> Option<Arc<Flow>> {
    let st = vs.state();
    let idx = st.pick(None)?;
    let rt = st.services[idx].rt.clone();
    let target = match rt.addr {
        Some(a) => a,
        None => tokio::net::lookup_host((rt.host.as_str(), rt.port))
            .await
            .ok()?
            .next()?,
    };
    let bind_ip = if target.ip().is_loopback() || target.is_ipv4() == ip.is_ipv4() {
        ip
    } else if target.is_ipv4() {
        IpAddr::from([0, 0, 0, 0])
    } else {
        IpAddr::from([0u16; 8])
    };
    let up = UdpSocket::bind((bind_ip, 0)).await.ok()?;
    up.connect(target).await.ok()?;
    let flow = Arc::new(Flow {
        up: Arc::new(up),
        dead: AtomicBool::new(false),
        rt: rt.clone(),
    });
    let f2 = flow.clone();
    let sock = sock.clone();
    let vs = vs.clone();
    rt.active.fetch_add(1, Ordering::Relaxed);
    let rkill = rt.kill_token();
    tokio::spawn(async move {
        let _g = ConnGuard::new();
        let mut buf = vec![0u8; 65536];
        loop {
            tokio::select! {
                _ = rkill.cancelled() => break,
                _ = vs.kill.cancelled() => break,
                r = tokio::time::timeout(FLOW_IDLE, f2.up.recv(&mut buf)) => match r {
                    Ok(Ok(n)) => {
                        add_bytes(n);
                        rt.record_traffic(n as u64, 1);
                        let _ = sock.send_to(&buf[..n], peer).await;
                    }
                    Ok(Err(_)) | Err(_) => break,
                },
            }
        }
        f2.dead.store(true, Ordering::Relaxed);
        rt.active.fetch_sub(1, Ordering::Relaxed);
    });
    Some(flow)
}
