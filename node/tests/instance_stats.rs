//! What `GetStats` says of CPU and memory, against the kernel: a node with
//! `--stats instance` (the default) reports the machine's CPU over all its
//! cores as /proc/stat counts it over the same window, under real processes
//! burning N cores and over an interval with a spike then idle; with
//! `--stats process` it reports its own process, as /proc/PID says.
//!
//! The machine is shared (other tests, other builds), so nothing is compared
//! with a constant: this test reads /proc/stat itself every few milliseconds
//! and takes the window the node says it covered, ending when it answered.

mod common;

use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{api_client, start_serve, Client};
use lbscale_proto::{NodeStats, StatsRequest};

/// How far the node's figure may be from the kernel's, in percentage points.
const TOLERANCE: f64 = 5.0;

/// The machine's (busy, total) CPU ticks, all cores, from /proc/stat's `cpu` line.
fn machine_ticks() -> (f64, f64) {
    let stat = std::fs::read_to_string("/proc/stat").unwrap();
    let v: Vec<f64> = stat
        .lines()
        .next()
        .unwrap()
        .split_whitespace()
        .skip(1)
        .take(8)
        .map(|f| f.parse().unwrap())
        .collect();
    let idle = v[3] + v[4];
    let total: f64 = v.iter().sum();
    (total - idle, total)
}

fn machine_cores() -> usize {
    let stat = std::fs::read_to_string("/proc/stat").unwrap();
    stat.lines()
        .filter(|l| l.starts_with("cpu") && l.as_bytes().get(3).is_some_and(u8::is_ascii_digit))
        .count()
}

/// A process's (utime + stime) ticks, from /proc/PID/stat.
fn process_ticks(pid: u32) -> f64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let f: Vec<&str> = s[s.rfind(')').unwrap() + 1..].split_whitespace().collect();
    f[11].parse::<f64>().unwrap() + f[12].parse::<f64>().unwrap()
}

fn process_rss_kb(pid: u32) -> f64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = s.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

/// A (busy, total) reading and when it was taken.
type Timed = (Instant, (f64, f64));

/// Readings of a counter every 5 ms, with when they were taken, until dropped.
struct Recorder {
    readings: Arc<Mutex<Vec<Timed>>>,
    stop: Arc<AtomicBool>,
}

impl Recorder {
    fn start(read: impl Fn() -> (f64, f64) + Send + 'static) -> Recorder {
        let readings = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let (r, s) = (readings.clone(), stop.clone());
        std::thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                let v = read();
                r.lock().unwrap().push((Instant::now(), v));
                std::thread::sleep(Duration::from_millis(5));
            }
        });
        Recorder { readings, stop }
    }

    /// The reading nearest `at`.
    fn at(&self, at: Instant) -> (f64, f64) {
        let r = self.readings.lock().unwrap();
        r.iter()
            .min_by_key(|(t, _)| if *t > at { *t - at } else { at - *t })
            .map(|(_, v)| *v)
            .expect("readings")
    }
}

impl Drop for Recorder {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// The node's statistics over `window`, and the window as the test's clock
/// places it: ending when the node answered (the middle of the call), as long
/// as the node says it was.
async fn stats_over(cl: &mut Client, window: Duration) -> (NodeStats, Instant, Instant) {
    let sent = Instant::now();
    let st = tokio::time::timeout(
        Duration::from_secs(5),
        cl.get_stats(StatsRequest {
            window_ms: window.as_millis() as u64,
        }),
    )
    .await
    .expect("GetStats within 5 s")
    .expect("GetStats")
    .into_inner();
    let end = sent + (Instant::now() - sent) / 2;
    let start = end - Duration::from_millis(st.window_ms);
    (st, start, end)
}

/// The busy percent over [start, end] of (busy, total) readings.
fn percent(rec: &Recorder, start: Instant, end: Instant) -> f64 {
    let (b0, t0) = rec.at(start);
    let (b1, t1) = rec.at(end);
    (b1 - b0) / (t1 - t0) * 100.0
}

/// Real processes, each keeping one core busy, until dropped.
struct Burners(Vec<Child>);

impl Burners {
    fn start(n: usize) -> Burners {
        Burners(
            (0..n)
                .map(|_| {
                    Command::new("sh")
                        .args(["-c", "while :; do :; done"])
                        .stdin(Stdio::null())
                        .spawn()
                        .expect("spawn a CPU burner")
                })
                .collect(),
        )
    }
}

impl Drop for Burners {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn assert_near(what: &str, node: f64, kernel: f64, st: &NodeStats) {
    eprintln!(
        "{what}: node {node:.2} %, kernel {kernel:.2} %, {} ms",
        st.window_ms
    );
    assert!(
        (node - kernel).abs() <= TOLERANCE,
        "{what}: the node says {node:.1} %, the kernel {kernel:.1} % over the same {} ms",
        st.window_ms
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cpu_under_a_burn_on_n_cores_is_what_proc_stat_says() {
    let (_node, _dir) = start_serve("instance-burn", "127.95.1.1", &[]);
    let mut cl = api_client("127.95.1.1").await;
    let rec = Recorder::start(machine_ticks);
    let cores = machine_cores();
    let _ = stats_over(&mut cl, Duration::ZERO).await; // the connection is up
    for n in 1..=cores.min(2) {
        let burn = Burners::start(n);
        // Let the burners get going, then judge a window inside the burn.
        tokio::time::sleep(Duration::from_millis(1500)).await;
        tokio::time::sleep(Duration::from_secs(3)).await;
        let (st, start, end) = stats_over(&mut cl, Duration::from_secs(3)).await;
        drop(burn);
        assert_eq!(st.stats_source, "instance");
        let kernel = percent(&rec, start, end);
        // The burn is there: n runnable processes keep n cores busy at least.
        let floor = n as f64 / cores as f64 * 100.0 - TOLERANCE;
        assert!(
            kernel >= floor,
            "{n} burners, the kernel says {kernel:.1} % only"
        );
        assert!(
            (0.0..=100.0).contains(&st.cpu_percent),
            "{}",
            st.cpu_percent
        );
        assert_near(&format!("{n} core(s) burning"), st.cpu_percent, kernel, &st);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_interval_with_a_spike_then_idle_reports_its_mean() {
    let (_node, _dir) = start_serve("instance-spike", "127.95.2.1", &[]);
    let mut cl = api_client("127.95.2.1").await;
    let rec = Recorder::start(machine_ticks);
    let _ = stats_over(&mut cl, Duration::ZERO).await;
    tokio::time::sleep(Duration::from_millis(1200)).await;
    // A spike on every core in the first second of a five-second interval.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let burn = Burners::start(machine_cores());
    tokio::time::sleep(Duration::from_secs(1)).await;
    drop(burn);
    tokio::time::sleep(Duration::from_millis(3500)).await;
    let (whole, start, end) = stats_over(&mut cl, Duration::from_secs(5)).await;
    let kernel_whole = percent(&rec, start, end);
    assert_near(
        "the whole interval",
        whole.cpu_percent,
        kernel_whole,
        &whole,
    );
    // The same node asked for the last second says what that second was.
    let (last, start, end) = stats_over(&mut cl, Duration::from_secs(1)).await;
    assert_near(
        "the last second",
        last.cpu_percent,
        percent(&rec, start, end),
        &last,
    );
    // Memory: the machine's (or its cgroup's), a percent.
    assert!(
        whole.memory_percent > 0.0 && whole.memory_percent <= 100.0,
        "memory {}",
        whole.memory_percent
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_stats_process_the_node_reports_its_own_process() {
    let (node, _dir) = start_serve(
        "process-stats",
        "127.95.3.1",
        &["--stats", "process", "--memory-limit-mb", "64"],
    );
    let pid = node.child.id();
    let mut cl = api_client("127.95.3.1").await;
    let wall = Instant::now();
    // The node's CPU ticks against the wall clock's (in the kernel's ticks).
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    let rec = Recorder::start(move || (process_ticks(pid), wall.elapsed().as_secs_f64() * hz));
    let _ = stats_over(&mut cl, Duration::ZERO).await;
    // The machine busy, the node not: the node says its own CPU, not the machine's.
    let burn = Burners::start(machine_cores());
    tokio::time::sleep(Duration::from_secs(3)).await;
    let (st, start, end) = stats_over(&mut cl, Duration::from_secs(2)).await;
    drop(burn);
    assert_eq!(st.stats_source, "process");
    assert_near(
        "the node's process",
        st.cpu_percent,
        percent(&rec, start, end),
        &st,
    );
    let rss_percent = process_rss_kb(pid) / (64.0 * 1024.0) * 100.0;
    assert!(
        (st.memory_percent - rss_percent).abs() <= TOLERANCE,
        "memory: the node says {:.1} %, its VmRSS is {rss_percent:.1} % of 64 MiB",
        st.memory_percent
    );
}

#[test]
fn a_bad_stats_setting_is_refused_naming_it() {
    for (args, says) in [
        (
            &["--stats", "machine"][..],
            "--stats must be instance or process",
        ),
        (
            &["--stats", "process"][..],
            "--stats process needs --memory-limit-mb",
        ),
    ] {
        let dir = common::tmpdir("bad-stats");
        let token = dir.join("token");
        std::fs::write(&token, "t").unwrap();
        let out = Command::new(common::BIN)
            .args([
                "serve",
                "--node-id",
                "n",
                "--listen-ip",
                "127.95.4.1",
                "--api-port",
                "7070",
            ])
            .arg("--token-file")
            .arg(&token)
            .args(args)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains(says),
            "{args:?}: {err}"
        );
    }
}
