//! TLS for the management API: the node shows its own certificate and accepts
//! only a client whose certificate the group's CA issued for a client (the
//! engine's; a node's certificate is a server's only). See docs/security.md.

use std::path::Path;
use std::sync::Arc;

use anyhow::{anyhow, Context};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;

/// The API's TLS configuration from the three PEM files that `serve` is given.
pub fn server_config(ca: &Path, cert: &Path, key: &Path) -> anyhow::Result<rustls::ServerConfig> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = rustls::RootCertStore::empty();
    for c in certs(ca, "--tls-ca")? {
        roots
            .add(c)
            .map_err(|e| anyhow!("--tls-ca {}: not a CA certificate: {e}", ca.display()))?;
    }
    let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider.clone())
        .build()
        .map_err(|e| anyhow!("--tls-ca {}: {e}", ca.display()))?;
    let key = PrivateKeyDer::from_pem_file(key)
        .map_err(|e| anyhow!("--tls-key {}: no private key in PEM: {e}", key.display()))?;
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .context("TLS protocol versions")?
        .with_client_cert_verifier(verifier)
        .with_single_cert(certs(cert, "--tls-cert")?, key)
        .map_err(|e| anyhow!("--tls-cert {} and --tls-key: {e}", cert.display()))?;
    // gRPC is HTTP/2; the statistics call also has HTTP/1.1, which a
    // client gets only by asking for it (the node's order comes first).
    config.alpn_protocols = vec![lbscale_proto::stats_http::ALPN.to_vec(), b"h2".to_vec()];
    // The engine resumes with the newest ticket per node and asks again at
    // every connection: one ticket per handshake is all it uses, and each
    // one takes a place in the session cache (rustls's, 256 sessions).
    config.send_tls13_tickets = 1;
    Ok(config)
}

fn certs(path: &Path, option: &str) -> anyhow::Result<Vec<CertificateDer<'static>>> {
    let certs = CertificateDer::pem_file_iter(path)
        .and_then(|it| it.collect::<Result<Vec<_>, _>>())
        .map_err(|e| anyhow!("{option} {}: {e}", path.display()))?;
    if certs.is_empty() {
        return Err(anyhow!("{option} {}: no certificate in it", path.display()));
    }
    Ok(certs)
}
