//! A service's idle HTTP/1.1 connections, kept alive between requests and
//! shared by every client connection of the node (HAProxy's `http-reuse
//! always`).

use std::collections::VecDeque;
use std::sync::Mutex;
use std::task::{Context, Waker};

use tokio::net::TcpStream;

/// Idle connections kept per service; more are closed when their response ends.
const MAX_IDLE_PER_SERVICE: usize = 512;

/// Whether an idle connection is still usable: nothing to read on it (an
/// idle service sends nothing; readable means it closed or misbehaved). Reads
/// the readiness the runtime already has, no system call.
fn still_idle(s: &TcpStream) -> bool {
    let mut cx = Context::from_waker(Waker::noop());
    s.poll_read_ready(&mut cx).is_pending()
}

/// Whether the service still has an idle connection open: asked of the
/// kernel (a non-blocking peek), for a request that could not be sent again
/// if the connection turned out closed.
pub fn still_open(s: &TcpStream) -> bool {
    use std::os::fd::AsRawFd;
    let mut b = 0u8;
    // SAFETY: a one-byte peek into a local buffer on a socket this owns.
    let n = unsafe {
        libc::recv(
            s.as_raw_fd(),
            (&mut b as *mut u8).cast(),
            1,
            libc::MSG_PEEK | libc::MSG_DONTWAIT,
        )
    };
    n < 0 && std::io::Error::last_os_error().kind() == std::io::ErrorKind::WouldBlock
}

/// The idle connections to one service, the most recent last. A poisoned lock
/// is treated as empty: the request then opens a new connection.
#[derive(Default)]
pub struct IdlePool(Mutex<VecDeque<TcpStream>>);

impl IdlePool {
    /// The most recent idle connection that is still open.
    pub fn pop(&self) -> Option<TcpStream> {
        let mut pool = self.0.lock().ok()?;
        while let Some(s) = pool.pop_back() {
            if still_idle(&s) {
                return Some(s);
            }
        }
        None
    }

    /// Keeps `conn` for the next request, unless the pool is full. The oldest
    /// one goes if the service closed it meanwhile, so that closed ones do not
    /// pile up.
    pub fn push(&self, conn: TcpStream) {
        if let Ok(mut pool) = self.0.lock() {
            if pool.front().is_some_and(|s| !still_idle(s)) {
                pool.pop_front();
            }
            if pool.len() < MAX_IDLE_PER_SERVICE {
                pool.push_back(conn);
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
