//! The data sources, and the contract with the daemon: node counts changed
//! outside Terraform (through the engine's scale-out and scale-in workflows, as
//! the daemon runs them) leave the plan empty.

use lbscale_acceptance::*;
use std::process::Command;

const CONFIG: &str = r#"
resource "lbscale_traffic_distributor" "d" {
  name   = "ds-dns"
  cloud  = "local"
  mode   = "dns"
  domain = "ds.lbscale.test"
  ttl    = "1s"
}

resource "lbscale_autoscale_group" "g" {
  name                   = "ds"
  cloud                  = "local"
  availability_zones     = ["az1"]
  traffic_distributor_id = lbscale_traffic_distributor.d.id
  min_nodes              = 1
  max_nodes              = 3
  drain_timeout          = "2s"
  threshold {
    metric = "memory"
    min    = 40
    max    = 85
  }
}

data "lbscale_autoscale_group" "g" {
  name = lbscale_autoscale_group.g.name
}

output "node_count" { value = data.lbscale_autoscale_group.g.node_count }
output "status" { value = data.lbscale_autoscale_group.g.status }
output "event_kinds" { value = [for e in data.lbscale_autoscale_group.g.events : e.kind] }
output "repeats" { value = [for e in data.lbscale_autoscale_group.g.events : "${e.kind} ${e.count} ${e.last_time}" if e.kind == "resume_failed"] }
output "dns" { value = lbscale_traffic_distributor.d.address["dns"] }
"#;

#[tokio::test(flavor = "multi_thread")]
async fn scaling_outside_terraform_keeps_the_plan_empty_and_shows_in_the_data_source() {
    let mut ws = Workspace::new("outside", 116);
    ws.write(CONFIG);
    ws.apply();
    let out = ws.outputs();
    assert_eq!(out["node_count"]["value"], 1);
    assert_eq!(out["status"]["value"], "ok");
    let kinds = out["event_kinds"]["value"].as_array().unwrap().clone();
    for k in [
        "group_created",
        "node_provisioning",
        "node_active",
        "node_registered",
    ] {
        assert!(kinds.iter().any(|x| x == k), "no {k} event in {kinds:?}");
    }
    let dns = out["dns"]["value"].as_str().unwrap().to_string();
    let group_id = ws.resource("lbscale_autoscale_group.g")["id"]
        .as_str()
        .unwrap()
        .to_string();

    // What the daemon does between applies, through the same engine and store.
    let engine = ws.engine();
    let added = engine
        .scale_out(&group_id, "az1", "memory 90 > 85 for 3 samples (test)")
        .await
        .unwrap();
    assert_eq!(
        dig(&dns, "ds.lbscale.test").len(),
        2,
        "the new node is in DNS"
    );
    ws.assert_plan_empty("a scale-out outside Terraform");
    let out = ws.outputs();
    assert_eq!(out["node_count"]["value"], 2);
    assert_eq!(ws.resource("lbscale_autoscale_group.g")["node_count"], 2);
    assert!(out["event_kinds"]["value"]
        .as_array()
        .unwrap()
        .iter()
        .any(|k| k == "scale_out"));

    // max_nodes is honoured by the workflow itself.
    engine.scale_out(&group_id, "az1", "test").await.unwrap();
    let refused = engine
        .scale_out(&group_id, "az1", "test")
        .await
        .unwrap_err()
        .to_string();
    assert!(refused.contains("max_nodes is 3"), "{refused}");

    let removed = engine
        .scale_in_one(&group_id, "az1", "memory below 40 for 3 samples (test)")
        .await
        .unwrap();
    assert_ne!(removed, added, "the newest node leaves first");
    engine.scale_in_one(&group_id, "az1", "test").await.unwrap();
    assert!(engine
        .scale_in_one(&group_id, "az1", "test")
        .await
        .unwrap_err()
        .to_string()
        .contains("min_nodes is 1"));
    assert_eq!(dig(&dns, "ds.lbscale.test").len(), 1);
    ws.assert_plan_empty("scale-ins outside Terraform");
    let kinds = ws.outputs()["event_kinds"]["value"]
        .as_array()
        .unwrap()
        .clone();
    for k in [
        "scale_in",
        "ttl_end",
        "drain_end",
        "deprovision_start",
        "node_removed",
    ] {
        assert!(kinds.iter().any(|x| x == k), "no {k} event in {kinds:?}");
    }
    // Repeats of one event (as a resume that keeps failing records) are one
    // event with a count, in the data source and in `lbscale events`.
    for _ in 0..3 {
        engine
            .record_event(
                &group_id,
                None,
                "resume_failed",
                "resuming (test) failed: test",
            )
            .await;
    }
    let repeats = ws.outputs()["repeats"]["value"].clone();
    let repeats = repeats.as_array().unwrap();
    assert_eq!(repeats.len(), 1, "{repeats:?}");
    let r = repeats[0].as_str().unwrap();
    assert!(r.starts_with("resume_failed 3 20"), "{r}");
    let table = Command::new(bin_dir().join("lbscale"))
        .args([
            "events",
            "--state",
            "sqlite://.lbscale/state.db",
            "--group",
            "ds",
        ])
        .current_dir(&ws.dir)
        .output()
        .unwrap();
    assert!(
        table.status.success(),
        "{}",
        String::from_utf8_lossy(&table.stderr)
    );
    let table = String::from_utf8_lossy(&table.stdout);
    let header = table.lines().next().unwrap();
    assert!(header.contains("COUNT"), "{table}");
    let row = table
        .lines()
        .find(|l| l.contains("resume_failed"))
        .unwrap_or_else(|| panic!("{table}"));
    assert!(row.contains(" 3 (last 20"), "{row}");
    drop(engine);
    ws.destroy();
    ws.assert_nothing_left(&[]);
}

/// Reference case G1 of docs/design.md (dns form) through the data source and through `lbscale simulate`:
/// the same ticks and events.
#[test]
fn scaling_simulation_matches_the_cli() {
    let memory = |t: u64| -> f64 {
        match t / 60 {
            1 | 2 => 90.0,
            3 => 80.0,
            4..=6 => 90.0,
            17 => 60.0,
            18..=20 => 30.0,
            _ => 60.0,
        }
    };
    let ticks: Vec<u64> = (1..=40).map(|m| m * 60).collect();
    let samples_tf: Vec<String> = ticks
        .iter()
        .map(|t| format!("{{ t = {t}, availability_zone = \"az1\", cpu = null, memory = {}, throughput = null }}", memory(*t)))
        .collect();
    let ws = Workspace::new("simulation", 117);
    ws.write(&format!(
        r#"
data "lbscale_scaling_simulation" "g1" {{
  availability_zones = ["az1"]
  min_nodes          = 1
  max_nodes          = 4
  stats_interval     = "1m"
  watch_time         = "3m"
  cooldown           = "10m"
  drain_timeout      = "10m"
  distributor        = "dns"
  dns_ttl            = "60s"
  threshold {{
    metric = "memory"
    min    = 40
    max    = 85
  }}
  samples = [
    {}
  ]
  until = 2400
}}

output "json" {{ value = data.lbscale_scaling_simulation.g1.json }}
output "scale_out_at" {{ value = [for e in data.lbscale_scaling_simulation.g1.events : e.t if e.kind == "scale_out"] }}
"#,
        samples_tf.join(",\n    ")
    ));
    let o = ws.tf(&["apply", "-auto-approve", "-no-color"]);
    assert_eq!(o.code, 0, "{}", o.all());
    let out = ws.outputs();
    assert_eq!(out["scale_out_at"]["value"], serde_json::json!([360]));
    let from_tf: serde_json::Value =
        serde_json::from_str(out["json"]["value"].as_str().unwrap()).unwrap();

    let input = serde_json::json!({
        "group": {
            "availability_zones": ["az1"], "min_nodes": 1, "max_nodes": 4,
            "stats_interval": "1m", "watch_time": "3m", "cooldown": "10m",
            "drain_timeout": "10m", "distributor": "dns", "dns_ttl": "60s",
            "thresholds": [{"metric": "memory", "min": 40, "max": 85}]
        },
        "cloud": {},
        "connections_drain_after": null,
        "samples": ticks.iter().map(|t| serde_json::json!({"t": t, "az": "az1", "memory": memory(*t)})).collect::<Vec<_>>(),
        "until": 2400
    });
    let file = ws.dir.join("g1.json");
    std::fs::write(&file, input.to_string()).unwrap();
    let cli = Command::new(bin_dir().join("lbscale"))
        .args(["simulate", file.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(
        cli.status.success(),
        "{}",
        String::from_utf8_lossy(&cli.stderr)
    );
    let from_cli: serde_json::Value = serde_json::from_slice(&cli.stdout).unwrap();
    assert_eq!(from_tf, from_cli);
    // G1 (dns): deprovision at T32, evaluation resumes at T33.
    let removed: Vec<_> = from_cli["events"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["kind"] == "node_removed")
        .map(|e| e["t"].clone())
        .collect();
    assert_eq!(removed, vec![serde_json::json!(1920)]);
}
