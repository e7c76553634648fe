//! The aws cloud driver against moto's server, a real implementation of AWS's
//! EC2 and Route 53 APIs (see `lbscale_cloud_aws::moto_testing`). What the driver
//! did is read back with curl and moto's own state dump, not through the driver.

use lbscale_cloud_aws::moto_testing::{moto, unique, Moto};
use lbscale_cloud_aws::{AwsCloud, AwsSettings, NODE_API_PORT};
use lbscale_engine::cloud::{Cloud, Distributor, DriverStore, ProvisionRequest, Publication};
use lbscale_engine::model::{
    CloudName, DeclaredDuration, DistributorMode, DistributorSpec, NodeSpec,
};
use lbscale_engine::nodeapi::auth;
use lbscale_engine::store::{NodeRow, NodeState, Store};
use serde_json::Value;
use std::sync::Arc;

/// One of the images moto knows from the start.
const IMAGE: &str = "ami-12c6146b";

fn node_settings(moto: &Moto) -> AwsSettings {
    AwsSettings {
        image_id: Some(IMAGE.into()),
        instance_type: Some("t3.micro".into()),
        ..moto.settings()
    }
}

fn store(test: &str) -> Arc<Store> {
    let dir = std::env::temp_dir().join(format!("lbscale-aws-{test}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    Arc::new(Store::open(&dir.join("state.db")).unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_is_an_ec2_instance_started_once_and_terminated() {
    let Some(moto) = moto("a_node_is_an_ec2_instance_started_once_and_terminated") else {
        return;
    };
    let store = store("node");
    let cloud = AwsCloud::new(node_settings(&moto), DriverStore::new(store)).expect("driver");
    let secret = "node-api-group-secret-0123456789".to_string();
    let node_id = unique("n");
    let req = ProvisionRequest {
        credentials: auth::node_credentials(&secret, &node_id).unwrap(),
        node_id,
        group_id: "g-aws".into(),
        group_name: "g-aws".into(),
        az: "us-east-1b".into(),
        node: NodeSpec {
            memory_limit_mb: 512,
            ..NodeSpec::default()
        },
    };
    let p = cloud.provision(&req).await.expect("provision");
    let id = p.handle["instance_id"]
        .as_str()
        .expect("instance id")
        .to_string();
    assert_eq!(p.api_port, NODE_API_PORT);

    // What EC2 holds: the instance in the AZ, from the image, of the type,
    // tagged with the node and group, running, with the addresses returned.
    let i = moto.instance(&id);
    assert_eq!(i["availability_zone"], "us-east-1b");
    assert_eq!(i["image_id"], IMAGE);
    assert_eq!(i["instance_type"], "t3.micro");
    assert_eq!(i["state"], "running");
    assert_eq!(
        i["private_ip_address"].as_str(),
        Some(p.private_ip.as_str())
    );
    assert_eq!(i["public_ip_address"].as_str(), p.public_ip.as_deref());
    let tags = moto.call(
        "ec2",
        "POST",
        "/",
        Some(&format!("Action=DescribeTags&Version=2016-11-15&Filter.1.Name=resource-id&Filter.1.Value.1={id}")),
    );
    for (k, v) in [
        ("lbscale:node-id", req.node_id.as_str()),
        ("lbscale:group-id", "g-aws"),
    ] {
        assert!(
            tags.contains(&format!("<key>{k}</key>"))
                && tags.contains(&format!("<value>{v}</value>")),
            "tag {k}={v} in {tags}"
        );
    }
    // The user data starts the node with its API's files: the token's hash,
    // not the token (nor the group secret); the group CA's certificate; the
    // node's certificate and key. Its API answers at the private address only.
    let script = moto.user_data(&id);
    let token = auth::node_token(&secret, &req.node_id);
    assert!(
        !script.contains(&secret),
        "the group secret is in the user data"
    );
    for part in [
        &req.credentials.token_file,
        &req.credentials.ca_pem,
        &req.credentials.cert_pem,
        &req.credentials.key_pem,
    ] {
        assert!(script.contains(part.trim_end()), "{script}");
    }
    assert!(script.contains("--api-address \"$ip\""), "{script}");
    assert!(script.contains("meta-data/local-ipv4"), "{script}");
    assert!(script.contains("lbscale-node serve"), "{script}");
    assert!(
        script.contains(&format!("--api-port {NODE_API_PORT}")),
        "{script}"
    );
    assert!(script.contains("sha256:"), "{script}");
    assert!(!script.contains(&token), "the token is in the user data");

    // Provisioning the same node again (a step re-run after a crash) finds
    // the same instance.
    let again = cloud.provision(&req).await.expect("provision again");
    assert_eq!(again.handle["instance_id"], id.as_str());
    let mine = moto.call(
        "ec2",
        "POST",
        "/",
        Some(&format!(
            "Action=DescribeInstances&Version=2016-11-15&Filter.1.Name=tag:lbscale:node-id&Filter.1.Value.1={}",
            req.node_id
        )),
    );
    assert_eq!(
        mine.matches("<instanceId>").count(),
        1,
        "one instance for the node: {mine}"
    );

    let row = NodeRow {
        id: req.node_id.clone(),
        group_id: "g-aws".into(),
        az: "us-east-1b".into(),
        seq: 1,
        state: NodeState::Joining,
        private_ip: p.private_ip.clone(),
        public_ip: p.public_ip.clone(),
        registered: false,
        handle: p.handle.clone(),
        created_at: 0,
    };
    assert!(cloud.is_alive(&row).await.unwrap());
    // All of a group's nodes in one call: one without an instance id (a
    // provisioning cut short) and one EC2 does not know are not alive.
    let unknown = NodeRow {
        handle: serde_json::json!({"instance_id": "i-0123456789abcdef0"}),
        ..row.clone()
    };
    let no_handle_row = NodeRow {
        handle: Value::Null,
        ..row.clone()
    };
    assert_eq!(
        cloud
            .alive(&[row.clone(), unknown.clone(), no_handle_row.clone()])
            .await
            .unwrap(),
        [true, false, false]
    );
    cloud.deprovision(&row).await.expect("deprovision");
    assert_eq!(moto.instance(&id)["state"], "terminated");
    assert!(!cloud.is_alive(&row).await.unwrap());
    assert_eq!(
        cloud.alive(&[row.clone(), unknown]).await.unwrap(),
        [false, false]
    );
    // Idempotent; and a node whose handle was never stored is found by its tag.
    cloud.deprovision(&row).await.expect("deprovision again");
    let lost = ProvisionRequest {
        node_id: unique("lost"),
        ..req.clone()
    };
    let p2 = cloud.provision(&lost).await.expect("provision");
    let id2 = p2.handle["instance_id"].as_str().unwrap().to_string();
    let no_handle = NodeRow {
        id: lost.node_id.clone(),
        handle: Value::Null,
        ..row.clone()
    };
    cloud
        .deprovision(&no_handle)
        .await
        .expect("deprovision by tag");
    assert_eq!(moto.instance(&id2)["state"], "terminated");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_name_the_call_and_the_missing_setting() {
    let Some(moto) = moto("errors_name_the_call_and_the_missing_setting") else {
        return;
    };
    // An AZ the region does not have: the error names the call, AWS's code
    // and message.
    let req = ProvisionRequest {
        node_id: unique("bad"),
        group_id: "g".into(),
        group_name: "g".into(),
        az: "us-east-1z".into(),
        node: NodeSpec {
            memory_limit_mb: 64,
            ..NodeSpec::default()
        },
        credentials: auth::node_credentials("t", "bad").unwrap(),
    };
    let e = AwsCloud::new(node_settings(&moto), DriverStore::new(store("errors")))
        .unwrap()
        .provision(&req)
        .await
        .expect_err("unknown AZ")
        .to_string();
    assert!(
        e.contains("RunInstances")
            && e.contains("InvalidParameterValue")
            && e.contains("us-east-1z"),
        "{e}"
    );
    let req = ProvisionRequest {
        az: "us-east-1a".into(),
        ..req
    };

    // No image at all: named by its setting.
    let mut settings = node_settings(&moto);
    settings.image_id = None;
    let e = AwsCloud::new(settings, DriverStore::new(store("errors2")))
        .unwrap()
        .provision(&req)
        .await
        .expect_err("no image")
        .to_string();
    assert!(
        e.contains("image_id") && e.contains("LBSCALE_AWS_IMAGE_ID"),
        "{e}"
    );

    // The server's certificate is checked: with the system's CAs (which did
    // not sign moto's), the TLS handshake fails and says with whom.
    let mut settings = node_settings(&moto);
    settings.ca_bundle = None;
    let e = AwsCloud::new(settings, DriverStore::new(store("errors3")))
        .unwrap()
        .provision(&req)
        .await
        .expect_err("untrusted certificate")
        .to_string();
    assert!(e.contains("TLS with 127.0.0.1"), "{e}");

    // No region or no credentials: refused when the driver is made, by name.
    let mut settings = node_settings(&moto);
    settings.region = None;
    let e = AwsCloud::new(settings, DriverStore::new(store("errors4")))
        .err()
        .unwrap();
    assert!(e.contains("region") && e.contains("AWS_REGION"), "{e}");
    // No credentials anywhere in the chain (and no instance metadata to ask).
    let mut settings = node_settings(&moto);
    settings.credentials = None;
    settings.env =
        lbscale_cloud_aws::credentials::EnvVars::of(&[("AWS_EC2_METADATA_DISABLED", "true")]);
    let e = AwsCloud::new(settings, DriverStore::new(store("errors5")))
        .err()
        .unwrap();
    assert!(
        e.contains("AWS_ACCESS_KEY_ID") && e.contains("AWS_WEB_IDENTITY_TOKEN_FILE"),
        "{e}"
    );
}

fn dns_spec(domain: &str) -> DistributorSpec {
    DistributorSpec {
        name: format!("d-{domain}"),
        cloud: CloudName::Aws,
        mode: DistributorMode::Dns,
        domain: Some(domain.into()),
        ttl: DeclaredDuration::parse("30s").unwrap(),
    }
}

fn publication(addresses: &[(&str, &str)]) -> Publication {
    let mut p = Publication::default();
    for (az, a) in addresses {
        p.endpoints
            .entry(az.to_string())
            .or_default()
            .push(a.to_string());
    }
    p
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dns_distributor_is_an_a_record_in_its_own_zone() {
    let Some(moto) = moto("a_dns_distributor_is_an_a_record_in_its_own_zone") else {
        return;
    };
    let store = store("dns-own");
    let cloud = AwsCloud::new(node_settings(&moto), DriverStore::new(store.clone())).unwrap();
    let domain = format!("{}.lbscale.test", unique("shop"));
    let spec = dns_spec(&domain);
    let id = unique("td");
    store.insert_distributor(&id, &spec).unwrap();
    cloud.ensure(&id, &spec).await.expect("ensure");
    // No zone held the domain: one was created for it, with name servers.
    let zone = moto
        .zones()
        .into_iter()
        .find(|z| z.1 == format!("{domain}."))
        .expect("a zone for the domain");
    assert_eq!(zone.2, format!("lbscale-{id}"));
    let fqdn = format!("{domain}.");
    let ns = cloud.addresses(&id, &spec)["dns"].clone();
    assert!(ns.contains("awsdns"), "{ns}");

    let two = publication(&[("us-east-1a", "54.1.1.1"), ("us-east-1b", "54.2.2.2")]);
    cloud.publish(&id, &spec, &two).await.expect("publish");
    assert_eq!(
        moto.a_records(&fqdn, &fqdn),
        vec![(
            "30".to_string(),
            vec!["54.1.1.1".to_string(), "54.2.2.2".to_string()]
        )]
    );
    let one = publication(&[("us-east-1b", "54.2.2.2")]);
    cloud.publish(&id, &spec, &one).await.expect("publish");
    assert_eq!(
        moto.a_records(&fqdn, &fqdn),
        vec![("30".to_string(), vec!["54.2.2.2".to_string()])]
    );
    // Nothing to hand out: no record (Route 53 has no empty record set).
    cloud
        .publish(&id, &spec, &Publication::default())
        .await
        .expect("publish none");
    assert!(moto.a_records(&fqdn, &fqdn).is_empty());
    cloud.publish(&id, &spec, &one).await.expect("publish");
    // Removing the distributor removes its record and the zone it created.
    cloud.remove(&id).await.expect("remove");
    assert!(moto.a_records(&fqdn, &fqdn).is_empty());
    assert!(
        !moto.zones().iter().any(|z| z.1 == fqdn),
        "the zone lbscale created is deleted"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dns_distributor_uses_the_zone_that_holds_its_domain_and_leaves_it() {
    let Some(moto) = moto("a_dns_distributor_uses_the_zone_that_holds_its_domain_and_leaves_it")
    else {
        return;
    };
    // The operator's zone, made by curl as any other client would.
    let parent = format!("{}.lbscale.test", unique("corp"));
    moto.call(
        "route53",
        "POST",
        "/2013-04-01/hostedzone",
        Some(&format!(
            r#"<?xml version="1.0" encoding="UTF-8"?><CreateHostedZoneRequest xmlns="https://route53.amazonaws.com/doc/2013-04-01/"><Name>{parent}</Name><CallerReference>{}</CallerReference></CreateHostedZoneRequest>"#,
            unique("operator")
        )),
    );
    let zone = format!("{parent}.");

    let store = store("dns-parent");
    let cloud = AwsCloud::new(node_settings(&moto), DriverStore::new(store.clone())).unwrap();
    let domain = format!("www.{parent}");
    let spec = dns_spec(&domain);
    let id = unique("td");
    store.insert_distributor(&id, &spec).unwrap();

    cloud
        .publish(&id, &spec, &publication(&[("us-east-1a", "54.3.3.3")]))
        .await
        .expect("publish");
    // (Other tests make zones meanwhile: only this domain's is looked for.)
    assert!(
        !moto.zones().iter().any(|z| z.1 == format!("{domain}.")),
        "no zone created for the domain"
    );
    assert_eq!(
        moto.a_records(&zone, &format!("{domain}.")),
        vec![("30".to_string(), vec!["54.3.3.3".to_string()])]
    );
    cloud.remove(&id).await.expect("remove");
    assert!(moto.a_records(&zone, &format!("{domain}.")).is_empty());
    assert!(
        moto.zones().iter().any(|z| z.1 == zone),
        "the operator's zone stays"
    );

    // A record the operator wrote is neither taken over nor deleted.
    let taken = format!("taken.{parent}");
    let zone_id = moto.zones().into_iter().find(|z| z.1 == zone).unwrap().0;
    moto.call(
        "route53",
        "POST",
        &format!("/2013-04-01/hostedzone/{zone_id}/rrset"),
        Some(&format!(
            r#"<?xml version="1.0" encoding="UTF-8"?><ChangeResourceRecordSetsRequest xmlns="https://route53.amazonaws.com/doc/2013-04-01/"><ChangeBatch><Changes><Change><Action>CREATE</Action><ResourceRecordSet><Name>{taken}</Name><Type>A</Type><TTL>300</TTL><ResourceRecords><ResourceRecord><Value>192.0.2.7</Value></ResourceRecord></ResourceRecords></ResourceRecordSet></Change></Changes></ChangeBatch></ChangeResourceRecordSetsRequest>"#
        )),
    );
    let spec = dns_spec(&taken);
    let id = unique("td");
    store.insert_distributor(&id, &spec).unwrap();
    let e = cloud
        .publish(&id, &spec, &publication(&[("us-east-1a", "54.5.5.5")]))
        .await
        .expect_err("the operator's record")
        .to_string();
    assert!(
        e.contains("not this distributor's") && e.contains(&taken),
        "{e}"
    );
    cloud.remove(&id).await.expect("remove");
    assert_eq!(
        moto.a_records(&zone, &format!("{taken}.")),
        vec![("300".to_string(), vec!["192.0.2.7".to_string()])],
        "the operator's record is untouched"
    );
}

/// An ELBv2 query through curl, as any other client would make it.
fn elb(moto: &Moto, params: &str) -> String {
    moto.call(
        "elasticloadbalancing",
        "POST",
        "/",
        Some(&format!("Version=2015-12-01&{params}")),
    )
}

/// The IP targets of the target group named `name` (empty when it does not exist).
fn targets(moto: &Moto, name: &str) -> Vec<String> {
    let groups = elb(
        moto,
        &format!("Action=DescribeTargetGroups&Names.member.1={name}"),
    );
    let Some(arn) = groups
        .split("<TargetGroupArn>")
        .nth(1)
        .and_then(|s| s.split('<').next())
    else {
        return vec![];
    };
    let health = elb(
        moto,
        &format!(
            "Action=DescribeTargetHealth&TargetGroupArn={}",
            lbscale_cloud_aws::sigv4::uri_encode(arn)
        ),
    );
    let mut ids: Vec<String> = health
        .split("<Id>")
        .skip(1)
        .filter_map(|s| s.split('<').next().map(str::to_string))
        .collect();
    ids.sort();
    ids
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_nlb_distributor_is_a_network_load_balancer_with_a_listener_per_port() {
    use lbscale_engine::cloud::{Balance, PortTargets};
    let Some(moto) = moto("an_nlb_distributor_is_a_network_load_balancer_with_a_listener_per_port")
    else {
        return;
    };
    let store = store("nlb");
    let cloud = AwsCloud::new(moto.settings(), DriverStore::new(store.clone())).unwrap();
    let id = format!("td-{:08x}", std::process::id() ^ 0x5a5a_0000);
    let spec = DistributorSpec {
        name: unique("nlb"),
        cloud: CloudName::Aws,
        mode: DistributorMode::Nlb,
        domain: None,
        ttl: DeclaredDuration::parse("60s").unwrap(),
    };
    store.insert_distributor(&id, &spec).unwrap();
    let lb_name = format!("lbscale-{id}");
    cloud.ensure(&id, &spec).await.expect("ensure");
    let described = |moto: &Moto| {
        elb(
            moto,
            &format!("Action=DescribeLoadBalancers&Names.member.1={lb_name}"),
        )
    };
    assert!(
        described(&moto).contains("LoadBalancerNotFound"),
        "no load balancer before a port is published"
    );

    // Two AZs, ports 80 and 443; on 443 of us-east-1a a native primary (First).
    let mut p = Publication::default();
    p.endpoints.insert(
        "us-east-1a".into(),
        vec!["172.31.0.10".into(), "172.31.0.11".into()],
    );
    p.endpoints
        .insert("us-east-1b".into(), vec!["172.31.16.10".into()]);
    for az in ["us-east-1a", "us-east-1b"] {
        p.ports.insert(az.into(), vec![80, 443]);
    }
    p.port_targets
        .entry("us-east-1a".into())
        .or_default()
        .insert(
            443,
            PortTargets {
                addresses: vec!["172.31.0.11".into(), "172.31.0.10".into()],
                balance: Balance::First,
            },
        );
    cloud.publish(&id, &spec, &p).await.expect("publish");
    let lb = described(&moto);
    assert!(lb.contains("<Type>network</Type>"), "{lb}");
    assert!(
        lb.contains("us-east-1a") && lb.contains("us-east-1b"),
        "{lb}"
    );
    let arn = lb
        .split("<LoadBalancerArn>")
        .nth(1)
        .and_then(|s| s.split('<').next())
        .unwrap()
        .to_string();
    let listeners = elb(
        &moto,
        &format!(
            "Action=DescribeListeners&LoadBalancerArn={}",
            lbscale_cloud_aws::sigv4::uri_encode(&arn)
        ),
    );
    assert!(
        listeners.contains("<Port>80</Port>") && listeners.contains("<Port>443</Port>"),
        "{listeners}"
    );
    assert_eq!(
        targets(&moto, &format!("{lb_name}-80")),
        ["172.31.0.10", "172.31.0.11", "172.31.16.10"]
    );
    // The primary only where the vserver has one; every node elsewhere.
    assert_eq!(
        targets(&moto, &format!("{lb_name}-443")),
        ["172.31.0.11", "172.31.16.10"]
    );
    let addresses = cloud.addresses(&id, &spec);
    assert_eq!(
        addresses.keys().collect::<Vec<_>>(),
        ["us-east-1a", "us-east-1b"]
    );
    assert!(
        addresses["us-east-1a"].starts_with("us-east-1a.lbscale-")
            && addresses["us-east-1a"].contains("elb.amazonaws.com"),
        "the zonal name of the load balancer: {addresses:?}"
    );

    // Port 443 goes and a node leaves: its listener and target group go, and
    // the node is deregistered.
    p.ports.insert("us-east-1a".into(), vec![80]);
    p.ports.insert("us-east-1b".into(), vec![80]);
    p.port_targets.clear();
    p.endpoints
        .insert("us-east-1a".into(), vec!["172.31.0.10".into()]);
    cloud.publish(&id, &spec, &p).await.expect("publish");
    assert_eq!(
        targets(&moto, &format!("{lb_name}-80")),
        ["172.31.0.10", "172.31.16.10"]
    );
    assert!(targets(&moto, &format!("{lb_name}-443")).is_empty());
    let listeners = elb(
        &moto,
        &format!(
            "Action=DescribeListeners&LoadBalancerArn={}",
            lbscale_cloud_aws::sigv4::uri_encode(&arn)
        ),
    );
    assert!(!listeners.contains("<Port>443</Port>"), "{listeners}");

    cloud.remove(&id).await.expect("remove");
    assert!(described(&moto).contains("LoadBalancerNotFound"));
    assert!(elb(
        &moto,
        &format!("Action=DescribeTargetGroups&Names.member.1={lb_name}-80")
    )
    .contains("TargetGroupNotFound"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dns_distributor_skips_private_zones_and_follows_a_new_domain() {
    let Some(moto) = moto("a_dns_distributor_skips_private_zones_and_follows_a_new_domain") else {
        return;
    };
    // The operator's public zone, and a private zone (seen only from a VPC)
    // named exactly as the domain: the record must go to the public one.
    let parent = format!("{}.lbscale.test", unique("split"));
    let domain = format!("www.{parent}");
    let vpcs = moto.call(
        "ec2",
        "POST",
        "/",
        Some("Action=DescribeVpcs&Version=2016-11-15"),
    );
    let vpc = vpcs
        .split("<vpcId>")
        .nth(1)
        .and_then(|s| s.split('<').next())
        .expect("a VPC in moto")
        .to_string();
    for (name, private) in [(&parent, false), (&domain, true)] {
        let vpc_part = if private {
            format!("<VPC><VPCRegion>us-east-1</VPCRegion><VPCId>{vpc}</VPCId></VPC><HostedZoneConfig><PrivateZone>true</PrivateZone></HostedZoneConfig>")
        } else {
            String::new()
        };
        moto.call(
            "route53",
            "POST",
            "/2013-04-01/hostedzone",
            Some(&format!(
                r#"<?xml version="1.0" encoding="UTF-8"?><CreateHostedZoneRequest xmlns="https://route53.amazonaws.com/doc/2013-04-01/"><Name>{name}</Name><CallerReference>{}</CallerReference>{vpc_part}</CreateHostedZoneRequest>"#,
                unique("operator")
            )),
        );
    }
    let store = store("dns-split");
    let cloud = AwsCloud::new(moto.settings(), DriverStore::new(store.clone())).unwrap();
    let mut spec = dns_spec(&domain);
    let id = unique("td");
    store.insert_distributor(&id, &spec).unwrap();
    let one = publication(&[("us-east-1a", "54.4.4.4")]);
    cloud.publish(&id, &spec, &one).await.expect("publish");
    let (public, private) = (format!("{parent}."), format!("{domain}."));
    assert_eq!(
        moto.a_records(&public, &private),
        vec![("30".to_string(), vec!["54.4.4.4".to_string()])],
        "the record is in the public zone"
    );
    assert!(
        moto.a_records(&private, &private).is_empty(),
        "not in the private zone"
    );

    // A new domain (changed in place): the old record goes, and a zone is
    // chosen (here made) for the new one.
    let other = format!("{}.lbscale.test", unique("moved"));
    spec.domain = Some(other.clone());
    cloud
        .publish(&id, &spec, &one)
        .await
        .expect("publish the new domain");
    assert!(
        moto.a_records(&public, &private).is_empty(),
        "the old record is gone"
    );
    let fqdn = format!("{other}.");
    assert_eq!(
        moto.a_records(&fqdn, &fqdn),
        vec![("30".to_string(), vec!["54.4.4.4".to_string()])]
    );
    cloud.remove(&id).await.expect("remove");
    assert!(
        !moto.zones().iter().any(|z| z.1 == fqdn),
        "its own zone is deleted"
    );
    assert!(
        moto.zones().iter().any(|z| z.1 == public),
        "the operator's zone stays"
    );
}
