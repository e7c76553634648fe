//! What the statistics read while a configuration is in progress.

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
