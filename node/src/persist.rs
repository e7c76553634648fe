//! Vserver persistence (`Vserver.persistence`): keeping a client on the service it
//! was first sent to, as NetScaler-style ADCs do.
//!
//! - **COOKIE** (HTTP vservers): a request load-balanced by the LB method gets
//!   `Set-Cookie: lbscale_<vserver>=<token>; Path=/; HttpOnly`, where `<vserver>`
//!   is the vserver's name with every character outside `[A-Za-z0-9_]` replaced by
//!   `_`, and `<token>` is [`cookie_token`] of the chosen service: a hash of its
//!   name, address and port, the same on every node given the same configuration
//!   (so a client keeps its backend across nodes and AZ clusters) and without the
//!   backend's address in clear. A request carrying the cookie goes to that
//!   service when it is enabled, UP and not draining, bypassing the LB method and
//!   the slow-start cap (a persistent session is not new load); it still counts in
//!   the service's statistics. Otherwise it is load-balanced and gets a new cookie.
//!   On a TCP or UDP vserver COOKIE is ignored (the engine refuses it at plan time).
//! - **SOURCEIP** (HTTP per request, TCP per connection, UDP per new flow): a
//!   per-vserver [`Table`] client IP → service. An entry is refreshed by every use
//!   and expires after the idle timeout (`--persistence-timeout-ms`, default 120 s,
//!   NetScaler's default); the table holds at most [`MAX_ENTRIES`] clients (when
//!   full, expired entries go, then the least recently used eighth). An entry whose
//!   service is disabled, DOWN, draining or gone is dropped and the client is
//!   load-balanced anew. The table lives with the vserver's listener, across
//!   configurations.
//!
//! Scale-out (see `scaleout`): a SOURCEIP primary keeps a client IP on the
//! node it first chose (itself or one secondary), with the same timeout and
//! bound, and tells the secondary the client's address in a PROXY protocol v2
//! header at the start of the forwarded connection (`proxy_protocol`), so that
//! the secondary's own table is keyed by the client and not by the primary.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::Mutex;
use std::time::Duration;

use crate::clock::now_ns;

/// The default persistence timeout (NetScaler's).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(120);
/// Clients remembered per vserver (and per scale-out primary).
pub const MAX_ENTRIES: usize = 65_536;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Persistence {
    #[default]
    None,
    Cookie,
    SourceIp,
}

/// `NONE` (or empty), `COOKIE`, `SOURCEIP`, in any case.
pub fn parse(s: &str) -> Result<Persistence, String> {
    match s.trim().to_ascii_uppercase().as_str() {
        "" | "NONE" => Ok(Persistence::None),
        "COOKIE" => Ok(Persistence::Cookie),
        "SOURCEIP" => Ok(Persistence::SourceIp),
        _ => Err(format!(
            "persistence must be NONE, COOKIE or SOURCEIP, got {s:?}"
        )),
    }
}

/// `lbscale_` and the vserver's name, every character outside `[A-Za-z0-9_]`
/// replaced by `_`.
pub fn cookie_name(vserver: &str) -> String {
    let mut n = String::with_capacity(8 + vserver.len());
    n.push_str("lbscale_");
    n.extend(vserver.chars().map(|c| {
        if c.is_ascii_alphanumeric() || c == '_' {
            c
        } else {
            '_'
        }
    }));
    n
}

/// The cookie value of a service: 16 hex digits of a 64-bit hash (FNV-1a, then
/// splitmix64's finaliser) of its name, address and port. Stable across nodes,
/// processes and builds; opaque, though not a secret.
pub fn cookie_token(name: &str, address: &str, port: u16) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let port = port.to_string();
    for part in ["lbscale-persist-v1", name, address, port.as_str()] {
        for b in part.bytes().chain(std::iter::once(0)) {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h ^= h >> 30;
    h = h.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    h ^= h >> 27;
    h = h.wrapping_mul(0x94d0_49bb_1331_11eb);
    h ^= h >> 31;
    format!("{h:016x}")
}

/// The value of cookie `name` in the request's `Cookie` headers, if any.
#[cfg(test)]
pub fn find_cookie<'a>(headers: &'a hyper::HeaderMap, name: &str) -> Option<&'a str> {
    headers
        .get_all(hyper::header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .find_map(|v| cookie_in(v, name))
}

/// The value of cookie `name` in one `Cookie` field's value, if any.
pub fn cookie_in<'a>(value: &'a str, name: &str) -> Option<&'a str> {
    value
        .split(';')
        .filter_map(|kv| kv.trim().split_once('='))
        .find(|(k, _)| k.trim() == name)
        .map(|(_, v)| v.trim().trim_matches('"'))
}

struct Entry<V> {
    value: V,
    /// ns of `clock` of the last use.
    last: u64,
}

/// A bounded map client IP → `V` whose entries expire after an idle timeout.
pub struct Table<K, V> {
    timeout_ns: u64,
    capacity: usize,
    inner: Mutex<TableInner<K, V>>,
}

struct TableInner<K, V> {
    map: HashMap<K, Entry<V>>,
    last_sweep: u64,
}

impl<K: Hash + Eq + Copy, V: Clone> Table<K, V> {
    pub fn new(timeout: Duration, capacity: usize) -> Self {
        Table {
            timeout_ns: timeout.as_nanos().min(u128::from(u64::MAX)) as u64,
            capacity: capacity.max(1),
            inner: Mutex::new(TableInner {
                map: HashMap::new(),
                last_sweep: now_ns(),
            }),
        }
    }

    /// The live entry of `key`, refreshed; `valid` may refuse it (then it goes).
    pub fn get(&self, key: K, valid: impl FnOnce(&V) -> bool) -> Option<V> {
        let now = now_ns();
        let mut g = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let e = g.map.get_mut(&key)?;
        if now.saturating_sub(e.last) > self.timeout_ns || !valid(&e.value) {
            g.map.remove(&key);
            return None;
        }
        e.last = now;
        Some(e.value.clone())
    }

    /// Records (or replaces) the entry of `key`. When the table is full, expired
    /// entries go first, then the least recently used eighth.
    pub fn insert(&self, key: K, value: V) {
        let now = now_ns();
        let mut g = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let timeout = self.timeout_ns;
        // A sweep every timeout keeps an idle table from holding memory.
        if now.saturating_sub(g.last_sweep) > timeout
            || (g.map.len() >= self.capacity && !g.map.contains_key(&key))
        {
            g.last_sweep = now;
            g.map.retain(|_, e| now.saturating_sub(e.last) <= timeout);
        }
        if g.map.len() >= self.capacity && !g.map.contains_key(&key) {
            let mut ages: Vec<u64> = g.map.values().map(|e| e.last).collect();
            let k = (self.capacity / 8).max(1).min(ages.len() - 1);
            let (_, cut, _) = ages.select_nth_unstable(k);
            let cut = *cut;
            g.map.retain(|_, e| e.last > cut);
        }
        g.map.insert(key, Entry { value, last: now });
    }

    pub fn remove(&self, key: K) {
        let mut g = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        g.map.remove(&key);
    }

    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.inner
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .map
            .len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_and_cookie_name() {
        assert_eq!(parse(""), Ok(Persistence::None));
        assert_eq!(parse("none"), Ok(Persistence::None));
        assert_eq!(parse("COOKIE"), Ok(Persistence::Cookie));
        assert_eq!(parse("SourceIP"), Ok(Persistence::SourceIp));
        assert!(parse("SESSION").is_err());
        assert_eq!(cookie_name("web-1.api"), "lbscale_web_1_api");
    }

    #[test]
    fn tokens_are_stable_opaque_and_distinct() {
        let t = cookie_token("a", "10.0.0.1", 80);
        assert_eq!(t, cookie_token("a", "10.0.0.1", 80));
        assert_eq!(t.len(), 16);
        assert!(!t.contains("10.0.0.1"));
        assert_ne!(t, cookie_token("a", "10.0.0.1", 81));
        assert_ne!(t, cookie_token("b", "10.0.0.1", 80));
        assert_ne!(t, cookie_token("a", "10.0.0.2", 80));
        // Pinned: every node and every build must compute the same value.
        assert_eq!(cookie_token("s1", "127.0.0.1", 8001), "9a3ba86909823677");
    }

    #[test]
    fn find_cookie_among_others() {
        let mut h = hyper::HeaderMap::new();
        h.append(
            hyper::header::COOKIE,
            "a=1; lbscale_web=abc ; b=2".parse().unwrap(),
        );
        assert_eq!(find_cookie(&h, "lbscale_web"), Some("abc"));
        assert_eq!(find_cookie(&h, "lbscale_we"), None);
        h.append(hyper::header::COOKIE, "lbscale_x=\"q\"".parse().unwrap());
        assert_eq!(find_cookie(&h, "lbscale_x"), Some("q"));
    }

    #[test]
    fn table_expires_refreshes_and_stays_bounded() {
        let t: Table<u32, u32> = Table::new(Duration::from_millis(50), 16);
        t.insert(1, 10);
        assert_eq!(t.get(1, |_| true), Some(10));
        assert_eq!(t.get(1, |_| false), None, "refused entries go");
        assert_eq!(t.get(1, |_| true), None);
        t.insert(2, 20);
        std::thread::sleep(Duration::from_millis(80));
        assert_eq!(t.get(2, |_| true), None, "expired");
        // Full: the least recently used go, the newest stays.
        for k in 0..100 {
            t.insert(k, k);
            assert!(t.len() <= 16, "{} entries", t.len());
        }
        assert_eq!(t.get(99, |_| true), Some(99));
    }
}
