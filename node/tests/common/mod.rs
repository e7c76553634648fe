//! Helpers shared by the integration tests: process guard, tiny backends, a tiny
//! HTTP client, the gRPC client.
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

pub const BIN: &str = env!("CARGO_BIN_EXE_lbscale-node");

/// Kills (SIGKILL) the process it guards when dropped.
pub struct Proc {
    pub child: Child,
    pub name: String,
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Proc {
    pub fn spawn(name: &str, args: &[&str], log: &Path) -> Proc {
        let log = std::fs::File::create(log).expect("create log file");
        let child = Command::new(BIN)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(log)
            .spawn()
            .expect("spawn lbscale-node");
        Proc {
            child,
            name: name.into(),
        }
    }

    /// Waits for the `ready` line on stdout.
    pub fn wait_ready(&mut self, timeout: Duration) {
        let out = self.child.stdout.take().expect("stdout piped");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut lines = BufReader::new(out).lines();
            while let Some(Ok(l)) = lines.next() {
                if l.trim() == "ready" {
                    let _ = tx.send(());
                }
            }
        });
        rx.recv_timeout(timeout)
            .unwrap_or_else(|_| panic!("{}: no `ready` line within {timeout:?}", self.name));
    }
}

pub fn tmpdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("lbscale-node-test-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Waits until `f` holds, panicking with `what` after `timeout`.
pub async fn wait_until<F: FnMut() -> bool>(what: &str, timeout: Duration, mut f: F) {
    let end = Instant::now() + timeout;
    while !f() {
        if Instant::now() > end {
            panic!("timed out after {timeout:?} waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A tiny HTTP/1.1 backend answering its name, with keep-alive. `/slow` waits
/// 1.5 s; `/big` answers 1 MB.
pub struct HttpBackend {
    pub addr: SocketAddr,
    pub hits: Arc<AtomicU64>,
    /// Connections accepted.
    pub conns: Arc<AtomicU64>,
    /// Arrival time of every request (HTTP backends).
    pub stamps: Arc<std::sync::Mutex<Vec<Instant>>>,
    task: tokio::task::JoinHandle<()>,
    /// Dropped with the backend: the open connections of an HTTP backend close
    /// too, as when a real backend stops.
    _stop: tokio::sync::watch::Sender<()>,
}

impl Drop for HttpBackend {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl HttpBackend {
    pub fn hits(&self) -> u64 {
        self.hits.load(Ordering::SeqCst)
    }
}

pub async fn http_backend(addr: &str, name: &'static str) -> HttpBackend {
    http_backend_with_delay(addr, name, Duration::ZERO).await
}

/// Like [`http_backend`], answering every request after `delay`.
pub async fn http_backend_with_delay(
    addr: &str,
    name: &'static str,
    delay: Duration,
) -> HttpBackend {
    let l = TcpListener::bind(addr)
        .await
        .unwrap_or_else(|e| panic!("bind backend {addr}: {e}"));
    let addr = l.local_addr().unwrap();
    let hits = Arc::new(AtomicU64::new(0));
    let conns = Arc::new(AtomicU64::new(0));
    let stamps = Arc::new(std::sync::Mutex::new(Vec::new()));
    let h = hits.clone();
    let cc = conns.clone();
    let st = stamps.clone();
    let (stop, stopped) = tokio::sync::watch::channel(());
    let task = tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = l.accept().await else {
                return;
            };
            cc.fetch_add(1, Ordering::SeqCst);
            let h = h.clone();
            let st = st.clone();
            let mut stopped = stopped.clone();
            tokio::spawn(async move {
                tokio::select! {
                    _ = stopped.changed() => {}
                    _ = serve_http(&mut s, h, st, name, delay) => {}
                }
            });
        }
    });
    HttpBackend {
        addr,
        hits,
        conns,
        stamps,
        task,
        _stop: stop,
    }
}

/// Answers the requests of one backend connection until it closes.
async fn serve_http(
    s: &mut TcpStream,
    h: Arc<AtomicU64>,
    st: Arc<std::sync::Mutex<Vec<Instant>>>,
    name: &'static str,
    delay: Duration,
) {
    let mut buf = Vec::new();
    let mut tmp = [0u8; 4096];
    loop {
        // Read one request head (requests carry no body in these tests).
        let end = loop {
            if let Some(p) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                break p + 4;
            }
            match s.read(&mut tmp).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&tmp[..n]),
            }
        };
        let head = String::from_utf8_lossy(&buf[..end]).to_string();
        buf.drain(..end);
        h.fetch_add(1, Ordering::SeqCst);
        st.lock().unwrap().push(Instant::now());
        let path = head.split_whitespace().nth(1).unwrap_or("/").to_string();
        if path.starts_with("/slow") {
            tokio::time::sleep(Duration::from_millis(1500)).await;
        } else if !delay.is_zero() {
            tokio::time::sleep(delay).await;
        }
        let body: Vec<u8> = if path.starts_with("/big") {
            vec![b'x'; 1 << 20]
        } else {
            name.as_bytes().to_vec()
        };
        let resp = format!(
            "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nX-Backend: {name}\r\n\r\n",
            body.len()
        );
        if s.write_all(resp.as_bytes()).await.is_err() || s.write_all(&body).await.is_err() {
            return;
        }
    }
}

/// A TCP backend that writes `name\n` on connect, then echoes.
pub async fn tcp_backend(addr: &str, name: &'static str) -> HttpBackend {
    let l = TcpListener::bind(addr)
        .await
        .unwrap_or_else(|e| panic!("bind backend {addr}: {e}"));
    let addr = l.local_addr().unwrap();
    let hits = Arc::new(AtomicU64::new(0));
    let h = hits.clone();
    // Its connections outlive it (tests of draining rely on that).
    let (stop, _) = tokio::sync::watch::channel(());
    let task = tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = l.accept().await else {
                return;
            };
            h.fetch_add(1, Ordering::SeqCst);
            tokio::spawn(async move {
                if s.write_all(format!("{name}\n").as_bytes()).await.is_err() {
                    return;
                }
                let mut tmp = [0u8; 4096];
                loop {
                    match s.read(&mut tmp).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => {
                            if s.write_all(&tmp[..n]).await.is_err() {
                                return;
                            }
                        }
                    }
                }
            });
        }
    });
    HttpBackend {
        addr,
        hits: hits.clone(),
        conns: hits,
        stamps: Arc::new(std::sync::Mutex::new(Vec::new())),
        task,
        _stop: stop,
    }
}

pub struct HttpResp {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl HttpResp {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// Sends one GET on `s` and reads the response (Content-Length framing).
pub async fn http_request(s: &mut TcpStream, path: &str) -> std::io::Result<HttpResp> {
    http_request_with(s, path, &[]).await
}

/// Like [`http_request`], with extra request headers.
pub async fn http_request_with(
    s: &mut TcpStream,
    path: &str,
    headers: &[(&str, &str)],
) -> std::io::Result<HttpResp> {
    let mut req = format!("GET {path} HTTP/1.1\r\nHost: test\r\n");
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    s.write_all(req.as_bytes()).await?;
    let mut buf = Vec::new();
    let mut tmp = [0u8; 65536];
    let end = loop {
        if let Some(p) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break p + 4;
        }
        let n = s.read(&mut tmp).await?;
        if n == 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "eof before response head",
            ));
        }
        buf.extend_from_slice(&tmp[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..end]).to_string();
    let mut lines = head.split("\r\n");
    let status: u16 = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
        .collect();
    let len: usize = headers
        .iter()
        .find(|(k, _)| k.eq_ignore_ascii_case("content-length"))
        .and_then(|(_, v)| v.parse().ok())
        .unwrap_or(0);
    let mut body = buf[end..].to_vec();
    while body.len() < len {
        let n = s.read(&mut tmp).await?;
        if n == 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "eof in body",
            ));
        }
        body.extend_from_slice(&tmp[..n]);
    }
    Ok(HttpResp {
        status,
        headers,
        body,
    })
}

/// One GET on a new connection, with a timeout.
pub async fn http_get(addr: &str, path: &str) -> HttpResp {
    let fut = async {
        let mut s = TcpStream::connect(addr).await?;
        http_request(&mut s, path).await
    };
    tokio::time::timeout(Duration::from_secs(5), fut)
        .await
        .unwrap_or_else(|_| panic!("GET {addr}{path}: no response within 5 s"))
        .unwrap_or_else(|e| panic!("GET {addr}{path}: {e}"))
}

// --- UDP ----------------------------------------------------------------------

/// A UDP-only backend answering every datagram with `name:` and the datagram.
pub async fn udp_echo(addr: &str, name: &'static str) -> tokio::task::JoinHandle<()> {
    let s = tokio::net::UdpSocket::bind(addr)
        .await
        .unwrap_or_else(|e| panic!("bind udp backend {addr}: {e}"));
    tokio::spawn(async move {
        let mut buf = [0u8; 1500];
        loop {
            let Ok((n, peer)) = s.recv_from(&mut buf).await else {
                return;
            };
            let mut out = format!("{name}:").into_bytes();
            out.extend_from_slice(&buf[..n]);
            let _ = s.send_to(&out, peer).await;
        }
    })
}

// --- `serve` and its gRPC API -------------------------------------------------

/// The group secret and the node whose credentials, issued as the engine
/// issues them, every test node's API gets.
pub const SECRET: &str = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";
pub const API_NODE: &str = "node-under-test";

/// Writes node `node`'s API files (the token file holding `token_file`, or the
/// hash of its token) into `dir`; returns `serve`'s options for them.
pub fn api_files(dir: &Path, node: &str, token_file: Option<&str>) -> Vec<String> {
    let c = lbscale_engine::nodeapi::auth::node_credentials(SECRET, node).unwrap();
    let mut args = Vec::new();
    for (option, name, content) in [
        ("--token-file", "token", token_file.unwrap_or(&c.token_file)),
        ("--tls-ca", "ca.pem", &c.ca_pem),
        ("--tls-cert", "node.pem", &c.cert_pem),
        ("--tls-key", "node-key.pem", &c.key_pem),
    ] {
        std::fs::write(dir.join(name), content).unwrap();
        args.extend([option.to_string(), dir.join(name).display().to_string()]);
    }
    args
}

/// A TLS channel to the API at `addr` (IP:PORT) that expects node `node`'s
/// certificate and shows `client` (certificate and key PEM), if any.
pub async fn api_channel(
    addr: &str,
    node: &str,
    ca_pem: &str,
    client: Option<(String, String)>,
) -> Result<tonic::transport::Channel, String> {
    use tonic::transport::{Certificate, Channel, ClientTlsConfig, Identity};
    let mut tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(ca_pem))
        .domain_name(lbscale_engine::nodeapi::auth::node_name(node));
    if let Some((cert, key)) = client {
        tls = tls.identity(Identity::from_pem(cert, key));
    }
    let endpoint = Channel::from_shared(format!("https://{addr}"))
        .unwrap()
        .tls_config(tls)
        .unwrap();
    let connect = endpoint.connect();
    match tokio::time::timeout(Duration::from_secs(5), connect).await {
        Ok(r) => r.map_err(|e| {
            let mut s = e.to_string();
            let mut src = std::error::Error::source(&e);
            while let Some(e) = src {
                s = format!("{s}: {e}");
                src = e.source();
            }
            s
        }),
        Err(_) => Err(format!("no connection to {addr} within 5 s")),
    }
}

/// A client of the API at `addr` for node `node` of the test group, as the
/// engine connects, carrying `token` (none: no token).
pub async fn api_client_with(addr: &str, node: &str, token: Option<&str>) -> Client {
    let ca = lbscale_engine::nodeapi::auth::GroupCa::derive(SECRET).unwrap();
    let ch = api_channel(addr, node, &ca.cert_pem(), Some(ca.issue_engine().unwrap()))
        .await
        .expect("connect to node API");
    let hv: Option<tonic::metadata::MetadataValue<_>> =
        token.map(|t| format!("Bearer {t}").parse().unwrap());
    #[allow(clippy::result_large_err)]
    let f: AddToken = Box::new(move |mut r: tonic::Request<()>| {
        if let Some(hv) = &hv {
            r.metadata_mut()
                .insert(lbscale_proto::AUTH_HEADER, hv.clone());
        }
        Ok(r)
    });
    lbscale_proto::node_api_client::NodeApiClient::with_interceptor(ch, f)
}

pub type AddToken =
    Box<dyn FnMut(tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> + Send>;
pub type Client = lbscale_proto::node_api_client::NodeApiClient<
    tonic::service::interceptor::InterceptedService<tonic::transport::Channel, AddToken>,
>;

/// Starts `lbscale-node serve` on `ip` (API port 7070) with `extra` options; returns
/// the process guard and the directory holding `node.log`.
pub fn start_serve(name: &str, ip: &str, extra: &[&str]) -> (Proc, PathBuf) {
    let dir = tmpdir(name);
    let files = api_files(&dir, API_NODE, None);
    let mut args = vec![
        "serve",
        "--node-id",
        name,
        "--listen-ip",
        ip,
        "--api-port",
        "7070",
        "--memory-limit-mb",
        "512",
    ];
    args.extend(files.iter().map(String::as_str));
    args.extend_from_slice(extra);
    let mut p = Proc::spawn(name, &args, &dir.join("node.log"));
    p.wait_ready(Duration::from_secs(10));
    (p, dir)
}

pub async fn api_client(ip: &str) -> Client {
    let token = lbscale_engine::nodeapi::auth::node_token(SECRET, API_NODE);
    api_client_with(&format!("{ip}:7070"), API_NODE, Some(&token)).await
}

// --- load ---------------------------------------------------------------------

/// Sends GET / at a fixed rate over a pool of keep-alive connections.
pub struct Load {
    pub stop: Arc<AtomicBool>,
    pub errors: Arc<AtomicU64>,
    pub task: tokio::task::JoinHandle<()>,
}

pub fn start_load(vip: &'static str, rate: f64) -> Load {
    let stop = Arc::new(AtomicBool::new(false));
    let errors = Arc::new(AtomicU64::new(0));
    let (st, er) = (stop.clone(), errors.clone());
    let task = tokio::spawn(async move {
        let pool: Arc<Mutex<Vec<TcpStream>>> = Arc::new(Mutex::new(Vec::new()));
        let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / rate));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
        while !st.load(Ordering::Relaxed) {
            tick.tick().await;
            let pool = pool.clone();
            let er = er.clone();
            tokio::spawn(async move {
                let conn = pool.lock().unwrap().pop();
                let r = tokio::time::timeout(Duration::from_secs(5), async move {
                    let mut s = match conn {
                        Some(s) => s,
                        None => TcpStream::connect(vip).await?,
                    };
                    let r = http_request(&mut s, "/").await?;
                    Ok::<_, std::io::Error>((s, r.status))
                })
                .await;
                match r {
                    Ok(Ok((s, 200))) => pool.lock().unwrap().push(s),
                    _ => {
                        er.fetch_add(1, Ordering::Relaxed);
                    }
                }
            });
        }
    });
    Load { stop, errors, task }
}

impl Load {
    /// Stops sending; the number of requests that failed.
    pub async fn finish(self) -> u64 {
        self.stop.store(true, Ordering::Relaxed);
        tokio::time::timeout(Duration::from_secs(5), self.task)
            .await
            .expect("load generator stops within 5 s")
            .unwrap();
        // Requests still in flight end within their own timeout.
        tokio::time::sleep(Duration::from_millis(200)).await;
        self.errors.load(Ordering::Relaxed)
    }
}

/// The group peers of a test node: every address 1-20 of its /24, where the
/// tests of a file put their nodes (clients connect from 127.0.0.1, backends
/// are .100 and up), so that a primary's forwarded connections, which start
/// with a PROXY header, are recognised as such.
pub fn test_group_peers(ip: &str) -> Vec<String> {
    let prefix = ip.rsplit_once('.').expect("an IPv4 address").0;
    (1..=20).map(|i| format!("{prefix}.{i}")).collect()
}

/// A service's `requests_total` as the node reports it (GetStats).
pub async fn requests_total(cl: &mut Client, service: &str) -> u64 {
    let s = tokio::time::timeout(
        Duration::from_secs(5),
        cl.get_stats(lbscale_proto::StatsRequest::default()),
    )
    .await
    .expect("GetStats within 5 s")
    .expect("GetStats")
    .into_inner();
    s.services
        .iter()
        .find(|x| x.service == service)
        .unwrap_or_else(|| panic!("no stats for {service}"))
        .requests_total
}
