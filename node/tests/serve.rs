//! Integration tests of `lbscale-node serve`: the real binary, real backends, the
//! gRPC API with its bearer token.

mod common;

use std::time::{Duration, Instant};

use common::*;
use lbscale_proto::{
    DrainRequest, LbMethod, NodeConfig, Service, ServiceType, StatsRequest, Vserver,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const TOKEN: &str = "s3cret-token-value";

struct TestNode {
    proc: Proc,
    api: String,
    dir: std::path::PathBuf,
}

fn start_node(name: &str, ip: &str) -> TestNode {
    start_node_with_token_file(name, ip, &format!("{TOKEN}\n"))
}

/// A node whose token file holds `content` (the token, or `sha256:HEX`).
fn start_node_with_token_file(name: &str, ip: &str, content: &str) -> TestNode {
    let dir = tmpdir(name);
    let files = api_files(&dir, API_NODE, Some(content));
    let port = "7070";
    let mut args = vec![
        "serve",
        "--node-id",
        name,
        "--listen-ip",
        ip,
        "--api-port",
        port,
        "--memory-limit-mb",
        "512",
    ];
    args.extend(files.iter().map(String::as_str));
    let mut proc = Proc::spawn(name, &args, &dir.join("node.log"));
    proc.wait_ready(Duration::from_secs(10));
    TestNode {
        proc,
        api: format!("{ip}:{port}"),
        dir,
    }
}

async fn client_with(api: &str, token: Option<&str>) -> Client {
    api_client_with(api, API_NODE, token).await
}

async fn client(node: &TestNode) -> Client {
    client_with(&node.api, Some(TOKEN)).await
}

fn svc(name: &str, addr: std::net::SocketAddr, weight: u32, enabled: bool) -> Service {
    Service {
        name: name.into(),
        address: addr.ip().to_string(),
        port: addr.port() as u32,
        weight,
        enabled,
        cap_per_second: None,
        custom_load: None,
    }
}

fn vserver(name: &str, t: ServiceType, port: u16, m: LbMethod, services: Vec<Service>) -> Vserver {
    Vserver {
        name: name.into(),
        service_type: t as i32,
        port: port as u32,
        lb_method: m as i32,
        persistence: "NONE".into(),
        services,
        slow_start: None,
        scaleout: None,
        ramp_peers: vec![],
        ..Default::default()
    }
}

async fn configure(c: &mut Client, version: u64, vservers: Vec<Vserver>) -> u64 {
    c.configure(NodeConfig {
        version,
        vservers,
        ..Default::default()
    })
    .await
    .expect("configure")
    .into_inner()
    .applied_version
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_or_missing_token_is_refused() {
    let node = start_node("auth", "127.77.0.1");
    let mut bad = client_with(&node.api, Some("not-the-token")).await;
    let e = bad
        .get_stats(StatsRequest::default())
        .await
        .expect_err("wrong token must be refused");
    assert_eq!(e.code(), tonic::Code::Unauthenticated);
    let e = bad
        .configure(NodeConfig {
            group_peers: Vec::new(),
            fence: 0,
            version: 1,
            vservers: vec![],
        })
        .await
        .expect_err("wrong token");
    assert_eq!(e.code(), tonic::Code::Unauthenticated);
    let mut none = client_with(&node.api, None).await;
    let e = none
        .drain(DrainRequest { timeout_ms: 10 })
        .await
        .expect_err("missing token must be refused");
    assert_eq!(e.code(), tonic::Code::Unauthenticated);
    let mut good = client(&node).await;
    let s = good
        .get_stats(StatsRequest::default())
        .await
        .expect("good token")
        .into_inner();
    assert_eq!(s.node_id, "auth");
    assert_eq!(
        s.state, "active",
        "a refused Drain must not have drained the node"
    );
    let log = std::fs::read_to_string(node.dir.join("node.log")).unwrap();
    assert!(!log.contains(TOKEN), "the token must never be logged");
}

/// A token file with the token's SHA-256 (as a cloud instance's user data
/// carries it): the token is accepted, the hash itself and other tokens are not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_file_may_hold_the_tokens_sha256_only() {
    use sha2::Digest;
    let hex: String = sha2::Sha256::digest(TOKEN.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let hashed = format!("sha256:{hex}");
    let node = start_node_with_token_file("authhash", "127.77.9.1", &format!("{hashed}\n"));
    let s = client(&node)
        .await
        .get_stats(StatsRequest::default())
        .await
        .expect("the token whose hash the file holds")
        .into_inner();
    assert_eq!(s.node_id, "authhash");
    for wrong in [hashed.as_str(), hex.as_str(), "not-the-token"] {
        let e = client_with(&node.api, Some(wrong))
            .await
            .get_stats(StatsRequest::default())
            .await
            .expect_err("only the token itself is accepted");
        assert_eq!(e.code(), tonic::Code::Unauthenticated, "{wrong}");
    }
    // A malformed hash is refused at start, naming the file.
    let dir = tmpdir("authbad");
    let bad = dir.join("token");
    std::fs::write(&bad, "sha256:abc\n").unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_lbscale-node"))
        .args([
            "serve",
            "--node-id",
            "authbad",
            "--listen-ip",
            "127.77.9.2",
            "--api-port",
            "7070",
        ])
        .args([
            "--token-file",
            bad.to_str().unwrap(),
            "--memory-limit-mb",
            "64",
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("64 hex digits") && err.contains("token"),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_round_robin_weights_and_disabled() {
    let a = http_backend("127.77.1.10:8001", "alpha").await;
    let b = http_backend("127.77.1.11:8001", "beta").await;
    let c = http_backend("127.77.1.12:8001", "gamma").await;
    let node = start_node("rr", "127.77.1.1");
    let mut cl = client(&node).await;
    let v = configure(
        &mut cl,
        1,
        vec![vserver(
            "web",
            ServiceType::Http,
            8080,
            LbMethod::Roundrobin,
            vec![
                svc("a", a.addr, 1, true),
                svc("b", b.addr, 1, true),
                svc("c", c.addr, 1, false),
            ],
        )],
    )
    .await;
    assert_eq!(v, 1);
    let vip = "127.77.1.1:8080";
    let mut seen = Vec::new();
    for _ in 0..6 {
        let r = http_get(vip, "/").await;
        assert_eq!(r.status, 200);
        assert_eq!(r.header("x-lbscale-node"), Some("rr"));
        assert_eq!(
            r.header("x-lbscale-service").unwrap(),
            String::from_utf8_lossy(&r.body)
                .replace("alpha", "a")
                .replace("beta", "b")
        );
        seen.push(r.header("x-lbscale-service").unwrap().to_string());
    }
    for w in seen.windows(2) {
        assert_ne!(w[0], w[1], "round robin must alternate: {seen:?}");
    }
    assert_eq!(c.hits(), 0, "a disabled service gets nothing");

    // Keep-alive: several requests on one client connection.
    let mut s = TcpStream::connect(vip).await.unwrap();
    for _ in 0..4 {
        let r = tokio::time::timeout(Duration::from_secs(5), http_request(&mut s, "/"))
            .await
            .expect("keep-alive response")
            .unwrap();
        assert_eq!(r.status, 200);
    }

    // Weights 3:1 (c still disabled, whatever its weight).
    configure(
        &mut cl,
        2,
        vec![vserver(
            "web",
            ServiceType::Http,
            8080,
            LbMethod::Roundrobin,
            vec![
                svc("a", a.addr, 3, true),
                svc("b", b.addr, 1, true),
                svc("c", c.addr, 5, false),
            ],
        )],
    )
    .await;
    let (a0, b0) = (a.hits(), b.hits());
    for _ in 0..40 {
        assert_eq!(http_get(vip, "/").await.status, 200);
    }
    assert_eq!(
        (a.hits() - a0, b.hits() - b0),
        (30, 10),
        "weights 3:1 over 40 requests"
    );
    assert_eq!(c.hits(), 0);

    // Upstream connections are kept alive and reused.
    assert!(
        a.conns.load(std::sync::atomic::Ordering::SeqCst) <= 3,
        "backend a saw {} connections for {} requests",
        a.conns.load(std::sync::atomic::Ordering::SeqCst),
        a.hits()
    );

    // Nothing enabled → 503.
    configure(
        &mut cl,
        3,
        vec![vserver(
            "web",
            ServiceType::Http,
            8080,
            LbMethod::Roundrobin,
            vec![svc("a", a.addr, 1, false)],
        )],
    )
    .await;
    assert_eq!(http_get(vip, "/").await.status, 503);

    let st = cl
        .get_stats(StatsRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(st.config_version, 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_least_connection_and_refused_backend() {
    let a = http_backend("127.77.2.10:8001", "alpha").await;
    let b = http_backend("127.77.2.11:8001", "beta").await;
    let node = start_node("lc", "127.77.2.1");
    let mut cl = client(&node).await;
    configure(
        &mut cl,
        1,
        vec![vserver(
            "web",
            ServiceType::Http,
            8080,
            LbMethod::Leastconnection,
            vec![svc("a", a.addr, 1, true), svc("b", b.addr, 1, true)],
        )],
    )
    .await;
    let vip = "127.77.2.1:8080";
    // Hold one slow request on one service; every other request must go to the other.
    let slow = tokio::spawn(async move { http_get(vip, "/slow").await });
    wait_until(
        "the slow request to reach a backend",
        Duration::from_secs(5),
        || a.hits() + b.hits() == 1,
    )
    .await;
    let busy = if a.hits() == 1 { "a" } else { "b" };
    for _ in 0..6 {
        let r = http_get(vip, "/").await;
        assert_eq!(r.status, 200);
        assert_ne!(
            r.header("x-lbscale-service"),
            Some(busy),
            "least connection must avoid the busy service"
        );
    }
    let r = tokio::time::timeout(Duration::from_secs(5), slow)
        .await
        .expect("slow request finishes")
        .unwrap();
    assert_eq!(r.header("x-lbscale-service"), Some(busy));

    // A service whose backend refuses connections: requests go to the other one.
    let dead: std::net::SocketAddr = "127.77.2.12:8001".parse().unwrap();
    configure(
        &mut cl,
        2,
        vec![vserver(
            "web",
            ServiceType::Http,
            8080,
            LbMethod::Roundrobin,
            vec![svc("dead", dead, 1, true), svc("b", b.addr, 1, true)],
        )],
    )
    .await;
    for _ in 0..6 {
        let r = http_get(vip, "/").await;
        assert_eq!(
            r.status, 200,
            "a refused backend must be retried on the next service"
        );
        assert_eq!(r.header("x-lbscale-service"), Some("b"));
    }
    configure(
        &mut cl,
        3,
        vec![vserver(
            "web",
            ServiceType::Http,
            8080,
            LbMethod::Roundrobin,
            vec![svc("dead", dead, 1, true)],
        )],
    )
    .await;
    assert_eq!(http_get(vip, "/").await.status, 502);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_relay_round_robin_and_bind_failure() {
    let a = tcp_backend("127.77.3.10:9001", "alpha").await;
    let b = tcp_backend("127.77.3.11:9001", "beta").await;
    let node = start_node("tcp", "127.77.3.1");
    let mut cl = client(&node).await;
    configure(
        &mut cl,
        1,
        vec![vserver(
            "db",
            ServiceType::Tcp,
            9000,
            LbMethod::Roundrobin,
            vec![svc("a", a.addr, 1, true), svc("b", b.addr, 1, true)],
        )],
    )
    .await;
    let mut names = Vec::new();
    for i in 0..4 {
        let mut s = tokio::time::timeout(
            Duration::from_secs(5),
            TcpStream::connect("127.77.3.1:9000"),
        )
        .await
        .unwrap()
        .unwrap();
        let msg = format!("ping{i}\n");
        s.write_all(msg.as_bytes()).await.unwrap();
        let mut got = Vec::new();
        let mut tmp = [0u8; 256];
        let want_len = 6 + msg.len(); // "alpha\n"/"beta\n" + echo
        let _ = tokio::time::timeout(Duration::from_secs(5), async {
            while !String::from_utf8_lossy(&got).ends_with(&msg) {
                let n = s.read(&mut tmp).await.unwrap();
                if n == 0 {
                    break;
                }
                got.extend_from_slice(&tmp[..n]);
            }
        })
        .await;
        let text = String::from_utf8_lossy(&got).to_string();
        assert!(
            text.ends_with(&msg),
            "echo through the relay, got {text:?} (want about {want_len} bytes)"
        );
        names.push(text.lines().next().unwrap().to_string());
    }
    assert_eq!(names, vec!["alpha", "beta", "alpha", "beta"]);

    // A port already taken: the configure fails naming the vserver and port, and
    // the previous vserver keeps working.
    let _blocker = std::net::TcpListener::bind("127.77.3.1:9100").unwrap();
    let e = cl
        .configure(NodeConfig {
            group_peers: Vec::new(),
            fence: 0,
            version: 2,
            vservers: vec![
                vserver(
                    "db",
                    ServiceType::Tcp,
                    9000,
                    LbMethod::Roundrobin,
                    vec![svc("a", a.addr, 1, true)],
                ),
                vserver(
                    "taken",
                    ServiceType::Http,
                    9100,
                    LbMethod::Roundrobin,
                    vec![svc("a", a.addr, 1, true)],
                ),
            ],
        })
        .await
        .expect_err("bind on a taken port must fail");
    assert!(matches!(
        e.code(),
        tonic::Code::FailedPrecondition | tonic::Code::InvalidArgument
    ));
    assert!(
        e.message().contains("taken") && e.message().contains("9100"),
        "message: {}",
        e.message()
    );
    let st = cl
        .get_stats(StatsRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        st.config_version, 1,
        "the failed configuration is not applied"
    );
    let mut s = TcpStream::connect("127.77.3.1:9000")
        .await
        .expect("previous vserver still listens");
    let mut tmp = [0u8; 16];
    let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut tmp))
        .await
        .unwrap()
        .unwrap();
    assert!(n > 0);

    // Removing the vserver closes its port.
    configure(&mut cl, 3, vec![]).await;
    assert!(
        TcpStream::connect("127.77.3.1:9000").await.is_err(),
        "removed vserver must stop listening"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stats_and_drain() {
    let a = http_backend("127.77.4.10:8001", "alpha").await;
    let t = tcp_backend("127.77.4.11:9001", "tee").await;
    let node = start_node("drain", "127.77.4.1");
    let mut cl = client(&node).await;
    configure(
        &mut cl,
        7,
        vec![
            vserver(
                "web",
                ServiceType::Http,
                8080,
                LbMethod::Roundrobin,
                vec![svc("a", a.addr, 1, true)],
            ),
            vserver(
                "raw",
                ServiceType::Tcp,
                9000,
                LbMethod::Leastconnection,
                vec![svc("t", t.addr, 1, true)],
            ),
        ],
    )
    .await;
    for _ in 0..5 {
        let r = http_get("127.77.4.1:8080", "/big").await;
        assert_eq!(r.body.len(), 1 << 20);
    }
    // Throughput is measured over ~1 s windows: wait for a window with the traffic.
    let start = Instant::now();
    let st = loop {
        let st = cl
            .get_stats(StatsRequest::default())
            .await
            .unwrap()
            .into_inner();
        if st.throughput_mbps > 0.0 || start.elapsed() > Duration::from_secs(3) {
            break st;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(
        st.throughput_mbps > 0.0,
        "throughput after 5 MB of traffic: {st:?}"
    );
    assert_eq!(st.node_id, "drain");
    assert_eq!(st.config_version, 7);
    assert_eq!(st.state, "active");
    assert!(st.total_connections >= 5);
    assert!(
        st.memory_percent > 0.0 && st.memory_percent < 100.0,
        "memory {}",
        st.memory_percent
    );
    assert!(st.uptime_ms > 0);
    let web_a = st
        .services
        .iter()
        .find(|s| s.vserver == "web" && s.service == "a")
        .expect("stats of web/a");
    assert_eq!(web_a.requests_total, 5);
    assert!(web_a.avg_response_ms > 0.0);

    // A long-lived TCP connection, then drain.
    let mut held = TcpStream::connect("127.77.4.1:9000").await.unwrap();
    let mut tmp = [0u8; 64];
    let n = tokio::time::timeout(Duration::from_secs(5), held.read(&mut tmp))
        .await
        .expect("greeting")
        .unwrap();
    assert_eq!(&tmp[..n], b"tee\n");
    let d = cl
        .drain(DrainRequest { timeout_ms: 1500 })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        d.active_connections, 1,
        "the held TCP connection is still active"
    );
    let st = cl
        .get_stats(StatsRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(st.state, "draining");
    assert!(
        TcpStream::connect("127.77.4.1:8080").await.is_err(),
        "no new connections while draining"
    );
    assert!(
        TcpStream::connect("127.77.4.1:9000").await.is_err(),
        "no new connections while draining"
    );
    // The existing connection still relays.
    held.write_all(b"still\n").await.unwrap();
    let n = tokio::time::timeout(Duration::from_secs(5), held.read(&mut tmp))
        .await
        .expect("echo while draining")
        .unwrap();
    assert_eq!(&tmp[..n], b"still\n");
    // After the timeout it is closed, and the node is drained.
    let closed = tokio::time::timeout(Duration::from_secs(5), held.read(&mut tmp))
        .await
        .expect("connection closed at the drain timeout");
    assert!(matches!(closed, Ok(0) | Err(_)));
    let start = Instant::now();
    loop {
        let st = cl
            .get_stats(StatsRequest::default())
            .await
            .unwrap()
            .into_inner();
        if st.state == "drained" {
            assert_eq!(st.active_connections, 0);
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(3),
            "node did not reach drained: {st:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Idempotent.
    let d = cl
        .drain(DrainRequest { timeout_ms: 1500 })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(d.active_connections, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_exits_zero() {
    let mut node = start_node("term", "127.77.5.1");
    let pid = node.proc.child.id() as i32;
    // SAFETY: plain kill(2) on our own child.
    unsafe { libc::kill(pid, libc::SIGTERM) };
    let start = Instant::now();
    loop {
        if let Some(st) = node.proc.child.try_wait().unwrap() {
            assert!(st.success(), "exit status {st:?}");
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(3),
            "node did not exit within 3 s of SIGTERM"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_start_cap_limits_a_service() {
    let a = http_backend("127.77.6.10:8001", "alpha").await;
    let b = http_backend("127.77.6.11:8001", "beta").await;
    let node = start_node("cap", "127.77.6.1");
    let mut cl = client(&node).await;
    let mut capped = svc("new", a.addr, 1, true);
    capped.cap_per_second = Some(5.0);
    configure(
        &mut cl,
        1,
        vec![vserver(
            "web",
            ServiceType::Http,
            8080,
            LbMethod::Roundrobin,
            vec![capped, svc("old", b.addr, 1, true)],
        )],
    )
    .await;
    let start = Instant::now();
    let mut s = TcpStream::connect("127.77.6.1:8080").await.unwrap();
    for _ in 0..150 {
        let r = tokio::time::timeout(Duration::from_secs(5), http_request(&mut s, "/"))
            .await
            .expect("response")
            .unwrap();
        assert_eq!(r.status, 200);
    }
    let secs = start.elapsed().as_secs_f64();
    let (na, nb) = (a.hits(), b.hits());
    assert_eq!(na + nb, 150);
    assert!(na >= 1, "the capped service still gets traffic");
    let allowed = (5.0 * secs).ceil() as u64 + 2;
    assert!(
        na <= allowed,
        "capped service got {na} requests in {secs:.2} s (cap 5/s, allowed {allowed})"
    );
    assert!(nb >= 150 - allowed);
    // The stats show the cap in force, and that it is not a slow-start ramp.
    let st = cl
        .get_stats(StatsRequest::default())
        .await
        .unwrap()
        .into_inner();
    let new = st.services.iter().find(|s| s.service == "new").unwrap();
    assert_eq!(new.cap_per_second, 5.0);
    assert!(
        !new.in_slow_start,
        "an explicit cap is not slow start: {new:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn udp_vserver_relays_per_flow() {
    let ta = udp_echo("127.77.7.10:5300", "alpha").await;
    let tb = udp_echo("127.77.7.11:5300", "beta").await;
    let node = start_node("udp", "127.77.7.1");
    let mut cl = client(&node).await;
    let sa: std::net::SocketAddr = "127.77.7.10:5300".parse().unwrap();
    let sb: std::net::SocketAddr = "127.77.7.11:5300".parse().unwrap();
    configure(
        &mut cl,
        1,
        vec![vserver(
            "dns",
            ServiceType::Udp,
            5300,
            LbMethod::Roundrobin,
            vec![svc("a", sa, 1, true), svc("b", sb, 1, true)],
        )],
    )
    .await;
    let mut got = Vec::new();
    for i in 0..2 {
        let c = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
        c.connect("127.77.7.1:5300").await.unwrap();
        let mut first = None;
        for j in 0..3 {
            c.send(format!("m{i}{j}").as_bytes()).await.unwrap();
            let mut buf = [0u8; 1500];
            let n = tokio::time::timeout(Duration::from_secs(5), c.recv(&mut buf))
                .await
                .expect("udp reply within 5 s")
                .unwrap();
            let text = String::from_utf8_lossy(&buf[..n]).to_string();
            let (who, msg) = text.split_once(':').unwrap();
            assert_eq!(msg, format!("m{i}{j}"));
            match &first {
                None => first = Some(who.to_string()),
                Some(f) => assert_eq!(f, who, "one flow sticks to one service"),
            }
        }
        got.push(first.unwrap());
    }
    got.sort();
    assert_eq!(
        got,
        vec!["alpha", "beta"],
        "two flows spread over both services"
    );
    ta.abort();
    tb.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn standalone_http_round_robin() {
    let a = http_backend("127.77.8.10:8001", "alpha").await;
    let b = http_backend("127.77.8.11:8001", "beta").await;
    let dir = tmpdir("standalone");
    let (sa, sb) = (a.addr.to_string(), b.addr.to_string());
    let mut p = Proc::spawn(
        "standalone",
        &[
            "standalone",
            "--listen",
            "127.77.8.1:8080",
            "--mode",
            "http",
            "--lb-method",
            "ROUNDROBIN",
            "--service",
            &sa,
            "--service",
            &sb,
        ],
        &dir.join("standalone.log"),
    );
    p.wait_ready(Duration::from_secs(10));
    let mut bodies = Vec::new();
    for _ in 0..4 {
        let r = http_get("127.77.8.1:8080", "/").await;
        assert_eq!(r.status, 200);
        bodies.push(String::from_utf8_lossy(&r.body).to_string());
    }
    assert_eq!(bodies, vec!["alpha", "beta", "alpha", "beta"]);
}
