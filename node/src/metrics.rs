//! The node's traffic counters and its process's CPU and memory.

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

/// CPU time (user + system) of this process in seconds, from /proc/self/stat.
pub fn process_cpu_seconds() -> Option<f64> {
    let s = std::fs::read_to_string("/proc/self/stat").ok()?;
    // The command name is in parentheses and may contain spaces: fields after ')'.
    let rest = &s[s.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // After ')': field 3 (state) is index 0; utime is field 14 → index 11, stime 15 → 12.
    let utime: f64 = fields.get(11)?.parse().ok()?;
    let stime: f64 = fields.get(12)?.parse().ok()?;
    // SAFETY: sysconf has no preconditions.
    let tck = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    let tck = if tck > 0 { tck as f64 } else { 100.0 };
    Some((utime + stime) / tck)
}

/// Resident set size in kB, from /proc/self/status (VmRSS).
pub fn process_rss_kb() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    for line in s.lines() {
        if let Some(v) = line.strip_prefix("VmRSS:") {
            return v.split_whitespace().next()?.parse().ok();
        }
    }
    None
}
