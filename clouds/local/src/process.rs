//! The processes the local cloud starts, and how it knows them again.
//!
//! A pid alone may name another process later (pids are reused), and a node's
//! id can be in anyone's arguments (an operator's `tail -f` of its log, node
//! `x-<id>` beside node `<id>`). So a process is ours only while three things
//! hold: its arguments have our exact `flag value` pair (`--node-id <id>`, or a
//! distributor's `--status <file>`), its executable is the binary we started,
//! and its start time is the one recorded when we started it. Signals go
//! through a pidfd opened before those checks, so that a process that exits
//! meanwhile cannot hand its pid to the one we signal.

use crate::{fail, log_tail};
use lbscale_engine::cloud::{CloudError, Result};
use serde::{Deserialize, Serialize};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// SIGTERM grace before SIGKILL.
const STOP_GRACE: Duration = Duration::from_secs(5);

/// A process this cloud started, as recorded when it started.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub(crate) struct Started {
    pub pid: u32,
    /// Field 22 of /proc/PID/stat (clock ticks after boot). 0 in records made
    /// before it was kept: then the executable and the arguments decide.
    pub start_time: u64,
    /// The executable it runs. Empty in records made before it was kept: then
    /// any executable named `lbscale-node`.
    pub exe: PathBuf,
}

/// The argument pair that says which node or distributor a process serves.
pub(crate) struct Mark {
    flag: &'static str,
    value: String,
}

impl Mark {
    pub fn node(id: &str) -> Mark {
        Mark {
            flag: "--node-id",
            value: id.to_string(),
        }
    }

    /// A distributor is named by its status file, which is under its own directory.
    pub fn distributor(dir: &Path) -> Mark {
        Mark {
            flag: "--status",
            value: dir.join("status.json").display().to_string(),
        }
    }
}

impl std::fmt::Display for Mark {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.flag, self.value)
    }
}

/// What /proc/PID/stat says of a process.
struct Stat {
    /// Its main thread has exited (a zombie waits only for its parent to reap
    /// it, and for its other threads).
    exited: bool,
    /// Its main thread has begun to exit (the kernel's PF_EXITING flag), or
    /// has exited.
    exiting: bool,
    /// Field 22: clock ticks after boot.
    start_time: u64,
}

fn stat(pid: u32) -> Option<Stat> {
    const PF_EXITING: u64 = 0x4;
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) is in parentheses and may hold anything.
    let (_, rest) = text.rsplit_once(')')?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // `fields[0]` is field 3 (the state), so field 9 (the flags) is
    // `fields[6]` and field 22 is `fields[19]`.
    let exited = matches!(fields.first(), Some(&"Z") | Some(&"X"));
    let flags: u64 = fields.get(6)?.parse().ok()?;
    Some(Stat {
        exited,
        exiting: exited || flags & PF_EXITING != 0,
        start_time: fields.get(19)?.parse().ok()?,
    })
}

/// The executable of `pid`; a binary replaced since it started (a rebuild)
/// still counts as the path it was started from.
fn exe(pid: u32) -> Option<PathBuf> {
    let link = std::fs::read_link(format!("/proc/{pid}/exe")).ok()?;
    let text = link.to_string_lossy();
    Some(match text.strip_suffix(" (deleted)") {
        Some(p) => PathBuf::from(p),
        None => link,
    })
}

/// Whether `pid`'s arguments have `mark`'s flag followed by exactly its value.
fn has_mark(pid: u32, mark: &Mark) -> bool {
    let Ok(cmdline) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
        return false;
    };
    let args: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
    args.windows(2)
        .any(|w| w[0] == mark.flag.as_bytes() && w[1] == mark.value.as_bytes())
}

/// Whether `p` still runs and is the process we started for `mark`.
pub(crate) fn is_ours(p: &Started, mark: &Mark) -> bool {
    if p.pid == 0 {
        return false;
    }
    let Some(Stat {
        exited, start_time, ..
    }) = stat(p.pid)
    else {
        return false;
    };
    if exited || (p.start_time != 0 && start_time != p.start_time) {
        return false;
    }
    let exe_ok = match exe(p.pid) {
        Some(e) if p.exe.as_os_str().is_empty() => e.file_name() == Some("lbscale-node".as_ref()),
        Some(e) => e == p.exe,
        None => false,
    };
    exe_ok && has_mark(p.pid, mark)
}

/// Running processes that are ours for `mark`, started from `exe` (empty:
/// any `lbscale-node`), whenever they started: for a process whose pid was
/// never recorded.
pub(crate) fn find(mark: &Mark, exe: &Path) -> Vec<Started> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| *pid != std::process::id())
        .filter_map(|pid| {
            let p = Started {
                pid,
                start_time: stat(pid)?.start_time,
                exe: exe.to_path_buf(),
            };
            is_ours(&p, mark).then_some(p)
        })
        .collect()
}

/// A process that was ours when opened, named from then on by a pidfd, so that a
/// pid handed on after it exits is never signalled.
struct Opened<'a> {
    p: &'a Started,
    mark: &'a Mark,
    /// None without pidfds (a kernel before 5.3, or a sandbox that refuses the
    /// call): then the /proc checks made at each step do, and a stop ends once
    /// the main thread has exited.
    fd: Option<OwnedFd>,
}

impl<'a> Opened<'a> {
    /// `p` if it still runs and is ours for `mark`, or was and is exiting. The
    /// pidfd is opened before the checks, so that it names the process they
    /// were made on.
    fn if_ours(p: &'a Started, mark: &'a Mark) -> Option<Opened<'a>> {
        // SAFETY: a plain system call on an integer; a descriptor it returns is
        // ours alone, and owned (closed on drop) from here.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, p.pid as libc::pid_t, 0) } as i32;
        let fd = (fd >= 0).then(|| unsafe { OwnedFd::from_raw_fd(fd) });
        let opened = Opened { p, mark, fd };
        (is_ours(p, mark) || opened.exiting()).then_some(opened)
    }

    /// Whether the process was ours and is exiting: the kernel marks its main
    /// thread as exiting or exited (with no executable or arguments left to
    /// check), with the start time recorded for it, while another thread
    /// still runs.
    /// An exiting process's pid is not handed on before it is reaped, nor is
    /// it reaped before its last thread exits, so the start time still names
    /// it. (A stop retried after a SIGKILL finds it so.)
    fn exiting(&self) -> bool {
        self.fd.is_some()
            && self.p.start_time != 0
            && !self.exited()
            // Not merely the same pid and start tick (after a reboot another
            // program could have both): one the kernel marks as exiting.
            && stat(self.p.pid).is_some_and(|st| st.exiting && st.start_time == self.p.start_time)
    }

    /// Sends `signal`. A process that is gone or going is no error (the wait
    /// that follows tells); being refused (EPERM) is.
    fn signal(&self, signal: i32) -> Result<()> {
        // SAFETY: plain system calls on integers and our own descriptor.
        let by_pidfd = |fd: &OwnedFd| unsafe {
            libc::syscall(
                libc::SYS_pidfd_send_signal,
                fd.as_raw_fd(),
                signal,
                std::ptr::null::<libc::siginfo_t>(),
                0,
            ) == 0
        };
        let by_pid = || {
            // SAFETY: a plain system call on integers.
            !(is_ours(self.p, self.mark) || self.exiting())
                || unsafe { libc::kill(self.p.pid as libc::pid_t, signal) == 0 }
        };
        let sent = match &self.fd {
            Some(fd) => {
                by_pidfd(fd)
                    // A sandbox that lets pidfds be opened but not signalled.
                    || (std::io::Error::last_os_error().raw_os_error() == Some(libc::ENOSYS)
                        && by_pid())
            }
            None => by_pid(),
        };
        let err = std::io::Error::last_os_error();
        if sent || err.raw_os_error() == Some(libc::ESRCH) {
            return Ok(());
        }
        Err(CloudError::Failed(format!(
            "could not signal process {} ({}): {err}",
            self.p.pid, self.mark
        )))
    }

    /// Whether every thread of the process has exited, and so closed its sockets.
    /// Its main thread can be a zombie, no longer ours by /proc, while another
    /// thread still holds the process's listeners; a pidfd reads as ready only
    /// once the last one is gone.
    fn exited(&self) -> bool {
        let Some(fd) = &self.fd else {
            return !is_ours(self.p, self.mark);
        };
        let mut poll = libc::pollfd {
            fd: fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd, no wait.
        unsafe { libc::poll(&mut poll, 1, 0) == 1 }
    }

    /// Waits up to `limit` for the process to exit; whether it did.
    async fn exited_within(&self, limit: Duration) -> bool {
        let deadline = Instant::now() + limit;
        loop {
            if self.exited() {
                return true;
            }
            if Instant::now() > deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// SIGTERM, then SIGKILL after the grace period; returns once the process and
/// all its threads are gone, so that its ports are free (where the kernel has
/// pidfds: else once its main thread is). Does nothing to a process that is not
/// ours for `mark`. Fails if it cannot be signalled, or outlives the SIGKILL by
/// 2 s (stuck in the kernel): then it still holds its address.
pub(crate) async fn stop(p: &Started, mark: &Mark) -> Result<()> {
    let Some(process) = Opened::if_ours(p, mark) else {
        return Ok(());
    };
    process.signal(libc::SIGTERM)?;
    if process.exited_within(STOP_GRACE).await {
        return Ok(());
    }
    process.signal(libc::SIGKILL)?;
    if process.exited_within(Duration::from_secs(2)).await {
        return Ok(());
    }
    Err(CloudError::Failed(format!(
        "process {} ({mark}) still runs 2s after the SIGKILL that followed its SIGTERM by {}s",
        p.pid,
        STOP_GRACE.as_secs()
    )))
}

/// Starts `bin args` in a session of its own, stdio to `log`, and does not wait
/// for it; `args` must hold `mark`. A thread reaps it if it ends while we still
/// run; otherwise init does. Returns what identifies it from now on.
pub(crate) fn spawn_detached(
    bin: &Path,
    args: &[String],
    log: &Path,
    mark: &Mark,
) -> Result<Started> {
    use std::os::unix::process::CommandExt;
    let exe = std::fs::canonicalize(bin).map_err(|e| fail("find", bin, e))?;
    let out = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .map_err(|e| fail("open the log", log, e))?;
    let err = out.try_clone().map_err(|e| fail("open the log", log, e))?;
    let mut cmd = std::process::Command::new(&exe);
    cmd.args(args)
        .stdin(std::process::Stdio::null())
        .stdout(out)
        .stderr(err)
        // Backtraces in a node's log are useful; the provider's environment is not.
        .env_remove("TF_LOG")
        .process_group(0);
    // Terraform hands the provider pipes that are not close-on-exec; a node that
    // kept them would hold Terraform's output open long after the provider exits.
    // Mark every inherited descriptor close-on-exec (closing them here would also
    // close the pipe through which std reports a failed exec).
    unsafe {
        cmd.pre_exec(|| {
            const CLOSE_RANGE_CLOEXEC: u32 = 1 << 2;
            if libc::syscall(libc::SYS_close_range, 3u32, u32::MAX, CLOSE_RANGE_CLOEXEC) != 0 {
                for fd in 3..4096 {
                    libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC);
                }
            }
            Ok(())
        });
    }
    let mut child = cmd
        .spawn()
        .map_err(|e| CloudError::Failed(format!("could not start {}: {e}", bin.display())))?;
    // Not reaped yet, so the pid is still this child's: its start time is
    // read race-free (the start time is the fork's, an exec keeps it).
    let pid = child.id();
    let started = Started {
        pid,
        start_time: stat(pid).map_or(0, |st| st.start_time),
        exe,
    };
    // Liveness checks look at /proc/PID/exe and cmdline: make sure they show
    // the new program before anyone looks.
    let deadline = Instant::now() + Duration::from_secs(5);
    while started.start_time == 0 || !is_ours(&started, mark) {
        if let Ok(Some(status)) = child.try_wait() {
            return Err(CloudError::Failed(format!(
                "{} exited at once ({status}): {}",
                bin.display(),
                log_tail(log)
            )));
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            return Err(CloudError::Failed(format!(
                "{} did not start within 5s (its arguments should hold {mark})",
                bin.display()
            )));
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    std::thread::spawn(move || {
        let _ = child.wait();
    });
    Ok(started)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_start_time_is_field_22_whatever_the_command_name() {
        let Stat {
            exited,
            exiting,
            start_time: t,
        } = stat(std::process::id()).unwrap();
        assert!(!exited && !exiting);
        assert!(t > 0);
        // Another process started later has a later (or equal) start time.
        let mut child = std::process::Command::new("sleep")
            .arg("5")
            .spawn()
            .unwrap();
        let t2 = stat(child.id()).unwrap().start_time;
        assert!(t2 >= t, "{t2} < {t}");
        child.kill().unwrap();
        child.wait().unwrap();
    }

    /// A process whose main thread exits on SIGTERM while another thread keeps
    /// its listener 1.5 s longer (as a node's runtime threads can, briefly): its
    /// main thread is a zombie, no longer ours by /proc, but its port is taken.
    /// Returns it, what identifies it, and its port.
    fn holding_its_port_past_its_main_thread(mark: &Mark) -> (std::process::Child, Started, u16) {
        const SCRIPT: &str = r#"
import ctypes, signal, socket, threading, time
s = socket.socket(); s.bind(("127.62.9.11", 0)); s.listen()
def on_term(*_):
    threading.Thread(target=time.sleep, args=(1.5,)).start()
    ctypes.CDLL(None).pthread_exit(None)
signal.signal(signal.SIGTERM, on_term)
print(s.getsockname()[1], flush=True)
time.sleep(60)
"#;
        let mut child = std::process::Command::new("python3")
            .args(["-c", SCRIPT, "--node-id", &mark.value])
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        std::io::BufRead::read_line(
            &mut std::io::BufReader::new(child.stdout.take().unwrap()),
            &mut line,
        )
        .unwrap();
        let port: u16 = line.trim().parse().unwrap();
        let p = Started {
            pid: child.id(),
            start_time: stat(child.id()).unwrap().start_time,
            // Its interpreter, found once it runs (past any launcher script).
            exe: exe(child.id()).unwrap(),
        };
        assert!(is_ours(&p, mark));
        (child, p, port)
    }

    fn listening(port: u16) -> bool {
        std::net::TcpStream::connect(("127.62.9.11", port)).is_ok()
    }

    #[tokio::test]
    async fn a_stop_returns_once_the_last_thread_has_let_go_of_the_port() {
        let mark = Mark::node("held-port");
        let (mut child, p, port) = holding_its_port_past_its_main_thread(&mark);
        stop(&p, &mark).await.unwrap();
        assert!(
            !listening(port),
            "stop returned while a thread of the process still listened"
        );
        child.wait().unwrap();
    }

    /// As a removal retried after a stop that failed finds it: signalled
    /// already, its main thread gone, another thread still on the port.
    #[tokio::test]
    async fn a_stop_of_a_process_already_exiting_waits_for_it_too() {
        let mark = Mark::node("held-port-exiting");
        let (mut child, p, port) = holding_its_port_past_its_main_thread(&mark);
        // SAFETY: a signal to our own child, not reaped yet.
        assert_eq!(
            unsafe { libc::kill(p.pid as libc::pid_t, libc::SIGTERM) },
            0
        );
        let deadline = Instant::now() + Duration::from_secs(5);
        while is_ours(&p, &mark) {
            assert!(
                Instant::now() < deadline,
                "its main thread did not exit within 5 s"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(listening(port), "the whole process exited at once");
        stop(&p, &mark).await.unwrap();
        assert!(
            !listening(port),
            "stop returned while a thread of the process still listened"
        );
        child.wait().unwrap();
    }

    #[test]
    fn a_record_without_start_time_or_exe_still_reads() {
        let s: Started = serde_json::from_str(r#"{"pid":7}"#).unwrap();
        assert_eq!(
            s,
            Started {
                pid: 7,
                ..Started::default()
            }
        );
    }
}
