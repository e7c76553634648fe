//! The gcp cloud driver against the gcp fake (clouds/gcp/fake: Compute Engine
//! v1 and Cloud DNS v1 as Google's discovery documents define them; see
//! `lbscale_cloud_gcp::fake_testing`). What the driver did is read back from
//! the fake's state and traffic log with curl, not through the driver.

use lbscale_cloud_gcp::fake_testing::{GcpFake, IMAGE, PROJECT};
use lbscale_cloud_gcp::{instance_name, GcpCloud, GcpSettings, NODE_API_PORT};
use lbscale_engine::cloud::{
    Balance, Cloud, Distributor, DriverStore, PortTargets, ProvisionRequest, Provisioned,
    Publication,
};
use lbscale_engine::model::{
    CloudName, DeclaredDuration, DistributorMode, DistributorSpec, NodeSpec,
};
use lbscale_engine::nodeapi::auth;
use lbscale_engine::store::{NodeRow, NodeState, Store};
use serde_json::Value;
use std::sync::Arc;

fn store(test: &str) -> Arc<Store> {
    let dir = std::env::temp_dir().join(format!("lbscale-gcp-{test}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    Arc::new(Store::open(&dir.join("state.db")).unwrap())
}

fn request(node_id: &str, group: &str, zone: &str, node: NodeSpec) -> ProvisionRequest {
    ProvisionRequest {
        credentials: auth::node_credentials("group-secret-0123456789abcdef", node_id).unwrap(),
        node_id: node_id.into(),
        group_id: group.into(),
        group_name: format!("{group}-name"),
        az: zone.into(),
        node,
    }
}

fn node(image: &str) -> NodeSpec {
    NodeSpec {
        memory_limit_mb: 512,
        image: Some(image.into()),
        size: Some("e2-small".into()),
        security_groups: vec!["lbscale-nodes".into()],
        ..NodeSpec::default()
    }
}

fn row(req: &ProvisionRequest, p: &Provisioned) -> NodeRow {
    NodeRow {
        id: req.node_id.clone(),
        group_id: req.group_id.clone(),
        az: req.az.clone(),
        seq: 1,
        state: NodeState::Joining,
        private_ip: p.private_ip.clone(),
        public_ip: p.public_ip.clone(),
        registered: false,
        handle: p.handle.clone(),
        created_at: 0,
    }
}

fn instances(fake: &GcpFake) -> Vec<Value> {
    fake.state()["instances"].as_array().unwrap().clone()
}

fn count(fake: &GcpFake, method: &str, status: u16) -> usize {
    fake.calls()
        .iter()
        .filter(|(m, s)| m == method && *s == status)
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_is_an_instance_started_once_found_by_name_and_deleted() {
    let fake = GcpFake::start("node");
    fake.subnetwork("us-central1", "edge", "10.20.0.0/24");
    let cloud = GcpCloud::new(fake.settings(), DriverStore::new(store("node"))).expect("driver");
    let mut spec = node(IMAGE);
    spec.subnets.insert("us-central1-b".into(), "edge".into());
    spec.tags.insert("team".into(), "web".into());
    spec.identity = Some("nodes@lbscale-test.iam.gserviceaccount.com".into());
    let req = request("web-us-central1-b-1", "g-1", "us-central1-b", spec);
    let p = cloud.provision(&req).await.expect("provision");
    assert_eq!(p.api_port, NODE_API_PORT);

    // What Compute Engine holds: the instance, named after the node, in the
    // zone and the subnetwork, of the machine type, labelled, with the
    // addresses returned and the startup script.
    let all = instances(&fake);
    assert_eq!(all.len(), 1);
    let i = &all[0];
    assert_eq!(i["name"], "lbscale-web-us-central1-b-1");
    assert!(i["zone"]
        .as_str()
        .unwrap()
        .ends_with("/zones/us-central1-b"));
    assert!(i["machineType"]
        .as_str()
        .unwrap()
        .ends_with("/zones/us-central1-b/machineTypes/e2-small"));
    assert_eq!(i["status"], "RUNNING");
    assert_eq!(i["labels"]["lbscale-group"], "g-1");
    assert_eq!(i["labels"]["lbscale-node"], "web-us-central1-b-1");
    assert_eq!(i["labels"]["team"], "web");
    assert_eq!(i["tags"]["items"], serde_json::json!(["lbscale-nodes"]));
    assert_eq!(
        i["serviceAccounts"][0]["email"],
        "nodes@lbscale-test.iam.gserviceaccount.com"
    );
    let nic = &i["networkInterfaces"][0];
    assert!(nic["subnetwork"]
        .as_str()
        .unwrap()
        .ends_with("/regions/us-central1/subnetworks/edge"));
    assert_eq!(nic["networkIP"].as_str(), Some(p.private_ip.as_str()));
    assert!(p.private_ip.starts_with("10.20.0."), "{}", p.private_ip);
    assert_eq!(
        nic["accessConfigs"][0]["natIP"].as_str(),
        p.public_ip.as_deref()
    );
    let items = i["metadata"]["items"].as_array().unwrap();
    let meta = |k: &str| {
        items
            .iter()
            .find(|m| m["key"] == k)
            .map(|m| m["value"].as_str().unwrap().to_string())
    };
    assert_eq!(
        meta("lbscale-node-id").as_deref(),
        Some("web-us-central1-b-1")
    );
    let script = meta("startup-script").expect("a startup script");
    assert!(
        script.contains("exec lbscale-node serve --node-id web-us-central1-b-1"),
        "{script}"
    );
    assert!(
        script.contains(&format!("--api-port {NODE_API_PORT}")),
        "{script}"
    );
    assert!(script.contains("Metadata-Flavor: Google"), "{script}");
    assert!(
        script.contains(&req.credentials.token_file)
            && req.credentials.token_file.starts_with("sha256:")
    );
    assert!(script.contains("--memory-limit-mb 512"), "{script}");
    // The insert was waited on through the zone's operations.
    assert_eq!(count(&fake, "compute.instances.insert", 200), 1);
    assert!(count(&fake, "compute.zoneOperations.wait", 200) >= 1);

    // Provisioning the same node again (a step re-run after a crash) finds
    // the same instance: no second insert.
    let again = cloud.provision(&req).await.expect("provision again");
    assert_eq!(again.handle, p.handle);
    assert_eq!(again.private_ip, p.private_ip);
    assert_eq!(count(&fake, "compute.instances.insert", 200), 1);
    assert_eq!(instances(&fake).len(), 1);

    let r = row(&req, &p);
    assert!(cloud.is_alive(&r).await.unwrap());
    // All of a group's nodes in one aggregated list: one the cloud does not
    // know, and one without a handle (found by its name) are judged too.
    let unknown = NodeRow {
        id: "gone".into(),
        handle: Value::Null,
        ..r.clone()
    };
    let no_handle = NodeRow {
        handle: Value::Null,
        ..r.clone()
    };
    let before = count(&fake, "compute.instances.aggregatedList", 200);
    assert_eq!(
        cloud
            .alive(&[r.clone(), unknown.clone(), no_handle.clone()])
            .await
            .unwrap(),
        [true, false, true]
    );
    assert_eq!(
        count(&fake, "compute.instances.aggregatedList", 200),
        before + 1
    );

    cloud.deprovision(&r).await.expect("deprovision");
    assert!(instances(&fake).is_empty(), "deleted and waited on");
    assert!(!cloud.is_alive(&r).await.unwrap());
    assert_eq!(
        cloud.alive(std::slice::from_ref(&r)).await.unwrap(),
        [false]
    );
    cloud
        .deprovision(&r)
        .await
        .expect("deprovision again: gone is fine");
    // Every call the driver made was valid against the discovery documents
    // (the fake answers 400 to one that is not).
    let refused: Vec<_> = fake
        .calls()
        .into_iter()
        .filter(|(_, s)| *s == 400)
        .collect();
    assert!(refused.is_empty(), "{refused:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn throttled_and_failed_calls_are_retried_and_refusals_carry_googles_words() {
    let fake = GcpFake::start("retry");
    let cloud = GcpCloud::new(fake.settings(), DriverStore::new(store("retry"))).expect("driver");
    // Two throttled inserts, a failed wait: retried, one instance.
    fake.fail("compute.instances.insert", 429, "rateLimitExceeded", 2);
    fake.fail("compute.zoneOperations.wait", 503, "backendError", 1);
    let req = request("n-retry", "g-r", "us-central1-a", node(IMAGE));
    cloud
        .provision(&req)
        .await
        .expect("provision through the throttling");
    assert_eq!(count(&fake, "compute.instances.insert", 429), 2);
    assert_eq!(count(&fake, "compute.instances.insert", 200), 1);
    assert_eq!(count(&fake, "compute.zoneOperations.wait", 503), 1);
    assert_eq!(instances(&fake).len(), 1);

    // Failing for good: the error names the call, Google's status, reason and message.
    fake.fail("compute.instances.aggregatedList", 500, "backendError", 10);
    let e = cloud.alive(&[]).await;
    assert!(e.is_ok(), "no nodes: no call");
    let r = NodeRow {
        id: "n-retry".into(),
        group_id: "g-r".into(),
        az: "us-central1-a".into(),
        seq: 1,
        state: NodeState::Active,
        private_ip: String::new(),
        public_ip: None,
        registered: false,
        handle: Value::Null,
        created_at: 0,
    };
    let e = cloud.alive(&[r]).await.expect_err("500s").to_string();
    assert!(
        e.contains("compute.instances.aggregatedList")
            && e.contains("HTTP 500")
            && e.contains("backendError")
            && e.contains("injected fault"),
        "{e}"
    );

    // A machine type the zone lacks and an image that does not exist: Google's words.
    let mut bad = node(IMAGE);
    bad.size = Some("n9-huge".into());
    let e = cloud
        .provision(&request("n-bad", "g-r", "us-central1-a", bad))
        .await
        .expect_err("bad type")
        .to_string();
    assert!(
        e.contains("compute.instances.insert") && e.contains("HTTP 400") && e.contains("n9-huge"),
        "{e}"
    );
    let e = cloud
        .provision(&request(
            "n-bad2",
            "g-r",
            "us-central1-a",
            node("projects/lbscale-test/global/images/nope"),
        ))
        .await
        .expect_err("no image")
        .to_string();
    assert!(e.contains("HTTP 404") && e.contains("images/nope"), "{e}");
    let key = std::fs::read_to_string(&fake.key).unwrap();
    let pem: Value = serde_json::from_str(&key).unwrap();
    let body = pem["private_key"]
        .as_str()
        .unwrap()
        .lines()
        .nth(1)
        .unwrap()
        .to_string();
    assert!(!e.contains(&body));
    // No node block image: said at plan time, by name.
    let why = cloud.node_unusable(&NodeSpec::default()).expect("unusable");
    assert!(why.contains("node.image"), "{why}");
    assert_eq!(cloud.node_unusable(&node(IMAGE)), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_come_from_the_signed_key_or_the_metadata_server_and_are_refreshed() {
    let fake = GcpFake::start("tokens");
    fake.configure(serde_json::json!({"token_lifetime": 2}));
    let cloud = GcpCloud::new(fake.settings(), DriverStore::new(store("tokens"))).expect("driver");
    let src = cloud.credential_source();
    assert!(
        src.contains("lbscale@lbscale-test.iam.gserviceaccount.com")
            && src.contains("provider's gcp credentials file"),
        "{src}"
    );
    let r = NodeRow {
        id: "n-t".into(),
        group_id: "g-t".into(),
        az: "us-central1-a".into(),
        seq: 1,
        state: NodeState::Active,
        private_ip: String::new(),
        public_ip: None,
        registered: false,
        handle: Value::Null,
        created_at: 0,
    };
    for _ in 0..4 {
        assert_eq!(
            cloud.alive(std::slice::from_ref(&r)).await.unwrap(),
            [false]
        );
        tokio::time::sleep(std::time::Duration::from_millis(800)).await;
    }
    // A 2 s token is fetched again at half its life: before it expires, so
    // no call was refused.
    assert!(
        cloud.tokens_fetched() >= 2,
        "fetched {}",
        cloud.tokens_fetched()
    );
    assert_eq!(
        count(&fake, "oauth2.token", 200) as u64,
        cloud.tokens_fetched()
    );
    assert_eq!(count(&fake, "compute.instances.aggregatedList", 401), 0);

    // On an instance: the metadata server's tokens (GCE_METADATA_HOST).
    let mut settings = fake.settings();
    settings.credentials = None;
    settings
        .env
        .insert("GCE_METADATA_HOST".into(), fake.metadata.clone());
    let on_gce = GcpCloud::new(settings, DriverStore::new(store("tokens-md"))).unwrap();
    assert!(on_gce.credential_source().contains(&fake.metadata));
    assert_eq!(
        on_gce.alive(std::slice::from_ref(&r)).await.unwrap(),
        [false]
    );
    assert_eq!(count(&fake, "metadata.token", 200), 1);

    // A key the token endpoint does not know (another key, same shape):
    // refused, the error says who refused and why, and shows no key.
    let other = std::env::temp_dir().join(format!("lbscale-gcp-otherkey-{}", std::process::id()));
    std::fs::create_dir_all(&other).unwrap();
    let pem = other.join("k.pem");
    assert!(std::process::Command::new("openssl")
        .args([
            "genpkey",
            "-algorithm",
            "RSA",
            "-pkeyopt",
            "rsa_keygen_bits:2048",
            "-out"
        ])
        .arg(&pem)
        .output()
        .unwrap()
        .status
        .success());
    let mut key: Value =
        serde_json::from_str(&std::fs::read_to_string(&fake.key).unwrap()).unwrap();
    let private = std::fs::read_to_string(&pem).unwrap();
    key["private_key"] = Value::String(private.clone());
    let settings = GcpSettings {
        credentials: Some(key.to_string()),
        ..fake.settings()
    };
    let forged = GcpCloud::new(settings, DriverStore::new(store("tokens-bad"))).unwrap();
    let e = forged
        .alive(std::slice::from_ref(&r))
        .await
        .expect_err("bad signature")
        .to_string();
    assert!(
        e.contains("invalid_grant") && e.contains("Invalid JWT Signature"),
        "{e}"
    );
    assert!(!e.contains(private.lines().nth(1).unwrap()), "{e}");
    std::fs::remove_dir_all(&other).unwrap();
}

fn dns_spec(domain: &str) -> DistributorSpec {
    DistributorSpec {
        name: format!("d-{domain}"),
        cloud: CloudName::Gcp,
        mode: DistributorMode::Dns,
        domain: Some(domain.into()),
        ttl: DeclaredDuration::parse("30s").unwrap(),
    }
}

fn publication(addresses: &[(&str, &str)]) -> Publication {
    let mut p = Publication::default();
    for (zone, a) in addresses {
        p.endpoints
            .entry(zone.to_string())
            .or_default()
            .push(a.to_string());
    }
    p
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dns_distributor_is_an_a_record_set_marked_as_lbscales() {
    let fake = GcpFake::start("dns");
    let store = store("dns");
    let cloud = GcpCloud::new(fake.settings(), DriverStore::new(store.clone())).expect("driver");
    let id = "td-dns-1";
    let spec = dns_spec("App.Example.test");
    store.insert_distributor(id, &spec).unwrap();
    // No zone holds the domain: said, and nothing is created.
    let e = cloud
        .ensure(id, &spec)
        .await
        .expect_err("no zone")
        .to_string();
    assert!(
        e.contains("no public Cloud DNS managed zone") && e.contains("app.example.test."),
        "{e}"
    );
    assert!(fake.state()["managedZones"].as_array().unwrap().is_empty());

    fake.managed_zone("example", "example.test.");
    fake.managed_zone("app-example", "app.example.test.");
    fake.managed_zone("other", "other.test.");
    cloud.ensure(id, &spec).await.expect("ensure");
    // The longest zone that holds the domain; its first name server is the address.
    assert_eq!(
        cloud.addresses(id, &spec)["dns"],
        "ns-cloud-a2.googledomains.com"
    );

    cloud
        .publish(
            id,
            &spec,
            &publication(&[
                ("us-central1-a", "127.77.0.9"),
                ("us-central1-b", "127.77.0.5"),
            ]),
        )
        .await
        .expect("publish");
    let records = fake.records("app-example");
    let a = ("app.example.test.".to_string(), "A".to_string());
    let txt = ("_lbscale.app.example.test.".to_string(), "TXT".to_string());
    assert_eq!(
        records[&a],
        (30, vec!["127.77.0.5".to_string(), "127.77.0.9".to_string()])
    );
    assert_eq!(
        records[&txt].1,
        vec![format!("\"lbscale distributor {id}\"")]
    );
    // The same again: no change.
    let changes = count(&fake, "dns.changes.create", 200);
    cloud
        .publish(
            id,
            &spec,
            &publication(&[
                ("us-central1-a", "127.77.0.9"),
                ("us-central1-b", "127.77.0.5"),
            ]),
        )
        .await
        .unwrap();
    assert_eq!(count(&fake, "dns.changes.create", 200), changes);
    // Another set and TTL: one change that deletes the record exactly as it
    // is (the fake refuses any other deletion with 412) and adds the new one.
    let spec2 = DistributorSpec {
        ttl: DeclaredDuration::parse("5s").unwrap(),
        ..spec.clone()
    };
    cloud
        .publish(id, &spec2, &publication(&[("us-central1-a", "127.77.0.7")]))
        .await
        .expect("republish");
    assert_eq!(
        fake.records("app-example")[&a],
        (5, vec!["127.77.0.7".to_string()])
    );
    assert_eq!(count(&fake, "dns.changes.create", 200), changes + 1);
    assert_eq!(count(&fake, "dns.changes.create", 412), 0);
    // Changes were waited on until done.
    assert!(count(&fake, "dns.changes.get", 200) >= 1);

    // A record lbscale did not make is never taken over.
    let (code, v) = fake.api(
        "POST",
        &format!("/dns/v1/projects/{PROJECT}/managedZones/other/changes"),
        Some(&serde_json::json!({"additions": [{"name": "www.other.test.", "type": "A", "ttl": 60, "rrdatas": ["192.0.2.1"]}]})),
    );
    assert_eq!(code, 200, "{v}");
    let foreign = dns_spec("www.other.test");
    store.insert_distributor("td-dns-2", &foreign).unwrap();
    let e = cloud
        .publish(
            "td-dns-2",
            &foreign,
            &publication(&[("us-central1-a", "127.77.0.7")]),
        )
        .await
        .expect_err("foreign")
        .to_string();
    assert!(
        e.contains("not this distributor's") && e.contains("www.other.test."),
        "{e}"
    );
    let www = ("www.other.test.".to_string(), "A".to_string());
    assert_eq!(
        fake.records("other")[&www],
        (60, vec!["192.0.2.1".to_string()])
    );
    cloud
        .remove("td-dns-2")
        .await
        .expect("remove leaves the foreign record");
    assert_eq!(
        fake.records("other")[&www],
        (60, vec!["192.0.2.1".to_string()])
    );

    // No serving node: no A record; remove deletes what is ours, not the zone.
    cloud
        .publish(id, &spec, &Publication::default())
        .await
        .expect("empty");
    assert!(!fake.records("app-example").contains_key(&a));
    cloud
        .publish(id, &spec, &publication(&[("us-central1-a", "127.77.0.8")]))
        .await
        .unwrap();
    cloud.remove(id).await.expect("remove");
    let left = fake.records("app-example");
    assert!(
        !left.contains_key(&a) && !left.contains_key(&txt),
        "{left:?}"
    );
    assert_eq!(
        fake.state()["managedZones"].as_array().unwrap().len(),
        3,
        "zones are the operator's"
    );
    cloud.remove(id).await.expect("remove again");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_nlb_distributor_is_a_vip_per_zone_with_pools_that_follow_the_placement() {
    let fake = GcpFake::start("nlb");
    let store = store("nlb");
    let cloud = GcpCloud::new(fake.settings(), DriverStore::new(store.clone())).expect("driver");
    let mut nodes = vec![];
    for (n, zone) in [
        ("a1", "us-central1-a"),
        ("a2", "us-central1-a"),
        ("b1", "us-central1-b"),
    ] {
        let p = cloud
            .provision(&request(n, "g-nlb", zone, node(IMAGE)))
            .await
            .unwrap();
        nodes.push((zone, p.private_ip));
    }
    let id = "td-nlb-1";
    let spec = DistributorSpec {
        name: "nlb".into(),
        cloud: CloudName::Gcp,
        mode: DistributorMode::Nlb,
        domain: None,
        ttl: DeclaredDuration::parse("60s").unwrap(),
    };
    store.insert_distributor(id, &spec).unwrap();
    cloud.ensure(id, &spec).await.unwrap();
    assert!(
        fake.state()["addresses"].as_array().unwrap().is_empty(),
        "nothing before a port"
    );

    let mut p = Publication::default();
    for (zone, ip) in &nodes {
        p.endpoints
            .entry(zone.to_string())
            .or_default()
            .push(ip.clone());
    }
    p.ports.insert("us-central1-a".into(), vec![80, 443]);
    p.ports.insert("us-central1-b".into(), vec![80]);
    // 443 of us-central1-a has a native primary: that node only.
    p.port_targets
        .entry("us-central1-a".into())
        .or_default()
        .insert(
            443,
            PortTargets {
                addresses: vec![nodes[1].1.clone(), nodes[0].1.clone()],
                balance: Balance::First,
            },
        );
    cloud.publish(id, &spec, &p).await.expect("publish");
    let state = fake.state();
    let vips = cloud.addresses(id, &spec);
    assert_eq!(vips.len(), 2, "{vips:?}");
    assert_ne!(vips["us-central1-a"], vips["us-central1-b"]);
    let rules = state["forwardingRules"].as_array().unwrap();
    assert_eq!(rules.len(), 3);
    let pools = state["targetPools"].as_array().unwrap();
    let members = |zone: &str, port: u16| -> Vec<String> {
        let name = format!("lbscale-{id}-{zone}-{port}");
        let rule = rules
            .iter()
            .find(|r| r["name"] == name.as_str())
            .unwrap_or_else(|| panic!("rule {name}"));
        assert_eq!(rule["IPAddress"].as_str(), Some(vips[zone].as_str()));
        assert_eq!(rule["portRange"], format!("{port}-{port}"));
        assert!(rule["target"]
            .as_str()
            .unwrap()
            .ends_with(&format!("/targetPools/{name}")));
        let pool = pools.iter().find(|x| x["name"] == name.as_str()).unwrap();
        let mut m: Vec<String> = pool["instances"]
            .as_array()
            .unwrap()
            .iter()
            .map(|u| u.as_str().unwrap().rsplit('/').next().unwrap().to_string())
            .collect();
        m.sort();
        m
    };
    assert_eq!(members("us-central1-a", 80), ["lbscale-a1", "lbscale-a2"]);
    assert_eq!(members("us-central1-a", 443), ["lbscale-a2"]);
    assert_eq!(members("us-central1-b", 80), ["lbscale-b1"]);

    // The primary moves, a zone goes: membership follows, the rest is deleted.
    p.port_targets
        .get_mut("us-central1-a")
        .unwrap()
        .get_mut(&443)
        .unwrap()
        .addresses = vec![nodes[0].1.clone()];
    p.ports.remove("us-central1-b");
    cloud.publish(id, &spec, &p).await.expect("republish");
    let state = fake.state();
    let rules = state["forwardingRules"].as_array().unwrap().clone();
    let pools = state["targetPools"].as_array().unwrap().clone();
    assert_eq!(rules.len(), 2);
    assert_eq!(state["addresses"].as_array().unwrap().len(), 1);
    let pool443 = pools
        .iter()
        .find(|x| x["name"] == format!("lbscale-{id}-us-central1-a-443").as_str())
        .unwrap();
    assert!(
        pool443["instances"][0]
            .as_str()
            .unwrap()
            .ends_with("/lbscale-a1"),
        "{pool443}"
    );
    assert_eq!(pool443["instances"].as_array().unwrap().len(), 1);
    assert_eq!(count(&fake, "compute.targetPools.addInstance", 200), 1);
    assert_eq!(count(&fake, "compute.targetPools.removeInstance", 200), 1);
    assert!(count(&fake, "compute.regionOperations.wait", 200) >= 1);

    cloud.remove(id).await.expect("remove");
    let state = fake.state();
    for kind in ["forwardingRules", "targetPools", "addresses"] {
        assert!(
            state[kind].as_array().unwrap().is_empty(),
            "{kind}: {}",
            state[kind]
        );
    }
    assert!(cloud.addresses(id, &spec).is_empty());
    let refused: Vec<_> = fake
        .calls()
        .into_iter()
        .filter(|(_, s)| *s == 400)
        .collect();
    assert!(refused.is_empty(), "{refused:?}");
}

/// Google's own client, the Google Cloud CLI, reads what the driver made
/// and writes on the fake: the fake speaks Google's API, not only ours.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gcloud_sees_what_the_driver_made_and_writes_what_the_driver_reads() {
    let fake = GcpFake::start("gcloud");
    let store = store("gcloud");
    let cloud = GcpCloud::new(fake.settings(), DriverStore::new(store.clone())).expect("driver");
    let mut provisioned = vec![];
    for (n, zone) in [("gc-1", "us-central1-a"), ("gc-2", "us-central1-c")] {
        let req = request(n, "g-gc", zone, node(IMAGE));
        provisioned.push((cloud.provision(&req).await.unwrap(), req));
    }
    let (ok, out, err) = fake.gcloud(&[
        "compute",
        "instances",
        "list",
        "--filter=labels.lbscale-group=g-gc",
        "--format=value(name,zone.basename(),networkInterfaces[0].networkIP,status)",
    ]);
    assert!(ok, "{err}");
    let mut listed: Vec<&str> = out.lines().collect();
    listed.sort();
    let want: Vec<String> = provisioned
        .iter()
        .map(|(p, r)| {
            format!(
                "{}\t{}\t{}\tRUNNING",
                instance_name(&r.node_id),
                r.az,
                p.private_ip
            )
        })
        .collect();
    assert_eq!(listed, want);

    // gcloud makes the managed zone and a record set; the driver works in it.
    let (ok, _, err) = fake.gcloud(&[
        "dns",
        "managed-zones",
        "create",
        "shop",
        "--dns-name=shop.test.",
        "--description=made by gcloud",
    ]);
    assert!(ok, "{err}");
    let (ok, _, err) = fake.gcloud(&[
        "dns",
        "record-sets",
        "create",
        "static.shop.test.",
        "--zone=shop",
        "--type=A",
        "--ttl=300",
        "--rrdatas=192.0.2.7",
    ]);
    assert!(ok, "{err}");
    let spec = dns_spec("www.shop.test");
    store.insert_distributor("td-gc", &spec).unwrap();
    let mut p = Publication::default();
    for (prov, req) in &provisioned {
        p.endpoints
            .entry(req.az.clone())
            .or_default()
            .push(prov.public_ip.clone().unwrap());
    }
    cloud.publish("td-gc", &spec, &p).await.expect("publish");
    let (ok, out, err) = fake.gcloud(&[
        "dns",
        "record-sets",
        "list",
        "--zone=shop",
        "--format=value(name,type,ttl,rrdatas.list())",
    ]);
    assert!(ok, "{err}");
    let mut nats: Vec<String> = provisioned
        .iter()
        .map(|(p, _)| p.public_ip.clone().unwrap())
        .collect();
    nats.sort();
    assert!(
        out.contains(&format!("www.shop.test.\tA\t30\t{}", nats.join(","))),
        "{out}"
    );
    assert!(
        out.contains("static.shop.test.\tA\t300\t192.0.2.7"),
        "{out}"
    );
    assert!(out.contains("_lbscale.www.shop.test.\tTXT"), "{out}");

    // An instance gcloud starts carries no lbscale label: not the group's.
    let (ok, _, err) = fake.gcloud(&[
        "compute",
        "instances",
        "create",
        "by-hand",
        "--zone=us-central1-a",
        "--machine-type=e2-small",
        &format!("--image={IMAGE}"),
    ]);
    assert!(ok, "{err}");
    let rows: Vec<NodeRow> = provisioned.iter().map(|(p, r)| row(r, p)).collect();
    assert_eq!(cloud.alive(&rows).await.unwrap(), [true, true]);
    assert_eq!(instances(&fake).len(), 3);
    // The nlb: gcloud lists the forwarding rules the driver made.
    let nlb = DistributorSpec {
        mode: DistributorMode::Nlb,
        domain: None,
        ..dns_spec("x")
    };
    store.insert_distributor("td-gcn", &nlb).unwrap();
    let mut p = Publication::default();
    for (prov, req) in &provisioned {
        p.endpoints
            .entry(req.az.clone())
            .or_default()
            .push(prov.private_ip.clone());
        p.ports.insert(req.az.clone(), vec![8080]);
    }
    cloud
        .publish("td-gcn", &nlb, &p)
        .await
        .expect("publish nlb");
    let (ok, out, err) = fake.gcloud(&[
        "compute",
        "forwarding-rules",
        "list",
        "--format=value(name,IPAddress,portRange)",
    ]);
    assert!(ok, "{err}");
    let vips = cloud.addresses("td-gcn", &nlb);
    for (zone, vip) in &vips {
        assert!(
            out.contains(&format!("lbscale-td-gcn-{zone}-8080\t{vip}\t8080-8080")),
            "{out}"
        );
    }
    assert_eq!(out.lines().count(), 2, "{out}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_without_network_tags_gets_firewall_rules_of_its_own() {
    use lbscale_engine::cloud::{GroupResources, Listener, Transport};
    let fake = GcpFake::start("firewall");
    let cloud =
        GcpCloud::new(fake.settings(), DriverStore::new(store("firewall"))).expect("driver");
    let mut group = GroupResources {
        group_id: "g-fw".into(),
        group_name: "fw".into(),
        availability_zones: vec!["us-central1-a".into(), "us-central1-b".into()],
        node: NodeSpec {
            security_groups: vec![],
            ..node(IMAGE)
        },
        listeners: vec![
            Listener {
                port: 80,
                protocol: Transport::Tcp,
            },
            Listener {
                port: 443,
                protocol: Transport::Tcp,
            },
            Listener {
                port: 53,
                protocol: Transport::Udp,
            },
        ],
    };
    let rules = |fake: &GcpFake| -> std::collections::BTreeMap<String, Value> {
        fake.state()["firewalls"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| (r["name"].as_str().unwrap().to_string(), r.clone()))
            .collect()
    };
    cloud.prepare_group(&group).await.expect("prepare");
    let r = rules(&fake);
    assert_eq!(r.len(), 2, "{r:?}");
    let serve = &r["lbscale-g-fw-serve"];
    assert_eq!(
        serve["allowed"],
        serde_json::json!([{"IPProtocol": "tcp", "ports": ["80", "443"]}, {"IPProtocol": "udp", "ports": ["53"]}])
    );
    assert_eq!(serve["sourceRanges"], serde_json::json!(["0.0.0.0/0"]));
    assert_eq!(serve["targetTags"], serde_json::json!(["lbscale-g-fw"]));
    let api = &r["lbscale-g-fw-api"];
    assert_eq!(
        api["allowed"],
        serde_json::json!([{"IPProtocol": "tcp", "ports": [NODE_API_PORT.to_string()]}])
    );
    // The node API from the groups' subnetworks only (us-central1's default).
    assert_eq!(api["sourceRanges"], serde_json::json!(["10.128.0.0/20"]));
    assert!(count(&fake, "compute.globalOperations.wait", 200) >= 1);
    // The same again: nothing to do.
    let inserts = count(&fake, "compute.firewalls.insert", 200);
    cloud.prepare_group(&group).await.unwrap();
    assert_eq!(count(&fake, "compute.firewalls.insert", 200), inserts);
    assert_eq!(count(&fake, "compute.firewalls.patch", 200), 0);
    // The rules follow the vservers and management_cidrs.
    group.listeners.retain(|l| l.port == 443);
    group.node.management_cidrs = vec!["192.0.2.0/24".into()];
    cloud.prepare_group(&group).await.unwrap();
    let r = rules(&fake);
    assert_eq!(
        r["lbscale-g-fw-serve"]["allowed"],
        serde_json::json!([{"IPProtocol": "tcp", "ports": ["443"]}])
    );
    assert_eq!(
        r["lbscale-g-fw-api"]["sourceRanges"],
        serde_json::json!(["192.0.2.0/24"])
    );
    // A node of the group carries the tag the rules target.
    let req = request("fw-1", "g-fw", "us-central1-a", group.node.clone());
    let p = cloud.provision(&req).await.unwrap();
    let i = instances(&fake).into_iter().next().unwrap();
    assert_eq!(i["tags"]["items"], serde_json::json!(["lbscale-g-fw"]));
    cloud.deprovision(&row(&req, &p)).await.unwrap();
    // Tags given: lbscale's rules go; and all of them go with the group.
    group.node.security_groups = vec!["web".into()];
    group.node.management_cidrs.clear();
    cloud.prepare_group(&group).await.unwrap();
    assert!(rules(&fake).is_empty());
    group.node.security_groups.clear();
    cloud.prepare_group(&group).await.unwrap();
    assert_eq!(rules(&fake).len(), 2);
    cloud.release_group("g-fw").await.expect("release");
    assert!(rules(&fake).is_empty());
    cloud.release_group("g-fw").await.expect("release again");
    let refused: Vec<_> = fake
        .calls()
        .into_iter()
        .filter(|(_, s)| *s == 400)
        .collect();
    assert!(refused.is_empty(), "{refused:?}");
}
