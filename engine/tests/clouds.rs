//! The registry of clouds by name: the engine uses exactly the drivers it was
//! given, and says which exist when a `cloud` names none of them.

use lbscale_cloud_local::LocalSettings;
use lbscale_engine::cloud::{CloudError, Clouds};
use lbscale_engine::model::{CloudName, DeclaredDuration, DistributorMode, DistributorSpec};
use lbscale_engine::{Engine, EngineError};

fn engine(test: &str, clouds: Clouds) -> Engine {
    let dir = std::env::temp_dir().join(format!("lbscale-clouds-{test}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let url = format!("sqlite://{}", dir.join("state.db").display());
    Engine::open(&url, &dir, clouds).unwrap()
}

#[test]
fn a_cloud_without_a_driver_is_refused_naming_the_registered_ones() {
    let e = engine(
        "names",
        Clouds::new()
            .with(
                "local",
                lbscale_cloud_local::drivers(LocalSettings::default()),
            )
            .with("aws", |_| Err("no AWS region: set region".into())),
    );
    assert!(e.cloud_unusable("local", true).is_none());
    match e.cloud_unusable("azure", false) {
        Some(err @ CloudError::NoDriver { .. }) => {
            let text = err.to_string();
            assert!(text.contains("\"azure\""), "{text}");
            assert!(text.contains("\"local\" and \"aws\" work"), "{text}");
        }
        other => panic!("azure: {other:?}"),
    }
    // A driver whose settings do not let it be built says why, by its name.
    match e.cloud_unusable("aws", false) {
        Some(err @ CloudError::Unusable { .. }) => {
            assert_eq!(
                err.to_string(),
                "the aws cloud is not usable: no AWS region: set region"
            )
        }
        other => panic!("aws: {other:?}"),
    }
}

#[tokio::test]
async fn a_distributor_on_an_unregistered_cloud_stores_nothing() {
    // Only aws registered, and not usable: a local distributor is refused
    // before anything is stored.
    let e = engine(
        "none",
        Clouds::new().with("aws", |_| Err("no AWS credentials".into())),
    );
    let spec = DistributorSpec {
        name: "nowhere".into(),
        cloud: CloudName::Local,
        mode: DistributorMode::Dns,
        domain: Some("nowhere.lbscale.test".into()),
        ttl: DeclaredDuration::parse("1s").unwrap(),
    };
    let err = e.create_distributor(&spec).await.unwrap_err();
    assert!(
        matches!(err, EngineError::Cloud(CloudError::NoDriver { ref known, .. }) if known == &["aws".to_string()]),
        "{err:?}"
    );
    assert!(e.distributor_named("nowhere").unwrap().is_none());
}
