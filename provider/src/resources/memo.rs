//! What many resources of one plan read alike, read once.
//!
//! A refresh of N vservers on one SE group read, per vserver, its row and
//! then the same SE group, group, distributor, publication and driver record
//! to make its `vip` (six statements), and its plan read the SE group, group
//! and distributor again for the placement rules (three more): most of the
//! provider's time per vserver. Those shared reads are kept here for a
//! moment, so that each vserver costs its own row and nothing more. The
//! vserver's own row is always read: a refresh still sees every change made
//! outside Terraform to the vserver itself.
//!
//! An entry is used for at most [`FRESH_FOR`], and none survives a write by
//! this process (every create, update and delete calls [`wrote`]): an apply
//! reads back what it wrote. What another process changes in between (the
//! SE group's group or distributor, by another Terraform run) shows at most
//! that much later, as if the refresh had read it a moment earlier.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How long a shared read is used for: a plan's refresh of many resources
/// takes about this long, and the daemon never changes what is kept here.
pub const FRESH_FOR: Duration = Duration::from_secs(2);

/// Raised by every write this process makes through the engine.
static WRITES: AtomicU64 = AtomicU64::new(0);

/// Forgets every entry of every memo: this process changed the store.
pub fn wrote() {
    WRITES.fetch_add(1, Ordering::SeqCst);
}

/// Values by key, each read at most once per [`FRESH_FOR`] and per write.
pub struct Memo<K, V> {
    entries: Mutex<Option<HashMap<K, Entry<V>>>>,
}

struct Entry<V> {
    writes: u64,
    at: Instant,
    value: V,
}

impl<K: Eq + Hash, V: Clone> Memo<K, V> {
    pub const fn new() -> Self {
        Memo {
            entries: Mutex::new(None),
        }
    }

    /// The value kept for `key`, or `read()`'s (kept when it succeeds).
    pub fn get_or<E>(&self, key: K, read: impl FnOnce() -> Result<V, E>) -> Result<V, E> {
        self.get_or_at(key, Instant::now(), read)
    }

    fn get_or_at<E>(
        &self,
        key: K,
        now: Instant,
        read: impl FnOnce() -> Result<V, E>,
    ) -> Result<V, E> {
        // Taken before the read: a write that lands during it makes the
        // value stale at once.
        let writes = WRITES.load(Ordering::SeqCst);
        {
            let entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(e) = entries.as_ref().and_then(|m| m.get(&key)) {
                if e.writes == writes && now.saturating_duration_since(e.at) < FRESH_FOR {
                    return Ok(e.value.clone());
                }
            }
        }
        // Read without the lock: the store serialises its own calls, and a
        // slow read must not hold up the other keys.
        let value = read()?;
        let mut entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        let map = entries.get_or_insert_with(HashMap::new);
        map.retain(|_, e| e.writes == writes && now.saturating_duration_since(e.at) < FRESH_FOR);
        map.insert(
            key,
            Entry {
                writes,
                at: now,
                value: value.clone(),
            },
        );
        Ok(value)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counted(
        memo: &Memo<&'static str, u32>,
        key: &'static str,
        now: Instant,
        reads: &mut u32,
    ) -> u32 {
        memo.get_or_at(key, now, || -> Result<u32, ()> {
            *reads += 1;
            Ok(*reads)
        })
        .unwrap()
    }

    #[test]
    fn a_value_is_read_once_until_it_ages_or_the_process_writes_and_a_failure_is_not_kept() {
        let memo = Memo::new();
        let mut reads = 0;
        let t0 = Instant::now();
        assert_eq!(counted(&memo, "seg-1", t0, &mut reads), 1);
        assert_eq!(
            counted(&memo, "seg-1", t0 + Duration::from_millis(10), &mut reads),
            1
        );
        assert_eq!(
            counted(&memo, "seg-2", t0, &mut reads),
            2,
            "another key is read"
        );
        assert_eq!(
            counted(&memo, "seg-1", t0 + FRESH_FOR, &mut reads),
            3,
            "aged out"
        );
        wrote();
        assert_eq!(
            counted(&memo, "seg-1", t0 + FRESH_FOR, &mut reads),
            4,
            "a write forgets it"
        );

        // One test: `wrote` is process-wide, and a test beside this one
        // calling it would make the reads below happen again.
        let memo: Memo<&str, u32> = Memo::new();
        assert_eq!(memo.get_or("x", || Err::<u32, _>("down")), Err("down"));
        assert_eq!(memo.get_or("x", || Ok::<_, &str>(7)), Ok(7));
        assert_eq!(memo.get_or("x", || Err::<u32, _>("down")), Ok(7));
    }
}
