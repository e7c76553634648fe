//! A TCP or HTTP vserver's listener: each accepted connection is read for the
//! PROXY header of a group peer, then forwarded to a scale-out secondary or
//! served here by its protocol (see `scaleout` for the rules).

use std::future::poll_fn;
use std::io;
use std::net::SocketAddr;
use std::sync::Arc;

use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};

use crate::bounds::{Backoff, Refusals};
use crate::cancel::Watch;
use crate::model::{Kind, Vserver};
use crate::persist::Persistence;
use crate::proxy_protocol::{proxy_header, read_proxy_header};
use crate::scaleout::{Peer, Route, PEER_CONNECT_TIMEOUT};

/// Descriptors a connection holds: the client's and one towards a service
/// (or a secondary).
const CONNECTION_FDS: usize = 2;

/// Accepts the vserver's connections until it closes. A connection past the
/// vserver's limit or the node's descriptors is closed at once; an accept
/// error is waited out.
pub async fn accept_loop(listener: TcpListener, vs: Arc<Vserver>) {
    let mut backoff = Backoff::default();
    let mut refused = Refusals::default();
    let name = vs.state().name.clone();
    loop {
        let (stream, peer) = tokio::select! {
            _ = vs.closing.cancelled() => break,
            r = crate::bounds::accept(&listener, &mut backoff, &name) => r,
        };
        match vs.admit(CONNECTION_FDS) {
            Some(admission) => {
                let vs = vs.clone();
                tokio::spawn(async move {
                    let _admission = admission;
                    accept(stream, peer, vs).await
                });
            }
            None => {
                if let Some(refused) = refused.note() {
                    let (open, limit) = vs.connections();
                    tracing::warn!(vserver = %name, open, limit, refused, "connection limit reached: closing new connections");
                }
            }
        }
    }
}

/// Handles one accepted connection of a TCP or HTTP vserver: forwards it to a
/// secondary when this node is the vserver's primary and the plan says so, else
/// serves it here.
///
/// SOURCEIP: the primary keeps a client on one node (`Scaleout::route`) and
/// starts a forwarded connection with a PROXY protocol v2 header naming the
/// client; a secondary reads that header and keys its persistence by the client
/// it names.
async fn accept(client: TcpStream, from: SocketAddr, vs: Arc<Vserver>) {
    let mut client = client;
    // A connection from another node of the group (its primary forwarding a
    // client) starts with a PROXY header naming the client: read and removed
    // here, whatever this node's role or the vserver's persistence, so that it
    // never reaches a service. Nobody else's header is read.
    let mut source = from.ip();
    if vs.state().proxy_from.contains(&from.ip()) {
        match read_proxy_header(&mut client).await {
            Ok(Some(ip)) => source = ip,
            Ok(None) => {}
            Err(e) => {
                tracing::debug!(%from, error = %e, "bad PROXY header");
                return;
            }
        }
    }
    let sticky = vs.state().persistence == Persistence::SourceIp;
    let client = match vs.scaleout.route(source, sticky) {
        Route::Local => client,
        // Every forwarded connection names its client (the secondary has this
        // node among its group peers and removes the header).
        Route::Forward(peer) => match forward(client, from, &vs, peer).await {
            Ok(()) => return,
            Err(client) => {
                vs.scaleout.forget(source);
                client
            }
        },
    };
    vs.scaleout.count_served();
    match vs.state().kind {
        Kind::Http => crate::http::serve_conn(client, source, vs).await,
        _ => crate::tcp::serve_conn(client, source, vs).await,
    }
}

/// Relays `client` to `peer`, after a PROXY header naming it, until either side
/// closes, the scale-in timeout of a leaving secondary, or the end of a drain.
/// Hands the client back when the secondary cannot be reached.
async fn forward(
    client: TcpStream,
    from: SocketAddr,
    vs: &Vserver,
    peer: Arc<Peer>,
) -> Result<(), TcpStream> {
    let connect = async {
        let mut s = peer.connect(&vs.dialer).await?;
        let dst = s.peer_addr()?;
        s.write_all(&proxy_header(from, dst)).await?;
        Ok::<_, io::Error>(s)
    };
    let up = match tokio::time::timeout(PEER_CONNECT_TIMEOUT, connect).await {
        Ok(Ok(s)) => s,
        r => {
            let error = match r {
                Ok(Err(e)) => e.to_string(),
                _ => "connect timed out".to_string(),
            };
            tracing::warn!(secondary = %peer.address, %error, "secondary unreachable: serving on the primary");
            peer.mark_unreachable();
            return Err(client);
        }
    };
    let _g = vs.traffic.connection();
    let _ = client.set_nodelay(true);
    let _ = up.set_nodelay(true);
    let mut kill = Watch::new(&peer.kill_token());
    let mut node_kill = Watch::new(&vs.kill);
    let _active = peer.track();
    tokio::select! {
        biased;
        _ = crate::tcp::relay(client, up, &vs.traffic, None) => {}
        _ = poll_fn(|cx| kill.poll(cx)) => {}
        _ = poll_fn(|cx| node_kill.poll(cx)) => {}
    }
    Ok(())
}
