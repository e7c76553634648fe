//! Who the node's management API answers (docs/security.md): over TLS, a
//! client with the engine's certificate from the node's group CA, carrying
//! this node's own token, calling the node's private address; and the engine
//! takes only its own node for the node.

mod common;

use std::time::Duration;

use common::*;
use lbscale_engine::nodeapi::auth::{self, GroupCa};
use lbscale_engine::nodeapi::{EngineCredentials, NodeClient};
use lbscale_proto::StatsRequest;

/// `serve` for node `node` of the test group on `listen`, API port `port`,
/// with `extra` options.
fn start(name: &str, node: &str, listen: &str, port: u16, extra: &[&str]) -> Proc {
    let dir = tmpdir(name);
    let files = api_files(&dir, node, None);
    let port = port.to_string();
    let mut args = vec![
        "serve",
        "--node-id",
        node,
        "--listen-ip",
        listen,
        "--api-port",
        &port,
        "--memory-limit-mb",
        "64",
    ];
    args.extend(files.iter().map(String::as_str));
    args.extend_from_slice(extra);
    let mut p = Proc::spawn(name, &args, &dir.join("node.log"));
    p.wait_ready(Duration::from_secs(10));
    p
}

async fn stats(mut c: Client) -> Result<String, tonic::Status> {
    c.get_stats(StatsRequest::default())
        .await
        .map(|r| r.into_inner().node_id)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_without_the_engines_certificate_is_refused() {
    let _node = start("tls-client", "web-az1-1-aaaa", "127.77.20.1", 7070, &[]);
    let addr = "127.77.20.1:7070";
    let ca = GroupCa::derive(SECRET).unwrap();
    let token = auth::node_token(SECRET, "web-az1-1-aaaa");
    // The node's own certificate and key (what its user data holds), another
    // node's, another group's engine, and no certificate at all.
    let own = auth::node_credentials(SECRET, "web-az1-1-aaaa").unwrap();
    let other = auth::node_credentials(SECRET, "web-az1-2-bbbb").unwrap();
    let foreign = GroupCa::derive(&"f".repeat(64)).unwrap();
    for (what, client) in [
        (
            "the node's own certificate",
            Some((own.cert_pem, own.key_pem)),
        ),
        (
            "another node's certificate",
            Some((other.cert_pem, other.key_pem)),
        ),
        (
            "another group's engine",
            Some(foreign.issue_engine().unwrap()),
        ),
        ("no certificate", None),
    ] {
        let refused = match api_channel(addr, "web-az1-1-aaaa", &ca.cert_pem(), client).await {
            // TLS 1.3: the client may finish its handshake before the
            // server has judged its certificate; the first call fails then.
            Ok(ch) => {
                let mut c = lbscale_proto::node_api_client::NodeApiClient::new(ch);
                let mut req = tonic::Request::new(StatsRequest::default());
                req.metadata_mut().insert(
                    lbscale_proto::AUTH_HEADER,
                    format!("Bearer {token}").parse().unwrap(),
                );
                c.get_stats(req).await.is_err()
            }
            Err(_) => true,
        };
        assert!(refused, "a client with {what} was answered");
    }
    // The engine's certificate, with the same token: answered.
    let c = api_client_with(addr, "web-az1-1-aaaa", Some(&token)).await;
    assert_eq!(
        stats(c).await.expect("the engine is answered"),
        "web-az1-1-aaaa"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_nodes_token_is_refused() {
    let _node = start("tls-token", "web-az1-1-cccc", "127.77.20.2", 7070, &[]);
    let addr = "127.77.20.2:7070";
    for (what, token) in [
        (
            "another node's token",
            auth::node_token(SECRET, "web-az1-2-dddd"),
        ),
        ("the group secret", SECRET.to_string()),
        (
            "another group's token for this node",
            auth::node_token(&"f".repeat(64), "web-az1-1-cccc"),
        ),
    ] {
        let e = stats(api_client_with(addr, "web-az1-1-cccc", Some(&token)).await)
            .await
            .expect_err(what);
        assert_eq!(e.code(), tonic::Code::Unauthenticated, "{what}: {e}");
    }
    let own = auth::node_token(SECRET, "web-az1-1-cccc");
    let c = api_client_with(addr, "web-az1-1-cccc", Some(&own)).await;
    assert_eq!(stats(c).await.expect("its own token"), "web-az1-1-cccc");
}

/// The token is bound to the node's private address: a node that listens on
/// every address answers only calls made to the one it is told is its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_to_another_address_of_the_node_is_refused() {
    let port = std::net::TcpListener::bind("0.0.0.0:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let _node = start(
        "tls-address",
        "web-az1-1-eeee",
        "0.0.0.0",
        port,
        &["--api-address", "127.77.20.3"],
    );
    let token = auth::node_token(SECRET, "web-az1-1-eeee");
    let c = api_client_with(
        &format!("127.77.20.4:{port}"),
        "web-az1-1-eeee",
        Some(&token),
    )
    .await;
    let e = stats(c).await.expect_err("a call made to another address");
    assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e}");
    assert!(e.message().contains("127.77.20.3"), "{e}");
    let c = api_client_with(
        &format!("127.77.20.3:{port}"),
        "web-az1-1-eeee",
        Some(&token),
    )
    .await;
    assert_eq!(
        stats(c).await.expect("its private address"),
        "web-az1-1-eeee"
    );

    // Listening on every address without being told its own: refused at start.
    let dir = tmpdir("tls-address-missing");
    let files = api_files(&dir, "web-az1-1-ffff", None);
    let out = std::process::Command::new(BIN)
        .args([
            "serve",
            "--node-id",
            "x",
            "--listen-ip",
            "0.0.0.0",
            "--api-port",
            "1",
        ])
        .args(["--memory-limit-mb", "64"])
        .args(&files)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("--api-address"),
        "{err}"
    );
}

/// The engine's client dials a node's address for a node id: it refuses a
/// node whose certificate is not that node's, before any token is sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_engine_refuses_a_node_that_is_not_its_node() {
    let _node = start("tls-engine", "web-az1-1-9999", "127.77.20.5", 7070, &[]);
    for (node, secret) in [
        ("web-az1-2-8888", SECRET.to_string()),
        ("web-az1-1-9999", "f".repeat(64)),
    ] {
        let e = match NodeClient::connect("127.77.20.5", 7070, node, &secret).await {
            Ok(_) => panic!("the engine took the node for {node} under {secret:.4}…"),
            Err(e) => e.to_string(),
        };
        assert!(e.contains("certificate") && e.contains(node), "{e}");
    }
    let mut c = NodeClient::connect("127.77.20.5", 7070, "web-az1-1-9999", SECRET)
        .await
        .expect("its own node");
    let configured = c
        .configure(lbscale_proto::NodeConfig {
            version: 7,
            ..Default::default()
        })
        .await
        .expect("Configure");
    assert_eq!(configured, 7);
}

/// The engine keeps one TLS client per group's credentials, so a second
/// connection to a node resumes its session instead of checking certificates
/// again; a resumed session still needs the node's token, another node's name
/// gets no session to resume, and a node that restarted (its sessions gone) is
/// dialled with a full handshake.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_connection_resumes_the_session_and_still_checks_name_and_token() {
    const NODE: &str = "web-az1-1-7777";
    let (ip, port) = ("127.77.20.6", 7070);
    let node = start("tls-resume", NODE, ip, port, &[]);
    let creds = EngineCredentials::issue(SECRET).unwrap();
    let mut first = NodeClient::connect_with(&creds, ip, port, NODE, SECRET)
        .await
        .expect("first connection");
    // The node's session tickets come after the handshake, before an answer.
    first.stats().await.expect("stats on the first connection");
    assert!(!first.resumed_session(), "nothing to resume yet");

    let mut second = NodeClient::connect_with(&creds, ip, port, NODE, SECRET)
        .await
        .expect("second connection");
    assert!(
        second.resumed_session(),
        "the second connection did not resume"
    );
    assert_eq!(second.stats().await.expect("stats, resumed").node_id, NODE);

    // Same credentials, a wrong token: the session resumes, the call is refused.
    let mut wrong = NodeClient::connect_with(&creds, ip, port, NODE, &"f".repeat(64))
        .await
        .expect("resumed connection");
    assert!(wrong.resumed_session());
    let e = wrong.stats().await.expect_err("a wrong token was taken");
    assert!(e.to_string().contains("Unauthenticated"), "{e}");

    // Another node's name at this address: no session for it, and the
    // certificate is refused.
    let e = match NodeClient::connect_with(&creds, ip, port, "web-az1-2-6666", SECRET).await {
        Ok(_) => panic!("the engine took node {NODE} for web-az1-2-6666"),
        Err(e) => e.to_string(),
    };
    assert!(
        e.contains("expected node web-az1-2-6666's certificate"),
        "{e}"
    );

    drop(node);
    let _node = start("tls-resume", NODE, ip, port, &[]);
    let mut after = NodeClient::connect_with(&creds, ip, port, NODE, SECRET)
        .await
        .expect("connection after the node's restart");
    assert!(
        !after.resumed_session(),
        "resumed a session the node forgot"
    );
    assert_eq!(
        after.stats().await.expect("stats after restart").node_id,
        NODE
    );
}
