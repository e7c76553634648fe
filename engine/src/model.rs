//! The declared objects (what Terraform and the store hold) and their validation.
//!
//! Validators take the individual values they check, so that the provider can run
//! each rule as soon as its inputs are known at plan time (a value that is still
//! unknown is simply not checked yet). Every finding carries the path of the
//! attribute it is about, so that Terraform points at the right line.

use lbscale_core::duration::parse_duration;
use lbscale_core::error::{ConfigError, PathStep as CorePathStep};
use lbscale_core::policy;
// The types of the specs' typed settings.
pub use lbscale_core::duration::DeclaredDuration;
pub use lbscale_core::policy::Metric;
use serde::{Deserialize, Serialize};
use std::time::Duration;

mod node;
pub use node::{
    check_cidr, node_fields, NodeField, NodeSpec, AWS_MAX_SECURITY_GROUPS, AWS_MAX_USER_TAGS,
};

pub const CLOUDS: &[&str] = &["local", "aws", "azure", "gcp"];
pub const DISTRIBUTOR_MODES: &[&str] = &["dns", "nlb"];
pub const METRICS: &[&str] = &["cpu", "memory", "throughput"];
pub const SERVICE_TYPES: &[&str] = &["HTTP", "TCP", "UDP"];
pub const LB_METHODS: &[&str] = &[
    "ROUNDROBIN",
    "LEASTCONNECTION",
    "LEASTRESPONSETIME",
    "LEASTBANDWIDTH",
    "LEASTPACKETS",
    "LRTM",
    "CUSTOMLOAD",
];
pub const PERSISTENCE: &[&str] = &["NONE", "COOKIE", "SOURCEIP"];
pub const SLOW_START_UNITS: &[&str] = &["PER_SECOND", "PERCENT"];
pub const SCALING_MODES: &[&str] = &["native", "bgp", "native_and_bgp"];

pub const DEFAULT_MEMORY_LIMIT_MB: i64 = 256;

/// The cloud a group or distributor lives in: the name its driver is
/// registered under (see `cloud::Clouds`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CloudName {
    Local,
    Aws,
    Azure,
    Gcp,
}

impl CloudName {
    pub fn as_str(self) -> &'static str {
        match self {
            CloudName::Local => "local",
            CloudName::Aws => "aws",
            CloudName::Azure => "azure",
            CloudName::Gcp => "gcp",
        }
    }
    /// Reads a name of [`CLOUDS`].
    pub fn parse(name: &str) -> Option<CloudName> {
        [
            CloudName::Local,
            CloudName::Aws,
            CloudName::Azure,
            CloudName::Gcp,
        ]
        .into_iter()
        .find(|c| c.as_str() == name)
    }
}

impl std::fmt::Display for CloudName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How a distributor spreads clients over a group's nodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DistributorMode {
    /// Name records, one address per serving node; clients re-resolve after the TTL.
    Dns,
    /// One VIP per AZ in front of the nodes.
    Nlb,
}

impl DistributorMode {
    pub fn as_str(self) -> &'static str {
        match self {
            DistributorMode::Dns => "dns",
            DistributorMode::Nlb => "nlb",
        }
    }
    /// Reads a name of [`DISTRIBUTOR_MODES`].
    pub fn parse(name: &str) -> Option<DistributorMode> {
        [DistributorMode::Dns, DistributorMode::Nlb]
            .into_iter()
            .find(|m| m.as_str() == name)
    }
}

impl std::fmt::Display for DistributorMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DistributorSpec {
    pub name: String,
    pub cloud: CloudName,
    pub mode: DistributorMode,
    pub domain: Option<String>,
    pub ttl: DeclaredDuration,
}

impl DistributorSpec {
    /// How long a resolver may keep an answer: the TTL of a `dns` distributor,
    /// zero for an `nlb` (its VIPs do not change).
    pub fn answer_ttl(&self) -> Duration {
        match self.mode {
            DistributorMode::Dns => self.ttl.get(),
            DistributorMode::Nlb => Duration::ZERO,
        }
    }
}

/// A threshold block, validated.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ThresholdSpec {
    pub metric: Metric,
    pub min: f64,
    pub max: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GroupSpec {
    pub name: String,
    pub cloud: CloudName,
    pub availability_zones: Vec<String>,
    pub traffic_distributor_id: String,
    pub min_nodes: i64,
    pub max_nodes: i64,
    pub stats_interval: DeclaredDuration,
    pub watch_time: DeclaredDuration,
    pub cooldown: DeclaredDuration,
    pub drain_timeout: DeclaredDuration,
    pub thresholds: Vec<ThresholdSpec>,
    /// `None` when the configuration has no `node` block (defaults apply).
    pub node: Option<NodeSpec>,
    pub apply_timeout: DeclaredDuration,
}

impl GroupSpec {
    /// The `node` block, or its defaults when there is none.
    pub fn node_spec(&self) -> NodeSpec {
        self.node.clone().unwrap_or_default()
    }
    pub fn drain_timeout(&self) -> Duration {
        self.drain_timeout.get()
    }
    pub fn apply_timeout(&self) -> Duration {
        self.apply_timeout.get()
    }

    /// The group's scaling policy as core declares one, with the distributor
    /// it publishes through (`None`: an `nlb`-like distributor without a TTL,
    /// as when it is gone). The one conversion from a group to core's policy:
    /// `policy::validate_policy` of it is what the daemon runs.
    pub fn policy_spec(&self, distributor: Option<&DistributorSpec>) -> policy::PolicySpec {
        let mode = distributor.map_or(DistributorMode::Nlb, |d| d.mode);
        policy::PolicySpec {
            min_nodes: u32::try_from(self.min_nodes).unwrap_or(0),
            max_nodes: u32::try_from(self.max_nodes).unwrap_or(0),
            initial_nodes: None,
            stats_interval: self.stats_interval.get(),
            watch_time: self.watch_time.get(),
            cooldown: self.cooldown.get(),
            drain_timeout: self.drain_timeout.get(),
            distributor: mode.as_str().to_string(),
            dns_ttl: distributor.map_or(Duration::ZERO, |d| d.ttl.get()),
            thresholds: self
                .thresholds
                .iter()
                .map(|t| policy::ThresholdSpec {
                    metric: t.metric.name().to_string(),
                    min: t.min,
                    max: t.max,
                })
                .collect(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SeGroupSpec {
    pub name: String,
    pub autoscale_group_id: String,
    pub scaling_mode: String,
    pub min_scaleout_per_vs: i64,
    pub max_scaleout_per_vs: i64,
    pub vs_scalein_timeout: DeclaredDuration,
    pub se_tunnel_mode: i64,
    pub primary_forwarding_cost: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ServiceSpec {
    pub name: String,
    pub address: String,
    pub port: i64,
    pub weight: i64,
    pub enabled: bool,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SlowStartSpec {
    pub new_service_request: i64,
    pub unit: String,
    pub increment_interval: i64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VserverSpec {
    pub name: String,
    pub se_group_id: String,
    pub service_type: String,
    pub port: i64,
    pub lb_method: String,
    pub persistence: String,
    pub services: Vec<ServiceSpec>,
    /// `None` when the configuration has no `slow_start` block.
    pub slow_start: Option<SlowStartSpec>,
    /// At most this many connections (UDP: flows) at once on each node; 0 (a
    /// row stored before the attribute): the node's default.
    #[serde(default)]
    pub max_connections: i64,
    /// UDP: the health check's request datagram in hex; empty: the passive check.
    #[serde(default)]
    pub udp_health_request: String,
}

/// The default of a vserver's `max_connections`, as the node applies it.
pub const DEFAULT_MAX_CONNECTIONS: i64 = 10_000;

/// `udp_health_request`'s bytes: hex digits in pairs (spaces allowed between
/// them); an error says what is wrong.
pub fn udp_health_request_bytes(hex: &str) -> Result<Vec<u8>, String> {
    let digits: Vec<u8> = hex.bytes().filter(|b| !b.is_ascii_whitespace()).collect();
    if digits.len() % 2 != 0 {
        return Err("must be pairs of hex digits (an odd number was given)".into());
    }
    digits
        .chunks(2)
        .map(|p| {
            std::str::from_utf8(p)
                .ok()
                .and_then(|p| u8::from_str_radix(p, 16).ok())
                .ok_or_else(|| {
                    format!(
                        "{:?} is not a pair of hex digits",
                        String::from_utf8_lossy(p)
                    )
                })
        })
        .collect()
}

/// One step of the path to the attribute a finding is about.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PathStep {
    Attr(&'static str),
    Index(usize),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Severity {
    Error,
    Warning,
}

/// A validation finding: which attribute, what is wrong and what is allowed.
#[derive(Debug, Clone, PartialEq)]
pub struct Finding {
    pub severity: Severity,
    pub path: Vec<PathStep>,
    pub summary: String,
    pub detail: String,
}

impl Finding {
    pub fn error(
        path: Vec<PathStep>,
        summary: impl Into<String>,
        detail: impl Into<String>,
    ) -> Self {
        Finding {
            severity: Severity::Error,
            path,
            summary: summary.into(),
            detail: detail.into(),
        }
    }
    pub fn warning(
        path: Vec<PathStep>,
        summary: impl Into<String>,
        detail: impl Into<String>,
    ) -> Self {
        Finding {
            severity: Severity::Warning,
            path,
            summary: summary.into(),
            detail: detail.into(),
        }
    }
}

/// Collects findings; each `check_*` adds what it finds.
#[derive(Debug, Default)]
pub struct Findings(pub Vec<Finding>);

impl Findings {
    pub fn has_errors(&self) -> bool {
        self.0.iter().any(|f| f.severity == Severity::Error)
    }

    /// `value` must be one of `allowed`.
    pub fn one_of(&mut self, path: Vec<PathStep>, field: &str, value: &str, allowed: &[&str]) {
        if !allowed.contains(&value) {
            self.0.push(Finding::error(
                path,
                format!("Invalid {field}"),
                format!(
                    "{field} must be one of {}, got {value:?}.",
                    allowed
                        .iter()
                        .map(|a| format!("\"{a}\""))
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            ));
        }
    }

    /// A duration setting read into its typed form (`None`, with a finding, when
    /// it does not parse).
    pub fn declared_duration(
        &mut self,
        field: &'static str,
        value: &str,
    ) -> Option<DeclaredDuration> {
        self.duration(vec![PathStep::Attr(field)], field, value)?;
        DeclaredDuration::parse(value).ok()
    }

    /// `cloud` read into its typed form.
    pub fn cloud(&mut self, value: &str) -> Option<CloudName> {
        self.one_of(vec![PathStep::Attr("cloud")], "cloud", value, CLOUDS);
        CloudName::parse(value)
    }

    /// A distributor's `mode` read into its typed form.
    pub fn distributor_mode(&mut self, value: &str) -> Option<DistributorMode> {
        self.one_of(
            vec![PathStep::Attr("mode")],
            "mode",
            value,
            DISTRIBUTOR_MODES,
        );
        DistributorMode::parse(value)
    }

    /// Threshold blocks read into their typed form, by core's rules.
    pub fn typed_thresholds(
        &mut self,
        thresholds: &[policy::ThresholdSpec],
    ) -> Option<Vec<ThresholdSpec>> {
        let before = self.0.len();
        self.thresholds(thresholds);
        if self.0[before..]
            .iter()
            .any(|f| f.severity == Severity::Error)
        {
            return None;
        }
        thresholds
            .iter()
            .map(|t| {
                Some(ThresholdSpec {
                    metric: Metric::parse(&t.metric)?,
                    min: t.min,
                    max: t.max,
                })
            })
            .collect()
    }

    /// `value` must be a duration string; returns it when it is.
    pub fn duration(&mut self, path: Vec<PathStep>, field: &str, value: &str) -> Option<Duration> {
        match parse_duration(value) {
            Ok(d) => Some(d),
            Err(e) => {
                self.0.push(Finding::error(
                    path,
                    format!("Invalid {field}"),
                    format!("{field} {e}."),
                ));
                None
            }
        }
    }

    /// `lo <= value <= hi`.
    pub fn range(&mut self, path: Vec<PathStep>, field: &str, value: i64, lo: i64, hi: i64) {
        if value < lo || value > hi {
            self.0.push(Finding::error(
                path,
                format!("Invalid {field}"),
                format!("{field} must be between {lo} and {hi}, got {value}."),
            ));
        }
    }

    /// Thresholds: at least one block, and core's rules for each (known metric,
    /// `min < max`, percent bounds, one block per metric), the same rules that
    /// `lbscale simulate` and the daemon apply.
    pub fn thresholds(&mut self, thresholds: &[policy::ThresholdSpec]) {
        if thresholds.is_empty() {
            self.0.push(Finding::error(
                vec![PathStep::Attr("threshold")],
                "Missing threshold",
                "At least one threshold block is required (metric \"cpu\", \"memory\" or \"throughput\").",
            ));
        }
        if let Err(errors) = policy::validate_thresholds(thresholds) {
            self.0.extend(errors.iter().map(from_core));
        }
    }

    /// `watch_time` must be a positive multiple of `stats_interval` (core's rule).
    pub fn timing(&mut self, stats_interval: &str, watch_time: &str) {
        let si = self.duration(
            vec![PathStep::Attr("stats_interval")],
            "stats_interval",
            stats_interval,
        );
        let wt = self.duration(vec![PathStep::Attr("watch_time")], "watch_time", watch_time);
        if let (Some(si), Some(wt)) = (si, wt) {
            if let Err(e) = policy::validate_timing(si, wt) {
                self.0.push(from_core(&e));
            }
        }
    }

    /// `1 <= min_nodes <= max_nodes <= 64` (core's rule, plus the fleet cap).
    pub fn node_bounds(&mut self, min_nodes: Option<i64>, max_nodes: Option<i64>) {
        if let Some(max) = max_nodes {
            if max > 64 {
                self.0.push(Finding::error(
                    vec![PathStep::Attr("max_nodes")],
                    "Invalid max_nodes",
                    format!("max_nodes: must be at most 64, got {max}."),
                ));
            }
        }
        let (min, max) = match (min_nodes, max_nodes) {
            (Some(min), Some(max)) => (min, max),
            // Only one is known yet: check it against itself.
            (Some(min), None) => (min, min.max(1)),
            (None, Some(max)) => (1, max),
            (None, None) => return,
        };
        match (u32::try_from(min), u32::try_from(max)) {
            (Ok(min), Ok(max)) => {
                if let Err(e) = policy::validate_node_bounds(min, max, None) {
                    self.0.push(from_core(&e));
                }
            }
            // Core's rule takes u32s: a value outside them (a negative one) is
            // refused here in the same words, with the value as written.
            _ if min < 1 => self.0.push(Finding::error(
                vec![PathStep::Attr("min_nodes")],
                "Invalid min_nodes",
                format!("min_nodes: must be at least 1, got {min}."),
            )),
            _ if max < min => self.0.push(Finding::error(
                vec![PathStep::Attr("max_nodes")],
                "Invalid max_nodes",
                format!("max_nodes: must be at least min_nodes ({min}), got {max}."),
            )),
            _ => {}
        }
    }

    /// Availability zones: at least one, no duplicates, no empty names.
    pub fn availability_zones(&mut self, zones: &[String]) {
        if zones.is_empty() {
            self.0.push(Finding::error(
                vec![PathStep::Attr("availability_zones")],
                "Invalid availability_zones",
                "availability_zones must list at least one zone.",
            ));
        }
        for (i, z) in zones.iter().enumerate() {
            if z.is_empty()
                || !z
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
            {
                self.0.push(Finding::error(
                    vec![PathStep::Attr("availability_zones"), PathStep::Index(i)],
                    "Invalid availability zone",
                    format!("an availability zone name uses letters, digits, '-' and '_' only, got {z:?}."),
                ));
            }
            if zones[..i].contains(z) {
                self.0.push(Finding::error(
                    vec![PathStep::Attr("availability_zones"), PathStep::Index(i)],
                    "Duplicate availability zone",
                    format!("availability zone {z:?} is listed more than once."),
                ));
            }
        }
    }

    /// A name that becomes part of process names, files and DNS: 1-63 of `[A-Za-z0-9_-]`.
    pub fn name(&mut self, value: &str) {
        if value.is_empty()
            || value.len() > 63
            || !value
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
        {
            self.0.push(Finding::error(
                vec![PathStep::Attr("name")],
                "Invalid name",
                format!("name must be 1 to 63 letters, digits, '-' or '_', got {value:?}."),
            ));
        }
    }

    /// A DNS domain name.
    pub fn domain(&mut self, value: &str) {
        let ok = !value.is_empty()
            && value.len() <= 253
            && value.trim_end_matches('.').split('.').all(|l| {
                !l.is_empty()
                    && l.len() <= 63
                    && l.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
                    && !l.starts_with('-')
                    && !l.ends_with('-')
            });
        if !ok {
            self.0.push(Finding::error(
                vec![PathStep::Attr("domain")],
                "Invalid domain",
                format!("domain must be a DNS name such as \"app.example.com\", got {value:?}."),
            ));
        }
    }
}

/// A finding from one of core's validators. Core names fields as `lbscale
/// simulate`'s JSON does; Terraform's names differ only for the threshold blocks.
fn from_core(e: &ConfigError) -> Finding {
    let path: Vec<PathStep> = e
        .path
        .iter()
        .map(|step| match step {
            CorePathStep::Field(f) => PathStep::Attr(attribute_name(f)),
            CorePathStep::Index(i) => PathStep::Index(*i),
        })
        .collect();
    let mut text = String::new();
    for step in &path {
        match step {
            PathStep::Attr(a) if text.is_empty() => text.push_str(a),
            PathStep::Attr(a) => text.push_str(&format!(".{a}")),
            PathStep::Index(i) => text.push_str(&format!("[{i}]")),
        }
    }
    let field = path.iter().rev().find_map(|s| match s {
        PathStep::Attr(a) => Some(*a),
        PathStep::Index(_) => None,
    });
    Finding::error(
        path.clone(),
        format!("Invalid {}", field.unwrap_or("configuration")),
        format!("{text}: {}, got {}.", e.allowed, e.got),
    )
}

/// The attribute that a field of core's documents is in Terraform.
fn attribute_name(field: &str) -> &'static str {
    match field {
        "thresholds" => "threshold",
        "metric" => "metric",
        "min" => "min",
        "max" => "max",
        "stats_interval" => "stats_interval",
        "watch_time" => "watch_time",
        "min_nodes" => "min_nodes",
        "max_nodes" => "max_nodes",
        "initial_nodes" => "initial_nodes",
        _ => "configuration",
    }
}

/// COOKIE persistence needs HTTP: the node inserts and reads the cookie in HTTP
/// headers, which a TCP or UDP vserver does not parse. A rule of the vserver
/// alone, so the provider checks it at validate time.
pub fn check_vserver_persistence(findings: &mut Findings, service_type: &str, persistence: &str) {
    if persistence == "COOKIE" && matches!(service_type, "TCP" | "UDP") {
        findings.0.push(Finding::error(
            vec![PathStep::Attr("persistence")],
            "COOKIE persistence on a non-HTTP vserver",
            format!("COOKIE persistence needs an HTTP vserver: a {service_type} vserver has no HTTP headers to carry the cookie. Use SOURCEIP or NONE."),
        ));
    }
}

/// The plan-time rule that ties a vserver to the distributor of its group.
pub fn check_vserver_placement(
    findings: &mut Findings,
    service_type: &str,
    persistence: &str,
    distributor_mode: &str,
    zone_count: usize,
) {
    if service_type == "UDP" && distributor_mode == "nlb" {
        findings.0.push(Finding::error(
            vec![PathStep::Attr("service_type")],
            "UDP vserver behind an nlb distributor",
            "UDP applications need a dns traffic distributor: the group of this vserver's SE group uses an \"nlb\" distributor, which forwards TCP only.",
        ));
    }
    if persistence == "SOURCEIP" && zone_count > 1 {
        findings.0.push(Finding::warning(
            vec![PathStep::Attr("persistence")],
            "SOURCEIP persistence across availability zones",
            format!("This vserver's group spans {zone_count} availability zones; source-IP persistence is kept per AZ cluster and cannot be shared across them. Only COOKIE persistence works across AZ clusters."),
        ));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(metric: &str, min: f64, max: f64) -> policy::ThresholdSpec {
        policy::ThresholdSpec {
            metric: metric.into(),
            min,
            max,
        }
    }

    /// The daemon's policy (from a group's typed settings) is the one that
    /// `lbscale simulate` reads from the same values.
    #[test]
    fn a_groups_policy_is_the_one_simulate_reads() {
        let d = |s: &str| DeclaredDuration::parse(s).unwrap();
        let group = GroupSpec {
            name: "web".into(),
            cloud: CloudName::Local,
            availability_zones: vec!["az1".into()],
            traffic_distributor_id: "td-1".into(),
            min_nodes: 1,
            max_nodes: 3,
            stats_interval: d("2s"),
            watch_time: d("6s"),
            cooldown: d("10s"),
            drain_timeout: d("1m"),
            thresholds: vec![ThresholdSpec {
                metric: Metric::Cpu,
                min: 10.0,
                max: 80.0,
            }],
            node: None,
            apply_timeout: d("5m"),
        };
        let distributor = DistributorSpec {
            name: "d".into(),
            cloud: CloudName::Local,
            mode: DistributorMode::Dns,
            domain: Some("app.example.com".into()),
            ttl: d("5s"),
        };
        let (cfg, _) = policy::validate_policy(&group.policy_spec(Some(&distributor))).unwrap();
        assert_eq!((cfg.stats_interval, cfg.watch_samples), (2_000, 3));
        assert_eq!(
            (cfg.cooldown, cfg.drain_timeout, cfg.dns_ttl),
            (10_000, 60_000, 5_000)
        );
        let doc = serde_json::json!({"group": {
            "availability_zones": ["az1"],
            "min_nodes": 1, "max_nodes": 3, "stats_interval": "2s", "watch_time": "6s",
            "cooldown": "10s", "drain_timeout": "1m", "distributor": "dns", "dns_ttl": "5s",
            "thresholds": [{"metric": "cpu", "min": 10, "max": 80}],
        }, "samples": [], "until": 1});
        let input = lbscale_core::simulate::parse_input(&doc).unwrap();
        assert_eq!(input.policy, cfg);
    }

    /// A stored spec keeps each duration as it was written, and a stored
    /// setting that does not read is an error naming the value, not a default.
    #[test]
    fn typed_settings_round_trip_as_written() {
        let json = r#"{"name":"d","cloud":"aws","mode":"nlb","domain":null,"ttl":"90s"}"#;
        let spec: DistributorSpec = serde_json::from_str(json).unwrap();
        assert_eq!(
            (spec.cloud, spec.mode),
            (CloudName::Aws, DistributorMode::Nlb)
        );
        assert_eq!(spec.ttl.get(), Duration::from_secs(90));
        assert_eq!(serde_json::to_string(&spec).unwrap(), json);
        let bad = json.replace("90s", "soon");
        let e = serde_json::from_str::<DistributorSpec>(&bad).unwrap_err();
        assert!(e.to_string().contains("\"soon\""), "{e}");
        let bad = json.replace("aws", "oracle");
        assert!(serde_json::from_str::<DistributorSpec>(&bad).is_err());
    }

    #[test]
    fn threshold_rules_point_at_the_block() {
        let mut f = Findings::default();
        f.thresholds(&[
            t("cpu", 20.0, 80.0),
            t("memory", 85.0, 40.0),
            t("cpu", 1.0, 2.0),
            t("disk", 1.0, 2.0),
        ]);
        let paths: Vec<_> =
            f.0.iter()
                .map(|x| (x.path.clone(), x.detail.clone()))
                .collect();
        assert!(paths.iter().any(|(p, d)| p[1] == PathStep::Index(1)
            && d.contains("threshold[1].min: must be below max (40), got 85")));
        assert!(paths.iter().any(|(p, d)| p[1] == PathStep::Index(2)
            && d.contains(
                "threshold[2].metric: must name a metric that no other threshold block sets"
            )));
        assert!(paths.iter().any(|(p, d)| p[1] == PathStep::Index(3)
            && d.contains(
                "threshold[3].metric: must be one of cpu, memory, throughput, got \"disk\""
            )));
        assert_eq!(f.0.len(), 3);
    }

    #[test]
    fn node_bounds_show_the_values_as_written() {
        let detail = |min, max| {
            let mut f = Findings::default();
            f.node_bounds(min, max);
            f.0.iter().map(|x| x.detail.clone()).collect::<Vec<_>>()
        };
        assert_eq!(
            detail(Some(-1), Some(4)),
            ["min_nodes: must be at least 1, got -1."]
        );
        assert_eq!(
            detail(Some(0), Some(4)),
            ["min_nodes: must be at least 1, got 0."]
        );
        assert_eq!(
            detail(Some(-3), None),
            ["min_nodes: must be at least 1, got -3."]
        );
        assert_eq!(
            detail(Some(2), Some(-1)),
            ["max_nodes: must be at least min_nodes (2), got -1."]
        );
        assert_eq!(
            detail(Some(5_000_000_000), Some(4)),
            ["max_nodes: must be at least min_nodes (5000000000), got 4."]
        );
        assert_eq!(
            detail(Some(1), Some(5_000_000_000)),
            ["max_nodes: must be at most 64, got 5000000000."]
        );
        assert!(detail(Some(1), Some(4)).is_empty());
    }

    #[test]
    fn watch_time_must_be_a_positive_multiple() {
        let mut f = Findings::default();
        f.timing("1m", "90s");
        assert_eq!(
            f.0[0].detail,
            "watch_time: must be a positive multiple of stats_interval (60s), got 90s."
        );
        let mut ok = Findings::default();
        ok.timing("30s", "2m");
        assert!(ok.0.is_empty());
        let mut zero = Findings::default();
        zero.timing("1m", "0s");
        assert_eq!(zero.0.len(), 1);
    }

    #[test]
    fn placement_rules() {
        let mut f = Findings::default();
        check_vserver_placement(&mut f, "UDP", "SOURCEIP", "nlb", 2);
        assert_eq!(f.0[0].severity, Severity::Error);
        assert!(f.0[0]
            .detail
            .contains("UDP applications need a dns traffic distributor"));
        assert_eq!(f.0[1].severity, Severity::Warning);
        let mut g = Findings::default();
        check_vserver_placement(&mut g, "UDP", "SOURCEIP", "dns", 1);
        assert!(g.0.is_empty());
    }

    #[test]
    fn cookie_persistence_needs_http() {
        for t in ["TCP", "UDP"] {
            let mut f = Findings::default();
            check_vserver_persistence(&mut f, t, "COOKIE");
            assert_eq!(f.0.len(), 1, "{t}");
            assert_eq!(f.0[0].severity, Severity::Error);
            assert_eq!(f.0[0].path, vec![PathStep::Attr("persistence")]);
            assert!(f.0[0]
                .detail
                .starts_with("COOKIE persistence needs an HTTP vserver"));
            assert!(f.0[0].detail.contains(&format!("a {t} vserver")));
        }
        let mut ok = Findings::default();
        check_vserver_persistence(&mut ok, "HTTP", "COOKIE");
        check_vserver_persistence(&mut ok, "TCP", "SOURCEIP");
        check_vserver_persistence(&mut ok, "UDP", "NONE");
        assert!(ok.0.is_empty());
    }
}
