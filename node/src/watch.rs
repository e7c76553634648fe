//! Config-file polling and status-file protocol shared by `dns` and `nlb`.
//!
//! The engine writes the config atomically (rename); we poll it every 100 ms and
//! apply it when its content changes, then write `{"version": N, "pid": P}` to the
//! status file atomically (temp file + rename). The status is also written once at
//! start-up (version 0 when there is no config yet).

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::de::DeserializeOwned;

pub fn write_status(path: &Path, version: u64) -> std::io::Result<()> {
    let pid = std::process::id();
    let body = serde_json::json!({ "version": version, "pid": pid }).to_string();
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(format!(".tmp.{pid}"));
    let tmp = PathBuf::from(tmp);
    std::fs::write(&tmp, body.as_bytes())?;
    std::fs::rename(&tmp, path)
}

/// What applying a configuration gave: its version, and whether everything in it
/// is in place (false: apply it again a little later, e.g. a bind failed).
pub struct Applied {
    pub version: u64,
    pub complete: bool,
}

pub async fn run<T, F>(config: PathBuf, status: PathBuf, mut apply: F) -> !
where
    T: DeserializeOwned,
    F: FnMut(T) -> Applied,
{
    let mut last: Option<Vec<u8>> = None;
    let mut version = 0u64;
    let mut first = true;
    let mut retry_at: Option<tokio::time::Instant> = None;
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let bytes = match tokio::fs::read(&config).await {
            Ok(b) => Some(b),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => {
                tracing::warn!(path = %config.display(), error = %e, "cannot read config");
                None
            }
        };
        let due_retry = retry_at.is_some_and(|t| tokio::time::Instant::now() >= t);
        let changed = bytes.is_some() && bytes != last;
        if changed || due_retry {
            let b = bytes.clone().or_else(|| last.clone()).unwrap_or_default();
            match serde_json::from_slice::<T>(&b) {
                Ok(cfg) => {
                    let a = apply(cfg);
                    version = a.version;
                    retry_at = if a.complete {
                        None
                    } else {
                        Some(tokio::time::Instant::now() + Duration::from_secs(1))
                    };
                    if let Err(e) = write_status(&status, version) {
                        tracing::warn!(path = %status.display(), error = %e, "cannot write status");
                    }
                    tracing::info!(version, "configuration applied");
                    first = false;
                }
                Err(e) => {
                    tracing::warn!(path = %config.display(), error = %e, "invalid config; keeping the previous one");
                    retry_at = None;
                }
            }
            if bytes.is_some() {
                last = bytes;
            }
        }
        if first {
            first = false;
            if let Err(e) = write_status(&status, version) {
                tracing::warn!(path = %status.display(), error = %e, "cannot write status");
            }
        }
    }
}
