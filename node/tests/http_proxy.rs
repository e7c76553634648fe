//! The L7 proxy's HTTP/1.1 framing end to end: request bodies (length,
//! chunked, `Expect: 100-continue`) reach the service intact, responses come
//! back whole (chunked, HEAD, until close, decoded for an HTTP/1.0 client),
//! pipelined requests are answered in order, and a service that closes its
//! idle keep-alive connections costs no request. The real binary, real sockets.

mod common;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use lbscale_proto::{LbMethod, NodeConfig, Service, ServiceType, Vserver};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const NODE_IP: &str = "127.77.71.1";
const BACKEND: &str = "127.77.71.100:8000";

/// Reads from `s` into `buf` until `buf` holds `n` bytes; false at EOF.
async fn fill(s: &mut TcpStream, buf: &mut Vec<u8>, n: usize) -> bool {
    let mut tmp = [0u8; 16384];
    while buf.len() < n {
        match s.read(&mut tmp).await {
            Ok(0) | Err(_) => return false,
            Ok(k) => buf.extend_from_slice(&tmp[..k]),
        }
    }
    true
}

/// Reads until `buf` holds `pat`; its end, or None at EOF.
async fn until(s: &mut TcpStream, buf: &mut Vec<u8>, pat: &[u8]) -> Option<usize> {
    let mut tmp = [0u8; 16384];
    loop {
        if let Some(p) = buf.windows(pat.len()).position(|w| w == pat) {
            return Some(p + pat.len());
        }
        match s.read(&mut tmp).await {
            Ok(0) | Err(_) => return None,
            Ok(k) => buf.extend_from_slice(&tmp[..k]),
        }
    }
}

fn header<'a>(head: &'a str, name: &str) -> Option<&'a str> {
    head.split("\r\n")
        .filter_map(|l| l.split_once(':'))
        .find(|(k, _)| k.trim().eq_ignore_ascii_case(name))
        .map(|(_, v)| v.trim())
}

/// Reads one request (head and body, decoded) from `buf` and `s`.
async fn read_request(s: &mut TcpStream, buf: &mut Vec<u8>) -> Option<(String, Vec<u8>)> {
    let end = until(s, buf, b"\r\n\r\n").await?;
    let head = String::from_utf8_lossy(&buf[..end]).to_string();
    buf.drain(..end);
    let mut body = Vec::new();
    if let Some(n) = header(&head, "content-length").and_then(|v| v.parse::<usize>().ok()) {
        if !fill(s, buf, n).await {
            return None;
        }
        body = buf.drain(..n).collect();
    } else if header(&head, "transfer-encoding").is_some_and(|v| v.contains("chunked")) {
        loop {
            let e = until(s, buf, b"\r\n").await?;
            let line = String::from_utf8_lossy(&buf[..e - 2]).to_string();
            buf.drain(..e);
            let size = usize::from_str_radix(line.split(';').next().unwrap().trim(), 16).ok()?;
            if size == 0 {
                let e = until(s, buf, b"\r\n").await?; // no trailers in these tests
                buf.drain(..e);
                break;
            }
            if !fill(s, buf, size + 2).await {
                return None;
            }
            body.extend(buf.drain(..size));
            buf.drain(..2);
        }
    }
    Some((head, body))
}

/// A service whose answer depends on the path:
/// - `/echo`: the request's body, and its head's `Content-Length` or
///   `Transfer-Encoding` in `X-Framing`;
/// - `/chunked`: `hello world` in two chunks;
/// - `/close`: `bye` without a length, then it closes;
/// - `/once`: `once`, then it closes the connection without saying so
///   (as a service whose keep-alive timeout ran out between two requests).
///
/// Counts its connections.
async fn backend() -> Arc<AtomicU64> {
    let l = TcpListener::bind(BACKEND).await.unwrap();
    let conns = Arc::new(AtomicU64::new(0));
    let c = conns.clone();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            c.fetch_add(1, Ordering::SeqCst);
            tokio::spawn(async move {
                let mut buf = Vec::new();
                while let Some((head, body)) = read_request(&mut s, &mut buf).await {
                    let path = head.split_whitespace().nth(1).unwrap_or("/").to_string();
                    let resp: Vec<u8> = match path.as_str() {
                        "/echo" => {
                            let framing = header(&head, "content-length")
                                .map(|v| format!("length {v}"))
                                .or_else(|| {
                                    header(&head, "transfer-encoding").map(|v| format!("te {v}"))
                                })
                                .unwrap_or_else(|| "none".into());
                            let mut r = format!(
                                "HTTP/1.1 200 OK\r\nX-Framing: {framing}\r\nContent-Length: {}\r\n\r\n",
                                body.len()
                            )
                            .into_bytes();
                            r.extend_from_slice(&body);
                            r
                        }
                        "/chunked" => b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n\
                              5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"
                            .to_vec(),
                        "/close" => b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nbye".to_vec(),
                        _ => b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nonce".to_vec(),
                    };
                    // A HEAD gets the head alone.
                    let resp = if head.starts_with("HEAD ") {
                        let e = resp.windows(4).position(|w| w == b"\r\n\r\n").unwrap() + 4;
                        resp[..e].to_vec()
                    } else {
                        resp
                    };
                    if s.write_all(&resp).await.is_err() || path == "/close" || path == "/once" {
                        return;
                    }
                }
            });
        }
    });
    conns
}

/// Reads one response from `s` (after `buf`'s bytes): status, head, body
/// (by its length, chunked as it came, or until close).
async fn response(s: &mut TcpStream, buf: &mut Vec<u8>, head_only: bool) -> (u16, String, Vec<u8>) {
    let end = until(s, buf, b"\r\n\r\n").await.expect("a response head");
    let head = String::from_utf8_lossy(&buf[..end]).to_string();
    buf.drain(..end);
    let status = head.split_whitespace().nth(1).unwrap().parse().unwrap();
    if head_only {
        return (status, head, Vec::new());
    }
    let body = if let Some(n) = header(&head, "content-length").and_then(|v| v.parse().ok()) {
        assert!(fill(s, buf, n).await, "eof in the body: {head}");
        buf.drain(..n).collect()
    } else if header(&head, "transfer-encoding").is_some() {
        let e = until(s, buf, b"0\r\n\r\n").await.expect("the last chunk");
        buf.drain(..e).collect()
    } else {
        let mut rest = Vec::new();
        s.read_to_end(&mut rest).await.unwrap();
        buf.extend(rest);
        std::mem::take(buf)
    };
    (status, head, body)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_framing_end_to_end() {
    let conns = backend().await;
    let (_node, _dir) = start_serve("httpproxy", NODE_IP, &["--health-interval-ms", "0"]);
    let mut cl = api_client(NODE_IP).await;
    let sa: SocketAddr = BACKEND.parse().unwrap();
    tokio::time::timeout(
        Duration::from_secs(10),
        cl.configure(NodeConfig {
            version: 1,
            vservers: vec![Vserver {
                name: "web".into(),
                service_type: ServiceType::Http as i32,
                port: 8080,
                lb_method: LbMethod::Roundrobin as i32,
                persistence: "NONE".into(),
                services: vec![Service {
                    name: "b".into(),
                    address: sa.ip().to_string(),
                    port: sa.port() as u32,
                    weight: 1,
                    enabled: true,
                    cap_per_second: None,
                    custom_load: None,
                }],
                ..Default::default()
            }],
            ..Default::default()
        }),
    )
    .await
    .expect("Configure within 10 s")
    .expect("Configure");
    let vip = format!("{NODE_IP}:8080");

    let test = async {
        let mut s = TcpStream::connect(&vip).await.unwrap();
        let mut buf = Vec::new();

        // A body with a length, bigger than any buffer, byte for byte.
        let big: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
        let mut req = format!(
            "POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: {}\r\n\r\n",
            big.len()
        )
        .into_bytes();
        req.extend_from_slice(&big);
        s.write_all(&req).await.unwrap();
        let (st, head, body) = response(&mut s, &mut buf, false).await;
        assert_eq!(st, 200, "{head}");
        assert_eq!(header(&head, "x-framing"), Some("length 300000"));
        assert!(
            body == big,
            "the body came back changed ({} bytes)",
            body.len()
        );

        // A chunked body, sent after the 100 Continue the node gives.
        s.write_all(b"POST /echo HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\nExpect: 100-continue\r\n\r\n")
            .await
            .unwrap();
        let (st, head, _) = response(&mut s, &mut buf, true).await;
        assert_eq!(st, 100, "{head}");
        s.write_all(b"4\r\nabcd\r\n3;x=y\r\nefg\r\n0\r\n\r\n")
            .await
            .unwrap();
        let (st, head, body) = response(&mut s, &mut buf, false).await;
        assert_eq!(st, 200, "{head}");
        assert_eq!(header(&head, "x-framing"), Some("te chunked"));
        assert_eq!(body, b"abcdefg");

        // A chunked response, as it came; HEAD: the head alone.
        s.write_all(b"GET /chunked HTTP/1.1\r\nHost: t\r\n\r\n")
            .await
            .unwrap();
        let (_, head, body) = response(&mut s, &mut buf, false).await;
        assert_eq!(
            header(&head, "transfer-encoding"),
            Some("chunked"),
            "{head}"
        );
        assert_eq!(body, b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n");
        s.write_all(b"HEAD /echo HTTP/1.1\r\nHost: t\r\n\r\n")
            .await
            .unwrap();
        let (st, head, _) = response(&mut s, &mut buf, true).await;
        assert_eq!(
            (st, header(&head, "content-length")),
            (200, Some("0")),
            "{head}"
        );

        // Two pipelined requests: two answers, in order, on the same connection.
        s.write_all(
            b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 3\r\n\r\none\
                      POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 3\r\n\r\ntwo",
        )
        .await
        .unwrap();
        assert_eq!(response(&mut s, &mut buf, false).await.2, b"one");
        assert_eq!(response(&mut s, &mut buf, false).await.2, b"two");

        // A service that closes its connections after each answer, without
        // saying so: every request is answered all the same.
        for i in 0..20 {
            s.write_all(b"GET /once HTTP/1.1\r\nHost: t\r\n\r\n")
                .await
                .unwrap();
            let (st, head, body) = response(&mut s, &mut buf, false).await;
            assert_eq!(
                (st, body.as_slice()),
                (200, &b"once"[..]),
                "request {i}: {head}"
            );
        }

        // A body until close arrives whole (re-framed or closed after).
        s.write_all(b"GET /close HTTP/1.1\r\nHost: t\r\n\r\n")
            .await
            .unwrap();
        let (_, head, body) = response(&mut s, &mut buf, false).await;
        assert!(
            body == b"bye" || body == b"3\r\nbye\r\n0\r\n\r\n",
            "{head}{}",
            String::from_utf8_lossy(&body)
        );

        // HTTP/1.0: a chunked response is decoded, and the connection closes.
        let mut s = TcpStream::connect(&vip).await.unwrap();
        s.write_all(b"GET /chunked HTTP/1.0\r\n\r\n").await.unwrap();
        let mut all = Vec::new();
        s.read_to_end(&mut all).await.unwrap();
        let all = String::from_utf8_lossy(&all).to_string();
        assert!(all.ends_with("\r\n\r\nhello world"), "{all}");
        assert!(header(&all, "transfer-encoding").is_none(), "{all}");
    };
    tokio::time::timeout(Duration::from_secs(20), test)
        .await
        .expect("the exchanges within 20 s");
    assert!(
        conns.load(Ordering::SeqCst) >= 20,
        "a new connection after each /once"
    );
}
