//! The TLS sessions the engine may resume with a group's nodes.
//!
//! rustls's own memory cache keeps up to 8 tickets per server, each with the
//! server's certificate chain, and a node that sends two per handshake fills
//! them: with it the daemon of bench/daemon_scale.sh held 267 MiB for 2,667
//! groups, against 191 MiB with this store, which keeps what the engine uses:
//! the newest ticket per node (one connection per node at a time is the usual
//! pattern; a push dialling alongside a sample may find no ticket left and
//! make a full handshake), grown as nodes are dialled, bounded so that a group
//! whose nodes come and go while the client is kept cannot grow it without
//! end.

use rustls::client::{ClientSessionStore, Tls12ClientSessionValue, Tls13ClientSessionValue};
use rustls::pki_types::ServerName;
use rustls::NamedGroup;
use std::collections::HashMap;
use std::sync::Mutex;

/// More nodes than any group has at once; past it, some node's session is
/// forgotten (that node gets a full handshake next time).
const MAX_NODES: usize = 1024;

#[derive(Default)]
pub(crate) struct NodeSessions {
    by_node: Mutex<HashMap<ServerName<'static>, Session>>,
}

/// The count only: a ticket is a credential to resume with.
impl std::fmt::Debug for NodeSessions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let n = self.by_node.lock().map(|m| m.len()).unwrap_or_default();
        f.debug_struct("NodeSessions").field("nodes", &n).finish()
    }
}

/// The values are boxed: inline, every slot of the table (a group's is
/// about a third empty) held room for both, about 2 KiB per group.
#[derive(Default)]
struct Session {
    kx_hint: Option<NamedGroup>,
    tls12: Option<Box<Tls12ClientSessionValue>>,
    tls13: Option<Box<Tls13ClientSessionValue>>,
}

impl NodeSessions {
    fn edit(&self, name: ServerName<'static>, f: impl FnOnce(&mut Session)) {
        let mut map = self.by_node.lock().unwrap_or_else(|p| p.into_inner());
        if map.len() >= MAX_NODES && !map.contains_key(&name) {
            if let Some(any) = map.keys().next().cloned() {
                map.remove(&any);
            }
        }
        f(map.entry(name).or_default());
    }

    fn with<T>(
        &self,
        name: &ServerName<'_>,
        f: impl FnOnce(&mut Session) -> Option<T>,
    ) -> Option<T> {
        let mut map = self.by_node.lock().unwrap_or_else(|p| p.into_inner());
        // The map's keys are owned names; rustls asks with borrowed ones.
        map.get_mut(&name.to_owned()).and_then(f)
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.by_node.lock().unwrap().len()
    }
}

impl ClientSessionStore for NodeSessions {
    fn set_kx_hint(&self, name: ServerName<'static>, group: NamedGroup) {
        self.edit(name, |s| s.kx_hint = Some(group));
    }

    fn kx_hint(&self, name: &ServerName<'_>) -> Option<NamedGroup> {
        self.with(name, |s| s.kx_hint)
    }

    fn set_tls12_session(&self, name: ServerName<'static>, value: Tls12ClientSessionValue) {
        self.edit(name, |s| s.tls12 = Some(Box::new(value)));
    }

    fn tls12_session(&self, name: &ServerName<'_>) -> Option<Tls12ClientSessionValue> {
        self.with(name, |s| s.tls12.as_deref().cloned())
    }

    fn remove_tls12_session(&self, name: &ServerName<'static>) {
        self.with(name, |s| s.tls12.take());
    }

    /// The newest ticket replaces the one kept (a node sends its tickets after
    /// each handshake).
    fn insert_tls13_ticket(&self, name: ServerName<'static>, value: Tls13ClientSessionValue) {
        self.edit(name, |s| s.tls13 = Some(Box::new(value)));
    }

    /// A TLS 1.3 ticket is used once.
    fn take_tls13_ticket(&self, name: &ServerName<'static>) -> Option<Tls13ClientSessionValue> {
        self.with(name, |s| s.tls13.take().map(|b| *b))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn name(i: usize) -> ServerName<'static> {
        ServerName::try_from(format!("n{i}.node.lbscale")).unwrap()
    }

    #[test]
    fn the_store_is_bounded_and_keeps_what_it_was_told_per_node() {
        let s = NodeSessions::default();
        s.set_kx_hint(name(0), NamedGroup::X25519);
        assert_eq!(s.kx_hint(&name(0)), Some(NamedGroup::X25519));
        assert_eq!(s.kx_hint(&name(1)), None);
        for i in 0..MAX_NODES + 10 {
            s.set_kx_hint(name(i), NamedGroup::X25519);
        }
        assert_eq!(s.len(), MAX_NODES);
        // A node already known is edited in place, whatever the size.
        s.set_kx_hint(name(MAX_NODES + 9), NamedGroup::secp256r1);
        assert_eq!(s.len(), MAX_NODES);
        assert_eq!(s.kx_hint(&name(MAX_NODES + 9)), Some(NamedGroup::secp256r1));
    }
}
