//! The daemon's HTTP listener: four GET routes over a hand-rolled HTTP/1.1 (one
//! request per connection, `Connection: close`). Every read is bounded.
//!
//! - `/healthz`: 200 `ok` while the store answers, 503 with the reason while it
//!   does not (a probe task asks it every second, with a deadline: a request
//!   never waits for the store);
//! - `/metrics`: Prometheus text;
//! - `/v1/groups`: every group with each AZ's phase and node counts (JSON);
//! - `/v1/events?group=NAME[&limit=N]`: the group's recent events (JSON).

use crate::Shared;
use serde_json::json;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const READ_TIMEOUT: Duration = Duration::from_secs(5);
const WRITE_TIMEOUT: Duration = Duration::from_secs(10);
const MAX_HEAD: usize = 16 * 1024;

/// How often the store is probed for `/healthz`, and how long a probe waits
/// for it (a free connection, opening one, and the answer, each).
const PROBE_EVERY: Duration = Duration::from_secs(1);
const PROBE_DEADLINE: Duration = Duration::from_secs(2);

/// What the last probe of the store found: `None` when it answered.
#[derive(Default)]
struct Health {
    unreachable: Option<String>,
}

type SharedHealth = Arc<Mutex<Health>>;

/// Asks the store whether it answers, every [`PROBE_EVERY`], on a blocking
/// thread, giving up at twice [`PROBE_DEADLINE`]; a probe still running is
/// waited for before the next one starts (no pile of stalled threads).
async fn probe_store(shared: Arc<Shared>, health: SharedHealth) {
    let set = |why: Option<String>| {
        let mut h = health.lock().unwrap_or_else(|e| e.into_inner());
        match (&h.unreachable, &why) {
            (None, Some(w)) => {
                tracing::warn!(error = %w, "the store is unreachable; /healthz answers 503")
            }
            (Some(_), None) => tracing::info!("the store answers again; /healthz answers 200"),
            _ => {}
        }
        h.unreachable = why;
    };
    loop {
        let s = shared.clone();
        let mut job = tokio::task::spawn_blocking(move || s.engine.probe_store(PROBE_DEADLINE));
        tokio::select! {
            done = &mut job => match done {
                Ok(Ok(())) => set(None),
                Ok(Err(e)) => {
                    let e = e.to_string();
                    set(Some(e.strip_prefix("the store is unreachable: ").unwrap_or(&e).to_string()))
                }
                Err(e) => set(Some(format!("the store probe failed: {e}"))),
            },
            _ = tokio::time::sleep(PROBE_DEADLINE * 2) => {
                set(Some(format!(
                    "the store did not answer a probe within {} s",
                    (PROBE_DEADLINE * 2).as_secs()
                )));
                let _ = job.await;
            }
        }
        tokio::time::sleep(PROBE_EVERY).await;
    }
}

pub async fn serve(listener: TcpListener, shared: Arc<Shared>) {
    let health: SharedHealth = Arc::default();
    // Ends with this task (the daemon aborts it at shutdown).
    struct AbortOnDrop(tokio::task::JoinHandle<()>);
    impl Drop for AbortOnDrop {
        fn drop(&mut self) {
            self.0.abort();
        }
    }
    let _probe = AbortOnDrop(tokio::spawn(probe_store(shared.clone(), health.clone())));
    loop {
        match listener.accept().await {
            Ok((stream, _)) => {
                let shared = shared.clone();
                let health = health.clone();
                tokio::spawn(async move {
                    if let Err(e) = handle(stream, &shared, &health).await {
                        tracing::debug!(error = %e, "http connection");
                    }
                });
            }
            Err(e) => {
                tracing::warn!(error = %e, "http accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

async fn read_head(stream: &mut TcpStream) -> std::io::Result<Vec<u8>> {
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 1024];
    loop {
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            return Ok(buf);
        }
        buf.extend_from_slice(&chunk[..n]);
        if buf.windows(4).any(|w| w == b"\r\n\r\n") || buf.windows(2).any(|w| w == b"\n\n") {
            return Ok(buf);
        }
        if buf.len() > MAX_HEAD {
            return Err(std::io::Error::other("request head too large"));
        }
    }
}

async fn handle(
    mut stream: TcpStream,
    shared: &Shared,
    health: &Mutex<Health>,
) -> std::io::Result<()> {
    let head = tokio::time::timeout(READ_TIMEOUT, read_head(&mut stream))
        .await
        .map_err(|_| std::io::Error::other("read timed out"))??;
    let text = String::from_utf8_lossy(&head);
    let line = text.lines().next().unwrap_or("");
    let mut parts = line.split_whitespace();
    let (method, target) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let (status, ctype, body) = if target == "/healthz" && (method == "GET" || method == "HEAD") {
        healthz(health)
    } else {
        route(method, target, shared)
    };
    let reason = match status {
        200 => "OK",
        400 => "Bad Request",
        404 => "Not Found",
        405 => "Method Not Allowed",
        503 => "Service Unavailable",
        _ => "Internal Server Error",
    };
    let resp = format!(
        "HTTP/1.1 {status} {reason}\r\ncontent-type: {ctype}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    );
    let write = async {
        stream.write_all(resp.as_bytes()).await?;
        if method != "HEAD" {
            stream.write_all(body.as_bytes()).await?;
        }
        stream.shutdown().await
    };
    tokio::time::timeout(WRITE_TIMEOUT, write)
        .await
        .map_err(|_| std::io::Error::other("write timed out"))?
}

const JSON: &str = "application/json";
const TEXT: &str = "text/plain; charset=utf-8";
const PROM: &str = "text/plain; version=0.0.4; charset=utf-8";

fn route(method: &str, target: &str, shared: &Shared) -> (u16, &'static str, String) {
    if method != "GET" && method != "HEAD" {
        return (405, TEXT, "only GET\n".into());
    }
    let (path, query) = target.split_once('?').unwrap_or((target, ""));
    match path {
        "/metrics" => (
            200,
            PROM,
            shared.metrics.render() + &crate::sample::render_kept(&shared.node_connections.kept),
        ),
        "/v1/groups" => {
            let groups = shared.status_snapshot();
            (200, JSON, json!({ "groups": groups }).to_string())
        }
        "/v1/events" => events(query, shared),
        _ => (404, TEXT, "not found\n".into()),
    }
}

fn healthz(health: &Mutex<Health>) -> (u16, &'static str, String) {
    match &health.lock().unwrap_or_else(|e| e.into_inner()).unreachable {
        None => (200, TEXT, "ok\n".into()),
        Some(why) => (503, TEXT, format!("store unreachable: {why}\n")),
    }
}

fn events(query: &str, shared: &Shared) -> (u16, &'static str, String) {
    let mut group = None;
    let mut limit = 200usize;
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        match k {
            "group" => group = Some(percent_decode(v)),
            "limit" => match v.parse::<usize>() {
                Ok(n) if (1..=10_000).contains(&n) => limit = n,
                _ => {
                    return (
                        400,
                        JSON,
                        json!({"error": format!("limit: must be a whole number from 1 to 10000, got {v:?}")})
                            .to_string(),
                    )
                }
            },
            _ => {}
        }
    }
    let engine = &shared.engine;
    let groups = match &group {
        Some(name) => match engine.group_named(name) {
            Ok(Some(g)) => vec![g],
            Ok(None) => {
                return (
                    404,
                    JSON,
                    json!({"error": format!("group: no autoscale group named {name:?}")})
                        .to_string(),
                )
            }
            Err(e) => return (500, JSON, json!({"error": e.to_string()}).to_string()),
        },
        None => match engine.all_groups() {
            Ok(g) => g,
            Err(e) => return (500, JSON, json!({"error": e.to_string()}).to_string()),
        },
    };
    let mut out = Vec::new();
    for g in groups {
        match engine.events(&g.id, limit) {
            Ok(evs) => out.extend(evs.into_iter().map(|e| {
                json!({
                    "time_ms": e.time_ms,
                    "group": g.spec.name,
                    "group_id": e.group_id,
                    "az": e.az,
                    "kind": e.kind,
                    "reason": e.reason,
                    "count": e.count,
                    "last_ms": e.last_ms,
                })
            })),
            Err(e) => return (500, JSON, json!({"error": e.to_string()}).to_string()),
        }
    }
    out.sort_by_key(|e| e["time_ms"].as_i64().unwrap_or(0));
    (200, JSON, json!({ "events": out }).to_string())
}

fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'%' if i + 2 < b.len() => {
                let hex = std::str::from_utf8(&b[i + 1..i + 3]).unwrap_or("");
                match u8::from_str_radix(hex, 16) {
                    Ok(v) => {
                        out.push(v);
                        i += 3;
                        continue;
                    }
                    Err(_) => out.push(b'%'),
                }
            }
            b'+' => out.push(b' '),
            c => out.push(c),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::percent_decode;

    #[test]
    fn decodes_percent_escapes() {
        assert_eq!(percent_decode("a%2Db"), "a-b");
        assert_eq!(percent_decode("a%2"), "a%2");
        assert_eq!(percent_decode("web+1"), "web 1");
    }
}
