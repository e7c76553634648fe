//! The aws driver's placement against moto, below the engine: the security
//! group it makes for a group (made once, its rules brought back to the
//! vservers' ports, deleted with the group), and an `nlb` whose groups give
//! subnets that cannot be one load balancer's.

use lbscale_cloud_aws::moto_testing::{moto, unique, Moto};
use lbscale_cloud_aws::AwsCloud;
use lbscale_engine::cloud::{
    Cloud, Distributor, DriverStore, GroupResources, Listener, Publication, Transport,
};
use lbscale_engine::model::{
    CloudName, DeclaredDuration, DistributorMode, DistributorSpec, NodeSpec,
};
use lbscale_engine::store::Store;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

fn store(name: &str) -> Arc<Store> {
    let dir = std::env::temp_dir().join(format!("lbscale-awsplace-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    Arc::new(Store::open(&dir.join("state.db")).unwrap())
}

fn cloud(moto: &Moto, name: &str) -> AwsCloud {
    let mut settings = moto.settings();
    settings.image_id = Some("ami-12c6146b".into());
    AwsCloud::new(settings, DriverStore::new(store(name))).expect("driver")
}

fn ec2(moto: &Moto, query: &str) -> String {
    moto.call(
        "ec2",
        "POST",
        "/",
        Some(&format!("Version=2016-11-15&{query}")),
    )
}

fn between<'a>(xml: &'a str, tag: &str) -> Vec<&'a str> {
    xml.split(&format!("<{tag}>"))
        .skip(1)
        .filter_map(|s| s.split('<').next())
        .collect()
}

/// The ids of the security groups tagged for `group_id`, and their ports.
fn made(moto: &Moto, group_id: &str) -> (Vec<String>, BTreeSet<String>) {
    let xml = ec2(
        moto,
        &format!("Action=DescribeSecurityGroups&Filter.1.Name=tag:lbscale:group-id&Filter.1.Value.1={group_id}"),
    );
    let ids = between(&xml, "groupId")
        .into_iter()
        .map(String::from)
        .collect();
    // Ingress only (moto lists the egress rules first or last).
    let ingress: String = xml
        .split("<ipPermissions>")
        .skip(1)
        .filter_map(|s| s.split("</ipPermissions>").next())
        .collect();
    let ports = between(&ingress, "ipProtocol")
        .into_iter()
        .zip(between(&ingress, "fromPort"))
        .map(|(p, f)| format!("{p}:{f}"))
        .collect();
    (ids, ports)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_made_security_group_follows_the_listeners_and_goes_with_the_group() {
    let Some(moto) = moto("the_made_security_group_follows_the_listeners_and_goes_with_the_group")
    else {
        return;
    };
    let cloud = cloud(&moto, "sg");
    let group_id = unique("asg");
    let mut group = GroupResources {
        group_id: group_id.clone(),
        group_name: "web".into(),
        availability_zones: vec!["us-east-1a".into()],
        node: NodeSpec::default(),
        listeners: vec![
            Listener {
                port: 80,
                protocol: Transport::Tcp,
            },
            Listener {
                port: 53,
                protocol: Transport::Udp,
            },
        ],
    };
    cloud.prepare_group(&group).await.expect("prepare");
    cloud.prepare_group(&group).await.expect("prepare again");
    let (ids, ports) = made(&moto, &group_id);
    assert_eq!(ids.len(), 1, "made once: {ids:?}");
    assert_eq!(
        ports,
        BTreeSet::from(["tcp:80".to_string(), "udp:53".into(), "tcp:9990".into()])
    );
    group.listeners = vec![Listener {
        port: 8443,
        protocol: Transport::Tcp,
    }];
    cloud
        .prepare_group(&group)
        .await
        .expect("prepare after a change");
    let (again, ports) = made(&moto, &group_id);
    assert_eq!(again, ids);
    assert_eq!(
        ports,
        BTreeSet::from(["tcp:8443".to_string(), "tcp:9990".into()])
    );
    // Security groups given now: the made one goes (nothing uses it).
    let given = between(
        &ec2(
            &moto,
            &format!(
                "Action=CreateSecurityGroup&GroupName={}&GroupDescription=t",
                unique("given")
            ),
        ),
        "groupId",
    )[0]
    .to_string();
    group.node.security_groups = vec![given];
    cloud
        .prepare_group(&group)
        .await
        .expect("prepare with groups given");
    assert!(made(&moto, &group_id).0.is_empty());
    // None given again: made again; the group's destroy deletes it.
    group.node.security_groups.clear();
    cloud.prepare_group(&group).await.expect("prepare");
    assert_eq!(made(&moto, &group_id).0.len(), 1);
    cloud.release_group(&group_id).await.expect("release");
    assert!(made(&moto, &group_id).0.is_empty());
    cloud.release_group(&group_id).await.expect("release again");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_nlb_refuses_subnets_that_cannot_be_one_load_balancers() {
    let Some(moto) = moto("an_nlb_refuses_subnets_that_cannot_be_one_load_balancers") else {
        return;
    };
    let cloud = cloud(&moto, "nlb");
    let spec = DistributorSpec {
        name: "n".into(),
        cloud: CloudName::Aws,
        mode: DistributorMode::Nlb,
        domain: None,
        ttl: DeclaredDuration::parse("30s").unwrap(),
    };
    let vpc = |cidr: &str| {
        between(
            &ec2(&moto, &format!("Action=CreateVpc&CidrBlock={cidr}")),
            "vpcId",
        )[0]
        .to_string()
    };
    let subnet = |vpc: &str, cidr: &str, az: &str| {
        between(
            &ec2(
                &moto,
                &format!("Action=CreateSubnet&VpcId={vpc}&CidrBlock={cidr}&AvailabilityZone={az}"),
            ),
            "subnetId",
        )[0]
        .to_string()
    };
    let (v1, v2) = (vpc("10.71.0.0/16"), vpc("10.72.0.0/16"));
    let a1 = subnet(&v1, "10.71.1.0/24", "us-east-1a");
    let a2 = subnet(&v1, "10.71.2.0/24", "us-east-1a");
    let b2 = subnet(&v2, "10.72.1.0/24", "us-east-1b");
    let publication = |subnets: &[(&str, &str)]| {
        let mut p = Publication::default();
        for (az, s) in subnets {
            p.ports.insert(az.to_string(), vec![80]);
            p.subnets
                .entry(az.to_string())
                .or_insert_with(BTreeSet::new)
                .insert(s.to_string());
        }
        p
    };
    let id = unique("td");
    let e = cloud
        .publish(
            &id,
            &spec,
            &publication(&[("us-east-1a", &a1), ("us-east-1a", &a2)]),
        )
        .await
        .expect_err("two subnets in one AZ")
        .to_string();
    assert!(
        e.contains("different subnets in us-east-1a") && e.contains(&a1) && e.contains(&a2),
        "{e}"
    );
    let e = cloud
        .publish(
            &id,
            &spec,
            &publication(&[("us-east-1a", &a1), ("us-east-1b", &b2)]),
        )
        .await
        .expect_err("two VPCs")
        .to_string();
    assert!(
        e.contains("more than one VPC") && e.contains(&v1) && e.contains(&v2),
        "{e}"
    );
    let e = cloud
        .publish(&id, &spec, &publication(&[("us-east-1b", &a1)]))
        .await
        .expect_err("a subnet of another AZ")
        .to_string();
    assert!(
        e.contains(&format!(
            "subnet {a1}, given for us-east-1b in node.subnets, is in us-east-1a"
        )),
        "{e}"
    );
    // Nothing was made.
    let _: BTreeMap<String, String> = cloud.addresses(&id, &spec);
    assert!(cloud.addresses(&id, &spec).is_empty());
}
