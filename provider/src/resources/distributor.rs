//! `lbscale_traffic_distributor`: how clients reach the clusters (DNS or NLB).

use super::{check_cloud_built, missing_state};
use crate::common::*;
use async_trait::async_trait;
use lbscale_engine::model::{DistributorSpec, Findings, PathStep, CLOUDS, DISTRIBUTOR_MODES};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use tf_provider::schema::{AttributeType, Schema};
use tf_provider::value::{Value, ValueEmpty};
use tf_provider::{AttributePath, Diagnostics, Resource};

pub struct DistributorResource(pub EngineHandle);

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct State {
    pub id: Value<String>,
    pub name: Value<String>,
    pub cloud: Value<String>,
    pub mode: Value<String>,
    pub domain: Value<String>,
    pub ttl: Value<String>,
    pub endpoints: Value<Vec<String>>,
    pub address: Value<BTreeMap<String, String>>,
}

const DEFAULT_TTL: &str = "60s";

fn validate(s: &State) -> Findings {
    let mut f = Findings::default();
    if let Some(n) = known(&s.name) {
        f.name(n);
    }
    if let Some(c) = known(&s.cloud) {
        f.one_of(vec![PathStep::Attr("cloud")], "cloud", c, CLOUDS);
    }
    if let Some(m) = known(&s.mode) {
        f.one_of(vec![PathStep::Attr("mode")], "mode", m, DISTRIBUTOR_MODES);
        if m == "dns" && s.domain.is_null() {
            f.0.push(lbscale_engine::model::Finding::error(
                vec![PathStep::Attr("domain")],
                "Missing domain",
                "domain is required with mode = \"dns\": it is the application's domain that the DNS server answers for.",
            ));
        }
        if m == "nlb" && known(&s.domain).is_some() {
            f.0.push(lbscale_engine::model::Finding::error(
                vec![PathStep::Attr("domain")],
                "domain is for dns only",
                "domain is used only with mode = \"dns\"; remove it for an nlb distributor.",
            ));
        }
    }
    if let Some(d) = known(&s.domain) {
        f.domain(d);
    }
    if let Some(t) = known(&s.ttl) {
        if let Some(d) = f.duration(vec![PathStep::Attr("ttl")], "ttl", t) {
            if d.as_secs() < 1 || d.as_secs() > 86_400 {
                f.0.push(lbscale_engine::model::Finding::error(
                    vec![PathStep::Attr("ttl")],
                    "Invalid ttl",
                    format!("ttl must be between 1s and 24h, got {t}."),
                ));
            }
        }
    }
    f
}

fn spec_of(s: &State) -> DistributorSpec {
    DistributorSpec {
        name: string(&s.name),
        cloud: string(&s.cloud),
        mode: string(&s.mode),
        domain: known(&s.domain).cloned(),
        ttl: known(&s.ttl).cloned().unwrap_or_else(|| DEFAULT_TTL.into()),
    }
}

impl DistributorResource {
    /// The state as the store and the driver see it now; `Null` when it is gone.
    fn observe(&self, diags: &mut Diagnostics, id: &str) -> Option<Value<State>> {
        let engine = engine(&self.0, diags)?;
        match engine.distributor_view(id) {
            Ok(None) => Some(Value::Null),
            Ok(Some(v)) => Some(Value::Value(State {
                id: Value::Value(v.id),
                name: Value::Value(v.spec.name),
                cloud: Value::Value(v.spec.cloud),
                mode: Value::Value(v.spec.mode),
                domain: v.spec.domain.into(),
                ttl: Value::Value(v.spec.ttl),
                endpoints: Value::Value(v.endpoints),
                address: Value::Value(v.address),
            })),
            Err(e) => {
                engine_error(diags, "read traffic distributor", e);
                None
            }
        }
    }
}

#[async_trait]
impl Resource for DistributorResource {
    type State<'a> = Value<State>;
    type PrivateState<'a> = ValueEmpty;
    type ProviderMetaState<'a> = ValueEmpty;

    fn schema(&self, _diags: &mut Diagnostics) -> Option<Schema> {
        Some(Schema {
            version: 1,
            block: block(
                "How clients reach the clusters of the autoscale groups that use it: an authoritative DNS server (`dns`) or a network load balancer with one VIP per availability zone (`nlb`).",
                vec![
                    ("id", id_attr()),
                    ("name", required(AttributeType::String, "Name of the distributor. Changing it replaces the distributor.")),
                    ("cloud", required(AttributeType::String, "Cloud that runs it: `local`, `aws`, `azure` or `gcp`. Changing it replaces the distributor.")),
                    ("mode", required(AttributeType::String, "`dns` (the domain resolves to every serving node) or `nlb` (one static VIP per AZ forwarding TCP to the AZ's nodes). Changing it replaces the distributor.")),
                    ("domain", optional(AttributeType::String, "The application's domain; required with `dns`, not allowed with `nlb`.")),
                    ("ttl", defaulted(AttributeType::String, "TTL of the DNS answers (`dns` only), a duration such as `\"60s\"`. Default `\"60s\"`. Scale-in waits one TTL after removing a node's address.")),
                    ("endpoints", computed(AttributeType::List(Box::new(AttributeType::String)), "The node addresses registered right now.")),
                    ("address", computed(AttributeType::Map(Box::new(AttributeType::String)), "Where clients go: `{dns = \"IP:PORT\"}` of the DNS server (`dns`), or the VIP of each AZ (`nlb`).")),
                ],
                vec![],
            ),
        })
    }

    async fn validate<'a>(&self, diags: &mut Diagnostics, config: Self::State<'a>) -> Option<()> {
        let Some(c) = known(&config) else {
            return Some(());
        };
        report(diags, validate(c))
    }

    async fn read<'a>(
        &self,
        diags: &mut Diagnostics,
        state: Self::State<'a>,
        p: Self::PrivateState<'a>,
        _m: Self::ProviderMetaState<'a>,
    ) -> Option<(Self::State<'a>, Self::PrivateState<'a>)> {
        let Some(s) = known(&state) else {
            return Some((Value::Null, p));
        };
        let observed = self.observe(diags, &string(&s.id))?;
        Some((observed, p))
    }

    async fn plan_create<'a>(
        &self,
        diags: &mut Diagnostics,
        proposed: Self::State<'a>,
        _config: Self::State<'a>,
        _m: Self::ProviderMetaState<'a>,
    ) -> Option<(Self::State<'a>, Self::PrivateState<'a>)> {
        let Value::Value(mut s) = proposed else {
            return Some((proposed, Value::Null));
        };
        check_cloud_built(diags, known(&s.cloud))?;
        default_to(&mut s.ttl, DEFAULT_TTL.to_string());
        s.id = Value::Unknown;
        s.endpoints = Value::Unknown;
        s.address = Value::Unknown;
        Some((Value::Value(s), Value::Null))
    }

    async fn plan_update<'a>(
        &self,
        diags: &mut Diagnostics,
        prior: Self::State<'a>,
        proposed: Self::State<'a>,
        _config: Self::State<'a>,
        p: Self::PrivateState<'a>,
        _m: Self::ProviderMetaState<'a>,
    ) -> Option<(Self::State<'a>, Self::PrivateState<'a>, Vec<AttributePath>)> {
        let (Value::Value(prior), Value::Value(mut s)) = (prior, proposed) else {
            missing_state(diags);
            return None;
        };
        default_to(&mut s.ttl, DEFAULT_TTL.to_string());
        let replace: Vec<AttributePath> = [
            ("name", changed(&prior.name, &s.name)),
            ("cloud", changed(&prior.cloud, &s.cloud)),
            ("mode", changed(&prior.mode, &s.mode)),
        ]
        .into_iter()
        .filter(|(_, c)| *c)
        .map(|(a, _)| attr_path(a))
        .collect();
        if !replace.is_empty() {
            s.id = Value::Unknown;
            s.endpoints = Value::Unknown;
            s.address = Value::Unknown;
        }
        Some((Value::Value(s), p, replace))
    }

    async fn plan_destroy<'a>(
        &self,
        _diags: &mut Diagnostics,
        _prior: Self::State<'a>,
        p: Self::PrivateState<'a>,
        _m: Self::ProviderMetaState<'a>,
    ) -> Option<Self::PrivateState<'a>> {
        Some(p)
    }

    async fn create<'a>(
        &self,
        diags: &mut Diagnostics,
        planned: Self::State<'a>,
        _config: Self::State<'a>,
        p: Self::PrivateState<'a>,
        _m: Self::ProviderMetaState<'a>,
    ) -> Option<(Self::State<'a>, Self::PrivateState<'a>)> {
        let Some(s) = known(&planned) else {
            missing_state(diags);
            return None;
        };
        let engine = engine(&self.0, diags)?;
        let id = done(
            diags,
            "create traffic distributor",
            engine.create_distributor(&spec_of(s)).await,
        )?;
        Some((self.observe(diags, &id)?, p))
    }

    async fn update<'a>(
        &self,
        diags: &mut Diagnostics,
        prior: Self::State<'a>,
        planned: Self::State<'a>,
        _config: Self::State<'a>,
        p: Self::PrivateState<'a>,
        _m: Self::ProviderMetaState<'a>,
    ) -> Option<(Self::State<'a>, Self::PrivateState<'a>)> {
        let (Some(prior), Some(s)) = (known(&prior), known(&planned)) else {
            missing_state(diags);
            return None;
        };
        let engine = engine(&self.0, diags)?;
        let id = string(&prior.id);
        done(
            diags,
            "update traffic distributor",
            engine.update_distributor(&id, &spec_of(s)).await,
        )?;
        Some((self.observe(diags, &id)?, p))
    }

    async fn destroy<'a>(
        &self,
        diags: &mut Diagnostics,
        prior: Self::State<'a>,
        _p: Self::PrivateState<'a>,
        _m: Self::ProviderMetaState<'a>,
    ) -> Option<()> {
        let Some(prior) = known(&prior) else {
            return Some(());
        };
        let engine = engine(&self.0, diags)?;
        done(
            diags,
            "destroy traffic distributor",
            engine.delete_distributor(&string(&prior.id)).await,
        )
    }

    async fn import<'a>(
        &self,
        diags: &mut Diagnostics,
        name: String,
    ) -> Option<(Self::State<'a>, Self::PrivateState<'a>)> {
        let engine = engine(&self.0, diags)?;
        let id = import_id(
            diags,
            "traffic distributor",
            &name,
            engine
                .store
                .distributor_by_name(&name)
                .map(|r| r.map(|r| r.id)),
        )?;
        Some((self.observe(diags, &id)?, Value::Null))
    }
}
