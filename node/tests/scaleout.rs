//! Native SE scale-out through real `serve` processes: a primary that forwards the
//! secondaries' share of connections (L4) by lbscale-core's CPU-equalising plan,
//! source NAT on the secondaries, scale-in with `scalein_timeout_ms`, and the
//! fallback to the primary when a secondary is unreachable.

mod common;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use common::*;
use lbscale_core::seplan::{plan, PlanParams, ScalingMode};
use lbscale_proto::{
    LbMethod, NodeConfig, NodeStats, Scaleout, ScaleoutPeer, ScaleoutRole, Service, ServiceType,
    StatsRequest, Vserver,
};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};

/// A TCP backend that writes the source address it sees (`IP\n`) on connect,
/// then echoes.
async fn source_tcp_backend(addr: &str) -> tokio::task::JoinHandle<()> {
    let l = TcpListener::bind(addr).await.unwrap();
    tokio::spawn(async move {
        while let Ok((mut s, from)) = l.accept().await {
            tokio::spawn(async move {
                if s.write_all(format!("{}\n", from.ip()).as_bytes())
                    .await
                    .is_err()
                {
                    return;
                }
                let mut tmp = [0u8; 1024];
                while let Ok(n) = s.read(&mut tmp).await {
                    if n == 0 || s.write_all(&tmp[..n]).await.is_err() {
                        return;
                    }
                }
            });
        }
    })
}

/// An HTTP backend answering every request with the source address of its
/// connection (the node that proxied it), keep-alive.
async fn source_http_backend(addr: &str) -> tokio::task::JoinHandle<()> {
    let l = TcpListener::bind(addr).await.unwrap();
    tokio::spawn(async move {
        while let Ok((mut s, from)) = l.accept().await {
            tokio::spawn(async move {
                let body = from.ip().to_string();
                let mut buf: Vec<u8> = Vec::new();
                let mut tmp = [0u8; 4096];
                loop {
                    while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
                        match s.read(&mut tmp).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&tmp[..n]),
                        }
                    }
                    let end = buf.windows(4).position(|w| w == b"\r\n\r\n").unwrap() + 4;
                    // The X-Forwarded-For it was sent, echoed as x-seen-xff.
                    let head = String::from_utf8_lossy(&buf[..end]).to_string();
                    let xff = head
                        .lines()
                        .find_map(|l| {
                            let (k, v) = l.split_once(':')?;
                            k.eq_ignore_ascii_case("x-forwarded-for")
                                .then(|| v.trim().to_string())
                        })
                        .unwrap_or_default();
                    buf.drain(..end);
                    let resp = format!(
                        "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nx-seen-xff: {xff}\r\n\r\n{body}",
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

fn service(addr: &str) -> Service {
    let a: SocketAddr = addr.parse().unwrap();
    Service {
        name: format!("svc-{}", a.port()),
        address: a.ip().to_string(),
        port: a.port() as u32,
        weight: 1,
        enabled: true,
        cap_per_second: None,
        custom_load: None,
    }
}

fn vserver(name: &str, t: ServiceType, port: u32, backend: &str, so: Option<Scaleout>) -> Vserver {
    Vserver {
        name: name.into(),
        service_type: t as i32,
        port,
        lb_method: LbMethod::Roundrobin as i32,
        persistence: "NONE".into(),
        services: vec![service(backend)],
        slow_start: None,
        scaleout: so,
        ramp_peers: vec![],
        ..Default::default()
    }
}

fn primary(shares: &[f64], secondaries: &[&str], scalein_timeout_ms: u64) -> Scaleout {
    Scaleout {
        role: ScaleoutRole::Primary as i32,
        primary_share: shares[0],
        secondaries: secondaries
            .iter()
            .zip(&shares[1..])
            .map(|(a, s)| ScaleoutPeer {
                address: a.to_string(),
                share: *s,
            })
            .collect(),
        scalein_timeout_ms,
    }
}

fn secondary() -> Option<Scaleout> {
    Some(Scaleout {
        role: ScaleoutRole::Secondary as i32,
        ..Default::default()
    })
}

async fn configure(ip: &str, version: u64, vservers: Vec<Vserver>) {
    let mut cl = api_client(ip).await;
    tokio::time::timeout(
        Duration::from_secs(5),
        cl.configure(NodeConfig {
            version,
            vservers,
            group_peers: test_group_peers(ip),
            fence: 0,
        }),
    )
    .await
    .expect("Configure within 5 s")
    .unwrap_or_else(|e| panic!("Configure {ip}: {e}"));
}

async fn stats(ip: &str) -> NodeStats {
    let mut cl = api_client(ip).await;
    tokio::time::timeout(
        Duration::from_secs(5),
        cl.get_stats(StatsRequest::default()),
    )
    .await
    .expect("GetStats within 5 s")
    .expect("GetStats")
    .into_inner()
}

/// Opens a TCP connection and returns it with its first line (the backend's view
/// of the source address).
async fn tcp_open(addr: &str) -> (BufReader<TcpStream>, String) {
    let fut = async {
        let s = TcpStream::connect(addr).await.unwrap();
        let mut r = BufReader::new(s);
        let mut line = String::new();
        r.read_line(&mut line).await.unwrap();
        (r, line.trim().to_string())
    };
    tokio::time::timeout(Duration::from_secs(5), fut)
        .await
        .unwrap_or_else(|_| panic!("{addr}: no first line within 5 s"))
}

/// Runs `n` jobs, `width` at a time; returns their results in order.
async fn fan_out<F, Fut, T>(n: usize, width: usize, f: F) -> Vec<T>
where
    F: Fn(usize) -> Fut,
    Fut: std::future::Future<Output = T> + Send + 'static,
    T: Send + 'static,
{
    let mut out = Vec::with_capacity(n);
    let mut i = 0;
    while i < n {
        let batch: Vec<_> = (i..(i + width).min(n))
            .map(|k| tokio::spawn(f(k)))
            .collect();
        for h in batch {
            out.push(h.await.unwrap());
        }
        i += width;
    }
    out
}

fn count(sources: &[String]) -> HashMap<String, usize> {
    let mut m = HashMap::new();
    for s in sources {
        *m.entry(s.clone()).or_insert(0) += 1;
    }
    m
}

const NODES: [&str; 4] = ["127.86.1.1", "127.86.1.2", "127.86.1.3", "127.86.1.4"];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn primary_forwards_the_secondaries_share_with_source_nat() {
    let _tb = source_tcp_backend("127.86.1.100:9000").await;
    let _hb = source_http_backend("127.86.1.100:9001").await;
    let _procs: Vec<_> = NODES
        .iter()
        .enumerate()
        .map(|(i, ip)| start_serve(&format!("so-{i}"), ip, &["--health-interval-ms", "0"]))
        .collect();
    let p = plan(
        &PlanParams {
            mode: ScalingMode::Native,
            forwarding_cost: 0.3,
            ..Default::default()
        },
        4,
    );
    assert_eq!(p.shares.len(), 4);
    let so = primary(&p.shares, &NODES[1..], 30_000);
    let vss = |so: Option<Scaleout>| {
        vec![
            vserver(
                "tcp",
                ServiceType::Tcp,
                8080,
                "127.86.1.100:9000",
                so.clone(),
            ),
            vserver("web", ServiceType::Http, 8081, "127.86.1.100:9001", so),
        ]
    };
    configure(NODES[0], 1, vss(Some(so))).await;
    for ip in &NODES[1..] {
        configure(ip, 1, vss(secondary())).await;
    }

    // TCP: each connection reports which node's address reached the backend.
    let n_tcp = 800;
    let started = Instant::now();
    let tcp_sources = fan_out(n_tcp, 16, |_| async {
        let (_s, src) = tcp_open("127.86.1.1:8080").await;
        src
    })
    .await;
    let tcp_secs = started.elapsed().as_secs_f64();
    // HTTP: one GET per connection; the body is the source address the backend saw.
    let n_http = 600;
    let http_sources = fan_out(n_http, 16, |_| async {
        let r = http_get("127.86.1.1:8081", "/").await;
        assert_eq!(r.status, 200);
        let node = r.header("x-lbscale-node").unwrap_or("?").to_string();
        let xff = r.header("x-seen-xff").unwrap_or("").to_string();
        (String::from_utf8_lossy(&r.body).to_string(), node, xff)
    })
    .await;
    // X-Forwarded-For names the client wherever it was served: on a secondary,
    // the client the primary announced, not the primary.
    let xffs: std::collections::BTreeSet<&str> =
        http_sources.iter().map(|x| x.2.as_str()).collect();
    assert_eq!(xffs.len(), 1, "one client, one X-Forwarded-For: {xffs:?}");
    assert!(
        xffs.iter().all(|x| !x.is_empty() && !NODES.contains(x)),
        "X-Forwarded-For names a node, not the client: {xffs:?}"
    );

    let tcp_counts = count(&tcp_sources);
    let http_counts = count(&http_sources.iter().map(|x| x.0.clone()).collect::<Vec<_>>());
    // Source NAT: the backend sees the serving node's own address, and for HTTP that
    // is the node that answered (x-lbscale-node names it).
    for (src, node, _) in &http_sources {
        let i = NODES
            .iter()
            .position(|n| n == src)
            .unwrap_or_else(|| panic!("source {src}"));
        assert_eq!(
            node,
            &format!("so-{i}"),
            "HTTP served by {node} but seen from {src}"
        );
    }
    let mut report = Vec::new();
    for (kind, n, counts) in [("tcp", n_tcp, &tcp_counts), ("web", n_http, &http_counts)] {
        assert!(
            counts.keys().all(|k| NODES.contains(&k.as_str())),
            "{kind}: sources outside the nodes: {counts:?}"
        );
        for (i, ip) in NODES.iter().enumerate() {
            let got = counts.get(*ip).copied().unwrap_or(0);
            let want = p.shares[i] * n as f64;
            report.push(format!(
                "{kind} {ip}: {got} (share {:.3} -> {want:.1})",
                p.shares[i]
            ));
            assert!(
                (got as f64 - want).abs() <= 0.02 * n as f64,
                "{kind}: node {ip} served {got} of {n}, share {} wants {want:.1}: {counts:?}",
                p.shares[i]
            );
        }
    }
    eprintln!(
        "{n_tcp} TCP connections in {tcp_secs:.2} s\n{}",
        report.join("\n")
    );

    // The nodes' own statistics agree: served per vserver, forwarded per secondary.
    wait_until_async("forwarded connections closed", || async {
        stats(NODES[0])
            .await
            .forwarded
            .iter()
            .all(|f| f.active_connections == 0)
    })
    .await;
    let primary_stats = stats(NODES[0]).await;
    for (vs, counts) in [("tcp", &tcp_counts), ("web", &http_counts)] {
        assert_eq!(
            primary_stats.served_connections_total.get(vs).copied(),
            Some(counts.get(NODES[0]).copied().unwrap_or(0) as u64),
            "{vs}: primary served"
        );
        for ip in &NODES[1..] {
            let f = primary_stats
                .forwarded
                .iter()
                .find(|f| f.vserver == vs && f.peer == *ip)
                .unwrap_or_else(|| panic!("{vs}: no ForwardStats for {ip}"));
            assert_eq!(
                f.connections_total,
                counts.get(*ip).copied().unwrap_or(0) as u64
            );
            let s = stats(ip).await;
            assert_eq!(
                s.served_connections_total.get(vs).copied(),
                Some(counts.get(*ip).copied().unwrap_or(0) as u64),
                "{vs}: {ip} served"
            );
            assert!(s.forwarded.is_empty(), "a secondary forwards nothing");
        }
    }
}

/// Polls an async condition every 50 ms for up to 10 s.
async fn wait_until_async<F, Fut>(what: &str, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let end = Instant::now() + Duration::from_secs(10);
    while !f().await {
        assert!(Instant::now() < end, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Writes a line and reads its echo; false when the connection is closed.
async fn echoes(s: &mut BufReader<TcpStream>) -> bool {
    let fut = async {
        s.get_mut().write_all(b"ping\n").await.ok()?;
        let mut line = String::new();
        let n = s.read_line(&mut line).await.ok()?;
        (n > 0 && line == "ping\n").then_some(())
    };
    matches!(
        tokio::time::timeout(Duration::from_secs(3), fut).await,
        Ok(Some(()))
    )
}

/// Whether the peer closed the connection (EOF or reset) within `wait`.
async fn closed_within(s: &mut BufReader<TcpStream>, wait: Duration) -> bool {
    let mut tmp = [0u8; 64];
    matches!(
        tokio::time::timeout(wait, s.read(&mut tmp)).await,
        Ok(Ok(0)) | Ok(Err(_))
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leaving_secondary_keeps_its_connections_until_the_scalein_timeout() {
    let nodes = ["127.86.2.1", "127.86.2.2", "127.86.2.3"];
    let _tb = source_tcp_backend("127.86.2.100:9000").await;
    let _procs: Vec<_> = nodes
        .iter()
        .enumerate()
        .map(|(i, ip)| start_serve(&format!("si-{i}"), ip, &["--health-interval-ms", "0"]))
        .collect();
    let shares = [0.2, 0.4, 0.4];
    let vs = |so| {
        vec![vserver(
            "tcp",
            ServiceType::Tcp,
            8080,
            "127.86.2.100:9000",
            so,
        )]
    };
    configure(nodes[0], 1, vs(Some(primary(&shares, &nodes[1..], 1500)))).await;
    for ip in &nodes[1..] {
        configure(ip, 1, vs(secondary())).await;
    }
    // Long-lived connections, spread over the three nodes.
    let mut conns = Vec::new();
    for _ in 0..30 {
        conns.push(tcp_open("127.86.2.1:8080").await);
    }
    let leaving = nodes[2];
    let staying = nodes[1];
    let on = |ip: &str| conns.iter().filter(|c| c.1 == ip).count();
    assert_eq!((on(nodes[0]), on(staying), on(leaving)), (6, 12, 12));
    let st = stats(nodes[0]).await;
    let f = st.forwarded.iter().find(|f| f.peer == leaving).unwrap();
    assert_eq!((f.connections_total, f.active_connections), (12, 12));

    // The primary drops the third node, with a 1.5 s scale-in timeout.
    let t0 = Instant::now();
    configure(
        nodes[0],
        2,
        vs(Some(primary(&[0.5, 0.5], &nodes[1..2], 1500))),
    )
    .await;
    let mut fresh = Vec::new();
    for _ in 0..40 {
        fresh.push(tcp_open("127.86.2.1:8080").await);
    }
    assert!(
        fresh.iter().all(|c| c.1 != leaving),
        "new connections went to the leaving secondary"
    );
    // Before the timeout its connections still work.
    for c in conns.iter_mut().filter(|c| c.1 == leaving) {
        assert!(
            echoes(&mut c.0).await,
            "a forwarded connection stopped before the timeout"
        );
    }
    assert!(
        t0.elapsed() < Duration::from_millis(1300),
        "too slow to check before the timeout"
    );
    let st = stats(nodes[0]).await;
    let f = st
        .forwarded
        .iter()
        .find(|f| f.peer == leaving)
        .expect("leaving peer in stats");
    assert_eq!(f.active_connections, 12);

    // After it, the primary closes them; the others go on.
    for c in conns.iter_mut().filter(|c| c.1 == leaving) {
        let wait = Duration::from_millis(3000).saturating_sub(t0.elapsed());
        assert!(
            closed_within(&mut c.0, wait).await,
            "still open 3 s after a 1.5 s scale-in timeout"
        );
    }
    let closed_after = t0.elapsed();
    assert!(
        closed_after >= Duration::from_millis(1450),
        "closed too early: {closed_after:?}"
    );
    for c in conns.iter_mut().filter(|c| c.1 != leaving) {
        assert!(echoes(&mut c.0).await, "a connection to {} was closed", c.1);
    }
    wait_until_async(
        "no active forwarded connection to the leaving secondary",
        || async {
            stats(nodes[0])
                .await
                .forwarded
                .iter()
                .all(|f| f.peer != leaving || f.active_connections == 0)
        },
    )
    .await;
    let st = stats(nodes[0]).await;
    let f = st.forwarded.iter().find(|f| f.peer == staying).unwrap();
    let fresh_on_staying = fresh.iter().filter(|c| c.1 == staying).count() as u64;
    assert!(
        (19..=21).contains(&fresh_on_staying),
        "{fresh_on_staying} of 40 at share 0.5"
    );
    assert_eq!(f.active_connections, 12 + fresh_on_staying);
    eprintln!("leaving secondary's connections closed {closed_after:?} after Configure");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_secondary_leaves_the_connection_to_the_primary() {
    let _tb = source_tcp_backend("127.86.3.100:9000").await;
    let (_p, _d) = start_serve("unreach", "127.86.3.1", &["--health-interval-ms", "0"]);
    // Nothing listens on 127.86.3.9: the secondary refuses.
    let so = primary(&[0.25, 0.75], &["127.86.3.9"], 1000);
    configure(
        "127.86.3.1",
        1,
        vec![vserver(
            "tcp",
            ServiceType::Tcp,
            8080,
            "127.86.3.100:9000",
            Some(so),
        )],
    )
    .await;
    for _ in 0..20 {
        let (mut c, src) = tcp_open("127.86.3.1:8080").await;
        assert_eq!(src, "127.86.3.1");
        assert!(echoes(&mut c).await);
    }
    let st = stats("127.86.3.1").await;
    assert_eq!(st.served_connections_total.get("tcp").copied(), Some(20));
    let f = &st.forwarded[0];
    assert_eq!((f.peer.as_str(), f.connections_total), ("127.86.3.9", 0));
}

/// Bad shares are refused and change nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_scaleout_is_refused() {
    let (_p, _d) = start_serve("badso", "127.86.4.1", &["--health-interval-ms", "0"]);
    let mut cl = api_client("127.86.4.1").await;
    let mut so = primary(&[0.5, -0.5], &["127.86.4.2"], 0);
    let r = cl
        .configure(NodeConfig {
            group_peers: Vec::new(),
            fence: 0,
            version: 1,
            vservers: vec![vserver(
                "tcp",
                ServiceType::Tcp,
                8080,
                "127.86.4.100:9000",
                Some(so.clone()),
            )],
        })
        .await;
    assert_eq!(r.unwrap_err().code(), tonic::Code::InvalidArgument);
    so.secondaries = vec![
        ScaleoutPeer {
            address: "127.86.4.2".into(),
            share: 0.5,
        },
        ScaleoutPeer {
            address: "127.86.4.2".into(),
            share: 0.5,
        },
    ];
    let r = cl
        .configure(NodeConfig {
            group_peers: Vec::new(),
            fence: 0,
            version: 2,
            vservers: vec![vserver(
                "tcp",
                ServiceType::Tcp,
                8080,
                "127.86.4.100:9000",
                Some(so),
            )],
        })
        .await;
    assert_eq!(r.unwrap_err().code(), tonic::Code::InvalidArgument);
    // The node itself as its own secondary would forward without end.
    let so = primary(&[0.5, 0.5], &["127.86.4.1"], 0);
    let r = cl
        .configure(NodeConfig {
            group_peers: Vec::new(),
            fence: 0,
            version: 3,
            vservers: vec![vserver(
                "tcp",
                ServiceType::Tcp,
                8080,
                "127.86.4.100:9000",
                Some(so),
            )],
        })
        .await;
    assert_eq!(r.unwrap_err().code(), tonic::Code::InvalidArgument);
}

/// UDP: the primary forwards flows (client addresses) by the shares too, and the
/// backend sees the serving node's address.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn udp_flows_follow_the_shares() {
    let nodes = ["127.86.5.1", "127.86.5.2", "127.86.5.3"];
    let backend = tokio::net::UdpSocket::bind("127.86.5.100:5300")
        .await
        .unwrap();
    let _echo = tokio::spawn(async move {
        let mut buf = [0u8; 512];
        while let Ok((_, from)) = backend.recv_from(&mut buf).await {
            let _ = backend
                .send_to(from.ip().to_string().as_bytes(), from)
                .await;
        }
    });
    let _procs: Vec<_> = nodes
        .iter()
        .enumerate()
        .map(|(i, ip)| start_serve(&format!("udp-{i}"), ip, &["--health-interval-ms", "0"]))
        .collect();
    let shares = [0.2, 0.4, 0.4];
    let vs = |so| {
        vec![vserver(
            "dns",
            ServiceType::Udp,
            5300,
            "127.86.5.100:5300",
            so,
        )]
    };
    configure(nodes[0], 1, vs(Some(primary(&shares, &nodes[1..], 1000)))).await;
    for ip in &nodes[1..] {
        configure(ip, 1, vs(secondary())).await;
    }
    let n = 150;
    let mut sources = Vec::new();
    let mut clients = Vec::new();
    for _ in 0..n {
        let c = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
        c.connect("127.86.5.1:5300").await.unwrap();
        let mut buf = [0u8; 64];
        let mut got = None;
        for _ in 0..3 {
            c.send(b"q").await.unwrap();
            if let Ok(Ok(k)) =
                tokio::time::timeout(Duration::from_millis(500), c.recv(&mut buf)).await
            {
                got = Some(String::from_utf8_lossy(&buf[..k]).to_string());
                break;
            }
        }
        sources.push(got.expect("a UDP reply"));
        clients.push(c); // keep the flow's client address taken
    }
    let counts = count(&sources);
    eprintln!("{n} UDP flows: {counts:?}");
    for (i, ip) in nodes.iter().enumerate() {
        let got = counts.get(*ip).copied().unwrap_or(0) as f64;
        assert!((got - shares[i] * n as f64).abs() <= 2.0, "{counts:?}");
    }
    let st = stats(nodes[0]).await;
    assert_eq!(
        st.served_connections_total.get("dns").copied(),
        Some(counts.get(nodes[0]).copied().unwrap_or(0) as u64)
    );
    for ip in &nodes[1..] {
        let f = st.forwarded.iter().find(|f| f.peer == *ip).unwrap();
        assert_eq!(
            f.connections_total,
            counts.get(*ip).copied().unwrap_or(0) as u64
        );
    }
}

/// A secondary that joins ramps under slow start against the older nodes, its
/// primary among them: what it passes on to the primary is served there, not
/// routed by the shares again (which would send part of it back and forth).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_joining_secondarys_overflow_to_its_primary_does_not_loop() {
    let backend = "127.91.1.100:9001";
    let _b = source_tcp_backend(backend).await;
    let (_p, _) = start_serve("loop-p", "127.91.1.1", &[]);
    let (_n, _) = start_serve("loop-n", "127.91.1.2", &[]);
    let shares = plan(
        &PlanParams {
            mode: ScalingMode::Native,
            forwarding_cost: 0.3,
            ..Default::default()
        },
        2,
    )
    .shares;
    configure(
        "127.91.1.1",
        1,
        vec![vserver(
            "web",
            ServiceType::Tcp,
            9000,
            backend,
            Some(primary(&shares, &["127.91.1.2"], 30_000)),
        )],
    )
    .await;
    // The joining node holds its service at 1 connection/s (manual slow start)
    // and passes the rest on to its ramp peer, the primary.
    let mut joining = vserver("web", ServiceType::Tcp, 9000, backend, secondary());
    joining.slow_start = Some(lbscale_proto::SlowStart {
        new_service_request: 1,
        unit: lbscale_proto::SlowStartUnit::PerSecond as i32,
        increment_interval_s: 0,
    });
    joining.ramp_peers = vec!["127.91.1.1".into()];
    configure("127.91.1.2", 1, vec![joining]).await;

    let n = 200;
    let started = std::time::Instant::now();
    let opened = fan_out(n, 20, |_| tcp_open("127.91.1.1:9000")).await;
    // What the held rate (1/s) allows the joining node over the run, plus its
    // first token and one for a second that had begun.
    let held = started.elapsed().as_secs() as usize + 2;
    let sources: Vec<String> = opened.iter().map(|(_, src)| src.clone()).collect();
    let by_source = count(&sources);
    assert_eq!(sources.len(), n);
    let p = stats("127.91.1.1").await;
    let forwarded: u64 = p.forwarded.iter().map(|f| f.connections_total).sum();
    let want = shares[1] * n as f64;
    assert!(
        (forwarded as f64 - want).abs() <= 3.0,
        "the primary forwarded {forwarded} connections, its plan says {want:.1}"
    );
    // Every client connection reached the backend once: the primary served what
    // the joining node passed back (the backend saw the primary as the source).
    // The joining node itself serves at most its held rate (1/s, plus a token):
    // bounded by the run's length, which a loaded machine stretches.
    assert!(
        by_source.get("127.91.1.2").copied().unwrap_or(0) <= held
            && by_source.get("127.91.1.1").copied().unwrap_or(0) >= n - held,
        "sources seen by the backend: {by_source:?} (the joining node may serve {held})"
    );
    assert!(
        p.total_connections <= (n as f64 + want + 3.0) as u64,
        "the primary accepted {} connections for {n} clients: forwarding looped",
        p.total_connections
    );
    drop(opened);
}

/// A PROXY v2 header naming `client`, as a primary sends before a forwarded
/// connection (the test builds the bytes itself, from the PROXY protocol spec).
fn proxy_v2(client: SocketAddr, dst: SocketAddr) -> Vec<u8> {
    let (SocketAddr::V4(c), SocketAddr::V4(d)) = (client, dst) else {
        panic!("IPv4 only here")
    };
    let mut h = b"\r\n\r\n\0\r\nQUIT\n".to_vec();
    h.extend_from_slice(&[0x21, 0x11, 0, 12]);
    h.extend_from_slice(&c.ip().octets());
    h.extend_from_slice(&d.ip().octets());
    h.extend_from_slice(&c.port().to_be_bytes());
    h.extend_from_slice(&d.port().to_be_bytes());
    h
}

/// What a TCP vserver passes on to its echo backend when a connection starts
/// with a PROXY header and `ping\n`, from `local` (the client's address).
async fn echoed_through(vip: SocketAddr, local: &str) -> Vec<u8> {
    let sock = tokio::net::TcpSocket::new_v4().unwrap();
    sock.bind(format!("{local}:0").parse().unwrap()).unwrap();
    let mut s = tokio::time::timeout(Duration::from_secs(5), sock.connect(vip))
        .await
        .expect("connect within 5 s")
        .unwrap();
    let mut out = proxy_v2("203.0.113.7:4242".parse().unwrap(), vip);
    out.extend_from_slice(b"ping\n");
    s.write_all(&out).await.unwrap();
    s.shutdown().await.unwrap();
    let mut got = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut got))
        .await
        .expect("the echo within 5 s")
        .unwrap();
    got
}

/// A node removes the PROXY header of a connection from another node of its
/// group whatever its role (here none: a secondary just dropped from a span, say,
/// while its primary still forwards), so that it never reaches a service; from
/// any other address the bytes are the client's and go through untouched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_proxy_header_is_removed_from_group_peers_only() {
    let (_p, _d) = start_serve("proxyhdr", "127.86.6.1", &["--health-interval-ms", "0"]);
    let _b = tcp_backend("127.86.6.100:9000", "echo").await;
    configure(
        "127.86.6.1",
        1,
        vec![vserver(
            "tcp",
            ServiceType::Tcp,
            8080,
            "127.86.6.100:9000",
            None,
        )],
    )
    .await;
    let vip: SocketAddr = "127.86.6.1:8080".parse().unwrap();
    // 127.86.6.2 is a group peer (test_group_peers): header removed.
    let from_peer = echoed_through(vip, "127.86.6.2").await;
    assert_eq!(
        from_peer,
        b"echo\nping\n",
        "{:?}",
        String::from_utf8_lossy(&from_peer)
    );
    // 127.0.0.5 is not: the backend gets every byte the client sent.
    let from_client = echoed_through(vip, "127.0.0.5").await;
    let mut want = b"echo\n".to_vec();
    want.extend_from_slice(&proxy_v2("203.0.113.7:4242".parse().unwrap(), vip));
    want.extend_from_slice(b"ping\n");
    assert_eq!(from_client, want);
}
