//! UDP services are health-checked in a way that fits UDP: passively (what the
//! node relays must be answered) or by a request datagram, never by a TCP
//! connect. Real UDP-only backends behind the real binary.

mod common;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use common::*;
use lbscale_proto::{LbMethod, NodeConfig, Service, ServiceType, StatsRequest, Vserver};
use tokio::net::UdpSocket;

fn svc(name: &str, addr: &str) -> Service {
    let a: SocketAddr = addr.parse().unwrap();
    Service {
        name: name.into(),
        address: a.ip().to_string(),
        port: a.port() as u32,
        weight: 1,
        enabled: true,
        cap_per_second: None,
        custom_load: None,
    }
}

async fn configure(cl: &mut Client, services: Vec<Service>, request: &[u8]) {
    let v = Vserver {
        name: "dns".into(),
        service_type: ServiceType::Udp as i32,
        port: 5353,
        lb_method: LbMethod::Roundrobin as i32,
        persistence: "NONE".into(),
        services,
        udp_health_request: request.to_vec(),
        ..Default::default()
    };
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

/// A UDP backend that reads and never answers (a hung server).
async fn udp_silent(addr: &str) -> tokio::task::JoinHandle<()> {
    let s = UdpSocket::bind(addr).await.unwrap();
    tokio::spawn(async move {
        let mut buf = [0u8; 1500];
        while s.recv_from(&mut buf).await.is_ok() {}
    })
}

/// One query from a new client (a new flow): the answering service's name.
async fn query(vip: &str, msg: &str, wait: Duration) -> Option<String> {
    let c = UdpSocket::bind("127.0.0.1:0").await.unwrap();
    c.connect(vip).await.unwrap();
    c.send(msg.as_bytes()).await.unwrap();
    let mut buf = [0u8; 1500];
    let n = tokio::time::timeout(wait, c.recv(&mut buf))
        .await
        .ok()?
        .ok()?;
    let text = String::from_utf8_lossy(&buf[..n]).to_string();
    let (who, echoed) = text.split_once(':')?;
    (echoed == msg).then(|| who.to_string())
}

async fn health(cl: &mut Client, service: &str) -> String {
    let st = tokio::time::timeout(
        Duration::from_secs(5),
        cl.get_stats(StatsRequest::default()),
    )
    .await
    .expect("GetStats within 5 s")
    .expect("GetStats")
    .into_inner();
    st.services
        .iter()
        .find(|s| s.service == service)
        .unwrap_or_else(|| panic!("no stats for {service}"))
        .health
        .clone()
}

async fn wait_health(cl: &mut Client, service: &str, want: &str, within: Duration) {
    let end = Instant::now() + within;
    loop {
        let h = health(cl, service).await;
        if h == want {
            return;
        }
        assert!(
            Instant::now() < end,
            "{service} is {h}, not {want}, after {within:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_udp_only_service_stays_up_and_serves() {
    let _a = udp_echo("127.77.67.100:5353", "alpha").await;
    // The default health settings (every second, DOWN after 3 failures).
    let (_node, _dir) = start_serve("udpup", "127.77.67.1", &[]);
    let mut cl = api_client("127.77.67.1").await;
    configure(&mut cl, vec![svc("alpha", "127.77.67.100:5353")], b"").await;
    // 6 s of new clients, one every 200 ms: every one is answered.
    let end = Instant::now() + Duration::from_secs(6);
    let mut n = 0;
    while Instant::now() < end {
        let who = query("127.77.67.1:5353", &format!("q{n}"), Duration::from_secs(2)).await;
        assert_eq!(who.as_deref(), Some("alpha"), "query {n} unanswered");
        n += 1;
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(health(&mut cl, "alpha").await, "UP");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn passive_check_takes_a_silent_or_refusing_service_down() {
    let _a = udp_echo("127.77.68.100:5353", "alpha").await;
    let _b = udp_silent("127.77.68.101:5353").await;
    // 127.77.68.102:5353: nothing listens (ICMP port unreachable).
    let (_node, _dir) = start_serve(
        "udppassive",
        "127.77.68.1",
        &["--health-interval-ms", "300", "--health-fall", "2"],
    );
    let mut cl = api_client("127.77.68.1").await;
    configure(
        &mut cl,
        vec![
            svc("alpha", "127.77.68.100:5353"),
            svc("silent", "127.77.68.101:5353"),
            svc("closed", "127.77.68.102:5353"),
        ],
        b"",
    )
    .await;
    // Without traffic nothing is known: all stay UP.
    tokio::time::sleep(Duration::from_millis(1000)).await;
    for s in ["alpha", "silent", "closed"] {
        assert_eq!(health(&mut cl, s).await, "UP", "{s} before any traffic");
    }
    // New clients, round robin over the three, until both others are DOWN.
    let end = Instant::now() + Duration::from_secs(10);
    let mut n = 0;
    loop {
        let _ = query(
            "127.77.68.1:5353",
            &format!("q{n}"),
            Duration::from_millis(100),
        )
        .await;
        n += 1;
        if health(&mut cl, "silent").await == "DOWN" && health(&mut cl, "closed").await == "DOWN" {
            break;
        }
        assert!(
            Instant::now() < end,
            "silent and closed not both DOWN after 10 s"
        );
    }
    assert_eq!(
        health(&mut cl, "alpha").await,
        "UP",
        "the answering service"
    );
    // Every new client is now answered, by alpha.
    for i in 0..10 {
        let who = query(
            "127.77.68.1:5353",
            &format!("after{i}"),
            Duration::from_secs(2),
        )
        .await;
        assert_eq!(
            who.as_deref(),
            Some("alpha"),
            "query {i} after the others went DOWN"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_probe_checks_udp_services_without_traffic() {
    let _a = udp_echo("127.77.69.100:5353", "alpha").await;
    let _b = udp_silent("127.77.69.101:5353").await;
    let (_node, _dir) = start_serve(
        "udpprobe",
        "127.77.69.1",
        &["--health-interval-ms", "300", "--health-fall", "2"],
    );
    let mut cl = api_client("127.77.69.1").await;
    configure(
        &mut cl,
        vec![
            svc("alpha", "127.77.69.100:5353"),
            svc("silent", "127.77.69.101:5353"),
        ],
        b"health?",
    )
    .await;
    // No client traffic at all: the probe alone tells them apart.
    wait_health(&mut cl, "silent", "DOWN", Duration::from_secs(5)).await;
    tokio::time::sleep(Duration::from_millis(1000)).await;
    assert_eq!(health(&mut cl, "alpha").await, "UP");
    assert_eq!(
        health(&mut cl, "silent").await,
        "DOWN",
        "no trial with a probe"
    );
    for i in 0..4 {
        let who = query("127.77.69.1:5353", &format!("q{i}"), Duration::from_secs(2)).await;
        assert_eq!(who.as_deref(), Some("alpha"));
    }
}
