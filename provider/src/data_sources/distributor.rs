//! `data "lbscale_traffic_distributor"`: a distributor as it hands out now, by
//! name: where clients go and the node addresses registered this moment.
//!
//! The resource keeps these values as its own apply saw them (its groups come
//! after it, and the daemon moves them between applies); this reads them live.

use crate::common::*;
use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use tf_provider::schema::{AttributeType, Schema};
use tf_provider::value::{Value, ValueEmpty};
use tf_provider::{DataSource, Diagnostics};

pub struct DistributorDataSource(pub EngineHandle);

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct State {
    pub name: Value<String>,
    pub id: Value<String>,
    pub cloud: Value<String>,
    pub mode: Value<String>,
    pub domain: Value<String>,
    pub ttl: Value<String>,
    pub address: Value<BTreeMap<String, String>>,
    pub endpoints: Value<Vec<String>>,
}

#[async_trait]
impl DataSource for DistributorDataSource {
    type State<'a> = State;
    type ProviderMetaState<'a> = ValueEmpty;

    fn schema(&self, _diags: &mut Diagnostics) -> Option<Schema> {
        Some(Schema {
            version: 1,
            block: block(
                "A traffic distributor as it hands out now: where clients go and the node addresses registered at this moment, read on every plan (or, with `depends_on` on the groups and vservers of the same apply, once they are applied).",
                vec![
                    ("name", required(AttributeType::String, "Name of the traffic distributor.")),
                    ("id", computed(AttributeType::String, "Id of the distributor.")),
                    ("cloud", computed(AttributeType::String, "Its cloud.")),
                    ("mode", computed(AttributeType::String, "`dns` or `nlb`.")),
                    ("domain", computed(AttributeType::String, "The application's domain (`dns`); null with `nlb`.")),
                    ("ttl", computed(AttributeType::String, "TTL of the DNS answers.")),
                    ("address", computed(AttributeType::Map(Box::new(AttributeType::String)), "Where clients go now: `{dns = \"IP:PORT\"}` of the DNS server (`dns`), or the VIP of each AZ that has one (`nlb`: made with the first vserver of the AZ).")),
                    ("endpoints", computed(AttributeType::List(Box::new(AttributeType::String)), "The node addresses registered now, of every group that uses the distributor, AZ by AZ.")),
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
        let not_found = |diags: &mut Diagnostics, why: String| {
            error(
                diags,
                attr_path("name"),
                "Traffic distributor not found",
                why,
            )
        };
        let row = match engine.distributor_named(&name) {
            Ok(Some(r)) => r,
            Ok(None) => {
                not_found(
                    diags,
                    format!("no traffic distributor named {name:?} exists in the lbscale store"),
                );
                return None;
            }
            Err(e) => {
                engine_error(diags, "read traffic distributor", e);
                return None;
            }
        };
        let view = match engine.distributor_view(&row.id) {
            Ok(Some(v)) => v,
            Ok(None) => {
                not_found(
                    diags,
                    format!("traffic distributor {name:?} disappeared while being read"),
                );
                return None;
            }
            Err(e) => {
                engine_error(diags, "read traffic distributor", e);
                return None;
            }
        };
        Some(State {
            name: Value::Value(name),
            id: Value::Value(view.id),
            cloud: Value::Value(view.spec.cloud.to_string()),
            mode: Value::Value(view.spec.mode.to_string()),
            domain: view.spec.domain.into(),
            ttl: Value::Value(view.spec.ttl.to_string()),
            address: Value::Value(view.address),
            endpoints: Value::Value(view.endpoints),
        })
    }
}
