//! The engine's node API credentials, one per group, kept while fresh.

use std::sync::Arc;

use super::{Engine, EngineError, Result};
use crate::nodeapi::EngineCredentials;

/// A group's credentials and the secret they were issued for.
pub(super) struct Kept {
    token: String,
    credentials: Arc<EngineCredentials>,
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
        if let Some(k) = self.kept_credentials().get(group_id) {
            if k.token == token && k.credentials.fresh() {
                return Ok(k.credentials.clone());
            }
        }
        // Issued outside the lock: other groups need not wait for it.
        let credentials =
            Arc::new(
                EngineCredentials::issue(token).map_err(|detail| EngineError::Step {
                    step: "issue the engine's node API certificate",
                    detail,
                })?,
            );
        self.kept_credentials().insert(
            group_id.to_string(),
            Kept {
                token: token.to_string(),
                credentials: credentials.clone(),
            },
        );
        Ok(credentials)
    }

    /// Drops group `group_id`'s kept credentials (the group is gone, or no
    /// longer this process's to look after).
    pub fn forget_node_credentials(&self, group_id: &str) {
        self.kept_credentials().remove(group_id);
    }

    fn kept_credentials(
        &self,
    ) -> std::sync::MutexGuard<'_, std::collections::HashMap<String, Kept>> {
        self.credentials.lock().unwrap_or_else(|e| e.into_inner())
    }
}
