//! What the statistics read while a configuration is in progress, and the
//! rates of a service that was removed.

use std::time::Duration;

use lbscale_proto::{LbMethod, NodeConfig, Service, ServiceType, Vserver as VserverCfg};

use super::{Node, NodeOpts};
use crate::usage::Source;

/// This test's own loopback address (the node's tests each have one).
const NODE_IP: &str = "127.77.30.1";

/// Vserver `name` on `port`, of `service_type`, with one service
/// `<name>-<suffix>` at `backend`.
fn vserver(
    name: &str,
    port: u16,
    service_type: ServiceType,
    (suffix, backend): (&str, (&str, u16)),
) -> VserverCfg {
    VserverCfg {
        name: name.to_string(),
        service_type: service_type as i32,
        port: port as u32,
        lb_method: LbMethod::Roundrobin as i32,
        persistence: "NONE".into(),
        services: vec![Service {
            name: format!("{name}-{suffix}"),
            address: backend.0.into(),
            port: backend.1 as u32,
            weight: 1,
            enabled: true,
            cap_per_second: None,
            custom_load: None,
        }],
        ..Default::default()
    }
}

fn config(version: u64, vservers: &[(&str, u16)]) -> NodeConfig {
    NodeConfig {
        version,
        vservers: vservers
            .iter()
            .map(|(name, port)| vserver(name, *port, ServiceType::Http, ("a", ("127.0.0.1", 9))))
            .collect(),
        ..Default::default()
    }
}

fn service_names(s: &lbscale_proto::NodeStats) -> Vec<String> {
    s.services.iter().map(|s| s.service.clone()).collect()
}

/// The statistics answer within the daemon's 2 s while a configuration holds
/// the listeners' lock (see `Published`), from the last configuration
/// applied; the next one shows once it is done.
#[tokio::test]
async fn statistics_answer_from_the_last_configuration_while_one_is_in_progress() {
    let node = Node::new(
        "n1".into(),
        NODE_IP.parse().unwrap(),
        Source::Process {
            memory_limit_mb: 1024,
        },
        NodeOpts::default(),
    );
    let (web, api) = (8081, 8082);
    node.configure(config(3, &[("web", web)]))
        .await
        .expect("the first configuration");

    // As a configuration in progress does.
    let held = node.inner.lock().await;
    let next = tokio::spawn({
        let node = node.clone();
        async move {
            node.configure(config(4, &[("web", web), ("api", api)]))
                .await
        }
    });
    // The configuration runs up to the lock.
    tokio::task::yield_now().await;
    let during = tokio::time::timeout(Duration::from_secs(2), node.stats(Duration::ZERO))
        .await
        .expect("the statistics answered while the listeners' lock was held");
    assert_eq!(during.config_version, 3);
    assert_eq!(service_names(&during), ["web-a"]);

    drop(held);
    let applied = tokio::time::timeout(Duration::from_secs(10), next)
        .await
        .expect("the second configuration was applied once the lock was free")
        .expect("its task")
        .expect("the second configuration");
    assert_eq!(applied, 4);
    let after = node.stats(Duration::ZERO).await;
    assert_eq!(after.config_version, 4);
    assert_eq!(service_names(&after), ["api-a", "web-a"]);
}

/// A service removed while it still has a connection stays in the statistics
/// while it drains, and its request rate falls to 0: it takes no new ones.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removed_service_that_drains_takes_no_requests_and_says_so() {
    const IP: &str = "127.77.31.1";
    let backend = tokio::net::TcpListener::bind("127.77.31.10:9001")
        .await
        .unwrap();
    // Accepts and keeps every connection open.
    tokio::spawn(async move {
        let mut kept = Vec::new();
        while let Ok((c, _)) = backend.accept().await {
            kept.push(c);
        }
    });
    let node = Node::new(
        "n2".into(),
        IP.parse().unwrap(),
        Source::Process {
            memory_limit_mb: 1024,
        },
        NodeOpts::default(),
    );
    let tcp = |version: u64, service: &str| NodeConfig {
        version,
        vservers: vec![vserver(
            "db",
            9000,
            ServiceType::Tcp,
            (service, ("127.77.31.10", 9001)),
        )],
        ..Default::default()
    };
    node.configure(tcp(1, "a")).await.expect("configure db-a");
    let rate = |stats: &lbscale_proto::NodeStats| {
        stats
            .services
            .iter()
            .find(|s| s.service == "db-a")
            .map(|s| (s.requests_per_second, s.active_connections))
    };
    // New connections to db-a for over two of the sampler's seconds, up to
    // the removal; the last ones stay open.
    let mut held = Vec::new();
    for _ in 0..25 {
        held.push(tokio::net::TcpStream::connect((IP, 9000)).await.unwrap());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let busy = rate(&node.stats(Duration::ZERO).await).expect("db-a in the statistics");
    assert!(busy.0 > 0.0, "{busy:?}");
    node.configure(tcp(2, "b")).await.expect("configure db-b");
    // The sampler's first reading after the removal may still count the
    // connections made before it; the next reads none.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let (rps, active) = rate(&node.stats(Duration::ZERO).await)
            .expect("db-a, draining, is still in the statistics");
        assert!(active > 0, "db-a's connections were closed");
        if rps == 0.0 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "db-a still read {rps} req/s 10 s after its removal"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
