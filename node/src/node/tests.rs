//! What the statistics read while a configuration is in progress, and the
//! rates of a service that was removed.

use std::time::Duration;

use lbscale_proto::{LbMethod, NodeConfig, Service, ServiceType, Vserver as VserverCfg};

use super::{Node, NodeOpts};
use crate::usage::Source;

/// This test's own loopback address (the node's tests each have one).
const NODE_IP: &str = "127.77.30.1";

fn config(version: u64, vservers: &[(&str, u16)]) -> NodeConfig {
    let vserver = |(name, port): &(&str, u16)| VserverCfg {
        name: name.to_string(),
        service_type: ServiceType::Http as i32,
        port: *port as u32,
        lb_method: LbMethod::Roundrobin as i32,
        persistence: "NONE".into(),
        services: vec![Service {
            name: format!("{name}-a"),
            address: "127.0.0.1".into(),
            port: 9,
            weight: 1,
            enabled: true,
            cap_per_second: None,
            custom_load: None,
        }],
        ..Default::default()
    };
    NodeConfig {
        version,
        vservers: vservers.iter().map(vserver).collect(),
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
        vservers: vec![VserverCfg {
            name: "db".into(),
            service_type: ServiceType::Tcp as i32,
            port: 9000,
            lb_method: LbMethod::Roundrobin as i32,
            persistence: "NONE".into(),
            services: vec![Service {
                name: service.into(),
                address: "127.77.31.10".into(),
                port: 9001,
                weight: 1,
                enabled: true,
                cap_per_second: None,
                custom_load: None,
            }],
            ..Default::default()
        }],
        ..Default::default()
    };
    node.configure(tcp(1, "db-a"))
        .await
        .expect("configure db-a");
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
    node.configure(tcp(2, "db-b"))
        .await
        .expect("configure db-b");
    // Two of the sampler's seconds later.
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    let (rps, active) = rate(&node.stats(Duration::ZERO).await)
        .expect("db-a, draining, is still in the statistics");
    assert!(active > 0, "db-a's connections were closed");
    assert_eq!(rps, 0.0, "db-a took no request since its removal");
}
