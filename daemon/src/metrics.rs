//! What the daemon exposes: Prometheus metrics and the per-group status behind
//! `/v1/groups`. Both are small maps behind a mutex, written by the group tasks
//! and read by the HTTP listener.

use crate::smallmap::SmallMap;
use lbscale_core::policy::PhaseKind;
use serde::Serialize;
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::Mutex;
use std::time::Duration;

#[derive(Default)]
struct Inner {
    /// (group, az) -> state -> nodes; replaced per AZ on every evaluation
    /// (keyed by AZ, so that an update touches its own entry, not every
    /// group's series).
    nodes: BTreeMap<(String, String), SmallMap<String, u64>>,
    /// (group, az) -> the last sample's (metric, value)s.
    samples: BTreeMap<(String, String), [(&'static str, f64); 3]>,
    /// (group, az, action) -> decisions taken.
    decisions: BTreeMap<(String, String, &'static str), u64>,
    /// group -> errors (store, node API, workflow failures).
    errors: BTreeMap<String, u64>,
    /// group -> failed resumes (the reconcile before deciding).
    resume_failures: BTreeMap<String, u64>,
    /// step kind -> (sum of seconds, count).
    workflows: BTreeMap<&'static str, (f64, u64)>,
    /// Evaluations run (all groups).
    evaluations: u64,
    /// How late evaluations started after their group was due.
    lag: LagHistogram,
}

/// Upper bounds (seconds) of the lag histogram's buckets.
const LAG_BUCKETS: [f64; 15] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

#[derive(Default)]
struct LagHistogram {
    /// Per bucket of [`LAG_BUCKETS`] (not cumulative), then the overflow.
    counts: [u64; LAG_BUCKETS.len() + 1],
    sum: f64,
    max: f64,
}

#[derive(Default)]
pub struct Metrics {
    inner: Mutex<Inner>,
}

impl Metrics {
    fn with<T>(&self, f: impl FnOnce(&mut Inner) -> T) -> T {
        f(&mut self.inner.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Replaces the node counts and samples of one AZ of `group`.
    pub fn set_az(
        &self,
        group: &str,
        az: &str,
        nodes: &SmallMap<String, u64>,
        sample: Option<&SampleOut>,
    ) {
        let key = (group.to_string(), az.to_string());
        self.with(|m| {
            if nodes.is_empty() {
                m.nodes.remove(&key);
            } else {
                m.nodes.insert(key.clone(), nodes.clone());
            }
            match sample {
                Some(s) => {
                    m.samples.insert(
                        key,
                        [
                            ("cpu", s.cpu),
                            ("memory", s.memory),
                            ("throughput", s.throughput),
                        ],
                    );
                }
                None => {
                    m.samples.remove(&key);
                }
            }
        })
    }

    pub fn evaluated(&self) {
        self.with(|m| m.evaluations += 1)
    }

    /// An evaluation that started `lag` after its group was due (its requeue).
    pub fn lag(&self, lag: Duration) {
        let s = lag.as_secs_f64();
        self.with(|m| {
            let i = LAG_BUCKETS
                .iter()
                .position(|b| s <= *b)
                .unwrap_or(LAG_BUCKETS.len());
            m.lag.counts[i] += 1;
            m.lag.sum += s;
            m.lag.max = m.lag.max.max(s);
        })
    }

    pub fn decision(&self, group: &str, az: &str, action: &'static str) {
        self.with(|m| {
            *m.decisions
                .entry((group.to_string(), az.to_string(), action))
                .or_default() += 1
        })
    }

    pub fn error(&self, group: &str) {
        self.with(|m| *m.errors.entry(group.to_string()).or_default() += 1)
    }

    pub fn resume_failed(&self, group: &str) {
        self.with(|m| *m.resume_failures.entry(group.to_string()).or_default() += 1)
    }

    pub fn workflow(&self, step: &'static str, took: Duration) {
        self.with(|m| {
            let e = m.workflows.entry(step).or_default();
            e.0 += took.as_secs_f64();
            e.1 += 1;
        })
    }

    /// Drops the series of a group that no longer exists.
    pub fn forget_group(&self, group: &str) {
        self.with(|m| {
            m.nodes.retain(|(g, _), _| g != group);
            m.samples.retain(|(g, _), _| g != group);
            m.decisions.retain(|(g, _, _), _| g != group);
            m.errors.remove(group);
            m.resume_failures.remove(group);
        })
    }

    /// The Prometheus text exposition (format 0.0.4).
    pub fn render(&self) -> String {
        self.with(|m| {
            let mut out = String::new();
            let _ = writeln!(
                out,
                "# HELP lbscale_nodes Nodes of a group's AZ cluster by lifecycle state.\n# TYPE lbscale_nodes gauge"
            );
            for ((g, az), states) in &m.nodes {
                for (state, n) in states {
                    let _ = writeln!(
                        out,
                        "lbscale_nodes{{group=\"{}\",az=\"{}\",state=\"{}\"}} {n}",
                        esc(g),
                        esc(az),
                        esc(state)
                    );
                }
            }
            let _ = writeln!(
                out,
                "# HELP lbscale_sample Last sample of an AZ cluster: mean over its serving nodes (cpu and memory in percent, throughput in Mbps).\n# TYPE lbscale_sample gauge"
            );
            for ((g, az), values) in &m.samples {
                for (metric, v) in values {
                    let _ = writeln!(
                        out,
                        "lbscale_sample{{group=\"{}\",az=\"{}\",metric=\"{metric}\"}} {}",
                        esc(g),
                        esc(az),
                        num(*v)
                    );
                }
            }
            let _ = writeln!(
                out,
                "# HELP lbscale_decisions_total Scaling decisions taken by this daemon.\n# TYPE lbscale_decisions_total counter"
            );
            for ((g, az, action), n) in &m.decisions {
                let _ = writeln!(
                    out,
                    "lbscale_decisions_total{{group=\"{}\",az=\"{}\",action=\"{action}\"}} {n}",
                    esc(g),
                    esc(az)
                );
            }
            let _ = writeln!(
                out,
                "# HELP lbscale_errors_total Errors while evaluating or scaling a group.\n# TYPE lbscale_errors_total counter"
            );
            for (g, n) in &m.errors {
                let _ = writeln!(out, "lbscale_errors_total{{group=\"{}\"}} {n}", esc(g));
            }
            let _ = writeln!(
                out,
                "# HELP lbscale_resume_failures_total Failed resumes of a group's unfinished work (retried after a back-off).\n# TYPE lbscale_resume_failures_total counter"
            );
            for (g, n) in &m.resume_failures {
                let _ = writeln!(
                    out,
                    "lbscale_resume_failures_total{{group=\"{}\"}} {n}",
                    esc(g)
                );
            }
            let _ = writeln!(
                out,
                "# HELP lbscale_workflow_seconds Duration of scaling workflows.\n# TYPE lbscale_workflow_seconds summary"
            );
            for (step, (sum, count)) in &m.workflows {
                let _ = writeln!(
                    out,
                    "lbscale_workflow_seconds_sum{{step=\"{step}\"}} {}\nlbscale_workflow_seconds_count{{step=\"{step}\"}} {count}",
                    num(*sum)
                );
            }
            let _ = writeln!(
                out,
                "# HELP lbscale_evaluations_total Group evaluations run by this daemon.\n# TYPE lbscale_evaluations_total counter\nlbscale_evaluations_total {}",
                m.evaluations
            );
            let _ = writeln!(
                out,
                "# HELP lbscale_evaluation_lag_seconds How late an evaluation started after its group was due (its requeue); a group's first evaluation by this daemon is not counted.\n# TYPE lbscale_evaluation_lag_seconds histogram"
            );
            let mut cumulative = 0;
            for (i, bound) in LAG_BUCKETS.iter().enumerate() {
                cumulative += m.lag.counts[i];
                let _ = writeln!(
                    out,
                    "lbscale_evaluation_lag_seconds_bucket{{le=\"{bound}\"}} {cumulative}"
                );
            }
            cumulative += m.lag.counts[LAG_BUCKETS.len()];
            let _ = writeln!(
                out,
                "lbscale_evaluation_lag_seconds_bucket{{le=\"+Inf\"}} {cumulative}\nlbscale_evaluation_lag_seconds_sum {}\nlbscale_evaluation_lag_seconds_count {cumulative}",
                num(m.lag.sum)
            );
            let _ = writeln!(
                out,
                "# HELP lbscale_evaluation_lag_max_seconds The largest lag since the daemon started.\n# TYPE lbscale_evaluation_lag_max_seconds gauge\nlbscale_evaluation_lag_max_seconds {}",
                num(m.lag.max)
            );
            let _ = writeln!(
                out,
                "# HELP lbscale_store_statements_total Statements this daemon sent to the store (one round trip each on PostgreSQL).\n# TYPE lbscale_store_statements_total counter\nlbscale_store_statements_total {}",
                lbscale_engine::store::Store::statements_sent()
            );
            out
        })
    }
}

fn esc(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

fn num(v: f64) -> String {
    if v.is_finite() {
        format!("{v}")
    } else {
        "NaN".into()
    }
}

/// One AZ's sample: the mean over the serving nodes that answered.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct SampleOut {
    pub cpu: f64,
    pub memory: f64,
    pub throughput: f64,
    /// How many serving nodes answered.
    pub nodes: u32,
}

impl SampleOut {
    pub fn describe(&self) -> String {
        format!(
            "cpu {:.1}%, memory {:.1}%, throughput {:.2} Mbps (mean of {} node(s))",
            self.cpu, self.memory, self.throughput, self.nodes
        )
    }
}

/// One AZ of a group as `/v1/groups` shows it.
#[derive(Debug, Clone, Serialize)]
pub struct AzStatus {
    pub az: String,
    /// What the policy is doing: evaluating, provisioning, cooldown, ttl,
    /// draining, deprovisioning.
    pub phase: PhaseKind,
    /// Nodes registered with the distributor (the policy's count).
    pub serving: u32,
    /// Nodes in the cloud (the policy's count).
    pub provisioned: u32,
    /// Nodes by observed lifecycle state.
    pub nodes: SmallMap<String, u64>,
    pub sample: Option<SampleOut>,
    /// Consecutive scale-out breaching samples, per metric.
    pub out_streak: SmallMap<&'static str, u32>,
    /// Consecutive samples with every metric below its min.
    pub in_streak: u32,
    /// Unix ms when the phase's wait ends (cooldown, provisioning back-off, DNS
    /// TTL, drain timeout); absent when the phase waits for nothing timed.
    pub wait_until_ms: Option<u64>,
    /// Services of the AZ's nodes in slow start, as the nodes reported them: a
    /// node that joined ramps its services against the older nodes, and a service
    /// back UP ramps again.
    pub slow_start: Vec<RampingService>,
    /// Behind an `nlb`: how many nodes each vserver spans, as sized from the CPU
    /// of the nodes that hold it.
    pub vserver_spans: Vec<VserverSpan>,
}

/// One vserver's span in an AZ.
#[derive(Debug, Clone, Serialize)]
pub struct VserverSpan {
    pub vserver: String,
    pub span: u32,
    pub min: u32,
    pub max: u32,
    /// The nodes that held it at this evaluation, the primary first.
    pub holders: Vec<String>,
    /// Their mean CPU, percent (absent when one did not answer).
    pub cpu: Option<f64>,
}

/// A service in slow start on one node.
#[derive(Debug, Clone, Serialize)]
pub struct RampingService {
    pub node: String,
    pub vserver: String,
    pub service: String,
    /// The cap in force, requests (HTTP) or connections per second.
    pub cap_per_second: f64,
    /// What it receives now.
    pub requests_per_second: f64,
}

/// A group's unfinished work that this daemon failed to resume and retries later.
#[derive(Debug, Clone, Serialize)]
pub struct ResumeWait {
    /// Failed resumes in a row.
    pub failures: u32,
    /// Unix ms of the next try.
    pub retry_at_ms: i64,
    /// Why the last one failed.
    pub error: String,
}

/// One group as `/v1/groups` shows it.
#[derive(Debug, Clone, Serialize)]
pub struct GroupStatus {
    pub id: String,
    pub name: String,
    pub min_nodes: i64,
    pub max_nodes: i64,
    pub stats_interval: String,
    /// `self` when this daemon evaluates the group, else the holder that does.
    pub owner: String,
    /// Unix ms of the last evaluation by this daemon.
    pub last_evaluated_ms: Option<i64>,
    /// The workflow running now (`scale_out az1`), if any.
    pub in_flight: Option<String>,
    /// Who held the group's lease at the last tick, when it was skipped for that.
    pub skipped_for: Option<String>,
    pub last_error: Option<String>,
    /// While a failed resume waits for its retry: no AZ is evaluated meanwhile.
    pub resume_backoff: Option<ResumeWait>,
    pub azs: Vec<AzStatus>,
}
