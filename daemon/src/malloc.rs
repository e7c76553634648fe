//! The daemon's memory allocator settings.
//!
//! glibc's malloc gives threads arenas of their own, up to eight per core, as
//! they contend; the daemon's runtime, blocking and store threads then grow
//! them each, and resident memory kept rising (bench/daemon_scale.sh, 2,667
//! groups: 194 to 241 MiB over ten intervals; 10,000 groups: 454 to 479 MiB
//! over three). With two arenas it stays flat (116-119 MiB, and 310 MiB for
//! 10,000 groups), for 5 to 12 % more CPU per evaluation. So the daemon caps
//! the arenas at two, unless the operator set `MALLOC_ARENA_MAX` (which glibc
//! reads itself).

/// Arenas the daemon's allocator may use.
const ARENAS: i32 = 2;

/// Caps glibc's malloc arenas at [`ARENAS`]; call it first, before any thread
/// starts. Elsewhere than glibc, nothing to do.
pub fn limit_arenas() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    if std::env::var_os("MALLOC_ARENA_MAX").is_none() {
        // SAFETY: mallopt only sets an allocator parameter; called before the
        // process starts threads of its own.
        unsafe {
            libc::mallopt(libc::M_ARENA_MAX, ARENAS);
        }
    }
}
