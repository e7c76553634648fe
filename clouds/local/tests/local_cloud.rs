//! The local cloud against the real `lbscale-node` binary: a node is a process that
//! outlives nothing but its deprovisioning, on its own loopback address.

use lbscale_cloud_local::{process_alive, LocalCloud, LocalSettings};
use lbscale_engine::cloud::{Cloud, DriverStore, ProvisionRequest};
use lbscale_engine::nodeapi::NodeClient;
use lbscale_engine::store::{NodeRow, NodeState, Store};
use std::path::PathBuf;
use std::sync::Arc;

/// The workspace's `lbscale-node`, built next to this test's own binary.
fn node_binary() -> PathBuf {
    if let Ok(p) = std::env::var("LBSCALE_NODE_BIN") {
        return p.into();
    }
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().unwrap().parent().unwrap();
    let p = dir.join("lbscale-node");
    assert!(
        p.is_file(),
        "build lbscale-node first (cargo build -p lbscale-node): {} missing",
        p.display()
    );
    p
}

#[tokio::test(flavor = "multi_thread")]
async fn a_node_is_a_real_process_with_an_authenticated_api() {
    let dir = std::env::temp_dir().join(format!("lbscale-local-{}", std::process::id()));
    let store = Arc::new(Store::open(&dir.join("state.db")).unwrap());
    let settings = LocalSettings {
        address_prefix: "127.61.".into(),
        node_binary: Some(node_binary()),
        ..LocalSettings::default()
    };
    let cloud = LocalCloud::new(settings, DriverStore::new(store.clone()));
    let token = "0123456789abcdef".repeat(4);
    let req = ProvisionRequest {
        node_id: format!("t-az1-1-{}", std::process::id()),
        group_id: "g".into(),
        az: "az1".into(),
        memory_limit_mb: 256,
        token: token.clone(),
    };
    let p = cloud.provision(&req).await.expect("provision");
    assert!(p.private_ip.starts_with("127.61."), "{}", p.private_ip);
    let row = NodeRow {
        id: req.node_id.clone(),
        group_id: "g".into(),
        az: "az1".into(),
        seq: 1,
        state: NodeState::Joining,
        private_ip: p.private_ip.clone(),
        public_ip: p.public_ip.clone(),
        registered: false,
        handle: p.handle.clone(),
        created_at: 0,
    };
    assert!(cloud.is_alive(&row).await.unwrap());
    let pid = p.handle["pid"].as_u64().unwrap() as u32;

    let mut client = NodeClient::connect(&p.private_ip, p.api_port, &token)
        .await
        .unwrap();
    let stats = client.stats().await.unwrap();
    assert_eq!(stats.node_id, req.node_id);
    let mut wrong = NodeClient::connect(&p.private_ip, p.api_port, "not-the-token")
        .await
        .unwrap();
    let err = wrong.stats().await.unwrap_err().to_string();
    assert!(err.contains("Unauthenticated"), "{err}");

    cloud.deprovision(&row).await.unwrap();
    assert!(!process_alive(pid, &req.node_id));
    assert!(!cloud.is_alive(&row).await.unwrap());
    assert!(
        std::net::TcpStream::connect((p.private_ip.as_str(), p.api_port)).is_err(),
        "API still listening"
    );
    assert_eq!(
        store.rows_mentioning(&req.node_id).unwrap(),
        0,
        "address not released"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
