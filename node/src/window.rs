//! The node's CPU, memory and throughput as their means over a window that
//! the caller names (the group's stats interval), so that a one-minute
//! interval is judged by the whole minute and not by its last second.
//!
//! Every second the node keeps a snapshot of cumulative counters: CPU busy and
//! elapsed time, bytes relayed, and the integral of the memory percent over
//! time. The mean over a window is the difference between the snapshot taken
//! when the statistics are asked for and the kept one nearest the window's
//! start, over the time between them: exact for CPU and bytes (the kernel's
//! and the node's counters), and the trapezoid rule over one-second steps for
//! memory. An hour of snapshots is kept.

use std::collections::VecDeque;

use crate::usage::Reading;

/// How far back snapshots are kept.
pub const KEPT_NS: u64 = 3_600 * 1_000_000_000;
/// A window of zero means the last second.
pub const DEFAULT_WINDOW_NS: u64 = 1_000_000_000;

/// Cumulative counters at one instant.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Snapshot {
    /// Monotonic clock, ns.
    pub t_ns: u64,
    pub cpu_busy: f64,
    pub cpu_total: f64,
    /// Memory percent now, and its integral (percent × seconds) since the
    /// first snapshot.
    pub memory_percent: f64,
    pub memory_integral: f64,
    /// Bytes relayed since the node started.
    pub bytes: u64,
}

/// The means over a window (see the module docs).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Means {
    pub cpu_percent: f64,
    pub memory_percent: f64,
    pub throughput_mbps: f64,
    /// The window these cover, ending at the snapshot they were taken at.
    pub window_ms: u64,
}

/// The snapshots of the last hour, oldest first, about one second apart.
#[derive(Default)]
pub struct Window {
    kept: VecDeque<Snapshot>,
}

impl Window {
    /// The snapshot at `t_ns` of `reading` and `bytes`, continuing the memory
    /// integral of the newest kept one.
    pub fn snapshot(&self, t_ns: u64, reading: Reading, bytes: u64) -> Snapshot {
        let memory_integral = match self.kept.back() {
            Some(last) if t_ns > last.t_ns => {
                let dt = (t_ns - last.t_ns) as f64 / 1e9;
                last.memory_integral + (last.memory_percent + reading.memory_percent) / 2.0 * dt
            }
            Some(last) => last.memory_integral,
            None => 0.0,
        };
        Snapshot {
            t_ns,
            cpu_busy: reading.cpu_busy,
            cpu_total: reading.cpu_total,
            memory_percent: reading.memory_percent,
            memory_integral,
            bytes,
        }
    }

    /// Keeps `s` (a snapshot of [`Window::snapshot`]) and forgets the ones
    /// older than [`KEPT_NS`] before it.
    pub fn keep(&mut self, s: Snapshot) {
        if self.kept.back().is_some_and(|last| s.t_ns <= last.t_ns) {
            return;
        }
        self.kept.push_back(s);
        while self.kept.front().is_some_and(|f| s.t_ns - f.t_ns > KEPT_NS) {
            self.kept.pop_front();
        }
    }

    /// The means over the `window_ns` before `now` (0: the last second): from
    /// the kept snapshot nearest `now - window_ns`, to `now`. With no kept
    /// snapshot before `now`, CPU and throughput are 0 and memory is `now`'s.
    pub fn means(&self, now: &Snapshot, window_ns: u64) -> Means {
        let window_ns = if window_ns == 0 {
            DEFAULT_WINDOW_NS
        } else {
            window_ns
        };
        let start_at = now.t_ns.saturating_sub(window_ns);
        let start = self
            .kept
            .iter()
            .filter(|s| s.t_ns < now.t_ns)
            .min_by_key(|s| s.t_ns.abs_diff(start_at));
        let Some(start) = start else {
            return Means {
                memory_percent: now.memory_percent,
                ..Means::default()
            };
        };
        let seconds = (now.t_ns - start.t_ns) as f64 / 1e9;
        let cpu_total = now.cpu_total - start.cpu_total;
        Means {
            cpu_percent: if cpu_total > 0.0 {
                ((now.cpu_busy - start.cpu_busy) / cpu_total * 100.0).max(0.0)
            } else {
                0.0
            },
            memory_percent: (now.memory_integral - start.memory_integral) / seconds,
            throughput_mbps: now.bytes.saturating_sub(start.bytes) as f64 * 8.0 / 1e6 / seconds,
            window_ms: (now.t_ns - start.t_ns) / 1_000_000,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: u64 = 1_000_000_000;

    /// A node's second-by-second life on a 2-core machine (ticks of 100 per
    /// core-second): `busy[i]` cores busy in second i, memory `mem[i]` at its
    /// end, `mbit[i]` megabits relayed in it. Returns the window after the
    /// last second, and that last snapshot (as the caller would take it).
    fn life(busy: &[f64], mem: &[f64], mbit: &[u64]) -> (Window, Snapshot) {
        let mut w = Window::default();
        let mut r = Reading {
            cpu_busy: 0.0,
            cpu_total: 0.0,
            memory_percent: mem[0],
        };
        let mut bytes = 0;
        let first = w.snapshot(0, r, 0);
        w.keep(first);
        let mut last = first;
        for i in 0..busy.len() {
            r.cpu_busy += busy[i] * 100.0;
            r.cpu_total += 200.0;
            r.memory_percent = mem[i];
            bytes += mbit[i] * 1_000_000 / 8;
            last = w.snapshot((i as u64 + 1) * S, r, bytes);
            if i + 1 < busy.len() {
                w.keep(last);
            }
        }
        (w, last)
    }

    #[test]
    fn a_spike_in_the_first_second_then_idle_is_judged_by_its_mean() {
        // Both cores busy in the first second of a minute, idle for the rest.
        let mut busy = vec![0.0; 60];
        busy[0] = 2.0;
        let mut mbit = vec![0; 60];
        mbit[0] = 600;
        let (w, now) = life(&busy, &[10.0; 60], &mbit);
        let m = w.means(&now, 60 * S);
        assert_eq!(m.window_ms, 60_000);
        // 200 of 12000 ticks busy.
        assert!((m.cpu_percent - 100.0 / 60.0).abs() < 1e-9, "{m:?}");
        assert!((m.throughput_mbps - 10.0).abs() < 1e-9, "{m:?}");
        assert!((m.memory_percent - 10.0).abs() < 1e-9, "{m:?}");
        // The last second alone was idle.
        let last = w.means(&now, 0);
        assert_eq!(
            (last.cpu_percent, last.throughput_mbps, last.window_ms),
            (0.0, 0.0, 1000)
        );
    }

    #[test]
    fn cpu_is_over_all_cores_and_memory_is_the_time_weighted_mean() {
        // One of two cores busy for ten seconds; memory climbing 0 → 50 over
        // the first five seconds, then flat.
        let mem: Vec<f64> = (1..=10).map(|i| (i as f64 * 10.0).min(50.0)).collect();
        let mut w = Window::default();
        let (w2, now) = life(&[1.0; 10], &mem, &[0; 10]);
        let m = w2.means(&now, 10 * S);
        assert!((m.cpu_percent - 50.0).abs() < 1e-9, "{m:?}");
        // Memory starts at mem[0] = 10 at t=0 (first reading), then trapezoids:
        // (10+10)/2 + (10+20)/2 + (20+30)/2 + (30+40)/2 + (40+50)/2 + 5 × 50, over 10 s.
        let integral = 10.0 + 15.0 + 25.0 + 35.0 + 45.0 + 250.0;
        assert!((m.memory_percent - integral / 10.0).abs() < 1e-9, "{m:?}");
        // An empty window: memory now, nothing else.
        let alone = w.snapshot(
            5,
            Reading {
                memory_percent: 7.0,
                ..Reading::default()
            },
            0,
        );
        assert_eq!(
            w.means(&alone, S),
            Means {
                memory_percent: 7.0,
                ..Means::default()
            }
        );
        w.keep(alone);
    }

    #[test]
    fn the_start_is_the_kept_snapshot_nearest_the_window_and_the_window_says_so() {
        let (w, now) = life(&[1.0; 30], &[0.0; 30], &[0; 30]);
        // 10.4 s ago: the snapshot 10 s before; 10.6 s: 11 s before.
        assert_eq!(w.means(&now, 10_400_000_000).window_ms, 10_000);
        assert_eq!(w.means(&now, 10_600_000_000).window_ms, 11_000);
        // Longer than the node has lived: all it has.
        assert_eq!(w.means(&now, 600 * S).window_ms, 30_000);
    }

    #[test]
    fn an_hour_is_kept() {
        let mut w = Window::default();
        for i in 0..4_000u64 {
            let s = w.snapshot(i * S, Reading::default(), 0);
            w.keep(s);
        }
        let now = w.snapshot(4_000 * S, Reading::default(), 0);
        assert_eq!(w.kept.len(), 3_601);
        assert_eq!(w.means(&now, 7_200 * S).window_ms, 3_601_000);
        // A snapshot not after the newest is not kept.
        w.keep(Snapshot {
            t_ns: 10,
            ..Snapshot::default()
        });
        assert_eq!(w.kept.len(), 3_601);
    }
}
