//! What-if simulation: replay a metric trace against a policy on a virtual clock.
//!
//! [`simulate`] drives [`policy::step`](crate::policy::step) exactly as the daemon
//! does, once per AZ per `stats_interval`, with a model of the cloud (fixed
//! provisioning and deprovisioning times, optional injected provisioning failures)
//! and of the leaving node's connections (`connections_drain_after`). It returns the
//! tick rows and events of `lbscale simulate` (cli.md) as serialisable structs, so the
//! CLI and the Terraform simulation data source return the same timeline.
//!
//! Input extensions beyond cli.md (all optional): `cloud.provision_failures` (the
//! first N provisioning attempts of the run fail after `provision_time`), and the
//! group's `stats_interval` defaults to `1m`.

use std::collections::HashMap;
use std::time::Duration;

use serde::{Serialize, Serializer};
use serde_json::Value;

use crate::error::{num, ConfigError};
use crate::jsonin::{as_array, as_object, child, show, show_duration, Obj};
use crate::policy::{
    self, pick_scale_in_node, validate_policy, Action, AzState, CandidateNode, Decision, EventKind,
    Metric, Observation, Phase, PhaseKind, PolicyConfig, PolicySpec, ProvisionOutcome, Sample,
    ThresholdSpec,
};

/// Most tick rows a simulation may produce; keeps a typo in `until` from eating memory.
pub const MAX_TICK_ROWS: u64 = 2_000_000;

/// A validated simulation input.
#[derive(Debug, Clone, PartialEq)]
pub struct SimInput {
    /// The AZ names, in the order ticks are reported.
    pub availability_zones: Vec<String>,
    /// The policy shared by every AZ.
    pub policy: PolicyConfig,
    /// Nodes per AZ at the start.
    pub initial_nodes: u32,
    /// How the simulated cloud behaves.
    pub cloud: CloudModel,
    /// How long a leaving node's connections take to finish after its drain starts;
    /// `None`: never (the full drain timeout is waited).
    pub connections_drain_after: Option<Duration>,
    /// Samples by (AZ index, tick number), tick number `t / stats_interval`.
    pub samples: HashMap<(usize, u64), Sample>,
    /// Last tick, seconds.
    pub until: u64,
}

/// The simulated cloud.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CloudModel {
    /// Time from a provisioning request to a ready node.
    pub provision_time: Duration,
    /// Time from a deletion request to the node being gone.
    pub deprovision_time: Duration,
    /// The first this-many provisioning attempts fail (after `provision_time`).
    pub provision_failures: u32,
}

/// A time in the output: seconds from the start, written as an integer when whole.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Secs(pub u64);

impl Serialize for Secs {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        if self.0 % 1000 == 0 {
            s.serialize_u64(self.0 / 1000)
        } else {
            s.serialize_f64(self.0 as f64 / 1000.0)
        }
    }
}

/// One AZ at one tick.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TickRow {
    /// Tick time.
    pub t: Secs,
    /// AZ name.
    pub az: String,
    /// What the AZ was doing at this tick: `Evaluating` when its statistics were
    /// evaluated, otherwise the phase in force once every wait that ended strictly
    /// before the tick has been processed (see [`policy::StepOutput::phase`]).
    pub phase: PhaseKind,
    /// Nodes registered with the distributor at the end of the tick.
    pub serving: u32,
    /// Nodes existing in the cloud at the end of the tick.
    pub provisioned: u32,
    /// Decision taken (only on an evaluating tick).
    pub action: Option<Decision>,
}

/// One decision or workflow step.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct EventRow {
    /// When it happened.
    pub t: Secs,
    /// AZ name.
    pub az: String,
    /// What happened.
    pub kind: EventKind,
    /// Why, for people; names the node concerned.
    pub reason: String,
}

/// The timeline: `{"ticks": [...], "events": [...]}`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SimOutput {
    /// One row per AZ per tick.
    pub ticks: Vec<TickRow>,
    /// Every event, in time order.
    pub events: Vec<EventRow>,
}

/// Reads and validates the JSON input of `lbscale simulate`.
pub fn parse_input(doc: &Value) -> Result<SimInput, ConfigError> {
    let root = as_object(
        doc,
        Vec::new(),
        &[
            "group",
            "cloud",
            "connections_drain_after",
            "samples",
            "until",
        ],
    )?;
    let group_v = root.required("group")?;
    let group = as_object(
        group_v,
        root.path_of("group"),
        &[
            "availability_zones",
            "min_nodes",
            "max_nodes",
            "initial_nodes",
            "stats_interval",
            "watch_time",
            "cooldown",
            "drain_timeout",
            "distributor",
            "dns_ttl",
            "thresholds",
        ],
    )?;
    let azs = read_azs(&group)?;
    let (policy, initial_nodes) = read_policy(&group)?;

    let cloud = match root.get("cloud") {
        None => CloudModel::default(),
        Some(v) => {
            let c = as_object(
                v,
                root.path_of("cloud"),
                &["provision_time", "deprovision_time", "provision_failures"],
            )?;
            CloudModel {
                provision_time: c.duration_opt("provision_time")?.unwrap_or_default(),
                deprovision_time: c.duration_opt("deprovision_time")?.unwrap_or_default(),
                provision_failures: c.u32_opt("provision_failures")?.unwrap_or(0),
            }
        }
    };
    let connections_drain_after = root.duration_opt("connections_drain_after")?;
    let until = root.u64_req("until")?;
    let interval = policy.stats_interval;
    let ticks = until.saturating_mul(1000) / interval;
    if ticks.saturating_mul(azs.len() as u64) > MAX_TICK_ROWS {
        return Err(ConfigError::new(
            root.path_of("until"),
            format!("must give at most {MAX_TICK_ROWS} tick rows (ticks x availability zones)"),
            until.to_string(),
        ));
    }
    // Samples after `until` are checked but never replayed: a long trace can be
    // replayed in part by lowering `until`.
    let samples = read_samples(&root, &azs, interval)?;
    Ok(SimInput {
        availability_zones: azs,
        policy,
        initial_nodes,
        cloud,
        connections_drain_after,
        samples,
        until,
    })
}

fn read_azs(group: &Obj<'_>) -> Result<Vec<String>, ConfigError> {
    let path = group.path_of("availability_zones");
    let list = as_array(group.required("availability_zones")?, &path)?;
    if list.is_empty() {
        return Err(ConfigError::new(
            path,
            "must list at least one availability zone",
            "[]",
        ));
    }
    let mut azs: Vec<String> = Vec::new();
    for (i, v) in list.iter().enumerate() {
        let p = child(&path, i);
        let name = v
            .as_str()
            .filter(|s| !s.is_empty())
            .ok_or_else(|| ConfigError::new(p.clone(), "must be a non-empty string", show(v)))?;
        if azs.iter().any(|a| a == name) {
            return Err(ConfigError::new(
                p,
                "must not repeat an availability zone",
                show(v),
            ));
        }
        azs.push(name.to_string());
    }
    Ok(azs)
}

/// A scaling policy from the `group` object of the input: read into core's
/// declared [`PolicySpec`] and checked by [`validate_policy`], the one check
/// that the daemon (from a group's typed settings) runs too, so that a setting
/// is refused in the same words everywhere.
fn read_policy(group: &Obj<'_>) -> Result<(PolicyConfig, u32), ConfigError> {
    let spec = read_policy_spec(group)?;
    validate_policy(&spec).map_err(|mut e| e.remove(0).under_path(&group.path))
}

fn read_policy_spec(group: &Obj<'_>) -> Result<PolicySpec, ConfigError> {
    let distributor = group.str_req("distributor")?.to_string();
    let dns_ttl = match group.duration_opt("dns_ttl")? {
        Some(d) => d,
        None if distributor == "dns" => return Err(group.required("dns_ttl").unwrap_err()),
        None => Duration::ZERO,
    };
    let tpath = group.path_of("thresholds");
    let mut thresholds = Vec::new();
    for (i, v) in as_array(group.required("thresholds")?, &tpath)?
        .iter()
        .enumerate()
    {
        let t = as_object(v, child(&tpath, i), &["metric", "min", "max"])?;
        thresholds.push(ThresholdSpec {
            metric: t.str_req("metric")?.to_string(),
            min: t.f64_req("min")?,
            max: t.f64_req("max")?,
        });
    }
    Ok(PolicySpec {
        min_nodes: group.u32_req("min_nodes")?,
        max_nodes: group.u32_req("max_nodes")?,
        initial_nodes: group.u32_opt("initial_nodes")?,
        stats_interval: group
            .duration_opt("stats_interval")?
            .unwrap_or(Duration::from_secs(60)),
        watch_time: group.duration_req("watch_time")?,
        cooldown: group.duration_req("cooldown")?,
        drain_timeout: group.duration_req("drain_timeout")?,
        distributor,
        dns_ttl,
        thresholds,
    })
}

fn read_samples(
    root: &Obj<'_>,
    azs: &[String],
    interval: u64,
) -> Result<HashMap<(usize, u64), Sample>, ConfigError> {
    let path = root.path_of("samples");
    let mut out = HashMap::new();
    let Some(v) = root.get("samples") else {
        return Ok(out);
    };
    for (i, item) in as_array(v, &path)?.iter().enumerate() {
        let s = as_object(
            item,
            child(&path, i),
            &["t", "az", "cpu", "memory", "throughput"],
        )?;
        let t = s.u64_req("t")?;
        let t_ms = t.saturating_mul(1000);
        if t == 0 || t_ms % interval != 0 {
            return Err(ConfigError::new(
                s.path_of("t"),
                format!(
                    "must be a positive multiple of stats_interval ({})",
                    show_duration(Duration::from_millis(interval))
                ),
                t.to_string(),
            ));
        }
        let az_name = s.str_req("az")?;
        let az = azs.iter().position(|a| a == az_name).ok_or_else(|| {
            ConfigError::new(
                s.path_of("az"),
                format!(
                    "must be one of the group's availability_zones ({})",
                    azs.join(", ")
                ),
                format!("{az_name:?}"),
            )
        })?;
        let mut sample = Sample::default();
        for metric in Metric::ALL {
            if let Some(v) = s.f64_opt(metric.name())? {
                if v < 0.0 {
                    return Err(ConfigError::new(
                        s.path_of(metric.name()),
                        "must be a number, 0 or more",
                        num(v),
                    ));
                }
                sample = sample.with(metric, v);
            }
        }
        if out.insert((az, t_ms / interval), sample).is_some() {
            return Err(ConfigError::new(
                s.path_of("t"),
                format!("must not repeat a sample of {az_name} at the same time"),
                t.to_string(),
            ));
        }
    }
    Ok(out)
}

/// The simulated world of one AZ: node identities and the cloud's pending work.
struct AzWorld {
    name: String,
    state: AzState,
    /// Active and leaving nodes: (id, creation order).
    nodes: Vec<(String, u64)>,
    next_seq: u64,
    /// The node being created, when it will be ready (or fail).
    creating: Option<(String, u64, ProvisionOutcome)>,
    /// The node leaving the AZ.
    leaving: Option<String>,
    /// When the leaving node will be gone.
    gone_at: Option<u64>,
}

impl AzWorld {
    fn new(name: &str, nodes: u32) -> Self {
        let mut w = AzWorld {
            name: name.to_string(),
            state: AzState::new(nodes),
            nodes: Vec::new(),
            next_seq: 1,
            creating: None,
            leaving: None,
            gone_at: None,
        };
        for _ in 0..nodes {
            let id = w.new_id();
            w.nodes.push((id, w.next_seq - 1));
        }
        w
    }

    fn new_id(&mut self) -> String {
        let id = format!("{}-{}", self.name, self.next_seq);
        self.next_seq += 1;
        id
    }

    fn observe(&self, input: &SimInput, sample: Option<Sample>) -> Observation {
        let provision = self.creating.as_ref().map(|(_, _, outcome)| *outcome);
        let drained_at = match (self.state.phase, input.connections_drain_after) {
            (Phase::Draining { since, .. }, Some(d)) => {
                Some(since.saturating_add(d.as_millis() as u64))
            }
            _ => None,
        };
        Observation {
            sample,
            provision,
            drained_at,
            deprovisioned_at: self.gone_at,
        }
    }
}

/// Runs the simulation. Pure: the same input always gives the same timeline.
pub fn simulate(input: &SimInput) -> SimOutput {
    let cfg = &input.policy;
    let interval = cfg.stats_interval;
    let last_tick = input.until.saturating_mul(1000) / interval;
    let mut worlds: Vec<AzWorld> = input
        .availability_zones
        .iter()
        .map(|name| AzWorld::new(name, input.initial_nodes))
        .collect();
    let mut failures_left = input.cloud.provision_failures;
    let mut ticks = Vec::new();
    let mut events = Vec::new();

    for n in 1..=last_tick {
        let now = n * interval;
        for (az, w) in worlds.iter_mut().enumerate() {
            let sample = input.samples.get(&(az, n)).copied();
            let mut phase = None;
            let mut decision = None;
            // Call `step` until the AZ settles: an action the simulated cloud finishes
            // at once (zero provisioning time) is observed by the next call, in the
            // same tick, as a daemon re-running its reconcile would.
            for _ in 0..8 {
                let obs = w.observe(input, sample);
                let before = w.state.phase.kind();
                let (next, out) = policy::step(cfg, &w.state, &obs, now);
                // The tick's label (`StepOutput::phase`: what the AZ was doing at
                // `now`, past every wait that ended before it) is the first call's,
                // moved on by a later call that gets past a wait that had ended before
                // `now` (the leaving node's connections are only observed once its
                // drain has started, so a drain that ended before `now` can be seen by
                // the second call). Work done at `now` (a node activated, a deletion
                // requested or finished) keeps the label; an evaluation always labels
                // the tick and is never overridden.
                if out.evaluated {
                    phase = Some(PhaseKind::Evaluating);
                } else if phase.is_none()
                    || (phase != Some(PhaseKind::Evaluating) && out.phase != before)
                {
                    phase = Some(out.phase);
                }
                decision = decision.or(out.decision);
                let mut node_of_event: Option<String> = None;
                for action in &out.actions {
                    match action {
                        Action::Provision { .. } => {
                            let id = w.new_id();
                            let at =
                                now.saturating_add(input.cloud.provision_time.as_millis() as u64);
                            let outcome = if failures_left > 0 {
                                failures_left -= 1;
                                ProvisionOutcome::Failed { at }
                            } else {
                                ProvisionOutcome::Ready { at }
                            };
                            node_of_event = Some(id.clone());
                            w.creating = Some((id, w.next_seq - 1, outcome));
                        }
                        Action::DiscardFailedNode => {
                            if let Some((id, _, _)) = w.creating.take() {
                                node_of_event = Some(id);
                            }
                        }
                        Action::Activate => {
                            if let Some((id, seq, _)) = w.creating.take() {
                                node_of_event = Some(id.clone());
                                w.nodes.push((id, seq));
                            }
                        }
                        Action::RemoveFromDistributor => {
                            let candidates: Vec<CandidateNode> = w
                                .nodes
                                .iter()
                                .enumerate()
                                .map(|(i, (id, seq))| CandidateNode {
                                    id: id.clone(),
                                    created: *seq,
                                    primary: i == 0,
                                })
                                .collect();
                            if let Some(pick) = pick_scale_in_node(&candidates) {
                                let id = pick.id.clone();
                                w.nodes.retain(|(n, _)| *n != id);
                                w.leaving = Some(id);
                            }
                        }
                        Action::Deprovision => {
                            w.gone_at = Some(
                                now.saturating_add(input.cloud.deprovision_time.as_millis() as u64),
                            );
                        }
                    }
                }
                let changed = next != w.state;
                for e in out.events {
                    let node = match e.kind {
                        EventKind::ScaleOut
                        | EventKind::NodeActive
                        | EventKind::ProvisionFailed
                        | EventKind::ScaleOutAbandoned => node_of_event.clone(),
                        EventKind::ScaleIn
                        | EventKind::TtlEnd
                        | EventKind::DrainEnd
                        | EventKind::DeprovisionStart
                        | EventKind::NodeRemoved => w.leaving.clone(),
                        EventKind::CooldownEnd => None,
                    };
                    let reason = match node {
                        Some(id) => format!("{} [node {id}]", e.reason),
                        None => e.reason,
                    };
                    events.push(EventRow {
                        t: Secs(e.at),
                        az: w.name.clone(),
                        kind: e.kind,
                        reason,
                    });
                    if e.kind == EventKind::NodeRemoved {
                        w.leaving = None;
                        w.gone_at = None;
                    }
                }
                w.state = next;
                if !changed {
                    break;
                }
            }
            ticks.push(TickRow {
                t: Secs(now),
                az: w.name.clone(),
                phase: phase.unwrap_or(PhaseKind::Evaluating),
                serving: w.state.serving,
                provisioned: w.state.provisioned,
                action: decision,
            });
        }
    }
    events.sort_by_key(|e| e.t);
    SimOutput { ticks, events }
}

/// Parses and runs in one go, for callers holding a JSON document.
pub fn simulate_json(doc: &Value) -> Result<SimOutput, ConfigError> {
    parse_input(doc).map(|input| simulate(&input))
}
