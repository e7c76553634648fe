//! The daemon's memory allocator: mimalloc, for every binary that links the
//! daemon (`lbscale`, the benchmark's `sim_fleet`).
//!
//! At thousands of groups the daemon opens six node connections per
//! evaluation, each with its TLS and HTTP/2 buffers; with glibc's malloc,
//! allocating and freeing them was about a quarter of the daemon's CPU
//! (perf, bench/daemon_scale.sh at 2,667 groups x 16 s), and its arenas had to
//! be capped at two to keep resident memory from growing. With mimalloc the
//! CPU per evaluation fell by about a quarter, for more resident memory
//! (docs/scaling.md has the figures).

#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// mimalloc's `purge_delay` option: how long freed memory is kept before it
/// is given back to the system, in milliseconds.
const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

/// Tunes the allocator for the daemon: freed memory goes back to the system
/// at once rather than after mimalloc's default second (2,667 groups: 309
/// instead of 400 MiB resident, for about 10 % more CPU per evaluation: 1.46
/// instead of 1.30 ms), unless the operator
/// set `MIMALLOC_PURGE_DELAY` (which mimalloc reads itself). Call it first,
/// before the runtime starts.
pub fn tune() {
    if std::env::var_os("MIMALLOC_PURGE_DELAY").is_none() {
        // SAFETY: sets one of the allocator's options, which mimalloc allows
        // at any time.
        unsafe { libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, 0) };
    }
}

#[cfg(test)]
mod tests {
    use super::MI_OPTION_PURGE_DELAY;
    use libmimalloc_sys::mi_option_get;

    /// The option's number is mimalloc's own (the bindings do not name it):
    /// its default, 1,000 ms (mimalloc 3's options.c), until `tune` sets it to 0.
    #[test]
    fn tune_sets_the_purge_delay_from_its_default_to_zero() {
        if std::env::var_os("MIMALLOC_PURGE_DELAY").is_some() {
            return;
        }
        // SAFETY: reads one of the allocator's options.
        assert_eq!(unsafe { mi_option_get(MI_OPTION_PURGE_DELAY) }, 1000);
        super::tune();
        // SAFETY: as above.
        assert_eq!(unsafe { mi_option_get(MI_OPTION_PURGE_DELAY) }, 0);
    }
}
