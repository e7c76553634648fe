//! Outgoing TCP connections of a node, from its own address.
//!
//! Every connection a node opens (to a service, to a scale-out secondary, a
//! health check) leaves from the node's address: the source NAT of a scaled-out
//! vserver, so that the service (or the secondary) sees this node and answers it,
//! and the return path crosses the same nodes as the request. Without it a
//! loopback or multi-address host would pick some other source address
//! (127.0.0.1 for every node on loopback) and replies could bypass the node.

use std::io;
use std::net::{IpAddr, SocketAddr};
use std::os::fd::AsRawFd;

use tokio::net::{TcpSocket, TcpStream, UdpSocket};

/// Opens connections from one source address (the node's).
#[derive(Clone, Copy, Debug, Default)]
pub struct Dialer {
    /// None (a node on a wildcard address): the kernel chooses.
    source: Option<IpAddr>,
}

impl Dialer {
    pub fn from_node(ip: IpAddr) -> Self {
        Dialer {
            source: (!ip.is_unspecified()).then_some(ip),
        }
    }

    /// The node's own address, when it has one.
    pub fn source(&self) -> Option<IpAddr> {
        self.source
    }

    /// Connects to `target` from the node's address. The source is left to the
    /// kernel when it could not route to `target` (other address family,
    /// loopback to non-loopback).
    pub async fn connect(&self, target: SocketAddr) -> io::Result<TcpStream> {
        let src = self.source.filter(|ip| {
            ip.is_ipv4() == target.is_ipv4() && ip.is_loopback() == target.ip().is_loopback()
        });
        let Some(src) = src else {
            return TcpStream::connect(target).await;
        };
        let sock = if target.is_ipv4() {
            TcpSocket::new_v4()?
        } else {
            TcpSocket::new_v6()?
        };
        // Choose the source port at connect time, from the full 4-tuple: a plain
        // bind(ip:0) would reserve a port per connection across every destination and
        // run out under many short connections.
        let one: libc::c_int = 1;
        // SAFETY: a valid socket descriptor and a c_int option value of the right size.
        unsafe {
            libc::setsockopt(
                sock.as_raw_fd(),
                libc::IPPROTO_IP,
                libc::IP_BIND_ADDRESS_NO_PORT,
                &one as *const libc::c_int as *const libc::c_void,
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            );
        }
        sock.bind(SocketAddr::new(src, 0))?;
        sock.connect(target).await
    }

    /// A UDP socket from the node's address (the kernel's choice for another
    /// address family) connected to `target`: it receives only `target`'s
    /// datagrams, and an ICMP port unreachable shows as `ConnectionRefused`.
    pub async fn udp_socket(&self, target: SocketAddr) -> io::Result<UdpSocket> {
        let src = match self.source {
            Some(ip) if ip.is_ipv4() == target.is_ipv4() => ip,
            _ if target.is_ipv4() => IpAddr::from([0, 0, 0, 0]),
            _ => IpAddr::from([0u16; 8]),
        };
        let s = UdpSocket::bind((src, 0)).await?;
        s.connect(target).await?;
        Ok(s)
    }

    /// Connects to `host:port` (an IP address or a name) from the node's address.
    pub async fn connect_host(&self, host: &str, port: u16) -> io::Result<TcpStream> {
        let mut last = io::Error::new(io::ErrorKind::NotFound, format!("{host}: no address"));
        for a in tokio::net::lookup_host((host, port)).await? {
            match self.connect(a).await {
                Ok(s) => return Ok(s),
                Err(e) => last = e,
            }
        }
        Err(last)
    }
}
