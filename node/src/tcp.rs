//! L4 TCP relay: vservers of type TCP, and a primary's forwarded connections.

use std::future::poll_fn;
use std::io;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

use crate::cancel::Watch;
use crate::metrics::Traffic;
use crate::model::Vserver;
use crate::service::ServiceRt;

/// A stream that counts the bytes read from it into the node's throughput, and
/// into its service's traffic estimators when there is one.
struct Counted<'a>(TcpStream, &'a Traffic, Option<Arc<ServiceRt>>);

impl AsyncRead for Counted<'_> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.0).poll_read(cx, buf);
        if let Poll::Ready(Ok(())) = r {
            let n = buf.filled().len() - before;
            self.1.add_bytes(n);
            if let Some(rt) = &self.2 {
                rt.record_traffic(n as u64, 1);
            }
        }
        r
    }
}

impl AsyncWrite for Counted<'_> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.0).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_shutdown(cx)
    }
}

/// Relays both ways until both sides close, counting into the node's `traffic`
/// and feeding `rt`'s traffic estimators.
pub async fn relay(
    client: TcpStream,
    backend: TcpStream,
    traffic: &Traffic,
    rt: Option<Arc<ServiceRt>>,
) {
    let mut a = Counted(client, traffic, rt.clone());
    let mut b = Counted(backend, traffic, rt);
    let _ = tokio::io::copy_bidirectional(&mut a, &mut b).await;
}

/// Serves one TCP vserver connection: pick a service (trying the next ones if a
/// connection is refused), then relay until done or the node is killed. `source`
/// is the SOURCEIP persistence key (the client's address).
pub async fn serve_conn(client: TcpStream, source: IpAddr, vs: Arc<Vserver>) {
    let _g = vs.traffic.connection();
    let _ = client.set_nodelay(true);
    let st = vs.state();
    let Some(mut idx) = vs.pick_for(&st, source, None) else {
        return;
    };
    let attempts = st.services.len();
    let mut backend = None;
    let mut tried: Vec<usize> = Vec::new();
    for _ in 0..attempts {
        let rt = &st.services[idx].rt;
        let start = Instant::now();
        match rt
            .connect_within(&vs.dialer, vs.limits.connect_timeout)
            .await
        {
            Ok(s) => {
                rt.record_response(start.elapsed().as_micros() as u64);
                backend = Some(s);
                break;
            }
            Err(e) => {
                tracing::debug!(service = %rt.name, error = %e, "backend connect failed");
                tried.push(idx);
                match vs.pick_after_failure(&st, source, &tried) {
                    Some(j) => idx = j,
                    None => break,
                }
            }
        }
    }
    let Some(backend) = backend else { return };
    let rt = st.services[idx].rt.clone();
    drop(st);
    rt.active.fetch_add(1, Ordering::Relaxed);
    // The relay first, and the cancellations as flags once registered: no
    // lock per wake-up (see `Watch`).
    let mut rkill = Watch::new(&rt.kill_token());
    let mut kill = Watch::new(&vs.kill);
    tokio::select! {
        biased;
        _ = relay(client, backend, &vs.traffic, rt.track_traffic.load(Ordering::Relaxed).then(|| rt.clone())) => {}
        _ = poll_fn(|cx| rkill.poll(cx)) => {}
        _ = poll_fn(|cx| kill.poll(cx)) => {}
    }
    rt.active.fetch_sub(1, Ordering::Relaxed);
}
