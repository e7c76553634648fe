//! PROXY protocol v2 headers: a scale-out primary starts every connection it
//! forwards with one naming the client, and the secondary reads and removes it
//! (see `scaleout`), so that it keys SOURCEIP persistence and `X-Forwarded-For`
//! by the client, not by the primary.

use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::time::Duration;

use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;

const PROXY_SIG: [u8; 12] = *b"\r\n\r\n\0\r\nQUIT\n";
/// How long a node waits for a connection's first bytes to see whether they are
/// a PROXY header. Only connections from the group's other nodes wait (a primary
/// writes the header at once); nobody else's connection is delayed.
pub const PROXY_WAIT: Duration = Duration::from_millis(200);

/// The PROXY v2 header announcing a TCP connection from `client` to `dst`.
pub fn proxy_header(client: SocketAddr, dst: SocketAddr) -> Vec<u8> {
    let mut h = PROXY_SIG.to_vec();
    h.push(0x21); // version 2, PROXY
    match (client, dst) {
        (SocketAddr::V4(c), SocketAddr::V4(d)) => {
            h.push(0x11); // TCP over IPv4
            h.extend_from_slice(&12u16.to_be_bytes());
            h.extend_from_slice(&c.ip().octets());
            h.extend_from_slice(&d.ip().octets());
            h.extend_from_slice(&c.port().to_be_bytes());
            h.extend_from_slice(&d.port().to_be_bytes());
        }
        (c, d) => {
            let v6 = |a: SocketAddr| match a.ip() {
                IpAddr::V4(ip) => ip.to_ipv6_mapped(),
                IpAddr::V6(ip) => ip,
            };
            h.push(0x21); // TCP over IPv6
            h.extend_from_slice(&36u16.to_be_bytes());
            h.extend_from_slice(&v6(c).octets());
            h.extend_from_slice(&v6(d).octets());
            h.extend_from_slice(&c.port().to_be_bytes());
            h.extend_from_slice(&d.port().to_be_bytes());
        }
    }
    h
}

/// Reads a PROXY v2 header at the start of `s`, if there is one, and returns the
/// client address it carries. Consumes nothing when the first bytes are not one
/// (or do not come within [`PROXY_WAIT`]).
pub async fn read_proxy_header(s: &mut TcpStream) -> io::Result<Option<IpAddr>> {
    let mut head = [0u8; 16];
    let end = tokio::time::Instant::now() + PROXY_WAIT;
    loop {
        let n = match tokio::time::timeout_at(end, s.peek(&mut head)).await {
            Ok(r) => r?,
            Err(_) => return Ok(None),
        };
        if n == 0 || head[..n.min(12)] != PROXY_SIG[..n.min(12)] {
            return Ok(None);
        }
        if n >= 16 {
            break;
        }
        // Part of the signature so far: wait for the rest.
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let len = u16::from_be_bytes([head[14], head[15]]) as usize;
    let mut all = vec![0u8; 16 + len];
    tokio::time::timeout(PROXY_WAIT, s.read_exact(&mut all))
        .await
        .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "PROXY header"))??;
    let body = &all[16..];
    Ok(match head[13] >> 4 {
        1 if body.len() >= 12 => Some(IpAddr::V4(Ipv4Addr::new(
            body[0], body[1], body[2], body[3],
        ))),
        2 if body.len() >= 36 => {
            let mut o = [0u8; 16];
            o.copy_from_slice(&body[..16]);
            let ip = Ipv6Addr::from(o);
            Some(
                ip.to_ipv4_mapped()
                    .map(IpAddr::V4)
                    .unwrap_or(IpAddr::V6(ip)),
            )
        }
        _ => None, // LOCAL or an unknown family: the header is consumed, no address
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn proxy_header_round_trip() {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let a = l.local_addr().unwrap();
        for client in ["127.9.8.7:4242", "[2001:db8::1]:443"] {
            let client: SocketAddr = client.parse().unwrap();
            let mut c = TcpStream::connect(a).await.unwrap();
            let (mut s, _) = l.accept().await.unwrap();
            use tokio::io::AsyncWriteExt;
            let mut msg = proxy_header(client, a);
            msg.extend_from_slice(b"GET / HTTP/1.1\r\n");
            c.write_all(&msg).await.unwrap();
            assert_eq!(read_proxy_header(&mut s).await.unwrap(), Some(client.ip()));
            let mut rest = [0u8; 16];
            s.read_exact(&mut rest).await.unwrap();
            assert_eq!(&rest, b"GET / HTTP/1.1\r\n");
        }
        // Not a header: nothing consumed.
        let mut c = TcpStream::connect(a).await.unwrap();
        let (mut s, _) = l.accept().await.unwrap();
        use tokio::io::AsyncWriteExt;
        c.write_all(b"GET / HTTP/1.1\r\n").await.unwrap();
        assert_eq!(read_proxy_header(&mut s).await.unwrap(), None);
        let mut rest = [0u8; 3];
        s.read_exact(&mut rest).await.unwrap();
        assert_eq!(&rest, b"GET");
    }
}
