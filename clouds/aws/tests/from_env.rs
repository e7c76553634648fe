//! The settings as the daemon and the CLI take them, from the process's
//! environment only (`AwsSettings::from_env`), against moto: the keys of the
//! chain and the role of `LBSCALE_AWS_ROLE_ARN` over them. One test in its
//! own binary, since it sets the process's environment.

use lbscale_cloud_aws::moto_testing::{moto, unique};
use lbscale_cloud_aws::{AwsCloud, AwsSettings};
use lbscale_engine::cloud::DriverStore;
use lbscale_engine::store::Store;
use std::sync::Arc;

#[tokio::test]
async fn the_daemons_environment_gives_the_chain_and_the_role_to_assume() {
    let Some(moto) = moto("the_daemons_environment_gives_the_chain_and_the_role_to_assume") else {
        return;
    };
    let session = unique("daemon");
    let role = "arn:aws:iam::123456789012:role/lbscale-daemon";
    let ca = moto.ca.display().to_string();
    for (k, v) in [
        ("AWS_REGION", "us-east-1"),
        ("AWS_ENDPOINT_URL", moto.endpoint.as_str()),
        ("AWS_CA_BUNDLE", ca.as_str()),
        ("AWS_ACCESS_KEY_ID", "AKIDLBSCALEDAEMON"),
        ("AWS_SECRET_ACCESS_KEY", "daemon-secret"),
        ("LBSCALE_AWS_ROLE_ARN", role),
        ("LBSCALE_AWS_EXTERNAL_ID", "daemon-ext"),
        ("LBSCALE_AWS_ROLE_SESSION_NAME", session.as_str()),
    ] {
        std::env::set_var(k, v);
    }
    // Nothing of the machine's own AWS setup may take part.
    std::env::remove_var("AWS_PROFILE");
    std::env::set_var("AWS_CONFIG_FILE", "/nonexistent/lbscale/config");
    std::env::set_var(
        "AWS_SHARED_CREDENTIALS_FILE",
        "/nonexistent/lbscale/credentials",
    );

    let dir = std::env::temp_dir().join(format!("lbscale-aws-fromenv-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let store = DriverStore::new(Arc::new(Store::open(&dir.join("state.db")).unwrap()));
    let cloud = AwsCloud::new(AwsSettings::from_env(), store).unwrap();
    assert!(
        cloud.credential_source().contains(role)
            && cloud.credential_source().contains("environment"),
        "{}",
        cloud.credential_source()
    );
    assert_eq!(
        cloud.caller_identity().await.unwrap(),
        format!("arn:aws:sts::123456789012:assumed-role/lbscale-daemon/{session}")
    );
    let seen: Vec<String> = moto.state()["sts"]["AssumedRole"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .iter()
        .filter(|r| r["session_name"] == session.as_str())
        .map(|r| r["external_id"].as_str().unwrap_or_default().to_string())
        .collect();
    assert_eq!(seen, ["daemon-ext"]);
}
