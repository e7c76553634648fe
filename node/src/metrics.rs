//! The node's traffic counters (its CPU and memory are in `usage`).

use std::sync::atomic::{AtomicU64, Ordering};

/// Counters of one node's data plane, shared by its vservers' connections.
#[derive(Default)]
pub struct Traffic {
    /// Bytes relayed, both directions, since start.
    bytes: AtomicU64,
    /// Client connections (HTTP/TCP) and UDP flows currently open.
    active: AtomicU64,
    /// Client connections and UDP flows accepted since start.
    total: AtomicU64,
}

impl Traffic {
    #[inline]
    pub fn add_bytes(&self, n: usize) {
        if n > 0 {
            self.bytes.fetch_add(n as u64, Ordering::Relaxed);
        }
    }

    pub fn bytes(&self) -> u64 {
        self.bytes.load(Ordering::Relaxed)
    }

    pub fn active_connections(&self) -> u64 {
        self.active.load(Ordering::Relaxed)
    }

    pub fn total_connections(&self) -> u64 {
        self.total.load(Ordering::Relaxed)
    }

    /// Counts one client connection (or UDP flow) while the guard lives.
    pub fn connection(&self) -> ConnGuard<'_> {
        self.active.fetch_add(1, Ordering::Relaxed);
        self.total.fetch_add(1, Ordering::Relaxed);
        ConnGuard(self)
    }
}

/// One open client connection (see [`Traffic::connection`]).
pub struct ConnGuard<'a>(&'a Traffic);

impl Drop for ConnGuard<'_> {
    fn drop(&mut self) {
        self.0.active.fetch_sub(1, Ordering::Relaxed);
    }
}
