//! `lbscale_traffic_distributor`, `lbscale_se_group` and `lbscale_vserver` under
//! real Terraform, and traffic end to end: a real DNS query to the `dns`
//! distributor, then HTTP through a node to a backend; the same through an `nlb`
//! VIP; and a TCP vserver.

use lbscale_acceptance::*;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

struct Backends {
    a: u16,
    b: u16,
    tcp: u16,
}

fn stack(
    mode: &str,
    ttl: &str,
    forwarding_cost: &str,
    weight_b: i64,
    backends: &Backends,
    extra_service: bool,
) -> String {
    let domain = if mode == "dns" {
        "  domain = \"shop.lbscale.test\"\n"
    } else {
        ""
    };
    let extra = if extra_service {
        format!(
            r#"
  service {{
    name    = "c"
    address = "127.0.0.1"
    port    = {}
    enabled = false
  }}"#,
            backends.a
        )
    } else {
        String::new()
    };
    format!(
        r#"
resource "lbscale_traffic_distributor" "d" {{
  name  = "shop-{mode}"
  cloud = "local"
  mode  = "{mode}"
  ttl   = "{ttl}"
{domain}}}

resource "lbscale_autoscale_group" "g" {{
  name                   = "shop"
  cloud                  = "local"
  availability_zones     = ["az1"]
  traffic_distributor_id = lbscale_traffic_distributor.d.id
  min_nodes              = 2
  max_nodes              = 4
  drain_timeout          = "3s"
  threshold {{
    metric = "cpu"
    min    = 10
    max    = 70
  }}
}}

resource "lbscale_se_group" "s" {{
  name                    = "shop-se"
  autoscale_group_id      = lbscale_autoscale_group.g.id
  primary_forwarding_cost = {forwarding_cost}
}}

resource "lbscale_vserver" "web" {{
  name         = "shop-web"
  se_group_id  = lbscale_se_group.s.id
  service_type = "HTTP"
  port         = 8080
  lb_method    = "ROUNDROBIN"
  service {{
    name    = "a"
    address = "127.0.0.1"
    port    = {a}
  }}
  service {{
    name    = "b"
    address = "127.0.0.1"
    port    = {b}
    weight  = {weight_b}
  }}{extra}
  slow_start {{
    new_service_request = 5
    increment_interval  = 10
  }}
}}

resource "lbscale_vserver" "tcp" {{
  name         = "shop-tcp"
  se_group_id  = lbscale_se_group.s.id
  service_type = "TCP"
  port         = 9000
  service {{
    name    = "echo"
    address = "127.0.0.1"
    port    = {tcp}
  }}
}}

# What the distributor hands out now, read once the vservers are applied.
data "lbscale_traffic_distributor" "d" {{
  name       = lbscale_traffic_distributor.d.name
  depends_on = [lbscale_vserver.web, lbscale_vserver.tcp]
}}

output "address" {{ value = data.lbscale_traffic_distributor.d.address }}
output "endpoints" {{ value = data.lbscale_traffic_distributor.d.endpoints }}
output "vip" {{ value = lbscale_vserver.web.vip }}
"#,
        a = backends.a,
        b = backends.b,
        tcp = backends.tcp,
    )
}

fn backends() -> Backends {
    Backends {
        a: http_backend("backend-a"),
        b: http_backend("backend-b"),
        tcp: tcp_backend("echo"),
    }
}

/// Sends `n` requests to `ip:8080` and counts which backend answered each.
fn spread(ip: &str, n: usize) -> (usize, usize, Vec<String>) {
    let (mut a, mut b, mut nodes) = (0, 0, Vec::new());
    for _ in 0..n {
        let (status, headers, body) =
            http_get(ip, 8080, "shop.lbscale.test").expect("request through the vserver");
        assert_eq!(status, 200, "{headers:?} {body}");
        match body.trim() {
            "backend-a" => a += 1,
            "backend-b" => b += 1,
            other => panic!("unexpected body {other:?}"),
        }
        if let Some(n) = header(&headers, "x-lbscale-node") {
            nodes.push(n.to_string());
        }
    }
    (a, b, nodes)
}

fn tcp_roundtrip(ip: &str, port: u16) -> String {
    let mut s = TcpStream::connect_timeout(
        &format!("{ip}:{port}").parse().unwrap(),
        Duration::from_secs(3),
    )
    .expect("connect to the TCP vserver");
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s.write_all(b"ping\n").unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 64];
    while got.len() < "echo\nping\n".len() {
        let n = s.read(&mut buf).expect("read from the TCP vserver");
        assert!(
            n > 0,
            "connection closed early: {:?}",
            String::from_utf8_lossy(&got)
        );
        got.extend_from_slice(&buf[..n]);
    }
    String::from_utf8_lossy(&got).into_owned()
}

#[test]
fn dns_distributor_vservers_and_traffic() {
    let b = backends();
    let mut ws = Workspace::new("dns", 112);
    ws.write(&stack("dns", "1s", "0.3", 1, &b, false));
    ws.apply();
    ws.assert_plan_empty("create");

    // A real DNS query, then HTTP through each node it names.
    let out = ws.outputs();
    let dns = out["address"]["value"]["dns"].as_str().unwrap().to_string();
    let resolved = dig(&dns, "shop.lbscale.test");
    assert_eq!(resolved.len(), 2, "{resolved:?}");
    let mut endpoints: Vec<String> = out["endpoints"]["value"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap().to_string())
        .collect();
    endpoints.sort();
    assert_eq!(endpoints, resolved);
    assert_eq!(out["vip"]["value"]["az1"], "shop.lbscale.test:8080");
    for ip in &resolved {
        let (a, bb, nodes) = spread(ip, 10);
        assert_eq!(
            (a, bb),
            (5, 5),
            "round robin over equal weights through {ip}"
        );
        assert!(
            !nodes.is_empty() && nodes.iter().all(|n| n == &nodes[0]),
            "one node answers on {ip}: {nodes:?}"
        );
        assert_eq!(tcp_roundtrip(ip, 9000), "echo\nping\n");
    }
    assert_eq!(
        ws.resource("lbscale_vserver.web")["slow_start_summary"],
        "New Service Startup Request Rate: 5 PER_SECOND, Increment Interval: 10"
    );

    // In place: ttl (distributor), forwarding cost (SE group), a weight and a
    // disabled service (vserver). Nothing is replaced and the nodes stay.
    let node_ips = resolved.clone();
    ws.write(&stack("dns", "2s", "0.45", 3, &b, true));
    let o = ws.plan();
    assert_eq!(o.code, 2, "{}", o.all());
    assert!(
        o.stdout.contains("0 to add, 3 to change, 0 to destroy"),
        "{}",
        o.stdout
    );
    ws.apply();
    ws.assert_plan_empty("in-place updates");
    assert_eq!(dig(&dns, "shop.lbscale.test"), node_ips);
    let (a, bb, _) = spread(&node_ips[0], 8);
    assert_eq!(
        (a, bb),
        (2, 6),
        "weights 1:3, the disabled service gets nothing"
    );
    assert_eq!(
        ws.resource("lbscale_se_group.s")["primary_forwarding_cost"],
        0.45
    );

    // se_tunnel_mode takes effect when nodes start: the plan says so, and the
    // apply replaces every node, one at a time, while traffic keeps flowing.
    let with_tunnel = stack("dns", "2s", "0.45", 3, &b, true).replace(
        "primary_forwarding_cost = 0.45",
        "primary_forwarding_cost = 0.45\n  se_tunnel_mode          = 2",
    );
    ws.write(&with_tunnel);
    let o = ws.plan();
    let warnings = diagnostics(&o.all());
    assert!(
        warnings.iter().any(|d| d.severity == "warning"
            && d.text
                .contains("restarts every node of the autoscale group, one at a time")),
        "{}",
        o.all()
    );
    ws.apply();
    ws.assert_plan_empty("a rolling restart");
    let restarted = dig(&dns, "shop.lbscale.test");
    assert_eq!(restarted.len(), 2, "{restarted:?}");
    assert!(
        restarted.iter().all(|ip| !node_ips.contains(ip)),
        "every node was replaced: {node_ips:?} -> {restarted:?}"
    );
    for ip in &node_ips {
        assert!(!Workspace::listening(ip, 9990), "old node {ip} still runs");
    }
    let (a, bb, _) = spread(&restarted[0], 4);
    assert_eq!(a + bb, 4);
    let node_ips = restarted;

    // Import every resource by name.
    ws.reimport("lbscale_vserver.web", "shop-web");
    ws.reimport("lbscale_vserver.tcp", "shop-tcp");
    ws.reimport("lbscale_se_group.s", "shop-se");
    ws.reimport("lbscale_traffic_distributor.d", "shop-dns");

    // Destroying the vservers closes their ports on every node.
    std::fs::write(
        ws.dir.join("main.tf"),
        format!(
            "{}\n{}",
            ws.header(),
            with_tunnel
                .split("resource \"lbscale_vserver\" \"web\"")
                .next()
                .unwrap()
        ),
    )
    .unwrap();
    ws.apply();
    for ip in &node_ips {
        assert!(
            !Workspace::listening(ip, 8080),
            "vserver port still open on {ip}"
        );
        assert!(
            !Workspace::listening(ip, 9000),
            "vserver port still open on {ip}"
        );
    }
    assert_eq!(ws.store().count_rows("vservers").unwrap(), 0);

    ws.destroy();
    let (dns_ip, dns_port) = dns.rsplit_once(':').unwrap();
    let mut addrs: Vec<(String, u16)> = node_ips.iter().map(|ip| (ip.clone(), 9990)).collect();
    addrs.push((dns_ip.to_string(), dns_port.parse().unwrap()));
    ws.assert_nothing_left(&addrs);
}

#[tokio::test(flavor = "multi_thread")]
async fn nlb_distributor_forwards_http_and_tcp_and_mode_change_replaces_it() {
    let b = backends();
    let mut ws = Workspace::new("nlb", 113);
    ws.write(&stack("nlb", "60s", "0.3", 1, &b, false));
    ws.apply();
    ws.assert_plan_empty("create");

    let out = ws.outputs();
    let vip = out["address"]["value"]["az1"]
        .as_str()
        .expect("a VIP for az1")
        .to_string();
    assert_eq!(out["vip"]["value"]["az1"], format!("{vip}:8080"));
    // Native SE scale-out (the default scaling_mode), and a vserver's span
    // starts at min_scaleout_per_vs (1): the VIP sends every connection to the
    // primary (the older node), which serves them all.
    let group_id = ws.resource("lbscale_autoscale_group.g")["id"]
        .as_str()
        .unwrap()
        .to_string();
    let web_id = ws.resource("lbscale_vserver.web")["id"]
        .as_str()
        .unwrap()
        .to_string();
    let mut nodes_by_age = ws.engine().node_rows(&group_id).unwrap();
    nodes_by_age.sort_by_key(|n| n.seq);
    let (primary, secondary) = (&nodes_by_age[0], &nodes_by_age[1]);
    let (a, bb, nodes) = spread(&vip, 12);
    assert_eq!(a + bb, 12);
    assert!(
        nodes.iter().all(|n| *n == primary.id),
        "a span of one: the primary serves everything: {nodes:?}"
    );
    assert_eq!(tcp_roundtrip(&vip, 9000), "echo\nping\n");

    // The daemon sizes the span from the holders' CPU; here it is set as the
    // daemon sets it: two nodes hold the vserver, the primary keeps its share
    // and forwards the rest to the secondary. With primary_forwarding_cost 0.3
    // the CPU-equalising shares of 2 nodes are 0.7/1.7 and 1/1.7 (seplan).
    let engine = ws.engine();
    engine
        .set_vserver_span(&group_id, &web_id, "az1", 2, "test: span 2", None)
        .await
        .unwrap();
    ws.assert_plan_empty("a span change");
    let n = 170;
    let (_, _, served_by) = spread(&vip, n);
    let on_primary = served_by.iter().filter(|x| **x == primary.id).count();
    let on_secondary = served_by.iter().filter(|x| **x == secondary.id).count();
    assert_eq!(on_primary + on_secondary, n, "{served_by:?}");
    assert!(
        on_primary.abs_diff(70) <= 4,
        "the primary keeps 0.7/1.7 of {n} connections (70), kept {on_primary}"
    );
    let forwarded = ws.node_stats(primary).await.forwarded;
    assert!(
        forwarded
            .iter()
            .any(|f| f.peer.starts_with(&secondary.private_ip) && f.connections_total > 0),
        "the primary reports what it forwarded: {forwarded:?}"
    );
    // A span larger than the AZ (max_scaleout_per_vs, 4) takes every node, and
    // a node that joins the group joins the vserver at once.
    engine
        .set_vserver_span(&group_id, &web_id, "az1", 4, "test: span 4", None)
        .await
        .unwrap();

    // A node that joins (the daemon's scale-out workflow) becomes a secondary: the
    // primary now keeps the 3-node share and forwards the rest to both others.
    let added = engine.scale_out(&group_id, "az1", "test").await.unwrap();
    let native = |nodes: u32| {
        lbscale_core::seplan::plan(
            &lbscale_core::seplan::PlanParams {
                forwarding_cost: 0.3,
                ..Default::default()
            },
            nodes,
        )
        .shares
    };
    let shares = native(3);
    let n = 120;
    let (_, _, served_by) = spread(&vip, n);
    let count = |id: &str| served_by.iter().filter(|x| *x == id).count();
    for (id, share) in [primary.id.as_str(), secondary.id.as_str(), added.as_str()]
        .into_iter()
        .zip(&shares)
    {
        let want = share * n as f64;
        assert!(
            (count(id) as f64 - want).abs() <= 3.0,
            "{id} served {} of {n}, its share is {want:.1} ({served_by:?})",
            count(id)
        );
    }
    // It leaves again (scale-in): the primary stops forwarding to it.
    assert_eq!(
        engine.scale_in_one(&group_id, "az1", "test").await.unwrap(),
        added
    );
    let (_, _, served_by) = spread(&vip, 34);
    assert!(
        !served_by.contains(&added),
        "a node that left still served: {served_by:?}"
    );
    let on_primary = served_by.iter().filter(|x| **x == primary.id).count();
    assert!(
        (on_primary as f64 - native(2)[0] * 34.0).abs() <= 2.0,
        "back to the 2-node shares: {on_primary} of 34 on the primary"
    );

    // bgp: the VIP spreads flows over both nodes by a flow hash; nobody forwards.
    ws.write(&stack("nlb", "60s", "0.3", 1, &b, false).replace(
        "primary_forwarding_cost = 0.3",
        "primary_forwarding_cost = 0.3\n  scaling_mode            = \"bgp\"",
    ));
    ws.apply();
    ws.assert_plan_empty("scaling_mode bgp");
    let forwarded_total = |stats: lbscale_engine::nodeapi::NodeStats| -> u64 {
        stats.forwarded.iter().map(|f| f.connections_total).sum()
    };
    let before = forwarded_total(ws.node_stats(primary).await);
    let (_, _, served_by) = spread(&vip, 60);
    let on_primary = served_by.iter().filter(|x| **x == primary.id).count();
    assert!(
        (10..=50).contains(&on_primary),
        "flows spread over both nodes: {on_primary} of 60 on the first"
    );
    let after = forwarded_total(ws.node_stats(primary).await);
    assert_eq!(before, after, "with bgp no node forwards");

    // mode forces a replacement of the distributor (and the group follows it).
    let old_id = ws.resource("lbscale_traffic_distributor.d")["id"]
        .as_str()
        .unwrap()
        .to_string();
    ws.write(&stack("dns", "1s", "0.3", 1, &b, false));
    let o = ws.plan();
    assert!(
        o.stdout
            .contains("lbscale_traffic_distributor.d must be replaced"),
        "{}",
        o.stdout
    );
    ws.apply();
    ws.assert_plan_empty("replacing the distributor");
    assert_ne!(
        ws.resource("lbscale_traffic_distributor.d")["id"]
            .as_str()
            .unwrap(),
        old_id
    );
    assert!(
        !Workspace::listening(&vip, 8080),
        "the old VIP still forwards"
    );
    let dns = ws.outputs()["address"]["value"]["dns"]
        .as_str()
        .unwrap()
        .to_string();
    assert_eq!(dig(&dns, "shop.lbscale.test").len(), 2);

    ws.destroy();
    ws.assert_nothing_left(&[(vip, 8080)]);
}
