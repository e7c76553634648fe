//! The certificate authorities that the engine's TLS clients trust: a PEM file
//! that the operator names (PostgreSQL's `sslrootcert`, AWS's `AWS_CA_BUNDLE`)
//! or the system's bundle.

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::CertificateDer;
use rustls::RootCertStore;
use std::path::Path;

/// Where distributions keep their CA bundle (Debian/Ubuntu, RHEL/Fedora, Alpine/BSD).
const SYSTEM_BUNDLES: &[&str] = &[
    "/etc/ssl/certs/ca-certificates.crt",
    "/etc/pki/tls/certs/ca-bundle.crt",
    "/etc/ssl/cert.pem",
];

/// Every certificate of the PEM file at `path`; an error says which file and why.
pub fn pem_roots(path: &Path) -> Result<RootCertStore, String> {
    let mut roots = RootCertStore::empty();
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    for cert in certs {
        let cert = cert.map_err(|e| format!("{} is not PEM certificates: {e}", path.display()))?;
        roots
            .add(cert)
            .map_err(|e| format!("a certificate in {} is not usable: {e}", path.display()))?;
    }
    if roots.is_empty() {
        return Err(format!("{} holds no certificate", path.display()));
    }
    Ok(roots)
}

/// The system's CA bundle, from the first of the usual places that has one.
pub fn system_roots() -> Result<RootCertStore, String> {
    SYSTEM_BUNDLES
        .iter()
        .map(Path::new)
        .find(|p| p.exists())
        .map(pem_roots)
        .unwrap_or_else(|| {
            Err(format!(
                "no system CA bundle (looked in {}); name a PEM file of trusted CAs",
                SYSTEM_BUNDLES.join(", ")
            ))
        })
}
