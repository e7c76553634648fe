//! The engine on the local cloud (real `lbscale-node` and distributor processes).

use lbscale_cloud_local::LocalSettings;
use lbscale_engine::cloud::Clouds;
use lbscale_engine::store::Store;
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

/// The daemon and a Terraform apply each publish what a distributor hands out:
/// a publication waits while another process holds the distributor's lease, so
/// that two never interleave their read-modify-write of its configuration.
#[tokio::test(flavor = "multi_thread")]
async fn publications_to_one_distributor_take_turns_across_processes() {
    use lbscale_engine::model::{CloudName, DeclaredDuration, DistributorMode, DistributorSpec};
    use lbscale_engine::reconcile::Engine;
    use lbscale_engine::store::distributor_lease_key;
    use std::time::Duration;

    let dir = std::env::temp_dir().join(format!("lbscale-publish-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let url = format!("sqlite://{}", dir.join("state.db").display());
    let settings = LocalSettings {
        address_prefix: "127.62.".into(),
        node_binary: Some(node_binary()),
        ..LocalSettings::default()
    };
    let clouds = Clouds::new().with("local", lbscale_cloud_local::drivers(settings));
    let engine = Arc::new(Engine::open(&url, &dir, clouds).unwrap());
    let spec = DistributorSpec {
        name: "turns".into(),
        cloud: CloudName::Local,
        mode: DistributorMode::Dns,
        domain: Some("turns.lbscale.test".into()),
        ttl: DeclaredDuration::parse("5s").unwrap(),
    };
    let id = engine.create_distributor(&spec).await.unwrap();
    // Another process on the same store: its own handle and holder name.
    let other = Store::open_url(&url, &dir).unwrap();
    let version = || other.distributor_runtime(&id).unwrap()["version"].as_u64();
    let before = version();
    assert!(before.is_some(), "no config version after create");

    let lease = other
        .acquire_lease(
            &distributor_lease_key(&id),
            "another-process",
            Duration::from_secs(30),
        )
        .unwrap();
    let publishing = {
        let (engine, id, spec) = (engine.clone(), id.clone(), spec.clone());
        tokio::spawn(async move { engine.update_distributor(&id, &spec).await })
    };
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(
        !publishing.is_finished(),
        "published while another process held the distributor's lease"
    );
    assert_eq!(
        version(),
        before,
        "the config version moved under the lease"
    );

    other.release_lease(&lease).unwrap();
    tokio::time::timeout(Duration::from_secs(15), publishing)
        .await
        .expect("the publication did not follow the release within 15 s")
        .unwrap()
        .expect("publish");
    assert_eq!(version(), before.map(|v| v + 1));

    engine.delete_distributor(&id).await.unwrap();
    assert_eq!(
        other.count_rows("leases").unwrap(),
        0,
        "the distributor's lease outlived it"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A publication carries the fence of the distributor's lease: the local
/// distributor refuses one older than a publication it applied, and what is
/// served is recorded only under the current lease, so a holder that lost the
/// lease unawares changes neither.
#[tokio::test(flavor = "multi_thread")]
async fn a_publication_under_a_lost_lease_is_refused() {
    use lbscale_engine::cloud::{DriverStore, Publication};
    use lbscale_engine::model::{CloudName, DeclaredDuration, DistributorMode, DistributorSpec};
    use lbscale_engine::reconcile::Engine;
    use lbscale_engine::store::{distributor_lease_key, StoreError};
    use std::time::Duration;

    let dir = std::env::temp_dir().join(format!("lbscale-fenced-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let url = format!("sqlite://{}", dir.join("state.db").display());
    let settings = LocalSettings {
        address_prefix: "127.63.".into(),
        node_binary: Some(node_binary()),
        ..LocalSettings::default()
    };
    let clouds = Clouds::new().with("local", lbscale_cloud_local::drivers(settings.clone()));
    let engine = Engine::open(&url, &dir, clouds).unwrap();
    let spec = DistributorSpec {
        name: "fenced".into(),
        cloud: CloudName::Local,
        mode: DistributorMode::Dns,
        domain: Some("fenced.lbscale.test".into()),
        ttl: DeclaredDuration::parse("5s").unwrap(),
    };
    let id = engine.create_distributor(&spec).await.unwrap();

    // Another process's driver on the same store, as a newer and then a
    // stale holder of the distributor's lease would call it.
    let other = Arc::new(Store::open_url(&url, &dir).unwrap());
    let driver = (lbscale_cloud_local::drivers(settings))(DriverStore::new(other.clone()))
        .unwrap()
        .distributors;
    let mut one = Publication::default();
    one.endpoints
        .insert("az1".into(), vec!["127.63.9.1".into()]);
    driver
        .publish_fenced(&id, &spec, &one, 1_000)
        .await
        .unwrap();
    let e = driver
        .publish_fenced(&id, &spec, &Publication::default(), 999)
        .await
        .unwrap_err();
    assert!(e.to_string().contains("fence 999"), "{e}");
    let config: serde_json::Value = serde_json::from_slice(
        &std::fs::read(dir.join("local/distributors").join(&id).join("config.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(
        config["zones"][0]["addresses"],
        serde_json::json!(["127.63.9.1"]),
        "the stale publication changed what is served"
    );

    // The record of what is served: written only under the current lease.
    let key = distributor_lease_key(&id);
    let stale = other
        .acquire_lease(&key, "stale-holder", Duration::from_millis(50))
        .unwrap();
    tokio::time::sleep(Duration::from_millis(120)).await;
    let current = other
        .acquire_lease(&key, "new-holder", Duration::from_secs(30))
        .unwrap();
    let before = other.served_publication(&id).unwrap();
    let e = other
        .set_served_publication_under(&stale, &id, "{}")
        .unwrap_err();
    assert!(matches!(e, StoreError::LeaseLost { .. }), "{e:?}");
    assert_eq!(other.served_publication(&id).unwrap(), before);
    other.release_lease(&current).unwrap();
    engine.delete_distributor(&id).await.unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}
