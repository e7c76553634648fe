//! The node's data plane is bounded: a flood of UDP sources or connections
//! costs it its budget, never its management API; services that do not answer
//! in time get a timeout, not a hung client; a request head has a limit.
//! The real binary under a low open-files limit, real sockets.

mod common;

use std::net::SocketAddr;
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use lbscale_proto::{LbMethod, NodeConfig, Service, ServiceType, StatsRequest, Vserver};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpStream, UdpSocket};

/// Starts `lbscale-node serve` on `ip` (API port 7070) with its open-files
/// limit (soft and hard) at `nofile`.
fn start_limited(name: &str, ip: &str, nofile: u64, extra: &[&str]) -> (Proc, std::path::PathBuf) {
    let dir = tmpdir(name);
    let files = api_files(&dir, API_NODE, None);
    let log = std::fs::File::create(dir.join("node.log")).unwrap();
    let mut cmd = Command::new(BIN);
    cmd.args([
        "serve",
        "--node-id",
        name,
        "--listen-ip",
        ip,
        "--api-port",
        "7070",
        "--memory-limit-mb",
        "512",
    ])
    .args(&files)
    .args(extra)
    .stdin(Stdio::null())
    .stdout(Stdio::piped())
    .stderr(log);
    // SAFETY: only setrlimit, async-signal-safe, between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            let r = libc::rlimit {
                rlim_cur: nofile,
                rlim_max: nofile,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &r) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut p = Proc {
        child: cmd.spawn().expect("spawn lbscale-node"),
        name: name.into(),
    };
    p.wait_ready(Duration::from_secs(10));
    (p, dir)
}

fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count())
        .unwrap_or(0)
}

fn svc(name: &str, addr: SocketAddr) -> Service {
    Service {
        name: name.into(),
        address: addr.ip().to_string(),
        port: addr.port() as u32,
        weight: 1,
        enabled: true,
        cap_per_second: None,
        custom_load: None,
    }
}

fn vserver(t: ServiceType, port: u16, services: Vec<Service>) -> Vserver {
    Vserver {
        name: "vs".into(),
        service_type: t as i32,
        port: port as u32,
        lb_method: LbMethod::Roundrobin as i32,
        persistence: "NONE".into(),
        services,
        ..Default::default()
    }
}

async fn configure(cl: &mut Client, v: Vserver) {
    tokio::time::timeout(
        Duration::from_secs(10),
        cl.configure(NodeConfig {
            version: 1,
            vservers: vec![v],
            ..Default::default()
        }),
    )
    .await
    .expect("Configure within 10 s")
    .expect("Configure");
}

/// The node's API answers GetStats within 5 s (a new connection).
async fn api_answers(ip: &str) -> bool {
    let stats = async {
        let mut cl = api_client(ip).await;
        cl.get_stats(StatsRequest::default()).await
    };
    matches!(
        tokio::time::timeout(Duration::from_secs(5), stats).await,
        Ok(Ok(_))
    )
}

/// A new client's query through `vip` is answered, within `tries` tries.
async fn udp_answers(vip: &str, tries: u32) -> bool {
    for i in 0..tries {
        let c = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        c.connect(vip).await.unwrap();
        let msg = format!("probe{i}");
        c.send(msg.as_bytes()).await.unwrap();
        let mut buf = [0u8; 1500];
        if let Ok(Ok(n)) = tokio::time::timeout(Duration::from_millis(1000), c.recv(&mut buf)).await
        {
            if String::from_utf8_lossy(&buf[..n]).ends_with(&msg) {
                return true;
            }
        }
    }
    false
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_udp_sources_leaves_the_api_and_the_vserver_answering() {
    const NOFILE: u64 = 4096;
    let _echo = udp_echo("127.77.60.100:5353", "echo").await;
    let (mut node, dir) = start_limited("udpflood", "127.77.60.1", NOFILE, &[]);
    let pid = node.child.id();
    let mut cl = api_client("127.77.60.1").await;
    let sa: SocketAddr = "127.77.60.100:5353".parse().unwrap();
    configure(
        &mut cl,
        vserver(ServiceType::Udp, 5353, vec![svc("echo", sa)]),
    )
    .await;
    assert!(
        udp_answers("127.77.60.1:5353", 3).await,
        "served before the flood"
    );

    // 20,000 sources (4 addresses x 5,000 ports), each sending one datagram.
    let max_fds = Arc::new(AtomicUsize::new(0));
    let watching = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let (m, w) = (max_fds.clone(), watching.clone());
    let watcher = tokio::spawn(async move {
        while w.load(Ordering::Relaxed) {
            m.fetch_max(open_fds(pid), Ordering::Relaxed);
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    });
    let started = Instant::now();
    let sent = tokio::task::spawn_blocking(|| {
        let vip: SocketAddr = "127.77.60.1:5353".parse().unwrap();
        let mut sent = 0u32;
        for ip in 2..=5u8 {
            for port in 40000..45000u16 {
                let Ok(s) = std::net::UdpSocket::bind(SocketAddr::from(([127, 77, 60, ip], port)))
                else {
                    continue;
                };
                if s.send_to(b"flood", vip).is_ok() {
                    sent += 1;
                }
                if sent.is_multiple_of(500) {
                    // About 4,000 sources a second.
                    std::thread::sleep(Duration::from_millis(100));
                }
            }
        }
        sent
    })
    .await
    .unwrap();
    let flood = started.elapsed();
    assert!(sent >= 19_000, "the flood sent from {sent} sources only");

    // While the flood's flows are still open (they idle out after 30 s).
    assert!(
        node.child.try_wait().unwrap().is_none(),
        "the node exited during the flood; log: {}",
        std::fs::read_to_string(dir.join("node.log")).unwrap_or_default()
    );
    assert!(
        api_answers("127.77.60.1").await,
        "the management API does not answer after the flood"
    );
    assert!(
        udp_answers("127.77.60.1:5353", 5).await,
        "a new UDP client gets no answer after the flood"
    );
    watching.store(false, Ordering::Relaxed);
    watcher.await.unwrap();
    let max = max_fds.load(Ordering::Relaxed);
    eprintln!("flood: {sent} sources in {flood:?}; the node's descriptors peaked at {max}");
    assert!(
        max < NOFILE as usize,
        "the node's descriptors reached its limit: {max}"
    );
    assert!(
        max > 1000,
        "the flood opened few flows ({max} descriptors): not a flood"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_outlives_running_out_of_descriptors() {
    let (mut node, dir) = start_limited("apifds", "127.77.61.1", 64, &[]);
    // Connections held open past the node's descriptors: accept fails (EMFILE).
    let mut held = Vec::new();
    for _ in 0..100 {
        if let Ok(Ok(s)) = tokio::time::timeout(
            Duration::from_millis(500),
            TcpStream::connect("127.77.61.1:7070"),
        )
        .await
        {
            held.push(s);
        }
    }
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(
        node.child.try_wait().unwrap().is_none(),
        "the node exited when it ran out of descriptors; log: {}",
        std::fs::read_to_string(dir.join("node.log")).unwrap_or_default()
    );
    drop(held);
    let end = Instant::now() + Duration::from_secs(15);
    while !api_answers("127.77.61.1").await {
        assert!(
            Instant::now() < end,
            "the API does not answer once descriptors are free again"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let log = std::fs::read_to_string(dir.join("node.log")).unwrap();
    assert!(
        log.contains("accept failed; retrying"),
        "the accept errors are logged: {log}"
    );
}

/// Reads from `s` until it closes or `wait` passes; true when it closed.
async fn closes_within(s: &mut TcpStream, wait: Duration) -> bool {
    let mut buf = [0u8; 256];
    let end = Instant::now() + wait;
    loop {
        let left = end.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, s.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return true,
            Ok(Ok(_)) => continue,
            Err(_) => return false,
        }
    }
}

/// One line from a TCP vserver connection (the backend's greeting).
async fn greeting(s: &mut TcpStream) -> String {
    let mut buf = [0u8; 64];
    let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf))
        .await
        .expect("greeting within 5 s")
        .expect("greeting");
    String::from_utf8_lossy(&buf[..n]).trim().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vserver_takes_at_most_max_connections() {
    let b = tcp_backend("127.77.62.100:9000", "tcp").await;
    let (_node, _dir) = start_serve("maxconn", "127.77.62.1", &[]);
    let mut cl = api_client("127.77.62.1").await;
    let mut v = vserver(ServiceType::Tcp, 9000, vec![svc("b", b.addr)]);
    v.max_connections = 2;
    configure(&mut cl, v).await;
    let vip = "127.77.62.1:9000";
    let mut c1 = TcpStream::connect(vip).await.unwrap();
    let mut c2 = TcpStream::connect(vip).await.unwrap();
    assert_eq!(greeting(&mut c1).await, "tcp");
    assert_eq!(greeting(&mut c2).await, "tcp");
    let mut c3 = TcpStream::connect(vip).await.unwrap();
    assert!(
        closes_within(&mut c3, Duration::from_secs(2)).await,
        "a third connection past max_connections 2 is served"
    );
    drop(c1);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut c4 = TcpStream::connect(vip).await.unwrap();
    assert_eq!(greeting(&mut c4).await, "tcp", "room again once one closed");
    c2.write_all(b"x").await.unwrap();
}

/// A listener whose accept queue is full: a new connection's SYN goes
/// unanswered, as towards a host that is gone.
fn blackhole(addr: &str) -> (std::net::TcpListener, std::net::TcpStream) {
    let a: SocketAddr = addr.parse().unwrap();
    let SocketAddr::V4(a4) = a else {
        panic!("IPv4")
    };
    // SAFETY: plain socket calls on a descriptor owned here.
    let l = unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0);
        assert!(fd >= 0);
        let sa = libc::sockaddr_in {
            sin_family: libc::AF_INET as libc::sa_family_t,
            sin_port: a4.port().to_be(),
            sin_addr: libc::in_addr {
                s_addr: u32::from(*a4.ip()).to_be(),
            },
            sin_zero: [0; 8],
        };
        let r = libc::bind(
            fd,
            &sa as *const libc::sockaddr_in as *const libc::sockaddr,
            std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
        );
        assert_eq!(r, 0, "bind {addr}");
        assert_eq!(libc::listen(fd, 0), 0);
        <std::net::TcpListener as std::os::fd::FromRawFd>::from_raw_fd(fd)
    };
    // The one connection the queue holds.
    let filler = std::net::TcpStream::connect(a).unwrap();
    (l, filler)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backend_that_does_not_accept_times_out() {
    let _hole = blackhole("127.77.63.100:8000");
    let (_node, _dir) = start_serve(
        "connecttimeout",
        "127.77.63.1",
        &["--connect-timeout-ms", "500", "--health-interval-ms", "0"],
    );
    let mut cl = api_client("127.77.63.1").await;
    let sa: SocketAddr = "127.77.63.100:8000".parse().unwrap();
    configure(
        &mut cl,
        vserver(ServiceType::Http, 8080, vec![svc("hole", sa)]),
    )
    .await;
    let start = Instant::now();
    let r = http_get("127.77.63.1:8080", "/").await;
    assert_eq!(r.status, 502, "a service that cannot be connected to");
    assert!(
        start.elapsed() < Duration::from_secs(3),
        "answered after {:?}",
        start.elapsed()
    );
    // TCP: the client's connection closes instead of hanging.
    let mut v = vserver(ServiceType::Tcp, 9000, vec![svc("hole", sa)]);
    v.name = "tcp".into();
    cl.configure(NodeConfig {
        version: 2,
        vservers: vec![vserver(ServiceType::Http, 8080, vec![svc("hole", sa)]), v],
        ..Default::default()
    })
    .await
    .unwrap();
    let mut c = TcpStream::connect("127.77.63.1:9000").await.unwrap();
    assert!(
        closes_within(&mut c, Duration::from_secs(3)).await,
        "a TCP connection to a service that does not accept stays open"
    );
}

/// An HTTP backend that reads requests and never answers.
async fn silent_http(addr: &str) -> tokio::task::JoinHandle<()> {
    let l = tokio::net::TcpListener::bind(addr).await.unwrap();
    tokio::spawn(async move {
        let mut open = Vec::new();
        while let Ok((s, _)) = l.accept().await {
            open.push(s);
        }
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn response_headers_that_do_not_come_time_out() {
    let _b = silent_http("127.77.64.100:8000").await;
    let (_node, _dir) = start_serve(
        "headertimeout",
        "127.77.64.1",
        &["--response-header-timeout-ms", "700"],
    );
    let mut cl = api_client("127.77.64.1").await;
    let sa: SocketAddr = "127.77.64.100:8000".parse().unwrap();
    configure(
        &mut cl,
        vserver(ServiceType::Http, 8080, vec![svc("mute", sa)]),
    )
    .await;
    let start = Instant::now();
    let r = http_get("127.77.64.1:8080", "/").await;
    assert_eq!(r.status, 504);
    assert!(start.elapsed() >= Duration::from_millis(600));
}

/// An HTTP backend answering with the `X-Forwarded-For` fields it got, one per
/// line, and the size of the request head.
async fn xff_echo(addr: &str) -> tokio::task::JoinHandle<()> {
    let l = tokio::net::TcpListener::bind(addr).await.unwrap();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut tmp = [0u8; 8192];
                loop {
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
                    let xff: Vec<&str> = head
                        .split("\r\n")
                        .filter_map(|l| l.split_once(':'))
                        .filter(|(k, _)| k.eq_ignore_ascii_case("x-forwarded-for"))
                        .map(|(_, v)| v.trim())
                        .collect();
                    let body = format!("{}\nhead={}", xff.join("\n"), head.len());
                    let resp = format!(
                        "HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n{body}",
                        body.len()
                    );
                    if s.write_all(resp.as_bytes()).await.is_err() {
                        return;
                    }
                }
            });
        }
    })
}

async fn get_with(addr: &str, headers: &[(&str, &str)]) -> std::io::Result<HttpResp> {
    tokio::time::timeout(Duration::from_secs(5), async {
        let mut s = TcpStream::connect(addr).await?;
        http_request_with(&mut s, "/", headers).await
    })
    .await
    .expect("a response within 5 s")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_heads_are_limited_and_x_forwarded_for_is_appended_to() {
    let _b = xff_echo("127.77.65.100:8000").await;
    let (_node, _dir) = start_serve("heads", "127.77.65.1", &[]);
    let mut cl = api_client("127.77.65.1").await;
    let sa: SocketAddr = "127.77.65.100:8000".parse().unwrap();
    configure(
        &mut cl,
        vserver(ServiceType::Http, 8080, vec![svc("xff", sa)]),
    )
    .await;
    let vip = "127.77.65.1:8080";

    // No X-Forwarded-For from the client: the node names it.
    let r = get_with(vip, &[]).await.unwrap();
    assert_eq!(r.status, 200);
    let body = String::from_utf8_lossy(&r.body).to_string();
    assert_eq!(body.lines().next(), Some("127.0.0.1"), "{body}");

    // The client's own list (two fields) is kept, joined, and the client appended.
    let r = get_with(
        vip,
        &[
            ("X-Forwarded-For", "203.0.113.7"),
            ("X-Forwarded-For", "198.51.100.2"),
        ],
    )
    .await
    .unwrap();
    let body = String::from_utf8_lossy(&r.body).to_string();
    let fields: Vec<&str> = body.lines().filter(|l| !l.starts_with("head=")).collect();
    assert_eq!(
        fields,
        ["203.0.113.7, 198.51.100.2, 127.0.0.1"],
        "one X-Forwarded-For field, the client's list then the client"
    );

    // 16 KiB of headers pass the default 32 KiB limit; 64 KiB are refused.
    let small = "a".repeat(16 * 1024);
    let r = get_with(vip, &[("X-Big", &small)]).await.unwrap();
    assert_eq!(r.status, 200);
    let big = "a".repeat(64 * 1024);
    let r = get_with(vip, &[("X-Big", &big)]).await;
    match r {
        Ok(r) => assert_eq!(r.status, 431, "a 64 KiB header is refused"),
        Err(e) => panic!("no 431 for a 64 KiB header: {e}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dns_over_tcp_takes_at_most_its_cap() {
    let dir = tmpdir("dnscap");
    let config = dir.join("dns.json");
    std::fs::write(
        &config,
        r#"{"version":1,"zones":[{"domain":"app.test","addresses":["192.0.2.1"]}]}"#,
    )
    .unwrap();
    let status = dir.join("status.json");
    let _p = Proc::spawn(
        "dnscap",
        &[
            "dns",
            "--listen",
            "127.77.66.1:5353",
            "--config",
            config.to_str().unwrap(),
            "--status",
            status.to_str().unwrap(),
        ],
        &dir.join("dns.log"),
    );
    wait_until("the DNS server's status", Duration::from_secs(10), || {
        std::fs::read_to_string(&status)
            .ok()
            .and_then(|s| serde_json::from_str::<serde_json::Value>(&s).ok())
            .is_some_and(|v| v["version"] == 1)
    })
    .await;
    // 256 idle connections (the cap) are held; the next one is closed at once.
    let mut held = Vec::new();
    for _ in 0..256 {
        held.push(TcpStream::connect("127.77.66.1:5353").await.unwrap());
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut extra = TcpStream::connect("127.77.66.1:5353").await.unwrap();
    assert!(
        closes_within(&mut extra, Duration::from_secs(3)).await,
        "a connection past the DNS-over-TCP cap is kept"
    );
    // Room again once one closes.
    drop(held.pop());
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut s = TcpStream::connect("127.77.66.1:5353").await.unwrap();
    let q = [
        0x12u8, 0x34, 0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0, 3, b'a', b'p', b'p', 4, b't', b'e', b's',
        b't', 0, 0, 1, 0, 1,
    ];
    let mut msg = (q.len() as u16).to_be_bytes().to_vec();
    msg.extend_from_slice(&q);
    s.write_all(&msg).await.unwrap();
    let mut len = [0u8; 2];
    tokio::time::timeout(Duration::from_secs(3), s.read_exact(&mut len))
        .await
        .expect("a DNS answer over TCP within 3 s")
        .expect("a DNS answer over TCP");
    assert!(u16::from_be_bytes(len) > 12);
}
