//! Azure's own Python SDKs (tests/sdk/azure_sdk_client.py, pinned in
//! scripts/azure-sdk.sh) against the fake ARM server: they read back what the
//! driver made (pool members and Traffic Manager endpoints equal the serving
//! nodes' addresses, the CNAME points at the profile, the VM carries its tags,
//! the load balancer's frontends and the node are on public IPs of their
//! own, the group's NSG has the documented rules)
//! and make changes that the driver must then see. The fake speaks Azure's
//! wire format if Azure's own clients work against it.

use lbscale_cloud_azure::fake_testing::{fake, unique, Fake, CLIENT, SECRET, SUBSCRIPTION, TENANT};
use lbscale_cloud_azure::AzureCloud;
use lbscale_engine::cloud::{
    Cloud, Distributor, DriverStore, GroupResources, Listener, ProvisionRequest, Publication,
    Transport,
};
use lbscale_engine::model::{
    CloudName, DeclaredDuration, DistributorMode, DistributorSpec, NodeSpec,
};
use lbscale_engine::nodeapi::auth;
use lbscale_engine::store::{NodeRow, NodeState, Store};
use serde_json::Value;
use std::path::PathBuf;
use std::sync::Arc;

/// The SDKs' python (installed by scripts/azure-sdk.sh when missing), or
/// None after saying why (a failure under CI=true).
fn sdk_python() -> Option<PathBuf> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let out = std::process::Command::new(root.join("scripts/azure-sdk.sh"))
        .output()
        .expect("scripts/azure-sdk.sh");
    if out.status.success() {
        return Some(PathBuf::from(String::from_utf8(out.stdout).unwrap().trim()));
    }
    let why = format!(
        "scripts/azure-sdk.sh failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    if std::env::var("CI").as_deref() == Ok("true") {
        panic!("{why}");
    }
    eprintln!("SKIPPED: {why}");
    None
}

struct Sdk<'a> {
    python: PathBuf,
    fake: &'a Fake,
}

impl Sdk<'_> {
    fn run(&self, args: &[&str]) -> Value {
        let script =
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/sdk/azure_sdk_client.py");
        let out = std::process::Command::new(&self.python)
            .arg(script)
            .args(args)
            .env("AZURE_FAKE_ENDPOINT", &self.fake.endpoint)
            .env("AZURE_AUTHORITY_HOST", &self.fake.endpoint)
            .env("REQUESTS_CA_BUNDLE", &self.fake.ca)
            .env("AZURE_SUBSCRIPTION_ID", SUBSCRIPTION)
            .env("AZURE_TENANT_ID", TENANT)
            .env("AZURE_CLIENT_ID", CLIENT)
            .env("AZURE_CLIENT_SECRET", SECRET)
            .output()
            .expect("the SDK client");
        assert!(
            out.status.success(),
            "SDK {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).unwrap()
    }
}

fn strings(v: &Value) -> Vec<String> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_str().unwrap().to_string())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn azure_s_python_sdks_read_what_the_driver_made_and_the_driver_sees_their_changes() {
    let Some(fake) =
        fake("azure_s_python_sdks_read_what_the_driver_made_and_the_driver_sees_their_changes")
    else {
        return;
    };
    let Some(python) = sdk_python() else { return };
    let sdk = Sdk {
        python,
        fake: &fake,
    };
    let rg = unique("rg-sdk");
    // The network made by the SDK, used by the driver.
    let net = sdk.run(&[
        "network",
        &rg,
        "lbscale-sdk",
        "westeurope",
        "1=10.0.1.0/24",
        "2=10.0.2.0/24",
    ]);
    let subnet = |z: &str| net["subnets"][z].as_str().unwrap().to_string();
    let zone = format!("{}.example", unique("z"));
    sdk.run(&["zone", &rg, &zone]);

    let dir = std::env::temp_dir().join(format!("lbscale-azure-sdk-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let store = Arc::new(Store::open(&dir.join("state.db")).unwrap());
    let cloud = AzureCloud::new(fake.settings(&rg), DriverStore::new(store.clone())).unwrap();

    // nlb: pools of the serving nodes.
    let nlb_id = unique("n");
    let nlb = DistributorSpec {
        name: unique("nlb"),
        cloud: CloudName::Azure,
        mode: DistributorMode::Nlb,
        domain: None,
        ttl: DeclaredDuration::parse("60s").unwrap(),
    };
    store.insert_distributor(&nlb_id, &nlb).unwrap();
    let mut p = Publication::default();
    for (z, ips) in [("1", vec!["10.0.1.4", "10.0.1.5"]), ("2", vec!["10.0.2.4"])] {
        p.endpoints
            .insert(z.into(), ips.into_iter().map(String::from).collect());
        p.ports.insert(z.into(), vec![80]);
        p.subnets
            .insert(z.into(), [subnet(z)].into_iter().collect());
    }
    cloud.publish(&nlb_id, &nlb, &p).await.expect("publish nlb");
    let lb_name = format!("lbscale-{nlb_id}");
    let lb = sdk.run(&["lb", &rg, &lb_name]);
    assert_eq!(lb["sku"], "Standard");
    assert_eq!(strings(&lb["pools"]["z1"]), ["10.0.1.4", "10.0.1.5"]);
    assert_eq!(strings(&lb["pools"]["z2"]), ["10.0.2.4"]);
    // Public: the zone's frontend is on a zonal public IP (its zone is the
    // address's), which is the zone's VIP.
    assert!(lb["frontends"]["fe-2"]["zones"].is_null(), "{lb}");
    let pips = sdk.run(&["pips", &rg]);
    let fe2 = &pips[format!("lbscale-{nlb_id}-fe-2")];
    assert!(lb["frontends"]["fe-2"]["public_ip"]
        .as_str()
        .unwrap()
        .eq_ignore_ascii_case(fe2["id"].as_str().unwrap()));
    assert_eq!(fe2["zones"], serde_json::json!(["2"]));
    assert_eq!(
        (&fe2["sku"], &fe2["method"]),
        (&"Standard".into(), &"Static".into())
    );
    assert_eq!(lb["rules"]["z2-p80"]["pool"], "z2");
    assert_eq!(lb["rules"]["z2-p80"]["probe"], "p80");
    assert_eq!(lb["probes"]["p80"]["port"], 80);
    assert_eq!(
        cloud.addresses(&nlb_id, &nlb)["2"],
        fe2["address"].as_str().unwrap()
    );
    // The SDK drops a member (under the ETag it read); the driver puts it back.
    sdk.run(&["lb-drop-address", &rg, &lb_name, "z1", "10.0.1.5"]);
    assert_eq!(
        strings(&sdk.run(&["lb", &rg, &lb_name])["pools"]["z1"]),
        ["10.0.1.4"]
    );
    cloud
        .publish(&nlb_id, &nlb, &p)
        .await
        .expect("publish again");
    assert_eq!(
        strings(&sdk.run(&["lb", &rg, &lb_name])["pools"]["z1"]),
        ["10.0.1.4", "10.0.1.5"]
    );

    // dns: Traffic Manager endpoints of the serving nodes and the CNAME.
    let dns_id = unique("d");
    let dns = DistributorSpec {
        name: unique("dns"),
        cloud: CloudName::Azure,
        mode: DistributorMode::Dns,
        domain: Some(format!("www.{zone}")),
        ttl: DeclaredDuration::parse("20s").unwrap(),
    };
    store.insert_distributor(&dns_id, &dns).unwrap();
    let mut d = Publication::default();
    d.endpoints
        .insert("1".into(), vec!["127.92.9.1".into(), "127.92.9.2".into()]);
    d.ports.insert("1".into(), vec![8080]);
    cloud.ensure(&dns_id, &dns).await.unwrap();
    cloud.publish(&dns_id, &dns, &d).await.expect("publish dns");
    let profile = format!("lbscale-{dns_id}");
    let tm = sdk.run(&["tm", &rg, &profile]);
    assert_eq!(strings(&tm["endpoints"]), ["127.92.9.1", "127.92.9.2"]);
    assert_eq!(tm["ttl"], 20);
    assert_eq!(tm["routing"], "MultiValue");
    assert_eq!(tm["monitor"]["port"], 8080);
    let cname = sdk.run(&["cname", &rg, &zone, "www"]);
    assert_eq!(cname["cname"], tm["fqdn"]);
    assert_eq!(cname["metadata"]["lbscale_distributor"], dns_id.as_str());
    // The SDK deletes an endpoint; the driver's next publication restores it.
    sdk.run(&["tm-delete-endpoint", &rg, &profile, "n-127-92-9-2"]);
    assert_eq!(
        strings(&sdk.run(&["tm", &rg, &profile])["endpoints"]),
        ["127.92.9.1"]
    );
    cloud
        .publish(&dns_id, &dns, &d)
        .await
        .expect("publish dns again");
    assert_eq!(
        strings(&sdk.run(&["tm", &rg, &profile])["endpoints"]),
        ["127.92.9.1", "127.92.9.2"]
    );

    // A node: the VM as Compute's SDK lists it.
    let node_id = unique("vm");
    let req = ProvisionRequest {
        credentials: auth::node_credentials("node-api-group-secret-0123456789", &node_id).unwrap(),
        node_id: node_id.clone(),
        group_id: "g-sdk".into(),
        group_name: "g-sdk".into(),
        az: "1".into(),
        node: NodeSpec {
            image: Some("Canonical:ubuntu-24_04-lts:server:latest".into()),
            subnets: [("1".to_string(), subnet("1"))].into_iter().collect(),
            ..NodeSpec::default()
        },
    };
    let group = GroupResources {
        group_id: "g-sdk".into(),
        group_name: "g-sdk".into(),
        availability_zones: vec!["1".into()],
        node: req.node.clone(),
        listeners: vec![Listener {
            port: 8080,
            protocol: Transport::Tcp,
        }],
    };
    cloud
        .prepare_group(&group)
        .await
        .expect("prepare the group");
    let made = cloud.provision(&req).await.expect("provision");
    let vms = sdk.run(&["vms", &rg]);
    let vm = &vms[format!("lbscale-{node_id}")];
    assert_eq!(vm["tags"]["lbscale-node-id"], node_id.as_str());
    assert_eq!(vm["zones"], serde_json::json!(["1"]));
    assert_eq!(vm["state"], "Succeeded");
    // Its public IP, on its interface, is the node's public address.
    let nic = sdk.run(&["nic", &rg, &format!("lbscale-{node_id}-nic")]);
    let pips = sdk.run(&["pips", &rg]);
    let pip = &pips[format!("lbscale-{node_id}-pip")];
    assert!(nic["public_ip"]
        .as_str()
        .unwrap()
        .eq_ignore_ascii_case(pip["id"].as_str().unwrap()));
    assert_eq!(pip["address"].as_str(), made.public_ip.as_deref());
    assert_eq!(pip["zones"], serde_json::json!(["1"]));
    assert_eq!(pip["tags"]["lbscale-node-id"], node_id.as_str());
    assert!(pip["attached_to"]
        .as_str()
        .unwrap()
        .to_ascii_lowercase()
        .contains(&format!("lbscale-{node_id}-nic")));
    // The group's NSG, on the interface, as Network's SDK reads it.
    let nsg = sdk.run(&["nsg", &rg, "lbscale-g-sdk"]);
    assert!(nic["nsg"]
        .as_str()
        .unwrap()
        .to_ascii_lowercase()
        .ends_with("/networksecuritygroups/lbscale-g-sdk"));
    let rules = &nsg["rules"];
    assert_eq!(
        rules["vserver-tcp-8080"]["sources"],
        serde_json::json!(["*"])
    );
    assert_eq!(rules["vserver-tcp-8080"]["port"], "8080");
    assert_eq!(
        rules["node-api"]["sources"],
        serde_json::json!(["10.0.0.0/16"])
    );
    assert_eq!(rules["node-api"]["port"], "9990");
    assert_eq!(rules["node-api-deny"]["access"], "Deny");
    assert_eq!(rules.as_object().unwrap().len(), 3, "{nsg}");
    assert!(strings(&nsg["defaults"]).contains(&"DenyAllInBound".to_string()));
    // The SDK opens a port; the driver's next prepare closes it again.
    sdk.run(&["nsg-add-rule", &rg, "lbscale-g-sdk", "ssh", "300", "22"]);
    assert!(sdk.run(&["nsg", &rg, "lbscale-g-sdk"])["rules"]["ssh"].is_object());
    cloud.prepare_group(&group).await.unwrap();
    assert!(sdk.run(&["nsg", &rg, "lbscale-g-sdk"])["rules"]["ssh"].is_null());

    cloud.remove(&dns_id).await.unwrap();
    assert!(sdk.run(&["cname", &rg, &zone, "www"])["error"].is_string());
    cloud.remove(&nlb_id).await.unwrap();
    cloud
        .deprovision(&NodeRow {
            id: node_id.clone(),
            group_id: "g-sdk".into(),
            az: "1".into(),
            seq: 1,
            state: NodeState::Active,
            private_ip: made.private_ip.clone(),
            public_ip: made.public_ip.clone(),
            registered: false,
            handle: made.handle.clone(),
            created_at: 0,
        })
        .await
        .unwrap();
    cloud.release_group("g-sdk").await.unwrap();
    // Gone: the load balancer's and the node's public IPs, the NSG.
    let left = sdk.run(&["pips", &rg]);
    assert!(left.as_object().unwrap().is_empty(), "{left}");
    assert!(sdk.run(&["nsg", &rg, "lbscale-g-sdk"])["error"].is_string());
}
