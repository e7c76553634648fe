//! A service's idle HTTP/1.1 connections (kept alive between requests), and the
//! request body sent on them.

use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use hyper::client::conn::http1::SendRequest;

use crate::metrics::Traffic;

/// Idle connections kept per service; more are closed when their response ends.
const MAX_IDLE_PER_SERVICE: usize = 512;

/// A client's request body forwarded to a service, counting bytes into the
/// node's throughput as they pass.
pub struct UpBody {
    inner: Incoming,
    traffic: Arc<Traffic>,
}

impl UpBody {
    pub fn new(inner: Incoming, traffic: Arc<Traffic>) -> Self {
        UpBody { inner, traffic }
    }
}

impl Body for UpBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let r = Pin::new(&mut self.inner).poll_frame(cx);
        if let Poll::Ready(Some(Ok(f))) = &r {
            if let Some(d) = f.data_ref() {
                self.traffic.add_bytes(d.len());
            }
        }
        r
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// One upstream connection, ready for the next request.
pub type Conn = SendRequest<UpBody>;

/// The idle connections to one service. A poisoned lock is treated as empty:
/// the request then opens a new connection.
#[derive(Default)]
pub struct IdlePool(Mutex<Vec<Conn>>);

impl IdlePool {
    /// The most recent idle connection that is still open.
    pub fn pop(&self) -> Option<Conn> {
        let mut pool = self.0.lock().ok()?;
        while let Some(s) = pool.pop() {
            if !s.is_closed() {
                return Some(s);
            }
        }
        None
    }

    /// Keeps `conn` for the next request, unless the pool is full.
    pub fn push(&self, conn: Conn) {
        if let Ok(mut pool) = self.0.lock() {
            if pool.len() < MAX_IDLE_PER_SERVICE {
                pool.push(conn);
            }
        }
    }

    /// Closes every idle connection (the service went DOWN or drains).
    pub fn clear(&self) {
        if let Ok(mut pool) = self.0.lock() {
            pool.clear();
        }
    }
}
