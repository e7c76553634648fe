//! One HTTP/1.1 exchange over TLS (or plain HTTP for a loopback test endpoint
//! and the metadata server), on a new connection, bounded by a deadline.

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpStream;

/// Where a request goes: `http(s)://HOST[:PORT]` and the path after it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Url {
    pub tls: bool,
    pub host: String,
    pub port: u16,
    /// From the first `/` on (`/` when there is none), query included.
    pub path: String,
}

impl Url {
    /// Parses `http(s)://HOST[:PORT][/PATH]`; the error names the URL.
    pub fn parse(url: &str) -> Result<Url, String> {
        let bad = |why: &str| format!("URL {url:?}: {why}; expected http(s)://HOST[:PORT][/PATH]");
        let (tls, rest) = if let Some(r) = url.strip_prefix("https://") {
            (true, r)
        } else if let Some(r) = url.strip_prefix("http://") {
            (false, r)
        } else {
            return Err(bad("the scheme must be http or https"));
        };
        let (authority, path) = match rest.find('/') {
            Some(i) => (&rest[..i], rest[i..].to_string()),
            None => (rest, "/".to_string()),
        };
        if authority.is_empty() || authority.contains('@') {
            return Err(bad("no host"));
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

    /// The `Host` header: the port only when it is not the scheme's default.
    pub fn host_header(&self) -> String {
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

/// An answer: its status and body.
pub struct Answer {
    pub status: u16,
    pub body: Bytes,
}

/// Sends `method` to `url` with `headers` and `body`, answered within
/// `deadline`. The error says what failed and where, never a header's value.
pub async fn send(
    tls: &Arc<rustls::ClientConfig>,
    method: &str,
    url: &Url,
    headers: &[(&str, String)],
    body: Vec<u8>,
    deadline: Duration,
) -> Result<Answer, String> {
    let mut req = hyper::Request::builder()
        .method(method)
        .uri(url.path.as_str())
        .header("host", url.host_header())
        .header("content-length", body.len());
    for (k, v) in headers {
        req = req.header(*k, v.as_str());
    }
    let req = req
        .body(Full::new(Bytes::from(body)))
        .map_err(|e| format!("building the request: {e}"))?;
    match tokio::time::timeout(deadline, exchange(tls, url, req)).await {
        Ok(r) => r,
        Err(_) => Err(format!(
            "no answer from {}:{} within {}s",
            url.host,
            url.port,
            deadline.as_secs()
        )),
    }
}

async fn exchange(
    tls: &Arc<rustls::ClientConfig>,
    url: &Url,
    req: hyper::Request<Full<Bytes>>,
) -> Result<Answer, String> {
    let tcp = TcpStream::connect((url.host.as_str(), url.port))
        .await
        .map_err(|e| format!("connecting to {}:{}: {e}", url.host, url.port))?;
    let _ = tcp.set_nodelay(true);
    if url.tls {
        let name = rustls::pki_types::ServerName::try_from(url.host.clone())
            .map_err(|e| format!("{}: not a TLS server name: {e}", url.host))?;
        let stream = tokio_rustls::TlsConnector::from(tls.clone())
            .connect(name, tcp)
            .await
            .map_err(|e| format!("TLS with {}: {e}", url.host))?;
        over(stream, req).await
    } else {
        over(tcp, req).await
    }
}

async fn over<IO>(io: IO, req: hyper::Request<Full<Bytes>>) -> Result<Answer, String>
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
    let body = resp
        .into_body()
        .collect()
        .await
        .map_err(|e| format!("reading the answer: {e}"))?
        .to_bytes();
    Ok(Answer { status, body })
}

/// `s` percent-encoded for a URL's query or path segment (RFC 3986 unreserved kept).
pub fn encode(s: &str) -> String {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_parse_and_refuse_by_name() {
        let u = Url::parse("https://127.0.0.1:8443/compute/v1/").unwrap();
        assert_eq!(
            (u.tls, u.host.as_str(), u.port, u.path.as_str()),
            (true, "127.0.0.1", 8443, "/compute/v1/")
        );
        let u = Url::parse("http://metadata.google.internal").unwrap();
        assert_eq!((u.port, u.path.as_str()), (80, "/"));
        assert_eq!(u.host_header(), "metadata.google.internal");
        let u = Url::parse("http://[::1]:80/x").unwrap();
        assert_eq!(
            (u.host.as_str(), u.host_header()),
            ("::1", "[::1]".to_string())
        );
        for bad in [
            "ftp://x",
            "https://",
            "http://h:99999/",
            "compute.googleapis.com",
        ] {
            let e = Url::parse(bad).unwrap_err();
            assert!(e.contains(bad) && e.contains("http(s)://"), "{e}");
        }
        assert_eq!(encode("labels.a = \"b\""), "labels.a%20%3D%20%22b%22");
    }
}
