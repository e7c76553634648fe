//! The engine's node API credentials, one per group, kept while fresh.

use std::collections::HashMap;
use std::sync::Arc;

use sha2::{Digest, Sha256};

use super::{Engine, EngineError, Result};
use crate::nodeapi::EngineCredentials;

/// A group's credentials and a digest of the secret they were issued from
/// (the secret itself is not kept here).
pub(super) struct Kept {
    secret_digest: [u8; 32],
    credentials: Arc<EngineCredentials>,
}

impl Kept {
    fn serves(&self, digest: &[u8; 32]) -> bool {
        self.secret_digest == *digest && self.credentials.fresh()
    }
}

fn digest(token: &str) -> [u8; 32] {
    Sha256::digest(token.as_bytes()).into()
}

impl Engine {
    /// Group `group_id`'s engine credentials for its nodes (issued from its
    /// secret `token`): the kept ones while they are fresh, else new ones,
    /// kept. Issuing derives the group CA and signs a certificate, which costs
    /// more than a TLS handshake; and credentials kept also keep the nodes'
    /// session tickets, so a configuration push, a drain and the daemon's
    /// samples resume one TLS session per node instead of each checking
    /// certificates again.
    pub fn node_credentials(&self, group_id: &str, token: &str) -> Result<Arc<EngineCredentials>> {
        let digest = digest(token);
        if let Some(k) = self.kept_credentials().get(group_id) {
            if k.serves(&digest) {
                return Ok(k.credentials.clone());
            }
        }
        // Issued outside the lock: other groups need not wait for it.
        let issued =
            Arc::new(
                EngineCredentials::issue(token).map_err(|detail| EngineError::Step {
                    step: "issue the engine's node API certificate",
                    detail,
                })?,
            );
        let mut kept = self.kept_credentials();
        // Of two callers that issued at once, both use the first one's: the
        // daemon redials its kept connections when its credentials change.
        match kept.get(group_id) {
            Some(k) if k.serves(&digest) => Ok(k.credentials.clone()),
            _ => {
                kept.insert(
                    group_id.to_string(),
                    Kept {
                        secret_digest: digest,
                        credentials: issued.clone(),
                    },
                );
                Ok(issued)
            }
        }
    }

    /// Drops group `group_id`'s kept credentials: the group is destroyed.
    pub fn forget_node_credentials(&self, group_id: &str) {
        self.kept_credentials().remove(group_id);
    }

    /// Keeps only the credentials of the groups `present` says are still in
    /// the store (the daemon's listing: a group another process destroyed).
    pub fn retain_node_credentials(&self, present: impl Fn(&str) -> bool) {
        self.kept_credentials().retain(|id, _| present(id));
    }

    fn kept_credentials(&self) -> std::sync::MutexGuard<'_, HashMap<String, Kept>> {
        self.credentials.lock().unwrap_or_else(|e| e.into_inner())
    }
}
