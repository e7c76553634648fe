//! The CPU and memory a node reports, read from the kernel's files: the
//! instance's (the whole machine's CPU, its memory or its container's memory
//! limit) or this process's (the local cloud, where many nodes share one
//! machine and the machine's figures would say nothing about one node).

use std::path::{Path, PathBuf};

/// Whose CPU and memory the node reports (`serve --stats`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    /// The machine: CPU over all its cores from /proc/stat (0-100), used memory
    /// over the total from /proc/meminfo, or over the cgroup's memory limit
    /// when one binds (a container).
    Instance,
    /// This process: its CPU time as a share of one core (above 100 on several
    /// cores), its resident set over `memory_limit_mb`.
    Process { memory_limit_mb: u64 },
}

impl Source {
    pub fn name(self) -> &'static str {
        match self {
            Source::Instance => "instance",
            Source::Process { .. } => "process",
        }
    }
}

/// The counters at one instant. CPU as busy and elapsed time in one unit
/// (a percent over a window is the busy delta over the elapsed delta); memory
/// as a percent now.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Reading {
    pub cpu_busy: f64,
    pub cpu_total: f64,
    pub memory_percent: f64,
}

/// Where the kernel's files are: `/` on a node, a tree of files in the kernel's
/// formats in tests.
#[derive(Clone, Debug)]
pub struct Kernel {
    root: PathBuf,
}

impl Default for Kernel {
    fn default() -> Self {
        Kernel::at("/")
    }
}

impl Kernel {
    pub fn at(root: impl Into<PathBuf>) -> Kernel {
        Kernel { root: root.into() }
    }

    fn read(&self, path: &str) -> Option<String> {
        std::fs::read_to_string(self.root.join(path.trim_start_matches('/'))).ok()
    }

    fn read_in(&self, dir: &Path, file: &str) -> Option<String> {
        std::fs::read_to_string(dir.join(file)).ok()
    }

    /// The counters of `source` now; `uptime_s` is a monotonic clock in
    /// seconds (a process's CPU time is measured against it). A file that
    /// cannot be read counts as zero.
    pub fn reading(&self, source: Source, uptime_s: f64) -> Reading {
        match source {
            Source::Instance => {
                let (cpu_busy, cpu_total) = self.machine_cpu().unwrap_or((0.0, 0.0));
                Reading {
                    cpu_busy,
                    cpu_total,
                    memory_percent: self.instance_memory_percent().unwrap_or(0.0),
                }
            }
            Source::Process { memory_limit_mb } => Reading {
                cpu_busy: self.process_cpu_seconds().unwrap_or(0.0),
                cpu_total: uptime_s,
                memory_percent: match self.process_rss_kb() {
                    Some(kb) if memory_limit_mb > 0 => {
                        kb as f64 / (memory_limit_mb as f64 * 1024.0) * 100.0
                    }
                    _ => 0.0,
                },
            },
        }
    }

    /// The machine's (busy, total) CPU time in clock ticks over all cores, from
    /// the `cpu` line of /proc/stat. Idle and iowait are not busy; guest time
    /// is already inside user and nice.
    pub fn machine_cpu(&self) -> Option<(f64, f64)> {
        let stat = self.read("/proc/stat")?;
        let line = stat.lines().find(|l| l.starts_with("cpu "))?;
        let v: Vec<f64> = line
            .split_whitespace()
            .skip(1)
            .take(8)
            .map(|f| f.parse().ok())
            .collect::<Option<_>>()?;
        // user nice system idle iowait irq softirq steal (older kernels stop
        // earlier: the missing ones are zero).
        let at = |i: usize| v.get(i).copied().unwrap_or(0.0);
        let idle = at(3) + at(4);
        let total: f64 = v.iter().sum();
        Some((total - idle, total))
    }

    /// Used memory as a percent: over the cgroup's limit when it is below the
    /// machine's memory (a container's), else over /proc/meminfo's total.
    fn instance_memory_percent(&self) -> Option<f64> {
        let meminfo = self.read("/proc/meminfo")?;
        let kb = |key: &str| -> Option<f64> {
            let line = meminfo.lines().find(|l| l.starts_with(key))?;
            line[key.len()..].split_whitespace().next()?.parse().ok()
        };
        let total = kb("MemTotal:")? * 1024.0;
        if let Some((used, limit)) = self.cgroup_memory() {
            if limit > 0.0 && limit < total {
                return Some((used / limit * 100.0).clamp(0.0, 100.0));
            }
        }
        let available = kb("MemAvailable:")? * 1024.0;
        (total > 0.0).then(|| ((total - available) / total * 100.0).clamp(0.0, 100.0))
    }

    /// This process's cgroup's (used bytes, limit bytes): cgroup v2's
    /// memory.current and memory.max, or v1's memory.usage_in_bytes and
    /// memory.limit_in_bytes; used leaves out the inactive page cache (what
    /// the kernel reclaims first), as container runtimes count it. `None`
    /// without a limit.
    fn cgroup_memory(&self) -> Option<(f64, f64)> {
        let cgroups = self.read("/proc/self/cgroup")?;
        for line in cgroups.lines() {
            let mut parts = line.splitn(3, ':');
            let (Some(_), Some(controllers), Some(path)) =
                (parts.next(), parts.next(), parts.next())
            else {
                continue;
            };
            let v2 = controllers.is_empty();
            if !v2 && !controllers.split(',').any(|c| c == "memory") {
                continue;
            }
            let mount = if v2 {
                "sys/fs/cgroup"
            } else {
                "sys/fs/cgroup/memory"
            };
            let (limit, usage, inactive) = if v2 {
                ("memory.max", "memory.current", "inactive_file")
            } else {
                (
                    "memory.limit_in_bytes",
                    "memory.usage_in_bytes",
                    "total_inactive_file",
                )
            };
            if v2 && !self.root.join(mount).join("cgroup.controllers").exists() {
                continue;
            }
            // Without a cgroup namespace the path is the host's while the mount
            // shows the container's own cgroup at its top.
            let base = self.root.join(mount);
            let dirs = [base.join(path.trim_start_matches('/')), base];
            let Some(dir) = dirs.iter().find(|d| d.join(limit).exists()) else {
                continue;
            };
            let num = |f: &str| -> Option<f64> { self.read_in(dir, f)?.trim().parse().ok() };
            // "max" (v2) does not parse: no limit.
            let limit = num(limit)?;
            let usage = num(usage)?;
            let inactive = self
                .read_in(dir, "memory.stat")
                .and_then(|s| {
                    s.lines().find_map(|l| {
                        l.strip_prefix(inactive)?
                            .strip_prefix(' ')?
                            .trim()
                            .parse()
                            .ok()
                    })
                })
                .unwrap_or(0.0);
            return Some(((usage - inactive).max(0.0), limit));
        }
        None
    }

    /// CPU time (user + system) of this process in seconds, from /proc/self/stat.
    pub fn process_cpu_seconds(&self) -> Option<f64> {
        let s = self.read("/proc/self/stat")?;
        // The command name is in parentheses and may contain spaces: fields after ')'.
        let rest = &s[s.rfind(')')? + 1..];
        let fields: Vec<&str> = rest.split_whitespace().collect();
        // After ')': field 3 (state) is index 0; utime is field 14 → index 11, stime 15 → 12.
        let utime: f64 = fields.get(11)?.parse().ok()?;
        let stime: f64 = fields.get(12)?.parse().ok()?;
        Some((utime + stime) / clock_ticks_per_second())
    }

    /// Resident set size in kB, from /proc/self/status (VmRSS).
    pub fn process_rss_kb(&self) -> Option<u64> {
        let s = self.read("/proc/self/status")?;
        s.lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
    }
}

fn clock_ticks_per_second() -> f64 {
    // SAFETY: sysconf has no preconditions.
    let tck = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if tck > 0 {
        tck as f64
    } else {
        100.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tree with the kernel's files, in their formats.
    fn tree(files: &[(&str, &str)]) -> (Kernel, PathBuf) {
        static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("lbscale-usage-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        for (path, content) in files {
            let p = dir.join(path.trim_start_matches('/'));
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, content).unwrap();
        }
        (Kernel::at(&dir), dir)
    }

    const MEMINFO: &str =
        "MemTotal:        8000000 kB\nMemFree:          1000000 kB\nMemAvailable:     6000000 kB\n";

    #[test]
    fn machine_cpu_counts_all_but_idle_and_iowait() {
        let (k, dir) = tree(&[(
            "/proc/stat",
            "cpu  100 5 30 800 40 2 3 20 7 0\ncpu0 50 2 15 400 20 1 1 10 3 0\nintr 1 2 3\n",
        )]);
        // busy: user nice system irq softirq steal = 100+5+30+2+3+20; total adds idle, iowait.
        assert_eq!(k.machine_cpu(), Some((160.0, 1000.0)));
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn instance_memory_is_used_over_total_without_a_binding_limit() {
        let (k, dir) = tree(&[
            ("/proc/meminfo", MEMINFO),
            (
                "/proc/self/cgroup",
                "0::/system.slice/lbscale-node.service\n",
            ),
            ("/sys/fs/cgroup/cgroup.controllers", "cpu memory\n"),
            (
                "/sys/fs/cgroup/system.slice/lbscale-node.service/memory.max",
                "max\n",
            ),
            (
                "/sys/fs/cgroup/system.slice/lbscale-node.service/memory.current",
                "123\n",
            ),
        ]);
        assert_eq!(k.instance_memory_percent(), Some(25.0));
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn instance_memory_is_over_a_cgroup_v2_limit_less_its_inactive_cache() {
        let (k, dir) = tree(&[
            ("/proc/meminfo", MEMINFO),
            ("/proc/self/cgroup", "0::/\n"),
            ("/sys/fs/cgroup/cgroup.controllers", "cpu memory\n"),
            ("/sys/fs/cgroup/memory.max", "1073741824\n"),
            ("/sys/fs/cgroup/memory.current", "536870912\n"),
            (
                "/sys/fs/cgroup/memory.stat",
                "anon 1\nfile 2\nactive_file 3\ninactive_file 268435456\n",
            ),
        ]);
        // (512 MiB - 256 MiB inactive) / 1 GiB.
        assert_eq!(k.instance_memory_percent(), Some(25.0));
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn instance_memory_finds_a_cgroup_v1_limit_at_the_mounts_top() {
        let (k, dir) = tree(&[
            ("/proc/meminfo", MEMINFO),
            (
                "/proc/self/cgroup",
                "5:cpu,cpuacct:/x\n4:memory:/docker/abc\n0::/\n",
            ),
            (
                "/sys/fs/cgroup/memory/memory.limit_in_bytes",
                "2048000000\n",
            ),
            (
                "/sys/fs/cgroup/memory/memory.usage_in_bytes",
                "1024000000\n",
            ),
            (
                "/sys/fs/cgroup/memory/memory.stat",
                "inactive_file 1\ntotal_inactive_file 512000000\n",
            ),
        ]);
        assert_eq!(k.instance_memory_percent(), Some(25.0));
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn process_readings_are_this_process() {
        let k = Kernel::default();
        // Spend a clock tick of CPU (10 s at most).
        let spin = std::time::Instant::now();
        while k.process_cpu_seconds() == Some(0.0) && spin.elapsed().as_secs() < 10 {
            std::hint::black_box((0..10_000u64).sum::<u64>());
        }
        let r = k.reading(
            Source::Process {
                memory_limit_mb: 100,
            },
            5.0,
        );
        assert_eq!(r.cpu_total, 5.0);
        assert!(r.cpu_busy > 0.0, "{r:?}");
        assert!(r.cpu_busy <= k.process_cpu_seconds().unwrap(), "{r:?}");
        let rss = k.process_rss_kb().unwrap() as f64;
        assert!(
            (r.memory_percent - rss / (100.0 * 1024.0) * 100.0).abs() < 0.5,
            "{r:?} rss {rss} kB"
        );
    }
}
