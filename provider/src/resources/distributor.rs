//! `lbscale_traffic_distributor`: how clients reach the clusters (DNS or NLB).

use super::check_cloud_usable;
use super::managed::ManagedObject;
use crate::common::*;
use async_trait::async_trait;
use lbscale_engine::model::{DistributorSpec, Findings, PathStep, CLOUDS, DISTRIBUTOR_MODES};
use lbscale_engine::{Engine, EngineError};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use tf_provider::schema::{AttributeType, Block};
use tf_provider::value::Value;
use tf_provider::{AttributePath, Diagnostics};

pub struct Distributor;

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

impl State {
    /// Attributes that only the apply knows.
    fn forget_computed(&mut self) {
        self.id = Value::Unknown;
        self.forget_observed();
    }

    /// What the distributor hands out, which its apply reads back.
    fn forget_observed(&mut self) {
        self.endpoints = Value::Unknown;
        self.address = Value::Unknown;
    }
}

#[async_trait]
impl ManagedObject for Distributor {
    type State = State;
    type Spec = DistributorSpec;
    const KIND: &'static str = "traffic distributor";

    fn schema() -> Block {
        block(
            "How clients reach the clusters of the autoscale groups that use it: an authoritative DNS server (`dns`) or a network load balancer with one VIP per availability zone (`nlb`).",
            vec![
                ("id", id_attr()),
                ("name", required(AttributeType::String, "Name of the distributor. Changing it replaces the distributor.")),
                ("cloud", required(AttributeType::String, "Cloud that runs it: `local`, `aws`, `azure` or `gcp`. Changing it replaces the distributor.")),
                ("mode", required(AttributeType::String, "`dns` (the domain resolves to every serving node) or `nlb` (one static VIP per AZ forwarding TCP to the AZ's nodes). Changing it replaces the distributor.")),
                ("domain", optional(AttributeType::String, "The application's domain; required with `dns`, not allowed with `nlb`.")),
                ("ttl", defaulted(AttributeType::String, "TTL of the DNS answers (`dns` only), a duration such as `\"60s\"`. Default `\"60s\"`. Scale-in waits one TTL after removing a node's address.")),
                ("endpoints", computed(AttributeType::List(Box::new(AttributeType::String)), "The node addresses registered right now, as this distributor's last apply (or import) saw them: none for a new one, whose groups come after it. A refresh keeps them (the daemon changes them between applies); the `lbscale_traffic_distributor` data source reads them live.")),
                ("address", computed(AttributeType::Map(Box::new(AttributeType::String)), "Where clients go: `{dns = \"IP:PORT\"}` of the DNS server (`dns`, known when the distributor is created), or the VIP of each AZ (`nlb`) as this distributor's last apply (or import) saw them. An nlb's VIPs are made with the first vserver of each AZ, after the distributor: read them from `lbscale_vserver.vip` or the `lbscale_traffic_distributor` data source.")),
            ],
            vec![],
        )
    }

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

    fn id(state: &State) -> String {
        string(&state.id)
    }

    fn spec_of(s: &State) -> Result<DistributorSpec, Findings> {
        let mut f = Findings::default();
        let spec = (|| {
            Some(DistributorSpec {
                name: string(&s.name),
                cloud: f.cloud(&string(&s.cloud))?,
                mode: f.distributor_mode(&string(&s.mode))?,
                domain: known(&s.domain).cloned(),
                ttl: f
                    .declared_duration("ttl", known(&s.ttl).map_or(DEFAULT_TTL, String::as_str))?,
            })
        })();
        spec.ok_or(f)
    }

    fn plan_create(engine: &EngineHandle, diags: &mut Diagnostics, s: &mut State) -> Option<()> {
        check_cloud_usable(engine, diags, known(&s.cloud), None)?;
        default_to(&mut s.ttl, DEFAULT_TTL.to_string());
        s.forget_computed();
        Some(())
    }

    fn plan_update(
        _: &EngineHandle,
        _diags: &mut Diagnostics,
        prior: &State,
        s: &mut State,
    ) -> Option<Vec<AttributePath>> {
        default_to(&mut s.ttl, DEFAULT_TTL.to_string());
        let replace = requires_replace(&[
            ("name", changed(&prior.name, &s.name)),
            ("cloud", changed(&prior.cloud, &s.cloud)),
            ("mode", changed(&prior.mode, &s.mode)),
        ]);
        if !replace.is_empty() {
            s.forget_computed();
        } else if changed(&prior.domain, &s.domain) {
            // A new domain may be served from another zone (aws): its apply
            // reads the address back. A ttl alone changes neither.
            s.forget_observed();
        }
        Some(replace)
    }

    /// `endpoints` and `address` stay as the last apply saw them: the groups
    /// that register nodes are applied after the distributor and the daemon
    /// changes them between applies, so a refresh that moved them would
    /// report every scaling as a change outside Terraform.
    fn keep_from(last: &State, now: &mut State) {
        if let Value::Value(e) = &last.endpoints {
            now.endpoints = Value::Value(e.clone());
        }
        if let Value::Value(a) = &last.address {
            now.address = Value::Value(a.clone());
        }
    }

    /// The state as the store and the driver see it now.
    async fn read(engine: &Engine, id: &str) -> Result<Option<State>, EngineError> {
        Ok(engine.distributor_view(id)?.map(|v| State {
            id: Value::Value(v.id),
            name: Value::Value(v.spec.name),
            cloud: Value::Value(v.spec.cloud.to_string()),
            mode: Value::Value(v.spec.mode.to_string()),
            domain: v.spec.domain.into(),
            ttl: Value::Value(v.spec.ttl.to_string()),
            endpoints: Value::Value(v.endpoints),
            address: Value::Value(v.address),
        }))
    }

    fn find(engine: &Engine, name: &str) -> Result<Option<String>, EngineError> {
        Ok(engine.distributor_named(name)?.map(|r| r.id))
    }

    async fn create(engine: &Engine, spec: &DistributorSpec) -> Result<String, EngineError> {
        engine.create_distributor(spec).await
    }

    async fn update(engine: &Engine, id: &str, spec: &DistributorSpec) -> Result<(), EngineError> {
        engine.update_distributor(id, spec).await
    }

    /// Not refused while groups still use it: Terraform destroys a replaced
    /// distributor before the groups move to the new one.
    async fn delete(engine: &Engine, id: &str) -> Result<(), EngineError> {
        engine.delete_distributor(id).await
    }
}
