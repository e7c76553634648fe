//! The data plane's time stamps: nanoseconds of the kernel's monotonic clock.
//!
//! Plain `u64`s so that they fit the atomics of the hot path (token buckets,
//! when a service came UP, rate estimators). Only differences mean anything; the
//! clock is the one `std::time::Instant` reads, so no process-wide origin is kept.

/// Now, in ns of the monotonic clock (since boot on Linux).
#[inline]
pub fn now_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; CLOCK_MONOTONIC always exists.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

#[cfg(test)]
mod tests {
    #[test]
    fn monotonic_and_in_nanoseconds() {
        let a = super::now_ns();
        std::thread::sleep(std::time::Duration::from_millis(5));
        let b = super::now_ns();
        assert!(b - a >= 5_000_000, "{a} → {b}");
        assert!(b - a < 5_000_000_000, "{a} → {b}");
    }
}
