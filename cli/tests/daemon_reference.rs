//! docs/daemon.md against the daemon itself: its flags and variables against
//! `lbscale daemon --help`, its metrics, HTTP statuses and exit codes against a
//! running daemon on a throwaway SQLite store, and the systemd unit of
//! examples/systemd against `systemd-analyze`.

use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_lbscale");

fn repo(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(path)
}

fn read(path: &str) -> String {
    std::fs::read_to_string(repo(path)).unwrap_or_else(|e| panic!("{path}: {e}"))
}

fn doc() -> String {
    read("docs/daemon.md")
}

/// The rows (cells, trimmed) of the first table under `## heading`, without its
/// header and separator rows.
fn table(doc: &str, heading: &str) -> Vec<Vec<String>> {
    let start = doc
        .lines()
        .position(|l| l.trim_end() == format!("## {heading}"))
        .unwrap_or_else(|| panic!("docs/daemon.md has no section \"## {heading}\""));
    let rows: Vec<Vec<String>> = doc
        .lines()
        .skip(start + 1)
        .take_while(|l| !l.starts_with("## "))
        .skip_while(|l| !l.starts_with('|'))
        .take_while(|l| l.starts_with('|'))
        .filter(|l| !l.starts_with("|---"))
        .map(|l| {
            l.trim()
                .trim_matches('|')
                .split(" | ")
                .map(|c| c.trim().to_string())
                .collect()
        })
        .collect();
    assert!(rows.len() > 1, "\"## {heading}\" has no table rows");
    rows[1..].to_vec()
}

/// The `code` spans of a table cell.
fn code_spans(cell: &str) -> Vec<String> {
    cell.split('`')
        .skip(1)
        .step_by(2)
        .map(str::to_string)
        .collect()
}

fn lbscale(args: &[&str]) -> Output {
    Command::new(BIN)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("run lbscale")
}

fn help() -> String {
    let out = lbscale(&["daemon", "--help"]);
    assert!(
        out.status.success(),
        "lbscale daemon --help: {:?}, stderr {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// The entries of a section of the help text: the lines two spaces in after the
/// line that starts with `title`, up to the next blank line.
fn help_entries(help: &str, title: &str) -> Vec<String> {
    let start = help
        .lines()
        .position(|l| l.starts_with(title))
        .unwrap_or_else(|| panic!("lbscale daemon --help has no \"{title}\" section:\n{help}"));
    help.lines()
        .skip(start + 1)
        .take_while(|l| !l.trim().is_empty())
        .filter(|l| l.starts_with("  ") && !l.starts_with("   "))
        .map(|l| l.trim().to_string())
        .collect()
}

/// `--state URL  the store` -> `--state`; `--help, -h  print` -> both.
fn help_flags(help: &str) -> BTreeSet<String> {
    help_entries(help, "flags")
        .iter()
        .flat_map(|e| {
            e.split_whitespace()
                .take_while(|w| w.starts_with('-'))
                .map(|w| w.trim_end_matches(',').to_string())
                .collect::<Vec<_>>()
        })
        .collect()
}

fn help_variables(help: &str) -> BTreeSet<String> {
    help_entries(help, "environment")
        .iter()
        .map(|e| e.split_whitespace().next().unwrap_or("").to_string())
        .collect()
}

/// Both directions, naming what is missing where.
fn assert_same(what: &str, in_help: &BTreeSet<String>, in_doc: &BTreeSet<String>, help_name: &str) {
    let undocumented: Vec<_> = in_help.difference(in_doc).collect();
    let only_in_doc: Vec<_> = in_doc.difference(in_help).collect();
    assert!(
        undocumented.is_empty() && only_in_doc.is_empty(),
        "{what}: in {help_name} but not in docs/daemon.md: {undocumented:?}; in docs/daemon.md but not in {help_name}: {only_in_doc:?}"
    );
}

#[test]
fn help_and_reference_list_the_same_flags() {
    let help = help();
    let in_help = help_flags(&help);
    assert!(in_help.contains("--state"), "parsed no flags from:\n{help}");
    let in_doc: BTreeSet<String> = table(&doc(), "Flags")
        .iter()
        .flat_map(|row| code_spans(&row[0]))
        .filter(|f| f.starts_with('-'))
        .collect();
    assert_same("flags", &in_help, &in_doc, "lbscale daemon --help");

    // The flags the daemon accepts are the ones its help lists: each is taken
    // (--help and -h print the help, any other is refused by name).
    let bogus = lbscale(&["daemon", "--no-such-flag", "1"]);
    assert_eq!(bogus.status.code(), Some(2));
    let err = String::from_utf8_lossy(&bogus.stderr);
    for flag in in_help.iter().filter(|f| f.starts_with("--")) {
        assert!(
            err.contains(flag.as_str()),
            "the unknown-flag error does not list {flag}: {err}"
        );
    }
}

#[test]
fn help_and_reference_list_the_same_variables() {
    let help = help();
    let in_help = help_variables(&help);
    assert!(
        in_help.contains("LBSCALE_STATE"),
        "parsed no variables from:\n{help}"
    );
    let in_doc: BTreeSet<String> = table(&doc(), "Environment")
        .iter()
        .flat_map(|row| code_spans(&row[0]))
        .collect();
    assert_same(
        "environment variables",
        &in_help,
        &in_doc,
        "lbscale daemon --help",
    );

    // The example environment file sets only documented variables.
    for line in read("examples/systemd/daemon.env").lines() {
        let line = line.trim_start_matches('#').trim();
        let Some((name, _)) = line.split_once('=') else {
            continue;
        };
        if name.chars().all(|c| c.is_ascii_uppercase() || c == '_') && !name.is_empty() {
            assert!(
                in_doc.contains(name),
                "examples/systemd/daemon.env sets {name}, which docs/daemon.md does not document"
            );
        }
    }
}

#[test]
fn help_lists_every_variable_the_azure_driver_reads() {
    // The daemon builds its azure driver from the environment alone, so a
    // variable the driver reads and the help omits is a setting nobody can find.
    let in_help = help_variables(&help());
    let read: Vec<&str> = lbscale_cloud_azure::ENV_VARIABLES
        .iter()
        .chain(lbscale_cloud_azure::credentials::VARIABLES)
        .copied()
        .collect();
    assert!(read.len() >= 19, "the azure driver reads only {read:?}?");
    let missing: Vec<&&str> = read.iter().filter(|v| !in_help.contains(**v)).collect();
    assert!(
        missing.is_empty(),
        "the azure driver reads {missing:?}, which lbscale daemon --help does not list"
    );
}

// --- a running daemon ---------------------------------------------------------

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// One HTTP/1.1 request; the status and the body.
fn http(port: u16, method: &str, path: &str) -> std::io::Result<(u16, String)> {
    let addr: SocketAddr = ([127, 0, 0, 1], port).into();
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2))?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    s.set_write_timeout(Some(Duration::from_secs(10)))?;
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-length: 0\r\n\r\n"
    )?;
    let mut text = String::new();
    s.read_to_string(&mut text)?;
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("no status line in {text:?}")))?;
    let body = text.split_once("\r\n\r\n").map(|(_, b)| b).unwrap_or("");
    Ok((status, body.to_string()))
}

struct Daemon {
    child: Child,
    port: u16,
    dir: PathBuf,
}

impl Daemon {
    /// Starts `lbscale daemon` on a new SQLite store and waits (at most 20 s)
    /// for its /healthz.
    fn start(tag: &str) -> Daemon {
        let dir = std::env::temp_dir().join(format!(
            "lbscale-daemon-reference-{tag}-{}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let port = free_port();
        let child = Command::new(BIN)
            .args(["daemon", "--state", "sqlite://state.db", "--listen"])
            .arg(format!("127.0.0.1:{port}"))
            .current_dir(&dir)
            .env_remove("LBSCALE_STATE")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.join("daemon.log")).unwrap())
            .spawn()
            .expect("start lbscale daemon");
        let mut d = Daemon { child, port, dir };
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Ok((200, _)) = http(port, "GET", "/healthz") {
                return d;
            }
            if let Ok(Some(status)) = d.child.try_wait() {
                panic!(
                    "the daemon exited with {status} before answering /healthz:\n{}",
                    d.log()
                );
            }
            assert!(
                Instant::now() < deadline,
                "the daemon did not answer /healthz on 127.0.0.1:{port} within 20 s:\n{}",
                d.log()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("daemon.log")).unwrap_or_default()
    }

    /// Sends `signal` and returns the exit status (at most 15 s).
    fn stop(&mut self, signal: &str) -> std::process::ExitStatus {
        let sent = Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(self.child.id().to_string())
            .status()
            .expect("run kill");
        assert!(sent.success(), "kill -{signal} failed");
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "the daemon did not exit within 15 s of SIG{signal}:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[test]
fn every_metric_the_daemon_exposes_is_documented_with_its_type() {
    let mut d = Daemon::start("metrics");
    let (status, text) = http(d.port, "GET", "/metrics").unwrap();
    assert_eq!(status, 200, "{text}");
    let exposed: BTreeSet<(String, String)> = text
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .map(|l| {
            let mut w = l.split_whitespace();
            (
                w.next().unwrap().to_string(),
                w.next().unwrap_or("").to_string(),
            )
        })
        .collect();
    assert!(!exposed.is_empty(), "no # TYPE line in /metrics:\n{text}");
    // Every sample belongs to a family with a TYPE line (a summary's _sum and
    // _count, a histogram's _bucket too, to their family).
    for l in text
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
    {
        let name = l.split(['{', ' ']).next().unwrap();
        let family = name
            .strip_suffix("_sum")
            .or_else(|| name.strip_suffix("_count"))
            .filter(|f| {
                exposed
                    .iter()
                    .any(|(n, t)| n == f && (t == "summary" || t == "histogram"))
            })
            .or_else(|| {
                name.strip_suffix("_bucket")
                    .filter(|f| exposed.iter().any(|(n, t)| n == f && t == "histogram"))
            })
            .unwrap_or(name);
        assert!(
            exposed.iter().any(|(n, _)| n == family),
            "sample {name} has no # TYPE line"
        );
    }
    let documented: BTreeSet<(String, String)> = table(&doc(), "Metrics")
        .iter()
        .map(|row| {
            let names = code_spans(&row[0]);
            assert_eq!(names.len(), 1, "a metrics row names one metric: {row:?}");
            (names[0].clone(), row[1].clone())
        })
        .collect();
    let names = |s: &BTreeSet<(String, String)>| -> BTreeSet<String> {
        s.iter().map(|(n, t)| format!("{n} ({t})")).collect()
    };
    assert_same("metrics", &names(&exposed), &names(&documented), "/metrics");
    assert_eq!(d.stop("TERM").code(), Some(0), "{}", d.log());
}

#[test]
fn the_documented_statuses_and_exit_codes_are_the_daemons() {
    let mut d = Daemon::start("http");
    // Every row of the HTTP table that names one concrete request.
    let mut checked = 0;
    for row in table(&doc(), "HTTP API") {
        let spans = code_spans(&row[0]);
        let Some((method, path)) = spans.first().and_then(|s| s.split_once(' ')) else {
            continue;
        };
        if spans.len() != 1 || row[0] != format!("`{method} {path}`") {
            continue;
        }
        let want: u16 = row[1]
            .parse()
            .unwrap_or_else(|_| panic!("status of {row:?}"));
        let (got, body) = http(d.port, method, path).unwrap();
        assert_eq!(
            got, want,
            "{method} {path}: docs/daemon.md says {want}, got {got}: {body}"
        );
        checked += 1;
    }
    assert!(
        checked >= 6,
        "only {checked} concrete requests in the HTTP table"
    );
    let (status, _) = http(d.port, "POST", "/v1/groups").unwrap();
    assert_eq!(status, 405);
    let (status, body) = http(d.port, "GET", "/nowhere").unwrap();
    assert_eq!((status, body.as_str()), (404, "not found\n"));

    // 1: the listener's address is taken (by the daemon above).
    let busy = Command::new(BIN)
        .args(["daemon", "--state", "sqlite://state.db", "--listen"])
        .arg(format!("127.0.0.1:{}", d.port))
        .current_dir(&d.dir)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&busy.stderr);
    assert_eq!(busy.status.code(), Some(1), "{err}");
    assert!(err.contains("error: --listen: cannot listen on"), "{err}");
    // 2: a bad command line; no store at all.
    assert_eq!(
        lbscale(&["daemon", "--log-format", "yaml"]).status.code(),
        Some(2)
    );
    let none = Command::new(BIN)
        .arg("daemon")
        .env_remove("LBSCALE_STATE")
        .output()
        .unwrap();
    assert_eq!(none.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&none.stderr).contains("got neither"));

    // 0 on SIGTERM, and on SIGINT.
    assert_eq!(d.stop("TERM").code(), Some(0), "{}", d.log());
    assert!(d.log().contains("lbscale daemon stopped"), "{}", d.log());
    let mut d = Daemon::start("sigint");
    assert_eq!(d.stop("INT").code(), Some(0), "{}", d.log());
}

// --- the systemd unit -----------------------------------------------------------

const UNIT: &str = "examples/systemd/lbscale-daemon.service";
const INSTALLED_BINARY: &str = "/usr/local/bin/lbscale";

/// A systemd tool; never skipped: CI's machines get it from scripts/setup.sh.
fn systemd_tool(name: &str) -> PathBuf {
    ["/usr/bin", "/bin"]
        .iter()
        .map(|d| Path::new(d).join(name))
        .find(|p| p.is_file())
        .unwrap_or_else(|| {
            panic!("{name} is missing: install Debian's systemd package (scripts/setup.sh does: apt-get install systemd)")
        })
}

fn unit_values<'a>(unit: &'a str, key: &str) -> Vec<&'a str> {
    unit.lines()
        .filter_map(|l| l.strip_prefix(key)?.strip_prefix('='))
        .collect()
}

/// The unit with ExecStart pointed at the binary under test: `verify` checks
/// that the command exists and is executable, which /usr/local/bin/lbscale
/// is not on a build machine.
fn unit_for_verify(dir: &Path) -> PathBuf {
    let unit = read(UNIT);
    let exec = unit_values(&unit, "ExecStart");
    assert_eq!(exec.len(), 1, "one ExecStart in {UNIT}");
    assert!(
        exec[0].starts_with(&format!("{INSTALLED_BINARY} daemon ")),
        "{UNIT}: ExecStart must run {INSTALLED_BINARY} daemon, got {:?}",
        exec[0]
    );
    let path = dir.join("lbscale-daemon.service");
    std::fs::write(
        &path,
        unit.replace(
            &format!("ExecStart={INSTALLED_BINARY} "),
            &format!("ExecStart={BIN} "),
        ),
    )
    .unwrap();
    path
}

fn temp_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("lbscale-unit-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn the_systemd_unit_passes_systemd_analyze_verify() {
    let analyze = systemd_tool("systemd-analyze");
    let dir = temp_dir("verify");
    let path = unit_for_verify(&dir);
    let out = Command::new(&analyze)
        .args(["verify", "--man=no"])
        .arg(&path)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    // verify exits 0 on an unknown key or a value it cannot parse, and only
    // warns: any line about the unit is a failure.
    let about_unit: Vec<&str> = err
        .lines()
        .filter(|l| l.contains("lbscale-daemon.service"))
        .collect();
    assert!(
        out.status.success() && about_unit.is_empty(),
        "systemd-analyze verify {UNIT}: {:?}\n{err}",
        out.status
    );

    // The sandbox, as systemd rates it: exposure at most 2.0 of 10.
    let out = Command::new(&analyze)
        .args(["security", "--offline=true", "--threshold=20", "--no-pager"])
        .arg(&path)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let overall = text
        .lines()
        .find(|l| l.contains("Overall exposure level"))
        .unwrap_or("");
    assert!(
        out.status.success(),
        "systemd-analyze security rates {UNIT} above 2.0: {overall}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_systemd_unit_runs_the_daemon_as_documented() {
    let unit = read(UNIT);
    for (key, want) in [
        ("User", "lbscale"),
        ("EnvironmentFile", "/etc/lbscale/daemon.env"),
        ("Restart", "on-failure"),
        ("RestartPreventExitStatus", "2"),
        ("KillSignal", "SIGTERM"),
        ("NoNewPrivileges", "yes"),
        ("ProtectSystem", "strict"),
    ] {
        assert_eq!(unit_values(&unit, key), [want], "{UNIT}: {key}");
    }
    // The store comes from the environment file, never the command line.
    let exec = unit_values(&unit, "ExecStart")[0];
    assert!(
        !exec.contains("--state"),
        "{UNIT}: --state on the command line: {exec}"
    );
    // Every flag it passes is one the daemon takes, and the grace fits in the
    // stop timeout.
    let flags = help_flags(&help());
    for w in exec.split_whitespace().filter(|w| w.starts_with("--")) {
        let flag = w.split('=').next().unwrap();
        assert!(
            flags.contains(flag),
            "{UNIT}: ExecStart passes {flag}, which lbscale daemon does not take"
        );
    }
    let secs = |v: &str| v.trim_end_matches('s').parse::<u64>().unwrap();
    let grace = exec
        .split_whitespace()
        .skip_while(|w| *w != "--shutdown-grace")
        .nth(1)
        .unwrap();
    let stop = unit_values(&unit, "TimeoutStopSec")[0];
    assert!(
        secs(stop) > secs(grace),
        "TimeoutStopSec {stop} must exceed --shutdown-grace {grace}"
    );

    // Its user, as examples/systemd/lbscale.sysusers declares it, made by
    // systemd-sysusers in a scratch root.
    let root = temp_dir("sysusers");
    std::fs::create_dir_all(root.join("etc")).unwrap();
    let out = Command::new(systemd_tool("systemd-sysusers"))
        .arg(format!("--root={}", root.display()))
        .arg(repo("examples/systemd/lbscale.sysusers"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "systemd-sysusers: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let passwd = std::fs::read_to_string(root.join("etc/passwd")).unwrap();
    let entry = passwd
        .lines()
        .find(|l| l.starts_with("lbscale:"))
        .unwrap_or_else(|| panic!("no lbscale user in {passwd}"));
    assert!(
        entry.ends_with(":/var/lib/lbscale:/usr/sbin/nologin"),
        "{entry}"
    );
    let _ = std::fs::remove_dir_all(&root);
}
