//! The statistics call over HTTP/1.1, beside gRPC's `GetStats` on the same
//! port and TLS, chosen by ALPN (`http/1.1`).
//!
//! The daemon asks every node for its statistics at every sample. Over
//! HTTP/1.1 a connection kept between samples holds nothing but its TLS
//! session: a request and its answer are the only state, and neither
//! outlives the call. An HTTP/2 connection keeps its framing buffers and
//! tables (tens of KiB) for as long as it is open. So the daemon can keep a
//! connection to every node it samples, where a new TLS handshake per node
//! and sample would cost it most of its CPU.
//!
//! `GET /v1/stats?window_ms=N` with `authorization: Bearer TOKEN` (the
//! node's token, as for gRPC) answers `200` with the `NodeStats` message in
//! protobuf (`application/x-protobuf`, with a `content-length`), or an error
//! status with a line of text that says why. The connection is kept unless
//! either side says `connection: close`.

use prost::Message;
use std::io;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::NodeStats;

/// The ALPN protocol that selects this call on the management API's port.
pub const ALPN: &[u8] = b"http/1.1";
/// The request's path.
pub const PATH: &str = "/v1/stats";
/// The longest request or answer head either side reads.
const MAX_HEAD: usize = 8 * 1024;
/// The largest answer body the client takes (gRPC's default message limit).
const MAX_BODY: usize = 4 << 20;
/// How long a request's head may take once its first byte is in.
const HEAD_TIMEOUT: Duration = Duration::from_secs(10);
const MAX_HEADERS: usize = 32;
/// After a bad request's answer, what its client still sends is read and
/// dropped, this much at most and for this long at most, before the
/// connection closes: closed with unread data, it would be reset, and a
/// reset can cost the client the answer that says what was wrong.
const LINGER_BYTES: usize = 64 * 1024;
const LINGER_TIME: Duration = Duration::from_secs(2);

/// The request for the statistics over the last `window`.
pub fn request(host: &str, window: Duration, authorization: &str) -> Vec<u8> {
    format!(
        "GET {PATH}?window_ms={} HTTP/1.1\r\nhost: {host}\r\nauthorization: {authorization}\r\n\r\n",
        window.as_millis()
    )
    .into_bytes()
}

/// What the node answered.
pub struct Answer {
    pub status: u16,
    pub body: Vec<u8>,
    /// The node keeps the connection for the next request.
    pub keep_alive: bool,
}

fn invalid(what: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what.into())
}

/// Reads one answer from `io`. An answer cut short is `UnexpectedEof`, a
/// malformed one `InvalidData`, each saying what was wrong.
pub async fn read_answer<R: AsyncRead + Unpin>(io: &mut R) -> io::Result<Answer> {
    let mut buf = Vec::with_capacity(1024);
    let (status, head_len, length, keep_alive) = loop {
        let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
        let mut parsed = httparse::Response::new(&mut headers);
        match parsed.parse(&buf) {
            Ok(httparse::Status::Complete(n)) => {
                let status = parsed.code.unwrap_or(0);
                let mut length = None;
                let mut keep_alive = parsed.version == Some(1);
                for h in parsed.headers.iter() {
                    if h.name.eq_ignore_ascii_case("content-length") {
                        if length.is_some() {
                            return Err(invalid("more than one content-length"));
                        }
                        let v = std::str::from_utf8(h.value)
                            .ok()
                            .and_then(|v| v.parse().ok());
                        length = Some(
                            v.ok_or_else(|| invalid("a content-length that is not a number"))?,
                        );
                    } else if h.name.eq_ignore_ascii_case("transfer-encoding") {
                        return Err(invalid(
                            "a transfer-encoding (only content-length is expected)",
                        ));
                    } else if h.name.eq_ignore_ascii_case("connection")
                        && h.value.eq_ignore_ascii_case(b"close")
                    {
                        keep_alive = false;
                    }
                }
                let length: usize =
                    length.ok_or_else(|| invalid("an answer without content-length"))?;
                if length > MAX_BODY {
                    return Err(invalid(format!(
                        "an answer of {length} bytes (at most {MAX_BODY} are taken)"
                    )));
                }
                break (status, n, length, keep_alive);
            }
            Ok(httparse::Status::Partial) if buf.len() < MAX_HEAD => {}
            Ok(httparse::Status::Partial) => {
                return Err(invalid(format!("an answer head over {MAX_HEAD} bytes")))
            }
            Err(e) => return Err(invalid(format!("a malformed answer head: {e}"))),
        }
        buf.reserve(1024);
        if io.read_buf(&mut buf).await? == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "the node closed the connection before its answer",
            ));
        }
    };
    let mut body = buf.split_off(head_len);
    if body.len() > length {
        return Err(invalid("more bytes than the answer's content-length"));
    }
    if body.len() < length {
        let have = body.len();
        body.resize(length, 0);
        io.read_exact(&mut body[have..]).await?;
    }
    Ok(Answer {
        status,
        body,
        keep_alive,
    })
}

/// What a request asks, as the node's handler sees it.
pub struct Asked {
    pub window: Duration,
    /// The `authorization` header's value, if any.
    pub authorization: Option<Vec<u8>>,
}

/// The handler's answer.
#[allow(clippy::large_enum_variant)] // one per answer, moved once
pub enum Reply {
    Stats(NodeStats),
    /// A status (401, 403, ...) and a line saying why.
    Refused(u16, String),
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        400 => "Bad Request",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        431 => "Request Header Fields Too Large",
        _ => "Error",
    }
}

fn response(status: u16, content_type: &str, body: &[u8], close: bool) -> Vec<u8> {
    let mut out = format!(
        "HTTP/1.1 {status} {}\r\ncontent-type: {content_type}\r\ncontent-length: {}\r\n{}\r\n",
        reason(status),
        body.len(),
        if close { "connection: close\r\n" } else { "" }
    )
    .into_bytes();
    out.extend_from_slice(body);
    out
}

/// A request's head: what it asks, or the status and reason to refuse it
/// with (the connection is then closed).
enum Head {
    Asked { asked: Asked, close: bool },
    Bad(u16, String),
}

fn head(req: &httparse::Request) -> Head {
    let bad = |status, why: &str| Head::Bad(status, why.to_string());
    if req.method != Some("GET") {
        return bad(405, "only GET is answered here");
    }
    let path = req.path.unwrap_or("");
    let (route, query) = path.split_once('?').unwrap_or((path, ""));
    if route != PATH {
        return Head::Bad(404, format!("{route}: the statistics are at {PATH}"));
    }
    let mut window = Duration::ZERO;
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        match pair.split_once('=') {
            Some(("window_ms", v)) => match v.parse::<u64>() {
                Ok(ms) => window = Duration::from_millis(ms),
                Err(_) => return bad(400, "window_ms must be a whole number of milliseconds"),
            },
            _ => return Head::Bad(400, format!("{pair}: the only parameter is window_ms")),
        }
    }
    let mut close = req.version != Some(1);
    let mut authorization = None;
    for h in req.headers.iter() {
        if h.name.eq_ignore_ascii_case("authorization") {
            if authorization.is_some() {
                return bad(400, "more than one authorization header");
            }
            authorization = Some(h.value.to_vec());
        } else if h.name.eq_ignore_ascii_case("transfer-encoding")
            || (h.name.eq_ignore_ascii_case("content-length") && h.value != b"0")
        {
            return bad(400, "a GET of the statistics has no body");
        } else if h.name.eq_ignore_ascii_case("connection")
            && h.value.eq_ignore_ascii_case(b"close")
        {
            close = true;
        }
    }
    Head::Asked {
        asked: Asked {
            window,
            authorization,
        },
        close,
    }
}

/// Serves the requests of one connection, one at a time, until the client
/// closes it, asks to, sends what is not a statistics request, or sends
/// nothing for `idle` between requests. `handle` answers each request.
pub async fn serve<S, F, Fut>(io: S, idle: Duration, handle: F) -> io::Result<()>
where
    S: AsyncRead + AsyncWrite + Unpin,
    F: FnMut(Asked) -> Fut,
    Fut: std::future::Future<Output = Reply>,
{
    serve_within(io, idle, HEAD_TIMEOUT, handle).await
}

/// [`serve`], a request's head due within `head_timeout` of its first byte.
async fn serve_within<S, F, Fut>(
    mut io: S,
    idle: Duration,
    head_timeout: Duration,
    mut handle: F,
) -> io::Result<()>
where
    S: AsyncRead + AsyncWrite + Unpin,
    F: FnMut(Asked) -> Fut,
    Fut: std::future::Future<Output = Reply>,
{
    // Emptied between requests: a kept connection holds a read's room only.
    let mut buf = Vec::new();
    loop {
        // Set by a request's first byte: the whole head must follow by then.
        let mut head_by = None;
        let (parsed, used) = loop {
            let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
            let mut req = httparse::Request::new(&mut headers);
            match req.parse(&buf) {
                Ok(httparse::Status::Complete(n)) => break (head(&req), n),
                Ok(httparse::Status::Partial) if buf.len() < MAX_HEAD => {}
                Ok(httparse::Status::Partial) => {
                    break (
                        Head::Bad(431, format!("a request head over {MAX_HEAD} bytes")),
                        0,
                    )
                }
                Err(e) => break (Head::Bad(400, format!("a malformed request: {e}")), 0),
            }
            let by = match head_by {
                _ if buf.is_empty() => tokio::time::Instant::now() + idle,
                Some(by) => by,
                None => *head_by.insert(tokio::time::Instant::now() + head_timeout),
            };
            buf.reserve(1024);
            match tokio::time::timeout_at(by, io.read_buf(&mut buf)).await {
                Ok(Ok(0)) => return Ok(()),
                Ok(Ok(_)) => {}
                Ok(Err(e)) => return Err(e),
                // Idle: closed quietly. A head begun and not finished: told.
                Err(_) if buf.is_empty() => return Ok(()),
                Err(_) => {
                    let why = format!("no whole request head within {head_timeout:?}");
                    break (Head::Bad(408, why), 0);
                }
            }
        };
        let bad = matches!(parsed, Head::Bad(..));
        let (out, close) = match parsed {
            Head::Bad(status, why) => (response(status, "text/plain", why.as_bytes(), true), true),
            Head::Asked { asked, close } => match handle(asked).await {
                Reply::Stats(stats) => (
                    response(200, "application/x-protobuf", &stats.encode_to_vec(), close),
                    close,
                ),
                Reply::Refused(status, why) => {
                    (response(status, "text/plain", why.as_bytes(), close), close)
                }
            },
        };
        tokio::time::timeout(HEAD_TIMEOUT, async {
            io.write_all(&out).await?;
            io.flush().await
        })
        .await
        .map_err(|_| {
            io::Error::new(io::ErrorKind::TimedOut, "the answer was not taken in time")
        })??;
        if close {
            let _ = tokio::time::timeout(HEAD_TIMEOUT, io.shutdown()).await;
            // A bad request, or requests sent after the one that closes:
            // the client may still be sending.
            if bad || buf.len() > used {
                linger(&mut io).await;
            }
            return Ok(());
        }
        buf.drain(..used);
        if buf.is_empty() {
            buf = Vec::new();
        }
    }
}

/// Reads and drops what the client still sends after a bad request's answer
/// (see [`LINGER_BYTES`]), until it closes, fails, or the limits are reached.
async fn linger<S: AsyncRead + Unpin>(io: &mut S) {
    // On the heap: a buffer in the future would grow every kept connection's.
    let mut scratch = vec![0u8; 4096];
    let mut left = LINGER_BYTES;
    let _ = tokio::time::timeout(LINGER_TIME, async {
        while left > 0 {
            match io.read(&mut scratch).await {
                Ok(0) | Err(_) => break,
                Ok(n) => left = left.saturating_sub(n),
            }
        }
    })
    .await;
}

#[cfg(test)]
mod tests {
    use super::*;

    type Served = (
        tokio::io::DuplexStream,
        tokio::task::JoinHandle<io::Result<()>>,
    );

    async fn answered(window: Duration) -> Served {
        answered_within(window, HEAD_TIMEOUT).await
    }

    /// A server of the statistics for `window` on the far side of a pipe.
    async fn answered_within(window: Duration, head_timeout: Duration) -> Served {
        let (near, far) = tokio::io::duplex(1 << 16);
        let server = tokio::spawn(serve_within(
            far,
            Duration::from_secs(60),
            head_timeout,
            move |asked: Asked| async move {
                if asked.authorization.as_deref() != Some(b"Bearer right".as_slice()) {
                    return Reply::Refused(401, "missing or invalid bearer token".into());
                }
                assert_eq!(asked.window, window);
                Reply::Stats(NodeStats {
                    node_id: "n1".into(),
                    window_ms: asked.window.as_millis() as u64,
                    cpu_percent: 42.5,
                    ..Default::default()
                })
            },
        ));
        (near, server)
    }

    #[tokio::test]
    async fn one_connection_answers_request_after_request_and_refuses_a_wrong_token() {
        let window = Duration::from_secs(60);
        let (mut io, server) = answered(window).await;
        for _ in 0..3 {
            io.write_all(&request("node-n1", window, "Bearer right"))
                .await
                .unwrap();
            let a = read_answer(&mut io).await.unwrap();
            assert_eq!(a.status, 200);
            assert!(a.keep_alive);
            let stats = NodeStats::decode(a.body.as_slice()).unwrap();
            assert_eq!(
                (stats.node_id.as_str(), stats.window_ms, stats.cpu_percent),
                ("n1", 60_000, 42.5)
            );
        }
        io.write_all(&request("node-n1", window, "Bearer wrong"))
            .await
            .unwrap();
        let a = read_answer(&mut io).await.unwrap();
        assert_eq!(a.status, 401);
        assert_eq!(a.body, b"missing or invalid bearer token");
        assert!(a.keep_alive, "a refusal keeps the connection");
        drop(io);
        server.await.unwrap().unwrap();
    }

    #[tokio::test]
    async fn what_is_not_a_statistics_request_is_refused_with_why_and_the_connection_closed() {
        let cases: [(&[u8], u16, &str); 4] = [
            (b"POST /v1/stats HTTP/1.1\r\n\r\n", 405, "only GET"),
            (b"GET /v1/config HTTP/1.1\r\n\r\n", 404, "/v1/stats"),
            (
                b"GET /v1/stats?window_ms=soon HTTP/1.1\r\n\r\n",
                400,
                "window_ms",
            ),
            (
                b"GET /v1/stats HTTP/1.1\r\ncontent-length: 3\r\n\r\nabc",
                400,
                "no body",
            ),
        ];
        for (req, status, says) in cases {
            let (mut io, server) = answered(Duration::ZERO).await;
            io.write_all(req).await.unwrap();
            let a = read_answer(&mut io).await.unwrap();
            assert_eq!(a.status, status, "{}", String::from_utf8_lossy(req));
            assert!(
                String::from_utf8_lossy(&a.body).contains(says),
                "{}",
                String::from_utf8_lossy(&a.body)
            );
            assert!(!a.keep_alive);
            server.await.unwrap().unwrap();
        }
    }

    #[tokio::test]
    async fn pipelined_requests_are_answered_in_order_and_a_close_is_honoured() {
        let (mut io, server) = answered(Duration::ZERO).await;
        let mut two = request("node-n1", Duration::ZERO, "Bearer right");
        two.extend(request("node-n1", Duration::ZERO, "Bearer wrong"));
        // Byte by byte, the two requests in one stream.
        for b in two {
            io.write_all(&[b]).await.unwrap();
        }
        assert_eq!(read_answer(&mut io).await.unwrap().status, 200);
        assert_eq!(read_answer(&mut io).await.unwrap().status, 401);
        io.write_all(
            b"GET /v1/stats HTTP/1.1\r\nauthorization: Bearer right\r\nconnection: close\r\n\r\n",
        )
        .await
        .unwrap();
        let a = read_answer(&mut io).await.unwrap();
        assert_eq!((a.status, a.keep_alive), (200, false));
        server.await.unwrap().unwrap();
    }

    #[tokio::test]
    async fn a_head_sent_a_byte_at_a_time_must_be_whole_within_its_deadline() {
        let head_timeout = Duration::from_millis(300);
        let (mut io, server) = answered_within(Duration::ZERO, head_timeout).await;
        // A byte every 100 ms: each comes well within the head's time, the
        // whole head does not; the server gives up before the last byte.
        let head = b"GET /v1/stats HTTP/1.1\r\nhost: node-n1\r\n";
        let mut sent = 0;
        for b in head {
            if server.is_finished() || io.write_all(&[*b]).await.is_err() {
                break;
            }
            sent += 1;
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert!(sent < head.len(), "the server waited for all {sent} bytes");
        let a = tokio::time::timeout(Duration::from_secs(10), read_answer(&mut io))
            .await
            .expect("the server answers once the head's time is up")
            .unwrap();
        assert_eq!(a.status, 408);
        assert!(String::from_utf8_lossy(&a.body).contains("within 300ms"));
        server.await.unwrap().unwrap();
    }

    #[tokio::test]
    async fn a_head_too_large_is_answered_and_closed_without_a_reset() {
        // Over TCP: only a real socket is reset when closed with unread data.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(async move {
            let (conn, _) = listener.accept().await.unwrap();
            serve(conn, Duration::from_secs(60), |_: Asked| async {
                Reply::Refused(500, "no request gets this far".into())
            })
            .await
        });
        let mut client = tokio::net::TcpStream::connect(addr).await.unwrap();
        // A head four times the limit: most of it is never parsed.
        let mut head = format!("GET {PATH} HTTP/1.1\r\nx-junk: ").into_bytes();
        head.resize(4 * MAX_HEAD, b'a');
        client.write_all(&head).await.unwrap();
        // The server has answered and closed its side by now; a client that
        // is still sending must not be reset (its write would fail, and it
        // would never read the answer).
        tokio::time::sleep(Duration::from_millis(300)).await;
        client
            .write_all(&[b'a'; 1024])
            .await
            .expect("still sending after the answer");
        let mut answer = Vec::new();
        let read = tokio::time::timeout(Duration::from_secs(10), client.read_to_end(&mut answer))
            .await
            .expect("the answer and the end of the connection within 10 s");
        // The whole answer, then the end of the stream, not a reset.
        assert!(read.is_ok(), "{read:?}");
        let text = String::from_utf8_lossy(&answer);
        assert!(text.starts_with("HTTP/1.1 431 "), "{text}");
        assert!(text.contains("over 8192 bytes"), "{text}");
        drop(client);
        server.await.unwrap().unwrap();
    }

    #[tokio::test]
    async fn a_repeated_authorization_is_refused() {
        let (mut io, server) = answered(Duration::ZERO).await;
        io.write_all(
            b"GET /v1/stats HTTP/1.1\r\nauthorization: Bearer wrong\r\nauthorization: Bearer right\r\n\r\n",
        )
        .await
        .unwrap();
        let a = read_answer(&mut io).await.unwrap();
        assert_eq!(a.status, 400);
        assert!(String::from_utf8_lossy(&a.body).contains("more than one authorization"));
        server.await.unwrap().unwrap();
    }

    #[tokio::test]
    async fn an_answer_cut_short_or_without_a_length_is_an_error_that_says_so() {
        let (mut near, mut far) = tokio::io::duplex(1 << 16);
        far.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nabc")
            .await
            .unwrap();
        drop(far);
        let e = read_answer(&mut near).await.err().unwrap();
        assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof);

        let (mut near, mut far) = tokio::io::duplex(1 << 16);
        far.write_all(b"HTTP/1.1 200 OK\r\n\r\n").await.unwrap();
        let e = read_answer(&mut near).await.err().unwrap();
        assert!(e.to_string().contains("without content-length"), "{e}");
    }
}
