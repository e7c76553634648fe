//! The azure cloud under the real Terraform CLI, against the fake ARM server
//! (`lbscale_cloud_azure::fake_testing`: it follows Azure's published API
//! definitions). The fake runs a VM's custom data (scripts/test.sh starts it
//! with `--run-custom-data` and the built lbscale-node), so a group's node
//! really serves, at the loopback private address the fake gave it: apply,
//! an empty plan, the daemon scaling out under load and back in, destroy.
//! The fake relays a public address (a node's, an nlb frontend's) to the
//! private one on the ports that the NSGs open, as Azure's NAT does: clients
//! here reach the nodes at the addresses that Traffic Manager and the load
//! balancer hand out.

use lbscale_acceptance::*;
use lbscale_cloud_azure::fake_testing::{fake, unique, Fake, CLIENT, SECRET, SUBSCRIPTION, TENANT};
use std::time::Duration;

/// The provider's `azure` block that reaches the fake.
fn azure_block(fake: &Fake, rg: &str) -> String {
    format!(
        r#"  azure {{
    subscription_id = "{SUBSCRIPTION}"
    resource_group  = "{rg}"
    location        = "westeurope"
    tenant_id       = "{TENANT}"
    client_id       = "{CLIENT}"
    client_secret   = "{SECRET}"
    endpoint        = "{e}"
    authority_host  = "{e}"
    ca_bundle       = "{ca}"
  }}
"#,
        e = fake.endpoint,
        ca = fake.ca.display()
    )
}

#[test]
fn an_azure_group_of_vms_behind_a_traffic_manager_profile_applies_plans_empty_and_destroys() {
    let Some(fake) = fake(
        "an_azure_group_of_vms_behind_a_traffic_manager_profile_applies_plans_empty_and_destroys",
    ) else {
        return;
    };
    let rg = unique("rg-acc");
    let subnets = fake.network(&rg, &["1", "2"]);
    let zone = format!("{}.example", unique("acc"));
    let zone_path = fake.dns_zone(&rg, &zone);
    let mut ws = Workspace::new("azure-group", 151);
    ws.provider_blocks = azure_block(&fake, &rg);
    ws.write(&format!(
        r#"
resource "lbscale_traffic_distributor" "d" {{
  name   = "azd"
  cloud  = "azure"
  mode   = "dns"
  domain = "www.{zone}"
  ttl    = "1s"
}}

resource "lbscale_autoscale_group" "g" {{
  name                   = "azg"
  cloud                  = "azure"
  availability_zones     = ["1", "2"]
  traffic_distributor_id = lbscale_traffic_distributor.d.id
  min_nodes              = 1
  max_nodes              = 2
  apply_timeout          = "60s"
  drain_timeout          = "1s"
  node {{
    image   = "Canonical:ubuntu-24_04-lts:server:latest"
    size    = "Standard_B2s"
    subnets = {{ "1" = "{s1}", "2" = "{s2}" }}
    tags    = {{ team = "edge" }}
  }}
  threshold {{
    metric = "cpu"
    min    = 10
    max    = 70
  }}
}}

output "address" {{ value = lbscale_traffic_distributor.d.address }}
output "endpoints" {{ value = lbscale_traffic_distributor.d.endpoints }}
"#,
        s1 = subnets["1"],
        s2 = subnets["2"],
    ));
    ws.apply();
    let vms = fake.resources_under(&Fake::path(&rg, "Microsoft.Compute/virtualMachines/"));
    assert_eq!(vms.len(), 2, "{vms:?}");
    let mut zones: Vec<String> = vms
        .values()
        .map(|v| v["zones"][0].as_str().unwrap().to_string())
        .collect();
    zones.sort();
    assert_eq!(zones, ["1", "2"]);
    assert!(vms.values().all(|v| v["tags"]["team"] == "edge"));
    let processes = fake.state()["processes"].as_object().unwrap().len();
    assert!(processes >= 2, "the VMs' lbscale-node run: {processes}");
    // The profile hands out the two nodes; the CNAME points at it.
    let out = ws.outputs();
    let fqdn = out["address"]["value"]["dns"].as_str().unwrap().to_string();
    assert!(fqdn.ends_with(".trafficmanager.net"), "{out}");
    let profiles = fake.resources_under(&Fake::path(
        &rg,
        "Microsoft.Network/trafficmanagerprofiles/",
    ));
    let profile = profiles.values().next().expect("a profile");
    // Its endpoints are the nodes' public IPs (each node's own, in its zone).
    let group_id = ws.engine().group_named("azg").unwrap().unwrap().id;
    let mut publics: Vec<String> = ws
        .engine()
        .node_rows(&group_id)
        .unwrap()
        .into_iter()
        .map(|n| n.public_ip.expect("a public address"))
        .collect();
    publics.sort();
    let mut endpoints: Vec<String> = profile["properties"]["endpoints"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["properties"]["target"].as_str().unwrap().to_string())
        .collect();
    endpoints.sort();
    assert_eq!(endpoints, publics, "{profile}");
    assert!(
        publics.iter().all(|a| a.starts_with(&fake.public_prefix())),
        "{publics:?}"
    );
    let pips = fake.resources_under(&Fake::path(&rg, "Microsoft.Network/publicIPAddresses/"));
    let mut pip_addresses: Vec<String> = pips
        .values()
        .map(|p| {
            assert_eq!(p["sku"]["name"], "Standard");
            p["properties"]["ipAddress"].as_str().unwrap().to_string()
        })
        .collect();
    pip_addresses.sort();
    assert_eq!(pip_addresses, publics);
    // The group's own NSG: the node API from the network's range only.
    let nsgs = fake.resources_under(&Fake::path(&rg, "Microsoft.Network/networkSecurityGroups/"));
    assert_eq!(nsgs.len(), 1, "{nsgs:?}");
    let rules = nsgs.values().next().unwrap()["properties"]["securityRules"].clone();
    let api = rules
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["name"] == "node-api")
        .expect("the node API rule");
    assert_eq!(
        api["properties"]["sourceAddressPrefixes"],
        serde_json::json!(["10.0.0.0/16"])
    );
    let cname = fake
        .resource(&format!("{zone_path}/CNAME/www"))
        .expect("the CNAME");
    assert_eq!(cname["properties"]["CNAMERecord"]["cname"], fqdn.as_str());
    // The secret is in neither the state nor the store.
    let state = std::fs::read_to_string(ws.dir.join("terraform.tfstate")).unwrap();
    assert!(!state.contains(SECRET), "the secret is in the state");
    let db = std::fs::read(ws.dir.join(".lbscale/state.db")).unwrap();
    assert!(
        !String::from_utf8_lossy(&db).contains(SECRET),
        "the secret is in the store"
    );
    ws.assert_plan_empty("an azure group and distributor");

    ws.destroy();
    assert!(fake
        .resources_under(&Fake::path(&rg, "Microsoft.Compute/"))
        .is_empty());
    for gone in [
        "networkInterfaces",
        "publicIPAddresses",
        "networkSecurityGroups",
    ] {
        let left = fake.resources_under(&Fake::path(&rg, &format!("Microsoft.Network/{gone}/")));
        assert!(left.is_empty(), "{gone} left after destroy: {left:?}");
    }
    assert!(fake
        .resources_under(&Fake::path(
            &rg,
            "Microsoft.Network/trafficmanagerprofiles/"
        ))
        .is_empty());
    assert!(fake.resource(&format!("{zone_path}/CNAME/www")).is_none());
    assert!(fake.state()["disks"]
        .as_object()
        .unwrap()
        .keys()
        .all(|d| !d.contains(&rg.to_ascii_lowercase())));
}

/// Bad azure settings are refused at plan time on their attribute, without
/// repeating the secret.
#[test]
fn bad_azure_settings_are_refused_by_name() {
    let mut ws = Workspace::new("azure-refused", 152);
    ws.provider_blocks = r#"  azure {
    subscription_id = "s"
    resource_group  = "g"
    location        = "westeurope"
    client_id       = "c"
    client_secret   = "s3cret-value"
  }
"#
    .into();
    let body = r#"
resource "lbscale_traffic_distributor" "d" {
  name   = "refused"
  cloud  = "azure"
  mode   = "dns"
  domain = "refused.lbscale.test"
}
"#;
    ws.write(body);
    let o = ws.plan();
    assert_eq!(o.code, 1, "{}", o.all());
    let d = diagnostics(&o.all());
    assert!(
        d.iter().any(|d| d.summary == "Missing tenant_id"
            && d.text.contains("client_secret needs tenant_id")),
        "{d:?}"
    );
    assert!(!o.all().contains("s3cret-value"), "{}", o.all());

    ws.provider_blocks = ws.provider_blocks.replace(
        "    client_secret   = \"s3cret-value\"\n",
        "    endpoint        = \"management.azure.com\"\n",
    );
    ws.write(body);
    let o = ws.plan();
    assert_eq!(o.code, 1, "{}", o.all());
    assert!(
        diagnostics(&o.all())
            .iter()
            .any(|d| d.summary == "Invalid endpoint" && d.text.contains("http(s)://HOST")),
        "{}",
        o.all()
    );
}

/// The daemon scales an azure group out under load and back in when idle:
/// its VMs (real lbscale-node processes that the fake runs) join the Traffic
/// Manager profile and leave it, and the plan stays empty.
#[test]
fn the_daemon_scales_an_azure_group_out_under_load_and_back_in() {
    let Some(fake) = fake("the_daemon_scales_an_azure_group_out_under_load_and_back_in") else {
        return;
    };
    let rg = unique("rg-daemon");
    let subnets = fake.network(&rg, &["1"]);
    let zone = format!("{}.example", unique("dmn"));
    fake.dns_zone(&rg, &zone);
    let backend = big_backend();
    let mut ws = Workspace::new("azure-daemon", 153);
    ws.provider_blocks = azure_block(&fake, &rg);
    let stack = daemon_stack("azdm", backend, 2, "3s")
        .replace("cloud  = \"local\"", "cloud  = \"azure\"")
        .replace("cloud                  = \"local\"", "cloud                  = \"azure\"")
        .replace("domain = \"azdm.lbscale.test\"", &format!("domain = \"www.{zone}\""))
        .replace("availability_zones     = [\"az1\"]", "availability_zones     = [\"1\"]")
        .replace(
            "  drain_timeout          = \"2s\"\n",
            &format!(
                "  drain_timeout          = \"2s\"\n  apply_timeout          = \"60s\"\n  node {{\n    image   = \"Canonical:ubuntu-24_04-lts:server:latest\"\n    subnets = {{ \"1\" = \"{}\" }}\n  }}\n",
                subnets["1"]
            ),
        );
    ws.write(&stack);
    ws.apply();
    let group_id = ws.engine().group_named("azdm").unwrap().unwrap().id;
    let serving = |ws: &Workspace| -> Vec<String> {
        ws.engine()
            .node_rows(&group_id)
            .unwrap()
            .into_iter()
            .filter(|n| n.registered && n.state.as_str() == "active")
            .map(|n| n.public_ip.expect("a public address"))
            .collect()
    };
    let targets = |fake: &Fake| -> Vec<String> {
        let profiles = fake.resources_under(&Fake::path(
            &rg,
            "Microsoft.Network/trafficmanagerprofiles/",
        ));
        let mut t: Vec<String> = profiles
            .values()
            .flat_map(|p| {
                p["properties"]["endpoints"]
                    .as_array()
                    .cloned()
                    .unwrap_or_default()
            })
            .map(|e| e["properties"]["target"].as_str().unwrap().to_string())
            .collect();
        t.sort();
        t
    };
    let first = serving(&ws);
    assert_eq!(first.len(), 1, "{first:?}");
    assert_eq!(targets(&fake), first);

    let env = [
        ("ARM_SUBSCRIPTION_ID", SUBSCRIPTION),
        ("LBSCALE_AZURE_RESOURCE_GROUP", rg.as_str()),
        ("LBSCALE_AZURE_LOCATION", "westeurope"),
        ("LBSCALE_AZURE_ENDPOINT", fake.endpoint.as_str()),
        ("LBSCALE_AZURE_CA_BUNDLE", fake.ca.to_str().unwrap()),
        ("AZURE_AUTHORITY_HOST", fake.endpoint.as_str()),
        ("AZURE_TENANT_ID", TENANT),
        ("AZURE_CLIENT_ID", CLIENT),
        ("AZURE_CLIENT_SECRET", SECRET),
    ];
    let daemon = Daemon::start_with(&ws, 19571, "azure", &env);
    // At the node's public address, as Traffic Manager hands it out: the
    // fake relays it to the node (the group's NSG opens the vserver's port).
    let load = Load::start(&first[0], &format!("www.{zone}"));
    let both = wait_for(
        "scale-out to 2 serving VMs",
        Duration::from_secs(60),
        || {
            let s = serving(&ws);
            (s.len() == 2).then_some(s)
        },
    );
    wait_for(
        "both VMs in the Traffic Manager profile",
        Duration::from_secs(15),
        || {
            let mut b = both.clone();
            b.sort();
            (targets(&fake) == b).then_some(())
        },
    );
    assert_eq!(
        fake.resources_under(&Fake::path(&rg, "Microsoft.Compute/virtualMachines/"))
            .len(),
        2
    );
    assert!(load.stop() > 20, "the load generator got answers");
    wait_for("scale-in back to 1 VM", Duration::from_secs(60), || {
        (serving(&ws).len() == 1
            && fake
                .resources_under(&Fake::path(&rg, "Microsoft.Compute/virtualMachines/"))
                .len()
                == 1)
            .then_some(())
    });
    wait_for(
        "the profile back to one endpoint",
        Duration::from_secs(15),
        || (targets(&fake).len() == 1).then_some(()),
    );
    ws.assert_plan_empty("the daemon scaled an azure group out and in");
    daemon.stop();
    ws.destroy();
    assert!(fake
        .resources_under(&Fake::path(&rg, "Microsoft.Compute/"))
        .is_empty());
    assert!(fake
        .resources_under(&Fake::path(&rg, "Microsoft.Network/publicIPAddresses/"))
        .is_empty());
}

/// An nlb distributor is a public Standard Load Balancer: each zone's VIP is
/// a zonal public IP, and a client reaches the group's vserver through it
/// (the fake relays a frontend's rule to its pool's members, through their
/// NSG). The nodes behind it have no public IP of their own.
#[test]
fn an_azure_nlb_is_public_and_serves_through_its_zone_s_public_address() {
    let Some(fake) = fake("an_azure_nlb_is_public_and_serves_through_its_zone_s_public_address")
    else {
        return;
    };
    let rg = unique("rg-nlb");
    let subnets = fake.network(&rg, &["1"]);
    let backend = http_backend("azure-nlb-backend");
    let mut ws = Workspace::new("azure-nlb", 155);
    ws.provider_blocks = azure_block(&fake, &rg);
    ws.write(&format!(
        r#"
resource "lbscale_traffic_distributor" "d" {{
  name  = "aznlb"
  cloud = "azure"
  mode  = "nlb"
}}

resource "lbscale_autoscale_group" "g" {{
  name                   = "aznlbg"
  cloud                  = "azure"
  availability_zones     = ["1"]
  traffic_distributor_id = lbscale_traffic_distributor.d.id
  min_nodes              = 1
  max_nodes              = 2
  apply_timeout          = "60s"
  drain_timeout          = "1s"
  node {{
    image   = "Canonical:ubuntu-24_04-lts:server:latest"
    subnets = {{ "1" = "{s1}" }}
  }}
  threshold {{
    metric = "cpu"
    min    = 10
    max    = 70
  }}
}}

resource "lbscale_se_group" "s" {{
  name               = "aznlb-se"
  autoscale_group_id = lbscale_autoscale_group.g.id
}}

resource "lbscale_vserver" "web" {{
  name         = "aznlb-web"
  se_group_id  = lbscale_se_group.s.id
  service_type = "HTTP"
  port         = 8080
  service {{
    name    = "b"
    address = "127.0.0.1"
    port    = {backend}
  }}
}}
"#,
        s1 = subnets["1"],
    ));
    ws.apply();
    let lbs = fake.resources_under(&Fake::path(&rg, "Microsoft.Network/loadBalancers/"));
    assert_eq!(lbs.len(), 1, "{lbs:?}");
    let front = lbs.values().next().unwrap()["properties"]["frontendIPConfigurations"][0].clone();
    let pip = fake
        .resource(
            front["properties"]["publicIPAddress"]["id"]
                .as_str()
                .expect("a public frontend"),
        )
        .unwrap();
    assert_eq!(pip["zones"], serde_json::json!(["1"]));
    let vip = pip["properties"]["ipAddress"].as_str().unwrap().to_string();
    assert!(vip.starts_with(&fake.public_prefix()), "{vip}");
    // No public IP but the frontend's: the nodes are behind the load balancer.
    assert_eq!(
        fake.resources_under(&Fake::path(&rg, "Microsoft.Network/publicIPAddresses/"))
            .len(),
        1
    );
    let group_id = ws.engine().group_named("aznlbg").unwrap().unwrap().id;
    assert!(ws
        .engine()
        .node_rows(&group_id)
        .unwrap()
        .iter()
        .all(|n| n.public_ip.is_none()));
    let (status, _, body) = wait_for(
        "an answer through the nlb's public address",
        Duration::from_secs(30),
        || http_get(&vip, 8080, "aznlb.example").ok(),
    );
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("azure-nlb-backend"), "{body}");
    ws.assert_plan_empty("an azure nlb group");
    ws.destroy();
    for gone in [
        "loadBalancers",
        "publicIPAddresses",
        "networkSecurityGroups",
        "networkInterfaces",
    ] {
        let left = fake.resources_under(&Fake::path(&rg, &format!("Microsoft.Network/{gone}/")));
        assert!(left.is_empty(), "{gone} left after destroy: {left:?}");
    }
}

/// The shared module `examples/modules/fleet` on the fake ARM server: the
/// same module as on local (fleet_module.rs), with azure's zones and node
/// block.
#[test]
fn the_fleet_module_comes_up_on_azure_and_goes_with_destroy() {
    let Some(fake) = fake("the_fleet_module_comes_up_on_azure_and_goes_with_destroy") else {
        return;
    };
    let rg = unique("rg-fleet");
    let subnets = fake.network(&rg, &["1", "2"]);
    let zone = format!("{}.example", unique("fleet"));
    fake.dns_zone(&rg, &zone);
    let mut ws = Workspace::new("azure-fleet", 154);
    ws.provider_blocks = azure_block(&fake, &rg);
    ws.copy_fleet_module();
    ws.write(&format!(
        r#"
module "shop" {{
  source             = "./modules/fleet"
  name               = "azfleet"
  cloud              = "azure"
  availability_zones = ["1", "2"]
  domain             = "www.{zone}"
  ttl                = "1s"
  node = {{
    image   = "Canonical:ubuntu-24_04-lts:server:latest"
    size    = "Standard_B2s"
    subnets = {{ "1" = "{s1}", "2" = "{s2}" }}
    tags    = {{ app = "fleet" }}
  }}
  vservers = {{
    web = {{
      port     = 8080
      backends = [{{ name = "b1", address = "10.0.1.10", port = 8080 }}]
    }}
  }}
}}
"#,
        s1 = subnets["1"],
        s2 = subnets["2"],
    ));
    let o = ws.tf(&["get", "-no-color"]);
    assert_eq!(o.code, 0, "terraform get:\n{}", o.all());
    ws.apply();
    let vms = fake.resources_under(&Fake::path(&rg, "Microsoft.Compute/virtualMachines/"));
    assert_eq!(vms.len(), 2, "{vms:?}");
    assert!(vms.values().all(|v| v["tags"]["app"] == "fleet"), "{vms:?}");
    ws.assert_plan_empty("the fleet module on azure");
    ws.destroy();
    assert!(fake
        .resources_under(&Fake::path(&rg, "Microsoft.Compute/"))
        .is_empty());
    assert!(fake
        .resources_under(&Fake::path(
            &rg,
            "Microsoft.Network/trafficmanagerprofiles/"
        ))
        .is_empty());
}
