//! Crash-safe workflows (spec §4): a daemon killed at any step of scale-out or
//! scale-in — `LBSCALE_FAULT=<point>` makes it abort there, like SIGKILL — is
//! followed by a daemon that resumes at the right step. After the resume, within
//! a bounded time:
//!
//! - every `lbscale-node` process of the workspace is a node in the store, and
//!   every node in the store has its process (no orphan, nothing forgotten);
//! - every address the DNS distributor answers (real `dig`) is a registered node
//!   whose process runs, and every registered node is answered;
//! - no node is left in a transient state; the count is within min..max;
//! - `terraform plan` is empty; destroy leaves nothing.
//!
//! Throughout the resume, the DNS distributor never answers an address whose
//! node process is gone.

use lbscale_acceptance::*;
use std::collections::BTreeSet;
use std::os::unix::process::ExitStatusExt;
use std::sync::atomic::{AtomicU16, Ordering};
use std::time::{Duration, Instant};

const SIGABRT: i32 = 6;

/// Scale out above 8 Mbps per node (the load generator), scale in below 1 Mbps
/// (idle). One AZ, min 1, max 2.
fn config(name: &str, backend: u16) -> String {
    config_with(name, backend, 2, "2s")
}

fn config_with(name: &str, backend: u16, max_nodes: u32, cooldown: &str) -> String {
    daemon_stack(name, backend, max_nodes, cooldown)
}

/// Every daemon of this file listens on a port of its own.
static NEXT_PORT: AtomicU16 = AtomicU16::new(19480);

/// Starts a daemon on a port of its own; `fault` arms `LBSCALE_FAULT`.
fn start_daemon(ws: &Workspace, tag: &str, fault: Option<&str>) -> Daemon {
    let port = NEXT_PORT.fetch_add(1, Ordering::SeqCst);
    match fault {
        Some(f) => Daemon::start_with(ws, port, tag, &[("LBSCALE_FAULT", f)]),
        None => Daemon::start(ws, port, tag),
    }
}

/// Scale-out workflows the daemon has finished (its /metrics).
fn workflows(d: &Daemon, step: &str) -> f64 {
    let m = d.get("/metrics").map(|r| r.1).unwrap_or_default();
    let series = format!("lbscale_workflow_seconds_count{{step=\"{step}\"}}");
    m.lines()
        .find_map(|l| {
            l.strip_prefix(series.as_str())
                .and_then(|r| r.trim().parse().ok())
        })
        .unwrap_or(0.0)
}

/// Waits (bounded) for the armed daemon to abort at `point`.
fn wait_aborted(mut d: Daemon, point: &str, within: Duration) {
    let Some(status) = d.wait_exit(within) else {
        panic!(
            "the daemon armed with LBSCALE_FAULT={point} did not abort within {within:?}:\n{}",
            d.logs()
        );
    };
    assert_eq!(
        status.signal(),
        Some(SIGABRT),
        "the daemon must die by abort at {point}, got {status}:\n{}",
        d.logs()
    );
    assert!(
        d.logs()
            .contains(&format!("LBSCALE_FAULT={point}: aborting")),
        "{}",
        d.logs()
    );
}

/// Node processes of the workspace: (node id, listen ip).
fn node_processes(ws: &Workspace) -> Vec<(String, String)> {
    ws.processes()
        .into_iter()
        .filter_map(|(_, cmd)| {
            let args: Vec<&str> = cmd.split_whitespace().collect();
            let after = |flag: &str| {
                args.iter()
                    .position(|a| *a == flag)
                    .and_then(|i| args.get(i + 1))
                    .map(|s| s.to_string())
            };
            Some((after("--node-id")?, after("--listen-ip")?))
        })
        .collect()
}

fn rows(ws: &Workspace, group: &str) -> Vec<lbscale_engine::store::NodeRow> {
    let engine = ws.engine();
    let g = engine
        .group_named(group)
        .unwrap()
        .expect("group in the store");
    engine.node_rows(&g.id).unwrap()
}

fn events(ws: &Workspace, group: &str) -> Vec<lbscale_engine::store::Event> {
    let engine = ws.engine();
    let g = engine
        .group_named(group)
        .unwrap()
        .expect("group in the store");
    engine.events(&g.id, 10_000).unwrap()
}

/// The safety half, which must hold at every instant: DNS answers only
/// addresses whose node process runs.
fn assert_dns_safe(ws: &Workspace, dns: &str, domain: &str, when: &str) -> Vec<String> {
    let answered = dig(dns, domain);
    let procs = node_processes(ws);
    for ip in &answered {
        assert!(
            procs.iter().any(|(_, p)| p == ip),
            "{when}: DNS answers {ip}, whose node process is gone (processes: {procs:?})"
        );
    }
    answered
}

/// Waits (bounded) until the group is settled and every invariant holds; the
/// safety half is asserted at every poll. Returns the nodes (id, ip).
fn wait_settled(
    ws: &Workspace,
    dns: &str,
    group: &str,
    when: &str,
    within: Duration,
) -> Vec<(String, String)> {
    let domain = format!("{group}.lbscale.test");
    let deadline = Instant::now() + within;
    loop {
        let answered = assert_dns_safe(ws, dns, &domain, when);
        let rs = rows(ws, group);
        let procs: BTreeSet<(String, String)> = node_processes(ws).into_iter().collect();
        let stored: BTreeSet<(String, String)> = rs
            .iter()
            .map(|r| (r.id.clone(), r.private_ip.clone()))
            .collect();
        let registered: BTreeSet<String> = rs
            .iter()
            .filter(|r| r.registered)
            .map(|r| r.private_ip.clone())
            .collect();
        let all_active = rs
            .iter()
            .all(|r| r.state.as_str() == "active" && r.registered);
        let dns_set: BTreeSet<String> = answered.iter().cloned().collect();
        if all_active && procs == stored && dns_set == registered && (1..=2).contains(&rs.len()) {
            return stored.into_iter().collect();
        }
        let last = format!(
            "rows {:?}; processes {procs:?}; DNS {answered:?}",
            rs.iter()
                .map(|r| format!(
                    "{} {} {} reg={}",
                    r.id,
                    r.private_ip,
                    r.state.as_str(),
                    r.registered
                ))
                .collect::<Vec<_>>()
        );
        assert!(
            Instant::now() < deadline,
            "{when}: not settled within {within:?}: {last}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn apply_group(ws: &mut Workspace, name: &str, backend: u16) -> (String, String) {
    apply_config(ws, name, &config(name, backend))
}

fn apply_config(ws: &mut Workspace, name: &str, config: &str) -> (String, String) {
    ws.write(config);
    ws.apply();
    let dns = ws.outputs()["dns"]["value"].as_str().unwrap().to_string();
    let first = dig(&dns, &format!("{name}.lbscale.test"));
    assert_eq!(first.len(), 1, "one node after apply: {first:?}");
    (dns, first[0].clone())
}

const BOUND: Duration = Duration::from_secs(40);

#[test]
fn a_daemon_killed_during_scale_out_is_resumed_by_the_next() {
    let t0 = Instant::now();
    let backend = big_backend();
    let mut ws = Workspace::new("faults-out", 123);
    let (dns, first_ip) = apply_group(&mut ws, "fout", backend);
    let domain = "fout.lbscale.test";
    for point in [
        "after_node_row",
        "after_provision",
        "after_configure",
        "after_register",
    ] {
        let before: BTreeSet<String> = rows(&ws, "fout").into_iter().map(|r| r.id).collect();
        assert_eq!(before.len(), 1, "{point}: one node before the scale-out");
        let armed = start_daemon(&ws, &format!("{point}-armed"), Some(point));
        let load = Load::start(&first_ip, domain);
        wait_aborted(armed, point, BOUND);
        load.stop();
        let new: Vec<_> = rows(&ws, "fout")
            .into_iter()
            .filter(|r| !before.contains(&r.id))
            .collect();
        assert_eq!(
            new.len(),
            1,
            "{point}: the crashed scale-out left its node row"
        );
        let new_id = new[0].id.clone();

        let resumed = start_daemon(&ws, &format!("{point}-resume"), None);
        let nodes = wait_settled(&ws, &dns, "fout", &format!("resume after {point}"), BOUND);
        assert!(
            nodes.iter().any(|(_, ip)| *ip == first_ip),
            "{point}: the first node must stay: {nodes:?}"
        );
        let ev = events(&ws, "fout");
        match point {
            // Nothing ran yet, or a process whose pid was never recorded: removed.
            "after_node_row" | "after_provision" => assert!(
                ev.iter()
                    .any(|e| e.kind == "node_removed" && e.reason.contains(&new_id)),
                "{point}: the half-provisioned node {new_id} is removed"
            ),
            // Finished: it became active and registered (before any scale-in).
            _ => assert!(
                ev.iter()
                    .any(|e| e.kind == "node_registered" && e.reason.contains(&new_id)),
                "{point}: the new node {new_id} is registered"
            ),
        }
        // Back to one node (the resumed daemon scales the idle group in) before
        // the next point, and still settled after that. The plan is checked only
        // then: while the idle group is being scaled in, a refresh sees a node
        // draining, and the plan rightly proposes to act.
        wait_for(
            &format!("{point}: the idle group back to one node"),
            BOUND,
            || {
                assert_dns_safe(&ws, &dns, domain, point);
                (rows(&ws, "fout").len() == 1).then_some(())
            },
        );
        wait_settled(&ws, &dns, "fout", &format!("scale-in after {point}"), BOUND);
        ws.assert_plan_empty(&format!("the resume after {point}"));
        resumed.stop();
    }
    ws.destroy();
    ws.assert_nothing_left(&[]);
    eprintln!(
        "MEASURE scale-out fault points: {} s",
        t0.elapsed().as_secs()
    );
}

#[test]
fn a_daemon_killed_during_scale_in_is_resumed_by_the_next() {
    let t0 = Instant::now();
    let backend = big_backend();
    let mut ws = Workspace::new("faults-in", 124);
    let (dns, first_ip) = apply_group(&mut ws, "fin", backend);
    let domain = "fin.lbscale.test";
    let mut current = start_daemon(&ws, "first", None);
    for point in [
        "after_deregister",
        "after_drain",
        "after_deprovision_before_delete",
    ] {
        // Two nodes first, without a fault.
        let load = Load::start(&first_ip, domain);
        wait_for(&format!("{point}: scale-out to 2"), BOUND, || {
            (workflows(&current, "scale_out") >= 1.0).then_some(())
        });
        load.stop();
        current.stop();
        let nodes = wait_settled(
            &ws,
            &dns,
            "fin",
            &format!("scale-out before {point}"),
            BOUND,
        );
        assert_eq!(nodes.len(), 2, "{point}: two nodes before the scale-in");
        let leaving = nodes
            .iter()
            .find(|(_, ip)| *ip != first_ip)
            .expect("the new node")
            .0
            .clone();

        let armed = start_daemon(&ws, &format!("{point}-armed"), Some(point));
        wait_aborted(armed, point, BOUND);
        let resumed = start_daemon(&ws, &format!("{point}-resume"), None);
        let nodes = wait_settled(&ws, &dns, "fin", &format!("resume after {point}"), BOUND);
        assert_eq!(
            nodes.iter().map(|(_, ip)| ip.clone()).collect::<Vec<_>>(),
            vec![first_ip.clone()],
            "{point}: the scale-in finished with the first node left"
        );
        let removed = events(&ws, "fin")
            .into_iter()
            .filter(|e| e.kind == "node_removed" && e.reason.contains(&leaving))
            .count();
        assert_eq!(removed, 1, "{point}: node {leaving} removed exactly once");
        ws.assert_plan_empty(&format!("the resume after {point}"));
        current = resumed;
    }
    current.stop();
    ws.destroy();
    ws.assert_nothing_left(&[]);
    eprintln!(
        "MEASURE scale-in fault points: {} s",
        t0.elapsed().as_secs()
    );
}

/// Issue 4: the per-AZ policy state is in the store, so a daemon killed during a
/// cooldown is followed by one that keeps it. The load stays above max
/// throughout: a daemon that started the AZ afresh would scale out again a
/// watch time after taking the group over; this one waits for the persisted end
/// of the cooldown, then scales out.
#[test]
fn a_daemon_killed_in_a_cooldown_is_followed_by_one_that_keeps_it() {
    let t0 = Instant::now();
    let backend = big_backend();
    let mut ws = Workspace::new("faults-cooldown", 125);
    let (_dns, first_ip) = apply_config(&mut ws, "fcool", &config_with("fcool", backend, 3, "20s"));
    let domain = "fcool.lbscale.test";
    let group_id = ws.engine().group_named("fcool").unwrap().unwrap().id;

    let first = start_daemon(&ws, "first", None);
    let load = Load::start(&first_ip, domain);
    wait_for("the first scale-out", BOUND, || {
        (workflows(&first, "scale_out") >= 1.0).then_some(())
    });
    // The policy state as the store holds it: `{"phase": {"kind": "cooldown",
    // "until": ms}, ...}`.
    let until = wait_for("the cooldown in the store", BOUND, || {
        let row = ws
            .engine()
            .policy_states(&group_id)
            .unwrap()
            .into_iter()
            .find(|r| r.az == "az1")?;
        let state = serde_json::to_value(row.state).unwrap();
        (state["phase"]["kind"] == "cooldown")
            .then(|| state["phase"]["until"].as_u64())
            .flatten()
    });
    drop(first); // SIGKILL
    assert_eq!(rows(&ws, "fcool").len(), 2, "two nodes after the scale-out");

    // The second daemon takes the group over once the dead one's claim expires,
    // within the cooldown, and shows the persisted end of it.
    let second = start_daemon(&ws, "second", None);
    let shown = wait_for(
        "the second daemon to take the group over in the cooldown",
        BOUND,
        || {
            let (_, body) = daemon_get(second.port, "/v1/groups").ok()?;
            let v: serde_json::Value = serde_json::from_str(&body).ok()?;
            let g = &v["groups"][0];
            (g["owner"] == "self" && g["azs"][0]["phase"] == "cooldown")
                .then(|| g["azs"][0]["wait_until_ms"].as_u64())
                .flatten()
        },
    );
    assert_eq!(shown, until, "the persisted cooldown, not a new one");

    // Load above max all along: the next scale-out comes, but only after the
    // cooldown that the first daemon started.
    wait_for("the scale-out after the cooldown", BOUND, || {
        (workflows(&second, "scale_out") >= 1.0).then_some(())
    });
    load.stop();
    let outs: Vec<i64> = events(&ws, "fcool")
        .into_iter()
        .filter(|e| e.kind == "scale_out")
        .map(|e| e.time_ms)
        .collect();
    assert_eq!(outs.len(), 2, "two scale-outs: {outs:?}");
    assert!(
        outs[1] >= until as i64,
        "the second scale-out at {} ms came before the persisted cooldown ended at {until} ms",
        outs[1]
    );
    assert!(
        second
            .logs()
            .contains("resuming the AZ's persisted policy state"),
        "{}",
        second.logs()
    );
    second.stop();
    ws.destroy();
    ws.assert_nothing_left(&[]);
    eprintln!(
        "MEASURE cooldown across a restart: {} s",
        t0.elapsed().as_secs()
    );
}

/// A resume that keeps failing is retried after a back-off, not at every
/// evaluation, and says so (event, /v1/groups, /metrics); once the cause is
/// gone, the next daemon's resume repairs the group. The cause here: the
/// group's only node died, and the daemon cannot start a replacement (its node
/// binary does not exist).
#[test]
fn a_resume_that_keeps_failing_backs_off_and_a_later_one_repairs() {
    let backend = big_backend();
    let mut ws = Workspace::new("faults-resume", 128);
    let (dns, first_ip) = apply_group(&mut ws, "fres", backend);
    let dead = rows(&ws, "fres").remove(0);
    let pid = dead.handle["pid"].as_u64().expect("the node's pid") as u32;
    sigkill(pid);
    wait_for("the node process to die", Duration::from_secs(5), || {
        (!std::path::Path::new(&format!("/proc/{pid}")).exists()).then_some(())
    });

    let missing = ws.dir.join("no-such-dir/lbscale-node");
    let port = NEXT_PORT.fetch_add(1, Ordering::SeqCst);
    let broken = Daemon::start_using(&ws, port, "broken", &[], &missing);
    let backoff = wait_for("a failed resume", Duration::from_secs(20), || {
        let b = broken.group("fres")["resume_backoff"].clone();
        (!b.is_null()).then_some(b)
    });
    let failed_at = lbscale_engine::store::now_ms() as i64;
    assert_eq!(backoff["failures"], 1, "{backoff}");
    let retry_in = backoff["retry_at_ms"].as_i64().unwrap() - failed_at;
    assert!(
        (20_000..=30_000).contains(&retry_in),
        "the first retry is 30 s after the failure, in {retry_in} ms"
    );
    assert!(
        backoff["error"].as_str().unwrap().contains("lbscale-node"),
        "the error names what is wrong: {backoff}"
    );
    let ev = events(&ws, "fres");
    let failed = ev
        .iter()
        .find(|e| e.kind == "resume_failed")
        .expect("a resume_failed event");
    // The reason is the error, in the same words each time (so repeats
    // collapse into one event); when it is retried is the status's.
    assert!(
        failed.reason.contains("failed: ") && failed.reason.contains("lbscale-node"),
        "{}",
        failed.reason
    );
    // Evaluations go on every second; the resume is not retried meanwhile.
    std::thread::sleep(Duration::from_secs(4));
    assert_eq!(broken.group("fres")["resume_backoff"]["failures"], 1);
    let metrics = broken.metrics();
    assert!(
        metrics.contains("lbscale_resume_failures_total{group=\"fres\"} 1"),
        "{metrics}"
    );
    assert_eq!(
        events(&ws, "fres")
            .iter()
            .filter(|e| e.kind == "resume_failed")
            .count(),
        1
    );
    broken.stop();

    // The cause gone, the next daemon's resume replaces the dead node.
    let good = start_daemon(&ws, "good", None);
    let nodes = wait_settled(&ws, &dns, "fres", "the repairing resume", BOUND);
    assert_eq!(nodes.len(), 1, "{nodes:?}");
    assert!(
        nodes.iter().all(|(id, _)| *id != dead.id),
        "the dead node was replaced: {nodes:?} (it was {} at {first_ip})",
        dead.id
    );
    assert!(good.group("fres")["resume_backoff"].is_null());
    good.stop();
    ws.assert_plan_empty("after the repair");
    ws.destroy();
    ws.assert_nothing_left(&[]);
}
