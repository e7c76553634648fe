//! The azure cloud driver against the fake ARM server, which validates every
//! request and answer against Azure's published OpenAPI definitions (see
//! `lbscale_cloud_azure::fake_testing`). What the driver did is read back
//! from the fake's state and with curl, not through the driver.

use lbscale_cloud_azure::fake_testing::{fake, unique, Fake, CLIENT, TENANT};
use lbscale_cloud_azure::{AzureCloud, NODE_API_PORT};
use lbscale_engine::cloud::{
    Balance, Cloud, Distributor, DriverStore, GroupResources, Listener, PortTargets,
    ProvisionRequest, Publication, Transport,
};
use lbscale_engine::model::{
    CloudName, DeclaredDuration, DistributorMode, DistributorSpec, GroupSpec, Metric, NodeSpec,
    ThresholdSpec,
};
use lbscale_engine::nodeapi::auth;
use lbscale_engine::store::{NodeRow, NodeState, Store};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::sync::Arc;

fn store(test: &str) -> Arc<Store> {
    let dir = std::env::temp_dir().join(format!("lbscale-azure-{test}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    Arc::new(Store::open(&dir.join("state.db")).unwrap())
}

fn driver(fake: &Fake, rg: &str, store: &Arc<Store>) -> AzureCloud {
    AzureCloud::new(fake.settings(rg), DriverStore::new(store.clone())).expect("driver")
}

fn dns_spec(domain: &str, ttl: &str) -> DistributorSpec {
    DistributorSpec {
        name: unique("dns"),
        cloud: CloudName::Azure,
        mode: DistributorMode::Dns,
        domain: Some(domain.into()),
        ttl: DeclaredDuration::parse(ttl).unwrap(),
    }
}

fn publication(endpoints: &[(&str, &[&str])], ports: &[u16]) -> Publication {
    let mut p = Publication::default();
    for (az, ips) in endpoints {
        p.endpoints
            .insert(az.to_string(), ips.iter().map(|s| s.to_string()).collect());
        p.ports.insert(az.to_string(), ports.to_vec());
    }
    p
}

fn tm_path(rg: &str, id: &str) -> String {
    Fake::path(
        rg,
        &format!("Microsoft.Network/trafficmanagerprofiles/lbscale-{id}"),
    )
}

fn targets(profile: &Value) -> Vec<String> {
    let mut t: Vec<String> = profile["properties"]["endpoints"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["properties"]["target"].as_str().unwrap().to_string())
        .collect();
    t.sort();
    t
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dns_distributor_is_a_traffic_manager_profile_with_a_cname_it_owns() {
    let Some(fake) = fake("a_dns_distributor_is_a_traffic_manager_profile_with_a_cname_it_owns")
    else {
        return;
    };
    let rg = unique("rg-dns");
    let zone = format!("{}.example", unique("z"));
    let zone_path = fake.dns_zone(&rg, &zone);
    let store = store("dns");
    let cloud = driver(&fake, &rg, &store);
    let id = unique("d");
    let spec = dns_spec(&format!("www.{zone}"), "30s");
    store.insert_distributor(&id, &spec).unwrap();

    cloud.ensure(&id, &spec).await.expect("ensure");
    let profile = fake.resource(&tm_path(&rg, &id)).expect("a profile");
    let fqdn = profile["properties"]["dnsConfig"]["fqdn"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(fqdn.ends_with(".trafficmanager.net"), "{fqdn}");
    assert_eq!(cloud.addresses(&id, &spec)["dns"], fqdn);
    let record = fake
        .resource(&format!("{zone_path}/CNAME/www"))
        .expect("the CNAME");
    assert_eq!(record["properties"]["CNAMERecord"]["cname"], fqdn);
    assert_eq!(
        record["properties"]["metadata"]["lbscale_distributor"],
        id.as_str()
    );
    assert_eq!(record["properties"]["TTL"], 30);

    // One external endpoint per serving node, the TTL, monitoring the vserver port.
    let p = publication(
        &[
            ("1", &["127.92.0.10", "127.92.0.11"]),
            ("2", &["127.92.0.12"]),
        ],
        &[8080, 443],
    );
    cloud.publish(&id, &spec, &p).await.expect("publish");
    let profile = fake.resource(&tm_path(&rg, &id)).unwrap();
    assert_eq!(
        targets(&profile),
        ["127.92.0.10", "127.92.0.11", "127.92.0.12"]
    );
    let props = &profile["properties"];
    assert_eq!(props["trafficRoutingMethod"], "MultiValue");
    assert_eq!(props["dnsConfig"]["ttl"], 30);
    assert_eq!(props["monitorConfig"]["port"], 443);
    assert_eq!(props["monitorConfig"]["protocol"], "TCP");

    // The same publication again changes nothing (no PUT).
    let puts = |f: &Fake| {
        f.requests()
            .iter()
            .filter(|r| r["method"] == "PUT" && r["path"].as_str().unwrap().contains(&id))
            .count()
    };
    let before = puts(&fake);
    cloud.publish(&id, &spec, &p).await.expect("publish again");
    assert_eq!(puts(&fake), before, "an unchanged publication wrote");

    // Scale-in and a new TTL.
    let spec60 = DistributorSpec {
        ttl: DeclaredDuration::parse("60s").unwrap(),
        ..spec.clone()
    };
    store.insert_distributor(&id, &spec60).ok();
    let p = publication(&[("1", &["127.92.0.11"]), ("2", &[])], &[443]);
    cloud
        .publish(&id, &spec60, &p)
        .await
        .expect("publish fewer");
    let profile = fake.resource(&tm_path(&rg, &id)).unwrap();
    assert_eq!(targets(&profile), ["127.92.0.11"]);
    assert_eq!(profile["properties"]["dnsConfig"]["ttl"], 60);
    assert_eq!(
        fake.resource(&format!("{zone_path}/CNAME/www")).unwrap()["properties"]["TTL"],
        60
    );

    // Removed: the profile and the record set go.
    cloud.remove(&id).await.expect("remove");
    assert!(fake.resource(&tm_path(&rg, &id)).is_none());
    assert!(fake.resource(&format!("{zone_path}/CNAME/www")).is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_set_lbscale_did_not_make_is_never_taken_over() {
    let Some(fake) = fake("a_record_set_lbscale_did_not_make_is_never_taken_over") else {
        return;
    };
    let rg = unique("rg-own");
    let zone = format!("{}.example", unique("z"));
    let zone_path = fake.dns_zone(&rg, &zone);
    let theirs = format!("{zone_path}/CNAME/shop?api-version=2018-05-01");
    let (code, body) = fake.arm(
        "PUT",
        &theirs,
        Some(
            json!({"properties": {"TTL": 300, "CNAMERecord": {"cname": "elsewhere.example.net"}}}),
        ),
    );
    assert_eq!(code, 201, "{body}");
    let store = store("own");
    let cloud = driver(&fake, &rg, &store);
    let id = unique("d");
    let spec = dns_spec(&format!("shop.{zone}"), "30s");
    store.insert_distributor(&id, &spec).unwrap();
    let e = cloud.ensure(&id, &spec).await.unwrap_err().to_string();
    assert!(
        e.contains(&format!("shop.{zone}")) && e.contains("not this distributor's"),
        "{e}"
    );
    cloud.remove(&id).await.expect("remove");
    let r = fake
        .resource(&format!("{zone_path}/CNAME/shop"))
        .expect("theirs is still there");
    assert_eq!(
        r["properties"]["CNAMERecord"]["cname"],
        "elsewhere.example.net"
    );

    // At a zone's apex: an alias A record set to the profile.
    let apex_id = unique("d");
    let apex = dns_spec(&zone, "30s");
    store.insert_distributor(&apex_id, &apex).unwrap();
    cloud.ensure(&apex_id, &apex).await.expect("apex");
    let r = fake
        .resource(&format!("{zone_path}/A/@"))
        .expect("the alias");
    assert!(r["properties"]["targetResource"]["id"]
        .as_str()
        .unwrap()
        .eq_ignore_ascii_case(&tm_path(&rg, &apex_id)));
    cloud.remove(&apex_id).await.unwrap();
    assert!(fake.resource(&format!("{zone_path}/A/@")).is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_nlb_distributor_is_a_standard_load_balancer_written_under_its_etag() {
    let Some(fake) = fake("an_nlb_distributor_is_a_standard_load_balancer_written_under_its_etag")
    else {
        return;
    };
    let rg = unique("rg-nlb");
    let subnets = fake.network(&rg, &["1", "2"]);
    let store = store("nlb");
    let cloud = driver(&fake, &rg, &store);
    let id = unique("n");
    let spec = DistributorSpec {
        name: unique("nlb"),
        cloud: CloudName::Azure,
        mode: DistributorMode::Nlb,
        domain: None,
        ttl: DeclaredDuration::parse("60s").unwrap(),
    };
    store.insert_distributor(&id, &spec).unwrap();
    let mut p = publication(
        &[("1", &["10.0.1.4", "10.0.1.5"]), ("2", &["10.0.2.4"])],
        &[80, 443],
    );
    for (z, s) in &subnets {
        p.subnets
            .insert(z.clone(), [s.clone()].into_iter().collect());
    }
    // A native primary on 443 in zone 1.
    p.port_targets.entry("1".into()).or_default().insert(
        443,
        PortTargets {
            addresses: vec!["10.0.1.5".into(), "10.0.1.4".into()],
            balance: Balance::First,
        },
    );
    cloud.publish(&id, &spec, &p).await.expect("publish");
    let lb_path = Fake::path(
        &rg,
        &format!("Microsoft.Network/loadBalancers/lbscale-{id}"),
    );
    let lb = fake.resource(&lb_path).expect("a load balancer");
    assert_eq!(lb["sku"]["name"], "Standard");
    let props = &lb["properties"];
    let fronts: BTreeMap<String, Value> = props["frontendIPConfigurations"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| (f["name"].as_str().unwrap().to_string(), f.clone()))
        .collect();
    assert_eq!(fronts.len(), 2);
    // Public: each zone's frontend is on a zonal Standard static public IP
    // of its own (its zone is the address's; no subnet, no private address).
    let mut vips = BTreeMap::new();
    for zone in ["1", "2"] {
        let f = &fronts[&format!("fe-{zone}")];
        assert!(f["zones"].is_null(), "{f}");
        assert!(f["properties"]["subnet"].is_null(), "{f}");
        let pip_id = f["properties"]["publicIPAddress"]["id"].as_str().unwrap();
        assert!(
            pip_id.eq_ignore_ascii_case(&Fake::path(
                &rg,
                &format!("Microsoft.Network/publicIPAddresses/lbscale-{id}-fe-{zone}")
            )),
            "{pip_id}"
        );
        let pip = fake.resource(pip_id).expect("the frontend's public IP");
        assert_eq!(pip["zones"], json!([zone]));
        assert_eq!(pip["sku"]["name"], "Standard");
        assert_eq!(pip["properties"]["publicIPAllocationMethod"], "Static");
        assert_eq!(pip["tags"]["lbscale-distributor-id"], id.as_str());
        let address = pip["properties"]["ipAddress"].as_str().unwrap().to_string();
        assert!(address.starts_with(&fake.public_prefix()), "{address}");
        vips.insert(zone.to_string(), address);
    }
    let pools: BTreeMap<String, Vec<String>> = props["backendAddressPools"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| {
            let mut a: Vec<String> = b["properties"]["loadBalancerBackendAddresses"]
                .as_array()
                .unwrap()
                .iter()
                .map(|a| a["properties"]["ipAddress"].as_str().unwrap().to_string())
                .collect();
            a.sort();
            (b["name"].as_str().unwrap().to_string(), a)
        })
        .collect();
    assert_eq!(pools["z1"], ["10.0.1.4", "10.0.1.5"]);
    assert_eq!(pools["z1-p443"], ["10.0.1.5"]);
    assert_eq!(pools["z2"], ["10.0.2.4"]);
    assert_eq!(props["loadBalancingRules"].as_array().unwrap().len(), 4);
    assert_eq!(props["probes"].as_array().unwrap().len(), 2);
    // Each zone's VIP is its frontend's public address.
    assert_eq!(cloud.addresses(&id, &spec), vips);

    // Another writer drops a member; a 412 (a write in between) is read again.
    let etag = lb["etag"].as_str().unwrap().to_string();
    let mut theirs = lb.clone();
    theirs["properties"]["backendAddressPools"]
        .as_array_mut()
        .unwrap()
        .iter_mut()
        .find(|b| b["name"] == "z2")
        .unwrap()["properties"]["loadBalancerBackendAddresses"] = json!([]);
    for k in ["id", "name", "type", "etag"] {
        theirs.as_object_mut().unwrap().remove(k);
    }
    strip_read_only(&mut theirs);
    let (code, body) = fake.arm(
        "PUT",
        &format!("{lb_path}?api-version=2025-07-01"),
        Some(theirs),
    );
    assert!(code == 200, "{code} {body}");
    fake.fail("PUT", &format!("loadBalancers/lbscale-{id}$"), 412, 1);
    cloud
        .publish(&id, &spec, &p)
        .await
        .expect("publish over the other writer");
    let lb2 = fake.resource(&lb_path).unwrap();
    assert_ne!(lb2["etag"].as_str().unwrap(), etag);
    let z2 = lb2["properties"]["backendAddressPools"]
        .as_array()
        .unwrap()
        .iter()
        .find(|b| b["name"] == "z2")
        .unwrap()
        .clone();
    assert_eq!(
        z2["properties"]["loadBalancerBackendAddresses"][0]["properties"]["ipAddress"],
        "10.0.2.4"
    );
    let writes: Vec<Value> = fake
        .requests()
        .into_iter()
        .filter(|r| {
            r["method"] == "PUT"
                && r["path"]
                    .as_str()
                    .unwrap()
                    .ends_with(&format!("lbscale-{id}"))
        })
        .collect();
    // The driver's: the creation under If-None-Match, the update under the
    // ETag it read (the other writer's, unconditional, in between).
    assert_eq!(writes.len(), 3, "{writes:?}");
    assert_eq!(writes[0]["if_none_match"], "*", "{writes:?}");
    assert!(writes[1]["if_match"].is_null(), "{writes:?}");
    assert!(
        writes[2]["if_match"]
            .as_str()
            .is_some_and(|e| e.starts_with("W/")),
        "{writes:?}"
    );

    // Zone 2 no longer served: its frontend and then its address go; zone 1
    // keeps its address.
    let mut one = p.clone();
    one.ports.remove("2");
    one.endpoints.remove("2");
    cloud.publish(&id, &spec, &one).await.expect("one zone");
    let pips = |f: &Fake| {
        f.resources_under(&Fake::path(&rg, "Microsoft.Network/publicIPAddresses/"))
            .into_keys()
            .collect::<Vec<_>>()
    };
    assert_eq!(
        pips(&fake),
        [Fake::path(
            &rg,
            &format!("Microsoft.Network/publicIPAddresses/lbscale-{id}-fe-1")
        )
        .to_ascii_lowercase()]
    );
    assert_eq!(cloud.addresses(&id, &spec)["1"], vips["1"]);

    // Nothing published: no load balancer, no address.
    cloud
        .publish(&id, &spec, &Publication::default())
        .await
        .expect("empty");
    assert!(fake.resource(&lb_path).is_none());
    assert!(cloud.addresses(&id, &spec).is_empty());
    assert!(pips(&fake).is_empty(), "{:?}", pips(&fake));
}

/// What a client reads but must not send back (Azure's SDKs leave it out).
fn strip_read_only(v: &mut Value) {
    if let Some(o) = v.as_object_mut() {
        for k in ["provisioningState", "resourceGuid", "etag", "type"] {
            o.remove(k);
        }
        for (_, c) in o.iter_mut() {
            strip_read_only(c);
        }
    } else if let Some(a) = v.as_array_mut() {
        a.iter_mut().for_each(strip_read_only);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn throttling_and_failures_are_retried_and_errors_name_azure_s_code() {
    let Some(fake) = fake("throttling_and_failures_are_retried_and_errors_name_azure_s_code")
    else {
        return;
    };
    let rg = unique("rg-faults");
    let store = store("faults");
    let cloud = driver(&fake, &rg, &store);
    let id = unique("d");
    let spec = dns_spec("nowhere.invalid", "30s");
    store.insert_distributor(&id, &spec).unwrap();
    // Two 429s and a 503 on the profile's GET: retried.
    fake.fail(
        "GET",
        &format!("trafficmanagerprofiles/lbscale-{id}$"),
        429,
        2,
    );
    fake.fail(
        "GET",
        &format!("trafficmanagerprofiles/lbscale-{id}$"),
        503,
        1,
    );
    cloud.ensure(&id, &spec).await.expect("retried");
    assert!(fake.resource(&tm_path(&rg, &id)).is_some());
    // More 500s than attempts: the error names the operation, the status and Azure's code.
    fake.fail(
        "GET",
        &format!("trafficmanagerprofiles/lbscale-{id}$"),
        500,
        20,
    );
    let e = cloud
        .publish(&id, &spec, &publication(&[("1", &["127.0.0.9"])], &[80]))
        .await
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("Traffic Manager profile GET")
            && e.contains("HTTP 500")
            && e.contains("InternalServerError"),
        "{e}"
    );
    cloud.remove(&id).await.ok();

    // A long-running operation that fails: its error code is the error's.
    let rg2 = unique("rg-lro");
    let subnets = fake.network(&rg2, &["1"]);
    let cloud = driver(&fake, &rg2, &store);
    let nid = unique("n");
    let nlb = DistributorSpec {
        name: unique("nlb"),
        mode: DistributorMode::Nlb,
        domain: None,
        ..spec.clone()
    };
    store.insert_distributor(&nid, &nlb).unwrap();
    let mut p = publication(&[("1", &["10.0.1.4"])], &[80]);
    p.subnets
        .insert("1".into(), [subnets["1"].clone()].into_iter().collect());
    fake.fail_operation(
        &format!("loadBalancers/lbscale-{nid}$"),
        "LoadBalancerInternalError",
    );
    let e = cloud.publish(&nid, &nlb, &p).await.unwrap_err().to_string();
    assert!(
        e.contains("load balancer PUT") && e.contains("LoadBalancerInternalError"),
        "{e}"
    );
    cloud.publish(&nid, &nlb, &p).await.expect("a second try");
    cloud.remove(&nid).await.unwrap();
}

fn request(node_id: &str, az: &str, node: NodeSpec) -> ProvisionRequest {
    ProvisionRequest {
        credentials: auth::node_credentials("node-api-group-secret-0123456789", node_id).unwrap(),
        node_id: node_id.into(),
        group_id: "g-azure".into(),
        group_name: "g-azure".into(),
        az: az.into(),
        node,
    }
}

fn row(req: &ProvisionRequest, handle: Value) -> NodeRow {
    NodeRow {
        id: req.node_id.clone(),
        group_id: req.group_id.clone(),
        az: req.az.clone(),
        seq: 1,
        state: NodeState::Active,
        private_ip: String::new(),
        public_ip: None,
        registered: false,
        handle,
        created_at: 0,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_is_a_vm_in_its_zone_s_subnet_found_by_tag_and_deleted_with_its_nic_and_disk() {
    let Some(fake) =
        fake("a_node_is_a_vm_in_its_zone_s_subnet_found_by_tag_and_deleted_with_its_nic_and_disk")
    else {
        return;
    };
    let rg = unique("rg-vm");
    let subnets = fake.network(&rg, &["1", "2"]);
    let store = store("vm");
    let cloud = driver(&fake, &rg, &store);
    let node = NodeSpec {
        memory_limit_mb: 512,
        image: Some("Canonical:ubuntu-24_04-lts:server:latest".into()),
        size: Some("Standard_B2s".into()),
        subnets: subnets.clone(),
        tags: [("team".to_string(), "web".to_string())]
            .into_iter()
            .collect(),
        ..NodeSpec::default()
    };
    assert!(cloud.node_unusable(&node).is_none());
    let e = cloud
        .node_unusable(&NodeSpec {
            image: None,
            ..node.clone()
        })
        .unwrap();
    assert!(e.contains("node.image"), "{e}");
    let node_id = unique("n");
    let req = request(&node_id, "2", node.clone());
    let p = cloud.provision(&req).await.expect("provision");
    assert_eq!(p.api_port, NODE_API_PORT);
    let vm_path = Fake::path(
        &rg,
        &format!("Microsoft.Compute/virtualMachines/lbscale-{node_id}"),
    );
    let vm = fake.resource(&vm_path).expect("a VM");
    assert_eq!(vm["zones"], json!(["2"]));
    assert_eq!(vm["tags"]["lbscale-node-id"], node_id.as_str());
    assert_eq!(vm["tags"]["lbscale-group-id"], "g-azure");
    assert_eq!(vm["tags"]["team"], "web");
    assert_eq!(
        vm["properties"]["hardwareProfile"]["vmSize"],
        "Standard_B2s"
    );
    assert_eq!(
        vm["properties"]["storageProfile"]["imageReference"]["publisher"],
        "Canonical"
    );
    assert_eq!(vm["properties"]["provisioningState"], "Succeeded");
    let nic_id = vm["properties"]["networkProfile"]["networkInterfaces"][0]["id"]
        .as_str()
        .unwrap();
    let nic = fake.resource(nic_id).expect("its NIC");
    let ipc = &nic["properties"]["ipConfigurations"][0]["properties"];
    assert!(ipc["subnet"]["id"]
        .as_str()
        .unwrap()
        .eq_ignore_ascii_case(&subnets["2"]));
    assert_eq!(ipc["privateIPAddress"].as_str().unwrap(), p.private_ip);
    // Its public IP: Standard, static, in the node's zone, tagged like the
    // VM; its address is the node's public address.
    let pip_path = Fake::path(
        &rg,
        &format!("Microsoft.Network/publicIPAddresses/lbscale-{node_id}-pip"),
    );
    assert!(ipc["publicIPAddress"]["id"]
        .as_str()
        .unwrap()
        .eq_ignore_ascii_case(&pip_path));
    let pip = fake.resource(&pip_path).expect("its public IP");
    assert_eq!(pip["sku"]["name"], "Standard");
    assert_eq!(pip["properties"]["publicIPAllocationMethod"], "Static");
    assert_eq!(pip["zones"], json!(["2"]));
    assert_eq!(pip["tags"]["lbscale-node-id"], node_id.as_str());
    assert_eq!(pip["tags"]["lbscale-group-id"], "g-azure");
    assert_eq!(pip["tags"]["team"], "web");
    let public = p.public_ip.clone().expect("a public address");
    assert_eq!(pip["properties"]["ipAddress"].as_str().unwrap(), public);
    assert!(public.starts_with(&fake.public_prefix()), "{public}");
    assert!(p.private_ip.starts_with(&fake.private_prefix()), "{p:?}");
    // No node.security_groups: the group's own NSG is on the interface.
    let nsg_path = Fake::path(
        &rg,
        "Microsoft.Network/networkSecurityGroups/lbscale-g-azure",
    );
    assert!(nic["properties"]["networkSecurityGroup"]["id"]
        .as_str()
        .unwrap()
        .eq_ignore_ascii_case(&nsg_path));
    let disk = vm["properties"]["storageProfile"]["osDisk"]["managedDisk"]["id"]
        .as_str()
        .unwrap()
        .to_ascii_lowercase();
    assert!(fake.state()["disks"].get(&disk).is_some());

    // Run again (a crash before the handle was kept): the same VM, found by its tag.
    let again = cloud.provision(&req).await.expect("provision again");
    assert_eq!(again.private_ip, p.private_ip);
    assert_eq!(again.public_ip, p.public_ip);
    let vms = fake.resources_under(&Fake::path(&rg, "Microsoft.Compute/virtualMachines/"));
    assert_eq!(vms.len(), 1, "{vms:?}");

    let r = row(&req, p.handle.clone());
    assert_eq!(
        cloud
            .alive(&[
                r.clone(),
                row(&request("other", "1", node.clone()), Value::Null)
            ])
            .await
            .unwrap(),
        [true, false]
    );
    cloud.deprovision(&r).await.expect("deprovision");
    assert!(fake.resource(&vm_path).is_none());
    assert!(fake.resource(nic_id).is_none(), "the NIC went with the VM");
    assert!(
        fake.resource(&pip_path).is_none(),
        "the public IP went with the VM"
    );
    assert!(
        fake.state()["disks"].get(&disk).is_none(),
        "the disk went with the VM"
    );
    assert!(!cloud.is_alive(&r).await.unwrap());
    cloud
        .deprovision(&r)
        .await
        .expect("deprovision is idempotent");

    // A node without a handle is found by its name and tag.
    let lost = request(&unique("lost"), "1", node.clone());
    cloud.provision(&lost).await.unwrap();
    cloud.deprovision(&row(&lost, Value::Null)).await.unwrap();
    assert!(fake
        .resources_under(&Fake::path(&rg, "Microsoft.Compute/virtualMachines/"))
        .is_empty());

    // A crash after the public IP, before the VM (and the VM's start fails
    // for good): the address is found by its node id tag and deleted.
    let crashed = unique("crashed");
    let stray = Fake::path(
        &rg,
        &format!("Microsoft.Network/publicIPAddresses/{crashed}-elsewhere"),
    );
    let (code, body) = fake.arm(
        "PUT",
        &format!("{stray}?api-version=2025-07-01"),
        Some(
            json!({"location": "westeurope", "zones": ["1"], "sku": {"name": "Standard"},
                    "tags": {"lbscale-node-id": crashed, "lbscale-group-id": "g-azure"},
                    "properties": {"publicIPAllocationMethod": "Static"}}),
        ),
    );
    assert_eq!(code, 201, "{body}");
    let req = request(&crashed, "1", node.clone());
    cloud.deprovision(&row(&req, Value::Null)).await.unwrap();
    assert!(fake.resource(&stray).is_none(), "found by its tag");
    assert!(fake
        .resources_under(&Fake::path(&rg, "Microsoft.Network/publicIPAddresses/"))
        .is_empty());
}

fn group_spec(distributor_id: &str, node: &NodeSpec) -> GroupSpec {
    let d = |s: &str| DeclaredDuration::parse(s).unwrap();
    GroupSpec {
        name: unique("g"),
        cloud: CloudName::Azure,
        availability_zones: vec!["1".into()],
        traffic_distributor_id: distributor_id.into(),
        min_nodes: 1,
        max_nodes: 2,
        stats_interval: d("5s"),
        watch_time: d("10s"),
        cooldown: d("10s"),
        drain_timeout: d("1s"),
        thresholds: vec![ThresholdSpec {
            metric: Metric::Cpu,
            min: 10.0,
            max: 70.0,
        }],
        node: Some(node.clone()),
        apply_timeout: d("60s"),
    }
}

/// A node behind an `nlb` has no public IP (clients come through the load
/// balancer's frontends); behind a `dns` distributor it has one, and the
/// fake relays the node's public address to its private one on the ports
/// that its security group opens from the Internet, only those.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_s_public_address_is_its_own_behind_dns_and_none_behind_an_nlb() {
    let Some(fake) = fake("a_node_s_public_address_is_its_own_behind_dns_and_none_behind_an_nlb")
    else {
        return;
    };
    let rg = unique("rg-pip");
    let subnets = fake.network(&rg, &["1"]);
    let store = store("pip");
    let cloud = driver(&fake, &rg, &store);
    let node = NodeSpec {
        image: Some("Canonical:ubuntu-24_04-lts:server:latest".into()),
        subnets,
        ..NodeSpec::default()
    };
    let nlb_id = unique("n");
    store
        .insert_distributor(
            &nlb_id,
            &DistributorSpec {
                name: unique("nlb"),
                cloud: CloudName::Azure,
                mode: DistributorMode::Nlb,
                domain: None,
                ttl: DeclaredDuration::parse("60s").unwrap(),
            },
        )
        .unwrap();
    let dns_id = unique("d");
    store
        .insert_distributor(&dns_id, &dns_spec("pip.invalid", "30s"))
        .unwrap();
    let (g_nlb, g_dns) = (unique("gn"), unique("gd"));
    store
        .insert_group(&g_nlb, &group_spec(&nlb_id, &node), "t0ken")
        .unwrap();
    store
        .insert_group(&g_dns, &group_spec(&dns_id, &node), "t0ken")
        .unwrap();

    let mut behind_nlb = request(&unique("n"), "1", node.clone());
    behind_nlb.group_id = g_nlb.clone();
    let p = cloud.provision(&behind_nlb).await.expect("provision");
    assert_eq!(p.public_ip, None);
    assert!(fake
        .resources_under(&Fake::path(&rg, "Microsoft.Network/publicIPAddresses/"))
        .is_empty());
    cloud
        .deprovision(&row(&behind_nlb, p.handle))
        .await
        .unwrap();

    let mut behind_dns = request(&unique("n"), "1", node.clone());
    behind_dns.group_id = g_dns.clone();
    cloud
        .prepare_group(&GroupResources {
            group_id: g_dns.clone(),
            group_name: "gd".into(),
            availability_zones: vec!["1".into()],
            node: node.clone(),
            listeners: vec![Listener {
                port: 8080,
                protocol: Transport::Tcp,
            }],
        })
        .await
        .expect("prepare");
    let p = cloud.provision(&behind_dns).await.expect("provision");
    let public = p.public_ip.clone().expect("a public address");
    assert_ne!(public, p.private_ip);
    // Azure's NAT, as the fake emulates it: the vserver port reaches the
    // private address; the node API port does not (the NSG opens it to the
    // virtual network only, and the engine dials the private address).
    let relays = fake.relays();
    assert_eq!(
        relays.get(&format!("{public}:8080")),
        Some(&vec![format!("{}:8080", p.private_ip)]),
        "{relays:?}"
    );
    assert!(
        !relays.contains_key(&format!("{public}:{NODE_API_PORT}")),
        "{relays:?}"
    );
    cloud
        .deprovision(&row(&behind_dns, p.handle))
        .await
        .unwrap();
    assert!(fake
        .resources_under(&Fake::path(&rg, "Microsoft.Network/publicIPAddresses/"))
        .is_empty());
    assert!(!fake
        .relays()
        .keys()
        .any(|k| k.starts_with(&format!("{public}:"))));
    cloud.release_group(&g_dns).await.unwrap();
    cloud.release_group(&g_nlb).await.unwrap();
    assert!(fake
        .resources_under(&Fake::path(&rg, "Microsoft.Network/networkSecurityGroups/"))
        .is_empty());
}

fn inbound(nsg: &Value) -> BTreeMap<String, (i64, String, String, String, Vec<String>)> {
    nsg["properties"]["securityRules"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            let p = &r["properties"];
            assert_eq!(p["direction"], "Inbound", "{r}");
            let mut sources: Vec<String> = match p["sourceAddressPrefix"].as_str() {
                Some(s) => vec![s.to_string()],
                None => p["sourceAddressPrefixes"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|s| s.as_str().unwrap().to_string())
                    .collect(),
            };
            sources.sort();
            (
                r["name"].as_str().unwrap().to_string(),
                (
                    p["priority"].as_i64().unwrap(),
                    p["access"].as_str().unwrap().to_string(),
                    p["protocol"].as_str().unwrap().to_string(),
                    p["destinationPortRange"].as_str().unwrap().to_string(),
                    sources,
                ),
            )
        })
        .collect()
}

/// A group without node.security_groups gets an NSG of its own: the
/// vservers' ports from anywhere, the node API port from management_cidrs
/// (default: the virtual network's ranges) and denied from anywhere else;
/// kept exact at every prepare, left for a given NSG, deleted with the group.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_s_own_nsg_opens_the_vservers_and_the_node_api_to_management_only() {
    let Some(fake) =
        fake("a_group_s_own_nsg_opens_the_vservers_and_the_node_api_to_management_only")
    else {
        return;
    };
    let rg = unique("rg-nsg");
    let subnets = fake.network(&rg, &["1", "2"]);
    let store = store("nsg");
    let cloud = driver(&fake, &rg, &store);
    let group_id = unique("g");
    let nsg_path = Fake::path(
        &rg,
        &format!("Microsoft.Network/networkSecurityGroups/lbscale-{group_id}"),
    );
    let mut g = GroupResources {
        group_id: group_id.clone(),
        group_name: "web".into(),
        availability_zones: vec!["1".into(), "2".into()],
        node: NodeSpec {
            image: Some("Canonical:ubuntu-24_04-lts:server:latest".into()),
            subnets: subnets.clone(),
            ..NodeSpec::default()
        },
        listeners: vec![
            Listener {
                port: 8080,
                protocol: Transport::Tcp,
            },
            Listener {
                port: 5353,
                protocol: Transport::Udp,
            },
        ],
    };
    cloud.prepare_group(&g).await.expect("prepare");
    let nsg = fake.resource(&nsg_path).expect("the group's NSG");
    assert_eq!(nsg["tags"]["lbscale-group-id"], group_id.as_str());
    let any = || vec!["*".to_string()];
    let want = |api_sources: Option<Vec<String>>| {
        let mut m: BTreeMap<String, (i64, String, String, String, Vec<String>)> = [
            (
                "vserver-udp-5353".to_string(),
                (100, "Allow".into(), "Udp".into(), "5353".into(), any()),
            ),
            (
                "vserver-tcp-8080".to_string(),
                (101, "Allow".into(), "Tcp".into(), "8080".into(), any()),
            ),
            (
                "node-api-deny".to_string(),
                (4000, "Deny".into(), "Tcp".into(), "9990".into(), any()),
            ),
        ]
        .into();
        if let Some(s) = api_sources {
            m.insert(
                "node-api".into(),
                (1000, "Allow".into(), "Tcp".into(), "9990".into(), s),
            );
        }
        m
    };
    // The network's address space (fake.network: 10.0.0.0/16).
    assert_eq!(inbound(&nsg), want(Some(vec!["10.0.0.0/16".into()])));

    // An unchanged group writes nothing; a change made outside lbscale is undone.
    let puts = |f: &Fake| {
        f.requests()
            .iter()
            .filter(|r| {
                r["method"] == "PUT" && r["path"].as_str().unwrap().eq_ignore_ascii_case(&nsg_path)
            })
            .count()
    };
    let before = puts(&fake);
    cloud.prepare_group(&g).await.unwrap();
    assert_eq!(puts(&fake), before);
    let mut theirs = nsg.clone();
    theirs["properties"]["securityRules"].as_array_mut().unwrap().push(json!({"name": "ssh",
        "properties": {"protocol": "Tcp", "access": "Allow", "priority": 200, "direction": "Inbound",
                       "sourcePortRange": "*", "sourceAddressPrefix": "*", "destinationAddressPrefix": "*",
                       "destinationPortRange": "22"}}));
    theirs["properties"]
        .as_object_mut()
        .unwrap()
        .retain(|k, _| k == "securityRules");
    for k in ["id", "name", "type", "etag"] {
        theirs.as_object_mut().unwrap().remove(k);
    }
    strip_read_only(&mut theirs);
    let (code, body) = fake.arm(
        "PUT",
        &format!("{nsg_path}?api-version=2025-07-01"),
        Some(theirs),
    );
    assert_eq!(code, 200, "{body}");
    // management_cidrs given, a vserver gone.
    g.node.management_cidrs = vec!["192.0.2.0/24".into(), "198.51.100.7/32".into()];
    g.listeners.retain(|l| l.port == 8080);
    cloud.prepare_group(&g).await.unwrap();
    let mut w = want(Some(vec!["192.0.2.0/24".into(), "198.51.100.7/32".into()]));
    w.remove("vserver-udp-5353");
    w.get_mut("vserver-tcp-8080").unwrap().0 = 100;
    assert_eq!(inbound(&fake.resource(&nsg_path).unwrap()), w);

    // A node's interface has it; it cannot go while the interface exists.
    let node_id = unique("n");
    let mut req = request(&node_id, "1", g.node.clone());
    req.group_id = group_id.clone();
    let p = cloud.provision(&req).await.expect("provision");
    let nic = fake
        .resource(&Fake::path(
            &rg,
            &format!("Microsoft.Network/networkInterfaces/lbscale-{node_id}-nic"),
        ))
        .unwrap();
    assert!(nic["properties"]["networkSecurityGroup"]["id"]
        .as_str()
        .unwrap()
        .eq_ignore_ascii_case(&nsg_path));
    // node.security_groups given: the made NSG is left while in use (said in
    // the log), and a new node gets the given one.
    let given = Fake::path(&rg, "Microsoft.Network/networkSecurityGroups/theirs");
    let (code, body) = fake.arm(
        "PUT",
        &format!("{given}?api-version=2025-07-01"),
        Some(json!({"location": "westeurope", "properties": {"securityRules": []}})),
    );
    assert_eq!(code, 201, "{body}");
    let mut with_given = g.clone();
    with_given.node.security_groups = vec![given.clone()];
    cloud
        .prepare_group(&with_given)
        .await
        .expect("left while in use");
    assert!(fake.resource(&nsg_path).is_some());
    cloud.deprovision(&row(&req, p.handle)).await.unwrap();
    let other = unique("n");
    let mut req = request(&other, "1", with_given.node.clone());
    req.group_id = group_id.clone();
    let p = cloud.provision(&req).await.unwrap();
    let nic = fake
        .resource(&Fake::path(
            &rg,
            &format!("Microsoft.Network/networkInterfaces/lbscale-{other}-nic"),
        ))
        .unwrap();
    assert!(nic["properties"]["networkSecurityGroup"]["id"]
        .as_str()
        .unwrap()
        .eq_ignore_ascii_case(&given));
    cloud.prepare_group(&with_given).await.unwrap();
    assert!(fake.resource(&nsg_path).is_none(), "deleted once unused");
    cloud.deprovision(&row(&req, p.handle)).await.unwrap();

    // Back without a given one, then the group's destroy.
    cloud.prepare_group(&g).await.unwrap();
    assert!(fake.resource(&nsg_path).is_some());
    cloud.release_group(&group_id).await.unwrap();
    assert!(fake.resource(&nsg_path).is_none());
    assert!(
        fake.resource(&given).is_some(),
        "a given NSG is never touched"
    );
    cloud.release_group(&group_id).await.expect("idempotent");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_come_from_each_source_of_the_chain_and_are_refreshed_before_expiry() {
    let Some(fake) =
        fake("tokens_come_from_each_source_of_the_chain_and_are_refreshed_before_expiry")
    else {
        return;
    };
    use lbscale_cloud_azure::credentials::{Choice, EnvVars};
    let store = store("creds");
    let grants = |f: &Fake| {
        f.control("GET", "/_fake/grants", None)["grants"]
            .as_array()
            .unwrap()
            .clone()
    };
    let env = |v: &[(&str, &str)]| {
        EnvVars(
            v.iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        )
    };
    let base = |e: EnvVars| lbscale_cloud_azure::AzureSettings {
        credentials: Choice {
            authority_host: Some(fake.endpoint.clone()),
            ..Choice::default()
        },
        env: e,
        ..fake.settings("rg-creds")
    };

    // Environment (ARM_*): a client secret.
    let client = unique("env-client");
    let cloud = AzureCloud::new(
        base(env(&[
            ("ARM_CLIENT_ID", &client),
            ("ARM_CLIENT_SECRET", "s"),
            ("ARM_TENANT_ID", TENANT),
        ])),
        DriverStore::new(store.clone()),
    )
    .unwrap();
    cloud.check_credentials().await.unwrap();
    assert!(grants(&fake)
        .iter()
        .any(|g| g["subject"] == format!("{TENANT}/{client}") && g["how"] == "secret"));
    assert!(!cloud.credential_source().contains("\"s\""));

    // A wrong secret: the login's error code, not the secret.
    fake.control(
        "POST",
        "/_fake/clients",
        Some(json!({"client_id": "locked", "secret": "right"})),
    );
    let cloud = AzureCloud::new(
        base(env(&[
            ("AZURE_CLIENT_ID", "locked"),
            ("AZURE_CLIENT_SECRET", "wrong-s3cret"),
            ("AZURE_TENANT_ID", TENANT),
        ])),
        DriverStore::new(store.clone()),
    )
    .unwrap();
    let e = cloud.check_credentials().await.unwrap_err().to_string();
    assert!(
        e.contains("invalid_client") && e.contains("AADSTS7000215") && !e.contains("wrong-s3cret"),
        "{e}"
    );

    // Workload identity: the federated token file.
    let file = std::env::temp_dir().join(format!("lbscale-azure-federated-{}", std::process::id()));
    std::fs::write(&file, "eyJhbGciOiJSUzI1NiJ9.eyJzdWIiOiJ0In0.c2ln\n").unwrap();
    let wi = unique("wi");
    let cloud = AzureCloud::new(
        base(env(&[
            ("AZURE_CLIENT_ID", &wi),
            ("AZURE_TENANT_ID", TENANT),
            ("AZURE_FEDERATED_TOKEN_FILE", file.to_str().unwrap()),
        ])),
        DriverStore::new(store.clone()),
    )
    .unwrap();
    cloud.check_credentials().await.unwrap();
    assert!(grants(&fake)
        .iter()
        .any(|g| g["subject"] == format!("{TENANT}/{wi}") && g["how"] == "federated"));

    // Managed identity: the metadata endpoint (the fake's, for the test).
    let mi = unique("uai");
    let cloud = AzureCloud::new(
        base(env(&[
            ("AZURE_CLIENT_ID", &mi),
            ("AZURE_POD_IDENTITY_AUTHORITY_HOST", &fake.endpoint),
        ])),
        DriverStore::new(store.clone()),
    )
    .unwrap();
    assert!(cloud.credential_source().contains("managed identity"));
    cloud.check_credentials().await.unwrap();
    assert!(grants(&fake)
        .iter()
        .any(|g| g["subject"] == format!("managed-identity/{mi}")));

    // Short-lived tokens are fetched again before they expire, and ARM calls go on.
    fake.control("POST", "/_fake/tokens", Some(json!({"expires_in": 2})));
    let short = unique("short");
    let cloud = AzureCloud::new(
        base(env(&[
            ("AZURE_CLIENT_ID", &short),
            ("AZURE_CLIENT_SECRET", "s"),
            ("AZURE_TENANT_ID", TENANT),
        ])),
        DriverStore::new(store.clone()),
    )
    .unwrap();
    let id = unique("d");
    let spec = dns_spec("nowhere.invalid", "30s");
    store.insert_distributor(&id, &spec).unwrap();
    let result = async {
        cloud.ensure(&id, &spec).await?;
        tokio::time::sleep(std::time::Duration::from_millis(2500)).await;
        cloud
            .publish(&id, &spec, &publication(&[("1", &["127.0.0.7"])], &[80]))
            .await?;
        cloud.remove(&id).await
    }
    .await;
    fake.control("POST", "/_fake/tokens", Some(json!({"expires_in": 3600})));
    result.expect("calls across the refresh");
    let n = grants(&fake)
        .iter()
        .filter(|g| g["subject"] == format!("{TENANT}/{short}"))
        .count();
    assert!(n >= 2, "one token for all: {n}");
    let _ = CLIENT;
}
