//! `lbscale-node nlb`: the local cloud's L4 forwarder (network load balancer).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};
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
}

struct Targets {
    list: RwLock<Arc<Vec<SocketAddr>>>,
    rr: AtomicUsize,
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
    loop {
        match l.accept().await {
            Ok((client, _peer)) => {
                let t = targets.clone();
                tokio::spawn(async move {
                    let list = t.list.read().unwrap_or_else(|e| e.into_inner()).clone();
                    let n = list.len();
                    if n == 0 {
                        return; // no target: close the client connection
                    }
                    let start = t.rr.fetch_add(1, Ordering::Relaxed);
                    for i in 0..n {
                        let target = list[(start + i) % n];
                        match tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(target))
                            .await
                        {
                            Ok(Ok(backend)) => {
                                let _ = client.set_nodelay(true);
                                let _ = backend.set_nodelay(true);
                                crate::tcp::relay(client, backend).await;
                                return;
                            }
                            Ok(Err(e)) => tracing::debug!(%target, error = %e, "target refused"),
                            Err(_) => tracing::debug!(%target, "target connect timed out"),
                        }
                    }
                    tracing::warn!("no target reachable; closing client connection");
                });
            }
            Err(e) => {
                tracing::warn!(error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
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
        let mut wanted: HashMap<SocketAddr, Vec<SocketAddr>> = HashMap::new();
        for l in &cfg.listeners {
            let Ok(ip) = l.vip.parse::<std::net::IpAddr>() else {
                tracing::warn!(vip = %l.vip, "invalid vip; listener skipped");
                continue;
            };
            let mut targets = Vec::new();
            for t in &l.targets {
                match t.parse::<SocketAddr>() {
                    Ok(a) => targets.push(a),
                    Err(_) => tracing::warn!(target = %t, "invalid target (want IP:PORT); skipped"),
                }
            }
            wanted.insert(SocketAddr::new(ip, l.port), targets);
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
                *l.targets.list.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(targets);
                continue;
            }
            match bind(addr) {
                Ok(tl) => {
                    tracing::info!(%addr, targets = targets.len(), "listener open");
                    let t = Arc::new(Targets {
                        list: RwLock::new(Arc::new(targets)),
                        rr: AtomicUsize::new(0),
                    });
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
