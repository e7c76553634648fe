//! A network link to the test server that can stall: a TCP relay on this host
//! that, while stalled, passes nothing either way and opens no new
//! connection onward. The client's calls then get no answer, as over a
//! half-open socket or to a server that stopped answering.
//!
//! The server itself runs on meanwhile, so a stall never freezes it: its own
//! timeouts (`statement_timeout`, `idle_in_transaction_session_timeout`) end
//! what a stalled client left open, and other clients are not held up (a
//! backend stopped with SIGSTOP instead may hold a lock of the whole server).

use super::url_parts;
use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// How often a relay looks at its flags while it waits.
const POLL: Duration = Duration::from_millis(20);
/// A peer that takes no bytes for this long ends its connection.
const WRITE_DEADLINE: Duration = Duration::from_secs(10);
/// Connecting onward to the server.
const CONNECT_DEADLINE: Duration = Duration::from_secs(5);

#[derive(Default)]
struct Flags {
    stalled: AtomicBool,
    closed: AtomicBool,
    /// Writes and onward connects under way: a stall begins once they end.
    passing: AtomicUsize,
}

impl Flags {
    /// Waits until nothing is stalled and counts a pass begun; false once the
    /// link is closed. Counting before looking at the flag, as `stall` sets
    /// the flag before looking at the count, lets no pass slip past a stall.
    fn begin_pass(&self) -> bool {
        loop {
            if self.closed.load(Ordering::SeqCst) {
                return false;
            }
            self.passing.fetch_add(1, Ordering::SeqCst);
            if !self.stalled.load(Ordering::SeqCst) {
                return true;
            }
            self.passing.fetch_sub(1, Ordering::SeqCst);
            std::thread::sleep(POLL);
        }
    }

    fn end_pass(&self) {
        self.passing.fetch_sub(1, Ordering::SeqCst);
    }
}

/// The relay; `url` is the server's URL through it. Dropped, it ends every
/// connection it relays (each within a poll, or a write's deadline).
pub struct Link {
    /// The server's URL with this relay's address in place of the server's.
    pub url: String,
    flags: Arc<Flags>,
    listen: std::net::SocketAddr,
}

/// A stall of a [`Link`]; the link relays again when this is dropped.
pub struct Stall<'a>(&'a Link);

impl Link {
    /// A relay to the server of `url` (`postgres://user:pw@host:port/db?...`).
    /// Panics on a URL that names its server elsewhere too (several hosts,
    /// `host=` or `port=` parameters): its store would pass the link by.
    pub fn to(url: &str) -> Link {
        assert!(
            !url_parts(url).1.contains(',')
                && !url.contains("host=")
                && !url.contains("hostaddr=")
                && !url.contains("port="),
            "Link::to: the URL must name one server, in its authority only"
        );
        let server = server_addr(url);
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind the link's port");
        let listen = listener.local_addr().unwrap();
        let flags = Arc::new(Flags::default());
        let f = flags.clone();
        std::thread::spawn(move || {
            for client in listener.incoming() {
                if f.closed.load(Ordering::SeqCst) {
                    break;
                }
                match client {
                    Ok(client) => {
                        let (f, server) = (f.clone(), server.clone());
                        std::thread::spawn(move || connect(client, &server, &f));
                    }
                    // Out of descriptors, say: not a reason to spin.
                    Err(_) => std::thread::sleep(POLL),
                }
            }
        });
        Link {
            url: with_authority_addr(url, &listen.to_string()),
            flags,
            listen,
        }
    }

    /// Stops relaying until the answer is dropped; returns once no byte
    /// passes (a write under way ends first, within its deadline).
    pub fn stall(&self) -> Stall<'_> {
        self.flags.stalled.store(true, Ordering::SeqCst);
        let until = std::time::Instant::now() + WRITE_DEADLINE + POLL;
        while self.flags.passing.load(Ordering::SeqCst) > 0 {
            assert!(
                std::time::Instant::now() < until,
                "a write through the link did not end within {WRITE_DEADLINE:?}"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        Stall(self)
    }
}

impl Drop for Stall<'_> {
    fn drop(&mut self) {
        self.0.flags.stalled.store(false, Ordering::SeqCst);
    }
}

impl Drop for Link {
    fn drop(&mut self) {
        self.flags.closed.store(true, Ordering::SeqCst);
        // Wakes the accepting thread, which then sees the flag.
        let _ = TcpStream::connect_timeout(&self.listen, CONNECT_DEADLINE);
    }
}

/// Opens the onward connection once the link is not stalled, then relays
/// both ways.
fn connect(client: TcpStream, server: &str, flags: &Arc<Flags>) {
    if !flags.begin_pass() {
        return;
    }
    let upstream = server_stream(server);
    flags.end_pass();
    let Some(upstream) = upstream else {
        return;
    };
    for s in [&client, &upstream] {
        let _ = s.set_read_timeout(Some(POLL));
        let _ = s.set_write_timeout(Some(WRITE_DEADLINE));
        let _ = s.set_nodelay(true);
    }
    let (c2, u2) = match (client.try_clone(), upstream.try_clone()) {
        (Ok(c), Ok(u)) => (c, u),
        _ => return,
    };
    let f = flags.clone();
    let back = std::thread::spawn(move || relay(u2, c2, &f));
    relay(client, upstream, flags);
    let _ = back.join();
}

fn server_stream(server: &str) -> Option<TcpStream> {
    use std::net::ToSocketAddrs;
    let addrs = server.to_socket_addrs().ok()?;
    addrs
        .into_iter()
        .find_map(|a| TcpStream::connect_timeout(&a, CONNECT_DEADLINE).ok())
}

/// Copies `from` to `to` while not stalled; at the end of either, or once the
/// link is closed, shuts both down.
fn relay(mut from: TcpStream, mut to: TcpStream, flags: &Flags) {
    let mut buf = vec![0u8; 16 * 1024];
    while !flags.closed.load(Ordering::SeqCst) {
        if flags.stalled.load(Ordering::SeqCst) {
            std::thread::sleep(POLL);
            continue;
        }
        match from.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                // A read that a stall began under holds its bytes.
                if !flags.begin_pass() {
                    break;
                }
                let written = to.write_all(&buf[..n]);
                flags.end_pass();
                if written.is_err() {
                    break;
                }
            }
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(_) => break,
        }
    }
    let _ = from.shutdown(Shutdown::Both);
    let _ = to.shutdown(Shutdown::Both);
}

/// `host:port` of a `scheme://[user[:pw]@]host[:port][/db][?query]` URL.
fn server_addr(url: &str) -> String {
    let authority = url_parts(url).1;
    let hostport = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
    if hostport
        .rsplit_once(':')
        .is_some_and(|(_, p)| p.parse::<u16>().is_ok())
    {
        hostport.to_string()
    } else {
        format!("{hostport}:5432")
    }
}

/// `url` with its `host:port` replaced by `addr`, the rest kept.
fn with_authority_addr(url: &str, addr: &str) -> String {
    let (scheme, authority, tail) = url_parts(url);
    match authority.rsplit_once('@') {
        Some((user, _)) => format!("{scheme}://{user}@{addr}{tail}"),
        None => format!("{scheme}://{addr}{tail}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    #[test]
    fn a_url_gets_the_links_address_and_keeps_the_rest() {
        let u = "postgres://lbscale:p%40ss@127.0.0.1:5433/db_1?application_name=a";
        assert_eq!(server_addr(u), "127.0.0.1:5433");
        assert_eq!(
            with_authority_addr(u, "127.0.0.1:40000"),
            "postgres://lbscale:p%40ss@127.0.0.1:40000/db_1?application_name=a"
        );
        assert_eq!(server_addr("postgres://db.example"), "db.example:5432");
        assert_eq!(
            with_authority_addr("postgres://h:1?x=1", "127.0.0.1:2"),
            "postgres://127.0.0.1:2?x=1"
        );
    }

    /// An echo server; answers its address.
    fn echo() -> String {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap().to_string();
        std::thread::spawn(move || {
            for s in l.incoming().flatten() {
                std::thread::spawn(move || {
                    let mut r = s.try_clone().unwrap();
                    let mut w = s;
                    let _ = std::io::copy(&mut r, &mut w);
                });
            }
        });
        addr
    }

    fn round_trip(s: &mut TcpStream, msg: &[u8]) -> std::io::Result<Vec<u8>> {
        s.write_all(msg)?;
        let mut got = vec![0u8; msg.len()];
        s.read_exact(&mut got)?;
        Ok(got)
    }

    #[test]
    fn a_stalled_link_answers_nothing_until_it_relays_again() {
        let link = Link::to(&format!("tcp://{}/x", echo()));
        let addr = server_addr(&link.url);
        let mut open = TcpStream::connect(&addr).unwrap();
        open.set_read_timeout(Some(Duration::from_millis(500)))
            .unwrap();
        assert_eq!(round_trip(&mut open, b"one").unwrap(), b"one");

        let stall = link.stall();
        // Neither an open connection nor a new one gets an answer.
        let err = round_trip(&mut open, b"two").unwrap_err();
        assert!(
            matches!(err.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut),
            "{err}"
        );
        let mut new = TcpStream::connect(&addr).unwrap();
        new.set_read_timeout(Some(Duration::from_millis(500)))
            .unwrap();
        assert!(round_trip(&mut new, b"three").is_err());
        drop(stall);

        // What was sent during the stall arrives after it.
        open.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut got = [0u8; 3];
        open.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"two");
        new.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut got = [0u8; 5];
        new.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"three");

        // Dropped, the link ends its connections.
        drop(link);
        let t = Instant::now();
        let mut rest = Vec::new();
        let end = open.read_to_end(&mut rest);
        assert!(end.is_ok() && rest.is_empty(), "{end:?} {rest:?}");
        eprintln!("closed after {:?}", t.elapsed());
    }
}
