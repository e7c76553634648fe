//! LB methods, health checks and CUSTOMLOAD through the real `serve` binary.

mod common;

use std::time::{Duration, Instant};

use common::*;
use lbscale_proto::{LbMethod, NodeConfig, Service, ServiceType, StatsRequest, Vserver};

fn svc(name: &str, b: &HttpBackend, weight: u32) -> Service {
    Service {
        name: name.into(),
        address: b.addr.ip().to_string(),
        port: b.addr.port() as u32,
        weight,
        enabled: true,
        cap_per_second: None,
        custom_load: None,
    }
}

async fn configure(cl: &mut Client, m: LbMethod, services: Vec<Service>) {
    tokio::time::timeout(
        Duration::from_secs(5),
        cl.configure(NodeConfig {
            group_peers: Vec::new(),
            fence: 0,
            version: 1,
            vservers: vec![Vserver {
                name: "web".into(),
                service_type: ServiceType::Http as i32,
                port: 8080,
                lb_method: m as i32,
                persistence: "NONE".into(),
                services,
                slow_start: None,
                scaleout: None,
                ramp_peers: vec![],
                ..Default::default()
            }],
        }),
    )
    .await
    .expect("Configure within 5 s")
    .expect("Configure accepted");
}

/// `n` sequential GETs on new connections; the services that answered, in order.
async fn services_hit(vip: &str, n: usize) -> Vec<String> {
    let mut v = Vec::new();
    for _ in 0..n {
        let r = http_get(vip, "/").await;
        assert_eq!(r.status, 200, "GET {vip}/");
        v.push(r.header("x-lbscale-service").unwrap_or("?").to_string());
    }
    v
}

async fn wait_log(dir: &std::path::Path, needle: &str, timeout: Duration) -> String {
    let end = Instant::now() + timeout;
    loop {
        let log = std::fs::read_to_string(dir.join("node.log")).unwrap_or_default();
        if let Some(l) = log.lines().find(|l| l.contains(needle)) {
            return l.to_string();
        }
        if Instant::now() > end {
            panic!("timed out after {timeout:?} waiting for {needle:?} in node.log:\n{log}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_checks_take_a_down_service_out_and_back() {
    let a = http_backend("127.81.1.10:8001", "alpha").await;
    let b = http_backend("127.81.1.11:8001", "beta").await;
    let (_p, dir) = start_serve(
        "health",
        "127.81.1.1",
        &[
            "--health-interval-ms",
            "100",
            "--health-fall",
            "2",
            "--health-rise",
            "2",
        ],
    );
    let mut cl = api_client("127.81.1.1").await;
    configure(
        &mut cl,
        LbMethod::Roundrobin,
        vec![svc("a", &a, 1), svc("b", &b, 1)],
    )
    .await;
    let vip = "127.81.1.1:8080";
    let hit = services_hit(vip, 4).await;
    assert_eq!(hit.iter().filter(|s| *s == "b").count(), 2, "{hit:?}");

    // b goes away: refused connects take it DOWN.
    drop(b);
    let line = wait_log(&dir, "service DOWN", Duration::from_secs(5)).await;
    assert!(line.contains("service=b"), "{line}");
    let before = requests_total(&mut cl, "b").await;
    let hit = services_hit(vip, 10).await;
    assert!(
        hit.iter().all(|s| s == "a"),
        "a DOWN service got traffic: {hit:?}"
    );
    assert_eq!(
        requests_total(&mut cl, "b").await,
        before,
        "a DOWN service must not even be tried"
    );

    // b is back: UP after 2 good probes, and it gets traffic again.
    let b = http_backend("127.81.1.11:8001", "beta").await;
    let line = wait_log(&dir, "service UP", Duration::from_secs(5)).await;
    assert!(
        line.contains("service=b") && line.contains("up_since_ms="),
        "{line}"
    );
    let hit = services_hit(vip, 6).await;
    assert_eq!(
        hit.iter().filter(|s| *s == "b").count(),
        3,
        "UP again: round robin {hit:?}"
    );
    assert!(b.hits() >= 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn custom_load_from_the_load_file_with_weights() {
    let a = http_backend("127.81.2.10:8001", "alpha").await;
    let b = http_backend("127.81.2.11:8001", "beta").await;
    let dir = tmpdir("customload-file");
    let file = dir.join("loads.json");
    // a: 20 / weight 3 = 6.7 < b: 7 / 1 → a.
    std::fs::write(&file, r#"{"web/a": 20, "b": 7}"#).unwrap();
    let (_p, _d) = start_serve(
        "customload",
        "127.81.2.1",
        &["--custom-load-file", file.to_str().unwrap()],
    );
    let mut cl = api_client("127.81.2.1").await;
    configure(
        &mut cl,
        LbMethod::Customload,
        vec![svc("a", &a, 3), svc("b", &b, 1)],
    )
    .await;
    let vip = "127.81.2.1:8080";
    let hit = services_hit(vip, 8).await;
    assert!(
        hit.iter().all(|s| s == "a"),
        "lowest load/weight is a: {hit:?}"
    );

    // The monitor reports a new load: b becomes the least loaded.
    std::fs::write(&file, r#"{"web/a": 30, "b": 7}"#).unwrap();
    let end = Instant::now() + Duration::from_secs(3);
    loop {
        if services_hit(vip, 1).await[0] == "b" {
            break;
        }
        assert!(
            Instant::now() < end,
            "the new load file was not applied within 3 s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let hit = services_hit(vip, 8).await;
    assert!(hit.iter().all(|s| s == "b"), "30/3 > 7/1: {hit:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn custom_load_in_the_configuration_overrides_the_file() {
    let a = http_backend("127.81.6.10:8001", "alpha").await;
    let b = http_backend("127.81.6.11:8001", "beta").await;
    let dir = tmpdir("customload-config");
    let file = dir.join("loads.json");
    std::fs::write(&file, r#"{"a": 1, "b": 0}"#).unwrap();
    let (_p, _d) = start_serve(
        "customload-config",
        "127.81.6.1",
        &["--custom-load-file", file.to_str().unwrap()],
    );
    let mut cl = api_client("127.81.6.1").await;
    let with_b = |load: Option<f64>| {
        let mut b = svc("b", &b, 1);
        b.custom_load = load;
        vec![svc("a", &a, 1), b]
    };
    let vip = "127.81.6.1:8080";
    // The file says b: 0, the configuration b: 5 → a (load 1) is the least loaded.
    configure(&mut cl, LbMethod::Customload, with_b(Some(5.0))).await;
    let hit = services_hit(vip, 6).await;
    assert!(
        hit.iter().all(|s| s == "a"),
        "configuration over file: {hit:?}"
    );
    // A new file does not override it either.
    std::fs::write(&file, r#"{"a": 1, "b": 0, "c": 2}"#).unwrap();
    tokio::time::sleep(Duration::from_millis(600)).await;
    let hit = services_hit(vip, 6).await;
    assert!(hit.iter().all(|s| s == "a"), "file changed: {hit:?}");
    // Without a value in the configuration the file's applies again: b (0).
    configure(&mut cl, LbMethod::Customload, with_b(None)).await;
    let hit = services_hit(vip, 6).await;
    assert!(hit.iter().all(|s| s == "b"), "back to the file: {hit:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn least_response_time_prefers_the_fast_service() {
    let slow = http_backend_with_delay("127.81.3.10:8001", "slow", Duration::from_millis(40)).await;
    let fast = http_backend("127.81.3.11:8001", "fast").await;
    let (_p, _d) = start_serve("lrt", "127.81.3.1", &[]);
    let mut cl = api_client("127.81.3.1").await;
    configure(
        &mut cl,
        LbMethod::Leastresponsetime,
        vec![svc("slow", &slow, 1), svc("fast", &fast, 1)],
    )
    .await;
    let vip = "127.81.3.1:8080";
    // Until both have a response time, ties follow round robin.
    let warm = services_hit(vip, 2).await;
    assert!(
        warm.contains(&"slow".to_string()) && warm.contains(&"fast".to_string()),
        "{warm:?}"
    );
    // (A scheduling stall on a loaded machine can inflate one fast sample, hence
    // "nearly all"; round robin would give 10.)
    let hit = services_hit(vip, 20).await;
    let to_fast = hit.iter().filter(|s| *s == "fast").count();
    assert!(to_fast >= 17, "least response time: {hit:?}");

    // Round robin on the same backends for contrast: both get half.
    configure(
        &mut cl,
        LbMethod::Roundrobin,
        vec![svc("slow", &slow, 1), svc("fast", &fast, 1)],
    )
    .await;
    let hit = services_hit(vip, 10).await;
    assert_eq!(hit.iter().filter(|s| *s == "slow").count(), 5, "{hit:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn least_bandwidth_avoids_the_busy_service() {
    let a = http_backend("127.81.4.10:8001", "alpha").await;
    let b = http_backend("127.81.4.11:8001", "beta").await;
    let (_p, _d) = start_serve("lbw", "127.81.4.1", &[]);
    let mut cl = api_client("127.81.4.1").await;
    configure(
        &mut cl,
        LbMethod::Leastbandwidth,
        vec![svc("a", &a, 1), svc("b", &b, 1)],
    )
    .await;
    let vip = "127.81.4.1:8080";
    // The first request goes to a (schedule order) and moves 1 MB through it.
    let r = http_get(vip, "/big").await;
    assert_eq!(r.body.len(), 1 << 20);
    let first = r.header("x-lbscale-service").unwrap().to_string();
    let other = if first == "a" { "b" } else { "a" };
    let hit = services_hit(vip, 10).await;
    assert!(
        hit.iter().all(|s| s == other),
        "{first} moved 1 MB, {other} must get the next requests: {hit:?}"
    );
}

async fn read_line(s: &mut tokio::net::TcpStream) -> Option<String> {
    use tokio::io::AsyncReadExt;
    let mut out = Vec::new();
    let mut b = [0u8; 1];
    loop {
        match tokio::time::timeout(Duration::from_secs(5), s.read(&mut b)).await {
            Ok(Ok(1)) if b[0] == b'\n' => return Some(String::from_utf8_lossy(&out).into()),
            Ok(Ok(1)) => out.push(b[0]),
            Ok(_) => return None,
            Err(_) => panic!("no line within 5 s"),
        }
    }
}

async fn stats_of(cl: &mut Client, service: &str) -> Option<lbscale_proto::ServiceStats> {
    let s = tokio::time::timeout(
        Duration::from_secs(5),
        cl.get_stats(StatsRequest::default()),
    )
    .await
    .expect("GetStats within 5 s")
    .expect("GetStats")
    .into_inner();
    s.services.into_iter().find(|x| x.service == service)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn removed_service_drains_then_closes() {
    use tokio::io::AsyncWriteExt;
    let a = tcp_backend("127.81.5.10:9001", "alpha").await;
    let b = tcp_backend("127.81.5.11:9001", "beta").await;
    let (_p, dir) = start_serve(
        "svcdrain",
        "127.81.5.1",
        &["--service-drain-timeout-ms", "1500"],
    );
    let mut cl = api_client("127.81.5.1").await;
    let tcp_vs = |services: Vec<Service>| NodeConfig {
        group_peers: Vec::new(),
        fence: 0,
        version: 1,
        vservers: vec![Vserver {
            name: "db".into(),
            service_type: ServiceType::Tcp as i32,
            port: 9000,
            lb_method: LbMethod::Roundrobin as i32,
            persistence: "NONE".into(),
            services,
            slow_start: None,
            scaleout: None,
            ramp_peers: vec![],
            ..Default::default()
        }],
    };
    cl.configure(tcp_vs(vec![svc("a", &a, 1), svc("b", &b, 1)]))
        .await
        .expect("configure");
    let vip = "127.81.5.1:9000";
    let mut held = tokio::net::TcpStream::connect(vip).await.unwrap();
    assert_eq!(read_line(&mut held).await.as_deref(), Some("alpha"));

    // a is removed: no new connections, the held one goes on and is reported.
    cl.configure(tcp_vs(vec![svc("b", &b, 1)]))
        .await
        .expect("configure");
    let removed_at = Instant::now();
    for _ in 0..3 {
        let mut s = tokio::net::TcpStream::connect(vip).await.unwrap();
        assert_eq!(read_line(&mut s).await.as_deref(), Some("beta"));
    }
    held.write_all(b"still here\n").await.unwrap();
    assert_eq!(read_line(&mut held).await.as_deref(), Some("still here"));
    let st = stats_of(&mut cl, "a")
        .await
        .expect("a draining service is still reported");
    assert_eq!(st.active_connections, 1);

    // At the timeout the node closes it.
    let closed = read_line(&mut held).await;
    let after = removed_at.elapsed();
    assert_eq!(
        closed, None,
        "the connection must be closed at the drain timeout"
    );
    assert!(
        after >= Duration::from_millis(1300) && after < Duration::from_millis(4000),
        "closed after {after:?}, drain timeout 1.5 s"
    );
    wait_log(&dir, "service drain timeout", Duration::from_secs(2)).await;
    let end = Instant::now() + Duration::from_secs(2);
    while stats_of(&mut cl, "a").await.is_some() {
        assert!(
            Instant::now() < end,
            "a drained service must leave the statistics"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
