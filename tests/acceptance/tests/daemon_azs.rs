//! Each availability zone is its own cluster, evaluated on its own: a drain
//! in one AZ never holds up the evaluation or the workflows of another.
//!
//! Under real Terraform, two AZs: az1 scales in a node that holds a slow,
//! long-lived download (drain_timeout 60 s), and while that node drains, az2's
//! load crosses its max. az2 must scale out within watch_time plus two stats
//! intervals of its load starting (the policy's own timing: `watch_time` of
//! breaching samples, one interval for the node to measure its throughput and
//! one for the daemon's evaluation to come round), long before az1's drain
//! ends; and az1's drain still completes, the download whole.

use lbscale_acceptance::*;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

const STATS_INTERVAL_S: u64 = 2;
const WATCH_TIME_S: u64 = 6;
/// How long the slow download takes: it keeps az1's leaving node draining.
const SLOW_DOWNLOAD: Duration = Duration::from_secs(45);
/// The slow download's body: 100 bytes every 250 ms.
const SLOW_CHUNK: usize = 100;
const SLOW_EVERY: Duration = Duration::from_millis(250);

fn slow_chunks() -> usize {
    (SLOW_DOWNLOAD.as_millis() / SLOW_EVERY.as_millis()) as usize
}

/// A backend that answers `/slow` with a body trickled over
/// [`SLOW_DOWNLOAD`], and anything else with 64 KiB at once (the load).
fn backend() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            std::thread::spawn(move || serve(stream));
        }
    });
    port
}

fn serve(mut s: TcpStream) {
    let _ = s.set_read_timeout(Some(Duration::from_secs(10)));
    let mut reader = BufReader::new(s.try_clone().unwrap());
    loop {
        let mut request = String::new();
        if reader.read_line(&mut request).unwrap_or(0) == 0 {
            return;
        }
        loop {
            let mut h = String::new();
            if reader.read_line(&mut h).unwrap_or(0) == 0 {
                return;
            }
            if h == "\r\n" || h == "\n" {
                break;
            }
        }
        if request.starts_with("GET /slow ") {
            let len = slow_chunks() * SLOW_CHUNK;
            let head = format!("HTTP/1.1 200 OK\r\ncontent-length: {len}\r\n\r\n");
            if s.write_all(head.as_bytes()).is_err() {
                return;
            }
            for _ in 0..slow_chunks() {
                std::thread::sleep(SLOW_EVERY);
                if s.write_all(&[b's'; SLOW_CHUNK]).is_err() {
                    return;
                }
            }
            continue;
        }
        let body = vec![b'x'; 64 * 1024];
        let head = format!(
            "HTTP/1.1 200 OK\r\ncontent-length: {}\r\nconnection: keep-alive\r\n\r\n",
            body.len()
        );
        if s.write_all(head.as_bytes()).is_err() || s.write_all(&body).is_err() {
            return;
        }
    }
}

/// Downloads `/slow` through the node at `ip`; returns the body bytes read.
fn slow_download(ip: String, host: String) -> std::thread::JoinHandle<Result<usize, String>> {
    std::thread::spawn(move || {
        let addr: SocketAddr = format!("{ip}:8080").parse().unwrap();
        let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(3))
            .map_err(|e| format!("connect {addr}: {e}"))?;
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        write!(
            s,
            "GET /slow HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"
        )
        .map_err(|e| e.to_string())?;
        let mut raw = Vec::new();
        s.read_to_end(&mut raw)
            .map_err(|e| format!("read from {addr} after {} bytes: {e}", raw.len()))?;
        let at = raw
            .windows(4)
            .position(|w| w == b"\r\n\r\n")
            .ok_or("no HTTP response")?;
        Ok(raw.len() - at - 4)
    })
}

fn config(name: &str, backend: u16) -> String {
    format!(
        r#"
resource "lbscale_traffic_distributor" "d" {{
  name   = "{name}-dns"
  cloud  = "local"
  mode   = "dns"
  domain = "{name}.lbscale.test"
  ttl    = "1s"
}}

resource "lbscale_autoscale_group" "g" {{
  name                   = "{name}"
  cloud                  = "local"
  availability_zones     = ["az1", "az2"]
  traffic_distributor_id = lbscale_traffic_distributor.d.id
  min_nodes              = 1
  max_nodes              = 2
  stats_interval         = "{STATS_INTERVAL_S}s"
  watch_time             = "{WATCH_TIME_S}s"
  cooldown               = "2s"
  drain_timeout          = "60s"
  threshold {{
    metric = "throughput"
    min    = 1
    max    = 8
  }}
}}

resource "lbscale_se_group" "s" {{
  name               = "{name}-se"
  autoscale_group_id = lbscale_autoscale_group.g.id
}}

resource "lbscale_vserver" "web" {{
  name         = "{name}-web"
  se_group_id  = lbscale_se_group.s.id
  service_type = "HTTP"
  port         = 8080
  service {{
    name    = "big"
    address = "127.0.0.1"
    port    = {backend}
  }}
}}
"#
    )
}

/// The group's nodes in the store: (id, az, state, registered, ip).
fn nodes(ws: &Workspace, group: &str) -> Vec<(String, String, String, bool, String)> {
    let engine = ws.engine();
    let g = engine
        .group_named(group)
        .unwrap()
        .expect("group in the store");
    engine
        .node_rows(&g.id)
        .unwrap()
        .into_iter()
        .map(|n| {
            (
                n.id,
                n.az,
                n.state.as_str().to_string(),
                n.registered,
                n.private_ip,
            )
        })
        .collect()
}

fn serving_in(ws: &Workspace, group: &str, az: &str) -> Vec<(String, String)> {
    nodes(ws, group)
        .into_iter()
        .filter(|(_, a, state, registered, _)| a == az && state == "active" && *registered)
        .map(|(id, _, _, _, ip)| (id, ip))
        .collect()
}

fn events(ws: &Workspace, group: &str) -> Vec<lbscale_engine::store::Event> {
    let engine = ws.engine();
    let g = engine
        .group_named(group)
        .unwrap()
        .expect("group in the store");
    engine.events(&g.id, 1000).unwrap()
}

fn event_in(
    ws: &Workspace,
    group: &str,
    az: &str,
    kind: &str,
) -> Option<lbscale_engine::store::Event> {
    events(ws, group)
        .into_iter()
        .find(|e| e.az.as_deref() == Some(az) && e.kind == kind)
}

#[test]
fn a_drain_in_one_az_never_delays_the_scale_out_of_another() {
    let name = "dazs";
    let host = format!("{name}.lbscale.test");
    let mut ws = Workspace::new("daemon-azs", 135);
    ws.write(&config(name, backend()));
    ws.apply();
    let az1 = serving_in(&ws, name, "az1");
    let az2 = serving_in(&ws, name, "az2");
    assert_eq!(
        (az1.len(), az2.len()),
        (1, 1),
        "one node per AZ after apply"
    );
    let daemon = Daemon::start(&ws, 19481, "azs");

    // 1. az1 gets a second node under load, which will be the one to leave.
    let load1 = Load::start(&az1[0].1, &host);
    let (leaving, leaving_ip) = wait_showing(
        "az1 to scale out to 2 serving nodes",
        Duration::from_secs(60),
        || {
            let s = serving_in(&ws, name, "az1");
            if s.len() == 2 {
                Ok(s.into_iter().find(|(id, _)| *id != az1[0].0).unwrap())
            } else {
                Err(nodes(&ws, name))
            }
        },
    );
    // 2. A slow download holds a connection on it; az1 goes idle and scales
    //    in: the newest node leaves and drains until the download ends.
    let download = slow_download(leaving_ip.clone(), host.clone());
    let download_started = Instant::now();
    std::thread::sleep(Duration::from_millis(500));
    load1.stop();
    wait_showing(
        "az1's new node to drain (scale-in held by the slow download)",
        Duration::from_secs(40),
        || {
            let n = nodes(&ws, name);
            match n.iter().find(|(id, ..)| *id == leaving) {
                Some((_, _, state, ..)) if state == "draining" => Ok(()),
                _ => Err(n),
            }
        },
    );
    assert!(
        download_started.elapsed() + Duration::from_secs(15) < SLOW_DOWNLOAD,
        "the drain began {:?} into the {SLOW_DOWNLOAD:?} download: too late for the test to mean anything",
        download_started.elapsed()
    );

    // 3. Meanwhile az2's load crosses its max.
    let load2 = Load::start(&az2[0].1, &host);
    let load2_at = lbscale_engine::store::now_ms();
    let decided = wait_showing(
        "az2's scale-out decision while az1 drains",
        Duration::from_secs(60),
        || event_in(&ws, name, "az2", "scale_out").ok_or_else(|| daemon.group(name)),
    );
    let bound_ms = ((WATCH_TIME_S + 2 * STATS_INTERVAL_S) * 1000) as i64;
    let took_ms = decided.time_ms - load2_at;
    eprintln!(
        "MEASURE az2 load start -> scale_out decision while az1 drains: {took_ms} ms (bound: watch_time + 2 x stats_interval = {bound_ms} ms)"
    );
    let serving_at = wait_showing(
        "az2's second node to serve",
        Duration::from_secs(60),
        || {
            let s = serving_in(&ws, name, "az2");
            if s.len() == 2 {
                Ok(lbscale_engine::store::now_ms())
            } else {
                Err(nodes(&ws, name))
            }
        },
    );
    eprintln!(
        "MEASURE az2 load start -> second node serving: {} ms",
        serving_at - load2_at
    );
    assert!(
        event_in(&ws, name, "az1", "drain_end").is_none(),
        "az2 scaled out while az1 still drained"
    );
    assert!(
        took_ms <= bound_ms,
        "az2 decided {took_ms} ms after its load began, over watch_time + 2 x stats_interval ({bound_ms} ms): its evaluation waited for az1's drain"
    );
    load2.stop();

    // 4. az1's drain still completes: the download whole, then the node gone.
    let body = download
        .join()
        .unwrap()
        .expect("the slow download through the draining node");
    assert_eq!(
        body,
        slow_chunks() * SLOW_CHUNK,
        "the download completed whole"
    );
    let drained = wait_showing(
        "az1's drain to end and its node to go",
        Duration::from_secs(70),
        || match (
            event_in(&ws, name, "az1", "drain_end"),
            nodes(&ws, name).iter().any(|(id, ..)| *id == leaving),
        ) {
            (Some(e), false) => Ok(e),
            seen => Err(format!("{seen:?}")),
        },
    );
    assert!(
        drained.time_ms > serving_at,
        "az1's drain ended after az2's node served"
    );
    assert_eq!(serving_in(&ws, name, "az1").len(), 1);
    let ev = events(&ws, name);
    for az in ["az1", "az2"] {
        assert!(
            !ev.iter()
                .any(|e| e.az.as_deref() == Some(az) && e.kind.ends_with("_failed")),
            "no workflow failed in {az}: {ev:?}"
        );
    }
    daemon.stop();
    ws.destroy();
}
