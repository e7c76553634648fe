//! TCP_NODELAY on the plugin's gRPC listener.
//!
//! tf-provider binds the listener itself and leaves Nagle's algorithm on for
//! the connections it accepts. A gRPC response goes out as several small
//! writes (TLS records of HTTP/2 headers, data, trailers); with Nagle on, a
//! write that follows an unacknowledged one waits for Terraform's delayed ACK,
//! about 40 ms, on many RPCs. Measured on 4 resources: `terraform validate`
//! 0.55 s with it, 0.27 s without; `terraform plan` 0.9 s and 0.36 s.
//!
//! Linux gives an accepted socket its listener's TCP_NODELAY, so setting it
//! on the listener is enough, as long as that happens before Terraform
//! connects, which it does only after reading the handshake line on stdout.
//! So a thread holds stdout's lock while tf-provider starts: its `println!`
//! of the handshake waits until the thread has found the listener (a bound,
//! unconnected TCP socket among the process's descriptors) and set the
//! option, or has given up (then the provider runs as it did before).

use std::mem::ManuallyDrop;
use std::net::TcpStream;
use std::os::fd::{FromRawFd, RawFd};
use std::time::{Duration, Instant};

/// How long the handshake may wait for the listener to appear. It is bound a
/// few milliseconds after start (after the schemas are built); past this, the
/// handshake goes out without the option rather than late.
const FIND_LISTENER_FOR: Duration = Duration::from_millis(500);

/// Holds stdout until the listener that tf-provider is about to bind has
/// TCP_NODELAY. Call before `tf_provider::serve`; returns once stdout is held.
pub fn before_handshake() {
    let (held, wait) = std::sync::mpsc::channel();
    let spawned = std::thread::Builder::new()
        .name("nodelay".into())
        .spawn(move || {
            let stdout = std::io::stdout();
            let _lock = stdout.lock();
            let _ = held.send(());
            let deadline = Instant::now() + FIND_LISTENER_FOR;
            loop {
                match set_on_listeners() {
                    // Not readable (no /proc): nothing to wait for.
                    None => return,
                    Some(0) if Instant::now() < deadline => {
                        std::thread::sleep(Duration::from_micros(200))
                    }
                    Some(_) => return,
                }
            }
        });
    if spawned.is_ok() {
        let _ = wait.recv();
    }
}

/// Sets TCP_NODELAY on every listening TCP socket of this process; how many
/// there were, or `None` when the process's descriptors cannot be listed.
pub fn set_on_listeners() -> Option<usize> {
    let mut set = 0;
    for entry in std::fs::read_dir("/proc/self/fd").ok()?.flatten() {
        let Some(fd) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<RawFd>().ok())
        else {
            continue;
        };
        let is_socket = std::fs::read_link(entry.path())
            .is_ok_and(|t| t.to_string_lossy().starts_with("socket:"));
        if !is_socket {
            continue;
        }
        // Borrowed, never closed: the descriptor stays tf-provider's.
        // SAFETY: `fd` is open (just listed) and ManuallyDrop never closes it.
        let sock = ManuallyDrop::new(unsafe { TcpStream::from_raw_fd(fd) });
        let listening = sock.local_addr().is_ok_and(|a| a.port() != 0)
            && sock
                .peer_addr()
                .is_err_and(|e| e.kind() == std::io::ErrorKind::NotConnected);
        if listening && sock.set_nodelay(true).is_ok() {
            set += 1;
        }
    }
    Some(set)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;
    use std::os::fd::AsRawFd;

    fn nodelay_of(l: &TcpListener) -> bool {
        // SAFETY: `l` is open for the whole call; ManuallyDrop never closes it.
        let s = ManuallyDrop::new(unsafe { TcpStream::from_raw_fd(l.as_raw_fd()) });
        s.nodelay().unwrap()
    }

    #[test]
    fn a_listener_gets_nodelay_and_passes_it_to_what_it_accepts() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        assert!(!nodelay_of(&listener), "a new listener has Nagle on");
        // A connected socket of the process is left as it is.
        let other = TcpListener::bind("127.0.0.1:0").unwrap();
        let client = TcpStream::connect(other.local_addr().unwrap()).unwrap();
        assert!(set_on_listeners().unwrap() >= 2);
        assert!(nodelay_of(&listener));
        assert!(!client.nodelay().unwrap(), "a connection is not a listener");
        let _c = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (accepted, _) = listener.accept().unwrap();
        assert!(accepted.nodelay().unwrap(), "inherited from the listener");
    }
}
