//! Publications are level-triggered (docs/design.md): what the distributor
//! serves is compared with what the store wants at every stats interval, so a
//! publication that failed is finished by the daemon once the distributor can
//! be written again. Here the local `dns` distributor's configuration file is
//! replaced by a directory (every write fails), then restored:
//!
//! - a node that joined while the distributor could not be written is
//!   answered by DNS (a real `dig`) within two stats intervals of the restore;
//! - a node that died meanwhile leaves DNS within two stats intervals of the
//!   restore, and only then is its row forgotten.
//!
//! The waits are bounded by two intervals plus a grace for the DNS server to
//! load its new configuration; the time measured is printed.

use lbscale_acceptance::*;
use std::path::PathBuf;
use std::time::{Duration, Instant};

const INTERVAL_S: u64 = 2;

fn config(min_nodes: u32) -> String {
    format!(
        r#"
resource "lbscale_traffic_distributor" "d" {{
  name   = "pub-dns"
  cloud  = "local"
  mode   = "dns"
  domain = "pub.lbscale.test"
  ttl    = "1s"
}}

resource "lbscale_autoscale_group" "g" {{
  name                   = "pub"
  cloud                  = "local"
  availability_zones     = ["az1"]
  traffic_distributor_id = lbscale_traffic_distributor.d.id
  min_nodes              = {min_nodes}
  max_nodes              = 2
  stats_interval         = "{INTERVAL_S}s"
  watch_time             = "{INTERVAL_S}s"
  cooldown               = "2s"
  drain_timeout          = "1s"
  apply_timeout          = "30s"
  threshold {{
    metric = "throughput"
    min    = 1
    max    = 8
  }}
}}

output "dns" {{ value = lbscale_traffic_distributor.d.address["dns"] }}
"#
    )
}

/// The local distributor's configuration file, made unwritable and restored.
struct Unwritable {
    path: PathBuf,
    saved: Vec<u8>,
}

impl Unwritable {
    fn make(path: PathBuf) -> Unwritable {
        let saved = std::fs::read(&path).expect("the distributor's configuration");
        std::fs::remove_file(&path).unwrap();
        std::fs::create_dir(&path).unwrap();
        Unwritable { path, saved }
    }

    /// Restores the file as it was; returns when.
    fn restore(self) -> Instant {
        std::fs::remove_dir(&self.path).unwrap();
        std::fs::write(&self.path, &self.saved).unwrap();
        Instant::now()
    }
}

fn kill_node(node_id: &str) {
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(cmd) = std::fs::read(e.path().join("cmdline")) else {
            continue;
        };
        let args: Vec<&[u8]> = cmd.split(|b| *b == 0).collect();
        if args
            .windows(2)
            .any(|w| w[0] == b"--node-id" && w[1] == node_id.as_bytes())
        {
            let pid = e.file_name().to_string_lossy().into_owned();
            assert!(std::process::Command::new("kill")
                .args(["-KILL", &pid])
                .status()
                .unwrap()
                .success());
        }
    }
}

#[test]
fn a_failed_publication_is_finished_by_the_daemon_within_two_stats_intervals() {
    let mut ws = Workspace::new("daemon-publication", 205);
    ws.write(&config(1));
    ws.apply();
    let dns = ws.outputs()["dns"]["value"].as_str().unwrap().to_string();
    let domain = "pub.lbscale.test";
    let distributor = ws.resource("lbscale_traffic_distributor.d")["id"]
        .as_str()
        .unwrap()
        .to_string();
    let group = ws.resource("lbscale_autoscale_group.g")["id"]
        .as_str()
        .unwrap()
        .to_string();
    let file = ws
        .dir
        .join(".lbscale/local/distributors")
        .join(&distributor)
        .join("config.json");
    assert_eq!(dig(&dns, domain).len(), 1);
    let daemon = Daemon::start(&ws, 19590, "pub");
    let bound = Duration::from_secs(2 * INTERVAL_S + 3);

    // A joining node: the apply that adds it fails at the publication.
    let broken = Unwritable::make(file.clone());
    ws.write(&config(2));
    let o = ws.tf(&["apply", "-auto-approve", "-no-color", "-input=false"]);
    assert_ne!(
        o.code, 0,
        "the apply published through an unwritable distributor"
    );
    let active: Vec<String> = ws
        .engine()
        .node_rows(&group)
        .unwrap()
        .into_iter()
        .filter(|n| n.state == lbscale_engine::store::NodeState::Active)
        .map(|n| n.private_ip)
        .collect();
    assert_eq!(active.len(), 2, "the second node joined: {active:?}");
    assert_eq!(dig(&dns, domain).len(), 1, "not answered yet");
    let restored = broken.restore();
    wait_for(
        "DNS to answer the joined node after the restore",
        bound,
        || (dig(&dns, domain).len() == 2).then_some(()),
    );
    println!(
        "joined node answered {:.1} s after the restore (stats interval {INTERVAL_S} s)",
        restored.elapsed().as_secs_f64()
    );
    ws.apply();

    // A dead node: it stays in DNS while the distributor cannot be written.
    let rows = ws.engine().node_rows(&group).unwrap();
    let dead = rows.iter().max_by_key(|n| n.seq).unwrap().clone();
    let broken = Unwritable::make(file.clone());
    kill_node(&dead.id);
    std::thread::sleep(Duration::from_secs(2 * INTERVAL_S));
    assert!(
        ws.engine()
            .node_rows(&group)
            .unwrap()
            .iter()
            .any(|n| n.id == dead.id),
        "the dead node's row is kept until DNS is without it"
    );
    let restored = broken.restore();
    wait_for("DNS to drop the dead node after the restore", bound, || {
        (!dig(&dns, domain).contains(&dead.private_ip)).then_some(())
    });
    println!(
        "dead node dropped {:.1} s after the restore (stats interval {INTERVAL_S} s)",
        restored.elapsed().as_secs_f64()
    );
    // Then forgotten and replaced up to min_nodes.
    wait_for(
        "the dead node's row to go (after the failed resume's back-off)",
        Duration::from_secs(90),
        || {
            let rows = ws.engine().node_rows(&group).ok()?;
            rows.iter().all(|n| n.id != dead.id).then_some(())
        },
    );
    wait_for(
        "DNS to answer two nodes again",
        Duration::from_secs(60),
        || (dig(&dns, domain).len() == 2).then_some(()),
    );
    daemon.stop();
    ws.assert_plan_empty("the daemon repaired the group");
    ws.destroy();
    ws.assert_nothing_left(&[]);
}
