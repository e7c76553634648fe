//! The gcp cloud under the real Terraform CLI, against the gcp fake
//! (`lbscale_cloud_gcp::fake_testing`: Compute Engine and Cloud DNS as
//! Google's discovery documents define them): a `dns` distributor is a Cloud
//! DNS record set, a group's nodes are Compute Engine instances, and a gcp
//! cloud without its settings is refused at plan time by name. Given
//! `lbscale-node`, the fake boots instances in loopback subnetworks (runs
//! their startup script at their private address): a group then comes up,
//! the daemon scales it out and in, and destroy takes it all down. The `nlb`
//! distributor is tested at the driver level (clouds/gcp/tests).

use lbscale_acceptance::*;
use lbscale_cloud_gcp::fake_testing::{GcpFake, IMAGE};

/// The provider's `gcp` block that reaches the fake.
fn gcp_block(fake: &GcpFake) -> String {
    format!(
        r#"  gcp {{
    project     = "lbscale-test"
    endpoint    = "{}"
    credentials = file("{}")
    ca_bundle   = "{}"
  }}
"#,
        fake.endpoint,
        fake.key.display(),
        fake.ca.display()
    )
}

#[test]
fn a_gcp_dns_distributor_is_a_cloud_dns_record_set() {
    let fake = GcpFake::start("acc-dns");
    fake.managed_zone("acc", "acc.lbscale.test.");
    let mut ws = Workspace::new("gcp-dns", 141);
    ws.provider_blocks = gcp_block(&fake);
    ws.write(
        r#"
resource "lbscale_traffic_distributor" "d" {
  name   = "gcpd"
  cloud  = "gcp"
  mode   = "dns"
  domain = "app.acc.lbscale.test"
  ttl    = "45s"
}

output "address" { value = lbscale_traffic_distributor.d.address }
output "endpoints" { value = lbscale_traffic_distributor.d.endpoints }
"#,
    );
    ws.apply();
    let out = ws.outputs();
    assert_eq!(
        out["address"]["value"]["dns"], "ns-cloud-a1.googledomains.com",
        "the zone's first name server: {}",
        out["address"]
    );
    assert_eq!(out["endpoints"]["value"], serde_json::json!([]));
    // Nothing serves yet: no A record.
    assert!(!fake
        .records("acc")
        .contains_key(&("app.acc.lbscale.test.".to_string(), "A".to_string())));
    // The key is in neither the state nor the store.
    let key: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&fake.key).unwrap()).unwrap();
    let secret = key["private_key"]
        .as_str()
        .unwrap()
        .lines()
        .nth(1)
        .unwrap()
        .to_string();
    let state = std::fs::read_to_string(ws.dir.join("terraform.tfstate")).unwrap();
    assert!(!state.contains(&secret), "the key is in the state");
    let db = std::fs::read(ws.dir.join(".lbscale/state.db")).unwrap();
    assert!(
        !String::from_utf8_lossy(&db).contains(&secret),
        "the key is in the store"
    );
    ws.assert_plan_empty("creating a gcp distributor");
    ws.destroy();
    assert_eq!(
        fake.state()["managedZones"].as_array().unwrap().len(),
        1,
        "the zone is the operator's"
    );
}

/// A gcp group's nodes are instances. The fake runs none, so no node answers:
/// the apply fails naming the step and the node, and destroy deletes every
/// instance it started.
#[test]
fn a_gcp_group_starts_instances_and_destroy_deletes_them() {
    let fake = GcpFake::start("acc-group");
    fake.managed_zone("grp", "grp.lbscale.test.");
    let mut ws = Workspace::new("gcp-group", 142);
    ws.provider_blocks = gcp_block(&fake);
    ws.write(&format!(
        r#"
resource "lbscale_traffic_distributor" "d" {{
  name   = "gcpg-d"
  cloud  = "gcp"
  mode   = "dns"
  domain = "www.grp.lbscale.test"
  ttl    = "1s"
}}

resource "lbscale_autoscale_group" "g" {{
  name                   = "gcpg"
  cloud                  = "gcp"
  availability_zones     = ["us-central1-a", "us-central1-b"]
  traffic_distributor_id = lbscale_traffic_distributor.d.id
  min_nodes              = 1
  max_nodes              = 2
  apply_timeout          = "10s"
  drain_timeout          = "1s"
  node {{
    image           = "{IMAGE}"
    size            = "e2-small"
    security_groups = ["lbscale-nodes"]
    tags            = {{ team = "edge" }}
  }}
  threshold {{
    metric = "cpu"
    min    = 10
    max    = 70
  }}
}}
"#
    ));
    let o = ws.tf(&["apply", "-auto-approve", "-no-color", "-input=false"]);
    assert_ne!(o.code, 0, "no node can answer on the fake:\n{}", o.all());
    let all = o.all();
    assert!(
        (all.contains("wait for the node to be active")
            || all.contains("push the vservers to the node"))
            && all.contains("gcpg-us-central1-"),
        "the failure names the step and the node:\n{all}"
    );
    let group_id = ws
        .engine()
        .group_named("gcpg")
        .unwrap()
        .expect("the group")
        .id;
    let mine = |fake: &GcpFake| -> Vec<serde_json::Value> {
        fake.state()["instances"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|i| {
                i["labels"]["lbscale-group"] == lbscale_cloud_gcp::label_value(&group_id).as_str()
            })
            .cloned()
            .collect()
    };
    let started = mine(&fake);
    let mut zones: Vec<String> = started
        .iter()
        .map(|i| {
            i["zone"]
                .as_str()
                .unwrap()
                .rsplit('/')
                .next()
                .unwrap()
                .to_string()
        })
        .collect();
    zones.sort();
    zones.dedup();
    assert_eq!(zones, ["us-central1-a", "us-central1-b"], "{started:?}");
    assert!(started.iter().all(
        |i| i["machineType"].as_str().unwrap().ends_with("/e2-small")
            && i["labels"]["team"] == "edge"
    ));
    ws.destroy();
    assert!(
        mine(&fake).is_empty(),
        "an instance outlived its group: {:?}",
        mine(&fake)
    );
}

#[test]
fn a_gcp_cloud_without_its_settings_is_refused_by_name() {
    let fake = GcpFake::start("acc-refused");
    let mut ws = Workspace::new("gcp-refused", 143);
    let stack = |node: &str| {
        format!(
            r#"
resource "lbscale_traffic_distributor" "d" {{
  name   = "refused-d"
  cloud  = "gcp"
  mode   = "dns"
  domain = "refused.lbscale.test"
}}

resource "lbscale_autoscale_group" "g" {{
  name                   = "refused"
  cloud                  = "gcp"
  availability_zones     = ["us-central1-a"]
  traffic_distributor_id = lbscale_traffic_distributor.d.id
{node}  threshold {{
    metric = "cpu"
    min    = 10
    max    = 70
  }}
}}
"#
        )
    };
    // No gcp block and none of Google's variables: no project, said on `cloud`.
    ws.write(&stack(""));
    let o = ws.plan();
    assert_eq!(o.code, 1, "{}", o.all());
    let d = diagnostics(&o.all());
    assert!(
        d.iter().any(|d| d.summary == "Cloud not usable"
            && d.text.contains("no GCP project")
            && d.text.contains("GOOGLE_CLOUD_PROJECT")
            && d.line == Some(line_of(&ws, "cloud  = \"gcp\""))),
        "{d:?}"
    );
    // With the settings, a group without node.image: said, naming the field.
    ws.provider_blocks = gcp_block(&fake);
    ws.write(&stack(""));
    let o = ws.plan();
    assert_eq!(o.code, 1, "{}", o.all());
    assert!(o.all().contains("node.image"), "{}", o.all());
    // A key that is not JSON: named on its attribute, its value not repeated.
    ws.provider_blocks = gcp_block(&fake).replace(
        &format!("file(\"{}\")", fake.key.display()),
        "\"{not-a-key SECRETVALUE\"",
    );
    ws.write(&stack(&format!("  node {{\n    image           = \"{IMAGE}\"\n    security_groups = [\"lbscale-nodes\"]\n  }}\n")));
    let o = ws.plan();
    assert_eq!(o.code, 1, "{}", o.all());
    assert!(
        o.all().contains("Invalid credentials") && o.all().contains("not JSON"),
        "{}",
        o.all()
    );
    assert_eq!(
        o.all().matches("SECRETVALUE").count(),
        1,
        "repeated:\n{}",
        o.all()
    );
    // All set: the plan goes through (2: it has changes).
    ws.provider_blocks = gcp_block(&fake);
    ws.write(&stack(&format!("  node {{\n    image           = \"{IMAGE}\"\n    security_groups = [\"lbscale-nodes\"]\n  }}\n")));
    let o = ws.plan();
    assert_eq!(o.code, 2, "{}", o.all());
}

/// With `lbscale-node` given to the fake, an instance in a loopback
/// subnetwork boots: the fake runs its startup script at its private address.
/// So a gcp group comes up under Terraform: its nodes serve, the distributor's
/// record holds them, the next plan is empty, and destroy deletes the
/// instances (and the fake stops their nodes) and the record.
#[test]
fn a_gcp_group_comes_up_on_booted_instances_and_goes_with_destroy() {
    let fake = GcpFake::start_with("acc-life", Some(&bin_dir()));
    fake.subnetwork("us-central1", "lb-a", "127.144.1.0/24");
    fake.subnetwork("us-central1", "lb-b", "127.144.2.0/24");
    fake.managed_zone("life", "life.lbscale.test.");
    let mut ws = Workspace::new("gcp-life", 144);
    ws.provider_blocks = gcp_block(&fake);
    ws.write(&format!(
        r#"
resource "lbscale_traffic_distributor" "d" {{
  name   = "life-d"
  cloud  = "gcp"
  mode   = "dns"
  domain = "app.life.lbscale.test"
  ttl    = "1s"
}}

resource "lbscale_autoscale_group" "g" {{
  name                   = "life"
  cloud                  = "gcp"
  availability_zones     = ["us-central1-a", "us-central1-b"]
  traffic_distributor_id = lbscale_traffic_distributor.d.id
  min_nodes              = 1
  max_nodes              = 2
  apply_timeout          = "60s"
  drain_timeout          = "1s"
  node {{
    image           = "{IMAGE}"
    subnets         = {{ "us-central1-a" = "lb-a", "us-central1-b" = "lb-b" }}
  }}
  threshold {{
    metric = "cpu"
    min    = 10
    max    = 70
  }}
}}

output "nodes" {{ value = lbscale_autoscale_group.g.nodes }}
"#
    ));
    let o = ws.tf(&["apply", "-auto-approve", "-no-color", "-input=false"]);
    assert_eq!(o.code, 0, "{}\nstate: {}", o.all(), fake.state());
    let state = fake.state();
    let instances = state["instances"].as_array().unwrap().clone();
    assert_eq!(instances.len(), 2, "{instances:?}");
    assert_eq!(state["booted"].as_array().unwrap().len(), 2, "{state}");
    let mut private: Vec<String> = instances
        .iter()
        .map(|i| {
            i["networkInterfaces"][0]["networkIP"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    private.sort();
    assert_eq!(private, ["127.144.1.2", "127.144.2.2"]);
    let mut public: Vec<String> = instances
        .iter()
        .map(|i| {
            i["networkInterfaces"][0]["accessConfigs"][0]["natIP"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    public.sort();
    // The serving nodes are in the record, by their external addresses.
    let a = ("app.life.lbscale.test.".to_string(), "A".to_string());
    assert_eq!(fake.records("life")[&a], (1, public.clone()));
    // No network tags given: the group's own firewall rule opens the node
    // API to its subnetworks (no vserver: no rule for clients).
    let rules = state["firewalls"].as_array().unwrap();
    assert_eq!(rules.len(), 1, "{rules:?}");
    assert_eq!(
        rules[0]["sourceRanges"],
        serde_json::json!(["127.144.1.0/24", "127.144.2.0/24"])
    );
    let tag = rules[0]["targetTags"][0].as_str().unwrap();
    assert!(
        instances.iter().all(|i| i["tags"]["items"][0] == tag),
        "{instances:?}"
    );
    // Google's own client sees the same: the group's instances are its
    // serving nodes, and the record hands out their external addresses.
    let group = ws.resource("lbscale_autoscale_group.g");
    let group_id = group["id"].as_str().unwrap().to_string();
    let mut serving: Vec<String> = group["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|n| n["state"] == "active")
        .map(|n| n["private_ip"].as_str().unwrap().to_string())
        .collect();
    serving.sort();
    assert_eq!(serving, private, "the serving nodes are the instances");
    let (ok, out, err) = fake.gcloud(&[
        "compute",
        "instances",
        "list",
        &format!("--filter=labels.lbscale-group={group_id}"),
        "--format=value(networkInterfaces[0].networkIP,status)",
    ]);
    assert!(ok, "gcloud: {err}");
    let mut listed: Vec<String> = out.lines().map(str::to_string).collect();
    listed.sort();
    let want: Vec<String> = serving.iter().map(|ip| format!("{ip}\tRUNNING")).collect();
    assert_eq!(listed, want, "gcloud's instances vs the serving nodes");
    let (ok, out, err) = fake.gcloud(&[
        "dns",
        "record-sets",
        "list",
        "--zone=life",
        "--format=value(name,type,rrdatas.list())",
    ]);
    assert!(ok, "gcloud: {err}");
    assert!(
        out.contains(&format!("app.life.lbscale.test.\tA\t{}", public.join(","))),
        "gcloud's record sets vs the serving nodes' addresses {public:?}: {out}"
    );
    ws.assert_plan_empty("a gcp group that came up");
    ws.destroy();
    let state = fake.state();
    assert!(state["firewalls"].as_array().unwrap().is_empty(), "{state}");
    assert!(state["instances"].as_array().unwrap().is_empty(), "{state}");
    assert!(state["booted"].as_array().unwrap().is_empty(), "{state}");
    assert!(!fake.records("life").contains_key(&a));
}

/// `lbscale daemon` on the gcp driver (its settings from Google's and
/// lbscale's environment variables): under load it scales out (a new
/// instance boots on the fake and joins the record), and back in when idle.
#[test]
fn the_daemon_scales_a_gcp_group_out_under_load_and_back_in() {
    use std::time::Duration;
    let backend = big_backend();
    let fake = GcpFake::start_with("acc-daemon", Some(&bin_dir()));
    fake.subnetwork("us-central1", "lb-d", "127.145.1.0/24");
    fake.managed_zone("dmn", "dmn.lbscale.test.");
    let mut ws = Workspace::new("gcp-daemon", 145);
    ws.provider_blocks = gcp_block(&fake);
    let stack = daemon_stack("gcpdmn", backend, 2, "3s")
        .replace("cloud  = \"local\"", "cloud  = \"gcp\"")
        .replace("cloud                  = \"local\"", "cloud                  = \"gcp\"")
        .replace("\"gcpdmn.lbscale.test\"", "\"app.dmn.lbscale.test\"")
        .replace("[\"az1\"]", "[\"us-central1-a\"]")
        .replace(
            "  drain_timeout          = \"2s\"\n",
            &format!("  drain_timeout          = \"2s\"\n  node {{\n    image   = \"{IMAGE}\"\n    subnets = {{ \"us-central1-a\" = \"lb-d\" }}\n  }}\n"),
        );
    assert!(
        stack.contains("lb-d") && !stack.contains("\"local\""),
        "{stack}"
    );
    ws.write(&stack);
    ws.apply();
    let running = |fake: &GcpFake| -> Vec<String> {
        let mut ips: Vec<String> = fake.state()["instances"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|i| i["status"] == "RUNNING")
            .map(|i| {
                i["networkInterfaces"][0]["networkIP"]
                    .as_str()
                    .unwrap()
                    .to_string()
            })
            .collect();
        ips.sort();
        ips
    };
    let first = running(&fake);
    assert_eq!(first.len(), 1, "{first:?}");
    let a = ("app.dmn.lbscale.test.".to_string(), "A".to_string());
    let key = fake.key.display().to_string();
    let ca = fake.ca.display().to_string();
    let daemon = Daemon::start_with(
        &ws,
        19481,
        "gcp",
        &[
            ("LBSCALE_GCP_ENDPOINT", fake.endpoint.as_str()),
            ("LBSCALE_GCP_CA_BUNDLE", ca.as_str()),
            ("GOOGLE_APPLICATION_CREDENTIALS", key.as_str()),
            ("GOOGLE_CLOUD_PROJECT", "lbscale-test"),
        ],
    );
    let load = Load::start(&first[0], "app.dmn.lbscale.test");
    wait_for(
        "scale-out to 2 instances in the record",
        Duration::from_secs(60),
        || {
            let r = fake.records("dmn");
            (running(&fake).len() == 2 && r.get(&a).is_some_and(|(_, v)| v.len() == 2))
                .then_some(())
        },
    );
    drop(load);
    wait_for(
        "scale-in back to 1 instance (the other deleted, its node stopped)",
        Duration::from_secs(60),
        || {
            let s = fake.state();
            let r = fake.records("dmn");
            (s["instances"].as_array().unwrap().len() == 1
                && s["booted"].as_array().unwrap().len() == 1
                && r.get(&a).is_some_and(|(_, v)| v.len() == 1))
            .then_some(())
        },
    );
    drop(daemon);
    ws.assert_plan_empty("after the daemon scaled the gcp group");
    ws.destroy();
    assert!(fake.state()["instances"].as_array().unwrap().is_empty());
}

/// The shared module `examples/modules/fleet` on the gcp fake: the same
/// module as on local (fleet_module.rs), with gcp's zones and node block.
#[test]
fn the_fleet_module_comes_up_on_gcp_and_goes_with_destroy() {
    let fake = GcpFake::start_with("acc-fleet", Some(&bin_dir()));
    fake.subnetwork("us-central1", "fl-a", "127.146.1.0/24");
    fake.subnetwork("us-central1", "fl-b", "127.146.2.0/24");
    fake.managed_zone("fleet", "fleet.lbscale.test.");
    let mut ws = Workspace::new("gcp-fleet", 146);
    ws.provider_blocks = gcp_block(&fake);
    ws.copy_fleet_module();
    ws.write(&format!(
        r#"
module "shop" {{
  source             = "./modules/fleet"
  name               = "gfleet"
  cloud              = "gcp"
  availability_zones = ["us-central1-a", "us-central1-b"]
  domain             = "app.fleet.lbscale.test"
  ttl                = "1s"
  node = {{
    image   = "{IMAGE}"
    subnets = {{ "us-central1-a" = "fl-a", "us-central1-b" = "fl-b" }}
    tags    = {{ app = "fleet" }}
  }}
  vservers = {{
    web = {{
      port     = 8080
      backends = [{{ name = "b1", address = "10.0.1.10", port = 8080 }}]
    }}
  }}
}}
"#
    ));
    let o = ws.tf(&["get", "-no-color"]);
    assert_eq!(o.code, 0, "terraform get:\n{}", o.all());
    let o = ws.tf(&["apply", "-auto-approve", "-no-color", "-input=false"]);
    assert_eq!(o.code, 0, "{}\nstate: {}", o.all(), fake.state());
    let state = fake.state();
    let instances = state["instances"].as_array().unwrap().clone();
    assert_eq!(instances.len(), 2, "{instances:?}");
    assert!(
        instances.iter().all(|i| i["labels"]["app"] == "fleet"),
        "the module's node tags are the instances' labels: {instances:?}"
    );
    let a = ("app.fleet.lbscale.test.".to_string(), "A".to_string());
    assert_eq!(fake.records("fleet")[&a].1.len(), 2);
    ws.assert_plan_empty("the fleet module on gcp");
    ws.destroy();
    let state = fake.state();
    assert!(state["instances"].as_array().unwrap().is_empty(), "{state}");
    assert!(!fake.records("fleet").contains_key(&a));
}
