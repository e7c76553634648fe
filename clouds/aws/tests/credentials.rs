//! The aws driver's credential chain against moto's STS (AssumeRole,
//! AssumeRoleWithWebIdentity, GetCallerIdentity), and against an instance
//! metadata service and a container credential endpoint on loopback, written
//! here to AWS's published protocol (nothing real of either can run off AWS).
//!
//! Which credentials a call was signed with is read back from moto: its
//! `GetCallerIdentity` names the role session of the access key it was given.

use lbscale_cloud_aws::credentials::{AssumeRole, EnvVars};
use lbscale_cloud_aws::moto_testing::{moto, unique, Moto};
use lbscale_cloud_aws::{AwsCloud, AwsSettings};
use lbscale_engine::cloud::{Cloud, DriverStore};
use lbscale_engine::store::{NodeRow, NodeState, Store};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const ACCOUNT: &str = "123456789012";

fn store(test: &str) -> DriverStore {
    let dir = std::env::temp_dir().join(format!("lbscale-aws-cred-{test}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    DriverStore::new(Arc::new(Store::open(&dir.join("state.db")).unwrap()))
}

fn temp_dir(test: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("lbscale-aws-files-{test}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// moto's settings with no credentials of their own: what `env` gives.
fn chain_settings(moto: &Moto, env: EnvVars) -> AwsSettings {
    AwsSettings {
        credentials: None,
        env,
        ..moto.settings()
    }
}

fn role_arn(name: &str) -> String {
    format!("arn:aws:iam::{ACCOUNT}:role/{name}")
}

fn session_arn(role: &str, session: &str) -> String {
    format!("arn:aws:sts::{ACCOUNT}:assumed-role/{role}/{session}")
}

/// Temporary keys of a role session, made by moto (through curl, not the
/// driver): (access key id, secret, token).
fn moto_session(moto: &Moto, role: &str, session: &str) -> (String, String, String) {
    let xml = moto.call(
        "sts",
        "POST",
        "/",
        Some(&format!(
            "Action=AssumeRole&Version=2011-06-15&RoleArn={}&RoleSessionName={session}",
            lbscale_cloud_aws::sigv4::uri_encode(&role_arn(role))
        )),
    );
    let doc = roxmltree::Document::parse(&xml).unwrap();
    let t = |n: &str| {
        doc.descendants()
            .find(|e| e.has_tag_name(n))
            .and_then(|e| e.text())
            .unwrap_or_else(|| panic!("no {n} in {xml}"))
            .to_string()
    };
    (t("AccessKeyId"), t("SecretAccessKey"), t("SessionToken"))
}

/// The external IDs that moto's STS was given for role sessions named
/// `session`.
fn external_ids(moto: &Moto, session: &str) -> Vec<String> {
    moto.state()["sts"]["AssumedRole"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .iter()
        .filter(|r| r["session_name"] == session)
        .map(|r| r["external_id"].as_str().unwrap_or_default().to_string())
        .collect()
}

/// A node EC2 does not know: `is_alive` makes a real `DescribeInstances`.
fn unknown_node() -> NodeRow {
    NodeRow {
        id: "n-cred".into(),
        group_id: "g".into(),
        az: "us-east-1a".into(),
        seq: 1,
        state: NodeState::Joining,
        private_ip: "10.0.0.1".into(),
        public_ip: None,
        registered: false,
        handle: serde_json::json!({"instance_id": "i-0123456789abcdef0"}),
        created_at: 0,
    }
}

// --- a loopback HTTP server -------------------------------------------------

#[derive(Debug, Clone)]
struct Seen {
    method: String,
    path: String,
    headers: Vec<(String, String)>,
}

impl Seen {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

type Handler = Arc<dyn Fn(&Seen) -> (u16, String) + Send + Sync>;

/// HTTP/1.1 on 127.0.0.1, one request per connection; every request is
/// recorded. `silent`: accepts and never answers (a black hole).
async fn serve(handler: Handler, silent: bool) -> (SocketAddr, Arc<Mutex<Vec<Seen>>>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let log = seen.clone();
    tokio::spawn(async move {
        loop {
            let Ok((mut conn, _)) = listener.accept().await else {
                return;
            };
            let handler = handler.clone();
            let log = log.clone();
            tokio::spawn(async move {
                if silent {
                    tokio::time::sleep(Duration::from_secs(60)).await;
                    return;
                }
                let mut buf = Vec::new();
                let mut chunk = [0u8; 4096];
                while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
                    match conn.read(&mut chunk).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => buf.extend_from_slice(&chunk[..n]),
                    }
                }
                let head = String::from_utf8_lossy(&buf).into_owned();
                let mut lines = head.split("\r\n");
                let mut first = lines.next().unwrap_or("").split(' ');
                let seen = Seen {
                    method: first.next().unwrap_or("").into(),
                    path: first.next().unwrap_or("").into(),
                    headers: lines
                        .take_while(|l| !l.is_empty())
                        .filter_map(|l| l.split_once(':'))
                        .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
                        .collect(),
                };
                log.lock().unwrap().push(seen.clone());
                let (status, body) = handler(&seen);
                let answer = format!(
                    "HTTP/1.1 {status} X\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = conn.write_all(answer.as_bytes()).await;
            });
        }
    });
    (addr, seen)
}

/// The credentials JSON of both endpoints, expiring `lifetime` from now.
fn credentials_json(keys: &(String, String, String), lifetime: Duration) -> String {
    let t = SystemTime::now() + lifetime;
    let secs = t.duration_since(UNIX_EPOCH).unwrap().as_secs() as i64;
    let u = lbscale_core::utc::UtcTime::from_unix_seconds(secs);
    serde_json::json!({
        "Code": "Success",
        "Type": "AWS-HMAC",
        "AccessKeyId": keys.0,
        "SecretAccessKey": keys.1,
        "Token": keys.2,
        "Expiration": format!(
            "{:04}-{:02}-{:02}T{:02}:{:02}:{:02}Z",
            u.year, u.month, u.day, u.hour, u.minute, u.second
        ),
    })
    .to_string()
}

/// How long the loopback endpoints' credentials last: the driver replaces
/// them after half of that.
const SHORT_LIFETIME: Duration = Duration::from_secs(4);

/// An IMDSv2 server: a session token from `PUT /latest/api/token` (which must
/// carry its TTL header) is required by every `GET`; the role's credentials
/// are the `n`-th of `sessions` at the `n`-th fetch.
fn imds(sessions: Vec<(String, String, String)>) -> Handler {
    let fetches = Arc::new(Mutex::new(0usize));
    Arc::new(move |r: &Seen| {
        const TOKEN: &str = "imds-session-token";
        if r.method == "PUT" && r.path == "/latest/api/token" {
            return match r.header("x-aws-ec2-metadata-token-ttl-seconds") {
                Some(_) => (200, TOKEN.into()),
                None => (400, "missing ttl".into()),
            };
        }
        if r.header("x-aws-ec2-metadata-token") != Some(TOKEN) {
            return (401, "".into());
        }
        match (r.method.as_str(), r.path.as_str()) {
            ("GET", "/latest/meta-data/iam/security-credentials/") => {
                (200, "lbscale-node-role".into())
            }
            ("GET", "/latest/meta-data/iam/security-credentials/lbscale-node-role") => {
                let mut n = fetches.lock().unwrap();
                let keys = &sessions[(*n).min(sessions.len() - 1)];
                *n += 1;
                (200, credentials_json(keys, SHORT_LIFETIME))
            }
            _ => (404, "".into()),
        }
    })
}

fn credential_fetches(seen: &Mutex<Vec<Seen>>, path: &str) -> usize {
    seen.lock()
        .unwrap()
        .iter()
        .filter(|s| s.path == path)
        .count()
}

// --- tests ------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_instance_role_is_read_through_imdsv2_and_refreshed_across_its_expiry() {
    let Some(moto) =
        moto("the_instance_role_is_read_through_imdsv2_and_refreshed_across_its_expiry")
    else {
        return;
    };
    let s1 = unique("imds");
    let s2 = unique("imds");
    let sessions = vec![
        moto_session(&moto, "node-role", &s1),
        moto_session(&moto, "node-role", &s2),
    ];
    let (addr, seen) = serve(imds(sessions), false).await;
    let env = EnvVars::of(&[(
        "AWS_EC2_METADATA_SERVICE_ENDPOINT",
        &format!("http://{addr}/"),
    )]);
    let cloud = AwsCloud::new(chain_settings(&moto, env), store("imds")).unwrap();
    assert!(
        cloud.credential_source().contains("instance metadata"),
        "{}",
        cloud.credential_source()
    );
    let creds_path = "/latest/meta-data/iam/security-credentials/lbscale-node-role";

    assert_eq!(
        cloud.caller_identity().await.unwrap(),
        session_arn("node-role", &s1)
    );
    // Kept while fresh: one fetch for both calls.
    assert_eq!(
        cloud.caller_identity().await.unwrap(),
        session_arn("node-role", &s1)
    );
    assert_eq!(credential_fetches(&seen, creds_path), 1);
    {
        let seen = seen.lock().unwrap();
        assert_eq!(
            (seen[0].method.as_str(), seen[0].path.as_str()),
            ("PUT", "/latest/api/token"),
            "the session token comes first: {seen:?}"
        );
        assert!(
            seen.iter()
                .skip(1)
                .all(|s| s.header("x-aws-ec2-metadata-token").is_some()),
            "{seen:?}"
        );
    }

    // Past the expiry of the first credentials: the next calls use new ones.
    tokio::time::sleep(SHORT_LIFETIME + Duration::from_millis(500)).await;
    assert!(!cloud
        .is_alive(&unknown_node())
        .await
        .expect("DescribeInstances with the new keys"));
    assert_eq!(credential_fetches(&seen, creds_path), 2);
    assert_eq!(
        cloud.caller_identity().await.unwrap(),
        session_arn("node-role", &s2)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn container_credentials_carry_the_authorization_token_and_are_refreshed() {
    let Some(moto) = moto("container_credentials_carry_the_authorization_token_and_are_refreshed")
    else {
        return;
    };
    let s1 = unique("task");
    let s2 = unique("task");
    let sessions = [
        moto_session(&moto, "task-role", &s1),
        moto_session(&moto, "task-role", &s2),
    ];
    let dir = temp_dir("container");
    let token_file = dir.join("token");
    std::fs::write(&token_file, "container-auth-token-1\n").unwrap();
    let fetches = Arc::new(Mutex::new(0usize));
    let handler: Handler = Arc::new(move |r: &Seen| {
        if r.header("authorization") != Some("container-auth-token-1") {
            return (401, r#"{"code":"Unauthorized"}"#.into());
        }
        if r.path != "/v1/credentials" {
            return (404, "".into());
        }
        let mut n = fetches.lock().unwrap();
        let keys = &sessions[(*n).min(1)];
        *n += 1;
        (200, credentials_json(keys, SHORT_LIFETIME))
    });
    let (addr, seen) = serve(handler, false).await;
    let env = EnvVars::of(&[
        (
            "AWS_CONTAINER_CREDENTIALS_FULL_URI",
            &format!("http://{addr}/v1/credentials"),
        ),
        (
            "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE",
            token_file.to_str().unwrap(),
        ),
        // Later in the chain: never asked.
        ("AWS_EC2_METADATA_SERVICE_ENDPOINT", "http://127.0.0.1:9"),
    ]);
    let cloud = AwsCloud::new(chain_settings(&moto, env), store("container")).unwrap();
    assert_eq!(
        cloud.caller_identity().await.unwrap(),
        session_arn("task-role", &s1)
    );
    assert_eq!(credential_fetches(&seen, "/v1/credentials"), 1);
    tokio::time::sleep(SHORT_LIFETIME + Duration::from_millis(500)).await;
    assert!(!cloud.is_alive(&unknown_node()).await.unwrap());
    assert_eq!(
        cloud.caller_identity().await.unwrap(),
        session_arn("task-role", &s2)
    );
    assert_eq!(credential_fetches(&seen, "/v1/credentials"), 2);

    // Plain HTTP to a non-local address is refused before anything is sent.
    let env = EnvVars::of(&[(
        "AWS_CONTAINER_CREDENTIALS_FULL_URI",
        "http://192.0.2.10/creds",
    )]);
    let e = AwsCloud::new(chain_settings(&moto, env), store("container2"))
        .err()
        .unwrap();
    assert!(
        e.contains("AWS_CONTAINER_CREDENTIALS_FULL_URI") && e.contains("https"),
        "{e}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_profile_assumes_its_role_over_its_source_profile_and_gives_its_region() {
    let Some(moto) =
        moto("a_profile_assumes_its_role_over_its_source_profile_and_gives_its_region")
    else {
        return;
    };
    let dir = temp_dir("profile");
    let session = unique("profile");
    std::fs::write(
        dir.join("config"),
        format!(
            "[default]\nregion = eu-west-3\n\n[profile app]\nregion = us-east-1\nrole_arn = {}\nsource_profile = base\nexternal_id = lbscale-ext-1\nrole_session_name = {session}\n",
            role_arn("app")
        ),
    )
    .unwrap();
    std::fs::write(
        dir.join("credentials"),
        "[base]\naws_access_key_id = AKIDLBSCALEBASE\naws_secret_access_key = base-secret\n",
    )
    .unwrap();
    let files = |profile: &str| {
        EnvVars::of(&[
            ("AWS_CONFIG_FILE", dir.join("config").to_str().unwrap()),
            (
                "AWS_SHARED_CREDENTIALS_FILE",
                dir.join("credentials").to_str().unwrap(),
            ),
            ("AWS_PROFILE", profile),
        ])
    };
    let mut settings = chain_settings(&moto, files("app"));
    settings.region = None;
    let cloud = AwsCloud::new(settings, store("profile")).unwrap();
    assert_eq!(
        cloud.caller_identity().await.unwrap(),
        session_arn("app", &session)
    );
    assert_eq!(external_ids(&moto, &session), ["lbscale-ext-1"]);
    assert!(
        cloud.credential_source().contains("profile \"app\""),
        "{}",
        cloud.credential_source()
    );

    // The provider's assume_role goes on top of the profile's role.
    let top = unique("top");
    let mut settings = chain_settings(&moto, files("app"));
    settings.assume_role = Some(AssumeRole {
        external_id: Some("lbscale-ext-2".into()),
        session_name: Some(top.clone()),
        ..AssumeRole::new(&role_arn("deploy"))
    });
    let cloud = AwsCloud::new(settings, store("profile2")).unwrap();
    assert_eq!(
        cloud.caller_identity().await.unwrap(),
        session_arn("deploy", &top)
    );
    assert_eq!(external_ids(&moto, &top), ["lbscale-ext-2"]);

    // A named profile that is not there is an error, not the next source.
    let e = AwsCloud::new(chain_settings(&moto, files("nobody")), store("profile3"))
        .err()
        .unwrap();
    assert!(e.contains("no AWS profile \"nobody\""), "{e}");

    // Keys in the environment come before the profile.
    let mut env = files("app");
    env.0
        .insert("AWS_ACCESS_KEY_ID".into(), "AKIDLBSCALEENV".into());
    env.0
        .insert("AWS_SECRET_ACCESS_KEY".into(), "env-secret".into());
    let cloud = AwsCloud::new(chain_settings(&moto, env), store("profile4")).unwrap();
    assert!(
        cloud.credential_source().contains("environment"),
        "{}",
        cloud.credential_source()
    );
    assert!(!cloud
        .caller_identity()
        .await
        .unwrap()
        .contains("assumed-role"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_providers_assume_role_and_web_identity_go_through_sts() {
    let Some(moto) = moto("the_providers_assume_role_and_web_identity_go_through_sts") else {
        return;
    };
    // assume_role over the provider's static keys.
    let session = unique("provider");
    let settings = AwsSettings {
        assume_role: Some(AssumeRole {
            external_id: Some("lbscale-ext".into()),
            session_name: Some(session.clone()),
            ..AssumeRole::new(&role_arn("lbscale-fleet"))
        }),
        ..moto.settings()
    };
    let cloud = AwsCloud::new(settings, store("assume")).unwrap();
    assert_eq!(
        cloud.caller_identity().await.unwrap(),
        session_arn("lbscale-fleet", &session)
    );
    assert!(!cloud.is_alive(&unknown_node()).await.unwrap());
    // One AssumeRole for both calls: the role's credentials are kept.
    assert_eq!(external_ids(&moto, &session), ["lbscale-ext"]);

    // A bad role is refused when the driver is made, by field.
    let settings = AwsSettings {
        assume_role: Some(AssumeRole::new("arn:aws:iam::42:role/x")),
        ..moto.settings()
    };
    let e = AwsCloud::new(settings, store("assume2")).err().unwrap();
    assert!(e.contains("assume_role role_arn"), "{e}");

    // Web identity: the token file is read, the role assumed with it.
    let dir = temp_dir("web");
    std::fs::write(dir.join("token"), "eyJhbGciOiJSUzI1NiJ9.e30.c2ln\n").unwrap();
    let web = unique("web");
    let env = EnvVars::of(&[
        (
            "AWS_WEB_IDENTITY_TOKEN_FILE",
            dir.join("token").to_str().unwrap(),
        ),
        ("AWS_ROLE_ARN", &role_arn("ci")),
        ("AWS_ROLE_SESSION_NAME", &web),
    ]);
    let cloud = AwsCloud::new(chain_settings(&moto, env), store("web")).unwrap();
    assert_eq!(
        cloud.caller_identity().await.unwrap(),
        session_arn("ci", &web)
    );

    // A token file that is gone: the call's error names the file.
    let env = EnvVars::of(&[
        ("AWS_WEB_IDENTITY_TOKEN_FILE", "/nonexistent/lbscale/token"),
        ("AWS_ROLE_ARN", &role_arn("ci")),
    ]);
    let cloud = AwsCloud::new(chain_settings(&moto, env), store("web2")).unwrap();
    let e = cloud.caller_identity().await.unwrap_err().to_string();
    assert!(
        e.contains("/nonexistent/lbscale/token") && e.contains("GetCallerIdentity"),
        "{e}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn off_ec2_the_instance_metadata_service_is_given_up_on_quickly() {
    let Some(moto) = moto("off_ec2_the_instance_metadata_service_is_given_up_on_quickly") else {
        return;
    };
    let (addr, _) = serve(Arc::new(|_: &Seen| (200, String::new())), true).await;
    let env = EnvVars::of(&[(
        "AWS_EC2_METADATA_SERVICE_ENDPOINT",
        &format!("http://{addr}"),
    )]);
    let cloud = AwsCloud::new(chain_settings(&moto, env), store("blackhole")).unwrap();
    let started = Instant::now();
    let e = cloud.caller_identity().await.unwrap_err().to_string();
    let took = started.elapsed();
    assert!(
        e.contains("NoCredentials")
            && e.contains("instance metadata")
            && e.contains("no answer within 1000 ms"),
        "{e}"
    );
    // Not a speed target: only that the call did not wait on a 30 s deadline.
    assert!(took < Duration::from_secs(15), "{took:?}");

    // A service that only speaks IMDSv1 (no session token) is not used.
    let (addr, _) = serve(
        Arc::new(|r: &Seen| {
            if r.method == "PUT" {
                (403, String::new())
            } else {
                (200, "role".into())
            }
        }),
        false,
    )
    .await;
    let env = EnvVars::of(&[(
        "AWS_EC2_METADATA_SERVICE_ENDPOINT",
        &format!("http://{addr}"),
    )]);
    let cloud = AwsCloud::new(chain_settings(&moto, env), store("imdsv1")).unwrap();
    let e = cloud.caller_identity().await.unwrap_err().to_string();
    assert!(e.contains("IMDSv2"), "{e}");
}
