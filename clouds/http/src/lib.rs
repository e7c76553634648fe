//! One HTTP/1.1 exchange of a cloud driver with its cloud's API: over TLS (or
//! plain HTTP where a URL says `http://`: an instance metadata endpoint, a
//! test server), on a new connection, within a deadline. The aws, gcp and
//! azure drivers share it. An error names what failed and where, never a
//! header's value (a bearer token, a signature).

use http_body_util::{BodyExt, Full};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpStream;

pub use hyper::body::Bytes;
/// A request as the drivers that sign their own (aws) build it, with
/// [`request`].
pub type Request = hyper::Request<Full<Bytes>>;

/// A builder of a [`Request`]: method, URI, headers.
pub fn request() -> hyper::http::request::Builder {
    hyper::Request::builder()
}

/// Where a URL points.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Url {
    pub tls: bool,
    pub host: String,
    pub port: u16,
    /// The path with its query, `/` at least.
    pub path: String,
}

impl Url {
    /// Parses `http(s)://HOST[:PORT][/PATH[?QUERY]]`; the error names the URL.
    pub fn parse(url: &str) -> Result<Url, String> {
        let bad = |why: &str| format!("URL {url:?}: {why}; expected http(s)://HOST[:PORT][/PATH]");
        let (tls, rest) = if let Some(r) = url.strip_prefix("https://") {
            (true, r)
        } else if let Some(r) = url.strip_prefix("http://") {
            (false, r)
        } else {
            return Err(bad("the scheme must be http or https"));
        };
        let (authority, path) = match rest.find(['/', '?']) {
            Some(i) if rest.as_bytes()[i] == b'/' => (&rest[..i], rest[i..].to_string()),
            Some(i) => (&rest[..i], format!("/{}", &rest[i..])),
            None => (rest, "/".to_string()),
        };
        if authority.is_empty() || authority.contains('@') {
            return Err(bad("a host is needed (and no user)"));
        }
        let (host, port) = match authority.rsplit_once(':') {
            Some((h, p)) if !h.is_empty() && !p.contains(']') => (
                h.to_string(),
                p.parse::<u16>()
                    .map_err(|_| bad("the port must be 1-65535"))?,
            ),
            _ => (authority.to_string(), if tls { 443 } else { 80 }),
        };
        // An IPv6 literal is connected to without its brackets.
        let host = host
            .strip_prefix('[')
            .and_then(|h| h.strip_suffix(']'))
            .map(str::to_string)
            .unwrap_or(host);
        Ok(Url {
            tls,
            host,
            port,
            path,
        })
    }

    /// The scheme, host and port, without a path: `https://host[:port]`.
    pub fn origin(&self) -> String {
        format!(
            "{}://{}",
            if self.tls { "https" } else { "http" },
            self.host_header()
        )
    }

    /// The `Host` header: the port only when it is not the scheme's default.
    pub fn host_header(&self) -> String {
        host_header(self.tls, &self.host, self.port)
    }
}

/// The `Host` header of `host:port` (brackets around an IPv6 literal; the port
/// only when it is not the scheme's default).
pub fn host_header(tls: bool, host: &str, port: u16) -> String {
    let host = if host.contains(':') {
        format!("[{host}]")
    } else {
        host.to_string()
    };
    if port == if tls { 443 } else { 80 } {
        host
    } else {
        format!("{host}:{port}")
    }
}

/// An answer.
#[derive(Debug, Clone)]
pub struct Response {
    pub status: u16,
    /// Names in lower case.
    pub headers: Vec<(String, String)>,
    pub body: Bytes,
}

impl Response {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// Sends one request (`body` with its content type) on a new connection and
/// reads the whole answer, all within `deadline`.
pub async fn send(
    tls: &Arc<rustls::ClientConfig>,
    method: &str,
    url: &Url,
    headers: &[(&str, &str)],
    body: Option<(&str, Vec<u8>)>,
    deadline: Duration,
) -> Result<Response, String> {
    let what = format!("{method} {}{}", url.origin(), path_only(&url.path));
    let mut req = hyper::Request::builder()
        .method(method)
        .uri(url.path.as_str())
        .header("host", url.host_header());
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let content = match body {
        Some((ct, b)) => {
            req = req.header("content-type", ct);
            b
        }
        None => Vec::new(),
    };
    let req = req
        .header("content-length", content.len())
        .body(Full::new(Bytes::from(content)))
        .map_err(|e| format!("{what}: building the request: {e}"))?;
    match tokio::time::timeout(deadline, round_trip(tls, url.tls, &url.host, url.port, req)).await {
        Err(_) => Err(format!(
            "{what}: no answer within {} ms",
            deadline.as_millis()
        )),
        Ok(Err(e)) => Err(format!("{what}: {e}")),
        Ok(Ok(r)) => Ok(r),
    }
}

/// The path without its query (which may be long, or carry a signature), for
/// messages.
fn path_only(path: &str) -> &str {
    path.split('?').next().unwrap_or(path)
}

/// Sends `req` to `host:port` (over TLS when `tls`) on a new connection and
/// reads the whole answer. No deadline of its own: the caller bounds it.
pub async fn round_trip(
    tls: &Arc<rustls::ClientConfig>,
    secure: bool,
    host: &str,
    port: u16,
    req: Request,
) -> Result<Response, String> {
    let tcp = TcpStream::connect((host, port))
        .await
        .map_err(|e| format!("connecting to {host}:{port}: {e}"))?;
    let _ = tcp.set_nodelay(true);
    if secure {
        let name = rustls::pki_types::ServerName::try_from(host.to_string())
            .map_err(|e| format!("{host}: not a TLS server name: {e}"))?;
        let io = tokio_rustls::TlsConnector::from(tls.clone())
            .connect(name, tcp)
            .await
            .map_err(|e| format!("TLS with {host}: {e}"))?;
        exchange(io, req).await
    } else {
        exchange(tcp, req).await
    }
}

async fn exchange<IO>(io: IO, req: Request) -> Result<Response, String>
where
    IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (mut sender, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(io))
            .await
            .map_err(|e| format!("HTTP handshake: {e}"))?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    let resp = sender
        .send_request(req)
        .await
        .map_err(|e| format!("sending the request: {e}"))?;
    let status = resp.status().as_u16();
    let headers = resp
        .headers()
        .iter()
        .map(|(k, v)| {
            (
                k.as_str().to_ascii_lowercase(),
                v.to_str().unwrap_or("").to_string(),
            )
        })
        .collect();
    let body = resp
        .into_body()
        .collect()
        .await
        .map_err(|e| format!("reading the answer: {e}"))?
        .to_bytes();
    Ok(Response {
        status,
        headers,
        body,
    })
}

/// The TLS client of a cloud's API: trusting the CAs of `ca_bundle` (a PEM
/// file) instead of the system's when it is given. `cloud` names the setting
/// in an error ("AWS", "GCP", "Azure").
pub fn client_tls(
    ca_bundle: Option<&Path>,
    cloud: &str,
) -> Result<Arc<rustls::ClientConfig>, String> {
    let roots = match ca_bundle {
        Some(path) => lbscale_engine::tlsroots::pem_roots(path)
            .map_err(|e| format!("{cloud} CA bundle: {e}"))?,
        None => lbscale_engine::tlsroots::system_roots()?,
    };
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|e| e.to_string())?
    .with_root_certificates(roots)
    .with_no_client_auth();
    Ok(Arc::new(config))
}

/// `%`-encodes a form, query or path value (RFC 3986 unreserved characters
/// kept).
pub fn encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                out.push(b as char)
            }
            _ => out.push_str(&format!("%{b:02X}")),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_parse_with_their_path_and_query() {
        let u = Url::parse("https://127.0.0.1:8443/subscriptions/s?api-version=1").unwrap();
        assert_eq!(
            (u.tls, u.host.as_str(), u.port, u.path.as_str()),
            (true, "127.0.0.1", 8443, "/subscriptions/s?api-version=1")
        );
        assert_eq!(u.origin(), "https://127.0.0.1:8443");
        let u = Url::parse("http://metadata.google.internal").unwrap();
        assert_eq!((u.port, u.path.as_str()), (80, "/"));
        assert_eq!(u.host_header(), "metadata.google.internal");
        assert_eq!(Url::parse("https://h?x=1").unwrap().path, "/?x=1");
        let u = Url::parse("http://[::1]:80/x").unwrap();
        assert_eq!(
            (u.host.as_str(), u.host_header()),
            ("::1", "[::1]".to_string())
        );
        assert_eq!(
            Url::parse("https://[::1]:5/").unwrap().host_header(),
            "[::1]:5"
        );
    }

    #[test]
    fn a_bad_url_is_refused_by_name() {
        for bad in [
            "ftp://x",
            "https://",
            "http://h:99999/",
            "https://h:0x",
            "compute.googleapis.com",
            "https://u@h/",
        ] {
            let e = Url::parse(bad).unwrap_err();
            assert!(e.contains(bad) && e.contains("http(s)://HOST"), "{e}");
        }
    }

    #[test]
    fn values_are_percent_encoded() {
        assert_eq!(encode("a b&c=/é"), "a%20b%26c%3D%2F%C3%A9");
        assert_eq!(encode("labels.a = \"b\""), "labels.a%20%3D%20%22b%22");
        assert_eq!(
            encode("https://management.azure.com/.default"),
            "https%3A%2F%2Fmanagement.azure.com%2F.default"
        );
    }

    #[test]
    fn a_missing_ca_bundle_is_named() {
        let e = client_tls(Some(Path::new("/nonexistent/ca.pem")), "GCP").unwrap_err();
        assert!(
            e.starts_with("GCP CA bundle: ") && e.contains("/nonexistent/ca.pem"),
            "{e}"
        );
    }

    /// A real exchange with a plain-HTTP server on loopback: status, headers in
    /// lower case, body; and the deadline, named.
    #[tokio::test]
    async fn one_exchange_and_its_deadline() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = l.local_addr().unwrap().port();
        tokio::spawn(async move {
            // The first connection is answered; the second never is.
            let (mut s, _) = l.accept().await.unwrap();
            let mut buf = vec![0u8; 4096];
            let mut got = Vec::new();
            while !String::from_utf8_lossy(&got).contains("\r\n\r\nhi") {
                let n = s.read(&mut buf).await.unwrap();
                got.extend_from_slice(&buf[..n]);
            }
            let req = String::from_utf8_lossy(&got).to_lowercase();
            assert!(req.starts_with("post /p?q=1 http/1.1\r\n"), "{req}");
            assert!(
                req.contains("content-type: text/plain") && req.contains("x-a: b"),
                "{req}"
            );
            s.write_all(b"HTTP/1.1 201 Created\r\nX-Thing: One\r\ncontent-length: 2\r\n\r\nok")
                .await
                .unwrap();
            let (_held, _) = l.accept().await.unwrap();
            tokio::time::sleep(Duration::from_secs(5)).await;
        });
        // Plain HTTP: the TLS client is not used.
        let tls = Arc::new(
            rustls::ClientConfig::builder_with_provider(Arc::new(
                rustls::crypto::ring::default_provider(),
            ))
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(rustls::RootCertStore::empty())
            .with_no_client_auth(),
        );
        let url = Url::parse(&format!("http://127.0.0.1:{port}/p?q=1")).unwrap();
        let r = send(
            &tls,
            "POST",
            &url,
            &[("x-a", "b")],
            Some(("text/plain", b"hi".to_vec())),
            Duration::from_secs(5),
        )
        .await
        .unwrap();
        assert_eq!(
            (r.status, r.header("x-thing"), &r.body[..]),
            (201, Some("One"), &b"ok"[..])
        );
        let e = send(&tls, "GET", &url, &[], None, Duration::from_millis(300))
            .await
            .unwrap_err();
        assert_eq!(
            e,
            format!("GET http://127.0.0.1:{port}/p: no answer within 300 ms")
        );
    }
}
