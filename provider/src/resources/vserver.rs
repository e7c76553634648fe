//! `lbscale_vserver`: a VIP:port with a protocol, an LB method, its services
//! (backends) and slow start, placed on the nodes of an SE group's autoscale group.

use super::managed::ManagedObject;
use super::memo::Memo;
use crate::common::*;
use async_trait::async_trait;
use lbscale_engine::model::{
    check_vserver_persistence, udp_health_request_bytes, Finding, Findings, PathStep, ServiceSpec,
    SlowStartSpec, VserverSpec, DEFAULT_MAX_CONNECTIONS, LB_METHODS, PERSISTENCE, SERVICE_TYPES,
    SLOW_START_UNITS,
};
use lbscale_engine::{Engine, EngineError};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use tf_provider::schema::{AttributeType, Block, NestedBlock};
use tf_provider::value::Value;
use tf_provider::{AttributePath, Diagnostics};

pub struct Vserver;

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ServiceBlock {
    pub name: Value<String>,
    pub address: Value<String>,
    pub port: Value<Number>,
    pub weight: Value<Number>,
    pub enabled: Value<bool>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SlowStartBlock {
    pub new_service_request: Value<Number>,
    pub unit: Value<String>,
    pub increment_interval: Value<Number>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct State {
    pub id: Value<String>,
    pub name: Value<String>,
    pub se_group_id: Value<String>,
    pub service_type: Value<String>,
    pub port: Value<Number>,
    pub lb_method: Value<String>,
    pub persistence: Value<String>,
    pub service: Value<Vec<ServiceBlock>>,
    pub slow_start: Value<Vec<SlowStartBlock>>,
    pub vip: Value<BTreeMap<String, String>>,
    pub slow_start_summary: Value<String>,
    pub max_connections: Value<Number>,
    pub udp_health_request: Value<String>,
}

/// The largest `max_connections` a node takes.
const MAX_CONNECTIONS_LIMIT: i64 = 1_000_000;

fn apply_defaults(s: &mut State) {
    default_to(&mut s.lb_method, "LEASTCONNECTION".into());
    default_to(&mut s.persistence, "NONE".into());
    default_to(&mut s.max_connections, DEFAULT_MAX_CONNECTIONS.into());
    default_to(&mut s.udp_health_request, String::new());
    if let Value::Value(services) = &mut s.service {
        for svc in services {
            default_to(&mut svc.weight, 1.into());
            default_to(&mut svc.enabled, true);
        }
    }
    if let Value::Value(ss) = &mut s.slow_start {
        for b in ss {
            default_to(&mut b.new_service_request, 0.into());
            default_to(&mut b.unit, "PER_SECOND".into());
            default_to(&mut b.increment_interval, 0.into());
        }
    }
}

/// The read-back line operators know, e.g.
/// `New Service Startup Request Rate: 5 PER_SECOND, Increment Interval: 10`.
fn summary(s: &State) -> Value<String> {
    let b = match &s.slow_start {
        Value::Unknown => return Value::Unknown,
        Value::Value(v) => v.first().cloned().unwrap_or_default(),
        Value::Null => SlowStartBlock::default(),
    };
    if b.new_service_request.is_unknown()
        || b.unit.is_unknown()
        || b.increment_interval.is_unknown()
    {
        return Value::Unknown;
    }
    Value::Value(format!(
        "New Service Startup Request Rate: {} {}, Increment Interval: {}",
        int(&b.new_service_request).unwrap_or(0),
        known(&b.unit).map(String::as_str).unwrap_or("PER_SECOND"),
        int(&b.increment_interval).unwrap_or(0),
    ))
}

fn state_of(id: String, spec: VserverSpec, vip: BTreeMap<String, String>) -> State {
    let mut s = State {
        id: Value::Value(id),
        name: Value::Value(spec.name),
        se_group_id: Value::Value(spec.se_group_id),
        service_type: Value::Value(spec.service_type),
        port: Value::Value(spec.port.into()),
        lb_method: Value::Value(spec.lb_method),
        persistence: Value::Value(spec.persistence),
        service: Value::Value(
            spec.services
                .into_iter()
                .map(|svc| ServiceBlock {
                    name: Value::Value(svc.name),
                    address: Value::Value(svc.address),
                    port: Value::Value(svc.port.into()),
                    weight: Value::Value(svc.weight.into()),
                    enabled: Value::Value(svc.enabled),
                })
                .collect(),
        ),
        slow_start: Value::Value(
            spec.slow_start
                .into_iter()
                .map(|b| SlowStartBlock {
                    new_service_request: Value::Value(b.new_service_request.into()),
                    unit: Value::Value(b.unit),
                    increment_interval: Value::Value(b.increment_interval.into()),
                })
                .collect(),
        ),
        vip: Value::Value(vip),
        slow_start_summary: Value::Null,
        // A row stored before the attribute holds 0: the node's default.
        max_connections: Value::Value(
            if spec.max_connections > 0 {
                spec.max_connections
            } else {
                DEFAULT_MAX_CONNECTIONS
            }
            .into(),
        ),
        udp_health_request: Value::Value(spec.udp_health_request),
    };
    s.slow_start_summary = summary(&s);
    s
}

/// [`Engine::check_vserver`]'s findings by what they depend on: the SE
/// group (and through it the group and distributor), the service type and
/// the persistence. The vservers of one SE group mostly share all three.
static PLACEMENT: Memo<(String, String, String), Vec<Finding>> = Memo::new();

/// Per SE group, the host of the vserver's VIP in each AZ (the AZ's VIP or
/// the application's domain): the same for every vserver of the SE group.
static VIP_HOSTS: Memo<String, BTreeMap<String, String>> = Memo::new();

/// The engine's rules against the store, checked at plan time once the values they need are known.
fn check_placement(engine: &EngineHandle, diags: &mut Diagnostics, s: &State) -> Option<()> {
    if s.se_group_id.is_unknown() || s.service_type.is_unknown() || s.persistence.is_unknown() {
        return Some(());
    }
    plan_check(engine, diags, "check vserver", |e| {
        let spec = match Vserver::spec_of(s) {
            Ok(spec) => spec,
            Err(findings) => return Ok(findings),
        };
        let key = (
            spec.se_group_id.clone(),
            spec.service_type.clone(),
            spec.persistence.clone(),
        );
        PLACEMENT
            .get_or(key, || e.check_vserver(&spec).map(|f| f.0))
            .map(Findings)
    })
}

/// [`Engine::vserver_vips`], its store reads shared by the SE group's vservers.
fn vips(engine: &Engine, spec: &VserverSpec) -> Result<BTreeMap<String, String>, EngineError> {
    // The engine's map for port 0 gives the hosts: each VIP is `HOST:PORT`.
    let hosts = VIP_HOSTS.get_or(spec.se_group_id.clone(), || {
        let probe = VserverSpec {
            port: 0,
            ..spec.clone()
        };
        Ok::<_, EngineError>(
            engine
                .vserver_vips(&probe)?
                .into_iter()
                .filter_map(|(az, vip)| Some((az, vip.strip_suffix(":0")?.to_string())))
                .collect(),
        )
    })?;
    Ok(hosts
        .into_iter()
        .map(|(az, host)| (az, format!("{host}:{}", spec.port)))
        .collect())
}

#[async_trait]
impl ManagedObject for Vserver {
    type State = State;
    type Spec = VserverSpec;
    const KIND: &'static str = "vserver";

    fn schema() -> Block {
        block(
            "A virtual server: a port with a protocol, an LB method, bound services (backends) and slow start, served by every node of its SE group's autoscale group.",
            vec![
                ("id", id_attr()),
                ("name", required(AttributeType::String, "Name of the vserver; can change in place.")),
                ("se_group_id", required(AttributeType::String, "Id of the `lbscale_se_group` that places this vserver.")),
                ("service_type", required(AttributeType::String, "`HTTP`, `TCP` or `UDP` (UDP needs a `dns` distributor).")),
                ("port", required(AttributeType::Number, "Port the vserver listens on, 1-65535.")),
                ("lb_method", defaulted(AttributeType::String, "`LEASTCONNECTION` (default), `ROUNDROBIN`, `LEASTRESPONSETIME`, `LEASTBANDWIDTH`, `LEASTPACKETS`, `LRTM` or `CUSTOMLOAD`.")),
                ("persistence", defaulted(AttributeType::String, "`NONE` (default), `COOKIE` or `SOURCEIP` (kept per AZ cluster only).")),
                ("max_connections", defaulted(AttributeType::Number, "At most this many client connections (UDP: flows) at once on each node, 1-1000000; past it a TCP or HTTP connection is closed at once and a new UDP flow replaces the least recently used one. Default 10000.")),
                ("udp_health_request", defaulted(AttributeType::String, "UDP vservers: a datagram in hex (e.g. a DNS query) that the health check sends to each service; a service that answers it is UP. Empty (default): the passive check, where a service that leaves what the node relays to it unanswered goes DOWN.")),
                ("vip", computed(AttributeType::Map(Box::new(AttributeType::String)), "Where clients reach the vserver in each AZ: the AZ's VIP (`nlb`) or the application's domain (`dns`), with the port.")),
                ("slow_start_summary", computed(AttributeType::String, "The slow-start settings as operators read them back, e.g. `New Service Startup Request Rate: 5 PER_SECOND, Increment Interval: 10`.")),
            ],
            vec![
                (
                    "service",
                    NestedBlock::List(block(
                        "A backend bound to the vserver.",
                        vec![
                            ("name", required(AttributeType::String, "Name of the service, unique within the vserver.")),
                            ("address", required(AttributeType::String, "Host or IP address of the backend.")),
                            ("port", required(AttributeType::Number, "Port of the backend, 1-65535.")),
                            ("weight", defaulted(AttributeType::Number, "Relative share of the load, 1-100. Default 1.")),
                            ("enabled", defaulted(AttributeType::Bool, "A disabled service gets no traffic. Default true.")),
                        ],
                        vec![],
                    )),
                ),
                (
                    "slow_start",
                    NestedBlock::Optional(block(
                        "How a new service (just bound, or back UP) ramps up.",
                        vec![
                            ("new_service_request", defaulted(AttributeType::Number, "The amount a new service's load grows each step (0 disables slow start). Default 0.")),
                            ("unit", defaulted(AttributeType::String, "`PER_SECOND` (requests per second, default) or `PERCENT` (of an existing service's load).")),
                            ("increment_interval", defaulted(AttributeType::Number, "Seconds between steps, 0-3600; 0 is manual slow start. Default 0.")),
                        ],
                        vec![],
                    )),
                ),
            ],
        )
    }

    fn validate(s: &State) -> Findings {
        let mut f = Findings::default();
        if let Some(n) = known(&s.name) {
            f.name(n);
        }
        if let Some(t) = known(&s.service_type) {
            f.one_of(
                vec![PathStep::Attr("service_type")],
                "service_type",
                t,
                SERVICE_TYPES,
            );
        }
        if let Some(p) = whole_number(&mut f, vec![PathStep::Attr("port")], "port", &s.port) {
            f.range(vec![PathStep::Attr("port")], "port", p, 1, 65535);
        }
        if let Some(m) = known(&s.lb_method) {
            f.one_of(
                vec![PathStep::Attr("lb_method")],
                "lb_method",
                m,
                LB_METHODS,
            );
        }
        if let Some(p) = known(&s.persistence) {
            f.one_of(
                vec![PathStep::Attr("persistence")],
                "persistence",
                p,
                PERSISTENCE,
            );
            if let Some(t) = known(&s.service_type) {
                check_vserver_persistence(&mut f, t, p);
            }
        }
        let at_max = vec![PathStep::Attr("max_connections")];
        if let Some(n) = whole_number(
            &mut f,
            at_max.clone(),
            "max_connections",
            &s.max_connections,
        ) {
            f.range(at_max, "max_connections", n, 1, MAX_CONNECTIONS_LIMIT);
        }
        if let Some(hex) = known(&s.udp_health_request) {
            let at = vec![PathStep::Attr("udp_health_request")];
            if let Err(e) = udp_health_request_bytes(hex) {
                f.0.push(Finding::error(
                    at,
                    "Invalid udp_health_request",
                    format!(
                        "udp_health_request must be hex digits in pairs (spaces allowed): {e}."
                    ),
                ));
            } else if !hex.trim().is_empty() && known(&s.service_type).is_some_and(|t| t != "UDP") {
                f.0.push(Finding::error(
                    at,
                    "udp_health_request on a non-UDP vserver",
                    "udp_health_request applies to vservers of service_type UDP only.",
                ));
            }
        }
        if let Some(services) = known(&s.service) {
            for (i, svc) in services.iter().enumerate() {
                let at = |a| {
                    vec![
                        PathStep::Attr("service"),
                        PathStep::Index(i),
                        PathStep::Attr(a),
                    ]
                };
                if let Some(p) = whole_number(&mut f, at("port"), "service.port", &svc.port) {
                    f.range(at("port"), "service.port", p, 1, 65535);
                }
                if let Some(w) = whole_number(&mut f, at("weight"), "service.weight", &svc.weight) {
                    f.range(at("weight"), "service.weight", w, 1, 100);
                }
                if let Some(a) = known(&svc.address) {
                    if a.is_empty() {
                        f.0.push(Finding::error(
                            at("address"),
                            "Invalid service address",
                            "service.address must be a host name or IP address, got \"\".",
                        ));
                    }
                }
                if let Some(n) = known(&svc.name) {
                    if services[..i].iter().any(|o| known(&o.name) == Some(n)) {
                        f.0.push(Finding::error(at("name"), "Duplicate service name", format!("service names must be unique within a vserver; {n:?} appears more than once.")));
                    }
                }
            }
        }
        if let Some(ss) = known(&s.slow_start) {
            for (i, b) in ss.iter().enumerate() {
                let at = |a| {
                    vec![
                        PathStep::Attr("slow_start"),
                        PathStep::Index(i),
                        PathStep::Attr(a),
                    ]
                };
                let request = "slow_start.new_service_request";
                if let Some(r) = whole_number(
                    &mut f,
                    at("new_service_request"),
                    request,
                    &b.new_service_request,
                ) {
                    if r < 0 {
                        f.0.push(Finding::error(
                            at("new_service_request"),
                            "Invalid new_service_request",
                            format!("slow_start.new_service_request must be 0 or more, got {r}."),
                        ));
                    }
                }
                if let Some(u) = known(&b.unit) {
                    f.one_of(at("unit"), "slow_start.unit", u, SLOW_START_UNITS);
                }
                let interval = "slow_start.increment_interval";
                if let Some(iv) = whole_number(
                    &mut f,
                    at("increment_interval"),
                    interval,
                    &b.increment_interval,
                ) {
                    f.range(at("increment_interval"), interval, iv, 0, 3600);
                }
            }
        }
        f
    }

    fn id(state: &State) -> String {
        string(&state.id)
    }

    fn spec_of(s: &State) -> Result<VserverSpec, Findings> {
        Ok(VserverSpec {
            name: string(&s.name),
            se_group_id: string(&s.se_group_id),
            service_type: string(&s.service_type),
            port: int(&s.port).unwrap_or(0),
            lb_method: string(&s.lb_method),
            persistence: string(&s.persistence),
            services: known(&s.service)
                .map(|v| {
                    v.iter()
                        .map(|svc| ServiceSpec {
                            name: string(&svc.name),
                            address: string(&svc.address),
                            port: int(&svc.port).unwrap_or(0),
                            weight: int(&svc.weight).unwrap_or(1),
                            enabled: known(&svc.enabled).copied().unwrap_or(true),
                        })
                        .collect()
                })
                .unwrap_or_default(),
            slow_start: known(&s.slow_start)
                .and_then(|v| v.first())
                .map(|b| SlowStartSpec {
                    new_service_request: int(&b.new_service_request).unwrap_or(0),
                    unit: known(&b.unit)
                        .cloned()
                        .unwrap_or_else(|| "PER_SECOND".into()),
                    increment_interval: int(&b.increment_interval).unwrap_or(0),
                }),
            max_connections: int(&s.max_connections).unwrap_or(DEFAULT_MAX_CONNECTIONS),
            udp_health_request: string(&s.udp_health_request),
        })
    }

    fn plan_create(engine: &EngineHandle, diags: &mut Diagnostics, s: &mut State) -> Option<()> {
        apply_defaults(s);
        check_placement(engine, diags, s)?;
        s.id = Value::Unknown;
        s.vip = Value::Unknown;
        s.slow_start_summary = summary(s);
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
        if changed(&prior.se_group_id, &s.se_group_id) || changed(&prior.port, &s.port) {
            s.vip = Value::Unknown;
        }
        s.slow_start_summary = summary(s);
        Some(vec![])
    }

    async fn read(engine: &Engine, id: &str) -> Result<Option<State>, EngineError> {
        let Some(row) = engine.vserver(id)? else {
            return Ok(None);
        };
        let vip = vips(engine, &row.spec)?;
        Ok(Some(state_of(row.id, row.spec, vip)))
    }

    fn find(engine: &Engine, name: &str) -> Result<Option<String>, EngineError> {
        Ok(engine.vserver_named(name)?.map(|r| r.id))
    }

    async fn create(engine: &Engine, spec: &VserverSpec) -> Result<String, EngineError> {
        engine.create_vserver(spec).await
    }

    async fn update(engine: &Engine, id: &str, spec: &VserverSpec) -> Result<(), EngineError> {
        engine.update_vserver(id, spec).await
    }

    async fn delete(engine: &Engine, id: &str) -> Result<(), EngineError> {
        engine.delete_vserver(id).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn udp(max: i64, request: &str) -> State {
        State {
            name: Value::Value("dns".into()),
            service_type: Value::Value("UDP".into()),
            port: Value::Value(53.into()),
            max_connections: Value::Value(max.into()),
            udp_health_request: Value::Value(request.into()),
            ..Default::default()
        }
    }

    fn summaries(s: &State) -> Vec<String> {
        Vserver::validate(s)
            .0
            .into_iter()
            .map(|f| f.detail)
            .collect()
    }

    #[test]
    fn max_connections_and_udp_health_request_are_checked() {
        assert!(summaries(&udp(10_000, "1234 0100")).is_empty());
        assert_eq!(
            summaries(&udp(0, "")),
            ["max_connections must be between 1 and 1000000, got 0."]
        );
        let bad = summaries(&udp(1, "12 3"));
        assert!(
            bad[0].starts_with("udp_health_request must be hex digits"),
            "{bad:?}"
        );
        let bad = summaries(&udp(1, "zz"));
        assert!(
            bad[0].contains("\"zz\" is not a pair of hex digits"),
            "{bad:?}"
        );
        let mut tcp = udp(1, "00");
        tcp.service_type = Value::Value("TCP".into());
        assert_eq!(
            summaries(&tcp),
            ["udp_health_request applies to vservers of service_type UDP only."]
        );
    }

    #[test]
    fn a_row_stored_before_max_connections_reads_back_the_default() {
        let spec = Vserver::spec_of(&udp(500, "ab")).unwrap();
        assert_eq!(spec.max_connections, 500);
        assert_eq!(
            udp_health_request_bytes(&spec.udp_health_request),
            Ok(vec![0xab])
        );
        let old: VserverSpec = serde_json::from_value(serde_json::json!({
            "name": "dns", "se_group_id": "seg-1", "service_type": "UDP", "port": 53,
            "lb_method": "ROUNDROBIN", "persistence": "NONE", "services": [],
            "slow_start": null
        }))
        .unwrap();
        let s = state_of("vs-1".into(), old, BTreeMap::new());
        assert_eq!(int(&s.max_connections), Some(DEFAULT_MAX_CONNECTIONS));
        assert_eq!(known(&s.udp_health_request).map(String::as_str), Some(""));
    }
}
