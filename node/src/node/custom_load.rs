//! CUSTOMLOAD values given from outside the configuration: a JSON file of
//! `{"vserver/service": load}` or `{"service": load}`, polled and applied at once.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use super::Node;

/// The file's value for `service` of `vserver`: `vserver/service` first, then
/// `service`.
pub(super) fn custom_load_for(
    loads: &HashMap<String, f64>,
    vserver: &str,
    service: &str,
) -> Option<f64> {
    loads
        .get(&format!("{vserver}/{service}"))
        .or_else(|| loads.get(service))
        .copied()
}

impl Node {
    /// Replaces the CUSTOMLOAD values (keys `vserver/service` or `service`; a
    /// service without a value has load 0) and applies them at once. A value in
    /// the configuration takes precedence.
    pub async fn set_custom_loads(&self, loads: HashMap<String, f64>) {
        // Kept first: a configuration applied between the two steps builds its
        // services with these values, not the old ones.
        *self.custom_loads.lock().unwrap_or_else(|e| e.into_inner()) = loads.clone();
        for st in &self.states().await {
            for e in st.services.iter().filter(|e| e.custom_load.is_none()) {
                e.rt.set_custom_load(custom_load_for(&loads, &st.name, &e.rt.name).unwrap_or(0.0));
            }
        }
    }

    /// Polls `path` every 200 ms and applies it when it changes; an invalid file
    /// keeps the previous values.
    pub async fn watch_custom_loads(self: Arc<Self>, path: PathBuf) {
        let mut last: Option<Vec<u8>> = None;
        let mut tick = tokio::time::interval(Duration::from_millis(200));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let Ok(b) = tokio::fs::read(&path).await else {
                continue;
            };
            if last.as_ref() == Some(&b) {
                continue;
            }
            match serde_json::from_slice::<HashMap<String, f64>>(&b) {
                Ok(m) => {
                    tracing::info!(path = %path.display(), services = m.len(), "custom loads applied");
                    self.set_custom_loads(m).await;
                }
                Err(e) => {
                    tracing::warn!(path = %path.display(), error = %e, "invalid custom load file; keeping the previous values")
                }
            }
            last = Some(b);
        }
    }
}
