//! `data "lbscale_scaling_simulation"`: replays a metric trace against a policy
//! with the engine's own decision code on a virtual clock, and returns the same
//! ticks and events as `lbscale simulate` for the same input.
//!
//! The attributes are turned into `lbscale simulate`'s JSON input document, and
//! the very function behind that command (`lbscale_core::simulate::simulate_json`)
//! runs it: one concept, one place.

use crate::common::*;
use crate::resources::group::ThresholdBlock;
use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value as Json};
use std::collections::HashMap;
use tf_provider::schema::{AttributeType, NestedBlock, Schema};
use tf_provider::value::{Value, ValueEmpty};
use tf_provider::{AttributePath, DataSource, Diagnostics};

pub struct SimulationDataSource;

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct SampleObject {
    pub t: Value<Number>,
    pub availability_zone: Value<String>,
    pub cpu: Value<Number>,
    pub memory: Value<Number>,
    pub throughput: Value<Number>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct TickObject {
    pub t: Value<Number>,
    pub availability_zone: Value<String>,
    pub phase: Value<String>,
    pub serving: Value<i64>,
    pub provisioned: Value<i64>,
    pub action: Value<String>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct EventObject {
    pub t: Value<Number>,
    pub availability_zone: Value<String>,
    pub kind: Value<String>,
    pub reason: Value<String>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct State {
    pub availability_zones: Value<Vec<String>>,
    pub min_nodes: Value<Number>,
    pub max_nodes: Value<Number>,
    pub initial_nodes: Value<Number>,
    pub stats_interval: Value<String>,
    pub watch_time: Value<String>,
    pub cooldown: Value<String>,
    pub drain_timeout: Value<String>,
    pub distributor: Value<String>,
    pub dns_ttl: Value<String>,
    pub provision_time: Value<String>,
    pub deprovision_time: Value<String>,
    pub connections_drain_after: Value<String>,
    pub samples: Value<Vec<SampleObject>>,
    pub until: Value<Number>,
    pub threshold: Value<Vec<ThresholdBlock>>,
    pub ticks: Value<Vec<TickObject>>,
    pub events: Value<Vec<EventObject>>,
    pub json: Value<String>,
}

fn obj(fields: &[(&str, AttributeType)]) -> AttributeType {
    AttributeType::Object(
        fields
            .iter()
            .map(|(k, t)| (k.to_string(), t.clone()))
            .collect::<HashMap<_, _>>(),
    )
}

/// The input document of `lbscale simulate` (cli.md), from the attributes.
fn input_document(s: &State) -> Json {
    let mut group = Map::new();
    group.insert(
        "availability_zones".into(),
        json!(known(&s.availability_zones).cloned().unwrap_or_default()),
    );
    for (k, v) in [
        ("min_nodes", &s.min_nodes),
        ("max_nodes", &s.max_nodes),
        ("initial_nodes", &s.initial_nodes),
    ] {
        // As written, so that the simulation's check shows a fraction or a
        // negative value as it is.
        if let Some(n) = known(v) {
            group.insert(k.into(), json_number(n));
        }
    }
    for (k, v) in [
        ("stats_interval", &s.stats_interval),
        ("watch_time", &s.watch_time),
        ("cooldown", &s.cooldown),
        ("drain_timeout", &s.drain_timeout),
        ("distributor", &s.distributor),
        ("dns_ttl", &s.dns_ttl),
    ] {
        if let Some(text) = known(v) {
            group.insert(k.into(), json!(text));
        }
    }
    let thresholds: Vec<Json> = known(&s.threshold)
        .map(|ts| {
            ts.iter()
                .map(|t| {
                    json!({
                        "metric": string(&t.metric),
                        "min": known(&t.min).map_or(Json::Null, json_number),
                        "max": known(&t.max).map_or(Json::Null, json_number),
                    })
                })
                .collect()
        })
        .unwrap_or_default();
    group.insert("thresholds".into(), json!(thresholds));
    let mut cloud = Map::new();
    for (k, v) in [
        ("provision_time", &s.provision_time),
        ("deprovision_time", &s.deprovision_time),
    ] {
        if let Some(text) = known(v) {
            cloud.insert(k.into(), json!(text));
        }
    }
    let samples: Vec<Json> = known(&s.samples)
        .map(|ss| {
            ss.iter()
                .map(|x| {
                    let mut m = Map::new();
                    m.insert("t".into(), known(&x.t).map_or(Json::Null, json_number));
                    m.insert("az".into(), json!(string(&x.availability_zone)));
                    // A metric left null is missing, as a metric left out of the CLI's input.
                    for (k, v) in [
                        ("cpu", &x.cpu),
                        ("memory", &x.memory),
                        ("throughput", &x.throughput),
                    ] {
                        if let Some(n) = known(v) {
                            m.insert(k.into(), json_number(n));
                        }
                    }
                    Json::Object(m)
                })
                .collect()
        })
        .unwrap_or_default();
    json!({
        "group": group,
        "cloud": cloud,
        "connections_drain_after": known(&s.connections_drain_after),
        "samples": samples,
        "until": known(&s.until).map(json_number),
    })
}

/// A number as the CLI's JSON input writes it: whole numbers without a fraction.
fn json_number(n: &Number) -> Json {
    if n.0.fract() == 0.0 && n.0.abs() < 9.0e15 {
        json!(n.0 as i64)
    } else {
        json!(n.0)
    }
}

fn number(v: &Json) -> Value<Number> {
    v.as_f64().map(Number).into()
}

#[async_trait]
impl DataSource for SimulationDataSource {
    type State<'a> = State;
    type ProviderMetaState<'a> = ValueEmpty;

    fn schema(&self, _diags: &mut Diagnostics) -> Option<Schema> {
        let duration = |d: &str| optional(AttributeType::String, d);
        let sample = obj(&[
            ("t", AttributeType::Number),
            ("availability_zone", AttributeType::String),
            ("cpu", AttributeType::Number),
            ("memory", AttributeType::Number),
            ("throughput", AttributeType::Number),
        ]);
        let tick = obj(&[
            ("t", AttributeType::Number),
            ("availability_zone", AttributeType::String),
            ("phase", AttributeType::String),
            ("serving", AttributeType::Number),
            ("provisioned", AttributeType::Number),
            ("action", AttributeType::String),
        ]);
        let event = obj(&[
            ("t", AttributeType::Number),
            ("availability_zone", AttributeType::String),
            ("kind", AttributeType::String),
            ("reason", AttributeType::String),
        ]);
        Some(Schema {
            version: 1,
            block: block(
                "What-if: replays a metric trace against a scaling policy with the engine's decision code on a virtual clock. Returns the same ticks and events as `lbscale simulate` for the same input.",
                vec![
                    ("availability_zones", required(AttributeType::List(Box::new(AttributeType::String)), "Availability zones, one cluster each.")),
                    ("min_nodes", optional(AttributeType::Number, "Fewest nodes per AZ (default 1).")),
                    ("max_nodes", optional(AttributeType::Number, "Most nodes per AZ (default 4).")),
                    ("initial_nodes", optional(AttributeType::Number, "Nodes per AZ at the start (default `min_nodes`).")),
                    ("stats_interval", duration("Sampling interval (default `\"1m\"`).")),
                    ("watch_time", duration("How long a breach must hold (default `\"3m\"`).")),
                    ("cooldown", duration("Cooldown after a scale-out (default `\"10m\"`).")),
                    ("drain_timeout", duration("Longest drain on scale-in (default `\"10m\"`).")),
                    ("distributor", optional(AttributeType::String, "`dns` (default) or `nlb`.")),
                    ("dns_ttl", duration("DNS TTL waited on scale-in with `dns` (default `\"60s\"`).")),
                    ("provision_time", duration("How long the cloud takes to create a node (default `\"0s\"`).")),
                    ("deprovision_time", duration("How long the cloud takes to delete a node (default `\"0s\"`).")),
                    ("connections_drain_after", duration("How long a leaving node's connections take to finish; null: never (the full drain_timeout is waited).")),
                    ("samples", required(AttributeType::List(Box::new(sample)), "The metric trace: `t` (seconds from the start), `availability_zone`, and `cpu`, `memory`, `throughput` (null when missing).")),
                    ("until", required(AttributeType::Number, "Last tick, in seconds.")),
                    ("ticks", computed(AttributeType::List(Box::new(tick)), "One row per AZ per stats interval: `phase` (`evaluating`, `provisioning`, `cooldown`, `ttl`, `draining`, `deprovisioning`), `serving`, `provisioned`, `action` (null, `scale_out` or `scale_in`).")),
                    ("events", computed(AttributeType::List(Box::new(event)), "Every decision and workflow step with its reason.")),
                    ("json", computed(AttributeType::String, "The whole result as `lbscale simulate` prints it (JSON).")),
                ],
                vec![(
                    "threshold",
                    NestedBlock::List(block(
                        "A threshold, as in `lbscale_autoscale_group`.",
                        vec![
                            ("metric", required(AttributeType::String, "`cpu`, `memory` or `throughput`.")),
                            ("min", required(AttributeType::Number, "Scale-in threshold.")),
                            ("max", required(AttributeType::Number, "Scale-out threshold.")),
                        ],
                        vec![],
                    )),
                )],
            ),
        })
    }

    async fn read<'a>(
        &self,
        diags: &mut Diagnostics,
        config: Self::State<'a>,
        _m: Self::ProviderMetaState<'a>,
    ) -> Option<Self::State<'a>> {
        let doc = input_document(&config);
        let out = match lbscale_core::simulate::simulate_json(&doc) {
            Ok(out) => out,
            Err(e) => {
                // The error names the field of the CLI document (`group.watch_time`,
                // `samples[3].t`); point at the attribute it comes from.
                let mut path = AttributePath::default();
                for step in &e.path {
                    match step {
                        lbscale_core::error::PathStep::Field(k) if k == "group" || k == "cloud" => {
                        }
                        lbscale_core::error::PathStep::Field(k) => {
                            let name = match k.as_str() {
                                "az" => "availability_zone",
                                "thresholds" => "threshold",
                                other => other,
                            };
                            path.add_attribute(name.to_string());
                        }
                        lbscale_core::error::PathStep::Index(i) => {
                            path.add_index(*i as i64);
                        }
                    }
                }
                error(diags, path, "Invalid simulation input", e.to_string());
                return None;
            }
        };
        let value = serde_json::to_value(&out).expect("simulation output serialises");
        let mut s = config;
        s.ticks = Value::Value(
            value["ticks"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|t| TickObject {
                    t: number(&t["t"]),
                    availability_zone: t["az"].as_str().map(String::from).into(),
                    phase: t["phase"].as_str().map(String::from).into(),
                    serving: t["serving"].as_i64().into(),
                    provisioned: t["provisioned"].as_i64().into(),
                    action: t["action"].as_str().map(String::from).into(),
                })
                .collect(),
        );
        s.events = Value::Value(
            value["events"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|e| EventObject {
                    t: number(&e["t"]),
                    availability_zone: e["az"].as_str().map(String::from).into(),
                    kind: e["kind"].as_str().map(String::from).into(),
                    reason: e["reason"].as_str().map(String::from).into(),
                })
                .collect(),
        );
        s.json = Value::Value(value.to_string());
        Some(s)
    }
}
