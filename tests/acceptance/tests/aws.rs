//! The aws cloud under the real Terraform CLI, against moto's server (a real
//! implementation of the AWS APIs; see `lbscale_cloud_aws::moto_testing`): a
//! `dns` distributor is a Route 53 record set, a group's nodes are EC2
//! instances, and bad settings (and the clouds not built yet) are refused at
//! plan time by name. A group whose nodes come up behind an `nlb` (ELBv2) in
//! the group's subnets is in aws_placement.rs, where each instance's user
//! data runs a real lbscale-node at the instance's private address.

use lbscale_acceptance::*;
use lbscale_cloud_aws::moto_testing::{moto, unique, Moto};

const SECRET: &str = "acceptance-secret-key-value";

/// The provider's `aws` block that reaches moto.
fn aws_block(moto: &Moto, extra: &str) -> String {
    format!(
        r#"  aws {{
    region      = "us-east-1"
    endpoint    = "{}"
    credentials = "AKIDACCEPTANCE:{SECRET}"
    ca_bundle   = "{}"
    image_id    = "ami-12c6146b"
{extra}  }}
"#,
        moto.endpoint,
        moto.ca.display()
    )
}

#[test]
fn an_aws_dns_distributor_is_a_route53_record_set() {
    let Some(moto) = moto("an_aws_dns_distributor_is_a_route53_record_set") else {
        return;
    };
    let mut ws = Workspace::new("aws-dns", 129);
    ws.provider_blocks = aws_block(&moto, "");
    let domain = format!("{}.lbscale.test", unique("app"));
    let name = unique("awsd");
    ws.write(&format!(
        r#"
resource "lbscale_traffic_distributor" "d" {{
  name   = "{name}"
  cloud  = "aws"
  mode   = "dns"
  domain = "{domain}"
  ttl    = "45s"
}}

output "address" {{ value = lbscale_traffic_distributor.d.address }}
output "endpoints" {{ value = lbscale_traffic_distributor.d.endpoints }}
"#
    ));
    ws.apply();
    // A zone for the domain, whose first name server is where clients go.
    let fqdn = format!("{domain}.");
    let zone = moto
        .zones()
        .into_iter()
        .find(|z| z.1 == fqdn)
        .expect("a hosted zone for the domain");
    let out = ws.outputs();
    let ns = out["address"]["value"]["dns"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(ns.contains("awsdns"), "address: {}", out["address"]);
    assert_eq!(out["endpoints"]["value"], serde_json::json!([]));
    // Nothing is registered yet: no A record.
    assert!(moto.a_records(&fqdn, &fqdn).is_empty());
    // The credentials are in neither the state nor the store.
    let state = std::fs::read_to_string(ws.dir.join("terraform.tfstate")).unwrap();
    assert!(!state.contains(SECRET), "the AWS secret is in the state");
    let db = std::fs::read(ws.dir.join(".lbscale/state.db")).unwrap();
    assert!(
        !String::from_utf8_lossy(&db).contains(SECRET),
        "the AWS secret is in the store"
    );
    ws.assert_plan_empty("creating an aws distributor");
    ws.reimport("lbscale_traffic_distributor.d", &name);

    ws.destroy();
    assert!(
        !moto.zones().iter().any(|z| z.0 == zone.0),
        "the zone lbscale created is deleted with the distributor"
    );
}

/// An aws group's nodes are EC2 instances. moto runs no instance, so no node
/// answers: the apply fails naming the step and the node, and destroy
/// terminates every instance it started (none is left running).
#[test]
fn an_aws_group_starts_instances_and_destroy_terminates_them() {
    let Some(moto) = moto("an_aws_group_starts_instances_and_destroy_terminates_them") else {
        return;
    };
    let mut ws = Workspace::new("aws-group", 130);
    ws.provider_blocks = aws_block(&moto, "    instance_type = \"t3.small\"\n");
    let group = unique("awsg");
    ws.write(&format!(
        r#"
resource "lbscale_traffic_distributor" "d" {{
  name   = "{group}-d"
  cloud  = "aws"
  mode   = "dns"
  domain = "{group}.lbscale.test"
  ttl    = "1s"
}}

resource "lbscale_autoscale_group" "g" {{
  name                   = "{group}"
  cloud                  = "aws"
  availability_zones     = ["us-east-1a", "us-east-1b"]
  traffic_distributor_id = lbscale_traffic_distributor.d.id
  min_nodes              = 1
  max_nodes              = 2
  apply_timeout          = "10s"
  drain_timeout          = "1s"
  threshold {{
    metric = "cpu"
    min    = 10
    max    = 70
  }}
}}
"#
    ));
    let o = ws.tf(&["apply", "-auto-approve", "-no-color", "-input=false"]);
    assert_ne!(o.code, 0, "no node can answer on moto:\n{}", o.all());
    // The private address may be unreachable (the wait times out) or answered
    // by something else on this network (refused at once); either way the
    // failure names the step and the node.
    let all = o.all();
    assert!(
        (all.contains("wait for the node to be active")
            || all.contains("push the vservers to the node"))
            && all.contains(&format!("{group}-us-east-1")),
        "the failure names the step and the node:\n{all}"
    );
    // One instance per AZ, of the type, in the AZ, tagged with the group.
    let group_id = ws
        .engine()
        .group_named(&group)
        .unwrap()
        .expect("the group")
        .id;
    let mine = |moto: &Moto| -> Vec<serde_json::Value> {
        let listed = moto.call(
            "ec2",
            "POST",
            "/",
            Some(&format!(
                "Action=DescribeInstances&Version=2016-11-15&Filter.1.Name=tag:lbscale:group-id&Filter.1.Value.1={group_id}"
            )),
        );
        listed
            .split("<instanceId>")
            .skip(1)
            .filter_map(|s| s.split('<').next())
            .map(|id| moto.instance(id))
            .collect()
    };
    let started = mine(&moto);
    let mut azs: Vec<String> = started
        .iter()
        .filter(|i| i["state"] == "running")
        .map(|i| i["availability_zone"].as_str().unwrap().to_string())
        .collect();
    azs.sort();
    assert_eq!(azs, ["us-east-1a", "us-east-1b"], "{started:?}");
    assert!(started.iter().all(|i| i["instance_type"] == "t3.small"));

    ws.destroy();
    let after = mine(&moto);
    assert!(
        after.iter().all(|i| i["state"] == "terminated"),
        "an instance outlived its group: {after:?}"
    );
    assert!(!after.is_empty());
}

#[test]
fn azure_and_bad_aws_settings_are_refused_by_name() {
    let Some(moto) = moto("azure_and_bad_aws_settings_are_refused_by_name") else {
        return;
    };
    let mut ws = Workspace::new("aws-refused", 131);
    ws.provider_blocks = aws_block(&moto, "");
    ws.write(
        r#"
resource "lbscale_traffic_distributor" "d" {
  name  = "refused-azure"
  cloud = "azure"
  mode  = "nlb"
}
"#,
    );
    let o = ws.plan();
    assert_eq!(o.code, 1, "{}", o.all());
    let d = diagnostics(&o.all());
    assert!(
        // The azure driver without its settings (none in the provider nor
        // the environment): said on `cloud`, naming what to set.
        d.iter().any(|d| d.summary == "Cloud not usable"
            && d.text.contains("no Azure subscription_id")
            && d.line == Some(line_of(&ws, "cloud = \"azure\""))),
        "{d:?}"
    );

    // A group on aws without an image, and a distributor without a region:
    // refused at plan time on their `cloud`, saying what to set.
    ws.provider_blocks = aws_block(&moto, "").replace("    image_id    = \"ami-12c6146b\"\n", "");
    let stack = r#"
resource "lbscale_traffic_distributor" "d" {
  name   = "noimage-d"
  cloud  = "aws"
  mode   = "dns"
  domain = "noimage.lbscale.test"
}

resource "lbscale_autoscale_group" "g" {
  name                   = "noimage"
  cloud                  = "aws"
  availability_zones     = ["us-east-1a"]
  traffic_distributor_id = lbscale_traffic_distributor.d.id
  threshold {
    metric = "cpu"
    min    = 10
    max    = 70
  }
}
"#;
    let o = plan_refused(&mut ws, None, stack);
    let d = diagnostics(&o.all());
    assert!(
        d.iter().any(|d| d.summary == "Cloud not usable"
            && d.text.contains("image_id")
            && d.text.contains("LBSCALE_AWS_IMAGE_ID")),
        "{d:?}"
    );
    let no_region = aws_block(&moto, "").replace("    region      = \"us-east-1\"\n", "");
    let o = plan_refused(&mut ws, Some(no_region), stack);
    let d = diagnostics(&o.all());
    assert!(
        d.iter().any(|d| d.summary == "Cloud not usable"
            && d.text.contains("no AWS region")
            && d.line == Some(line_of(&ws, "cloud  = \"aws\""))),
        "{d:?}"
    );

    // A credential without its secret: named, and not repeated.
    let no_secret = aws_block(&moto, "").replace(&format!("AKIDACCEPTANCE:{SECRET}"), "AKIDONLY");
    let o = plan_refused(&mut ws, Some(no_secret), stack);
    assert!(o.all().contains("Invalid credentials"), "{}", o.all());
    // Terraform quotes the configuration's line once; the message itself
    // does not repeat the value.
    assert_eq!(
        o.all().matches("AKIDONLY").count(),
        1,
        "the credential is repeated:\n{}",
        o.all()
    );
    // An endpoint that is not a URL.
    let bad_endpoint = aws_block(&moto, "").replace(&moto.endpoint, "moto:5000");
    let o = plan_refused(&mut ws, Some(bad_endpoint), stack);
    assert!(
        o.all().contains("Invalid endpoint") && o.all().contains("http(s)://HOST[:PORT]"),
        "{}",
        o.all()
    );
}

/// Plans `stack` (with these provider blocks, if given) and expects Terraform
/// to refuse it (exit 1); its output is for the caller to check.
fn plan_refused(ws: &mut Workspace, provider_blocks: Option<String>, stack: &str) -> Output {
    if let Some(blocks) = provider_blocks {
        ws.provider_blocks = blocks;
    }
    ws.write(stack);
    let o = ws.plan();
    assert_eq!(o.code, 1, "{}", o.all());
    o
}
