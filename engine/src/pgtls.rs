//! TLS to a PostgreSQL store, with libpq's names and meanings for the URL's
//! parameters, so that a URL that works with `psql` works here:
//!
//! | `sslmode` | encrypted | server authenticated |
//! |---|---|---|
//! | `disable` | no | no |
//! | `prefer` (default) | if the server offers TLS (plain if its handshake fails) | no |
//! | `require` | yes | only with `sslrootcert` (then as `verify-ca`) |
//! | `verify-ca` | yes | certificate chain to `sslrootcert` |
//! | `verify-full` | yes | chain to `sslrootcert`, and the host name (or IP) |
//!
//! `sslrootcert=PATH` is a PEM file of the CA certificate(s) to trust (not the
//! server's own certificate: webpki refuses a CA as an end entity; and names
//! are checked against the subject alternative names only); the
//! verifying modes need it (libpq would look in `~/.postgresql/root.crt`; a
//! store should say which CA it trusts). rustls with the `ring` provider does
//! the work (already in the build for tonic); a server certificate is never
//! checked against the system's web roots.

use std::path::PathBuf;
use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{CertificateError, DigitallySignedStruct, SignatureScheme};

/// What `sslmode` asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SslMode {
    Disable,
    Prefer,
    Require,
    VerifyCa,
    VerifyFull,
}

/// The TLS parameters of a store URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct TlsParams {
    pub mode: SslMode,
    pub root_cert: Option<PathBuf>,
}

/// Takes `sslmode` and `sslrootcert` out of a `postgres://` URL (the PostgreSQL
/// client library only knows `disable|prefer|require` and no root file) and
/// returns the URL without them. Errors name the parameter and what is allowed.
pub(crate) fn split_tls_params(url: &str) -> Result<(String, TlsParams), String> {
    let mut params = TlsParams {
        mode: SslMode::Prefer,
        root_cert: None,
    };
    let Some((base, query)) = url.split_once('?') else {
        return Ok((url.to_string(), params));
    };
    let mut kept = Vec::new();
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        // The client library decodes keys too: `ssl%6Dode` is `sslmode`.
        match percent_decode(key).as_str() {
            "sslmode" => {
                params.mode = match percent_decode(value).as_str() {
                    "disable" => SslMode::Disable,
                    "prefer" => SslMode::Prefer,
                    "require" => SslMode::Require,
                    "verify-ca" => SslMode::VerifyCa,
                    "verify-full" => SslMode::VerifyFull,
                    other => {
                        return Err(format!(
                            "sslmode: must be one of disable, prefer, require, verify-ca, verify-full, got {other:?}"
                        ))
                    }
                }
            }
            "sslrootcert" => params.root_cert = Some(PathBuf::from(percent_decode(value))),
            _ => kept.push(pair),
        }
    }
    if matches!(params.mode, SslMode::VerifyCa | SslMode::VerifyFull) && params.root_cert.is_none()
    {
        return Err(format!(
            "sslmode={}: needs sslrootcert=PATH, a PEM file of the CA certificate that signed the server's",
            if params.mode == SslMode::VerifyCa { "verify-ca" } else { "verify-full" }
        ));
    }
    let url = if kept.is_empty() {
        base.to_string()
    } else {
        format!("{base}?{}", kept.join("&"))
    };
    Ok((url, params))
}

/// `%XX` escapes decoded (a path in a URL may carry them); anything malformed
/// is kept as it is.
fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' && i + 2 < bytes.len() {
            let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).ok();
            if let Some(b) = hex.and_then(|h| u8::from_str_radix(h, 16).ok()) {
                out.push(b);
                i += 3;
                continue;
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

impl TlsParams {
    /// The PostgreSQL client's own setting: it negotiates TLS; the connector
    /// below decides what is checked.
    pub fn client_mode(&self) -> postgres::config::SslMode {
        match self.mode {
            SslMode::Disable => postgres::config::SslMode::Disable,
            SslMode::Prefer => postgres::config::SslMode::Prefer,
            _ => postgres::config::SslMode::Require,
        }
    }

    /// The TLS connector for these parameters (unused with `disable`).
    pub fn connector(&self) -> Result<tokio_postgres_rustls::MakeRustlsConnect, String> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let verifier: Arc<dyn ServerCertVerifier> = match &self.root_cert {
            None => Arc::new(EncryptOnly(provider.clone())),
            Some(path) => {
                let roots =
                    crate::tlsroots::pem_roots(path).map_err(|e| format!("sslrootcert: {e}"))?;
                let webpki =
                    WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider.clone())
                        .build()
                        .map_err(|e| format!("sslrootcert: {e}"))?;
                Arc::new(ChainVerifier {
                    webpki,
                    check_name: self.mode == SslMode::VerifyFull,
                })
            }
        };
        let config = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| format!("TLS: {e}"))?
            .dangerous()
            .with_custom_certificate_verifier(verifier)
            .with_no_client_auth();
        Ok(tokio_postgres_rustls::MakeRustlsConnect::new(config))
    }
}

/// `prefer` / `require` without a root certificate, as libpq: the connection is
/// encrypted and the handshake's signatures are checked, but the server's
/// certificate is not authenticated.
#[derive(Debug)]
struct EncryptOnly(Arc<CryptoProvider>);

impl ServerCertVerifier for EncryptOnly {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }
    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }
    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }
    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// `verify-ca` (chain only) and `verify-full` (chain and name).
#[derive(Debug)]
struct ChainVerifier {
    webpki: Arc<WebPkiServerVerifier>,
    check_name: bool,
}

impl ServerCertVerifier for ChainVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        match self.webpki.verify_server_cert(
            end_entity,
            intermediates,
            server_name,
            ocsp_response,
            now,
        ) {
            // The chain is good; only the name is not the one connected to.
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) if !self.check_name => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }
    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.webpki.verify_tls12_signature(message, cert, dss)
    }
    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.webpki.verify_tls13_signature(message, cert, dss)
    }
    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.webpki.supported_verify_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tls_parameters_are_taken_out_of_the_url() {
        let (url, p) = split_tls_params(
            "postgres://u:pw@h:5/db?sslmode=verify-full&application_name=x&sslrootcert=%2Fetc%2Fca.pem",
        )
        .unwrap();
        assert_eq!(url, "postgres://u:pw@h:5/db?application_name=x");
        assert_eq!(p.mode, SslMode::VerifyFull);
        assert_eq!(p.root_cert, Some(PathBuf::from("/etc/ca.pem")));

        let (url, p) = split_tls_params("postgres://h/db").unwrap();
        assert_eq!(url, "postgres://h/db");
        assert_eq!(p.mode, SslMode::Prefer);

        let (url, p) = split_tls_params("postgres://h/db?sslmode=disable").unwrap();
        assert_eq!(url, "postgres://h/db");
        assert_eq!(p.mode, SslMode::Disable);
    }

    #[test]
    fn bad_tls_parameters_are_named() {
        let e = split_tls_params("postgres://h/db?sslmode=allow-ish").unwrap_err();
        assert!(e.starts_with("sslmode: must be one of"), "{e}");
        let e = split_tls_params("postgres://h/db?sslmode=verify-ca").unwrap_err();
        assert!(e.contains("needs sslrootcert=PATH"), "{e}");
        // An encoded key is the same key (the client library would decode it).
        let (url, p) = split_tls_params("postgres://h/db?ssl%6Dode=require").unwrap();
        assert_eq!(
            (url.as_str(), p.mode),
            ("postgres://h/db", SslMode::Require)
        );
    }
}
