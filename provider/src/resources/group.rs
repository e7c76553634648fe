//! `lbscale_autoscale_group`: a fleet of nodes, one cluster per availability zone.
//!
//! `nodes` and `node_count` are computed: the daemon changes them between applies
//! and a plan never fights it. They become unknown in a plan only when the apply
//! will act on the nodes: a change to the declared shape, or a group that is not
//! healthy (a node died, an AZ below `min_nodes`), which the apply then heals.

use super::check_cloud_usable;
use super::managed::ManagedObject;
use crate::common::*;
use async_trait::async_trait;
use lbscale_core::policy;
use lbscale_engine::model::{CloudName, Findings, GroupSpec, NodeSpec, PathStep, CLOUDS};
use lbscale_engine::reconcile::GroupView;
use lbscale_engine::{Engine, EngineError};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use tf_provider::schema::{AttributeType, Block, NestedBlock};
use tf_provider::value::Value;
use tf_provider::{AttributePath, Diagnostics};

pub struct Group;

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ThresholdBlock {
    pub metric: Value<String>,
    pub min: Value<Number>,
    pub max: Value<Number>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct NodeBlock {
    pub memory_limit_mb: Value<Number>,
    pub image: Value<String>,
    pub size: Value<String>,
    pub subnets: Value<BTreeMap<String, String>>,
    pub security_groups: Value<Vec<String>>,
    pub management_cidrs: Value<Vec<String>>,
    pub identity: Value<String>,
    pub tags: Value<BTreeMap<String, String>>,
}

impl NodeBlock {
    /// The block as the engine reads it: what is known of it (a value not
    /// known yet is left out, and the rules on it wait for it).
    fn spec(&self) -> NodeSpec {
        let list = |v: &Value<Vec<String>>| known(v).cloned().unwrap_or_default();
        let map = |v: &Value<BTreeMap<String, String>>| known(v).cloned().unwrap_or_default();
        NodeSpec {
            memory_limit_mb: int(&self.memory_limit_mb).unwrap_or(Defaults::MEMORY_LIMIT_MB),
            image: known(&self.image).cloned(),
            size: known(&self.size).cloned(),
            subnets: map(&self.subnets),
            security_groups: list(&self.security_groups),
            management_cidrs: list(&self.management_cidrs),
            identity: known(&self.identity).cloned(),
            tags: map(&self.tags),
        }
    }

    fn of(n: &NodeSpec) -> NodeBlock {
        let list = |v: &Vec<String>| {
            if v.is_empty() {
                Value::Null
            } else {
                Value::Value(v.clone())
            }
        };
        let map = |v: &BTreeMap<String, String>| {
            if v.is_empty() {
                Value::Null
            } else {
                Value::Value(v.clone())
            }
        };
        NodeBlock {
            memory_limit_mb: Value::Value(n.memory_limit_mb.into()),
            image: n.image.clone().into(),
            size: n.size.clone().into(),
            subnets: map(&n.subnets),
            security_groups: list(&n.security_groups),
            management_cidrs: list(&n.management_cidrs),
            identity: n.identity.clone().into(),
            tags: map(&n.tags),
        }
    }
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct NodeObject {
    pub id: Value<String>,
    pub availability_zone: Value<String>,
    pub private_ip: Value<String>,
    pub public_ip: Value<String>,
    pub state: Value<String>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct State {
    pub id: Value<String>,
    pub name: Value<String>,
    pub cloud: Value<String>,
    pub availability_zones: Value<Vec<String>>,
    pub traffic_distributor_id: Value<String>,
    pub min_nodes: Value<Number>,
    pub max_nodes: Value<Number>,
    pub stats_interval: Value<String>,
    pub watch_time: Value<String>,
    pub cooldown: Value<String>,
    pub drain_timeout: Value<String>,
    pub apply_timeout: Value<String>,
    pub threshold: Value<Vec<ThresholdBlock>>,
    pub node: Value<Vec<NodeBlock>>,
    pub nodes: Value<Vec<NodeObject>>,
    pub node_count: Value<i64>,
}

pub fn node_object_type() -> AttributeType {
    AttributeType::Object(HashMap::from([
        ("id".to_string(), AttributeType::String),
        ("availability_zone".to_string(), AttributeType::String),
        ("private_ip".to_string(), AttributeType::String),
        ("public_ip".to_string(), AttributeType::String),
        ("state".to_string(), AttributeType::String),
    ]))
}

pub fn node_objects(view: &GroupView) -> Vec<NodeObject> {
    view.nodes
        .iter()
        .map(|n| NodeObject {
            id: Value::Value(n.id.clone()),
            availability_zone: Value::Value(n.availability_zone.clone()),
            private_ip: Value::Value(n.private_ip.clone()),
            public_ip: n.public_ip.clone().into(),
            state: Value::Value(n.state.clone()),
        })
        .collect()
}

struct Defaults;
impl Defaults {
    const MIN_NODES: i64 = 1;
    const MAX_NODES: i64 = 4;
    const STATS_INTERVAL: &'static str = "1m";
    const WATCH_TIME: &'static str = "3m";
    const COOLDOWN: &'static str = "10m";
    const DRAIN_TIMEOUT: &'static str = "10m";
    const APPLY_TIMEOUT: &'static str = "5m";
    const MEMORY_LIMIT_MB: i64 = lbscale_engine::model::DEFAULT_MEMORY_LIMIT_MB;
}

fn apply_defaults(s: &mut State) {
    default_to(&mut s.min_nodes, Defaults::MIN_NODES.into());
    default_to(&mut s.max_nodes, Defaults::MAX_NODES.into());
    default_to(&mut s.stats_interval, Defaults::STATS_INTERVAL.into());
    default_to(&mut s.watch_time, Defaults::WATCH_TIME.into());
    default_to(&mut s.cooldown, Defaults::COOLDOWN.into());
    default_to(&mut s.drain_timeout, Defaults::DRAIN_TIMEOUT.into());
    default_to(&mut s.apply_timeout, Defaults::APPLY_TIMEOUT.into());
    if let Value::Value(nodes) = &mut s.node {
        for n in nodes {
            default_to(&mut n.memory_limit_mb, Defaults::MEMORY_LIMIT_MB.into());
        }
    }
}

fn state_of(v: &GroupView) -> State {
    let s = &v.spec;
    State {
        id: Value::Value(v.id.clone()),
        name: Value::Value(s.name.clone()),
        cloud: Value::Value(s.cloud.to_string()),
        availability_zones: Value::Value(s.availability_zones.clone()),
        traffic_distributor_id: Value::Value(s.traffic_distributor_id.clone()),
        min_nodes: Value::Value(s.min_nodes.into()),
        max_nodes: Value::Value(s.max_nodes.into()),
        stats_interval: Value::Value(s.stats_interval.to_string()),
        watch_time: Value::Value(s.watch_time.to_string()),
        cooldown: Value::Value(s.cooldown.to_string()),
        drain_timeout: Value::Value(s.drain_timeout.to_string()),
        apply_timeout: Value::Value(s.apply_timeout.to_string()),
        threshold: Value::Value(
            s.thresholds
                .iter()
                .map(|t| ThresholdBlock {
                    metric: Value::Value(t.metric.name().to_string()),
                    min: Value::Value(Number(t.min)),
                    max: Value::Value(Number(t.max)),
                })
                .collect(),
        ),
        node: Value::Value(s.node.iter().map(NodeBlock::of).collect()),
        nodes: Value::Value(node_objects(v)),
        node_count: Value::Value(v.node_count()),
    }
}

/// Whether the observed nodes need an apply: a failed node, or an AZ outside
/// its bounds.
fn needs_healing(s: &State) -> bool {
    let (Some(nodes), Some(zones), Some(min), Some(max)) = (
        known(&s.nodes),
        known(&s.availability_zones),
        int(&s.min_nodes),
        int(&s.max_nodes),
    ) else {
        return false;
    };
    if nodes
        .iter()
        .any(|n| known(&n.state).is_some_and(|st| st != "active"))
    {
        return true;
    }
    zones.iter().any(|z| {
        let c = nodes
            .iter()
            .filter(|n| known(&n.availability_zone) == Some(z))
            .count() as i64;
        c < min || c > max
    })
}

impl State {
    /// The attributes that only the apply knows.
    fn forget_computed(&mut self) {
        self.id = Value::Unknown;
        self.nodes = Value::Unknown;
        self.node_count = Value::Unknown;
    }
}

/// The engine's rules against the store, checked at plan time once the ids are known.
fn check_placement(engine: &EngineHandle, diags: &mut Diagnostics, s: &State) -> Option<()> {
    if s.traffic_distributor_id.is_unknown() || s.cloud.is_unknown() {
        return Some(());
    }
    plan_check(engine, diags, "check autoscale group", |e| {
        // A value that does not read yet is validation's to report.
        Group::spec_of(s).map_or_else(|_| Ok(Findings::default()), |spec| e.check_group(&spec))
    })
}

#[async_trait]
impl ManagedObject for Group {
    type State = State;
    type Spec = GroupSpec;
    const KIND: &'static str = "autoscale group";

    fn schema() -> Block {
        let duration = |d: &str| defaulted(AttributeType::String, d);
        block(
            "A fleet of load-balancer nodes, one cluster per availability zone, scaled between `min_nodes` and `max_nodes` by thresholds on the nodes' CPU, memory and throughput. Apply brings every AZ to at least `min_nodes` and waits until the nodes serve; the daemon scales between applies.",
            vec![
                ("id", id_attr()),
                ("name", required(AttributeType::String, "Name of the group. Changing it replaces the group.")),
                ("cloud", required(AttributeType::String, "Cloud of the nodes: `local`, `aws`, `azure` or `gcp`; must equal the traffic distributor's. Changing it replaces the group.")),
                ("availability_zones", required(AttributeType::List(Box::new(AttributeType::String)), "Availability zones; one cluster per zone, each scaled on its own.")),
                ("traffic_distributor_id", required(AttributeType::String, "Id of the `lbscale_traffic_distributor` that hands out this group's nodes.")),
                ("min_nodes", defaulted(AttributeType::Number, "Fewest nodes per AZ. Default 1; 1 <= min_nodes <= max_nodes.")),
                ("max_nodes", defaulted(AttributeType::Number, "Most nodes per AZ. Default 4; at most 64. Lowering it below the current count drains the newest nodes.")),
                ("stats_interval", duration("How often the nodes' statistics are sampled. Default `\"1m\"`.")),
                ("watch_time", duration("How long a breach must hold before acting: a positive multiple of `stats_interval`. Default `\"3m\"`.")),
                ("cooldown", duration("After a scale-out's node has joined, no evaluation of that AZ for this long. Default `\"10m\"`.")),
                ("drain_timeout", duration("On scale-in, the longest wait for the leaving node's connections to finish. Default `\"10m\"`.")),
                ("apply_timeout", duration("How long apply waits for the nodes to be active. Default `\"5m\"`.")),
                ("nodes", computed(AttributeType::List(Box::new(node_object_type())), "The group's nodes now: `id`, `availability_zone`, `private_ip`, `public_ip`, `state` (`provisioning`, `joining`, `active`, `draining`, `deprovisioning`, `failed`).")),
                ("node_count", computed(AttributeType::Number, "Nodes serving now (changed by the daemon without creating a diff).")),
            ],
            vec![
                (
                    "threshold",
                    NestedBlock::List(block(
                        "A scaling threshold; at least one, one per metric. Scale-out when any metric is above its `max` for the watch time; scale-in when all are below their `min`.",
                        vec![
                            ("metric", required(AttributeType::String, "`cpu` (percent), `memory` (percent) or `throughput` (Mbps per node).")),
                            ("min", required(AttributeType::Number, "Scale-in threshold; below `max`.")),
                            ("max", required(AttributeType::Number, "Scale-out threshold; at most 100 for `cpu` and `memory`.")),
                        ],
                        vec![],
                    )),
                ),
                ("node", NestedBlock::Optional(node_block())),
            ],
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
        if let Some(z) = known(&s.availability_zones) {
            f.availability_zones(z);
        }
        let mut bound = |name: &'static str, v: &Value<Number>, d| {
            if v.is_null() {
                Some(d)
            } else {
                whole_number(&mut f, vec![PathStep::Attr(name)], name, v)
            }
        };
        let min = bound("min_nodes", &s.min_nodes, Defaults::MIN_NODES);
        let max = bound("max_nodes", &s.max_nodes, Defaults::MAX_NODES);
        f.node_bounds(min, max);
        let text = |v: &Value<String>, d: &str| {
            if v.is_null() {
                Some(d.to_string())
            } else {
                known(v).cloned()
            }
        };
        if let (Some(si), Some(wt)) = (
            text(&s.stats_interval, Defaults::STATS_INTERVAL),
            text(&s.watch_time, Defaults::WATCH_TIME),
        ) {
            f.timing(&si, &wt);
        }
        for (name, v) in [
            ("cooldown", &s.cooldown),
            ("drain_timeout", &s.drain_timeout),
            ("apply_timeout", &s.apply_timeout),
        ] {
            if let Some(t) = known(v) {
                f.duration(vec![PathStep::Attr(name)], name, t);
            }
        }
        if let Some(ts) = known(&s.threshold) {
            // Checked only once every value of every block is known.
            let all: Option<Vec<policy::ThresholdSpec>> = ts
                .iter()
                .map(|t| {
                    Some(policy::ThresholdSpec {
                        metric: known(&t.metric)?.clone(),
                        min: known(&t.min)?.0,
                        max: known(&t.max)?.0,
                    })
                })
                .collect();
            if let Some(all) = all {
                f.thresholds(&all);
            }
        }
        if let Some(n) = known(&s.node).and_then(|n| n.first()) {
            let at = vec![
                PathStep::Attr("node"),
                PathStep::Index(0),
                PathStep::Attr("memory_limit_mb"),
            ];
            whole_number(&mut f, at, "node.memory_limit_mb", &n.memory_limit_mb);
            // An empty list or map reads back as none given: refused, so that
            // the state always says what the configuration does.
            let empty = [
                ("subnets", known(&n.subnets).is_some_and(|m| m.is_empty())),
                (
                    "security_groups",
                    known(&n.security_groups).is_some_and(|l| l.is_empty()),
                ),
                (
                    "management_cidrs",
                    known(&n.management_cidrs).is_some_and(|l| l.is_empty()),
                ),
                ("tags", known(&n.tags).is_some_and(|m| m.is_empty())),
            ];
            for (field, _) in empty.iter().filter(|(_, e)| *e) {
                f.0.push(lbscale_engine::model::Finding::error(
                    vec![PathStep::Attr("node"), PathStep::Index(0), PathStep::Attr(field)],
                    format!("Empty node.{field}"),
                    format!("node.{field} is empty: leave it out (or set it to null) when there is nothing to give."),
                ));
            }
            // The cloud's and the zones' rules once they are known.
            let cloud = known(&s.cloud).and_then(|c| CloudName::parse(c));
            f.node_spec(
                cloud,
                known(&s.availability_zones).map(Vec::as_slice),
                &n.spec(),
            );
        }
        f
    }

    fn id(state: &State) -> String {
        string(&state.id)
    }

    fn spec_of(s: &State) -> Result<GroupSpec, Findings> {
        let mut f = Findings::default();
        let spec = (|| {
            let declared: Vec<policy::ThresholdSpec> = known(&s.threshold)
                .map(|ts| {
                    ts.iter()
                        .map(|t| policy::ThresholdSpec {
                            metric: string(&t.metric),
                            min: known(&t.min).copied().unwrap_or_default().0,
                            max: known(&t.max).copied().unwrap_or_default().0,
                        })
                        .collect()
                })
                .unwrap_or_default();
            Some(GroupSpec {
                name: string(&s.name),
                cloud: f.cloud(&string(&s.cloud))?,
                availability_zones: known(&s.availability_zones).cloned().unwrap_or_default(),
                traffic_distributor_id: string(&s.traffic_distributor_id),
                min_nodes: int(&s.min_nodes).unwrap_or(Defaults::MIN_NODES),
                max_nodes: int(&s.max_nodes).unwrap_or(Defaults::MAX_NODES),
                stats_interval: f
                    .declared_duration("stats_interval", &string(&s.stats_interval))?,
                watch_time: f.declared_duration("watch_time", &string(&s.watch_time))?,
                cooldown: f.declared_duration("cooldown", &string(&s.cooldown))?,
                drain_timeout: f.declared_duration("drain_timeout", &string(&s.drain_timeout))?,
                apply_timeout: f.declared_duration("apply_timeout", &string(&s.apply_timeout))?,
                thresholds: f.typed_thresholds(&declared)?,
                node: known(&s.node).and_then(|n| n.first()).map(NodeBlock::spec),
            })
        })();
        spec.ok_or(f)
    }

    fn plan_create(engine: &EngineHandle, diags: &mut Diagnostics, s: &mut State) -> Option<()> {
        apply_defaults(s);
        // The distributor's cloud first: "must equal the distributor's" is the
        // more useful message when both apply.
        check_placement(engine, diags, s)?;
        check_cloud_usable(engine, diags, known(&s.cloud), Some(&node_of(s)))?;
        s.forget_computed();
        Some(())
    }

    fn plan_update(
        engine: &EngineHandle,
        diags: &mut Diagnostics,
        prior: &State,
        s: &mut State,
    ) -> Option<Vec<AttributePath>> {
        apply_defaults(s);
        let replace = requires_replace(&[
            ("name", changed(&prior.name, &s.name)),
            ("cloud", changed(&prior.cloud, &s.cloud)),
        ]);
        if !replace.is_empty() {
            check_cloud_usable(engine, diags, known(&s.cloud), Some(&node_of(s)))?;
            s.forget_computed();
            return Some(replace);
        }
        check_placement(engine, diags, s)?;
        let shape_changed = changed(&prior.availability_zones, &s.availability_zones)
            || changed(&prior.min_nodes, &s.min_nodes)
            || changed(&prior.max_nodes, &s.max_nodes)
            || changed(&prior.traffic_distributor_id, &s.traffic_distributor_id)
            || changed(&prior.node, &s.node);
        if shape_changed || needs_healing(prior) {
            s.nodes = Value::Unknown;
            s.node_count = Value::Unknown;
        }
        Some(vec![])
    }

    async fn read(engine: &Engine, id: &str) -> Result<Option<State>, EngineError> {
        Ok(engine.group_view(id).await?.as_ref().map(state_of))
    }

    fn find(engine: &Engine, name: &str) -> Result<Option<String>, EngineError> {
        Ok(engine.group_named(name)?.map(|r| r.id))
    }

    /// Records the group; `bring_up` then starts its nodes.
    async fn create(engine: &Engine, spec: &GroupSpec) -> Result<String, EngineError> {
        engine.declare_group(spec)
    }

    /// Brings every AZ to `min_nodes` and waits until the nodes serve. If this
    /// fails, the group is tainted and the next apply replaces it.
    async fn bring_up(engine: &Engine, id: &str) -> Result<(), EngineError> {
        engine.reconcile_group(id).await
    }

    async fn update(engine: &Engine, id: &str, spec: &GroupSpec) -> Result<(), EngineError> {
        engine.update_group(id, spec).await
    }

    async fn delete(engine: &Engine, id: &str) -> Result<(), EngineError> {
        engine.delete_group(id).await
    }
}

/// The group's `node` block as the engine reads it (its defaults without one).
fn node_of(s: &State) -> NodeSpec {
    known(&s.node)
        .and_then(|n| n.first())
        .map(NodeBlock::spec)
        .unwrap_or_default()
}

/// The `node` block's schema: one shape for every cloud; what each field
/// means on each is in docs/resources/autoscale_group.md.
fn node_block() -> Block {
    let strings = || AttributeType::List(Box::new(AttributeType::String));
    let map = || AttributeType::Map(Box::new(AttributeType::String));
    block(
        "The nodes' machine and placement: one shape for every cloud, each field meaning that cloud's own thing. A field that the group's cloud does not take is an error at plan time. Changing a field changes the nodes started from then on; running nodes keep theirs until they are replaced.",
        vec![
            ("memory_limit_mb", defaulted(AttributeType::Number, "`local`: the node's memory budget, against which its memory percent is measured (the node process's resident memory over this, since nodes share one machine). On aws, azure and gcp a node reports its instance's used memory over the instance's total (or its cgroup's limit) and this is not used. Default 256; 32 to 65536.")),
            ("image", optional(AttributeType::String, "The image nodes start from, with `lbscale-node` on its PATH. aws: an AMI id (`ami-...`), default the provider's `aws.image_id`; azure: an image URN (`publisher:offer:sku:version`) or image resource id; gcp: an image (`projects/P/global/images/NAME` or `.../images/family/F`, or a self-link). Not on local.")),
            ("size", optional(AttributeType::String, "The machine size. aws: the instance type (`t3.small`), default the provider's `aws.instance_type`, else `c5.large`; azure: the VM size (`Standard_D2s_v5`); gcp: the machine type (`e2-standard-2`). Not on local.")),
            ("subnets", optional(map(), "Per availability zone, the subnet its nodes start in: every zone of `availability_zones` and no other. aws: a subnet id (`subnet-...`) in that AZ, also the `nlb` distributor's subnet there; azure: a subnet resource id; gcp: a subnetwork (name, `projects/P/regions/R/subnetworks/N` or self-link). Default: the cloud's default subnet of each zone. Not on local.")),
            ("security_groups", optional(strings(), "The nodes' firewall. aws: 1 to 5 security group ids (`sg-...`); azure: one network security group resource id; gcp: network tags that firewall rules target. Not given: lbscale makes one for the group, with the vservers' ports open (TCP or UDP, as each vserver says) and the node API port open only to `management_cidrs`, kept in step with the vservers and deleted with the group. Not on local.")),
            ("management_cidrs", optional(strings(), "Where lbscale (Terraform and the daemon) reaches the nodes from: the only sources of the node API port (9990) in the security group lbscale makes. Default: the network's own range (aws: the VPC's CIDR blocks). Only without `security_groups`. Not on local.")),
            ("identity", optional(AttributeType::String, "The nodes' cloud identity. aws: an IAM instance profile name or ARN; azure: a user-assigned managed identity resource id; gcp: a service account email. Not on local.")),
            ("tags", optional(map(), "Tags on the nodes. aws: instance and volume tags (at most 40; `Name`, `aws:` and `lbscale:` keys are reserved); azure: resource tags; gcp: labels (lowercase). Not on local.")),
        ],
        vec![],
    )
}
