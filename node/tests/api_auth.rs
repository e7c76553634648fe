//! Who the node's management API answers (docs/security.md): over TLS, a
//! client with the engine's certificate from the node's group CA, carrying
//! this node's own token, calling the node's private address; and the engine
//! takes only its own node for the node.

mod common;

use std::time::Duration;

use common::*;
use lbscale_engine::nodeapi::auth::{self, GroupCa};
use lbscale_engine::nodeapi::stats::StatsClient;
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

/// The daemon's statistics call goes over HTTP/1.1 to a node that offers it:
/// one connection answers sample after sample, a resumed session still
/// needs the node's token, and a call made to another address of the node
/// is refused with the address it answers at.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_statistics_call_over_http1_keeps_its_connection_under_the_same_checks() {
    const NODE: &str = "web-az1-1-5555";
    let port = std::net::TcpListener::bind("0.0.0.0:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let _node = start(
        "stats-http1",
        NODE,
        "0.0.0.0",
        port,
        &["--api-address", "127.77.20.8"],
    );
    let creds = EngineCredentials::issue(SECRET).unwrap();
    let mut c = StatsClient::connect(&creds, "127.77.20.8", port, NODE, SECRET)
        .await
        .expect("a statistics connection");
    assert!(c.lean(), "the node offers HTTP/1.1 for its statistics");
    for _ in 0..3 {
        let s = c.stats_over(Duration::from_secs(60)).await.expect("stats");
        assert_eq!(s.node_id, NODE);
        assert!(c.reusable(), "the node keeps the connection");
    }

    // Resumed, with another group's token for this node: refused, and the
    // connection stays good for the next call.
    let mut wrong = StatsClient::connect(&creds, "127.77.20.8", port, NODE, &"f".repeat(64))
        .await
        .expect("a second connection");
    assert!(wrong.resumed_session(), "the second connection resumed");
    let e = wrong
        .stats_over(Duration::ZERO)
        .await
        .expect_err("a wrong token");
    assert!(
        e.to_string().contains("HTTP 401") && e.to_string().contains("bearer token"),
        "{e}"
    );
    assert!(wrong.reusable());
    let e = wrong.stats_over(Duration::ZERO).await.expect_err("again");
    assert!(
        e.to_string().contains("HTTP 401"),
        "the same connection answered: {e}"
    );

    let mut other = StatsClient::connect(&creds, "127.77.20.9", port, NODE, SECRET)
        .await
        .expect("a connection to another address of the node");
    let e = other
        .stats_over(Duration::ZERO)
        .await
        .expect_err("another address");
    assert!(
        e.to_string().contains("HTTP 403") && e.to_string().contains("127.77.20.8"),
        "{e}"
    );
}

/// A node that offers only gRPC (an `lbscale-node` from before the
/// statistics call had HTTP/1.1) still answers the daemon's statistics
/// client, over HTTP/2; such a connection is not the lean kind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_that_offers_only_grpc_is_asked_over_http2() {
    use lbscale_proto::node_api_server::{NodeApi, NodeApiServer};
    use lbscale_proto::{ConfigureReply, DrainReply, DrainRequest, NodeConfig, NodeStats};
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    use std::sync::Arc;

    struct GrpcOnly;
    #[tonic::async_trait]
    impl NodeApi for GrpcOnly {
        async fn configure(
            &self,
            _: tonic::Request<NodeConfig>,
        ) -> Result<tonic::Response<ConfigureReply>, tonic::Status> {
            Err(tonic::Status::unimplemented("not here"))
        }
        async fn drain(
            &self,
            _: tonic::Request<DrainRequest>,
        ) -> Result<tonic::Response<DrainReply>, tonic::Status> {
            Err(tonic::Status::unimplemented("not here"))
        }
        async fn get_stats(
            &self,
            req: tonic::Request<StatsRequest>,
        ) -> Result<tonic::Response<NodeStats>, tonic::Status> {
            Ok(tonic::Response::new(NodeStats {
                node_id: "grpc-only".into(),
                window_ms: req.into_inner().window_ms,
                ..Default::default()
            }))
        }
    }

    const NODE: &str = "web-az1-1-4444";
    let own = auth::node_credentials(SECRET, NODE).unwrap();
    let ca = GroupCa::derive(SECRET).unwrap();
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(CertificateDer::from_pem_slice(ca.cert_pem().as_bytes()).unwrap())
        .unwrap();
    let verifier = rustls::server::WebPkiClientVerifier::builder(Arc::new(roots))
        .build()
        .unwrap();
    let mut config = rustls::ServerConfig::builder()
        .with_client_cert_verifier(verifier)
        .with_single_cert(
            vec![CertificateDer::from_pem_slice(own.cert_pem.as_bytes()).unwrap()],
            PrivateKeyDer::from_pem_slice(own.key_pem.as_bytes()).unwrap(),
        )
        .unwrap();
    config.alpn_protocols = vec![b"h2".to_vec()];
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let listener = tokio::net::TcpListener::bind("127.77.20.10:0")
        .await
        .unwrap();
    let port = listener.local_addr().unwrap().port();
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    tokio::spawn(async move {
        while let Ok((s, _)) = listener.accept().await {
            if let Ok(tls) = acceptor.accept(s).await {
                let _ = tx.send(Ok::<_, std::io::Error>(tls)).await;
            }
        }
    });
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(NodeApiServer::new(GrpcOnly))
            .serve_with_incoming(tokio_stream::wrappers::ReceiverStream::new(rx)),
    );

    let creds = EngineCredentials::issue(SECRET).unwrap();
    let mut c = StatsClient::connect(&creds, "127.77.20.10", port, NODE, SECRET)
        .await
        .expect("a statistics connection");
    assert!(!c.lean(), "HTTP/2 was all the server offered");
    let s = c
        .stats_over(Duration::from_secs(30))
        .await
        .expect("stats over gRPC");
    assert_eq!((s.node_id.as_str(), s.window_ms), ("grpc-only", 30_000));
}
