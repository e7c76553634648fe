//! One HTTP/1.1 exchange over TLS (or plain HTTP where a URL says `http://`:
//! the instance metadata endpoint, a test server), with a deadline. The
//! answer's status, headers and body; an error names the URL and what went
//! wrong, never a header's value (a bearer token).

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpStream;

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
    /// Parses `http(s)://HOST[:PORT][/PATH[?QUERY]]`.
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

    fn host_header(&self) -> String {
        let host = if self.host.contains(':') {
            format!("[{}]", self.host)
        } else {
            self.host.clone()
        };
        if self.port == if self.tls { 443 } else { 80 } {
            host
        } else {
            format!("{host}:{}", self.port)
        }
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

/// Sends one request on a new connection and reads the whole answer, all
/// within `deadline`.
pub async fn send(
    tls: &Arc<rustls::ClientConfig>,
    method: &str,
    url: &Url,
    headers: &[(&str, &str)],
    body: Option<(&str, Vec<u8>)>,
    deadline: Duration,
) -> Result<Response, String> {
    let what = format!("{method} {}{}", url.origin(), path_only(&url.path));
    match tokio::time::timeout(deadline, exchange(tls, method, url, headers, body)).await {
        Err(_) => Err(format!("{what}: no answer within {}s", deadline.as_secs())),
        Ok(Err(e)) => Err(format!("{what}: {e}")),
        Ok(Ok(r)) => Ok(r),
    }
}

/// The path without its query (which may be long), for messages.
fn path_only(path: &str) -> &str {
    path.split('?').next().unwrap_or(path)
}

async fn exchange(
    tls: &Arc<rustls::ClientConfig>,
    method: &str,
    url: &Url,
    headers: &[(&str, &str)],
    body: Option<(&str, Vec<u8>)>,
) -> Result<Response, String> {
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
        .map_err(|e| format!("building the request: {e}"))?;
    let tcp = TcpStream::connect((url.host.as_str(), url.port))
        .await
        .map_err(|e| format!("connecting to {}:{}: {e}", url.host, url.port))?;
    let _ = tcp.set_nodelay(true);
    if url.tls {
        let name = rustls::pki_types::ServerName::try_from(url.host.clone())
            .map_err(|e| format!("{}: not a TLS server name: {e}", url.host))?;
        let io = tokio_rustls::TlsConnector::from(tls.clone())
            .connect(name, tcp)
            .await
            .map_err(|e| format!("TLS with {}: {e}", url.host))?;
        round_trip(io, req).await
    } else {
        round_trip(tcp, req).await
    }
}

async fn round_trip<IO>(io: IO, req: hyper::Request<Full<Bytes>>) -> Result<Response, String>
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

/// `%`-encodes a form or query value (RFC 3986 unreserved characters kept).
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
        let u = Url::parse("http://169.254.169.254").unwrap();
        assert_eq!((u.port, u.path.as_str()), (80, "/"));
        assert_eq!(Url::parse("https://h?x=1").unwrap().path, "/?x=1");
        assert_eq!(Url::parse("https://[::1]:5/").unwrap().host, "::1");
        for bad in [
            "ftp://x",
            "https://",
            "https://h:0x",
            "h:80",
            "https://u@h/",
        ] {
            assert!(
                Url::parse(bad).unwrap_err().contains("http(s)://HOST"),
                "{bad}"
            );
        }
    }

    #[test]
    fn values_are_percent_encoded() {
        assert_eq!(encode("a b&c=/é"), "a%20b%26c%3D%2F%C3%A9");
        assert_eq!(
            encode("https://management.azure.com/.default"),
            "https%3A%2F%2Fmanagement.azure.com%2F.default"
        );
    }
}
