//! A process's file descriptors, as the node and the daemon count them: the
//! limit on open files (raised at start from its soft value to the hard one)
//! and [`Budget`], counted slots against a limit that a holder gives back by
//! dropping its [`Slot`]. The node budgets its data plane's descriptors and
//! each vserver's connections with it; the daemon, the node connections it
//! keeps between samples.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// The highest soft limit asked for: the kernel's default `fs.nr_open`. An
/// unlimited hard limit cannot be the soft one.
const MOST_OPEN_FILES: libc::rlim_t = 1 << 20;

/// What [`open_files_limit`] says when the limit cannot be read: the usual
/// default soft limit.
const UNREADABLE_LIMIT: usize = 1024;

fn rlimit() -> Option<libc::rlimit> {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes into the struct it is given.
    (unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) } == 0).then_some(r)
}

/// The process's soft limit on open files.
pub fn open_files_limit() -> usize {
    rlimit().map_or(UNREADABLE_LIMIT, |r| {
        usize::try_from(r.rlim_cur).unwrap_or(usize::MAX)
    })
}

/// Raises the soft limit on open files to the hard one (at most 2^20), and
/// returns the soft limit then: the default soft limit, often 1,024, is far
/// below what a node serves or a daemon keeps. Where the raise is refused,
/// the limit stays as it was.
pub fn raise_open_files_limit() -> usize {
    if let Some(r) = rlimit() {
        let want = r.rlim_max.min(MOST_OPEN_FILES);
        if want > r.rlim_cur {
            let raised = libc::rlimit {
                rlim_cur: want,
                rlim_max: r.rlim_max,
            };
            // SAFETY: setrlimit reads the struct it is given.
            unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) };
        }
    }
    open_files_limit()
}

/// Counted slots against a limit. A slot is given back when its [`Slot`] is
/// dropped.
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_budget_refuses_past_its_limit_and_frees_on_drop() {
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
        b.set_limit(0);
        assert!(b.take(1).is_none(), "a lowered limit refuses at once");
    }

    #[test]
    fn the_soft_limit_is_raised_to_the_hard_one() {
        let now = raise_open_files_limit();
        let r = rlimit().expect("the limit is readable");
        assert_eq!(r.rlim_cur, r.rlim_max.min(MOST_OPEN_FILES));
        assert_eq!(now, open_files_limit());
        assert_eq!(now as u64, r.rlim_cur);
    }
}
