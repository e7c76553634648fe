//! AWS Signature Version 4 for the few APIs the driver calls (EC2, ELBv2 and
//! Route 53): a pure function of the request, the credentials and the time.
//! The procedure is AWS's published one ("Create a signed AWS API request"):
//! a canonical request, a string to sign over its hash, and an HMAC-SHA256
//! chain from the secret key through the date, region and service.

use hmac::{Hmac, KeyInit, Mac};
use sha2::{Digest, Sha256};
use std::fmt;

/// Access keys. `Debug` shows the key id only: the secret and the session token
/// never reach a log.
#[derive(Clone, PartialEq, Eq)]
pub struct Credentials {
    pub access_key_id: String,
    pub secret_access_key: String,
    pub session_token: Option<String>,
}

impl fmt::Debug for Credentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Credentials")
            .field("access_key_id", &self.access_key_id)
            .field("secret_access_key", &"<sensitive>")
            .field(
                "session_token",
                &self.session_token.as_ref().map(|_| "<sensitive>"),
            )
            .finish()
    }
}

/// What is signed: the request as it will be sent.
pub struct Request<'a> {
    pub method: &'a str,
    /// The `Host` header: host, and `:port` when not the scheme's default.
    pub host: &'a str,
    /// The path, already percent-encoded as sent (`/` for query APIs).
    pub path: &'a str,
    /// Query parameters, unencoded.
    pub query: &'a [(String, String)],
    /// Headers other than `host`, `x-amz-date` and `x-amz-security-token`,
    /// which [`sign`] adds; all of them are signed.
    pub headers: &'a [(String, String)],
    pub body: &'a [u8],
}

/// The headers to send with `req` (its own plus `host`, `x-amz-date`, the
/// session token if any, and `authorization`), signed for `service` in
/// `region` at `unix_seconds`.
pub fn sign(
    req: &Request<'_>,
    creds: &Credentials,
    region: &str,
    service: &str,
    unix_seconds: i64,
) -> Vec<(String, String)> {
    let t = lbscale_core::utc::UtcTime::from_unix_seconds(unix_seconds);
    let date = format!("{:04}{:02}{:02}", t.year, t.month, t.day);
    let amz_date = format!("{date}T{:02}{:02}{:02}Z", t.hour, t.minute, t.second);

    let mut headers: Vec<(String, String)> = req
        .headers
        .iter()
        .map(|(k, v)| (k.to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    headers.push(("host".into(), req.host.to_string()));
    headers.push(("x-amz-date".into(), amz_date.clone()));
    if let Some(token) = &creds.session_token {
        headers.push(("x-amz-security-token".into(), token.clone()));
    }
    headers.sort();
    let signed_headers = headers
        .iter()
        .map(|(k, _)| k.as_str())
        .collect::<Vec<_>>()
        .join(";");
    let canonical_headers: String = headers.iter().map(|(k, v)| format!("{k}:{v}\n")).collect();

    let canonical_request = format!(
        "{}\n{}\n{}\n{}\n{}\n{}",
        req.method,
        req.path,
        canonical_query(req.query),
        canonical_headers,
        signed_headers,
        hex(&Sha256::digest(req.body)),
    );
    let scope = format!("{date}/{region}/{service}/aws4_request");
    let string_to_sign = format!(
        "AWS4-HMAC-SHA256\n{amz_date}\n{scope}\n{}",
        hex(&Sha256::digest(canonical_request.as_bytes()))
    );
    let mut key = hmac(
        format!("AWS4{}", creds.secret_access_key).as_bytes(),
        date.as_bytes(),
    );
    for part in [region, service, "aws4_request"] {
        key = hmac(&key, part.as_bytes());
    }
    let signature = hex(&hmac(&key, string_to_sign.as_bytes()));
    headers.push((
        "authorization".into(),
        format!(
            "AWS4-HMAC-SHA256 Credential={}/{scope}, SignedHeaders={signed_headers}, Signature={signature}",
            creds.access_key_id
        ),
    ));
    headers
}

/// Parameters sorted by encoded name then value, `name=value` joined by `&`.
pub fn canonical_query(query: &[(String, String)]) -> String {
    let mut pairs: Vec<(String, String)> = query
        .iter()
        .map(|(k, v)| (uri_encode(k), uri_encode(v)))
        .collect();
    pairs.sort();
    pairs
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join("&")
}

/// A request target split into its path and its query parameters, decoded
/// (`/a/b?name=x%2Ey&type=A` gives `/a/b` and `[(name, x.y), (type, A)]`).
pub fn split_query(target: &str) -> (String, Vec<(String, String)>) {
    let Some((path, query)) = target.split_once('?') else {
        return (target.to_string(), Vec::new());
    };
    let pairs = query
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (uri_decode(k), uri_decode(v))
        })
        .collect();
    (path.to_string(), pairs)
}

fn uri_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = bytes
            .get(i + 1..i + 3)
            .and_then(|h| std::str::from_utf8(h).ok())
            .and_then(|h| u8::from_str_radix(h, 16).ok());
        match (bytes[i], hex) {
            (b'%', Some(b)) => {
                out.push(b);
                i += 3;
            }
            (b, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Percent-encoding of everything but RFC 3986's unreserved characters, as
/// the signature requires (and so as the query and form bodies are sent).
pub fn uri_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

fn hmac(key: &[u8], data: &[u8]) -> Vec<u8> {
    let mut mac =
        <Hmac<Sha256> as KeyInit>::new_from_slice(key).expect("HMAC takes any key length");
    mac.update(data);
    mac.finalize().into_bytes().to_vec()
}

/// The SHA-256 of `data`, in lowercase hex.
pub fn sha256_hex(data: &[u8]) -> String {
    hex(&Sha256::digest(data))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn example_credentials() -> Credentials {
        Credentials {
            access_key_id: "AKIDEXAMPLE".into(),
            secret_access_key: "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY".into(),
            session_token: None,
        }
    }

    /// AWS's own example of a signed request (IAM ListUsers, 2015-08-30
    /// 12:36:00 UTC, us-east-1), whose published signature is this one.
    #[test]
    fn signs_awss_published_example() {
        let query = [
            ("Action".to_string(), "ListUsers".to_string()),
            ("Version".to_string(), "2010-05-08".to_string()),
        ];
        let headers = [(
            "Content-Type".to_string(),
            "application/x-www-form-urlencoded; charset=utf-8".to_string(),
        )];
        let req = Request {
            method: "GET",
            host: "iam.amazonaws.com",
            path: "/",
            query: &query,
            headers: &headers,
            body: b"",
        };
        let signed = sign(
            &req,
            &example_credentials(),
            "us-east-1",
            "iam",
            1_440_938_160,
        );
        let auth = &signed.iter().find(|(k, _)| k == "authorization").unwrap().1;
        assert_eq!(
            auth,
            "AWS4-HMAC-SHA256 Credential=AKIDEXAMPLE/20150830/us-east-1/iam/aws4_request, \
             SignedHeaders=content-type;host;x-amz-date, \
             Signature=5d672d79c15b13162d9279b0855cfba6789a8edb4c82c400e06b5924a6f2b5d7"
        );
        assert!(signed.contains(&("x-amz-date".into(), "20150830T123600Z".into())));
    }

    fn authorization(signed: &[(String, String)]) -> &str {
        &signed.iter().find(|(k, _)| k == "authorization").unwrap().1
    }

    /// Signatures that botocore (AWS's Python SDK) computes for the driver's
    /// two shapes of call, at 2026-11-30 03:30:00 UTC: a Route 53 GET with a
    /// query, and an EC2 form POST with a session token.
    #[test]
    fn signs_as_botocore_does() {
        let (path, query) = split_query(
            "/2013-04-01/hostedzone/Z123/rrset?name=www.shop.example.com&type=A&maxitems=1",
        );
        let req = Request {
            method: "GET",
            host: "route53.amazonaws.com",
            path: &path,
            query: &query,
            headers: &[],
            body: b"",
        };
        let signed = sign(
            &req,
            &example_credentials(),
            "us-east-1",
            "route53",
            1_796_009_400,
        );
        assert_eq!(
            authorization(&signed),
            "AWS4-HMAC-SHA256 Credential=AKIDEXAMPLE/20261130/us-east-1/route53/aws4_request, \
             SignedHeaders=host;x-amz-date, \
             Signature=b16a55a33602139ee38e986f7f53219afe6f83e3b15c2176133c539f60dd50df"
        );
        let mut creds = example_credentials();
        creds.session_token = Some("SESSIONTOKEN/+=".into());
        let headers = [(
            "content-type".to_string(),
            "application/x-www-form-urlencoded; charset=utf-8".to_string(),
        )];
        let req = Request {
            method: "POST",
            host: "ec2.eu-west-1.amazonaws.com",
            path: "/",
            query: &[],
            headers: &headers,
            body: b"Action=DescribeInstances&Version=2016-11-15&Filter.1.Name=tag%3Albscale%3Anode-id&Filter.1.Value.1=web-az1-1-3f2a",
        };
        let signed = sign(&req, &creds, "eu-west-1", "ec2", 1_796_009_400);
        assert_eq!(
            authorization(&signed),
            "AWS4-HMAC-SHA256 Credential=AKIDEXAMPLE/20261130/eu-west-1/ec2/aws4_request, \
             SignedHeaders=content-type;host;x-amz-date;x-amz-security-token, \
             Signature=e54d50bcb989c787c60313710a3ea3dc041e65506ffdd5c1c2c0e3b15a54cbbb"
        );
    }

    #[test]
    fn a_session_token_is_signed_and_never_shown() {
        let mut creds = example_credentials();
        creds.session_token = Some("SESSIONSECRET".into());
        let req = Request {
            method: "POST",
            host: "ec2.eu-west-1.amazonaws.com",
            path: "/",
            query: &[],
            headers: &[],
            body: b"Action=DescribeInstances&Version=2016-11-15",
        };
        let signed = sign(&req, &creds, "eu-west-1", "ec2", 1_440_938_160);
        let auth = &signed.iter().find(|(k, _)| k == "authorization").unwrap().1;
        assert!(auth.contains("SignedHeaders=host;x-amz-date;x-amz-security-token,"));
        let shown = format!("{creds:?}");
        assert!(
            !shown.contains("SESSIONSECRET") && !shown.contains("EXAMPLEKEY"),
            "{shown}"
        );
    }

    #[test]
    fn query_is_encoded_and_sorted() {
        let q = [
            ("b".to_string(), "x y/z".to_string()),
            ("a".to_string(), "~1".to_string()),
        ];
        assert_eq!(canonical_query(&q), "a=~1&b=x%20y%2Fz");
        let (path, pairs) = split_query("/p/q?name=x%2Ey%20z&type=A&flag");
        assert_eq!(path, "/p/q");
        assert_eq!(
            pairs,
            [
                ("name".to_string(), "x.y z".to_string()),
                ("type".to_string(), "A".to_string()),
                ("flag".to_string(), String::new())
            ]
        );
    }
}
