//! Process-wide counters of the data plane (one node per process).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::Instant;

/// Bytes relayed, both directions, since start.
pub static BYTES: AtomicU64 = AtomicU64::new(0);
/// Client connections (HTTP/TCP) and UDP flows currently open.
pub static ACTIVE_CONNS: AtomicU64 = AtomicU64::new(0);
/// Client connections and UDP flows accepted since start.
pub static TOTAL_CONNS: AtomicU64 = AtomicU64::new(0);

static START: OnceLock<Instant> = OnceLock::new();

pub fn start_instant() -> Instant {
    *START.get_or_init(Instant::now)
}

/// Nanoseconds since the process started (monotonic).
#[inline]
pub fn now_ns() -> u64 {
    start_instant().elapsed().as_nanos() as u64
}

#[inline]
pub fn add_bytes(n: usize) {
    if n > 0 {
        BYTES.fetch_add(n as u64, Ordering::Relaxed);
    }
}

/// Counts one client connection while alive.
pub struct ConnGuard;

impl ConnGuard {
    pub fn new() -> Self {
        ACTIVE_CONNS.fetch_add(1, Ordering::Relaxed);
        TOTAL_CONNS.fetch_add(1, Ordering::Relaxed);
        ConnGuard
    }
}

impl Drop for ConnGuard {
    fn drop(&mut self) {
        ACTIVE_CONNS.fetch_sub(1, Ordering::Relaxed);
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
