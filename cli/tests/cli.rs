//! Runs the built `lbscale` binary as an operator would: JSON in, JSON out, and on
//! invalid input exit status 2 with one `error: <path>: ...` line on standard error.

use std::io::Write;
use std::process::{Command, Output, Stdio};

use serde_json::{json, Value};

fn data(name: &str) -> String {
    format!("{}/../core/tests/data/{name}", env!("CARGO_MANIFEST_DIR"))
}

fn lbscale(args: &[&str], stdin: Option<&str>) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_lbscale"))
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    {
        let mut input = child.stdin.take().unwrap();
        if let Some(text) = stdin {
            input.write_all(text.as_bytes()).unwrap();
        }
    }
    child.wait_with_output().unwrap()
}

fn ok_json(out: &Output) -> Value {
    assert!(
        out.status.success(),
        "status {:?}, stderr {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.stderr.is_empty());
    serde_json::from_slice(&out.stdout).unwrap()
}

/// Asserts exit 2 and exactly one line on stderr, and returns it.
fn error_line(out: &Output) -> String {
    assert_eq!(
        out.status.code(),
        Some(2),
        "stdout {}",
        String::from_utf8_lossy(&out.stdout)
    );
    assert!(out.stdout.is_empty());
    let err = String::from_utf8(out.stderr.clone()).unwrap();
    assert_eq!(err.lines().count(), 1, "{err:?}");
    assert!(err.ends_with('\n'));
    err.trim_end().to_string()
}

fn g1_doc(distributor: &str) -> Value {
    let text = std::fs::read_to_string(data(&format!("g1_{distributor}.json"))).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn simulate_stdin(doc: &Value) -> Output {
    lbscale(&["simulate", "-"], Some(&doc.to_string()))
}

#[test]
fn simulate_g1_dns_from_a_file() {
    let out = ok_json(&lbscale(&["simulate", &data("g1_dns.json")], None));
    let ticks = out["ticks"].as_array().unwrap();
    assert_eq!(ticks.len(), 33);
    assert_eq!(
        ticks[5],
        json!({"t": 360, "az": "az1", "phase": "evaluating", "serving": 2, "provisioned": 2, "action": "scale_out"})
    );
    assert_eq!(ticks[20]["phase"], "ttl");
    assert_eq!(ticks[31]["phase"], "deprovisioning");
    assert_eq!(ticks[32]["phase"], "evaluating");
    let kinds: Vec<&str> = out["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["kind"].as_str().unwrap())
        .collect();
    assert_eq!(
        kinds,
        [
            "scale_out",
            "node_active",
            "cooldown_end",
            "scale_in",
            "ttl_end",
            "drain_end",
            "deprovision_start",
            "node_removed"
        ]
    );
    assert_eq!(out["events"][0]["t"], 360);
    assert_eq!(out["events"][0]["az"], "az1");
}

#[test]
fn simulate_g1_nlb_from_stdin() {
    let out = ok_json(&simulate_stdin(&g1_doc("nlb")));
    let ticks = out["ticks"].as_array().unwrap();
    assert_eq!(ticks[30]["phase"], "deprovisioning");
    assert_eq!(ticks[30]["provisioned"], 1);
    assert_eq!(ticks[31]["phase"], "evaluating");
}

#[test]
fn simulate_output_uses_cli_md_layout() {
    let out = lbscale(&["simulate", &data("g1_nlb.json")], None);
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.starts_with(
        "{\"ticks\": [{\"t\": 60, \"az\": \"az1\", \"phase\": \"evaluating\", \"serving\": 1, \"provisioned\": 1, \"action\": null}"
    ), "{text}");
    assert_eq!(text.lines().count(), 1);
}

#[test]
fn simulate_two_azs_decide_independently() {
    let mut doc = g1_doc("nlb");
    doc["group"]["availability_zones"] = json!(["az1", "az2"]);
    doc["until"] = json!(240);
    let out = ok_json(&simulate_stdin(&doc));
    let ticks = out["ticks"].as_array().unwrap();
    assert_eq!(ticks.len(), 8);
    assert_eq!(ticks[0]["az"], "az1");
    assert_eq!(ticks[1]["az"], "az2");
    // az2 has no samples: evaluated, nothing fires.
    assert!(ticks.iter().all(|t| t["action"].is_null()));
}

#[test]
fn simulate_refuses_bad_watch_time_like_cli_md() {
    let mut doc = g1_doc("dns");
    doc["group"]["watch_time"] = json!("90s");
    assert_eq!(
        error_line(&simulate_stdin(&doc)),
        "error: group.watch_time: must be a positive multiple of stats_interval (60s), got 90s"
    );
}

#[test]
fn simulate_errors_name_the_field() {
    let cases: Vec<(&str, Value, &str)> = vec![
        ("/group/thresholds/0/min", json!(90), "error: group.thresholds[0].min: must be below max (85), got 90"),
        ("/group/thresholds/0/metric", json!("disk"), "error: group.thresholds[0].metric: must be one of cpu, memory, throughput, got \"disk\""),
        ("/group/min_nodes", json!(0), "error: group.min_nodes: must be at least 1, got 0"),
        ("/group/max_nodes", json!(0), "error: group.max_nodes: must be at least min_nodes (1), got 0"),
        ("/group/initial_nodes", json!(9), "error: group.initial_nodes: must be between min_nodes (1) and max_nodes (4), got 9"),
        ("/group/distributor", json!("alb"), "error: group.distributor: must be one of dns, nlb, got \"alb\""),
        ("/group/cooldown", json!("ten minutes"), "error: group.cooldown: must be a duration such as \"30s\", \"2m\" or \"1h30m\", or a whole number of seconds, got \"ten minutes\""),
        ("/group/min_nodes", json!(-1), "error: group.min_nodes: must be a whole number from 0 to 4294967295, got -1"),
        ("/samples/2/t", json!(90), "error: samples[2].t: must be a positive multiple of stats_interval (60s), got 90"),
        ("/samples/2/az", json!("az9"), "error: samples[2].az: must be one of the group's availability_zones (az1), got \"az9\""),
        ("/samples/2/memory", json!("high"), "error: samples[2].memory: must be a number, got \"high\""),
    ];
    for (pointer, value, expected) in cases {
        let mut doc = g1_doc("dns");
        *doc.pointer_mut(pointer).unwrap() = value;
        assert_eq!(error_line(&simulate_stdin(&doc)), expected, "{pointer}");
    }
}

#[test]
fn simulate_refuses_duplicate_metric_block_and_unknown_fields() {
    let mut doc = g1_doc("dns");
    doc["group"]["thresholds"] = json!([
        {"metric": "memory", "min": 40, "max": 85},
        {"metric": "memory", "min": 10, "max": 20}
    ]);
    assert_eq!(
        error_line(&simulate_stdin(&doc)),
        "error: group.thresholds[1].metric: must name a metric that no other threshold block sets (memory is set by thresholds[0]), got \"memory\""
    );
    let mut doc = g1_doc("dns");
    doc["group"]["cooldwn"] = json!("1m");
    let line = error_line(&simulate_stdin(&doc));
    assert!(
        line.starts_with("error: group.cooldwn: must be one of the known fields ("),
        "{line}"
    );
    let mut doc = g1_doc("dns");
    doc["group"]
        .as_object_mut()
        .unwrap()
        .remove("drain_timeout");
    assert_eq!(
        error_line(&simulate_stdin(&doc)),
        "error: group.drain_timeout: must be set, got nothing"
    );
}

#[test]
fn broken_json_and_missing_file_exit_2() {
    let line = error_line(&lbscale(&["simulate", "-"], Some("{\"group\": ")));
    assert!(
        line.starts_with("error: standard input: must be a JSON document, got "),
        "{line}"
    );
    let line = error_line(&lbscale(&["simulate", "/nonexistent/x.json"], None));
    assert!(
        line.starts_with("error: /nonexistent/x.json: must be a readable file, got "),
        "{line}"
    );
    let line = error_line(&lbscale(&["simulate"], None));
    assert!(line.starts_with("error: FILE: "), "{line}");
    assert_eq!(
        error_line(&lbscale(&["frobnicate"], None)),
        "error: command: must be one of simulate, slowstart, se-plan, daemon, status, events, got \"frobnicate\""
    );
}

#[test]
fn slowstart_g3_and_layout() {
    let out = lbscale(&["slowstart", &data("g3_per_second.json")], None);
    let text = String::from_utf8(out.stdout.clone()).unwrap();
    assert!(text.starts_with(
        "{\"rows\": [{\"t\": 0, \"rates\": {\"Service1\": 25.0, \"Service2\": 25.0, \"Service3\": 25.0, \"Service4\": 25.0, \"Service5\": 0.0}, \"slow_start\": [\"Service5\"]}"
    ), "{text}");
    let v = ok_json(&out);
    assert_eq!(v["rows"][5]["rates"]["Service5"], 20.0);
    assert_eq!(v["rows"][5]["slow_start"], json!([]));
}

#[test]
fn slowstart_g2_manual_from_stdin() {
    let text = std::fs::read_to_string(data("g2_manual.json")).unwrap();
    let v = ok_json(&lbscale(&["slowstart", "-"], Some(&text)));
    assert_eq!(
        v["rows"][2]["rates"],
        json!({"Service1": 80.0, "Service2": 80.0, "Service3": 40.0, "Service4": 40.0})
    );
}

#[test]
fn slowstart_errors_name_the_field() {
    let base: Value =
        serde_json::from_str(&std::fs::read_to_string(data("g3_per_second.json")).unwrap())
            .unwrap();
    let cases: Vec<(&str, Value, &str)> = vec![
        ("/slow_start/increment_interval", json!(4000), "error: slow_start.increment_interval: must be 0-3600 (seconds; 0 is manual slow start), got 4000"),
        ("/slow_start/unit", json!("PER_MINUTE"), "error: slow_start.unit: must be one of PER_SECOND, PERCENT, got \"PER_MINUTE\""),
        ("/slow_start/new_service_request", json!(-3), "error: slow_start.new_service_request: must be a whole number, 0 or more, got -3"),
        ("/lb_method", json!("RANDOM"), "error: lb_method: must be one of ROUNDROBIN, LEASTCONNECTION, LEASTRESPONSETIME, LEASTBANDWIDTH, LEASTPACKETS, LRTM, CUSTOMLOAD, got \"RANDOM\""),
        ("/request_rate", json!(-1), "error: request_rate: must be a number of requests per second, 0 or more, got -1"),
        ("/services/1/name", json!("Service1"), "error: services[1].name: must be a non-empty name not used by another service, got \"Service1\""),
        ("/at/2", json!(-5), "error: at[2]: must be a number of seconds, 0 or more, got -5"),
    ];
    for (pointer, value, expected) in cases {
        let mut doc = base.clone();
        *doc.pointer_mut(pointer).unwrap() = value;
        let out = lbscale(&["slowstart", "-"], Some(&doc.to_string()));
        assert_eq!(error_line(&out), expected, "{pointer}");
    }
}

#[test]
fn se_plan_prints_cli_md_example_exactly() {
    let out = lbscale(&["se-plan", "--nodes", "4"], None);
    assert!(out.status.success());
    assert_eq!(
        String::from_utf8(out.stdout).unwrap(),
        "{\"nodes\": 4, \"mode\": \"native\", \"capacity\": 3.10, \"shares\": [0.032, 0.323, 0.323, 0.323]}\n"
    );
    let v = ok_json(&lbscale(
        &["se-plan", "--nodes=2", "--forwarding-cost", "0.3"],
        None,
    ));
    assert_eq!(v["capacity"], 1.7);
    let v = ok_json(&lbscale(
        &["se-plan", "--nodes", "4", "--mode", "bgp"],
        None,
    ));
    assert_eq!(
        v,
        json!({"nodes": 4, "mode": "bgp", "capacity": 4.0, "shares": [0.25, 0.25, 0.25, 0.25]})
    );
    let v = ok_json(&lbscale(
        &[
            "se-plan",
            "--nodes",
            "3",
            "--mode",
            "native_and_bgp",
            "--ecmp-paths",
            "2",
        ],
        None,
    ));
    assert_eq!(v["capacity"], 2.0);
}

#[test]
fn se_plan_errors() {
    assert_eq!(
        error_line(&lbscale(&["se-plan"], None)),
        "error: --nodes: must be given, a whole number from 1 to 64, got nothing"
    );
    assert_eq!(
        error_line(&lbscale(&["se-plan", "--nodes", "0"], None)),
        "error: --nodes: must be a whole number from 1 to 64, got \"0\""
    );
    assert_eq!(
        error_line(&lbscale(
            &["se-plan", "--nodes", "4", "--forwarding-cost", "1.5"],
            None
        )),
        "error: --forwarding-cost: must be a number from 0 to 1, got \"1.5\""
    );
    assert_eq!(
        error_line(&lbscale(
            &["se-plan", "--nodes", "4", "--mode", "ecmp"],
            None
        )),
        "error: --mode: must be one of native, bgp, native_and_bgp, got \"ecmp\""
    );
    assert_eq!(
        error_line(&lbscale(&["se-plan", "--nodes"], None)),
        "error: --nodes: must be followed by a value, got nothing"
    );
}

fn lbscale_with_state_env(args: &[&str], state_env: Option<&str>) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_lbscale"));
    cmd.args(args).env_remove("LBSCALE_STATE");
    if let Some(v) = state_env {
        cmd.env("LBSCALE_STATE", v);
    }
    cmd.output().unwrap()
}

#[test]
fn the_store_url_comes_from_state_or_the_environment() {
    let dir = std::env::temp_dir().join(format!("lbscale-cli-env-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let sqlite = format!("sqlite://{}", dir.join("state.db").display());

    let err = error_line(&lbscale_with_state_env(&["status"], None));
    assert!(
        err.starts_with("error: --state: must be given") && err.contains("LBSCALE_STATE"),
        "{err}"
    );

    // A bad URL from the environment is refused by name, and not echoed: it
    // may carry a password.
    let err = error_line(&lbscale_with_state_env(
        &["events"],
        Some("mysql://lb:hunter2@db.example/lb"),
    ));
    assert!(
        err.starts_with("error: LBSCALE_STATE: must be sqlite://"),
        "{err}"
    );
    assert!(!err.contains("hunter2"), "{err}");

    let out = lbscale_with_state_env(&["status"], Some(&sqlite));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("GROUP"));
    assert!(
        dir.join("state.db").is_file(),
        "the store is not the one in LBSCALE_STATE"
    );

    // --state wins over the environment.
    let out = lbscale_with_state_env(&["status", "--state", &sqlite], Some("bogus"));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let _ = std::fs::remove_dir_all(&dir);
}
