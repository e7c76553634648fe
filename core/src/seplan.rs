//! Service-engine scale-out planning: how many nodes a vserver spans and which share
//! of its connections each one serves.
//!
//! # The native model (golden case G4)
//!
//! Capacities are in units of one node's capacity `C`, loads as fractions of a node's
//! CPU per unit of vserver traffic. With native scale-out every packet crosses the
//! primary: serving a share `s0` itself costs `s0`, forwarding the rest costs
//! `f × (1 − s0)` where `f` is `primary_forwarding_cost`. A secondary serving share
//! `si` costs `si`. The primary equalises CPU:
//!
//! ```text
//! s0 + f (1 − s0) = s   for every secondary,   s0 + (N − 1) s = 1
//! ⇒ s = 1 / (1 + (N − 1)(1 − f)),   capacity = 1 / s = 1 + (N − 1)(1 − f)
//! ```
//!
//! With `f = 0.3` this gives 1, 1.7, 2.4 and 3.1 for 1–4 nodes and shares
//! `[0.032, 0.323, 0.323, 0.323]` for 4 nodes: reference case G4 of
//! docs/design.md and the `lbscale se-plan` example of docs/cli.md. The primary's
//! share cannot go below zero: once `(N − 1) f > 1` (the 5th node at `f = 0.3`) the
//! primary only forwards, its load is `f` per unit of traffic whatever the number of
//! secondaries, and capacity stays at the ceiling `1 / f` (3.33 at `f = 0.3`): the
//! "marginal gain" beyond about 4 nodes. Secondaries then split the traffic evenly.
//!
//! # BGP (ECMP)
//!
//! Every node advertises the VIP and the router spreads flows evenly: capacity `N`,
//! shares `1/N`.
//!
//! # native_and_bgp (this project's model)
//!
//! Routers spread flows over a limited number of equal-cost paths
//! (`ecmp_paths`, default [`DEFAULT_ECMP_PATHS`]). Up to that many nodes advertise the
//! VIP and each acts as a native primary for the nodes beyond it, dealt round-robin
//! (head 1 gets the first extra node, head 2 the next, …). ECMP gives every head the
//! same traffic whatever its group's size, so the weakest group saturates first:
//! capacity = heads × min over groups of the native capacity of that group. Shares are
//! listed group by group, each head first. With `N ≤ ecmp_paths` this is plain BGP.

use serde::Serialize;

use crate::error::{num, ConfigError};
use crate::policy::Millis;

/// The default `primary_forwarding_cost`.
pub const DEFAULT_FORWARDING_COST: f64 = 0.3;
/// The default number of ECMP paths in `native_and_bgp`.
pub const DEFAULT_ECMP_PATHS: u32 = 8;
/// The default `min_scaleout_per_vs`.
pub const DEFAULT_MIN_SCALEOUT: u32 = 1;
/// The default `max_scaleout_per_vs`.
pub const DEFAULT_MAX_SCALEOUT: u32 = 4;
/// The largest scale-out a plan accepts.
pub const MAX_NODES: u32 = 64;
/// The default `vs_scalein_timeout`, ms.
pub const DEFAULT_VS_SCALEIN_TIMEOUT: Millis = 30_000;

/// How a vserver spreads over its nodes (`scaling_mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ScalingMode {
    /// The primary forwards to secondaries.
    Native,
    /// The router spreads flows with ECMP.
    Bgp,
    /// ECMP over a few heads, native scale-out behind each.
    NativeAndBgp,
}

impl ScalingMode {
    /// Reads a configuration name.
    pub fn parse(name: &str) -> Option<ScalingMode> {
        match name {
            "native" => Some(ScalingMode::Native),
            "bgp" => Some(ScalingMode::Bgp),
            "native_and_bgp" => Some(ScalingMode::NativeAndBgp),
            _ => None,
        }
    }

    /// The configuration name.
    pub fn name(self) -> &'static str {
        match self {
            ScalingMode::Native => "native",
            ScalingMode::Bgp => "bgp",
            ScalingMode::NativeAndBgp => "native_and_bgp",
        }
    }
}

/// The parameters of a plan.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PlanParams {
    /// Scaling mode.
    pub mode: ScalingMode,
    /// `primary_forwarding_cost`, 0–1.
    pub forwarding_cost: f64,
    /// ECMP paths (only `native_and_bgp`).
    pub ecmp_paths: u32,
}

impl Default for PlanParams {
    fn default() -> Self {
        PlanParams {
            mode: ScalingMode::Native,
            forwarding_cost: DEFAULT_FORWARDING_COST,
            ecmp_paths: DEFAULT_ECMP_PATHS,
        }
    }
}

/// A vserver spread over `nodes` nodes.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Plan {
    /// Nodes holding the vserver.
    pub nodes: u32,
    /// Scaling mode.
    pub mode: ScalingMode,
    /// Capacity in units of one node's capacity.
    pub capacity: f64,
    /// Share of connections each node serves (primary / heads first); sums to 1.
    pub shares: Vec<f64>,
}

/// Checks `primary_forwarding_cost`: a fraction of the cost of serving a connection.
pub fn validate_forwarding_cost(f: f64) -> Result<f64, ConfigError> {
    if f.is_finite() && (0.0..=1.0).contains(&f) {
        Ok(f)
    } else {
        Err(ConfigError::new(
            ["primary_forwarding_cost"],
            "must be a number from 0 to 1",
            num(f),
        ))
    }
}

/// Checks `1 <= min_scaleout_per_vs <= max_scaleout_per_vs <= 64`.
pub fn validate_scaleout_bounds(min: u32, max: u32) -> Result<(), ConfigError> {
    if !(1..=MAX_NODES).contains(&min) {
        return Err(ConfigError::new(
            ["min_scaleout_per_vs"],
            format!("must be from 1 to {MAX_NODES}"),
            min.to_string(),
        ));
    }
    if max < min || max > MAX_NODES {
        return Err(ConfigError::new(
            ["max_scaleout_per_vs"],
            format!("must be from min_scaleout_per_vs ({min}) to {MAX_NODES}"),
            max.to_string(),
        ));
    }
    Ok(())
}

/// Native shares for `n >= 1` nodes (primary first) and the capacity.
fn native(n: u32, f: f64) -> (f64, Vec<f64>) {
    if n <= 1 {
        return (1.0, vec![1.0]);
    }
    let secondaries = f64::from(n - 1);
    if secondaries * f <= 1.0 {
        let s = 1.0 / (1.0 + secondaries * (1.0 - f));
        let s0 = (1.0 - secondaries * s).max(0.0);
        let mut shares = vec![s0];
        shares.extend(std::iter::repeat_n(s, (n - 1) as usize));
        (1.0 / s, shares)
    } else {
        // The primary only forwards: its load f per unit of traffic caps the vserver.
        let s = 1.0 / secondaries;
        let mut shares = vec![0.0];
        shares.extend(std::iter::repeat_n(s, (n - 1) as usize));
        (1.0 / f.max(s), shares)
    }
}

/// The plan for `nodes >= 1` nodes. `nodes` of 0 is treated as 1.
pub fn plan(params: &PlanParams, nodes: u32) -> Plan {
    let n = nodes.max(1);
    let (capacity, shares) = match params.mode {
        ScalingMode::Native => native(n, params.forwarding_cost),
        ScalingMode::Bgp => (f64::from(n), vec![1.0 / f64::from(n); n as usize]),
        ScalingMode::NativeAndBgp => {
            let heads = n.min(params.ecmp_paths.max(1));
            let mut sizes = vec![1u32; heads as usize];
            for extra in 0..(n - heads) {
                sizes[(extra % heads) as usize] += 1;
            }
            let mut shares = Vec::with_capacity(n as usize);
            let mut weakest = f64::INFINITY;
            for &g in &sizes {
                let (c, s) = native(g, params.forwarding_cost);
                weakest = weakest.min(c);
                shares.extend(s.into_iter().map(|x| x / f64::from(heads)));
            }
            (f64::from(heads) * weakest, shares)
        }
    };
    Plan {
        nodes: n,
        mode: params.mode,
        capacity,
        shares,
    }
}

/// How many nodes a vserver needs for a load.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct NodesNeeded {
    /// Nodes to place the vserver on.
    pub nodes: u32,
    /// Their capacity.
    pub capacity: f64,
    /// Whether even `max_scaleout_per_vs` nodes cannot carry the load.
    pub saturated: bool,
}

/// The fewest nodes in `[min_scaleout, max_scaleout]` whose capacity carries `load`
/// (in units of one node's capacity). When none does, `max_scaleout` nodes, marked
/// saturated: the caller should alert rather than add nodes that bring no gain.
pub fn nodes_for_load(
    params: &PlanParams,
    load: f64,
    min_scaleout: u32,
    max_scaleout: u32,
) -> NodesNeeded {
    let lo = min_scaleout.max(1);
    let hi = max_scaleout.max(lo);
    for n in lo..=hi {
        let c = plan(params, n).capacity;
        if c + 1e-9 >= load {
            return NodesNeeded {
                nodes: n,
                capacity: c,
                saturated: false,
            };
        }
    }
    NodesNeeded {
        nodes: hi,
        capacity: plan(params, hi).capacity,
        saturated: true,
    }
}

/// The CPU utilisation, in percent, at which a vserver's nodes are "out of CPU"
/// when the group sets no `cpu` threshold.
pub const DEFAULT_SPAN_TARGET_CPU: f64 = 80.0;

/// A span shrinks only when the load would fit in fewer nodes at this fraction
/// of the target: a span that just grew does not shrink back at the next sample.
pub const SPAN_SHRINK_MARGIN: f64 = 0.8;

/// How many nodes a vserver should span, from the CPU of the nodes that hold it
/// now (`holders_cpu`, percent, primary first), its current span (which may be
/// more than its holders: an AZ with fewer nodes, or a holder gone) and the
/// utilisation they should stay under (`target_cpu`, percent), within
/// `[min_scaleout, max_scaleout]`.
///
/// The plan's shares equalise CPU across the holders, so their mean utilisation
/// `u` carries `u × capacity(n)` of load (in units of one node's capacity). The
/// span grows to the fewest nodes that carry that load at `target_cpu`, and
/// shrinks only to a span that carries it at [`SPAN_SHRINK_MARGIN`] of it;
/// between the two it stays. No holder measured: the span stays (clamped to the
/// bounds).
pub fn span_for_cpu(
    params: &PlanParams,
    holders_cpu: &[f64],
    current_span: u32,
    target_cpu: f64,
    min_scaleout: u32,
    max_scaleout: u32,
) -> NodesNeeded {
    let lo = min_scaleout.max(1);
    let hi = max_scaleout.max(lo);
    let current = current_span.clamp(lo, hi);
    if holders_cpu.is_empty() || target_cpu.is_nan() || target_cpu <= 0.0 {
        return NodesNeeded {
            nodes: current,
            capacity: plan(params, current).capacity,
            saturated: false,
        };
    }
    let n = holders_cpu.len() as u32;
    let utilisation =
        holders_cpu.iter().map(|c| c.clamp(0.0, 100.0)).sum::<f64>() / 100.0 / n as f64;
    let load = utilisation * plan(params, n).capacity;
    let grow = nodes_for_load(params, load / (target_cpu / 100.0), lo, hi);
    if grow.nodes > current || grow.saturated {
        return grow;
    }
    let shrink = nodes_for_load(
        params,
        load / (SPAN_SHRINK_MARGIN * target_cpu / 100.0),
        lo,
        hi,
    );
    if shrink.nodes < current {
        return shrink;
    }
    NodesNeeded {
        nodes: current,
        capacity: plan(params, current).capacity,
        saturated: false,
    }
}

/// Evaluations in a row that asked to move a span the same way (see
/// [`span_streak_step`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpanStreak {
    /// True while the evaluations ask for more nodes, false for fewer.
    pub grow: bool,
    /// How many evaluations in a row asked to move this way.
    pub count: u32,
    /// Of the spans they asked for, the one closest to the current span: what
    /// every evaluation of the streak agreed on at least.
    pub agreed: u32,
}

/// One evaluation of a span's streak: the span wanted now (from
/// [`span_for_cpu`]) against the current one. A span moves only after
/// `watch_samples` evaluations in a row asked to move it the same way, and then
/// by no more than all of them asked for. The streak counts the direction, not
/// the exact span: a load near a boundary that asks for 2, 3, 2 nodes has asked
/// for growth three times, and gets 2. Returns the streak to keep and, when it
/// completes, the new span.
pub fn span_streak_step(
    streak: Option<SpanStreak>,
    current_span: u32,
    wanted: u32,
    watch_samples: u32,
) -> (Option<SpanStreak>, Option<u32>) {
    if wanted == current_span {
        return (None, None);
    }
    let grow = wanted > current_span;
    let next = match streak {
        Some(s) if s.grow == grow => SpanStreak {
            grow,
            count: s.count + 1,
            agreed: if grow {
                s.agreed.min(wanted)
            } else {
                s.agreed.max(wanted)
            },
        },
        _ => SpanStreak {
            grow,
            count: 1,
            agreed: wanted,
        },
    };
    if next.count >= watch_samples.max(1) {
        (None, Some(next.agreed))
    } else {
        (Some(next), None)
    }
}

/// Where packets of the leaving secondary's remaining flows go once it has closed them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum LatePackets {
    /// To the primary (fewer than three nodes left).
    Primary,
    /// To a node chosen at random among those left (three or more left); the caller
    /// makes the choice, the core has no randomness.
    AnyRemaining,
}

/// The plan for one secondary leaving a vserver.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ScaleInPlan {
    /// Index (in plan order) of the node that leaves: the last secondary, the most
    /// recently added, so that long-lived flows on older nodes are left alone.
    pub leaving: u32,
    /// When it stops receiving new connections.
    pub stop_new_at: Millis,
    /// When its remaining connections are closed (`vs_scalein_timeout` later).
    pub close_remaining_at: Millis,
    /// The plan of the nodes that stay.
    pub after: Plan,
    /// Where later packets of closed flows go.
    pub late_packets: LatePackets,
}

/// Plans a secondary leaving a vserver on `nodes` nodes at `now`. `None` when the
/// vserver has no secondary (one node) or `min_scaleout` forbids going lower.
pub fn plan_secondary_scale_in(
    params: &PlanParams,
    nodes: u32,
    min_scaleout: u32,
    now: Millis,
    vs_scalein_timeout: Millis,
) -> Option<ScaleInPlan> {
    if nodes <= 1 || nodes <= min_scaleout.max(1) {
        return None;
    }
    let left = nodes - 1;
    Some(ScaleInPlan {
        leaving: nodes - 1,
        stop_new_at: now,
        close_remaining_at: now.saturating_add(vs_scalein_timeout),
        after: plan(params, left),
        late_packets: if left >= 3 {
            LatePackets::AnyRemaining
        } else {
            LatePackets::Primary
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn native_at(f: f64) -> PlanParams {
        PlanParams {
            forwarding_cost: f,
            ..PlanParams::default()
        }
    }

    #[test]
    fn beyond_the_ceiling_the_primary_only_forwards() {
        let p = plan(&native_at(0.3), 5);
        assert_eq!(p.shares[0], 0.0);
        assert!((p.capacity - 1.0 / 0.3).abs() < 1e-12);
        assert!((plan(&native_at(0.3), 12).capacity - 1.0 / 0.3).abs() < 1e-12);
    }

    #[test]
    fn free_forwarding_is_linear_and_full_cost_is_flat() {
        assert!((plan(&native_at(0.0), 6).capacity - 6.0).abs() < 1e-12);
        for n in 1..8 {
            assert!((plan(&native_at(1.0), n).capacity - 1.0).abs() < 1e-12);
        }
    }

    #[test]
    fn native_and_bgp_is_bgp_up_to_the_paths_then_native_behind_heads() {
        let p = PlanParams {
            mode: ScalingMode::NativeAndBgp,
            forwarding_cost: 0.3,
            ecmp_paths: 2,
        };
        assert!((plan(&p, 2).capacity - 2.0).abs() < 1e-12);
        // 3 nodes: groups of 2 and 1; ECMP halves traffic, the single head limits.
        assert!((plan(&p, 3).capacity - 2.0).abs() < 1e-12);
        // 4 nodes: two groups of 2, each 1.7.
        assert!((plan(&p, 4).capacity - 3.4).abs() < 1e-12);
        let shares = plan(&p, 4).shares;
        assert!((shares.iter().sum::<f64>() - 1.0).abs() < 1e-12);
        assert!((shares[1] - 0.5 / 1.7).abs() < 1e-12);
    }

    #[test]
    fn a_span_follows_the_cpu_of_its_holders() {
        let native = PlanParams::default();
        // One primary at 95 % of its CPU, target 80 %: load 0.95 needs 1.19
        // nodes' worth at 80 %: two nodes (capacity 1.7).
        let d = span_for_cpu(&native, &[95.0], 1, 80.0, 1, 4);
        assert_eq!((d.nodes, d.saturated), (2, false));
        // Two holders at 50 %: load 0.85 of 1.7; fits in one node at 80 %? 1.06
        // needed: no, stays at 2. At 30 %: load 0.51, one node at 64 % (the
        // shrink margin): 0.80 needed, fits: back to 1.
        assert_eq!(span_for_cpu(&native, &[50.0, 50.0], 2, 80.0, 1, 4).nodes, 2);
        assert_eq!(span_for_cpu(&native, &[30.0, 30.0], 2, 80.0, 1, 4).nodes, 1);
        // Between the grow and the shrink points the span holds: 45 % on one node
        // is below 80 %, 2 nodes at 45 % carry 0.765, one node would be at 76 %,
        // above the 64 % margin: stays at 2.
        assert_eq!(span_for_cpu(&native, &[45.0, 45.0], 2, 80.0, 1, 4).nodes, 2);
        // Bounds: never under min, never over max; saturated when max is not enough.
        assert_eq!(span_for_cpu(&native, &[1.0], 1, 80.0, 2, 4).nodes, 2);
        let full = span_for_cpu(&native, &[100.0, 100.0, 100.0, 100.0], 4, 80.0, 1, 4);
        assert_eq!((full.nodes, full.saturated), (4, true));
        // Nothing measured: the span stays as it is.
        assert_eq!(span_for_cpu(&native, &[], 1, 80.0, 1, 4).nodes, 1);
        // bgp scales linearly: 3 holders at 100 % -> 3.75 nodes at 80 % -> 4.
        let bgp = PlanParams {
            mode: ScalingMode::Bgp,
            ..PlanParams::default()
        };
        assert_eq!(
            span_for_cpu(&bgp, &[100.0, 100.0, 100.0], 3, 80.0, 1, 8).nodes,
            4
        );
        // A span of 4 held by the AZ's only 2 nodes, both at 95 %: load 1.6,
        // which 3 nodes would carry at 80 % but only 4 at the shrink margin:
        // it stays at 4 (it is not sized down to the 2 holders).
        assert_eq!(span_for_cpu(&native, &[95.0, 95.0], 4, 80.0, 1, 4).nodes, 4);
        // Idle, it shrinks to what carries the load.
        assert_eq!(span_for_cpu(&native, &[1.0, 1.0], 4, 80.0, 1, 4).nodes, 1);
    }

    #[test]
    fn a_span_moves_after_a_streak_in_one_direction_by_what_all_asked() {
        // Asked for 3, 2, 4 nodes from a span of 1 over 3 samples: it grows to
        // 2, the least every evaluation asked for.
        let (s, moved) = span_streak_step(None, 1, 3, 3);
        assert_eq!(moved, None);
        let (s, moved) = span_streak_step(s, 1, 2, 3);
        assert_eq!(moved, None);
        let (s, moved) = span_streak_step(s, 1, 4, 3);
        assert_eq!((s, moved), (None, Some(2)));
        // A sample that asks for the current span breaks the streak.
        let (s, _) = span_streak_step(None, 2, 3, 2);
        let (s, moved) = span_streak_step(s, 2, 2, 2);
        assert_eq!((s, moved), (None, None));
        let (_, moved) = span_streak_step(s, 2, 3, 2);
        assert_eq!(moved, None, "the streak started again");
        // A change of direction starts a new streak.
        let (s, _) = span_streak_step(None, 2, 3, 2);
        let (s, moved) = span_streak_step(s, 2, 1, 2);
        assert_eq!(moved, None);
        assert_eq!(s.map(|s| (s.grow, s.count)), Some((false, 1)));
        // Shrinking keeps the largest span asked for.
        let (s, _) = span_streak_step(None, 4, 1, 2);
        let (_, moved) = span_streak_step(s, 4, 3, 2);
        assert_eq!(moved, Some(3));
        // watch_samples 0 or 1: the first evaluation moves it.
        assert_eq!(span_streak_step(None, 1, 2, 0).1, Some(2));
    }

    #[test]
    fn nodes_for_load_stays_within_bounds() {
        let p = native_at(0.3);
        let need = nodes_for_load(&p, 2.0, 1, 4);
        assert_eq!((need.nodes, need.saturated), (3, false));
        let need = nodes_for_load(&p, 0.5, 2, 4);
        assert_eq!((need.nodes, need.saturated), (2, false));
        let need = nodes_for_load(&p, 3.2, 1, 4);
        assert_eq!((need.nodes, need.saturated), (4, true));
        assert!((need.capacity - 3.1).abs() < 1e-9);
        let bgp = PlanParams {
            mode: ScalingMode::Bgp,
            ..p
        };
        assert_eq!(nodes_for_load(&bgp, 3.2, 1, 4).nodes, 4);
        assert!(!nodes_for_load(&bgp, 3.2, 1, 4).saturated);
    }

    #[test]
    fn secondary_scale_in_plan() {
        let p = native_at(0.3);
        let plan4 = plan_secondary_scale_in(&p, 4, 1, 1_000, 30_000).unwrap();
        assert_eq!(plan4.leaving, 3);
        assert_eq!(plan4.close_remaining_at, 31_000);
        assert_eq!(plan4.after.nodes, 3);
        assert_eq!(plan4.late_packets, LatePackets::AnyRemaining);
        let plan3 = plan_secondary_scale_in(&p, 3, 1, 0, 30_000).unwrap();
        assert_eq!(plan3.late_packets, LatePackets::Primary);
        assert!(plan_secondary_scale_in(&p, 1, 1, 0, 30_000).is_none());
        assert!(plan_secondary_scale_in(&p, 2, 2, 0, 30_000).is_none());
    }

    #[test]
    fn validation_messages() {
        assert_eq!(
            validate_forwarding_cost(1.5).unwrap_err().to_string(),
            "primary_forwarding_cost: must be a number from 0 to 1, got 1.5"
        );
        assert_eq!(
            validate_scaleout_bounds(3, 2).unwrap_err().to_string(),
            "max_scaleout_per_vs: must be from min_scaleout_per_vs (3) to 64, got 2"
        );
        assert!(validate_scaleout_bounds(1, 4).is_ok());
    }
}
