//! The shared module `examples/modules/fleet` (distributor, group, SE group,
//! vservers, with the cloud and its settings as variables), applied under the
//! real Terraform CLI on the local cloud: traffic flows through it, the plan
//! after is empty, destroy leaves nothing. gcp.rs applies the same module on
//! the gcp fake.

use lbscale_acceptance::*;
use std::time::Duration;

#[test]
fn the_fleet_module_applies_serves_and_destroys_on_local() {
    let backend = http_backend("fleet-b1");
    let mut ws = Workspace::new("fleet-local", 207);
    ws.copy_fleet_module();
    ws.write(&format!(
        r#"
module "shop" {{
  source             = "./modules/fleet"
  name               = "fleet"
  cloud              = "local"
  availability_zones = ["az1", "az2"]
  domain             = "fleet.lbscale.test"
  ttl                = "1s"
  node               = {{ memory_limit_mb = 128 }}
  thresholds         = [{{ metric = "memory", min = 1, max = 99 }}]
  vservers = {{
    web = {{
      port     = 18207
      backends = [{{ name = "b1", address = "127.0.0.1", port = {backend} }}]
    }}
  }}
}}

output "dns" {{ value = module.shop.dns }}
"#
    ));
    let o = ws.tf(&["get", "-no-color"]);
    assert_eq!(o.code, 0, "terraform get:\n{}", o.all());
    ws.apply();
    let dns = ws.outputs()["dns"]["value"].as_str().unwrap().to_string();
    let answered = dig(&dns, "fleet.lbscale.test");
    assert_eq!(answered.len(), 2, "a node per zone: {answered:?}");
    for ip in &answered {
        let (status, _, body) = wait_for("the node to serve", Duration::from_secs(15), || {
            http_get(ip, 18207, "fleet.lbscale.test").ok()
        });
        assert_eq!((status, body.trim()), (200, "fleet-b1"));
    }
    // Neither the group's secret nor a node's private key is in the state.
    let state = std::fs::read_to_string(ws.dir.join("terraform.tfstate")).unwrap();
    let group_id = ws
        .engine()
        .group_named("fleet")
        .unwrap()
        .expect("the group")
        .id;
    let secret = ws
        .store()
        .group_token(&group_id)
        .unwrap()
        .expect("its secret");
    assert!(
        !state.contains(&secret),
        "the group's secret is in the state"
    );
    assert!(
        !state.contains("PRIVATE KEY"),
        "a private key is in the state"
    );
    ws.assert_plan_empty("the fleet module");
    ws.destroy();
    ws.assert_nothing_left(&[]);
}
