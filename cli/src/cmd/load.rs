//! `lbscale load --url http://HOST[:PORT]/PATH [--dns IP:PORT [--resolve-every 2s]]
//! [--resolve HOST:PORT:IP]... [--rate N] [--connections N] [--duration 60s]
//! [--report 2s] [--csv FILE]`: an HTTP load generator with no dependencies (std
//! `TcpStream` and threads), made to drive traffic through a fleet.
//!
//! - Addresses: `--dns` asks that DNS server (the distributor's) for the URL's host
//!   every `--resolve-every`, as a client honouring a short TTL would, so nodes that
//!   join get traffic and nodes that leave stop getting it; `--resolve` pins
//!   addresses like curl's option; otherwise the system resolver, once.
//! - Each of `--connections` workers sends GETs (HTTP/1.1, keep-alive when the
//!   server allows it), spreading requests round robin over the current addresses.
//!   `--rate N` paces the workers to N requests/s in total; without it they send as
//!   fast as answers come back.
//! - Every `--report` it prints a line: requests/s, Mbps received, errors, and the
//!   share of answers per node (`x-lbscale-node` header). `--csv FILE` gets one
//!   line per second: `unix_ms,req_per_s,mbps,errors`. It stops after `--duration`
//!   or at SIGINT/SIGTERM and prints a summary.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpStream, ToSocketAddrs, UdpSocket};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::cmd::daemon::flag_pairs;
use crate::output::CliError;

const FLAGS: &str =
    "--url, --dns, --resolve-every, --resolve, --rate, --connections, --duration, --report, --csv";
const IO_TIMEOUT: Duration = Duration::from_secs(5);

static STOP: AtomicBool = AtomicBool::new(false);

extern "C" {
    fn signal(sig: i32, handler: extern "C" fn(i32)) -> usize;
}
extern "C" fn on_signal(_: i32) {
    STOP.store(true, Ordering::SeqCst);
}

struct Target {
    host: String,
    port: u16,
    path: String,
}

fn parse_url(url: &str) -> Result<Target, CliError> {
    let bad = || {
        CliError::Usage(format!(
            "--url: must be http://HOST[:PORT][/PATH], got {url:?}"
        ))
    };
    let rest = url.strip_prefix("http://").ok_or_else(bad)?;
    let (authority, path) = match rest.find('/') {
        Some(i) => (&rest[..i], rest[i..].to_string()),
        None => (rest, "/".to_string()),
    };
    let (host, port) = match authority.rsplit_once(':') {
        Some((h, p)) => (h, p.parse::<u16>().map_err(|_| bad())?),
        None => (authority, 80),
    };
    if host.is_empty() {
        return Err(bad());
    }
    Ok(Target {
        host: host.to_string(),
        port,
        path,
    })
}

fn duration(flag: &str, v: &str) -> Result<Duration, CliError> {
    lbscale_core::duration::parse_duration(v)
        .ok()
        .filter(|d| !d.is_zero())
        .ok_or_else(|| {
            CliError::Usage(format!(
                "{flag}: must be a positive duration such as 30s, got {v:?}"
            ))
        })
}

fn number(flag: &str, v: &str, max: f64) -> Result<f64, CliError> {
    v.parse::<f64>()
        .ok()
        .filter(|n| n.is_finite() && *n > 0.0 && *n <= max)
        .ok_or_else(|| {
            CliError::Usage(format!(
                "{flag}: must be a number above 0 and at most {max}, got {v:?}"
            ))
        })
}

/// Counters shared by the workers and the reporter.
#[derive(Default)]
struct Counters {
    ok: AtomicU64,
    errors: AtomicU64,
    bytes: AtomicU64,
    per_node: Mutex<BTreeMap<String, u64>>,
    last_error: Mutex<Option<String>>,
}

pub fn run(args: &[String]) -> Result<(), CliError> {
    let mut url = None;
    let mut dns: Option<SocketAddr> = None;
    let mut resolve_every = Duration::from_secs(2);
    let mut pinned: Vec<IpAddr> = Vec::new();
    let mut rate: Option<f64> = None;
    let mut connections = 4usize;
    let mut total = Duration::from_secs(60);
    let mut report = Duration::from_secs(2);
    let mut csv = None;
    let mut resolves = Vec::new();
    for (flag, value) in flag_pairs(args, FLAGS)? {
        match flag.as_str() {
            "--url" => url = Some(value),
            "--dns" => {
                dns = Some(value.parse().map_err(|_| {
                    CliError::Usage(format!(
                        "--dns: must be IP:PORT of a DNS server, got {value:?}"
                    ))
                })?)
            }
            "--resolve-every" => resolve_every = duration("--resolve-every", &value)?,
            "--resolve" => resolves.push(value),
            "--rate" => rate = Some(number("--rate", &value, 100_000.0)?),
            "--connections" => connections = number("--connections", &value, 256.0)? as usize,
            "--duration" => total = duration("--duration", &value)?,
            "--report" => report = duration("--report", &value)?,
            "--csv" => csv = Some(value),
            other => {
                return Err(CliError::Usage(format!(
                    "{other}: must be one of {FLAGS}, got an unknown argument"
                )))
            }
        }
    }
    let url = url.ok_or_else(|| {
        CliError::Usage("--url: must be given (http://HOST[:PORT]/PATH), got nothing".into())
    })?;
    let target = Arc::new(parse_url(&url)?);
    for r in &resolves {
        // HOST:PORT:IP, as curl's --resolve.
        let mut parts = r.splitn(3, ':');
        let (h, p, ip) = (parts.next(), parts.next(), parts.next());
        let ip: IpAddr = match (h, p, ip) {
            (Some(h), Some(p), Some(ip)) if h == target.host && p == target.port.to_string() => {
                ip.parse().ok()
            }
            _ => None,
        }
        .ok_or_else(|| {
            CliError::Usage(format!(
                "--resolve: must be {}:{}:IP (the URL's host and port), got {r:?}",
                target.host, target.port
            ))
        })?;
        pinned.push(ip);
    }
    if dns.is_some() && !pinned.is_empty() {
        return Err(CliError::Usage(
            "--dns: must not be combined with --resolve, got both".into(),
        ));
    }
    let first = if let Some(server) = dns {
        dns_a(server, &target.host).map_err(|e| {
            CliError::Output(format!(
                "--dns: {server} did not answer for {}: {e}",
                target.host
            ))
        })?
    } else if !pinned.is_empty() {
        pinned.clone()
    } else {
        (target.host.as_str(), target.port)
            .to_socket_addrs()
            .map_err(|e| CliError::Output(format!("--url: cannot resolve {}: {e}", target.host)))?
            .map(|a| a.ip())
            .collect()
    };
    if first.is_empty() {
        return Err(CliError::Output(format!(
            "--url: no address for {}",
            target.host
        )));
    }
    let mut csv_file = match &csv {
        Some(path) => Some(
            std::fs::File::create(path)
                .map_err(|e| CliError::Output(format!("--csv: cannot create {path}: {e}")))?,
        ),
        None => None,
    };
    if let Some(f) = csv_file.as_mut() {
        let _ = writeln!(f, "unix_ms,req_per_s,mbps,errors");
    }
    unsafe {
        signal(2, on_signal);
        signal(15, on_signal);
    }

    let addrs = Arc::new(RwLock::new(first.clone()));
    let counters = Arc::new(Counters::default());
    let rr = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let end = start + total;
    println!(
        "load: GET {url} from {connections} connection(s), {}, for {}s; addresses {}",
        match rate {
            Some(r) => format!("{r} requests/s"),
            None => "as fast as answers come".into(),
        },
        total.as_secs_f64(),
        list(&first)
    );

    let mut workers = Vec::new();
    for i in 0..connections {
        let (target, addrs, counters, rr) =
            (target.clone(), addrs.clone(), counters.clone(), rr.clone());
        let period = rate.map(|r| Duration::from_secs_f64(connections as f64 / r));
        workers.push(std::thread::spawn(move || {
            worker(i, connections, &target, &addrs, &counters, &rr, period, end)
        }));
    }

    // The reporter (and re-resolver) is this thread.
    let mut last_resolve = Instant::now();
    let mut last_sec = (Instant::now(), 0u64, 0u64, 0u64);
    let mut last_report = (Instant::now(), 0u64, 0u64, 0u64, BTreeMap::new());
    while !STOP.load(Ordering::Relaxed) && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(100));
        if let Some(server) = dns {
            if last_resolve.elapsed() >= resolve_every {
                last_resolve = Instant::now();
                match dns_a(server, &target.host) {
                    Ok(found) if !found.is_empty() => {
                        let mut cur = addrs.write().unwrap_or_else(|e| e.into_inner());
                        if *cur != found {
                            println!(
                                "load: {:>5.1}s  {} now resolves to {}",
                                start.elapsed().as_secs_f64(),
                                target.host,
                                list(&found)
                            );
                            *cur = found;
                        }
                    }
                    Ok(_) => {}
                    Err(e) => println!("load: DNS query to {server} failed: {e}"),
                }
            }
        }
        let (ok, err, bytes) = (
            counters.ok.load(Ordering::Relaxed),
            counters.errors.load(Ordering::Relaxed),
            counters.bytes.load(Ordering::Relaxed),
        );
        let dt = last_sec.0.elapsed().as_secs_f64();
        if dt >= 1.0 {
            if let Some(f) = csv_file.as_mut() {
                let _ = writeln!(
                    f,
                    "{},{:.2},{:.3},{}",
                    unix_ms(),
                    (ok - last_sec.1) as f64 / dt,
                    (bytes - last_sec.2) as f64 * 8.0 / 1e6 / dt,
                    err - last_sec.3
                );
                let _ = f.flush();
            }
            last_sec = (Instant::now(), ok, bytes, err);
        }
        let dt = last_report.0.elapsed().as_secs_f64();
        if dt >= report.as_secs_f64() {
            let per_node = counters
                .per_node
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone();
            let shares: Vec<String> = per_node
                .iter()
                .map(|(n, c)| (n, c - last_report.4.get(n).copied().unwrap_or(0)))
                .filter(|(_, d)| *d > 0)
                .map(|(n, d)| {
                    format!(
                        "{n} {:.0}%",
                        d as f64 * 100.0 / (ok - last_report.1).max(1) as f64
                    )
                })
                .collect();
            println!(
                "load: {:>5.1}s  {:>6.1} req/s  {:>6.1} Mbps  errors {}  nodes: {}",
                start.elapsed().as_secs_f64(),
                (ok - last_report.1) as f64 / dt,
                (bytes - last_report.2) as f64 * 8.0 / 1e6 / dt,
                err - last_report.3,
                if shares.is_empty() {
                    "-".to_string()
                } else {
                    shares.join(", ")
                }
            );
            if err > last_report.3 {
                if let Some(e) = counters
                    .last_error
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .take()
                {
                    println!("load:         last error: {e}");
                }
            }
            last_report = (Instant::now(), ok, bytes, err, per_node);
        }
    }
    STOP.store(true, Ordering::SeqCst);
    for w in workers {
        let _ = w.join();
    }
    if let Some(f) = csv_file.as_mut() {
        let _ = writeln!(f, "{},0,0,0", unix_ms());
    }
    let secs = start.elapsed().as_secs_f64().max(1e-3);
    let (ok, err, bytes) = (
        counters.ok.load(Ordering::Relaxed),
        counters.errors.load(Ordering::Relaxed),
        counters.bytes.load(Ordering::Relaxed),
    );
    let per_node = counters
        .per_node
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone();
    println!(
        "load: done after {secs:.1}s: {ok} answers ({:.1} req/s, {:.1} Mbps), {err} errors; per node: {}",
        ok as f64 / secs,
        bytes as f64 * 8.0 / 1e6 / secs,
        per_node
            .iter()
            .map(|(n, c)| format!("{n} {c}"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    if ok == 0 {
        return Err(CliError::Output(
            "load: no request was answered".to_string(),
        ));
    }
    Ok(())
}

fn list(a: &[IpAddr]) -> String {
    a.iter()
        .map(|a| a.to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

fn unix_ms() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis())
        .unwrap_or(0)
}

#[allow(clippy::too_many_arguments)]
fn worker(
    index: usize,
    connections: usize,
    target: &Target,
    addrs: &RwLock<Vec<IpAddr>>,
    counters: &Counters,
    rr: &AtomicU64,
    period: Option<Duration>,
    end: Instant,
) {
    // Spread the workers' first requests over one period.
    let mut next = Instant::now()
        + period
            .map(|p| p.mul_f64(index as f64 / connections as f64))
            .unwrap_or_default();
    let mut conns: BTreeMap<IpAddr, BufReader<TcpStream>> = BTreeMap::new();
    let request = format!(
        "GET {} HTTP/1.1\r\nHost: {}:{}\r\nUser-Agent: lbscale-load\r\nAccept: */*\r\n\r\n",
        target.path, target.host, target.port
    );
    while !STOP.load(Ordering::Relaxed) && Instant::now() < end {
        if let Some(p) = period {
            let now = Instant::now();
            if next > now {
                std::thread::sleep((next - now).min(Duration::from_millis(200)));
                continue;
            }
            // Far behind (slow answers): do not burst to catch up.
            next = if now - next > Duration::from_secs(1) {
                now + p
            } else {
                next + p
            };
        }
        let current = addrs.read().unwrap_or_else(|e| e.into_inner()).clone();
        if current.is_empty() {
            std::thread::sleep(Duration::from_millis(100));
            continue;
        }
        // Drop connections to addresses that left the answer: their node drains.
        conns.retain(|ip, _| current.contains(ip));
        let ip = current[(rr.fetch_add(1, Ordering::Relaxed) % current.len() as u64) as usize];
        let reused = conns.contains_key(&ip);
        let result = match conns.remove(&ip) {
            Some(c) => Ok(c),
            None => connect(ip, target.port),
        }
        .and_then(|mut c| exchange(&mut c, &request).map(|r| (c, r)));
        let result = match result {
            // A kept-alive connection the server closed meanwhile: retry once, fresh.
            Err(_) if reused => connect(ip, target.port)
                .and_then(|mut c| exchange(&mut c, &request).map(|r| (c, r))),
            r => r,
        };
        match result {
            Ok((conn, resp)) => {
                if (200..300).contains(&resp.status) {
                    counters.ok.fetch_add(1, Ordering::Relaxed);
                    *counters
                        .per_node
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .entry(resp.node.unwrap_or_else(|| ip.to_string()))
                        .or_default() += 1;
                } else {
                    counters.errors.fetch_add(1, Ordering::Relaxed);
                    *counters
                        .last_error
                        .lock()
                        .unwrap_or_else(|e| e.into_inner()) =
                        Some(format!("{ip}: HTTP {}", resp.status));
                }
                counters.bytes.fetch_add(resp.bytes, Ordering::Relaxed);
                if resp.keep_alive {
                    conns.insert(ip, conn);
                }
            }
            Err(e) => {
                counters.errors.fetch_add(1, Ordering::Relaxed);
                *counters
                    .last_error
                    .lock()
                    .unwrap_or_else(|e| e.into_inner()) = Some(format!("{ip}: {e}"));
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }
}

fn connect(ip: IpAddr, port: u16) -> std::io::Result<BufReader<TcpStream>> {
    let s = TcpStream::connect_timeout(&SocketAddr::new(ip, port), Duration::from_secs(2))?;
    s.set_read_timeout(Some(IO_TIMEOUT))?;
    s.set_write_timeout(Some(IO_TIMEOUT))?;
    let _ = s.set_nodelay(true);
    Ok(BufReader::with_capacity(64 * 1024, s))
}

struct Response {
    status: u16,
    node: Option<String>,
    bytes: u64,
    keep_alive: bool,
}

/// Sends one request and reads the whole response (content-length, chunked, or
/// until the server closes).
fn exchange(conn: &mut BufReader<TcpStream>, request: &str) -> std::io::Result<Response> {
    let bad = |m: &str| std::io::Error::new(std::io::ErrorKind::InvalidData, m.to_string());
    conn.get_mut().write_all(request.as_bytes())?;
    let mut line = String::new();
    if conn.read_line(&mut line)? == 0 {
        return Err(bad("connection closed before the response"));
    }
    let mut bytes = line.len() as u64;
    let mut parts = line.split_whitespace();
    let version = parts.next().unwrap_or("").to_string();
    let status: u16 = parts
        .next()
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| bad("bad status line"))?;
    let mut keep_alive = version == "HTTP/1.1";
    let (mut length, mut chunked, mut node) = (None, false, None);
    loop {
        line.clear();
        let n = conn.read_line(&mut line)?;
        if n == 0 {
            return Err(bad("connection closed in the response head"));
        }
        bytes += n as u64;
        let l = line.trim_end();
        if l.is_empty() {
            break;
        }
        if let Some((k, v)) = l.split_once(':') {
            let (k, v) = (k.trim().to_ascii_lowercase(), v.trim());
            match k.as_str() {
                "content-length" => length = v.parse::<u64>().ok(),
                "transfer-encoding" => chunked = v.eq_ignore_ascii_case("chunked"),
                "connection" => {
                    if v.eq_ignore_ascii_case("close") {
                        keep_alive = false
                    } else if v.eq_ignore_ascii_case("keep-alive") {
                        keep_alive = true
                    }
                }
                "x-lbscale-node" => node = Some(v.to_string()),
                _ => {}
            }
        }
    }
    let mut sink = [0u8; 16 * 1024];
    if chunked {
        loop {
            line.clear();
            conn.read_line(&mut line)?;
            bytes += line.len() as u64;
            let size = u64::from_str_radix(line.trim().split(';').next().unwrap_or(""), 16)
                .map_err(|_| bad("bad chunk size"))?;
            if size == 0 {
                // Trailers, up to the empty line.
                loop {
                    line.clear();
                    if conn.read_line(&mut line)? == 0 || line.trim().is_empty() {
                        break;
                    }
                }
                break;
            }
            bytes += skip(conn, size + 2, &mut sink)?;
        }
    } else if let Some(len) = length {
        bytes += skip(conn, len, &mut sink)?;
    } else {
        keep_alive = false;
        loop {
            let n = conn.read(&mut sink)?;
            if n == 0 {
                break;
            }
            bytes += n as u64;
        }
    }
    Ok(Response {
        status,
        node,
        bytes,
        keep_alive,
    })
}

fn skip(conn: &mut BufReader<TcpStream>, mut left: u64, sink: &mut [u8]) -> std::io::Result<u64> {
    let total = left;
    while left > 0 {
        let want = left.min(sink.len() as u64) as usize;
        let n = conn.read(&mut sink[..want])?;
        if n == 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "connection closed in the body",
            ));
        }
        left -= n as u64;
    }
    Ok(total)
}

/// The A records of `name` from `server` (one UDP query, 2 s timeout, 2 tries).
fn dns_a(server: SocketAddr, name: &str) -> std::io::Result<Vec<IpAddr>> {
    let bad = |m: &str| std::io::Error::new(std::io::ErrorKind::InvalidData, m.to_string());
    let bind: SocketAddr = if server.is_ipv4() {
        (Ipv4Addr::UNSPECIFIED, 0).into()
    } else {
        "[::]:0".parse().expect("v6 any")
    };
    let sock = UdpSocket::bind(bind)?;
    sock.set_read_timeout(Some(Duration::from_secs(2)))?;
    let id = (unix_ms() as u16) ^ 0x5a5a;
    let mut q = Vec::with_capacity(64);
    q.extend_from_slice(&id.to_be_bytes());
    q.extend_from_slice(&[0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0]);
    for label in name.trim_end_matches('.').split('.') {
        if label.is_empty() || label.len() > 63 {
            return Err(bad("bad host name"));
        }
        q.push(label.len() as u8);
        q.extend_from_slice(label.as_bytes());
    }
    q.extend_from_slice(&[0, 0, 1, 0, 1]);
    let mut buf = [0u8; 1500];
    let mut last = bad("no answer");
    for _ in 0..2 {
        sock.send_to(&q, server)?;
        match sock.recv_from(&mut buf) {
            Ok((n, _)) if n >= 12 && buf[..2] == id.to_be_bytes() => {
                return parse_a(&buf[..n]).ok_or_else(|| bad("malformed DNS answer"))
            }
            Ok(_) => last = bad("unexpected DNS answer"),
            Err(e) => last = e,
        }
    }
    Err(last)
}

fn parse_a(m: &[u8]) -> Option<Vec<IpAddr>> {
    let qd = u16::from_be_bytes([m[4], m[5]]) as usize;
    let an = u16::from_be_bytes([m[6], m[7]]) as usize;
    let mut i = 12;
    let skip_name = |mut i: usize| -> Option<usize> {
        loop {
            let l = *m.get(i)? as usize;
            if l == 0 {
                return Some(i + 1);
            }
            if l & 0xc0 == 0xc0 {
                return Some(i + 2);
            }
            i += 1 + l;
        }
    };
    for _ in 0..qd {
        i = skip_name(i)? + 4;
    }
    let mut out = Vec::new();
    for _ in 0..an {
        i = skip_name(i)?;
        let h = m.get(i..i + 10)?;
        let (typ, len) = (
            u16::from_be_bytes([h[0], h[1]]),
            u16::from_be_bytes([h[8], h[9]]) as usize,
        );
        i += 10;
        let data = m.get(i..i + len)?;
        if typ == 1 && len == 4 {
            out.push(IpAddr::V4(Ipv4Addr::new(
                data[0], data[1], data[2], data[3],
            )));
        }
        i += len;
    }
    out.sort();
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_urls() {
        let t = parse_url("http://app.lbscale.test:8080/blob").unwrap();
        assert_eq!(
            (t.host.as_str(), t.port, t.path.as_str()),
            ("app.lbscale.test", 8080, "/blob")
        );
        let t = parse_url("http://x").unwrap();
        assert_eq!((t.port, t.path.as_str()), (80, "/"));
        assert!(parse_url("https://x/").is_err());
    }

    #[test]
    fn parses_a_records_with_compression() {
        // Header (id, flags, 1 question, 2 answers), question a.b A IN, two answers
        // pointing at the question's name.
        let mut m = vec![0, 1, 0x81, 0x80, 0, 1, 0, 2, 0, 0, 0, 0];
        m.extend_from_slice(&[1, b'a', 1, b'b', 0, 0, 1, 0, 1]);
        for last in [4u8, 3] {
            m.extend_from_slice(&[0xc0, 12, 0, 1, 0, 1, 0, 0, 0, 2, 0, 4, 127, 0, 0, last]);
        }
        assert_eq!(
            parse_a(&m).unwrap(),
            vec![
                IpAddr::V4(Ipv4Addr::new(127, 0, 0, 3)),
                IpAddr::V4(Ipv4Addr::new(127, 0, 0, 4))
            ]
        );
    }
}
