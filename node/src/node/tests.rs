//! What the statistics read while a configuration is in progress.

use std::time::Duration;

use lbscale_proto::{LbMethod, NodeConfig, Service, ServiceType, Vserver as VserverCfg};

use super::{Node, NodeOpts};
use crate::usage::Source;

fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind a free port");
    l.local_addr().expect("its address").port()
}

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

/// A configuration holds the listeners' lock while it binds, closes listeners
/// and resolves names (seconds, when a name server is slow); the daemon gives a
/// node 2 s to answer. The statistics answer meanwhile, from the last
/// configuration applied, and the next one shows once it is done.
#[tokio::test]
async fn statistics_answer_from_the_last_configuration_while_one_is_in_progress() {
    let node = Node::new(
        "n1".into(),
        "127.0.0.1".parse().unwrap(),
        Source::Process {
            memory_limit_mb: 1024,
        },
        NodeOpts::default(),
    );
    let (web, api) = (free_port(), free_port());
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
    let during = tokio::time::timeout(Duration::from_secs(10), node.stats(Duration::ZERO))
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
