//! `lbscale_se_group`: how a vserver scales out across the nodes of a group.

use super::managed::ManagedObject;
use crate::common::*;
use async_trait::async_trait;
use lbscale_engine::model::{Finding, Findings, PathStep, SeGroupSpec, SCALING_MODES};
use lbscale_engine::{Engine, EngineError};
use serde::{Deserialize, Serialize};
use tf_provider::schema::{AttributeType, Block};
use tf_provider::value::Value;
use tf_provider::{AttributePath, Diagnostics};

pub struct SeGroup;

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct State {
    pub id: Value<String>,
    pub name: Value<String>,
    pub autoscale_group_id: Value<String>,
    pub scaling_mode: Value<String>,
    pub min_scaleout_per_vs: Value<Number>,
    pub max_scaleout_per_vs: Value<Number>,
    pub vs_scalein_timeout: Value<String>,
    pub se_tunnel_mode: Value<Number>,
    pub primary_forwarding_cost: Value<Number>,
}

fn apply_defaults(s: &mut State) {
    default_to(&mut s.scaling_mode, "native".into());
    default_to(&mut s.min_scaleout_per_vs, 1.into());
    default_to(&mut s.max_scaleout_per_vs, 4.into());
    default_to(&mut s.vs_scalein_timeout, "30s".into());
    default_to(&mut s.se_tunnel_mode, 0.into());
    default_to(&mut s.primary_forwarding_cost, Number(0.3));
}

/// The engine's rules against the store, checked at plan time once the group id is known.
fn check_placement(engine: &EngineHandle, diags: &mut Diagnostics, s: &State) -> Option<()> {
    if s.autoscale_group_id.is_unknown() {
        return Some(());
    }
    plan_check(engine, diags, "check SE group", |e| {
        // A value that does not read yet is validation's to report.
        SeGroup::spec_of(s).map_or_else(|_| Ok(Findings::default()), |spec| e.check_se_group(&spec))
    })
}

#[async_trait]
impl ManagedObject for SeGroup {
    type State = State;
    type Spec = SeGroupSpec;
    const KIND: &'static str = "SE group";

    fn schema() -> Block {
        block(
            "The placement and scale-out policy of vservers across the nodes of an autoscale group.",
            vec![
                ("id", id_attr()),
                ("name", required(AttributeType::String, "Name of the SE group; can change in place.")),
                ("autoscale_group_id", required(AttributeType::String, "Id of the `lbscale_autoscale_group` whose nodes serve this SE group's vservers; changing it moves the vservers.")),
                ("scaling_mode", defaulted(AttributeType::String, "`native` (the primary forwards a share to secondaries), `bgp` (ECMP over every node) or `native_and_bgp`. Default `native`.")),
                ("min_scaleout_per_vs", defaulted(AttributeType::Number, "Fewest nodes a vserver is placed on. Default 1.")),
                ("max_scaleout_per_vs", defaulted(AttributeType::Number, "Most nodes a vserver is placed on. Default 4; 1 <= min <= max <= 64.")),
                ("vs_scalein_timeout", defaulted(AttributeType::String, "How long a secondary leaving a vserver keeps its connections. Default `\"30s\"`.")),
                ("se_tunnel_mode", defaulted(AttributeType::Number, "0 auto (default), 1 tunnel, 2 no tunnel (direct return). Takes effect when the nodes restart.")),
                ("primary_forwarding_cost", defaulted(AttributeType::Number, "Cost of forwarding a connection on the primary, as a fraction of serving one; 0 < x < 1. Default 0.3.")),
            ],
            vec![],
        )
    }

    fn validate(s: &State) -> Findings {
        let mut f = Findings::default();
        if let Some(n) = known(&s.name) {
            f.name(n);
        }
        if let Some(m) = known(&s.scaling_mode) {
            f.one_of(
                vec![PathStep::Attr("scaling_mode")],
                "scaling_mode",
                m,
                SCALING_MODES,
            );
        }
        let mut bound = |name: &'static str, v: &Value<Number>, d| {
            if v.is_null() {
                Some(d)
            } else {
                whole_number(&mut f, vec![PathStep::Attr(name)], name, v)
            }
        };
        let min = bound("min_scaleout_per_vs", &s.min_scaleout_per_vs, 1);
        let max = bound("max_scaleout_per_vs", &s.max_scaleout_per_vs, 4);
        if let Some(v) = min {
            f.range(
                vec![PathStep::Attr("min_scaleout_per_vs")],
                "min_scaleout_per_vs",
                v,
                1,
                64,
            );
        }
        if let Some(v) = max {
            f.range(
                vec![PathStep::Attr("max_scaleout_per_vs")],
                "max_scaleout_per_vs",
                v,
                1,
                64,
            );
        }
        if let (Some(a), Some(b)) = (min, max) {
            if a > b {
                f.0.push(Finding::error(
                    vec![PathStep::Attr("min_scaleout_per_vs")],
                    "Invalid scale-out bounds",
                    format!("min_scaleout_per_vs must be less than or equal to max_scaleout_per_vs, got {a} and {b}."),
                ));
            }
        }
        if let Some(t) = known(&s.vs_scalein_timeout) {
            f.duration(
                vec![PathStep::Attr("vs_scalein_timeout")],
                "vs_scalein_timeout",
                t,
            );
        }
        let at = || vec![PathStep::Attr("se_tunnel_mode")];
        if let Some(m) = whole_number(&mut f, at(), "se_tunnel_mode", &s.se_tunnel_mode) {
            f.range(at(), "se_tunnel_mode", m, 0, 2);
        }
        if let Some(Number(c)) = known(&s.primary_forwarding_cost) {
            if !(*c > 0.0 && *c < 1.0) {
                f.0.push(Finding::error(
                    vec![PathStep::Attr("primary_forwarding_cost")],
                    "Invalid primary_forwarding_cost",
                    format!(
                        "primary_forwarding_cost must be between 0 and 1 (both excluded), got {c}."
                    ),
                ));
            }
        }
        f
    }

    fn id(state: &State) -> String {
        string(&state.id)
    }

    fn spec_of(s: &State) -> Result<SeGroupSpec, Findings> {
        let mut f = Findings::default();
        let vs_scalein_timeout =
            f.declared_duration("vs_scalein_timeout", &string(&s.vs_scalein_timeout));
        let Some(vs_scalein_timeout) = vs_scalein_timeout else {
            return Err(f);
        };
        Ok(SeGroupSpec {
            name: string(&s.name),
            autoscale_group_id: string(&s.autoscale_group_id),
            scaling_mode: string(&s.scaling_mode),
            min_scaleout_per_vs: int(&s.min_scaleout_per_vs).unwrap_or(1),
            max_scaleout_per_vs: int(&s.max_scaleout_per_vs).unwrap_or(4),
            vs_scalein_timeout,
            se_tunnel_mode: int(&s.se_tunnel_mode).unwrap_or(0),
            primary_forwarding_cost: known(&s.primary_forwarding_cost).map_or(0.3, |n| n.0),
        })
    }

    fn plan_create(engine: &EngineHandle, diags: &mut Diagnostics, s: &mut State) -> Option<()> {
        apply_defaults(s);
        check_placement(engine, diags, s)?;
        s.id = Value::Unknown;
        Some(())
    }

    fn plan_update(
        engine: &EngineHandle,
        diags: &mut Diagnostics,
        prior: &State,
        s: &mut State,
    ) -> Option<Vec<AttributePath>> {
        apply_defaults(s);
        check_placement(engine, diags, s)?;
        if changed(&prior.se_tunnel_mode, &s.se_tunnel_mode) {
            // Shown in the plan: the apply restarts the group's nodes.
            warning(
                diags,
                attr_path("se_tunnel_mode"),
                "se_tunnel_mode change: rolling restart",
                "Nodes read se_tunnel_mode only when they start: this apply restarts every node of the autoscale group, one at a time (a new node joins and serves before each old one is drained and removed).",
            );
        }
        Some(vec![])
    }

    async fn read(engine: &Engine, id: &str) -> Result<Option<State>, EngineError> {
        Ok(engine.se_group(id)?.map(|r| State {
            id: Value::Value(r.id),
            name: Value::Value(r.spec.name),
            autoscale_group_id: Value::Value(r.spec.autoscale_group_id),
            scaling_mode: Value::Value(r.spec.scaling_mode),
            min_scaleout_per_vs: Value::Value(r.spec.min_scaleout_per_vs.into()),
            max_scaleout_per_vs: Value::Value(r.spec.max_scaleout_per_vs.into()),
            vs_scalein_timeout: Value::Value(r.spec.vs_scalein_timeout.to_string()),
            se_tunnel_mode: Value::Value(r.spec.se_tunnel_mode.into()),
            primary_forwarding_cost: Value::Value(Number(r.spec.primary_forwarding_cost)),
        }))
    }

    fn find(engine: &Engine, name: &str) -> Result<Option<String>, EngineError> {
        Ok(engine.se_group_named(name)?.map(|r| r.id))
    }

    async fn create(engine: &Engine, spec: &SeGroupSpec) -> Result<String, EngineError> {
        engine.create_se_group(spec).await
    }

    async fn update(engine: &Engine, id: &str, spec: &SeGroupSpec) -> Result<(), EngineError> {
        engine.update_se_group(id, spec).await
    }

    async fn delete(engine: &Engine, id: &str) -> Result<(), EngineError> {
        engine.delete_se_group(id).await
    }
}
