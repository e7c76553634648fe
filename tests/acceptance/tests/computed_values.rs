//! Computed values are complete when the apply that makes them ends, and stay
//! put until an apply changes them, under every Terraform the suite is given
//! (`LBSCALE_TERRAFORMS`; the pinned 1.0.3 alone without it).
//!
//! A two-AZ `nlb` fleet and a `dns` distributor: the outputs of the first
//! apply (read from the state it wrote, without a refresh) hold every VIP and
//! every node; the next plan is empty (exit 0) with no "changed outside of
//! Terraform" note, also after the daemon's workflows scale the group and
//! after an import; the `lbscale_traffic_distributor` data source reads what
//! the distributor hands out live.

use lbscale_acceptance::*;

fn stack(name: &str, live_outputs: bool) -> String {
    let live = if live_outputs {
        // Values that move with the fleet: the group's nodes, and the data
        // source's registered addresses.
        r#"
output "node_ips" { value = sort(lbscale_autoscale_group.g.nodes[*].private_ip) }
output "node_count" { value = lbscale_autoscale_group.g.node_count }
output "live_endpoints" { value = sort(data.lbscale_traffic_distributor.nlb.endpoints) }
"#
    } else {
        ""
    };
    format!(
        r#"
resource "lbscale_traffic_distributor" "dns" {{
  name   = "{name}-dns"
  cloud  = "local"
  mode   = "dns"
  domain = "{name}.lbscale.test"
  ttl    = "1s"
}}

resource "lbscale_traffic_distributor" "nlb" {{
  name  = "{name}-nlb"
  cloud = "local"
  mode  = "nlb"
}}

resource "lbscale_autoscale_group" "g" {{
  name                   = "{name}"
  cloud                  = "local"
  availability_zones     = ["az1", "az2"]
  traffic_distributor_id = lbscale_traffic_distributor.nlb.id
  min_nodes              = 1
  max_nodes              = 3
  drain_timeout          = "2s"
  threshold {{
    metric = "cpu"
    min    = 10
    max    = 70
  }}
}}

resource "lbscale_se_group" "s" {{
  name               = "{name}-se"
  autoscale_group_id = lbscale_autoscale_group.g.id
}}

resource "lbscale_vserver" "web" {{
  name         = "{name}-web"
  se_group_id  = lbscale_se_group.s.id
  service_type = "TCP"
  port         = 9000
  service {{
    name    = "echo"
    address = "127.0.0.1"
    port    = 9
  }}
}}

data "lbscale_traffic_distributor" "nlb" {{
  name       = lbscale_traffic_distributor.nlb.name
  depends_on = [lbscale_vserver.web]
}}

output "dns_server" {{ value = lbscale_traffic_distributor.dns.address["dns"] }}
output "vip" {{ value = lbscale_vserver.web.vip }}
output "live_vips" {{ value = data.lbscale_traffic_distributor.nlb.address }}
# The resource's own values, wired into outputs: they must not move either.
output "nlb_address" {{ value = lbscale_traffic_distributor.nlb.address }}
output "nlb_endpoints" {{ value = lbscale_traffic_distributor.nlb.endpoints }}
output "dns_endpoints" {{ value = lbscale_traffic_distributor.dns.endpoints }}
{live}"#
    )
}

/// `terraform output -json` as the last apply left it: no refresh.
fn outputs_as_applied(ws: &Workspace) -> serde_json::Value {
    let o = ws.tf(&["output", "-json"]);
    assert_eq!(o.code, 0, "terraform output failed:\n{}", o.all());
    serde_json::from_str(&o.stdout).expect("output json")
}

/// The objects of a plan's "changed outside of Terraform" note.
fn drifted(plan: &Output) -> Vec<String> {
    plan.stdout
        .lines()
        .filter_map(|l| {
            let l = l.trim();
            l.strip_prefix("# ")
                .and_then(|r| r.strip_suffix(" has been changed"))
                .map(str::to_string)
        })
        .collect()
}

/// A plan with nothing to do: exit 0 and no "changed outside" note.
fn assert_plan_clean(ws: &Workspace, tf: &TerraformCli, when: &str) {
    let o = ws.plan();
    assert_eq!(
        o.code,
        0,
        "terraform {}: plan after {when} is not empty:\n{}",
        tf.label(),
        o.all()
    );
    assert!(
        !o.stdout.contains("changed outside of Terraform"),
        "terraform {}: plan after {when} reports changes outside Terraform:\n{}",
        tf.label(),
        o.stdout
    );
}

fn strings(v: &serde_json::Value) -> Vec<String> {
    v.as_array()
        .unwrap_or_else(|| panic!("not a list: {v}"))
        .iter()
        .map(|x| x.as_str().unwrap().to_string())
        .collect()
}

async fn computed_values_under(tf: &TerraformCli, octet: u8) {
    let name = format!("cv{octet}");
    let mut ws = Workspace::new(&format!("computed-{}", tf.label()), octet);
    ws.terraform = tf.path.clone();
    ws.write(&stack(&name, true));
    ws.apply();

    // The first apply's outputs are complete, as that apply wrote them.
    let out = outputs_as_applied(&ws);
    let label = tf.label();
    let dns = out["dns_server"]["value"].as_str().unwrap_or_default();
    assert!(
        dns.starts_with(&ws.prefix) && dns.contains(':'),
        "terraform {label}: dns_server {dns:?}"
    );
    let vip = &out["vip"]["value"];
    let live_vips = &out["live_vips"]["value"];
    for az in ["az1", "az2"] {
        let host = live_vips[az]
            .as_str()
            .unwrap_or_else(|| panic!("terraform {label}: no VIP for {az} in {out}"));
        assert!(host.starts_with(&ws.prefix), "{host}");
        assert_eq!(vip[az], format!("{host}:9000"), "terraform {label}: {out}");
    }
    assert_ne!(live_vips["az1"], live_vips["az2"], "one VIP per AZ");
    let nodes = strings(&out["node_ips"]["value"]);
    assert_eq!(nodes.len(), 2, "one node per AZ: {out}");
    assert_eq!(out["node_count"]["value"], 2);
    assert_eq!(strings(&out["live_endpoints"]["value"]), nodes);
    // What the distributors' own applies saw, before any group existed.
    assert_eq!(out["nlb_endpoints"]["value"], serde_json::json!([]));
    assert_eq!(out["dns_endpoints"]["value"], serde_json::json!([]));
    assert_plan_clean(&ws, tf, "the first apply");

    // The daemon's workflows scale the group between applies. The outputs
    // that are the distributors' and the vserver's do not move.
    ws.write(&stack(&name, false));
    ws.apply();
    assert_plan_clean(&ws, tf, "dropping the live outputs");
    let group_id = ws.resource("lbscale_autoscale_group.g")["id"]
        .as_str()
        .unwrap()
        .to_string();
    let engine = ws.engine();
    let added = engine
        .scale_out(&group_id, "az1", "test: scale-out by the daemon")
        .await
        .unwrap();
    let o = ws.plan();
    assert_eq!(
        o.code,
        0,
        "terraform {label}: plan after a scale-out:\n{}",
        o.all()
    );
    // Only the group's `nodes`/`node_count`, which are "nodes serving now",
    // may be reported moved, and only by Terraform before 1.2 (which notes
    // every refreshed change, relevant to the plan or not).
    let moved = drifted(&o);
    eprintln!("terraform {label}: after a scale-out the plan notes changes to {moved:?}");
    let allowed: &[&str] = if tf.at_least(1, 2) {
        &[]
    } else {
        &["lbscale_autoscale_group.g"]
    };
    assert!(
        moved.iter().all(|m| allowed.contains(&m.as_str())),
        "terraform {label}: a scale-out moved {moved:?}:\n{}",
        o.stdout
    );

    // The data source reads the distributor live: the new node is there.
    ws.write(&stack(&name, true));
    ws.apply();
    let out = outputs_as_applied(&ws);
    let live = strings(&out["live_endpoints"]["value"]);
    assert_eq!(live.len(), 3, "terraform {label}: {out}");
    assert_eq!(live, strings(&out["node_ips"]["value"]));
    let added_ip = ws
        .engine()
        .node_rows(&group_id)
        .unwrap()
        .into_iter()
        .find(|n| n.id == added)
        .expect("the added node")
        .private_ip;
    assert!(live.contains(&added_ip), "{live:?} lacks {added_ip}");
    assert_eq!(out["nlb_endpoints"]["value"], serde_json::json!([]));
    assert_plan_clean(&ws, tf, "reading the scaled fleet");

    // A scale-in outside Terraform: the same.
    ws.write(&stack(&name, false));
    ws.apply();
    let removed = engine
        .scale_in_one(&group_id, "az1", "test: scale-in by the daemon")
        .await
        .unwrap();
    assert_eq!(removed, added, "the newest node leaves first");
    let o = ws.plan();
    assert_eq!(
        o.code,
        0,
        "terraform {label}: plan after a scale-in:\n{}",
        o.all()
    );
    let moved = drifted(&o);
    assert!(
        moved.iter().all(|m| allowed.contains(&m.as_str())),
        "terraform {label}: a scale-in moved {moved:?}:\n{}",
        o.stdout
    );
    drop(engine);

    // Import: the distributor comes back as the store has it now, and the
    // plan after it has nothing to do to the resources.
    ws.apply();
    let o = ws.tf(&["state", "rm", "lbscale_traffic_distributor.nlb"]);
    assert_eq!(o.code, 0, "{}", o.all());
    let o = ws.tf(&[
        "import",
        "-no-color",
        "-input=false",
        "lbscale_traffic_distributor.nlb",
        &format!("{name}-nlb"),
    ]);
    assert_eq!(o.code, 0, "import failed:\n{}", o.all());
    let imported = ws.resource("lbscale_traffic_distributor.nlb");
    assert_eq!(strings(&imported["endpoints"]).len(), 2, "{imported}");
    assert_eq!(imported["address"], out["live_vips"]["value"]);
    let o = ws.plan();
    assert!(
        o.code == 0 || (o.code == 2 && !o.stdout.contains("Plan:")),
        "terraform {label}: plan after the import:\n{}",
        o.all()
    );
    assert!(drifted(&o).is_empty(), "{}", o.stdout);
    // `state rm` dropped the outputs that read the distributor: apply them back.
    ws.apply();
    assert_plan_clean(&ws, tf, "the import");

    ws.destroy();
    let mut left: Vec<(String, u16)> = nodes.iter().map(|ip| (ip.clone(), 9990)).collect();
    for az in ["az1", "az2"] {
        left.push((live_vips[az].as_str().unwrap().to_string(), 9000));
    }
    ws.assert_nothing_left(&left);
}

#[tokio::test(flavor = "multi_thread")]
async fn computed_values_are_complete_after_the_apply_and_stay_put() {
    let tfs = terraforms();
    eprintln!(
        "computed values under terraform {}",
        tfs.iter().map(|t| t.label()).collect::<Vec<_>>().join(", ")
    );
    for (i, tf) in tfs.iter().enumerate() {
        computed_values_under(tf, 160 + i as u8).await;
    }
}

#[test]
fn the_distributor_data_source_names_a_missing_distributor() {
    let ws = Workspace::new("computed-missing", 165);
    ws.write(
        r#"
data "lbscale_traffic_distributor" "d" {
  name = "nowhere" # missing
}
"#,
    );
    let o = ws.plan();
    assert_eq!(o.code, 1, "{}", o.all());
    let d = diagnostics(&o.all());
    assert!(
        d.iter()
            .any(|d| d.summary == "Traffic distributor not found"
                && d.text.contains("no traffic distributor named \"nowhere\"")
                && d.line == Some(line_of(&ws, "# missing"))),
        "{d:?}"
    );
}
