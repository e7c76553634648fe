//! A UDP vserver declared through Terraform in front of a backend that speaks
//! UDP only (nothing listens on its TCP port): with the default passive health
//! check the service stays UP and datagrams keep being relayed long after a
//! TCP connect check would have marked it DOWN (about 3 s after start).

use lbscale_acceptance::*;
use std::net::UdpSocket;
use std::time::Duration;

/// A UDP-only backend on 127.0.0.1: answers each datagram with `name:` and it.
fn udp_backend(name: &str) -> u16 {
    let socket = UdpSocket::bind("127.0.0.1:0").unwrap();
    let port = socket.local_addr().unwrap().port();
    let prefix = format!("{name}:");
    std::thread::spawn(move || {
        let mut buf = [0u8; 1500];
        while let Ok((n, from)) = socket.recv_from(&mut buf) {
            let mut answer = prefix.clone().into_bytes();
            answer.extend_from_slice(&buf[..n]);
            let _ = socket.send_to(&answer, from);
        }
    });
    port
}

/// One datagram to `ip:port`; the answer, if one comes within a second.
fn ask(ip: &str, port: u16, what: &str) -> Option<String> {
    let s = UdpSocket::bind("127.0.0.1:0").unwrap();
    s.set_read_timeout(Some(Duration::from_secs(1))).unwrap();
    s.send_to(what.as_bytes(), (ip, port)).unwrap();
    let mut buf = [0u8; 1500];
    let (n, _) = s.recv_from(&mut buf).ok()?;
    Some(String::from_utf8_lossy(&buf[..n]).into_owned())
}

#[test]
fn a_udp_vserver_to_a_udp_only_backend_keeps_serving() {
    let backend = udp_backend("udp1");
    let port = 19653;
    let mut ws = Workspace::new("udp-vserver", 206);
    ws.write(&format!(
        r#"
resource "lbscale_traffic_distributor" "d" {{
  name   = "udp-dns"
  cloud  = "local"
  mode   = "dns"
  domain = "udp.lbscale.test"
  ttl    = "1s"
}}

resource "lbscale_autoscale_group" "g" {{
  name                   = "udp"
  cloud                  = "local"
  availability_zones     = ["az1"]
  traffic_distributor_id = lbscale_traffic_distributor.d.id
  min_nodes              = 1
  max_nodes              = 1
  threshold {{
    metric = "cpu"
    min    = 10
    max    = 90
  }}
}}

resource "lbscale_se_group" "s" {{
  name               = "udp-se"
  autoscale_group_id = lbscale_autoscale_group.g.id
}}

resource "lbscale_vserver" "dns" {{
  name         = "udp-vs"
  se_group_id  = lbscale_se_group.s.id
  service_type = "UDP"
  port         = {port}
  service {{
    name    = "udp1"
    address = "127.0.0.1"
    port    = {backend}
  }}
}}
"#
    ));
    ws.apply();
    let group = ws.resource("lbscale_autoscale_group.g");
    let ip = group["nodes"][0]["private_ip"]
        .as_str()
        .expect("the node's address")
        .to_string();
    let first = wait_for(
        "the node to relay a datagram",
        Duration::from_secs(15),
        || ask(&ip, port, "hello"),
    );
    assert_eq!(first, "udp1:hello");
    // Past the time a TCP connect check would have marked the service DOWN.
    std::thread::sleep(Duration::from_secs(6));
    for i in 0..5 {
        let q = format!("q{i}");
        assert_eq!(
            ask(&ip, port, &q).as_deref(),
            Some(format!("udp1:{q}").as_str()),
            "datagram {i}, 6 s after the start"
        );
    }
    ws.assert_plan_empty("the UDP vserver");
    ws.destroy();
    ws.assert_nothing_left(&[]);
}
