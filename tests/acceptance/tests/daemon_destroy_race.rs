//! `terraform destroy` while the daemon keeps scaling the group out (its
//! memory threshold always breaches), ten times: each destroy waits for the
//! daemon's workflow in the AZ, and a scale-out that read the group before the
//! destroy is refused its lease once the group is gone, so nothing of the
//! group remains: no node process, no row (leases included), no node
//! directory of the local cloud.

use lbscale_acceptance::*;
use std::time::Duration;

const ROUNDS: usize = 10;

fn config(name: &str) -> String {
    format!(
        r#"
resource "lbscale_traffic_distributor" "d" {{
  name   = "{name}-dns"
  cloud  = "local"
  mode   = "dns"
  domain = "{name}.lbscale.test"
  ttl    = "1s"
}}

resource "lbscale_autoscale_group" "g" {{
  name                   = "{name}"
  cloud                  = "local"
  availability_zones     = ["az1"]
  traffic_distributor_id = lbscale_traffic_distributor.d.id
  min_nodes              = 1
  max_nodes              = 4
  stats_interval         = "1s"
  watch_time             = "1s"
  cooldown               = "1s"
  drain_timeout          = "1s"
  # Any node uses more than 0.01 % of its memory budget: always a breach.
  threshold {{
    metric = "memory"
    min    = 0.001
    max    = 0.01
  }}
}}
"#
    )
}

/// Directories of the local cloud's nodes left in the workspace.
fn node_dirs(ws: &Workspace) -> Vec<String> {
    let mut out = Vec::new();
    let mut stack = vec![ws.dir.clone()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in entries.flatten() {
            let p = e.path();
            if !p.is_dir() {
                continue;
            }
            if d.file_name().is_some_and(|n| n == "nodes")
                && d.parent().is_some_and(|p| p.ends_with("local"))
            {
                out.push(p.display().to_string());
            } else {
                stack.push(p);
            }
        }
    }
    out
}

#[test]
fn destroy_while_the_daemon_scales_out_leaves_nothing_ten_times() {
    let mut ws = Workspace::new("destroy-race", 204);
    let daemon_port = 19560;
    for round in 1..=ROUNDS {
        let name = format!("race{round}");
        ws.write(&config(&name));
        ws.apply();
        let group = ws.resource("lbscale_autoscale_group.g")["id"]
            .as_str()
            .expect("the group's id")
            .to_string();
        let daemon = Daemon::start(&ws, daemon_port, &format!("race{round}"));
        // Destroy once the daemon is scaling out (a second node on its way),
        // at a point that moves from round to round.
        wait_for(
            "the daemon to start a scale-out",
            Duration::from_secs(60),
            || {
                let events = ws.engine().events(&group, 1000).ok()?;
                events.iter().any(|e| e.kind == "scale_out").then_some(())
            },
        );
        std::thread::sleep(Duration::from_millis(150 * (round as u64 % 5)));
        ws.destroy();
        let store = ws.store();
        assert_eq!(
            store.rows_mentioning(&group).unwrap(),
            0,
            "round {round}: rows of the group are left (leases included)"
        );
        ws.assert_nothing_left(&[]);
        // The daemon keeps running a little: nothing of the group comes back.
        std::thread::sleep(Duration::from_secs(2));
        assert!(
            ws.processes().is_empty(),
            "round {round}: {:?}",
            ws.processes()
        );
        assert_eq!(store.rows_mentioning(&group).unwrap(), 0, "round {round}");
        let dirs = node_dirs(&ws);
        assert!(
            dirs.is_empty(),
            "round {round}: node directories left: {dirs:?}"
        );
        daemon.stop();
    }
}
