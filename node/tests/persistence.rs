//! Vserver persistence through real `serve` processes: COOKIE (HTTP) and SOURCEIP
//! (HTTP per request, TCP per connection, UDP per flow), its idle timeout, a
//! service that can no longer take its persistent clients, the same cookie on two
//! nodes, and SOURCEIP behind native scale-out (primary → secondary).

mod common;

use std::collections::{HashMap, HashSet};
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use common::*;
use lbscale_proto::{
    LbMethod, NodeConfig, Scaleout, ScaleoutPeer, ScaleoutRole, Service, ServiceType, Vserver,
};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpSocket, TcpStream, UdpSocket};

const T: Duration = Duration::from_secs(5);

fn service(name: &str, addr: SocketAddr, enabled: bool) -> Service {
    Service {
        name: name.into(),
        address: addr.ip().to_string(),
        port: addr.port() as u32,
        weight: 1,
        enabled,
        cap_per_second: None,
        custom_load: None,
    }
}

fn vserver(
    name: &str,
    t: ServiceType,
    port: u32,
    persistence: &str,
    services: Vec<Service>,
) -> Vserver {
    Vserver {
        name: name.into(),
        service_type: t as i32,
        port,
        lb_method: LbMethod::Roundrobin as i32,
        persistence: persistence.into(),
        services,
        slow_start: None,
        scaleout: None,
        ramp_peers: vec![],
        ..Default::default()
    }
}

async fn configure(ip: &str, version: u64, vservers: Vec<Vserver>) {
    let mut cl = api_client(ip).await;
    let group_peers = test_group_peers(ip);
    tokio::time::timeout(
        T,
        cl.configure(NodeConfig {
            version,
            vservers,
            group_peers,
            fence: 0,
        }),
    )
    .await
    .expect("Configure within 5 s")
    .unwrap_or_else(|e| panic!("Configure {ip}: {e}"));
}

/// A connection to `to` from `from` (an address of the loopback network).
async fn connect_from(from: &str, to: &str) -> TcpStream {
    let s = TcpSocket::new_v4().unwrap();
    s.bind(SocketAddr::new(from.parse().unwrap(), 0)).unwrap();
    tokio::time::timeout(T, s.connect(to.parse().unwrap()))
        .await
        .unwrap_or_else(|_| panic!("connect {from} -> {to} within 5 s"))
        .unwrap_or_else(|e| panic!("connect {from} -> {to}: {e}"))
}

/// One GET on a new connection from `from`, with an optional cookie.
async fn get(from: &str, vip: &str, cookie: Option<&str>) -> HttpResp {
    let mut s = connect_from(from, vip).await;
    let h: Vec<(&str, &str)> = cookie.map(|c| ("Cookie", c)).into_iter().collect();
    tokio::time::timeout(T, http_request_with(&mut s, "/", &h))
        .await
        .unwrap_or_else(|_| panic!("GET {vip}: no response within 5 s"))
        .unwrap_or_else(|e| panic!("GET {vip}: {e}"))
}

fn served_by(r: &HttpResp) -> String {
    assert_eq!(r.status, 200);
    r.header("x-lbscale-service").unwrap_or("?").to_string()
}

/// The `name=value` part of a response's `Set-Cookie`, checking its attributes.
fn cookie_of(r: &HttpResp, name: &str) -> Option<String> {
    let v = r.header("set-cookie")?;
    let (nv, attrs) = v.split_once(';').unwrap_or((v, ""));
    assert!(
        nv.starts_with(&format!("{name}=")),
        "cookie name: {v:?} (want {name})"
    );
    assert!(attrs.contains("Path=/"), "{v:?}");
    assert!(attrs.contains("HttpOnly"), "{v:?}");
    Some(nv.trim().to_string())
}

/// One TCP connection from `from`: the first line the backend writes (its name).
async fn tcp_name(from: &str, vip: &str) -> String {
    let s = connect_from(from, vip).await;
    let mut r = BufReader::new(s);
    let mut line = String::new();
    tokio::time::timeout(T, r.read_line(&mut line))
        .await
        .unwrap_or_else(|_| panic!("{from} -> {vip}: no greeting within 5 s"))
        .unwrap();
    line.trim().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cookie_keeps_a_client_on_its_backend_until_it_is_disabled() {
    let ip = "127.93.1.1";
    let vip = "127.93.1.1:8080";
    let me = "127.93.1.100";
    let a = http_backend("127.93.1.10:8001", "a").await;
    let b = http_backend("127.93.1.11:8001", "b").await;
    let c = http_backend("127.93.1.12:8001", "c").await;
    let (_p, _dir) = start_serve("persist-cookie", ip, &["--health-interval-ms", "0"]);
    let all = |enabled: [bool; 3]| {
        vec![vserver(
            "web-1",
            ServiceType::Http,
            8080,
            "COOKIE",
            vec![
                service("a", a.addr, enabled[0]),
                service("b", b.addr, enabled[1]),
                service("c", c.addr, enabled[2]),
            ],
        )]
    };
    configure(ip, 1, all([true; 3])).await;

    // First request: load-balanced, with a cookie named after the vserver.
    let first = get(me, vip, None).await;
    let kept = served_by(&first);
    let cookie = cookie_of(&first, "lbscale_web_1").expect("a Set-Cookie on the first response");
    let token = cookie.split_once('=').unwrap().1;
    assert_eq!(token.len(), 16, "{cookie}");
    assert!(
        !cookie.contains("127.93"),
        "the backend's address in clear: {cookie}"
    );

    // With the cookie: always the same backend, no new cookie, whatever the LB
    // method (round robin) would have done.
    let before = requests_total(&mut api_client(ip).await, &kept).await;
    for i in 0..20 {
        let r = get(me, vip, Some(&format!("other=1; {cookie}"))).await;
        assert_eq!(served_by(&r), kept, "request {i} with the cookie");
        assert!(
            r.header("set-cookie").is_none(),
            "request {i}: cookie set again"
        );
    }
    assert!(
        requests_total(&mut api_client(ip).await, &kept).await >= before + 20,
        "persistent requests count in the service's statistics"
    );

    // Without it: round robin over the three, each with the cookie of its backend.
    let mut seen: HashMap<String, String> = HashMap::new();
    for _ in 0..20 {
        let r = get(me, vip, None).await;
        let c = cookie_of(&r, "lbscale_web_1").expect("a new cookie without one");
        if let Some(prev) = seen.insert(served_by(&r), c.clone()) {
            assert_eq!(prev, c, "one token per service");
        }
    }
    assert_eq!(
        seen.len(),
        3,
        "without the cookie requests spread: {seen:?}"
    );
    assert_eq!(seen[&kept], cookie);
    // A cookie the node does not know: load-balanced, with a new cookie.
    let r = get(me, vip, Some("lbscale_web_1=0123456789abcdef")).await;
    assert!(cookie_of(&r, "lbscale_web_1").is_some());

    // The kept service is disabled: the cookie's requests go elsewhere, with the
    // new backend's cookie, which then keeps them there.
    let enabled = [kept != "a", kept != "b", kept != "c"];
    configure(ip, 2, all(enabled)).await;
    let r = get(me, vip, Some(&cookie)).await;
    let moved = served_by(&r);
    assert_ne!(moved, kept, "a disabled service got a persistent request");
    let new_cookie = cookie_of(&r, "lbscale_web_1").expect("a new cookie after the move");
    assert_eq!(new_cookie, seen[&moved]);
    for _ in 0..10 {
        assert_eq!(served_by(&get(me, vip, Some(&new_cookie)).await), moved);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cookie_from_one_node_reaches_the_same_backend_through_another() {
    let a = http_backend("127.93.2.10:8001", "a").await;
    let b = http_backend("127.93.2.11:8001", "b").await;
    let c = http_backend("127.93.2.12:8001", "c").await;
    let vs = || {
        vec![vserver(
            "shop",
            ServiceType::Http,
            8080,
            "COOKIE",
            vec![
                service("a", a.addr, true),
                service("b", b.addr, true),
                service("c", c.addr, true),
            ],
        )]
    };
    let (_p1, _) = start_serve(
        "persist-node-a",
        "127.93.2.1",
        &["--health-interval-ms", "0"],
    );
    let (_p2, _) = start_serve(
        "persist-node-b",
        "127.93.2.2",
        &["--health-interval-ms", "0"],
    );
    configure("127.93.2.1", 1, vs()).await;
    configure("127.93.2.2", 1, vs()).await;
    let me = "127.93.2.100";
    // Every cookie node A hands out keeps its backend through node B.
    for _ in 0..3 {
        let r = get(me, "127.93.2.1:8080", None).await;
        let svc = served_by(&r);
        let cookie = cookie_of(&r, "lbscale_shop").expect("cookie from node A");
        for _ in 0..5 {
            let r = get(me, "127.93.2.2:8080", Some(&cookie)).await;
            assert_eq!(r.header("x-lbscale-node"), Some("persist-node-b"));
            assert_eq!(served_by(&r), svc, "node B honours node A's cookie");
            assert!(r.header("set-cookie").is_none());
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sourceip_tcp_keeps_a_client_address_on_one_backend_until_idle() {
    let ip = "127.93.3.1";
    let vip = "127.93.3.1:9000";
    let a = tcp_backend("127.93.3.10:8001", "a").await;
    let b = tcp_backend("127.93.3.11:8001", "b").await;
    let c = tcp_backend("127.93.3.12:8001", "c").await;
    let (_p, _) = start_serve(
        "persist-tcp",
        ip,
        &[
            "--health-interval-ms",
            "0",
            "--persistence-timeout-ms",
            "1000",
        ],
    );
    let all = |enabled: [bool; 3]| {
        vec![vserver(
            "db",
            ServiceType::Tcp,
            9000,
            "SOURCEIP",
            vec![
                service("a", a.addr, enabled[0]),
                service("b", b.addr, enabled[1]),
                service("c", c.addr, enabled[2]),
            ],
        )]
    };
    configure(ip, 1, all([true; 3])).await;

    // Six client addresses, five connections each: one backend per address, and
    // the addresses spread over the three backends.
    let mut per_client: HashMap<String, String> = HashMap::new();
    for round in 0..5 {
        for k in 1..=6 {
            let from = format!("127.93.3.{}", 100 + k);
            let got = tcp_name(&from, vip).await;
            let want = per_client.entry(from.clone()).or_insert(got.clone());
            assert_eq!(&got, want, "{from}, round {round}");
        }
    }
    let backends: HashSet<&String> = per_client.values().collect();
    assert_eq!(backends.len(), 3, "client addresses spread: {per_client:?}");

    // Used within the timeout, an entry is refreshed: still kept after more than
    // one timeout in all.
    let x = "127.93.3.101";
    let kept = per_client[x].clone();
    for _ in 0..4 {
        tokio::time::sleep(Duration::from_millis(400)).await;
        assert_eq!(tcp_name(x, vip).await, kept, "refreshed entry");
    }
    // Idle past the timeout: load-balanced anew. x was the first of six new
    // clients, so round robin's cursor is back at x's old choice: a new client y
    // takes that one, and x, if it is load-balanced again, the next one.
    tokio::time::sleep(Duration::from_millis(1300)).await;
    let y_first = tcp_name("127.93.3.120", vip).await;
    assert_eq!(y_first, kept, "round robin's order");
    let x_again = tcp_name(x, vip).await;
    assert_ne!(
        x_again, kept,
        "after the idle timeout x must be load-balanced anew"
    );
    for _ in 0..3 {
        assert_eq!(tcp_name(x, vip).await, x_again, "the new entry keeps x");
    }

    // x's service is disabled: x goes to another one and stays there.
    let now = x_again.clone();
    configure(ip, 2, all([now != "a", now != "b", now != "c"])).await;
    let moved = tcp_name(x, vip).await;
    assert_ne!(moved, now, "a disabled service got a persistent connection");
    for _ in 0..5 {
        assert_eq!(tcp_name(x, vip).await, moved);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sourceip_http_keeps_every_request_of_an_address_on_one_backend() {
    let ip = "127.93.4.1";
    let vip = "127.93.4.1:8080";
    let a = http_backend("127.93.4.10:8001", "a").await;
    let b = http_backend("127.93.4.11:8001", "b").await;
    let c = http_backend("127.93.4.12:8001", "c").await;
    let (_p, _) = start_serve("persist-http", ip, &["--health-interval-ms", "0"]);
    configure(
        ip,
        1,
        vec![vserver(
            "web",
            ServiceType::Http,
            8080,
            "SOURCEIP",
            vec![
                service("a", a.addr, true),
                service("b", b.addr, true),
                service("c", c.addr, true),
            ],
        )],
    )
    .await;
    let mut per_client: HashMap<String, String> = HashMap::new();
    for k in 1..=6 {
        let from = format!("127.93.4.{}", 100 + k);
        // New connections, and requests on one keep-alive connection.
        let first = served_by(&get(&from, vip, None).await);
        assert!(get(&from, vip, None).await.header("set-cookie").is_none());
        for _ in 0..3 {
            assert_eq!(served_by(&get(&from, vip, None).await), first, "{from}");
        }
        let mut s = connect_from(&from, vip).await;
        for _ in 0..5 {
            let r = http_request(&mut s, "/").await.unwrap();
            assert_eq!(served_by(&r), first, "{from}, keep-alive");
        }
        per_client.insert(from, first);
    }
    let backends: HashSet<&String> = per_client.values().collect();
    assert_eq!(backends.len(), 3, "client addresses spread: {per_client:?}");
}

/// A UDP backend answering every datagram with its name.
async fn udp_backend(addr: &str, name: &'static str) -> (SocketAddr, tokio::task::JoinHandle<()>) {
    let s = UdpSocket::bind(addr).await.unwrap();
    let a = s.local_addr().unwrap();
    let task = tokio::spawn(async move {
        let mut buf = [0u8; 1500];
        while let Ok((_, from)) = s.recv_from(&mut buf).await {
            let _ = s.send_to(name.as_bytes(), from).await;
        }
    });
    (a, task)
}

/// One datagram from a new socket on `from` (a new flow): the backend's answer.
async fn udp_name(from: &str, vip: &str) -> String {
    let s = UdpSocket::bind((from.parse::<IpAddr>().unwrap(), 0))
        .await
        .unwrap();
    s.connect(vip).await.unwrap();
    let mut buf = [0u8; 1500];
    for _ in 0..10 {
        s.send(b"ping").await.unwrap();
        if let Ok(Ok(n)) = tokio::time::timeout(Duration::from_millis(500), s.recv(&mut buf)).await
        {
            return String::from_utf8_lossy(&buf[..n]).to_string();
        }
    }
    panic!("{from} -> {vip}: no UDP answer");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sourceip_udp_keeps_new_flows_of_an_address_on_one_backend() {
    let ip = "127.93.5.1";
    let vip = "127.93.5.1:5300";
    let (a, _ta) = udp_backend("127.93.5.10:8001", "a").await;
    let (b, _tb) = udp_backend("127.93.5.11:8001", "b").await;
    let (c, _tc) = udp_backend("127.93.5.12:8001", "c").await;
    let (_p, _) = start_serve("persist-udp", ip, &["--health-interval-ms", "0"]);
    configure(
        ip,
        1,
        vec![vserver(
            "dns",
            ServiceType::Udp,
            5300,
            "SOURCEIP",
            vec![
                service("a", a, true),
                service("b", b, true),
                service("c", c, true),
            ],
        )],
    )
    .await;
    let mut per_client: HashMap<String, String> = HashMap::new();
    for round in 0..4 {
        for k in 1..=6 {
            let from = format!("127.93.5.{}", 100 + k);
            let got = udp_name(&from, vip).await;
            let want = per_client.entry(from.clone()).or_insert(got.clone());
            assert_eq!(&got, want, "{from}, flow {round}");
        }
    }
    let backends: HashSet<&String> = per_client.values().collect();
    assert_eq!(backends.len(), 3, "client addresses spread: {per_client:?}");
}

/// A TCP backend that writes `name source-ip\n` on connect (the source is the
/// node that served the connection).
async fn named_source_backend(addr: &str, name: &'static str) -> tokio::task::JoinHandle<()> {
    let l = TcpListener::bind(addr).await.unwrap();
    tokio::spawn(async move {
        while let Ok((mut s, from)) = l.accept().await {
            tokio::spawn(async move {
                let _ = s
                    .write_all(format!("{name} {}\n", from.ip()).as_bytes())
                    .await;
                let mut tmp = [0u8; 64];
                let _ = s.read(&mut tmp).await;
            });
        }
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sourceip_behind_scaleout_keeps_a_client_on_one_node_and_backend() {
    let primary = "127.93.6.1";
    let secondary = "127.93.6.2";
    let vip = "127.93.6.1:9000";
    let _a = named_source_backend("127.93.6.10:8001", "a").await;
    let _b = named_source_backend("127.93.6.11:8001", "b").await;
    let _c = named_source_backend("127.93.6.12:8001", "c").await;
    let services = || {
        ["a", "b", "c"]
            .iter()
            .enumerate()
            .map(|(i, n)| {
                service(
                    n,
                    format!("127.93.6.{}:8001", 10 + i).parse().unwrap(),
                    true,
                )
            })
            .collect::<Vec<_>>()
    };
    let (_p1, _) = start_serve("persist-primary", primary, &["--health-interval-ms", "0"]);
    let (_p2, _) = start_serve(
        "persist-secondary",
        secondary,
        &["--health-interval-ms", "0"],
    );
    let mut vs = vserver("db", ServiceType::Tcp, 9000, "SOURCEIP", services());
    vs.scaleout = Some(Scaleout {
        role: ScaleoutRole::Secondary as i32,
        ..Default::default()
    });
    configure(secondary, 1, vec![vs.clone()]).await;
    vs.scaleout = Some(Scaleout {
        role: ScaleoutRole::Primary as i32,
        primary_share: 0.5,
        secondaries: vec![ScaleoutPeer {
            address: secondary.into(),
            share: 0.5,
        }],
        scalein_timeout_ms: 0,
    });
    configure(primary, 1, vec![vs]).await;

    // Eight clients, four connections each: each keeps its node and backend.
    let mut per_client: HashMap<String, String> = HashMap::new();
    for round in 0..4 {
        for k in 1..=8 {
            let from = format!("127.93.6.{}", 100 + k);
            let got = tcp_name(&from, vip).await;
            let want = per_client.entry(from.clone()).or_insert(got.clone());
            assert_eq!(&got, want, "{from}, round {round}: node and backend kept");
        }
    }
    // Both nodes serve clients, and the secondary spreads the clients the primary
    // forwards over its backends: it keys them by the client's address (from the
    // PROXY header), not by the primary's.
    let on_secondary: HashSet<&str> = per_client
        .values()
        .filter(|v| v.ends_with(secondary))
        .map(|v| v.split(' ').next().unwrap())
        .collect();
    let on_primary = per_client.values().filter(|v| v.ends_with(primary)).count();
    assert!(on_primary > 0, "{per_client:?}");
    assert!(
        on_secondary.len() >= 2,
        "the secondary put every forwarded client on one backend: {per_client:?}"
    );
}
