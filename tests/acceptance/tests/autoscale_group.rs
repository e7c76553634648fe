//! `lbscale_autoscale_group` under real Terraform: create, empty plan, in-place
//! updates that add and drain nodes, replacement, import, a node that dies, and a
//! destroy that leaves nothing behind.

use lbscale_acceptance::*;
use std::time::Duration;

fn config(name: &str, min: i64, max: i64, cooldown: &str) -> String {
    format!(
        r#"
resource "lbscale_traffic_distributor" "d" {{
  name   = "grp-dns"
  cloud  = "local"
  mode   = "dns"
  domain = "grp.lbscale.test"
  ttl    = "1s"
}}

resource "lbscale_autoscale_group" "g" {{
  name                   = "{name}"
  cloud                  = "local"
  availability_zones     = ["az1", "az2"]
  traffic_distributor_id = lbscale_traffic_distributor.d.id
  min_nodes              = {min}
  max_nodes              = {max}
  cooldown               = "{cooldown}"
  drain_timeout          = "5s"

  threshold {{
    metric = "cpu"
    min    = 20.5
    max    = 80
  }}
  threshold {{
    metric = "memory"
    min    = 10.3
    max    = 85
  }}
}}

output "dns" {{ value = lbscale_traffic_distributor.d.address["dns"] }}
"#
    )
}

fn nodes(ws: &Workspace) -> Vec<serde_json::Value> {
    ws.resource("lbscale_autoscale_group.g")["nodes"]
        .as_array()
        .cloned()
        .unwrap_or_default()
}

fn ips(nodes: &[serde_json::Value]) -> Vec<String> {
    let mut v: Vec<String> = nodes
        .iter()
        .map(|n| n["private_ip"].as_str().unwrap().to_string())
        .collect();
    v.sort();
    v
}

#[test]
fn autoscale_group_lifecycle() {
    let mut ws = Workspace::new("group", 111);
    ws.write(&config("web", 1, 3, "10m"));
    ws.apply();

    // Every AZ at min_nodes, every node active, running and in DNS.
    let first = nodes(&ws);
    assert_eq!(first.len(), 2, "{first:?}");
    assert!(first.iter().all(|n| n["state"] == "active"), "{first:?}");
    assert_eq!(ws.resource("lbscale_autoscale_group.g")["node_count"], 2);
    assert_eq!(
        ws.processes()
            .iter()
            .filter(|(_, c)| c.contains(" serve "))
            .count(),
        2
    );
    let dns = ws.outputs()["dns"]["value"].as_str().unwrap().to_string();
    assert_eq!(dig(&dns, "grp.lbscale.test"), ips(&first));
    ws.assert_plan_empty("create");

    // In place: a declared setting that does not touch the nodes.
    ws.write(&config("web", 1, 3, "5m"));
    let o = ws.plan();
    assert_eq!(o.code, 2, "{}", o.all());
    assert!(
        o.stdout.contains("1 to change, 0 to destroy"),
        "{}",
        o.stdout
    );
    ws.apply();
    assert_eq!(
        ips(&nodes(&ws)),
        ips(&first),
        "a cooldown change must not touch the nodes"
    );
    ws.assert_plan_empty("updating cooldown");

    // Raising min_nodes adds nodes on apply.
    ws.write(&config("web", 2, 3, "5m"));
    ws.apply();
    let grown = nodes(&ws);
    assert_eq!(grown.len(), 4, "{grown:?}");
    assert_eq!(dig(&dns, "grp.lbscale.test"), ips(&grown));
    ws.assert_plan_empty("raising min_nodes");

    // Lowering max_nodes below the count drains the newest nodes.
    ws.write(&config("web", 1, 1, "5m"));
    ws.apply();
    let shrunk = nodes(&ws);
    assert_eq!(
        ips(&shrunk),
        ips(&first),
        "the oldest node of each AZ stays: {shrunk:?}"
    );
    assert_eq!(dig(&dns, "grp.lbscale.test"), ips(&first));
    assert_eq!(
        ws.processes()
            .iter()
            .filter(|(_, c)| c.contains(" serve "))
            .count(),
        2
    );
    let events = ws
        .engine()
        .events(
            ws.resource("lbscale_autoscale_group.g")["id"]
                .as_str()
                .unwrap(),
            100,
        )
        .unwrap();
    assert!(events.iter().any(|e| e.kind == "drain_end"), "{events:?}");
    ws.assert_plan_empty("lowering max_nodes");

    // Import by name, then an empty plan.
    ws.reimport("lbscale_autoscale_group.g", "web");
    ws.reimport("lbscale_traffic_distributor.d", "grp-dns");

    // A node process that dies shows as failed; the plan proposes to heal it.
    let victim = nodes(&ws)[0].clone();
    let (pid, _) = ws
        .processes()
        .into_iter()
        .find(|(_, c)| c.contains(victim["id"].as_str().unwrap()))
        .expect("victim process");
    unsafe { libc_kill(pid as i32, 9) };
    wait_for("the killed node to be gone", Duration::from_secs(5), || {
        (!ws.processes().iter().any(|(p, _)| *p == pid)).then_some(())
    });
    let o = ws.tf(&["apply", "-refresh-only", "-auto-approve", "-no-color"]);
    assert_eq!(o.code, 0, "{}", o.all());
    let after = nodes(&ws);
    let dead = after
        .iter()
        .find(|n| n["id"] == victim["id"])
        .expect("dead node still listed");
    assert_eq!(dead["state"], "failed");
    assert_eq!(
        ws.plan().code,
        2,
        "a failed node must make the plan non-empty"
    );
    ws.apply();
    let healed = nodes(&ws);
    assert_eq!(healed.len(), 2);
    assert!(
        healed
            .iter()
            .all(|n| n["state"] == "active" && n["id"] != victim["id"]),
        "{healed:?}"
    );
    assert_eq!(dig(&dns, "grp.lbscale.test"), ips(&healed));
    ws.assert_plan_empty("healing");

    // Renaming forces a replacement: new group, old nodes gone.
    let old_id = ws.resource("lbscale_autoscale_group.g")["id"]
        .as_str()
        .unwrap()
        .to_string();
    ws.write(&config("web2", 1, 1, "5m"));
    let o = ws.plan();
    assert!(o.stdout.contains("must be replaced"), "{}", o.stdout);
    ws.apply();
    let new_id = ws.resource("lbscale_autoscale_group.g")["id"]
        .as_str()
        .unwrap()
        .to_string();
    assert_ne!(old_id, new_id);
    assert_eq!(ws.store().rows_mentioning(&old_id).unwrap(), 0);
    assert!(!ws
        .processes()
        .iter()
        .any(|(_, c)| healed.iter().any(|n| c.contains(n["id"].as_str().unwrap()))));
    ws.assert_plan_empty("replacement");

    let last = nodes(&ws);
    ws.destroy();
    let mut addrs: Vec<(String, u16)> = last
        .iter()
        .map(|n| (n["private_ip"].as_str().unwrap().to_string(), 9990))
        .collect();
    let (dns_ip, dns_port) = dns.rsplit_once(':').unwrap();
    addrs.push((dns_ip.to_string(), dns_port.parse().unwrap()));
    ws.assert_nothing_left(&addrs);
}

extern "C" {
    #[link_name = "kill"]
    fn libc_kill(pid: i32, sig: i32) -> i32;
}

#[test]
fn an_apply_that_times_out_names_the_step_and_the_next_apply_recovers() {
    let mut ws = Workspace::new("timeout", 119);
    let body = |timeout: &str| {
        config("slow", 1, 2, "10m").replace(
            "drain_timeout          = \"5s\"",
            &format!("drain_timeout          = \"5s\"\n  apply_timeout          = \"{timeout}\""),
        )
    };
    ws.write(&body("1ms"));
    let o = ws.tf(&["apply", "-auto-approve", "-no-color"]);
    assert_eq!(o.code, 1, "{}", o.all());
    let diags = diagnostics(&o.all());
    assert!(
        diags.iter().any(|d| d.text.contains("timed out after")
            && d.text
                .contains("at step \"wait for the node to be active\"")),
        "{diags:#?}"
    );
    // The group was created (its nodes exist): Terraform keeps it, tainted.
    let o = ws.tf(&["state", "list"]);
    assert!(
        o.stdout.contains("lbscale_autoscale_group.g"),
        "{}",
        o.all()
    );
    let o = ws.plan();
    assert!(
        o.stdout.contains("is tainted, so must be replaced"),
        "{}",
        o.all()
    );

    ws.write(&body("2m"));
    ws.apply();
    ws.assert_plan_empty("recovering from a timeout");
    let g = ws.resource("lbscale_autoscale_group.g");
    assert_eq!(g["node_count"], 2);
    assert_eq!(
        ws.store().count_rows("groups").unwrap(),
        1,
        "the tainted group was removed"
    );

    // The node API token lives in the store only: never in Terraform's state,
    // never in a log.
    let token = ws.engine().group_token(g["id"].as_str().unwrap()).unwrap();
    assert!(!token.is_empty(), "the group has a token");
    let state = std::fs::read_to_string(ws.dir.join("terraform.tfstate")).unwrap();
    assert!(
        !state.contains(&token),
        "the token leaked into terraform.tfstate"
    );
    let mut logs = String::new();
    for dir in ["nodes", "distributors"] {
        for d in std::fs::read_dir(ws.dir.join(".lbscale/local").join(dir))
            .unwrap()
            .flatten()
        {
            for f in std::fs::read_dir(d.path()).unwrap().flatten() {
                if f.path().extension().is_some_and(|x| x == "log") {
                    logs.push_str(&std::fs::read_to_string(f.path()).unwrap());
                }
            }
        }
    }
    assert!(
        !logs.is_empty() && !logs.contains(&token),
        "the token leaked into a log"
    );
    ws.destroy();
    ws.assert_nothing_left(&[]);
}
