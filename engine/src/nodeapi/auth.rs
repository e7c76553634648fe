//! How the engine and a node know each other (docs/security.md).
//!
//! The store keeps one secret per group (`group_secrets`). Everything else is
//! derived from it or issued from it, so there is nothing more to keep:
//! - the group's CA: an Ed25519 key derived from the secret, so that the same CA
//!   comes back every time without its key being stored anywhere else;
//! - per node, at provision time: its token (an HMAC of the node id under the
//!   secret; the node is given only the token's SHA-256) and a server
//!   certificate for [`node_name`] with a fresh key;
//! - for the engine: its own client certificate, with a fresh key, issued per
//!   connection or kept for an hour per group by a caller that dials often
//!   (`nodeapi::EngineCredentials`).
//!
//! The certificates' extended key usages keep the two ends apart: a node's
//! certificate serves only (a node cannot pose as the engine to another node),
//! the engine's is a client's only.

use hmac::{Hmac, KeyInit, Mac};
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose, SanType, SerialNumber, PKCS_ED25519,
};
use sha2::{Digest, Sha256};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// What a node is given for its management API. `Debug` leaves the key out.
#[derive(Clone)]
pub struct NodeCredentials {
    /// The token file's content: `sha256:HEX`, the SHA-256 of the node's token
    /// (the token itself is never given to the node's boot configuration).
    pub token_file: String,
    /// The group CA's certificate (PEM): who may call the node.
    pub ca_pem: String,
    /// The node's server certificate (PEM), for [`node_name`].
    pub cert_pem: String,
    /// The node's private key (PEM, PKCS#8). Sensitive.
    pub key_pem: String,
}

impl std::fmt::Debug for NodeCredentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeCredentials")
            .field("token_file", &"sha256:…")
            .field("key_pem", &"<redacted>")
            .finish_non_exhaustive()
    }
}

/// The name a node's certificate is issued for, and that the engine checks when
/// it dials the node's private address. A DNS name made from the node id (a
/// node id may hold '_' or capitals and be longer than a DNS label), so that
/// it is known before the cloud gives the node an address.
pub fn node_name(node_id: &str) -> String {
    format!(
        "{}.node.lbscale",
        &hex(&Sha256::digest(node_id.as_bytes()))[..40]
    )
}

/// The node's bearer token: HMAC-SHA256 of the node id under the group secret,
/// hex. Another node's token is of no use here, nor is this one elsewhere.
pub fn node_token(group_secret: &str, node_id: &str) -> String {
    hex(&hmac(
        group_secret.as_bytes(),
        format!("lbscale node API token v1\n{node_id}").as_bytes(),
    ))
}

/// The `authorization` value of a call to the node: `Bearer` and its token.
/// A secret: never logged.
pub fn bearer(group_secret: &str, node_id: &str) -> String {
    format!("Bearer {}", node_token(group_secret, node_id))
}

/// What node `node_id` of the group whose secret is `group_secret` is given.
pub fn node_credentials(group_secret: &str, node_id: &str) -> Result<NodeCredentials, String> {
    let ca = GroupCa::derive(group_secret)?;
    let (cert_pem, key_pem) = ca.issue_node(node_id)?;
    Ok(NodeCredentials {
        token_file: format!(
            "sha256:{}",
            hex(&Sha256::digest(
                node_token(group_secret, node_id).as_bytes()
            ))
        ),
        ca_pem: ca.cert.pem(),
        cert_pem,
        key_pem,
    })
}

/// A group's certificate authority, derived from the group secret.
pub struct GroupCa {
    key: KeyPair,
    cert: rcgen::Certificate,
}

fn err(what: &str) -> impl Fn(rcgen::Error) -> String + '_ {
    move |e| format!("{what}: {e}")
}

impl GroupCa {
    pub fn derive(group_secret: &str) -> Result<GroupCa, String> {
        let seed = hmac(group_secret.as_bytes(), b"lbscale group CA key v1");
        let key = ed25519_from_seed(&seed).map_err(err("derive the group CA key"))?;
        // Fixed serial and validity: the same secret gives the same certificate.
        let mut params = CertificateParams::default();
        params.distinguished_name = dn("lbscale group CA");
        params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        params.serial_number = Some(SerialNumber::from_slice(&[1]));
        params.not_before = rcgen::date_time_ymd(2020, 1, 1);
        params.not_after = rcgen::date_time_ymd(9999, 12, 31);
        let cert = params
            .self_signed(&key)
            .map_err(err("make the group CA certificate"))?;
        Ok(GroupCa { key, cert })
    }

    pub fn cert_pem(&self) -> String {
        self.cert.pem()
    }

    /// A node's server certificate and key (PEM). It lasts as long as the node:
    /// once the node is gone its name is never dialled again.
    pub fn issue_node(&self, node_id: &str) -> Result<(String, String), String> {
        let name = node_name(node_id);
        let mut params = CertificateParams::default();
        params.distinguished_name = dn(&format!("lbscale node {node_id}"));
        params.subject_alt_names = vec![SanType::DnsName(
            name.clone().try_into().map_err(err("name the node"))?,
        )];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.not_before = rcgen::date_time_ymd(2020, 1, 1);
        params.not_after = rcgen::date_time_ymd(9999, 12, 31);
        self.issue(params, "the node's certificate")
    }

    /// The engine's client certificate and key (PEM), for one connection or
    /// one group's connections for an hour.
    /// Valid from a day before to a day after now, so that a node whose clock
    /// is somewhat off still accepts it.
    pub fn issue_engine(&self) -> Result<(String, String), String> {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        let day = Duration::from_secs(86_400);
        let epoch = rcgen::date_time_ymd(1970, 1, 1);
        let mut params = CertificateParams::default();
        params.distinguished_name = dn("lbscale engine");
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.not_before = epoch + now.saturating_sub(day);
        params.not_after = epoch + now + day;
        self.issue(params, "the engine's certificate")
    }

    fn issue(&self, params: CertificateParams, what: &str) -> Result<(String, String), String> {
        let key = KeyPair::generate_for(&PKCS_ED25519).map_err(err(what))?;
        let cert = params
            .signed_by(&key, &self.cert, &self.key)
            .map_err(err(what))?;
        Ok((cert.pem(), key.serialize_pem()))
    }
}

fn dn(common_name: &str) -> DistinguishedName {
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, common_name);
    dn
}

/// An Ed25519 key from a 32-byte seed (PKCS#8 v1: a fixed prefix, then the seed).
fn ed25519_from_seed(seed: &[u8]) -> Result<KeyPair, rcgen::Error> {
    const PREFIX: [u8; 16] = [
        0x30, 0x2e, 0x02, 0x01, 0x00, 0x30, 0x05, 0x06, 0x03, 0x2b, 0x65, 0x70, 0x04, 0x22, 0x04,
        0x20,
    ];
    let mut der = PREFIX.to_vec();
    der.extend_from_slice(&seed[..32]);
    KeyPair::from_pkcs8_der_and_sign_algo(&der.into(), &PKCS_ED25519)
}

fn hmac(key: &[u8], data: &[u8]) -> Vec<u8> {
    let mut mac =
        <Hmac<Sha256> as KeyInit>::new_from_slice(key).expect("HMAC takes any key length");
    mac.update(data);
    mac.finalize().into_bytes().to_vec()
}

fn hex(bytes: &[u8]) -> String {
    // One string, not one per byte: a token is derived at every connection.
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut out = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        out.push(DIGITS[usize::from(b >> 4)] as char);
        out.push(DIGITS[usize::from(b & 0xf)] as char);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECRET: &str = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

    #[test]
    fn hex_is_two_lowercase_digits_per_byte() {
        assert_eq!(hex(&[0x00, 0x0f, 0xa5, 0xff, 0x10]), "000fa5ff10");
        assert_eq!(hex(&[]), "");
    }

    #[test]
    fn the_same_secret_gives_the_same_ca_and_another_secret_another() {
        let a = GroupCa::derive(SECRET).unwrap().cert_pem();
        assert_eq!(a, GroupCa::derive(SECRET).unwrap().cert_pem());
        assert_ne!(
            a,
            GroupCa::derive(&SECRET.replace('0', "1"))
                .unwrap()
                .cert_pem()
        );
    }

    #[test]
    fn tokens_are_per_node_and_the_node_gets_their_hash_only() {
        let t1 = node_token(SECRET, "web-az1-1-00aa");
        assert_ne!(t1, node_token(SECRET, "web-az1-2-00bb"));
        assert_ne!(t1, node_token(&SECRET.replace('0', "1"), "web-az1-1-00aa"));
        let c = node_credentials(SECRET, "web-az1-1-00aa").unwrap();
        assert!(!c.token_file.contains(&t1));
        assert_eq!(
            c.token_file,
            format!("sha256:{}", hex(&Sha256::digest(t1.as_bytes())))
        );
        assert!(!format!("{c:?}").contains("PRIVATE KEY"));
    }

    #[test]
    fn node_names_are_dns_names_whatever_the_node_id() {
        let n = node_name("My_Group-eu-west-1a-12-ffff-with-a-rather-long-name-indeed-yes");
        assert!(n.len() < 64 && n.ends_with(".node.lbscale"));
        assert!(n
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '.'));
        assert_ne!(node_name("a"), node_name("b"));
    }
}
