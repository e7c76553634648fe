//! What bounds a node's data plane: its file-descriptor budget, each vserver's
//! connection limit, the timeouts towards services and the size of a request's
//! head. A flood of connections or UDP sources then costs the node at most its
//! budget, and the management API always has descriptors left.

use std::sync::atomic::{AtomicUsize, Ordering};
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

/// The process's soft limit on open files.
pub fn open_files_limit() -> usize {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes into the struct it is given.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) } != 0 {
        return 1024;
    }
    usize::try_from(r.rlim_cur).unwrap_or(usize::MAX)
}

/// Raises the soft limit on open files to the hard limit (capped at 2^20): the
/// default soft limit (often 1,024) is far below what a node can serve.
pub fn raise_open_files_limit() {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit read and write the struct they are given.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) == 0 {
            let want = r.rlim_max.min(1 << 20);
            if want > r.rlim_cur {
                r.rlim_cur = want;
                libc::setrlimit(libc::RLIMIT_NOFILE, &r);
            }
        }
    }
}

/// Counted slots against a limit (the node's descriptors, a vserver's
/// connections). A slot is given back when its [`Slot`] is dropped.
pub struct Budget {
    limit: AtomicUsize,
    used: AtomicUsize,
}

impl Budget {
    pub fn new(limit: usize) -> Arc<Budget> {
        Arc::new(Budget {
            limit: AtomicUsize::new(limit),
            used: AtomicUsize::new(0),
        })
    }

    /// The data plane's share of the process's descriptors: all but an eighth
    /// (at least [`MIN_RESERVE`]) kept for the rest of the process.
    pub fn for_descriptors(nofile: usize) -> Arc<Budget> {
        let reserve = (nofile / 8).max(MIN_RESERVE);
        Budget::new(nofile.saturating_sub(reserve).max(1))
    }

    pub fn set_limit(&self, limit: usize) {
        self.limit.store(limit, Ordering::Relaxed);
    }

    pub fn limit(&self) -> usize {
        self.limit.load(Ordering::Relaxed)
    }

    pub fn used(&self) -> usize {
        self.used.load(Ordering::Relaxed)
    }

    /// Takes `n` slots, or none when that would pass the limit.
    pub fn take(self: &Arc<Self>, n: usize) -> Option<Slot> {
        let limit = self.limit();
        self.used
            .fetch_update(Ordering::AcqRel, Ordering::Relaxed, |u| {
                (u + n <= limit).then_some(u + n)
            })
            .ok()?;
        Some(Slot {
            budget: self.clone(),
            n,
        })
    }
}

/// Slots taken from a [`Budget`], given back on drop.
pub struct Slot {
    budget: Arc<Budget>,
    n: usize,
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.budget.used.fetch_sub(self.n, Ordering::AcqRel);
    }
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
    fn budget_refuses_past_its_limit_and_frees_on_drop() {
        let b = Budget::new(3);
        let a = b.take(2).unwrap();
        assert!(b.take(2).is_none());
        let c = b.take(1).unwrap();
        assert_eq!(b.used(), 3);
        drop(a);
        assert_eq!(b.used(), 1);
        assert!(b.take(2).is_some());
        drop(c);
        assert_eq!(b.used(), 0);
    }

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
        assert_eq!(Budget::for_descriptors(4096).limit(), 4096 - 512);
        assert_eq!(Budget::for_descriptors(256).limit(), 128);
    }
}
