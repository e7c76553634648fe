//! Slow start of a vserver's new services (docs/design.md, "Slow start").
//!
//! A *new* service (just bound, or back UP from DOWN) does not get its full share of
//! the vserver's requests at once: it is capped, and what it does not take goes to the
//! existing services.
//!
//! * **Manual** (`increment_interval = 0`): a new service is held at
//!   `new_service_request` until the operator changes it; setting it to 0 releases
//!   every new service to its full share.
//! * **Automatic**: every interval, measured from the moment the service became new,
//!   its cap grows by one increment: `cap(t) = increment × floor(t / interval)`.
//!   Increments are accumulated as they fall due ([`Ramp::cap`]), so changing
//!   `new_service_request` mid-ramp changes the size of the *next* steps and never
//!   lowers a cap already reached.
//! * `PER_SECOND` caps are requests per second; `PERCENT` caps say which fraction of
//!   one existing service's load the new service takes: with existing weights `wi`
//!   and new services at `pj` %, every service gets `R × eff / Σ eff` with
//!   `eff = w` for existing ones and `w × p/100` for new ones (for round robin with
//!   equal weights: `R / (n + Σ pj/100)` per existing service).
//! * A service leaves slow start (automatic mode) when its cap reaches its full share
//!   (`PER_SECOND`; this also covers "the rate at full share is below the cap" when
//!   the vserver's rate drops), when it reaches 100 % (`PERCENT`), after 200
//!   increments, or after 3 consecutive increment intervals without traffic. Leaving
//!   is final: the service is then an existing one.
//!
//! # Where the leftover goes (LB methods)
//!
//! Round robin hands the leftover out in proportion to weight (evenly with equal
//! weights). For the load-based methods (`LEASTCONNECTION`, `LEASTRESPONSETIME`,
//! `LEASTBANDWIDTH`, `LEASTPACKETS`, `LRTM`, `CUSTOMLOAD`) the model assumes the
//! method converges to equal load per unit of weight among the existing services
//! (identical backends), which is the same split. Real backends that differ in speed
//! would tilt it; the caps themselves, which is what the data plane enforces, do not
//! depend on the method.
//!
//! # A vserver with only new services
//!
//! With no existing service there is nobody to ramp against, and holding the new
//! services back would drop requests: they leave slow start at once and share the
//! load by weight.

use std::collections::BTreeSet;

use serde::ser::SerializeMap;
use serde::{Serialize, Serializer};
use serde_json::Value;

use crate::error::{num, ConfigError};
use crate::jsonin::{as_array, as_object, child, show, Obj};
use crate::policy::Millis;

/// Increments after which a service leaves slow start whatever its cap.
pub const MAX_INCREMENTS: u32 = 200;
/// Consecutive intervals without traffic after which a service leaves slow start.
pub const QUIET_INTERVALS: u32 = 3;
/// The longest increment interval, seconds.
pub const MAX_INCREMENT_INTERVAL: u32 = 3600;

/// LB methods that slow start supports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub enum LbMethod {
    /// `ROUNDROBIN`
    #[serde(rename = "ROUNDROBIN")]
    RoundRobin,
    /// `LEASTCONNECTION`
    #[serde(rename = "LEASTCONNECTION")]
    LeastConnection,
    /// `LEASTRESPONSETIME`
    #[serde(rename = "LEASTRESPONSETIME")]
    LeastResponseTime,
    /// `LEASTBANDWIDTH`
    #[serde(rename = "LEASTBANDWIDTH")]
    LeastBandwidth,
    /// `LEASTPACKETS`
    #[serde(rename = "LEASTPACKETS")]
    LeastPackets,
    /// `LRTM`
    #[serde(rename = "LRTM")]
    Lrtm,
    /// `CUSTOMLOAD`
    #[serde(rename = "CUSTOMLOAD")]
    CustomLoad,
}

const LB_METHODS: [(&str, LbMethod); 7] = [
    ("ROUNDROBIN", LbMethod::RoundRobin),
    ("LEASTCONNECTION", LbMethod::LeastConnection),
    ("LEASTRESPONSETIME", LbMethod::LeastResponseTime),
    ("LEASTBANDWIDTH", LbMethod::LeastBandwidth),
    ("LEASTPACKETS", LbMethod::LeastPackets),
    ("LRTM", LbMethod::Lrtm),
    ("CUSTOMLOAD", LbMethod::CustomLoad),
];

impl LbMethod {
    /// Reads a configuration name.
    pub fn parse(name: &str) -> Option<LbMethod> {
        LB_METHODS.iter().find(|(n, _)| *n == name).map(|(_, m)| *m)
    }
}

/// Unit of `new_service_request`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub enum Unit {
    /// Requests per second.
    #[serde(rename = "PER_SECOND")]
    PerSecond,
    /// Percent of one existing service's load.
    #[serde(rename = "PERCENT")]
    Percent,
}

impl Unit {
    /// Reads a configuration name.
    pub fn parse(name: &str) -> Option<Unit> {
        match name {
            "PER_SECOND" => Some(Unit::PerSecond),
            "PERCENT" => Some(Unit::Percent),
            _ => None,
        }
    }

    /// The configuration name.
    pub fn name(self) -> &'static str {
        match self {
            Unit::PerSecond => "PER_SECOND",
            Unit::Percent => "PERCENT",
        }
    }
}

/// A vserver's slow-start settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlowStartConfig {
    /// Increment (automatic) or held rate (manual); 0 disables slow start.
    pub new_service_request: u32,
    /// Unit of `new_service_request`.
    pub unit: Unit,
    /// Seconds between increments, 0–3600; 0 is manual slow start.
    pub increment_interval: u32,
}

impl SlowStartConfig {
    fn interval_ms(&self) -> Millis {
        u64::from(self.increment_interval) * 1000
    }

    /// Whether caps grow on their own.
    pub fn is_automatic(&self) -> bool {
        self.increment_interval > 0
    }
}

/// Checks the slow-start settings; paths are `new_service_request`, `unit`,
/// `increment_interval`.
pub fn validate_slow_start(
    new_service_request: i64,
    unit: &str,
    increment_interval: i64,
) -> Result<SlowStartConfig, ConfigError> {
    let new_service_request = u32::try_from(new_service_request).map_err(|_| {
        ConfigError::new(
            ["new_service_request"],
            "must be a whole number, 0 or more",
            new_service_request.to_string(),
        )
    })?;
    let unit = Unit::parse(unit).ok_or_else(|| {
        ConfigError::new(
            ["unit"],
            "must be one of PER_SECOND, PERCENT",
            format!("{unit:?}"),
        )
    })?;
    let increment_interval = u32::try_from(increment_interval)
        .ok()
        .filter(|i| *i <= MAX_INCREMENT_INTERVAL)
        .ok_or_else(|| {
            ConfigError::new(
                ["increment_interval"],
                "must be 0-3600 (seconds; 0 is manual slow start)",
                increment_interval.to_string(),
            )
        })?;
    Ok(SlowStartConfig {
        new_service_request,
        unit,
        increment_interval,
    })
}

/// The show/read-back text operators know (golden case G5):
/// `New Service Startup Request Rate: 5 PER_SECOND, Increment Interval: 10`.
pub fn read_back(new_service_request: u32, unit: Unit, increment_interval: u32) -> String {
    format!(
        "New Service Startup Request Rate: {new_service_request} {}, Increment Interval: {increment_interval}",
        unit.name()
    )
}

/// The ramp of a service in slow start.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Ramp {
    /// When the service became new.
    pub since: Millis,
    /// Increments accounted for in `cap` (intervals elapsed since `since`).
    pub steps: u32,
    /// The cap after `steps` increments, in the configured unit.
    pub cap: f64,
    /// Consecutive finished intervals in which the service got no traffic.
    pub quiet_intervals: u32,
    /// Whether the service got traffic in the interval in progress.
    pub traffic_this_interval: bool,
}

impl Ramp {
    /// A ramp starting at `since`, cap 0.
    pub fn new(since: Millis) -> Self {
        Ramp {
            since,
            steps: 0,
            cap: 0.0,
            quiet_intervals: 0,
            traffic_this_interval: false,
        }
    }
}

/// A service bound to the vserver.
#[derive(Debug, Clone, PartialEq)]
pub struct Service {
    /// The service's name.
    pub name: String,
    /// Weight, 1 or more.
    pub weight: u32,
    /// `Some` while the service is in slow start.
    pub ramp: Option<Ramp>,
}

/// A vserver's slow-start state: what the daemon keeps and the node enforces.
#[derive(Debug, Clone, PartialEq)]
pub struct Vserver {
    /// LB method.
    pub lb_method: LbMethod,
    /// Requests per second the vserver receives.
    pub request_rate: f64,
    /// Slow-start settings.
    pub slow_start: SlowStartConfig,
    /// Bound services, in binding order.
    pub services: Vec<Service>,
}

impl Vserver {
    fn weight_sum(&self) -> f64 {
        self.services.iter().map(|s| f64::from(s.weight)).sum()
    }

    fn has_existing(&self) -> bool {
        self.services.iter().any(|s| s.ramp.is_none())
    }

    /// The share of each service without slow start (by weight), req/s.
    pub fn full_shares(&self) -> Vec<f64> {
        let total = self.weight_sum();
        self.services
            .iter()
            .map(|s| {
                if total > 0.0 {
                    self.request_rate * f64::from(s.weight) / total
                } else {
                    0.0
                }
            })
            .collect()
    }

    /// The cap of a ramp at `t` in the configured unit, before limiting to the full
    /// share: the accumulated cap plus the increments due since it was accounted.
    fn raw_cap(&self, ramp: &Ramp, t: Millis) -> f64 {
        let inc = f64::from(self.slow_start.new_service_request);
        if !self.slow_start.is_automatic() {
            return inc;
        }
        let due = steps_at(ramp.since, self.slow_start.interval_ms(), t);
        ramp.cap + inc * f64::from(due.saturating_sub(ramp.steps))
    }

    /// Each service's cap in req/s at `t` (`None`: not in slow start, no cap). This is
    /// what the data plane enforces. Assumes [`Vserver::advance`] has run up to `t`.
    pub fn caps(&self, t: Millis) -> Vec<Option<f64>> {
        let rates = self.rates(t);
        self.services
            .iter()
            .zip(rates)
            .map(|(s, r)| s.ramp.map(|_| r))
            .collect()
    }

    /// The request rate of each service at `t`, req/s; they sum to `request_rate`.
    pub fn rates(&self, t: Millis) -> Vec<f64> {
        let full = self.full_shares();
        if !self.has_existing() || self.slow_start.new_service_request == 0 {
            return full;
        }
        match self.slow_start.unit {
            Unit::PerSecond => {
                let capped: Vec<Option<f64>> = self
                    .services
                    .iter()
                    .zip(&full)
                    .map(|(s, fs)| s.ramp.map(|r| self.raw_cap(&r, t).min(*fs).max(0.0)))
                    .collect();
                let taken: f64 = capped.iter().flatten().sum();
                let existing_weight: f64 = self
                    .services
                    .iter()
                    .filter(|s| s.ramp.is_none())
                    .map(|s| f64::from(s.weight))
                    .sum();
                let leftover = (self.request_rate - taken).max(0.0);
                self.services
                    .iter()
                    .zip(capped)
                    .map(|(s, c)| {
                        c.unwrap_or_else(|| leftover * f64::from(s.weight) / existing_weight)
                    })
                    .collect()
            }
            Unit::Percent => {
                let eff: Vec<f64> = self
                    .services
                    .iter()
                    .map(|s| {
                        let w = f64::from(s.weight);
                        match s.ramp {
                            None => w,
                            Some(r) => w * self.raw_cap(&r, t).clamp(0.0, 100.0) / 100.0,
                        }
                    })
                    .collect();
                let total: f64 = eff.iter().sum();
                eff.iter().map(|e| self.request_rate * e / total).collect()
            }
        }
    }

    /// Binds a service (or brings it back UP) at `t`: it is new from then on, unless
    /// slow start is off.
    pub fn add_service(&mut self, name: &str, weight: u32, t: Millis) {
        let ramp = (self.slow_start.new_service_request > 0).then(|| Ramp::new(t));
        match self.services.iter_mut().find(|s| s.name == name) {
            Some(s) => {
                s.weight = weight;
                s.ramp = ramp;
            }
            None => self.services.push(Service {
                name: name.to_string(),
                weight,
                ramp,
            }),
        }
    }

    /// Records traffic received by the new services since the last call (the rates
    /// they had over a period of positive length); the daemon calls it with the
    /// request counts it observed, the simulator with its own rates.
    pub fn record_traffic(&mut self, got_traffic: &[bool]) {
        for (s, got) in self.services.iter_mut().zip(got_traffic) {
            if let Some(r) = s.ramp.as_mut() {
                r.traffic_this_interval |= *got;
            }
        }
    }

    /// Brings every ramp to `t`: folds the increments that fell due (with the current
    /// `new_service_request`), counts intervals without traffic, and applies the exit
    /// rules. Call it at every increment boundary (see [`Vserver::next_boundary`]) and
    /// after every change, in time order.
    pub fn advance(&mut self, t: Millis) {
        let cfg = self.slow_start;
        if cfg.new_service_request == 0 || !self.has_existing() {
            for s in &mut self.services {
                s.ramp = None;
            }
            return;
        }
        if !cfg.is_automatic() {
            return;
        }
        let full = self.full_shares();
        let interval = cfg.interval_ms();
        let inc = f64::from(cfg.new_service_request);
        for (s, fs) in self.services.iter_mut().zip(full) {
            let Some(r) = s.ramp.as_mut() else { continue };
            let due = steps_at(r.since, interval, t);
            if due > r.steps {
                // Traffic recorded since the last boundary resets the quiet count. When
                // a caller folds several boundaries at once it cannot say which of
                // them had traffic; any traffic counts for all, so that a service
                // that is receiving requests never leaves for being quiet.
                let boundaries = due - r.steps;
                if r.traffic_this_interval {
                    r.quiet_intervals = 0;
                } else {
                    r.quiet_intervals = r.quiet_intervals.saturating_add(boundaries);
                }
                r.traffic_this_interval = false;
                r.cap += inc * f64::from(boundaries);
                r.steps = due;
            }
            let reached = match cfg.unit {
                Unit::PerSecond => r.cap > 0.0 && r.cap >= fs,
                Unit::Percent => r.cap >= 100.0,
            };
            if reached || r.steps >= MAX_INCREMENTS || r.quiet_intervals >= QUIET_INTERVALS {
                s.ramp = None;
            }
        }
        if !self.has_existing() {
            for s in &mut self.services {
                s.ramp = None;
            }
        }
    }

    /// The next increment boundary strictly after `t`, if any service ramps
    /// automatically.
    pub fn next_boundary(&self, t: Millis) -> Option<Millis> {
        let interval = self.slow_start.interval_ms();
        if interval == 0 {
            return None;
        }
        self.services
            .iter()
            .filter_map(|s| s.ramp)
            .map(|r| {
                let k = steps_at(r.since, interval, t) as u64 + 1;
                r.since + k * interval
            })
            .min()
    }

    /// Names of the services in slow start.
    pub fn in_slow_start(&self) -> Vec<String> {
        self.services
            .iter()
            .filter(|s| s.ramp.is_some())
            .map(|s| s.name.clone())
            .collect()
    }
}

/// Whole intervals elapsed from `since` to `t`.
fn steps_at(since: Millis, interval: Millis, t: Millis) -> u32 {
    if interval == 0 || t <= since {
        0
    } else {
        u32::try_from((t - since) / interval).unwrap_or(u32::MAX)
    }
}

/// A change applied during a slow-start simulation.
#[derive(Debug, Clone, PartialEq)]
pub struct Change {
    /// When, ms.
    pub t: Millis,
    /// New `new_service_request`.
    pub new_service_request: Option<u32>,
    /// A service bound (or back UP), with its weight.
    pub add: Option<(String, u32)>,
    /// New vserver request rate.
    pub request_rate: Option<f64>,
}

/// The input of `lbscale slowstart`.
#[derive(Debug, Clone, PartialEq)]
pub struct SlowStartInput {
    /// The vserver at the start (services with a later `added_at` not yet bound).
    pub vserver: Vserver,
    /// Services bound later: (time, name, weight).
    pub later: Vec<(Millis, String, u32)>,
    /// Changes, in time order.
    pub changes: Vec<Change>,
    /// Times to report, in the order given.
    pub at: Vec<Millis>,
}

/// Service rates in binding order; serialises as a JSON object in that order.
#[derive(Debug, Clone, PartialEq)]
pub struct Rates(pub Vec<(String, f64)>);

impl Serialize for Rates {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut map = s.serialize_map(Some(self.0.len()))?;
        for (name, rate) in &self.0 {
            map.serialize_entry(name, rate)?;
        }
        map.end()
    }
}

/// One reported time.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Row {
    /// Seconds.
    pub t: crate::simulate::Secs,
    /// Rate of each bound service, req/s, rounded to 0.001.
    pub rates: Rates,
    /// Services still in slow start.
    pub slow_start: Vec<String>,
}

/// `{"rows": [...]}`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SlowStartOutput {
    /// One row per requested time.
    pub rows: Vec<Row>,
}

fn round3(x: f64) -> f64 {
    let r = (x * 1000.0).round() / 1000.0;
    if r == 0.0 {
        0.0
    } else {
        r
    }
}

fn secs_to_ms(obj: &Obj<'_>, key: &str) -> Result<Millis, ConfigError> {
    let v = obj.required(key)?;
    v.as_f64()
        .filter(|x| x.is_finite() && *x >= 0.0 && *x <= 1e12)
        .map(|x| (x * 1000.0).round() as Millis)
        .ok_or_else(|| {
            ConfigError::new(
                obj.path_of(key),
                "must be a number of seconds, 0 or more",
                show(v),
            )
        })
}

fn weight_of(obj: &Obj<'_>) -> Result<u32, ConfigError> {
    match obj.u32_opt("weight")? {
        None => Ok(1),
        Some(w) if w >= 1 => Ok(w),
        Some(w) => Err(ConfigError::new(
            obj.path_of("weight"),
            "must be at least 1",
            w.to_string(),
        )),
    }
}

fn rate_of(obj: &Obj<'_>, key: &str) -> Result<Option<f64>, ConfigError> {
    match obj.f64_opt(key)? {
        Some(r) if r < 0.0 => Err(ConfigError::new(
            obj.path_of(key),
            "must be a number of requests per second, 0 or more",
            num(r),
        )),
        other => Ok(other),
    }
}

fn nsr_of(obj: &Obj<'_>) -> Result<Option<u32>, ConfigError> {
    let Some(v) = obj.get("new_service_request") else {
        return Ok(None);
    };
    let n = v.as_i64().ok_or_else(|| {
        ConfigError::new(
            obj.path_of("new_service_request"),
            "must be a whole number, 0 or more",
            show(v),
        )
    })?;
    validate_slow_start(n, "PER_SECOND", 0)
        .map(|c| Some(c.new_service_request))
        .map_err(|e| ConfigError {
            path: obj.path_of("new_service_request"),
            ..e
        })
}

/// Reads and validates the JSON input of `lbscale slowstart`.
pub fn parse_input(doc: &Value) -> Result<SlowStartInput, ConfigError> {
    let root = as_object(
        doc,
        Vec::new(),
        &[
            "lb_method",
            "request_rate",
            "slow_start",
            "services",
            "changes",
            "at",
        ],
    )?;
    let method_name = root.str_req("lb_method")?;
    let lb_method = LbMethod::parse(method_name).ok_or_else(|| {
        let names: Vec<&str> = LB_METHODS.iter().map(|(n, _)| *n).collect();
        ConfigError::new(
            root.path_of("lb_method"),
            format!("must be one of {}", names.join(", ")),
            format!("{method_name:?}"),
        )
    })?;
    let request_rate = rate_of(&root, "request_rate")?
        .ok_or_else(|| root.required("request_rate").unwrap_err())?;
    let ss = as_object(
        root.required("slow_start")?,
        root.path_of("slow_start"),
        &["new_service_request", "unit", "increment_interval"],
    )?;
    let nsr = ss.required("new_service_request")?;
    let interval = ss.required("increment_interval")?;
    let as_int = |v: &Value, key: &str| {
        v.as_i64()
            .ok_or_else(|| ConfigError::new(ss.path_of(key), "must be a whole number", show(v)))
    };
    let slow_start = validate_slow_start(
        as_int(nsr, "new_service_request")?,
        ss.str_req("unit")?,
        as_int(interval, "increment_interval")?,
    )
    .map_err(|e| e.under_path(&ss.path))?;

    let mut vserver = Vserver {
        lb_method,
        request_rate,
        slow_start,
        services: Vec::new(),
    };
    let mut later = Vec::new();
    let mut names = BTreeSet::new();
    let spath = root.path_of("services");
    for (i, v) in as_array(root.required("services")?, &spath)?
        .iter()
        .enumerate()
    {
        let s = as_object(v, child(&spath, i), &["name", "added_at", "weight"])?;
        let name = s.str_req("name")?;
        if name.is_empty() || !names.insert(name.to_string()) {
            return Err(ConfigError::new(
                s.path_of("name"),
                "must be a non-empty name not used by another service",
                format!("{name:?}"),
            ));
        }
        let weight = weight_of(&s)?;
        match s.get("added_at") {
            None => vserver.services.push(Service {
                name: name.to_string(),
                weight,
                ramp: None,
            }),
            Some(_) => later.push((secs_to_ms(&s, "added_at")?, name.to_string(), weight)),
        }
    }
    let mut changes = Vec::new();
    let cpath = root.path_of("changes");
    if let Some(v) = root.get("changes") {
        for (i, item) in as_array(v, &cpath)?.iter().enumerate() {
            let c = as_object(
                item,
                child(&cpath, i),
                &["t", "new_service_request", "add", "weight", "request_rate"],
            )?;
            let add = match c.str_opt("add")? {
                Some(name) if !name.is_empty() => Some((name.to_string(), weight_of(&c)?)),
                Some(name) => {
                    return Err(ConfigError::new(
                        c.path_of("add"),
                        "must be a non-empty service name",
                        format!("{name:?}"),
                    ))
                }
                None => None,
            };
            let change = Change {
                t: secs_to_ms(&c, "t")?,
                new_service_request: nsr_of(&c)?,
                add,
                request_rate: rate_of(&c, "request_rate")?,
            };
            if change.new_service_request.is_none()
                && change.add.is_none()
                && change.request_rate.is_none()
            {
                return Err(ConfigError::new(
                    c.path,
                    "must set at least one of new_service_request, add, request_rate",
                    "none",
                ));
            }
            changes.push(change);
        }
    }
    changes.sort_by_key(|c| c.t);
    let mut at = Vec::new();
    let apath = root.path_of("at");
    for (i, v) in as_array(root.required("at")?, &apath)?.iter().enumerate() {
        let t = v
            .as_f64()
            .filter(|x| x.is_finite() && *x >= 0.0 && *x <= 1e9)
            .ok_or_else(|| {
                ConfigError::new(
                    child(&apath, i),
                    "must be a number of seconds, 0 or more",
                    show(v),
                )
            })?;
        at.push((t * 1000.0).round() as Millis);
    }
    Ok(SlowStartInput {
        vserver,
        later,
        changes,
        at,
    })
}

/// Replays the input and reports each service's rate at each requested time.
///
/// The vserver is advanced through every instant where something can change (a
/// change, a service being bound, an increment boundary, a reported time), in order;
/// between two instants every rate is constant, which is how traffic (for the
/// no-traffic exit) is accounted.
pub fn simulate(input: &SlowStartInput) -> SlowStartOutput {
    let mut vs = input.vserver.clone();
    let mut later: Vec<(Millis, String, u32)> = input.later.clone();
    later.sort_by_key(|(t, _, _)| *t);
    let mut sorted_at: Vec<Millis> = input.at.clone();
    sorted_at.sort_unstable();
    sorted_at.dedup();
    let end = sorted_at.last().copied().unwrap_or(0);
    let mut reported: Vec<(Millis, Row)> = Vec::new();

    let mut changes = input.changes.iter().peekable();
    let mut later_iter = later.iter().peekable();
    let mut at_iter = sorted_at.iter().peekable();
    let mut now: Millis = 0;
    let mut first = true;
    loop {
        if !first {
            let candidates = [
                changes.peek().map(|c| c.t),
                later_iter.peek().map(|l| l.0),
                at_iter.peek().map(|t| **t),
                vs.next_boundary(now),
            ];
            let Some(next) = candidates.into_iter().flatten().filter(|t| *t > now).min() else {
                break;
            };
            if next > end {
                break;
            }
            // Traffic over [now, next) at the current rates.
            let got: Vec<bool> = vs.rates(now).iter().map(|r| *r > 0.0).collect();
            vs.record_traffic(&got);
            now = next;
        }
        first = false;
        // Increments due at `now` are taken with the settings in force before any
        // change at the same instant.
        vs.advance(now);
        while let Some((_, name, weight)) = later_iter.next_if(|l| l.0 <= now) {
            vs.add_service(name, *weight, now);
        }
        while let Some(c) = changes.next_if(|c| c.t <= now) {
            if let Some(n) = c.new_service_request {
                vs.slow_start.new_service_request = n;
            }
            if let Some(r) = c.request_rate {
                vs.request_rate = r;
            }
            if let Some((name, weight)) = &c.add {
                vs.add_service(name, *weight, now);
            }
        }
        vs.advance(now);
        if at_iter.next_if(|t| **t == now).is_some() {
            let rates = vs.rates(now);
            reported.push((
                now,
                Row {
                    t: crate::simulate::Secs(now),
                    rates: Rates(
                        vs.services
                            .iter()
                            .zip(rates)
                            .map(|(s, r)| (s.name.clone(), round3(r)))
                            .collect(),
                    ),
                    slow_start: vs.in_slow_start(),
                },
            ));
        }
        if now >= end {
            break;
        }
    }
    let rows = input
        .at
        .iter()
        .filter_map(|t| {
            reported
                .iter()
                .find(|(rt, _)| rt == t)
                .map(|(_, r)| r.clone())
        })
        .collect();
    SlowStartOutput { rows }
}

/// Parses and runs in one go.
pub fn simulate_json(doc: &Value) -> Result<SlowStartOutput, ConfigError> {
    parse_input(doc).map(|i| simulate(&i))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vs(unit: Unit, inc: u32, interval: u32) -> Vserver {
        Vserver {
            lb_method: LbMethod::RoundRobin,
            request_rate: 100.0,
            slow_start: SlowStartConfig {
                new_service_request: inc,
                unit,
                increment_interval: interval,
            },
            services: (1..=4)
                .map(|i| Service {
                    name: format!("Service{i}"),
                    weight: 1,
                    ramp: None,
                })
                .collect(),
        }
    }

    #[test]
    fn changing_the_increment_never_lowers_a_reached_cap() {
        let mut v = vs(Unit::PerSecond, 4, 10);
        v.add_service("Service5", 1, 0);
        v.record_traffic(&[true; 5]);
        v.advance(20_000);
        assert_eq!(v.caps(20_000)[4], Some(8.0));
        v.slow_start.new_service_request = 1;
        v.advance(20_000);
        assert_eq!(v.caps(20_000)[4], Some(8.0));
        v.advance(30_000);
        assert_eq!(v.caps(30_000)[4], Some(9.0));
    }

    #[test]
    fn no_traffic_for_three_intervals_ends_slow_start() {
        // PERCENT, so that no cap reaches a full share first (with PER_SECOND a
        // vserver at 0 req/s ends slow start at the first increment: full share 0 is
        // below the cap).
        let mut v = vs(Unit::Percent, 1, 10);
        v.request_rate = 0.0;
        v.add_service("Service5", 1, 0);
        for t in [10_000, 20_000] {
            v.advance(t);
            assert_eq!(v.in_slow_start(), vec!["Service5".to_string()]);
        }
        v.advance(30_000);
        assert!(v.in_slow_start().is_empty());
    }

    #[test]
    fn per_second_at_zero_rate_ends_at_the_first_increment() {
        let mut v = vs(Unit::PerSecond, 1, 10);
        v.request_rate = 0.0;
        v.add_service("Service5", 1, 0);
        v.advance(0);
        assert_eq!(v.in_slow_start().len(), 1);
        v.advance(10_000);
        assert!(v.in_slow_start().is_empty());
    }

    #[test]
    fn two_hundred_increments_end_slow_start() {
        let mut v = vs(Unit::PerSecond, 1, 1);
        v.request_rate = 1_000_000.0;
        v.add_service("Service5", 1, 0);
        for s in 1..=199u64 {
            v.record_traffic(&[true; 5]);
            v.advance(s * 1000);
        }
        assert_eq!(v.in_slow_start().len(), 1);
        v.record_traffic(&[true; 5]);
        v.advance(200_000);
        assert!(v.in_slow_start().is_empty());
    }

    #[test]
    fn a_drop_in_rate_below_the_cap_ends_slow_start() {
        let mut v = vs(Unit::PerSecond, 4, 10);
        v.add_service("Service5", 1, 0);
        v.record_traffic(&[true; 5]);
        v.advance(30_000);
        assert_eq!(v.caps(30_000)[4], Some(12.0));
        v.request_rate = 50.0; // full share 10 < cap 12
        v.advance(30_000);
        assert!(v.in_slow_start().is_empty());
        assert_eq!(v.rates(30_000), vec![10.0; 5]);
    }

    #[test]
    fn only_new_services_get_full_shares() {
        let mut v = vs(Unit::PerSecond, 4, 10);
        v.services.clear();
        v.add_service("A", 1, 0);
        v.add_service("B", 3, 0);
        v.advance(0);
        assert!(v.in_slow_start().is_empty());
        assert_eq!(v.rates(0), vec![25.0, 75.0]);
    }

    #[test]
    fn weights_split_the_leftover() {
        let mut v = vs(Unit::PerSecond, 10, 0);
        v.services.truncate(2);
        v.services[1].weight = 3;
        v.add_service("New", 1, 0);
        // Held at 10; the other 90 go 1:3.
        assert_eq!(v.rates(0), vec![22.5, 67.5, 10.0]);
    }

    #[test]
    fn validation_messages() {
        assert_eq!(
            validate_slow_start(5, "PER_SECOND", 4000)
                .unwrap_err()
                .to_string(),
            "increment_interval: must be 0-3600 (seconds; 0 is manual slow start), got 4000"
        );
        assert_eq!(
            validate_slow_start(5, "PER_MINUTE", 10)
                .unwrap_err()
                .to_string(),
            "unit: must be one of PER_SECOND, PERCENT, got \"PER_MINUTE\""
        );
        assert_eq!(
            validate_slow_start(-1, "PERCENT", 10)
                .unwrap_err()
                .to_string(),
            "new_service_request: must be a whole number, 0 or more, got -1"
        );
    }
}
