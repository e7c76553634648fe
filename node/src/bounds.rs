//! What bounds a node's data plane: its file-descriptor budget, each vserver's
//! connection limit, the timeouts towards services and the size of a request's
//! head. A flood of connections or UDP sources then costs the node at most its
//! budget, and the management API always has descriptors left.

use std::sync::Arc;
use std::time::Duration;

/// A vserver's connection (or UDP flow) limit when its configuration sets none.
pub const DEFAULT_MAX_CONNECTIONS: usize = 10_000;
/// Descriptors kept out of the data plane's budget at least: the management
/// API, listeners, health checks, logs.
const MIN_RESERVE: usize = 128;

/// The limits of a node's connections to services and of a client's request.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Connecting to a service (TCP and HTTP vservers).
    pub connect_timeout: Duration,
    /// From sending a request to a service until its response's headers (HTTP).
    pub response_header_timeout: Duration,
    /// A client request's line and headers, bytes; more is answered 431.
    pub max_request_header_bytes: usize,
}

/// hyper's smallest read buffer: the floor of `max_request_header_bytes`.
pub const MIN_REQUEST_HEADER_BYTES: usize = 8192;

impl Default for Limits {
    fn default() -> Self {
        Limits {
            connect_timeout: Duration::from_secs(5),
            response_header_timeout: Duration::from_secs(60),
            max_request_header_bytes: 32 * 1024,
        }
    }
}

pub use lbscale_descriptors::{open_files_limit, raise_open_files_limit, Budget, Slot};

/// The data plane's share of the process's descriptors: all but an eighth (at
/// least [`MIN_RESERVE`]) kept for the rest of the process.
pub fn descriptor_budget(nofile: usize) -> Arc<Budget> {
    let reserve = (nofile / 8).max(MIN_RESERVE);
    Budget::new(nofile.saturating_sub(reserve).max(1))
}

/// What one client connection or UDP flow holds: its vserver's slot and its
/// descriptors in the node's budget.
pub struct Admission {
    _vserver: Slot,
    _descriptors: Slot,
}

/// Admits one connection (or flow) using `fds` descriptors, when both the
/// vserver's limit and the node's descriptor budget allow it.
pub fn admit(vserver: &Arc<Budget>, node: &Arc<Budget>, fds: usize) -> Option<Admission> {
    let v = vserver.take(1)?;
    let d = node.take(fds)?;
    Some(Admission {
        _vserver: v,
        _descriptors: d,
    })
}

/// Connections or datagrams refused for lack of room, to log at most once a
/// second under a flood.
#[derive(Default)]
pub struct Refusals {
    count: u64,
    logged: Option<std::time::Instant>,
}

impl Refusals {
    /// Counts one; the number since the last log when it is time to log again.
    pub fn note(&mut self) -> Option<u64> {
        self.count += 1;
        if self
            .logged
            .is_some_and(|t| t.elapsed() < Duration::from_secs(1))
        {
            return None;
        }
        self.logged = Some(std::time::Instant::now());
        Some(std::mem::take(&mut self.count))
    }
}

/// The delay between retries of a failing `accept` (no descriptor left, no
/// memory): doubling from 10 ms to 1 s, back to the start after a success. An
/// accept error never ends a listener.
pub struct Backoff {
    delay: Duration,
}

impl Default for Backoff {
    fn default() -> Self {
        Backoff {
            delay: Duration::ZERO,
        }
    }
}

impl Backoff {
    pub fn reset(&mut self) {
        self.delay = Duration::ZERO;
    }

    /// Logs the error of listener `what` and returns how long to wait.
    pub fn failed(&mut self, what: &str, e: &std::io::Error) -> Duration {
        self.delay = (self.delay * 2).clamp(Duration::from_millis(10), Duration::from_secs(1));
        tracing::warn!(listener = what, error = %e, retry_ms = self.delay.as_millis() as u64, "accept failed; retrying");
        self.delay
    }
}

/// Accepts the next connection of `l`, waiting out accept errors.
pub async fn accept(
    l: &tokio::net::TcpListener,
    backoff: &mut Backoff,
    what: &str,
) -> (tokio::net::TcpStream, std::net::SocketAddr) {
    loop {
        match l.accept().await {
            Ok(x) => {
                backoff.reset();
                return x;
            }
            Err(e) => tokio::time::sleep(backoff.failed(what, &e)).await,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn admission_needs_both_budgets() {
        let vs = Budget::new(10);
        let node = Budget::new(3);
        let one = admit(&vs, &node, 2).unwrap();
        assert!(admit(&vs, &node, 2).is_none());
        // The vserver's slot taken for the refused one was given back.
        assert_eq!(vs.used(), 1);
        drop(one);
        assert_eq!((vs.used(), node.used()), (0, 0));
    }

    #[test]
    fn descriptors_keep_a_reserve() {
        assert_eq!(descriptor_budget(4096).limit(), 4096 - 512);
        assert_eq!(descriptor_budget(256).limit(), 128);
    }
}
