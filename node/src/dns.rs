//! `lbscale-node dns`: a small authoritative DNS server (UDP and TCP) for the
//! local cloud's `dns` traffic distributor. Hand-written wire format (RFC 1035,
//! EDNS0 from RFC 6891).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::PathBuf;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use serde::Deserialize;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, UdpSocket};

use crate::watch::{self, Applied};

#[derive(Deserialize)]
pub struct DnsConfig {
    #[serde(default)]
    pub version: u64,
    #[serde(default)]
    pub zones: Vec<ZoneConfig>,
}

#[derive(Deserialize)]
pub struct ZoneConfig {
    pub domain: String,
    #[serde(default = "default_ttl")]
    pub ttl_secs: u32,
    #[serde(default)]
    pub addresses: Vec<String>,
}

fn default_ttl() -> u32 {
    60
}

pub struct Zone {
    /// Lower case, no trailing dot.
    pub domain: String,
    pub ttl: u32,
    pub v4: Vec<Ipv4Addr>,
    pub v6: Vec<Ipv6Addr>,
}

#[derive(Default)]
pub struct Zones(pub Vec<Zone>);

impl Zones {
    pub fn from_config(cfg: &DnsConfig) -> Zones {
        let mut zones = Vec::new();
        for z in &cfg.zones {
            let domain = z.domain.trim().trim_end_matches('.').to_ascii_lowercase();
            let mut v4 = Vec::new();
            let mut v6 = Vec::new();
            for a in &z.addresses {
                match a.trim().parse::<IpAddr>() {
                    Ok(IpAddr::V4(a)) => v4.push(a),
                    Ok(IpAddr::V6(a)) => v6.push(a),
                    Err(_) => {
                        tracing::warn!(zone = %domain, address = %a, "invalid address skipped")
                    }
                }
            }
            zones.push(Zone {
                domain,
                ttl: z.ttl_secs,
                v4,
                v6,
            });
        }
        Zones(zones)
    }

    /// The zone that holds `name` (longest suffix match) and whether it is the
    /// zone's own name.
    fn find(&self, name: &str) -> Option<(&Zone, bool)> {
        let mut best: Option<(&Zone, bool)> = None;
        for z in &self.0 {
            let exact = name == z.domain;
            let under = exact
                || z.domain.is_empty()
                || (name.len() > z.domain.len()
                    && name.ends_with(z.domain.as_str())
                    && name.as_bytes()[name.len() - z.domain.len() - 1] == b'.');
            if under && best.is_none_or(|(b, _)| z.domain.len() > b.domain.len()) {
                best = Some((z, exact));
            }
        }
        best
    }
}

const T_A: u16 = 1;
const T_AAAA: u16 = 28;
const T_OPT: u16 = 41;
const T_ANY: u16 = 255;
const C_IN: u16 = 1;
const RCODE_FORMERR: u8 = 1;
const RCODE_NXDOMAIN: u8 = 3;
const RCODE_NOTIMP: u8 = 4;
const RCODE_REFUSED: u8 = 5;
const EDNS_SIZE: u16 = 1232;

fn be16(b: &[u8], i: usize) -> Option<u16> {
    Some(u16::from_be_bytes([*b.get(i)?, *b.get(i + 1)?]))
}

/// Skips a (possibly compressed) name; returns the offset after it.
fn skip_name(b: &[u8], mut i: usize) -> Option<usize> {
    loop {
        let l = *b.get(i)? as usize;
        if l == 0 {
            return Some(i + 1);
        }
        if l & 0xC0 == 0xC0 {
            b.get(i + 1)?;
            return Some(i + 2);
        }
        if l & 0xC0 != 0 {
            return None;
        }
        i += 1 + l;
    }
}

fn header_only(q: &[u8], rcode: u8) -> Vec<u8> {
    let mut r = vec![0u8; 12];
    r[0] = q[0];
    r[1] = q[1];
    r[2] = 0x80 | (q[2] & 0x79); // QR, opcode, RD
    r[3] = rcode;
    r
}

/// Builds the answer to one query, or None to ignore it (not a query, too short).
/// A response fits the transport's limit (UDP: 512 or the EDNS size; TCP: 65535).
pub fn answer(q: &[u8], zones: &Zones, udp: bool) -> Option<Vec<u8>> {
    if q.len() < 12 || q[2] & 0x80 != 0 {
        return None;
    }
    let opcode = (q[2] >> 3) & 0x0F;
    let qdcount = be16(q, 4)?;
    if opcode != 0 {
        return Some(header_only(q, RCODE_NOTIMP));
    }
    if qdcount != 1 {
        return Some(header_only(q, RCODE_FORMERR));
    }
    let Some(question) = read_question(q) else {
        return Some(header_only(q, RCODE_FORMERR));
    };
    let edns = edns_size(q, question.end)?;
    let max_len = if udp {
        edns.map(|s| s.min(EDNS_SIZE)).unwrap_or(512) as usize
    } else {
        65535
    };
    let found = lookup(zones, &question);
    Some(response(q, question.end, &found, edns.is_some(), max_len))
}

/// The query's question (an uncompressed name, lower-cased).
struct Question {
    name: String,
    qtype: u16,
    qclass: u16,
    /// Where the question ends in the query.
    end: usize,
}

/// The question of `q`; None when it is malformed.
fn read_question(q: &[u8]) -> Option<Question> {
    let mut i = 12;
    let mut name = String::with_capacity(64);
    loop {
        let l = *q.get(i)? as usize;
        if l == 0 {
            i += 1;
            break;
        }
        if l & 0xC0 != 0 || i + 1 + l > q.len() || name.len() + l + 1 > 255 {
            return None;
        }
        if !name.is_empty() {
            name.push('.');
        }
        for &c in &q[i + 1..i + 1 + l] {
            name.push(c.to_ascii_lowercase() as char);
        }
        i += 1 + l;
    }
    Some(Question {
        name,
        qtype: be16(q, i)?,
        qclass: be16(q, i + 2)?,
        end: i + 4,
    })
}

/// The UDP payload size of an OPT record among the records after the question
/// (`Some(None)`: no EDNS); None when the header's counts cannot be read.
fn edns_size(q: &[u8], qend: usize) -> Option<Option<u16>> {
    let mut edns: Option<u16> = None;
    let others = be16(q, 6)? as usize + be16(q, 8)? as usize + be16(q, 10)? as usize;
    let mut j = qend;
    for _ in 0..others {
        let Some(k) = skip_name(q, j) else { break };
        let (Some(t), Some(c), Some(rdlen)) = (be16(q, k), be16(q, k + 2), be16(q, k + 8)) else {
            break;
        };
        if t == T_OPT {
            edns = Some(c.max(512));
        }
        j = k + 10 + rdlen as usize;
    }
    Some(edns)
}

/// What the zones say to a question.
struct Found<'a> {
    rcode: u8,
    /// Authoritative (the name is in one of our zones).
    aa: bool,
    ttl: u32,
    v4: &'a [Ipv4Addr],
    v6: &'a [Ipv6Addr],
}

fn lookup<'a>(zones: &'a Zones, question: &Question) -> Found<'a> {
    let refused = Found {
        rcode: RCODE_REFUSED,
        aa: false,
        ttl: 0,
        v4: &[],
        v6: &[],
    };
    if question.qclass != C_IN && question.qclass != T_ANY {
        return refused;
    }
    let qtype = question.qtype;
    match zones.find(&question.name) {
        None => refused,
        Some((_, false)) => Found {
            rcode: RCODE_NXDOMAIN,
            aa: true,
            ..refused
        },
        Some((z, true)) => Found {
            rcode: 0,
            aa: true,
            ttl: z.ttl,
            v4: if qtype == T_A || qtype == T_ANY {
                &z.v4
            } else {
                &[]
            },
            v6: if qtype == T_AAAA || qtype == T_ANY {
                &z.v6
            } else {
                &[]
            },
        },
    }
}

/// The response to `q` (question up to `qend`): every address that fits in
/// `max_len` (TC set when some do not), and an OPT record when the query had one.
fn response(q: &[u8], qend: usize, f: &Found<'_>, edns: bool, max_len: usize) -> Vec<u8> {
    let opt_len = if edns { 11 } else { 0 };
    let mut r = Vec::with_capacity(qend + 16 * (f.v4.len()) + 28 * f.v6.len() + opt_len);
    r.extend_from_slice(&q[0..2]);
    r.push(0x80 | (q[2] & 0x79) | if f.aa { 0x04 } else { 0 });
    r.push(f.rcode);
    r.extend_from_slice(&1u16.to_be_bytes());
    r.extend_from_slice(&[0, 0, 0, 0, 0, 0]); // counts filled below
    r.extend_from_slice(&q[12..qend]);
    let mut ancount: u16 = 0;
    let push_rr = |r: &mut Vec<u8>, rtype: u16, data: &[u8]| -> bool {
        if r.len() + 12 + data.len() + opt_len > max_len {
            return false;
        }
        r.extend_from_slice(&[0xC0, 0x0C]);
        r.extend_from_slice(&rtype.to_be_bytes());
        r.extend_from_slice(&C_IN.to_be_bytes());
        r.extend_from_slice(&f.ttl.to_be_bytes());
        r.extend_from_slice(&(data.len() as u16).to_be_bytes());
        r.extend_from_slice(data);
        true
    };
    let mut truncated = false;
    for a in f.v4 {
        if !push_rr(&mut r, T_A, &a.octets()) {
            truncated = true;
            break;
        }
        ancount += 1;
    }
    if !truncated {
        for a in f.v6 {
            if !push_rr(&mut r, T_AAAA, &a.octets()) {
                truncated = true;
                break;
            }
            ancount += 1;
        }
    }
    if truncated {
        r[2] |= 0x02;
    }
    r[6..8].copy_from_slice(&ancount.to_be_bytes());
    if edns {
        r[10..12].copy_from_slice(&1u16.to_be_bytes());
        r.push(0); // root
        r.extend_from_slice(&T_OPT.to_be_bytes());
        r.extend_from_slice(&EDNS_SIZE.to_be_bytes());
        r.extend_from_slice(&[0, 0, 0, 0, 0, 0]); // ext rcode, version, flags, rdlen
    }
    r
}

type Shared = Arc<RwLock<Arc<Zones>>>;

fn current(z: &Shared) -> Arc<Zones> {
    z.read().unwrap_or_else(|e| e.into_inner()).clone()
}

async fn serve_udp(sock: Arc<UdpSocket>, zones: Shared) {
    let mut buf = vec![0u8; 4096];
    loop {
        let (n, peer) = match sock.recv_from(&mut buf).await {
            Ok(x) => x,
            Err(e) => {
                tracing::debug!(error = %e, "udp recv failed");
                continue;
            }
        };
        if let Some(r) = answer(&buf[..n], &current(&zones), true) {
            let _ = sock.send_to(&r, peer).await;
        }
    }
}

async fn serve_tcp_conn(mut s: tokio::net::TcpStream, zones: Shared) {
    let mut buf = vec![0u8; 65535];
    loop {
        let mut len = [0u8; 2];
        match tokio::time::timeout(Duration::from_secs(10), s.read_exact(&mut len)).await {
            Ok(Ok(_)) => {}
            _ => return,
        }
        let len = u16::from_be_bytes(len) as usize;
        if tokio::time::timeout(Duration::from_secs(10), s.read_exact(&mut buf[..len]))
            .await
            .is_err()
        {
            return;
        }
        let Some(r) = answer(&buf[..len], &current(&zones), false) else {
            return;
        };
        let mut out = Vec::with_capacity(r.len() + 2);
        out.extend_from_slice(&(r.len() as u16).to_be_bytes());
        out.extend_from_slice(&r);
        if s.write_all(&out).await.is_err() {
            return;
        }
    }
}

/// DNS over TCP: connections served at once; one more is closed at once
/// (clients fall back to UDP or retry), so that idle or slow connections cannot
/// take every descriptor.
pub const MAX_TCP_CONNECTIONS: usize = 256;

/// Accepts DNS-over-TCP connections, at most `max` at once; accept errors are
/// waited out.
async fn accept_tcp(tcp: TcpListener, zones: Shared, max: usize) {
    let slots = crate::bounds::Budget::new(max);
    let mut backoff = crate::bounds::Backoff::default();
    let mut refusals = crate::bounds::Refusals::default();
    loop {
        let (s, peer) = crate::bounds::accept(&tcp, &mut backoff, "dns-tcp").await;
        let Some(slot) = slots.take(1) else {
            if let Some(refused) = refusals.note() {
                tracing::warn!(%peer, max, refused, "DNS-over-TCP connection cap reached: closing new connections");
            }
            continue;
        };
        let z = zones.clone();
        tokio::spawn(async move {
            let _slot = slot;
            serve_tcp_conn(s, z).await
        });
    }
}

pub async fn run(listen: SocketAddr, config: PathBuf, status: PathBuf) -> anyhow::Result<()> {
    let udp = Arc::new(
        UdpSocket::bind(listen)
            .await
            .map_err(|e| anyhow::anyhow!("cannot listen on udp {listen}: {e}"))?,
    );
    let tcp = TcpListener::bind(listen)
        .await
        .map_err(|e| anyhow::anyhow!("cannot listen on tcp {listen}: {e}"))?;
    tracing::info!(%listen, "dns server listening (udp and tcp)");
    let zones: Shared = Arc::new(RwLock::new(Arc::new(Zones::default())));
    for _ in 0..2 {
        tokio::spawn(serve_udp(udp.clone(), zones.clone()));
    }
    tokio::spawn(accept_tcp(tcp, zones.clone(), MAX_TCP_CONNECTIONS));
    watch::run(config, status, move |cfg: DnsConfig| {
        let z = Zones::from_config(&cfg);
        for zone in &z.0 {
            tracing::info!(zone = %zone.domain, ttl = zone.ttl, addresses = zone.v4.len() + zone.v6.len(), "zone");
        }
        *zones.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(z);
        Applied { version: cfg.version, complete: true }
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn query(name: &str, qtype: u16, edns: bool) -> Vec<u8> {
        let mut q = vec![
            0x12,
            0x34,
            0x01,
            0x00,
            0,
            1,
            0,
            0,
            0,
            0,
            0,
            if edns { 1 } else { 0 },
        ];
        for l in name.trim_end_matches('.').split('.') {
            q.push(l.len() as u8);
            q.extend_from_slice(l.as_bytes());
        }
        q.push(0);
        q.extend_from_slice(&qtype.to_be_bytes());
        q.extend_from_slice(&1u16.to_be_bytes());
        if edns {
            q.extend_from_slice(&[0, 0, 41, 0x10, 0, 0, 0, 0, 0, 0, 0]);
        }
        q
    }

    fn zones() -> Zones {
        Zones::from_config(&DnsConfig {
            version: 1,
            zones: vec![ZoneConfig {
                domain: "App.Example.test.".into(),
                ttl_secs: 42,
                addresses: vec!["127.0.1.2".into(), "127.0.1.3".into()],
            }],
        })
    }

    #[test]
    fn answers_a_with_every_address() {
        let r = answer(&query("app.EXAMPLE.test.", T_A, false), &zones(), true).unwrap();
        assert_eq!(&r[0..2], &[0x12, 0x34]);
        assert_eq!(r[2] & 0x84, 0x84, "QR and AA");
        assert_eq!(r[3] & 0x0F, 0);
        assert_eq!(be16(&r, 6), Some(2));
        let tail = &r[r.len() - 4..];
        assert_eq!(tail, &[127, 0, 1, 3]);
        let ttl_off = r.len() - 4 - 2 - 4;
        assert_eq!(
            u32::from_be_bytes(r[ttl_off..ttl_off + 4].try_into().unwrap()),
            42
        );
    }

    #[test]
    fn refused_nodata_nxdomain_formerr() {
        let z = zones();
        let r = answer(&query("other.test", T_A, true), &z, true).unwrap();
        assert_eq!(r[3] & 0x0F, RCODE_REFUSED);
        let r = answer(&query("app.example.test", 16, false), &z, true).unwrap();
        assert_eq!((r[3] & 0x0F, be16(&r, 6)), (0, Some(0)));
        let r = answer(&query("x.app.example.test", T_A, false), &z, true).unwrap();
        assert_eq!(r[3] & 0x0F, RCODE_NXDOMAIN);
        let r = answer(
            &[0x12, 0x34, 0x01, 0, 0, 1, 0, 0, 0, 0, 0, 0, 5, b'a'],
            &z,
            true,
        )
        .unwrap();
        assert_eq!(r[3] & 0x0F, RCODE_FORMERR);
        assert!(answer(&[1, 2, 3], &z, true).is_none());
    }

    #[test]
    fn edns_opt_echoed_and_truncation() {
        let mut cfg = DnsConfig {
            version: 1,
            zones: vec![],
        };
        cfg.zones.push(ZoneConfig {
            domain: "big.test".into(),
            ttl_secs: 5,
            addresses: (0..100).map(|i| format!("10.0.0.{i}")).collect(),
        });
        let z = Zones::from_config(&cfg);
        let r = answer(&query("big.test", T_A, false), &z, true).unwrap();
        assert!(r.len() <= 512);
        assert_ne!(r[2] & 0x02, 0, "TC set");
        let r = answer(&query("big.test", T_A, false), &z, false).unwrap();
        assert_eq!(be16(&r, 6), Some(100));
        let r = answer(&query("big.test", T_A, true), &z, true).unwrap();
        assert_eq!(be16(&r, 10), Some(1), "OPT echoed");
        assert_eq!(
            be16(&r, 6),
            Some(74),
            "as many answers as fit in 1232 bytes"
        );
        assert_ne!(r[2] & 0x02, 0, "TC set");
        assert!(r.len() <= 1232);
    }
}
