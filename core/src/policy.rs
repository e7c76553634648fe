//! Threshold autoscaling of one availability-zone cluster, as a pure state machine.
//!
//! The daemon, `terraform apply` and `lbscale simulate` all drive the same
//! [`step`] function: `step(config, state, observation, now) -> (state, output)`.
//! It is *level-triggered*: the state says where the AZ is (evaluating, provisioning,
//! cooling down, waiting for DNS TTL, draining, deprovisioning), the observation says
//! what the world looks like now (this tick's sample, whether the node being created
//! is ready, whether the leaving node has drained or is gone), and the function says
//! what to do next. Calling it again at the same `now` with the same observation
//! changes nothing, so a daemon that crashed in the middle of a tick can simply
//! re-run it.
//!
//! # Timing rules (golden case G1)
//!
//! * A tick evaluates statistics only when the AZ is idle. Each enabled metric keeps
//!   its own scale-out streak; scale-out fires when **any** metric has been above its
//!   `max` for `k = watch_time / stats_interval` consecutive samples. Scale-in fires
//!   when **all** enabled metrics have been below their `min` for `k` consecutive
//!   samples. A missing sample (or a missing value of a metric) breaks the streaks it
//!   would have fed, so a gap never pushes a decision either way.
//! * Waits that the core times itself (cooldown, DNS TTL, drain, provisioning
//!   back-off) cover their last tick: a wait ending at minute `m` lets the next step
//!   run at the first tick *after* `m`. Consecutive waits chain at exact instants:
//!   the drain is measured from the end of the TTL, not from the tick that noticed it.
//! * Work the cloud does (creating, deleting a node) is observed: as soon as a tick
//!   sees that it is done, the steps that follow run in that same tick. With a cloud
//!   that takes no time (G1) the node is provisioned, joined and registered in the
//!   tick of the scale-out, and the cooldown starts there.
//! * Cooldown follows scale-out only, starting when the new node has joined. After a
//!   scale-in, evaluation resumes at the first tick after the node is gone.
//!
//! With these rules G1 comes out exactly: DNS deprovisions at T32 and evaluates again
//! at T33; NLB deprovisions at T31 and evaluates at T32.
//!
//! # What the state does not hold
//!
//! Node identities live with the caller (the engine's store, the simulator). The state
//! keeps counts only, so it stays a few dozen bytes per AZ (the daemon holds one per AZ
//! of every group). When the core says [`Action::RemoveFromDistributor`], the caller
//! picks the node with [`pick_scale_in_node`].

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::duration::format_as_seconds;
use crate::error::{num, ConfigError, PathStep};

/// Milliseconds on the caller's clock (the simulator starts at 0; the daemon uses
/// Unix time). The core never reads a clock itself.
pub type Millis = u64;

fn ms(d: Duration) -> Millis {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// A statistic that thresholds can watch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Metric {
    /// CPU utilisation, percent.
    Cpu,
    /// Memory utilisation, percent.
    Memory,
    /// Throughput per node, Mbps.
    Throughput,
}

impl Metric {
    /// Every metric, in the order used for arrays indexed by metric.
    pub const ALL: [Metric; 3] = [Metric::Cpu, Metric::Memory, Metric::Throughput];

    /// The name used in configuration and messages.
    pub fn name(self) -> &'static str {
        match self {
            Metric::Cpu => "cpu",
            Metric::Memory => "memory",
            Metric::Throughput => "throughput",
        }
    }

    /// Reads a configuration name.
    pub fn parse(name: &str) -> Option<Metric> {
        Metric::ALL.into_iter().find(|m| m.name() == name)
    }

    /// Position in arrays indexed by metric.
    pub fn index(self) -> usize {
        self as usize
    }

    /// CPU and memory are percentages and cannot exceed 100.
    pub fn is_percent(self) -> bool {
        matches!(self, Metric::Cpu | Metric::Memory)
    }
}

/// The scale-in (`min`) and scale-out (`max`) bounds of one metric.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Band {
    /// Below this, the metric is in scale-in breach.
    pub min: f64,
    /// Above this, the metric is in scale-out breach.
    pub max: f64,
}

/// The enabled thresholds, one slot per [`Metric`]. A fixed array rather than a list
/// keeps the configuration free of heap allocations and makes "one block per metric"
/// a property of the type.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Thresholds(pub [Option<Band>; 3]);

impl Thresholds {
    /// The band of `metric`, if enabled.
    pub fn get(&self, metric: Metric) -> Option<Band> {
        self.0[metric.index()]
    }

    /// Enables `metric` with `band`.
    pub fn set(&mut self, metric: Metric, band: Band) {
        self.0[metric.index()] = Some(band);
    }

    /// The enabled metrics with their bands, in [`Metric::ALL`] order.
    pub fn enabled(&self) -> impl Iterator<Item = (Metric, Band)> + '_ {
        Metric::ALL
            .into_iter()
            .filter_map(|m| self.get(m).map(|b| (m, b)))
    }

    /// Whether no metric is enabled (the group then only keeps its bounds).
    pub fn is_empty(&self) -> bool {
        self.0.iter().all(Option::is_none)
    }
}

/// How clients reach the AZ clusters; it decides whether scale-in waits a DNS TTL.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Distributor {
    /// Clients resolve the app's name to every active node: removing a node needs a
    /// TTL wait before the drain, because resolvers keep handing the address out.
    Dns,
    /// A network load balancer targets node private IPs: removal is immediate.
    Nlb,
}

impl Distributor {
    /// Reads a configuration name.
    pub fn parse(name: &str) -> Option<Distributor> {
        match name {
            "dns" => Some(Distributor::Dns),
            "nlb" => Some(Distributor::Nlb),
            _ => None,
        }
    }
}

/// A validated scaling policy, shared by every AZ of a group. All times in ms.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PolicyConfig {
    /// Fewest nodes an AZ cluster may serve with.
    pub min_nodes: u32,
    /// Most nodes an AZ cluster may have in the cloud.
    pub max_nodes: u32,
    /// Time between two samples (and two ticks).
    pub stats_interval: Millis,
    /// `k`: consecutive breaching samples that confirm a breach.
    pub watch_samples: u32,
    /// No evaluation for this long after a scaled-out node has joined.
    pub cooldown: Millis,
    /// Longest wait for a leaving node's connections.
    pub drain_timeout: Millis,
    /// DNS or NLB distribution.
    pub distributor: Distributor,
    /// DNS record TTL; waited before the drain with DNS distribution.
    pub dns_ttl: Millis,
    /// Enabled thresholds.
    pub thresholds: Thresholds,
}

/// A threshold block as declared, before validation.
#[derive(Debug, Clone, PartialEq)]
pub struct ThresholdSpec {
    /// `cpu`, `memory` or `throughput`.
    pub metric: String,
    /// Scale-in bound.
    pub min: f64,
    /// Scale-out bound.
    pub max: f64,
}

/// A scaling policy as declared (Terraform attributes or the `group` object of
/// `lbscale simulate`), before validation.
#[derive(Debug, Clone, PartialEq)]
pub struct PolicySpec {
    /// See [`PolicyConfig::min_nodes`].
    pub min_nodes: u32,
    /// See [`PolicyConfig::max_nodes`].
    pub max_nodes: u32,
    /// Nodes per AZ at the start; defaults to `min_nodes`.
    pub initial_nodes: Option<u32>,
    /// See [`PolicyConfig::stats_interval`].
    pub stats_interval: Duration,
    /// How long a breach must hold.
    pub watch_time: Duration,
    /// See [`PolicyConfig::cooldown`].
    pub cooldown: Duration,
    /// See [`PolicyConfig::drain_timeout`].
    pub drain_timeout: Duration,
    /// `dns` or `nlb`.
    pub distributor: String,
    /// See [`PolicyConfig::dns_ttl`].
    pub dns_ttl: Duration,
    /// Threshold blocks, in declaration order.
    pub thresholds: Vec<ThresholdSpec>,
}

/// Checks `stats_interval` and `watch_time` and returns `k`, the number of samples
/// in the watch time. Paths are `stats_interval` / `watch_time`.
pub fn validate_timing(stats_interval: Duration, watch_time: Duration) -> Result<u32, ConfigError> {
    let interval = ms(stats_interval);
    if interval == 0 {
        return Err(ConfigError::new(
            ["stats_interval"],
            "must be a positive duration",
            format_as_seconds(stats_interval),
        ));
    }
    let watch = ms(watch_time);
    if watch == 0 || watch % interval != 0 || watch / interval > u64::from(u32::MAX) {
        return Err(ConfigError::new(
            ["watch_time"],
            format!(
                "must be a positive multiple of stats_interval ({})",
                format_as_seconds(stats_interval)
            ),
            format_as_seconds(watch_time),
        ));
    }
    Ok((watch / interval) as u32)
}

/// Checks one threshold block; paths are relative to the block (`metric`, `min`,
/// `max`). Percent metrics (cpu, memory) must lie within 0–100.
pub fn validate_threshold(spec: &ThresholdSpec) -> Result<(Metric, Band), ConfigError> {
    let metric = Metric::parse(&spec.metric).ok_or_else(|| {
        ConfigError::new(
            ["metric"],
            "must be one of cpu, memory, throughput",
            format!("{:?}", spec.metric),
        )
    })?;
    for (field, v) in [("min", spec.min), ("max", spec.max)] {
        if !v.is_finite() || v < 0.0 {
            return Err(ConfigError::new(
                [field],
                "must be a number, 0 or more",
                num(v),
            ));
        }
        if metric.is_percent() && v > 100.0 {
            return Err(ConfigError::new(
                [field],
                format!("must be at most 100 ({} is a percentage)", metric.name()),
                num(v),
            ));
        }
    }
    if spec.min >= spec.max {
        return Err(ConfigError::new(
            ["min"],
            format!("must be below max ({})", num(spec.max)),
            num(spec.min),
        ));
    }
    Ok((
        metric,
        Band {
            min: spec.min,
            max: spec.max,
        },
    ))
}

/// Checks a list of threshold blocks: each valid, one block per metric. Paths are
/// `thresholds[i].field`. Every error is returned, for Terraform's diagnostics.
pub fn validate_thresholds(specs: &[ThresholdSpec]) -> Result<Thresholds, Vec<ConfigError>> {
    let mut out = Thresholds::default();
    let mut first_at: [Option<usize>; 3] = [None; 3];
    let mut errors = Vec::new();
    for (i, spec) in specs.iter().enumerate() {
        match validate_threshold(spec) {
            Ok((metric, band)) => {
                if let Some(j) = first_at[metric.index()] {
                    errors.push(
                        ConfigError::new(
                            ["metric"],
                            format!(
                                "must name a metric that no other threshold block sets \
                                 ({} is set by thresholds[{j}])",
                                metric.name()
                            ),
                            format!("{:?}", spec.metric),
                        )
                        .under(i)
                        .under("thresholds"),
                    );
                } else {
                    first_at[metric.index()] = Some(i);
                    out.set(metric, band);
                }
            }
            Err(e) => errors.push(e.under(i).under("thresholds")),
        }
    }
    if errors.is_empty() {
        Ok(out)
    } else {
        Err(errors)
    }
}

/// Checks `1 <= min_nodes <= max_nodes` and `initial_nodes` within them; returns the
/// initial node count (default `min_nodes`).
pub fn validate_node_bounds(
    min_nodes: u32,
    max_nodes: u32,
    initial_nodes: Option<u32>,
) -> Result<u32, ConfigError> {
    if min_nodes < 1 {
        return Err(ConfigError::new(
            ["min_nodes"],
            "must be at least 1",
            min_nodes.to_string(),
        ));
    }
    if max_nodes < min_nodes {
        return Err(ConfigError::new(
            ["max_nodes"],
            format!("must be at least min_nodes ({min_nodes})"),
            max_nodes.to_string(),
        ));
    }
    let initial = initial_nodes.unwrap_or(min_nodes);
    if initial < min_nodes || initial > max_nodes {
        return Err(ConfigError::new(
            ["initial_nodes"],
            format!("must be between min_nodes ({min_nodes}) and max_nodes ({max_nodes})"),
            initial.to_string(),
        ));
    }
    Ok(initial)
}

/// Reads `dns` / `nlb`; the path is `distributor`.
pub fn validate_distributor(name: &str) -> Result<Distributor, ConfigError> {
    Distributor::parse(name).ok_or_else(|| {
        ConfigError::new(
            ["distributor"],
            "must be one of dns, nlb",
            format!("{name:?}"),
        )
    })
}

/// Validates a whole policy; returns it with the initial node count per AZ. Paths are
/// relative to the policy block. All errors are returned, in field order.
pub fn validate_policy(spec: &PolicySpec) -> Result<(PolicyConfig, u32), Vec<ConfigError>> {
    let mut errors = Vec::new();
    let initial = validate_node_bounds(spec.min_nodes, spec.max_nodes, spec.initial_nodes)
        .map_err(|e| errors.push(e))
        .ok();
    let k = validate_timing(spec.stats_interval, spec.watch_time)
        .map_err(|e| errors.push(e))
        .ok();
    let distributor = validate_distributor(&spec.distributor)
        .map_err(|e| errors.push(e))
        .ok();
    let thresholds = validate_thresholds(&spec.thresholds)
        .map_err(|mut e| errors.append(&mut e))
        .ok();
    match (initial, k, distributor, thresholds) {
        (Some(initial), Some(k), Some(distributor), Some(thresholds)) => Ok((
            PolicyConfig {
                min_nodes: spec.min_nodes,
                max_nodes: spec.max_nodes,
                stats_interval: ms(spec.stats_interval),
                watch_samples: k,
                cooldown: ms(spec.cooldown),
                drain_timeout: ms(spec.drain_timeout),
                distributor,
                dns_ttl: ms(spec.dns_ttl),
                thresholds,
            },
            initial,
        )),
        _ => Err(errors),
    }
}

/// What an AZ is doing, as reported per tick (`phase` in `lbscale simulate`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PhaseKind {
    /// Statistics are evaluated.
    Evaluating,
    /// A node is being created (or a failed creation waits to be retried).
    Provisioning,
    /// A scaled-out node has joined; traffic settles.
    Cooldown,
    /// The leaving node's address is out of DNS; resolvers forget it.
    Ttl,
    /// The leaving node's connections finish.
    Draining,
    /// The leaving node is being deleted.
    Deprovisioning,
}

/// Where an AZ is, with the instants its waits end.
///
/// Serialisable (as part of [`AzState`]) so that the daemon can persist it: the
/// instants are on the caller's clock, which must then mean the same after a
/// restart (the daemon uses Unix time).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Phase {
    /// Idle. Statistics are evaluated at ticks strictly after `after` (the last
    /// evaluation, or the end of the last wait), which also makes a repeated call at
    /// the same instant a no-op.
    Evaluating {
        /// No evaluation at or before this instant.
        after: Option<Millis>,
    },
    /// A provisioning request (attempt number `attempt`, from 1) is out.
    Provisioning {
        /// When the request was made.
        requested_at: Millis,
        /// 1 for the first try.
        attempt: u32,
    },
    /// The last provisioning attempt failed; the next one runs after `retry_after`.
    ProvisionBackoff {
        /// Retry at the first tick after this.
        retry_after: Millis,
        /// Attempts made so far.
        attempt: u32,
    },
    /// No evaluation until `until` has passed.
    Cooldown {
        /// End of the cooldown.
        until: Millis,
    },
    /// The leaving node is out of DNS; wait for resolvers until `until`.
    Ttl {
        /// End of the TTL wait.
        until: Millis,
    },
    /// The leaving node drains from `since`, at most until `until`.
    Draining {
        /// Start of the drain.
        since: Millis,
        /// `since + drain_timeout`.
        until: Millis,
    },
    /// The drain ended at `after`; deprovisioning starts at the first tick after it.
    DeprovisionDue {
        /// End of the drain.
        after: Millis,
    },
    /// The leaving node is being deleted since `requested_at`.
    Deprovisioning {
        /// When deletion was requested.
        requested_at: Millis,
    },
}

impl Phase {
    /// The reported phase.
    pub fn kind(&self) -> PhaseKind {
        match self {
            Phase::Evaluating { .. } => PhaseKind::Evaluating,
            Phase::Provisioning { .. } | Phase::ProvisionBackoff { .. } => PhaseKind::Provisioning,
            Phase::Cooldown { .. } => PhaseKind::Cooldown,
            Phase::Ttl { .. } => PhaseKind::Ttl,
            Phase::Draining { .. } => PhaseKind::Draining,
            Phase::DeprovisionDue { .. } | Phase::Deprovisioning { .. } => {
                PhaseKind::Deprovisioning
            }
        }
    }
}

/// The decision state of one AZ cluster. `Copy` and heap-free: the daemon keeps one
/// per AZ of every group (and persists it, serialised, after each step).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct AzState {
    /// Current phase.
    pub phase: Phase,
    /// Nodes registered with the traffic distributor.
    pub serving: u32,
    /// Nodes that exist in the cloud (including one being created or deleted).
    pub provisioned: u32,
    /// Consecutive samples above `max`, per metric ([`Metric::index`]).
    pub out_streak: [u32; 3],
    /// Consecutive samples with every enabled metric below its `min`.
    pub in_streak: u32,
}

impl AzState {
    /// An idle AZ with `nodes` active nodes.
    pub fn new(nodes: u32) -> Self {
        AzState {
            phase: Phase::Evaluating { after: None },
            serving: nodes,
            provisioned: nodes,
            out_streak: [0; 3],
            in_streak: 0,
        }
    }

    fn reset_streaks(&mut self) {
        self.out_streak = [0; 3];
        self.in_streak = 0;
    }
}

/// One AZ's statistics for one interval: the mean over its serving nodes. A metric
/// no node reported is `None`.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Sample(pub [Option<f64>; 3]);

impl Sample {
    /// The value of `metric`, if reported.
    pub fn get(&self, metric: Metric) -> Option<f64> {
        self.0[metric.index()]
    }

    /// This sample with `metric` set to `value`.
    pub fn with(mut self, metric: Metric, value: f64) -> Self {
        self.0[metric.index()] = Some(value);
        self
    }
}

/// How the cloud answered the current provisioning request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProvisionOutcome {
    /// The node is up and reachable since `at`.
    Ready {
        /// When the cloud finished.
        at: Millis,
    },
    /// The cloud gave up at `at` (the node, if any, must be deleted by the caller).
    Failed {
        /// When the cloud failed.
        at: Millis,
    },
}

/// What the caller sees of the world at this tick. Fields about workflows are read
/// only in the matching phase, so a stale value from an earlier workflow is harmless
/// as long as its time precedes the current request.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Observation {
    /// The sample of the interval ending now; `None` when no node reported.
    pub sample: Option<Sample>,
    /// The outcome of the provisioning request in flight, once known.
    pub provision: Option<ProvisionOutcome>,
    /// Since when the leaving node has had no connections, once it has none.
    pub drained_at: Option<Millis>,
    /// When the leaving node was gone from the cloud, once it is.
    pub deprovisioned_at: Option<Millis>,
}

/// A side effect the caller must carry out (durably) for this AZ.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Action {
    /// Create a node in the AZ (attempt number, from 1).
    Provision {
        /// 1 for the first try.
        attempt: u32,
    },
    /// Delete the node whose provisioning failed, before any retry.
    DiscardFailedNode,
    /// The new node is ready: join it to the cluster, sync every vserver to it,
    /// register it with the manager, add its address to the distributor.
    Activate,
    /// Pick the leaving node ([`pick_scale_in_node`]) and remove its address from the
    /// distributor; new connections stop.
    RemoveFromDistributor,
    /// Detach the leaving node from the cluster, deregister and delete it.
    Deprovision,
}

/// A scaling decision taken on an evaluating tick.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Decision {
    /// Add one node.
    ScaleOut,
    /// Remove one node.
    ScaleIn,
}

/// What an event records (the `kind` field of events).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum EventKind {
    /// Scale-out decided and provisioning requested.
    ScaleOut,
    /// The new node joined and is registered with the distributor.
    NodeActive,
    /// The cooldown after a scale-out ended.
    CooldownEnd,
    /// Scale-in decided; the leaving node's address left the distributor.
    ScaleIn,
    /// The DNS TTL wait ended.
    TtlEnd,
    /// The drain ended (connections finished or drain timeout).
    DrainEnd,
    /// Deletion of the leaving node started.
    DeprovisionStart,
    /// The leaving node is gone.
    NodeRemoved,
    /// A provisioning attempt failed; it is retried after a back-off.
    ProvisionFailed,
    /// Provisioning failed too often; the scale-out is given up.
    ScaleOutAbandoned,
}

/// A recorded decision or workflow step. `at` is when it happened, which for waits is
/// the exact end of the wait, not the tick that noticed it.
#[derive(Debug, Clone, PartialEq)]
pub struct Event {
    /// When it happened.
    pub at: Millis,
    /// What happened.
    pub kind: EventKind,
    /// Why, for people.
    pub reason: String,
}

/// The result of one [`step`].
#[derive(Debug, Clone, PartialEq)]
pub struct StepOutput {
    /// What the AZ was doing at `now` (the label of a tick row): `Evaluating` when
    /// statistics were evaluated; otherwise the phase in force once every wait that
    /// ended strictly before `now` has been processed. A wait that ends exactly at
    /// `now` still labels the tick (its end is observed there, and the next step runs
    /// at the next tick, as in golden case G1), and a step taken at `now` itself
    /// (activating a ready node, retrying or requesting a deletion, a deletion
    /// finished at `now`) keeps the label of the phase it leaves. So a tick is never
    /// labelled with a wait that had already ended before it.
    pub phase: PhaseKind,
    /// Whether statistics were evaluated.
    pub evaluated: bool,
    /// The decision of an evaluating tick, if any.
    pub decision: Option<Decision>,
    /// Side effects to carry out, in order.
    pub actions: Vec<Action>,
    /// Events to record, in order.
    pub events: Vec<Event>,
}

/// Provisioning attempts before a scale-out is abandoned.
pub const MAX_PROVISION_ATTEMPTS: u32 = 5;

/// Wait after the `attempt`-th failed provisioning attempt before the next one:
/// 30 s doubling each time (30 s, 1 min, 2 min, 4 min, …), at most 10 min. A pure
/// function of the attempt number so that a resumed daemon computes the same wait.
/// The daemon waits the same schedule between failed resumes of a group (one
/// retry schedule for everything lbscale retries on its own).
pub fn provision_backoff(attempt: u32) -> Duration {
    let base = 30_000u64;
    let cap = 600_000u64;
    let shift = attempt.saturating_sub(1).min(20);
    Duration::from_millis((base << shift).min(cap))
}

/// A node that could leave the AZ on scale-in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CandidateNode {
    /// The node's id.
    pub id: String,
    /// Creation order within the AZ (larger is newer).
    pub created: u64,
    /// Whether this node is the AZ cluster's primary (holds the cluster config).
    pub primary: bool,
}

/// Picks the node that leaves on scale-in: the newest non-primary node (largest
/// `created`; ties broken by the larger id so the choice is deterministic).
///
/// Why the newest: it carries the fewest long-lived connections and the least warm
/// cache, and scaling in undoes the most recent scale-out first. The primary never
/// leaves, because it holds the cluster's configuration. When no node is flagged as
/// primary, the oldest node is treated as the primary. Returns `None` when no node
/// may leave.
pub fn pick_scale_in_node(nodes: &[CandidateNode]) -> Option<&CandidateNode> {
    let implicit_primary = if nodes.iter().any(|n| n.primary) {
        None
    } else {
        nodes
            .iter()
            .min_by(|a, b| a.created.cmp(&b.created).then_with(|| b.id.cmp(&a.id)))
    };
    nodes
        .iter()
        .filter(|n| !n.primary)
        .filter(|n| implicit_primary.is_none_or(|p| !std::ptr::eq(*n, p)))
        .max_by(|a, b| a.created.cmp(&b.created).then_with(|| a.id.cmp(&b.id)))
}

/// Upper bound on internal transitions in one call; each transition either waits or
/// moves forward, so a handful suffices. It guards against a logic error looping.
const MAX_TRANSITIONS: usize = 16;

/// Advances one AZ to `now`. See the module documentation for the rules.
///
/// The caller carries out `actions` and reports their outcome in later observations;
/// when the cloud finishes instantly (simulation with zero provisioning time), the
/// caller may call `step` again at the same `now` with the new observation: a second
/// call never evaluates the same tick twice.
pub fn step(
    cfg: &PolicyConfig,
    state: &AzState,
    obs: &Observation,
    now: Millis,
) -> (AzState, StepOutput) {
    let mut s = *state;
    let mut out = StepOutput {
        phase: s.phase.kind(),
        evaluated: false,
        decision: None,
        actions: Vec::new(),
        events: Vec::new(),
    };
    for _ in 0..MAX_TRANSITIONS {
        // When the transition taken below ends a wait, the instant the wait ended.
        let mut wait_ended: Option<Millis> = None;
        let moved = match s.phase {
            Phase::Evaluating { after } => {
                if after.is_some_and(|a| now <= a) {
                    false
                } else {
                    evaluate(cfg, &mut s, obs.sample.as_ref(), now, &mut out);
                    true
                }
            }
            Phase::Provisioning {
                requested_at,
                attempt,
            } => match obs.provision {
                Some(ProvisionOutcome::Ready { at }) if at >= requested_at && at <= now => {
                    s.serving += 1;
                    out.actions.push(Action::Activate);
                    out.events.push(Event {
                        at: now,
                        kind: EventKind::NodeActive,
                        reason: format!(
                            "new node joined the cluster and the distributor; {} serving",
                            s.serving
                        ),
                    });
                    s.phase = if cfg.cooldown > 0 {
                        Phase::Cooldown {
                            until: now.saturating_add(cfg.cooldown),
                        }
                    } else {
                        Phase::Evaluating { after: Some(now) }
                    };
                    true
                }
                Some(ProvisionOutcome::Failed { at }) if at >= requested_at && at <= now => {
                    wait_ended = Some(at);
                    s.provisioned = s.provisioned.saturating_sub(1);
                    out.actions.push(Action::DiscardFailedNode);
                    if attempt >= MAX_PROVISION_ATTEMPTS {
                        out.events.push(Event {
                            at,
                            kind: EventKind::ScaleOutAbandoned,
                            reason: format!("provisioning failed {attempt} times; giving up"),
                        });
                        s.phase = Phase::Evaluating { after: Some(at) };
                    } else {
                        let wait = provision_backoff(attempt);
                        out.events.push(Event {
                            at,
                            kind: EventKind::ProvisionFailed,
                            reason: format!(
                                "provisioning attempt {attempt} failed; retrying after {}",
                                format_as_seconds(wait)
                            ),
                        });
                        s.phase = Phase::ProvisionBackoff {
                            retry_after: at.saturating_add(ms(wait)),
                            attempt,
                        };
                    }
                    true
                }
                _ => false,
            },
            Phase::ProvisionBackoff {
                retry_after,
                attempt,
            } => {
                if now > retry_after {
                    if s.provisioned < cfg.max_nodes {
                        s.provisioned += 1;
                        out.actions.push(Action::Provision {
                            attempt: attempt + 1,
                        });
                        s.phase = Phase::Provisioning {
                            requested_at: now,
                            attempt: attempt + 1,
                        };
                    } else {
                        // The AZ reached max_nodes meanwhile (e.g. the failed node
                        // is still being discarded): do not retry into an overrun.
                        s.phase = Phase::Evaluating { after: Some(now) };
                    }
                    true
                } else {
                    false
                }
            }
            Phase::Cooldown { until } => {
                if now >= until {
                    wait_ended = Some(until);
                    out.events.push(Event {
                        at: until,
                        kind: EventKind::CooldownEnd,
                        reason: format!(
                            "cooldown of {} ended; evaluation resumes at the next tick",
                            format_as_seconds(Duration::from_millis(cfg.cooldown))
                        ),
                    });
                    s.phase = Phase::Evaluating { after: Some(until) };
                    true
                } else {
                    false
                }
            }
            Phase::Ttl { until } => {
                if now >= until {
                    wait_ended = Some(until);
                    out.events.push(Event {
                        at: until,
                        kind: EventKind::TtlEnd,
                        reason: format!(
                            "DNS TTL of {} waited; resolvers no longer hand out the address",
                            format_as_seconds(Duration::from_millis(cfg.dns_ttl))
                        ),
                    });
                    s.phase = Phase::Draining {
                        since: until,
                        until: until.saturating_add(cfg.drain_timeout),
                    };
                    true
                } else {
                    false
                }
            }
            Phase::Draining { since, until } => {
                let early = obs.drained_at.map(|d| d.max(since)).filter(|d| *d < until);
                let end = early.unwrap_or(until);
                if now >= end {
                    wait_ended = Some(end);
                    let reason = if early.is_some() {
                        "no connections left on the node".to_string()
                    } else {
                        format!(
                            "drain timeout of {} reached",
                            format_as_seconds(Duration::from_millis(cfg.drain_timeout))
                        )
                    };
                    out.events.push(Event {
                        at: end,
                        kind: EventKind::DrainEnd,
                        reason,
                    });
                    s.phase = Phase::DeprovisionDue { after: end };
                    true
                } else {
                    false
                }
            }
            Phase::DeprovisionDue { after } => {
                if now > after {
                    out.actions.push(Action::Deprovision);
                    out.events.push(Event {
                        at: now,
                        kind: EventKind::DeprovisionStart,
                        reason: "detaching, deregistering and deleting the node".to_string(),
                    });
                    s.phase = Phase::Deprovisioning { requested_at: now };
                    true
                } else {
                    false
                }
            }
            Phase::Deprovisioning { requested_at } => match obs.deprovisioned_at {
                Some(gone) if gone >= requested_at && gone <= now => {
                    wait_ended = Some(gone);
                    s.provisioned = s.provisioned.saturating_sub(1);
                    out.events.push(Event {
                        at: gone,
                        kind: EventKind::NodeRemoved,
                        reason: format!("node deleted; {} left in the cloud", s.provisioned),
                    });
                    s.phase = Phase::Evaluating { after: Some(gone) };
                    true
                }
                _ => false,
            },
        };
        if !moved {
            break;
        }
        // A wait that ended before `now` is over at this tick: the tick shows what
        // the AZ went on to do. (An evaluation, once done, keeps its label.)
        if !out.evaluated && wait_ended.is_some_and(|e| e < now) {
            out.phase = s.phase.kind();
        }
    }
    (s, out)
}

/// Evaluates one tick's sample and, when a breach is confirmed, starts the workflow.
fn evaluate(
    cfg: &PolicyConfig,
    s: &mut AzState,
    sample: Option<&Sample>,
    now: Millis,
    out: &mut StepOutput,
) {
    out.phase = PhaseKind::Evaluating;
    out.evaluated = true;
    s.phase = Phase::Evaluating { after: Some(now) };

    match sample {
        None => s.reset_streaks(),
        Some(sample) => {
            let mut all_below = !cfg.thresholds.is_empty();
            for metric in Metric::ALL {
                let i = metric.index();
                match (cfg.thresholds.get(metric), sample.get(metric)) {
                    (Some(band), Some(v)) => {
                        s.out_streak[i] = if v > band.max {
                            s.out_streak[i].saturating_add(1)
                        } else {
                            0
                        };
                        all_below &= v < band.min;
                    }
                    (Some(_), None) => {
                        s.out_streak[i] = 0;
                        all_below = false;
                    }
                    (None, _) => s.out_streak[i] = 0,
                }
            }
            s.in_streak = if all_below {
                s.in_streak.saturating_add(1)
            } else {
                0
            };
        }
    }

    let k = cfg.watch_samples.max(1);
    let decision = if s.provisioned < cfg.min_nodes {
        Some((
            Decision::ScaleOut,
            format!("{} nodes < min_nodes {}", s.provisioned, cfg.min_nodes),
        ))
    } else if s.serving > cfg.max_nodes {
        Some((
            Decision::ScaleIn,
            format!("{} nodes > max_nodes {}", s.serving, cfg.max_nodes),
        ))
    } else if s.provisioned < cfg.max_nodes && s.out_streak.iter().any(|n| *n >= k) {
        let parts: Vec<String> = cfg
            .thresholds
            .enabled()
            .filter(|(m, _)| s.out_streak[m.index()] >= k)
            .map(|(m, band)| {
                format!(
                    "{} {} > {} for {} samples",
                    m.name(),
                    num(sample.and_then(|x| x.get(m)).unwrap_or(f64::NAN)),
                    num(band.max),
                    s.out_streak[m.index()]
                )
            })
            .collect();
        Some((Decision::ScaleOut, parts.join(", ")))
    } else if s.serving > cfg.min_nodes && s.in_streak >= k {
        let parts: Vec<String> = cfg
            .thresholds
            .enabled()
            .map(|(m, band)| {
                format!(
                    "{} {} < {}",
                    m.name(),
                    num(sample.and_then(|x| x.get(m)).unwrap_or(f64::NAN)),
                    num(band.min)
                )
            })
            .collect();
        Some((
            Decision::ScaleIn,
            format!("{} for {} samples", parts.join(", "), s.in_streak),
        ))
    } else {
        None
    };

    let Some((decision, reason)) = decision else {
        return;
    };
    out.decision = Some(decision);
    s.reset_streaks();
    match decision {
        Decision::ScaleOut => {
            s.provisioned += 1;
            out.actions.push(Action::Provision { attempt: 1 });
            out.events.push(Event {
                at: now,
                kind: EventKind::ScaleOut,
                reason,
            });
            s.phase = Phase::Provisioning {
                requested_at: now,
                attempt: 1,
            };
        }
        Decision::ScaleIn => {
            s.serving -= 1;
            out.actions.push(Action::RemoveFromDistributor);
            out.events.push(Event {
                at: now,
                kind: EventKind::ScaleIn,
                reason,
            });
            s.phase = if cfg.distributor == Distributor::Dns && cfg.dns_ttl > 0 {
                Phase::Ttl {
                    until: now.saturating_add(cfg.dns_ttl),
                }
            } else {
                Phase::Draining {
                    since: now,
                    until: now.saturating_add(cfg.drain_timeout),
                }
            };
        }
    }
}

/// Paths helper for callers that validate a policy nested in a larger document.
pub fn prefix_errors(errors: Vec<ConfigError>, prefix: &[PathStep]) -> Vec<ConfigError> {
    errors.into_iter().map(|e| e.under_path(prefix)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> PolicyConfig {
        let mut thresholds = Thresholds::default();
        thresholds.set(
            Metric::Memory,
            Band {
                min: 40.0,
                max: 85.0,
            },
        );
        PolicyConfig {
            min_nodes: 1,
            max_nodes: 4,
            stats_interval: 60_000,
            watch_samples: 3,
            cooldown: 600_000,
            drain_timeout: 600_000,
            distributor: Distributor::Nlb,
            dns_ttl: 60_000,
            thresholds,
        }
    }

    fn mem(v: f64) -> Observation {
        Observation {
            sample: Some(Sample::default().with(Metric::Memory, v)),
            ..Default::default()
        }
    }

    #[test]
    fn second_call_at_same_instant_does_not_evaluate_again() {
        let c = cfg();
        let s0 = AzState::new(1);
        let (s1, o1) = step(&c, &s0, &mem(90.0), 60_000);
        assert!(o1.evaluated);
        assert_eq!(s1.out_streak[Metric::Memory.index()], 1);
        let (s2, o2) = step(&c, &s1, &mem(90.0), 60_000);
        assert!(!o2.evaluated);
        assert_eq!(s2, s1);
    }

    #[test]
    fn missing_metric_breaks_streaks() {
        let c = cfg();
        let mut s = AzState::new(2);
        for (i, obs) in [mem(90.0), mem(90.0), Observation::default(), mem(90.0)]
            .iter()
            .enumerate()
        {
            let (n, o) = step(&c, &s, obs, (i as u64 + 1) * 60_000);
            assert_eq!(o.decision, None);
            s = n;
        }
        assert_eq!(s.out_streak[Metric::Memory.index()], 1);
    }

    #[test]
    fn no_thresholds_never_scale_in() {
        let mut c = cfg();
        c.thresholds = Thresholds::default();
        let mut s = AzState::new(3);
        for i in 1..10 {
            let (n, o) = step(&c, &s, &mem(1.0), i * 60_000);
            assert_eq!(o.decision, None);
            s = n;
        }
        assert_eq!(s.serving, 3);
    }

    #[test]
    fn below_min_nodes_scales_out_without_statistics() {
        let c = PolicyConfig {
            min_nodes: 2,
            ..cfg()
        };
        let (s, o) = step(&c, &AzState::new(1), &Observation::default(), 60_000);
        assert_eq!(o.decision, Some(Decision::ScaleOut));
        assert_eq!(s.provisioned, 2);
        assert_eq!(o.events[0].reason, "1 nodes < min_nodes 2");
    }

    #[test]
    fn breach_at_max_does_not_fire_until_max_is_raised() {
        let c = PolicyConfig {
            max_nodes: 2,
            ..cfg()
        };
        let mut s = AzState::new(2);
        for i in 1..=4 {
            let (n, o) = step(&c, &s, &mem(95.0), i * 60_000);
            assert_eq!(o.decision, None, "tick {i}");
            s = n;
        }
        let raised = PolicyConfig { max_nodes: 3, ..c };
        let (_, o) = step(&raised, &s, &mem(95.0), 5 * 60_000);
        assert_eq!(o.decision, Some(Decision::ScaleOut));
        assert_eq!(o.events[0].reason, "memory 95 > 85 for 5 samples");
    }

    #[test]
    fn failed_provisioning_backs_off_and_gives_up() {
        let c = cfg();
        let mut s = AzState::new(1);
        s.phase = Phase::Provisioning {
            requested_at: 0,
            attempt: 1,
        };
        s.provisioned = 2;
        let failed = |at| Observation {
            provision: Some(ProvisionOutcome::Failed { at }),
            ..Default::default()
        };
        let (n, o) = step(&c, &s, &failed(50_000), 60_000);
        assert_eq!(n.provisioned, 1);
        assert_eq!(
            n.phase,
            Phase::ProvisionBackoff {
                retry_after: 80_000,
                attempt: 1
            }
        );
        assert_eq!(o.events[0].kind, EventKind::ProvisionFailed);
        assert_eq!(o.events[0].at, 50_000);
        let (n2, o2) = step(&c, &n, &Observation::default(), 60_000);
        assert_eq!(n2, n, "a repeated call does not retry twice");
        assert!(o2.actions.is_empty());
        let (n3, o3) = step(&c, &n, &Observation::default(), 120_000);
        assert_eq!(o3.actions, vec![Action::Provision { attempt: 2 }]);
        assert_eq!(n3.provisioned, 2);
        // A failure whose back-off already ended is retried in the same call.
        let (n5, o5) = step(&c, &s, &failed(10_000), 60_000);
        assert_eq!(o5.actions[1], Action::Provision { attempt: 2 });
        assert_eq!(n5.provisioned, 2);
        // The last allowed attempt fails: the scale-out is abandoned.
        let mut last = n3;
        last.phase = Phase::Provisioning {
            requested_at: 0,
            attempt: MAX_PROVISION_ATTEMPTS,
        };
        let (n4, o4) = step(&c, &last, &failed(5_000), 180_000);
        assert_eq!(o4.events[0].kind, EventKind::ScaleOutAbandoned);
        assert_eq!(n4.provisioned, 1);
        assert_eq!(n4.phase.kind(), PhaseKind::Evaluating);
    }

    #[test]
    fn backoff_doubles_and_caps() {
        let secs: Vec<u64> = (1..=7).map(|a| provision_backoff(a).as_secs()).collect();
        assert_eq!(secs, vec![30, 60, 120, 240, 480, 600, 600]);
        assert_eq!(provision_backoff(u32::MAX).as_secs(), 600);
    }

    #[test]
    fn az_state_round_trips_through_json_in_every_phase() {
        for phase in [
            Phase::Evaluating { after: None },
            Phase::Evaluating { after: Some(7) },
            Phase::Provisioning {
                requested_at: 1,
                attempt: 2,
            },
            Phase::ProvisionBackoff {
                retry_after: 3,
                attempt: 4,
            },
            Phase::Cooldown { until: 5 },
            Phase::Ttl { until: 6 },
            Phase::Draining { since: 7, until: 8 },
            Phase::DeprovisionDue { after: 9 },
            Phase::Deprovisioning { requested_at: 10 },
        ] {
            let s = AzState {
                phase,
                serving: 2,
                provisioned: 3,
                out_streak: [1, 0, 2],
                in_streak: 4,
            };
            let json = serde_json::to_string(&s).unwrap();
            assert_eq!(serde_json::from_str::<AzState>(&json).unwrap(), s, "{json}");
        }
    }

    #[test]
    fn early_drain_moves_deprovision_forward() {
        let c = cfg();
        let mut s = AzState::new(1);
        s.phase = Phase::Draining {
            since: 1_200_000,
            until: 1_800_000,
        };
        s.provisioned = 2;
        let obs = Observation {
            drained_at: Some(1_290_000),
            ..Default::default()
        };
        let (n, o) = step(&c, &s, &obs, 1_320_000);
        assert_eq!(o.events[0].kind, EventKind::DrainEnd);
        assert_eq!(o.events[0].at, 1_290_000);
        assert_eq!(o.events[0].reason, "no connections left on the node");
        assert_eq!(o.actions, vec![Action::Deprovision]);
        assert_eq!(
            n.phase,
            Phase::Deprovisioning {
                requested_at: 1_320_000
            }
        );
    }

    fn cand(id: &str, created: u64, primary: bool) -> CandidateNode {
        CandidateNode {
            id: id.into(),
            created,
            primary,
        }
    }

    #[test]
    fn scale_in_picks_newest_non_primary() {
        let nodes = [cand("a", 1, true), cand("c", 3, false), cand("b", 2, false)];
        assert_eq!(pick_scale_in_node(&nodes).unwrap().id, "c");
        // The newest is the primary: the next newest leaves.
        let nodes = [cand("a", 1, false), cand("b", 5, true), cand("c", 3, false)];
        assert_eq!(pick_scale_in_node(&nodes).unwrap().id, "c");
        // Nobody flagged: the oldest is the implicit primary.
        let nodes = [cand("x", 7, false)];
        assert!(pick_scale_in_node(&nodes).is_none());
        let nodes = [cand("x", 7, false), cand("y", 9, false)];
        assert_eq!(pick_scale_in_node(&nodes).unwrap().id, "y");
        assert!(pick_scale_in_node(&[cand("p", 1, true)]).is_none());
    }

    fn spec() -> PolicySpec {
        PolicySpec {
            min_nodes: 1,
            max_nodes: 4,
            initial_nodes: None,
            stats_interval: Duration::from_secs(60),
            watch_time: Duration::from_secs(180),
            cooldown: Duration::from_secs(600),
            drain_timeout: Duration::from_secs(600),
            distributor: "dns".into(),
            dns_ttl: Duration::from_secs(60),
            thresholds: vec![ThresholdSpec {
                metric: "memory".into(),
                min: 40.0,
                max: 85.0,
            }],
        }
    }

    fn first_error(spec: PolicySpec) -> String {
        validate_policy(&spec).unwrap_err()[0].to_string()
    }

    #[test]
    fn validation_names_fields() {
        let (c, initial) = validate_policy(&spec()).unwrap();
        assert_eq!(c.watch_samples, 3);
        assert_eq!(initial, 1);
        assert_eq!(
            first_error(PolicySpec {
                watch_time: Duration::from_secs(90),
                ..spec()
            }),
            "watch_time: must be a positive multiple of stats_interval (60s), got 90s"
        );
        assert_eq!(
            first_error(PolicySpec {
                watch_time: Duration::ZERO,
                ..spec()
            }),
            "watch_time: must be a positive multiple of stats_interval (60s), got 0s"
        );
        assert_eq!(
            first_error(PolicySpec {
                min_nodes: 0,
                ..spec()
            }),
            "min_nodes: must be at least 1, got 0"
        );
        assert_eq!(
            first_error(PolicySpec {
                min_nodes: 3,
                max_nodes: 2,
                ..spec()
            }),
            "max_nodes: must be at least min_nodes (3), got 2"
        );
        assert_eq!(
            first_error(PolicySpec {
                initial_nodes: Some(5),
                ..spec()
            }),
            "initial_nodes: must be between min_nodes (1) and max_nodes (4), got 5"
        );
        assert_eq!(
            first_error(PolicySpec {
                distributor: "alb".into(),
                ..spec()
            }),
            "distributor: must be one of dns, nlb, got \"alb\""
        );
        assert_eq!(
            first_error(PolicySpec {
                stats_interval: Duration::ZERO,
                ..spec()
            }),
            "stats_interval: must be a positive duration, got 0s"
        );
    }

    #[test]
    fn threshold_validation() {
        let t = |metric: &str, min: f64, max: f64| ThresholdSpec {
            metric: metric.into(),
            min,
            max,
        };
        let errs = validate_thresholds(&[
            t("memory", 40.0, 85.0),
            t("cpu", 90.0, 80.0),
            t("memory", 10.0, 20.0),
            t("disk", 1.0, 2.0),
            t("throughput", 100.0, 5000.0),
            t("cpu", 10.0, 120.0),
        ])
        .unwrap_err();
        let msgs: Vec<String> = errs.iter().map(ToString::to_string).collect();
        assert_eq!(
            msgs,
            vec![
                "thresholds[1].min: must be below max (80), got 90",
                "thresholds[2].metric: must name a metric that no other threshold block sets (memory is set by thresholds[0]), got \"memory\"",
                "thresholds[3].metric: must be one of cpu, memory, throughput, got \"disk\"",
                "thresholds[5].max: must be at most 100 (cpu is a percentage), got 120",
            ]
        );
        assert!(validate_thresholds(&[t("throughput", 100.0, 5000.0)]).is_ok());
        assert_eq!(
            validate_threshold(&t("cpu", -1.0, 5.0))
                .unwrap_err()
                .to_string(),
            "min: must be a number, 0 or more, got -1"
        );
    }
}
