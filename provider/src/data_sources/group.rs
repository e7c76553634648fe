//! `data "lbscale_autoscale_group"`: a group's nodes, status and recent events, by name.

use crate::common::*;
use crate::resources::group::{node_object_type, node_objects, NodeObject};
use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use tf_provider::schema::{AttributeType, Schema};
use tf_provider::value::{Value, ValueEmpty};
use tf_provider::{DataSource, Diagnostics};

pub struct GroupDataSource(pub EngineHandle);

/// How many of the most recent events the data source returns.
const EVENTS: usize = 100;

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct EventObject {
    pub time: Value<String>,
    pub availability_zone: Value<String>,
    pub kind: Value<String>,
    pub reason: Value<String>,
    pub count: Value<i64>,
    pub last_time: Value<String>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct State {
    pub name: Value<String>,
    pub id: Value<String>,
    pub nodes: Value<Vec<NodeObject>>,
    pub node_count: Value<i64>,
    pub status: Value<String>,
    pub events: Value<Vec<EventObject>>,
}

/// RFC 3339 UTC with milliseconds, from Unix milliseconds.
fn rfc3339(ms: i64) -> String {
    let t = lbscale_core::utc::UtcTime::from_unix_seconds(ms.div_euclid(1000));
    format!(
        "{:04}-{:02}-{:02}T{:02}:{:02}:{:02}.{:03}Z",
        t.year,
        t.month,
        t.day,
        t.hour,
        t.minute,
        t.second,
        ms.rem_euclid(1000)
    )
}

#[async_trait]
impl DataSource for GroupDataSource {
    type State<'a> = State;
    type ProviderMetaState<'a> = ValueEmpty;

    fn schema(&self, _diags: &mut Diagnostics) -> Option<Schema> {
        let event = AttributeType::Object(HashMap::from([
            ("time".to_string(), AttributeType::String),
            ("availability_zone".to_string(), AttributeType::String),
            ("kind".to_string(), AttributeType::String),
            ("reason".to_string(), AttributeType::String),
            ("count".to_string(), AttributeType::Number),
            ("last_time".to_string(), AttributeType::String),
        ]));
        Some(Schema {
            version: 1,
            block: block(
                "An autoscale group as it is now: its nodes, whether every AZ has its minimum serving, and its recent scaling events.",
                vec![
                    ("name", required(AttributeType::String, "Name of the autoscale group.")),
                    ("id", computed(AttributeType::String, "Id of the group.")),
                    ("nodes", computed(AttributeType::List(Box::new(node_object_type())), "The group's nodes now.")),
                    ("node_count", computed(AttributeType::Number, "Nodes serving now.")),
                    ("status", computed(AttributeType::String, "`ok` when every AZ has at least `min_nodes` serving; otherwise `degraded (...)` saying which.")),
                    ("events", computed(AttributeType::List(Box::new(event)), "The most recent scaling events (up to 100), oldest first: `time` (RFC 3339), `availability_zone`, `kind`, `reason`; repeats in a row (same AZ, kind and reason) are one event with `count` and the `last_time` it happened.")),
                ],
                vec![],
            ),
        })
    }

    async fn read<'a>(
        &self,
        diags: &mut Diagnostics,
        config: Self::State<'a>,
        _m: Self::ProviderMetaState<'a>,
    ) -> Option<Self::State<'a>> {
        let engine = engine(&self.0, diags)?;
        let name = string(&config.name);
        let row = match engine.group_named(&name) {
            Ok(Some(r)) => r,
            Ok(None) => {
                error(
                    diags,
                    attr_path("name"),
                    "Autoscale group not found",
                    format!("no autoscale group named {name:?} exists in the lbscale store"),
                );
                return None;
            }
            Err(e) => {
                engine_error(diags, "read autoscale group", e);
                return None;
            }
        };
        let view = match engine.group_view(&row.id).await {
            Ok(Some(v)) => v,
            Ok(None) => {
                error(
                    diags,
                    attr_path("name"),
                    "Autoscale group not found",
                    format!("autoscale group {name:?} disappeared while being read"),
                );
                return None;
            }
            Err(e) => {
                engine_error(diags, "read autoscale group", e);
                return None;
            }
        };
        let events = match engine.events(&row.id, EVENTS) {
            Ok(ev) => ev,
            Err(e) => {
                engine_error(diags, "read events", e);
                return None;
            }
        };
        Some(State {
            name: Value::Value(name),
            id: Value::Value(row.id),
            nodes: Value::Value(node_objects(&view)),
            node_count: Value::Value(view.node_count()),
            status: Value::Value(view.status()),
            events: Value::Value(
                events
                    .into_iter()
                    .map(|e| EventObject {
                        time: Value::Value(rfc3339(e.time_ms)),
                        availability_zone: e.az.into(),
                        kind: Value::Value(e.kind),
                        reason: Value::Value(e.reason),
                        count: Value::Value(e.count as i64),
                        last_time: Value::Value(rfc3339(e.last_ms)),
                    })
                    .collect(),
            ),
        })
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn rfc3339_formats_utc() {
        assert_eq!(super::rfc3339(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(
            super::rfc3339(1_795_977_296_123),
            "2026-11-29T18:34:56.123Z"
        );
    }
}
