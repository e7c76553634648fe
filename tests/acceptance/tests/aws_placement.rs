//! A group's `node` block on aws under the real Terraform CLI, against moto:
//! nodes in the subnet given for their AZ, with the security groups given or
//! the one lbscale makes (its rules follow the vservers; it goes with the
//! group), the instance profile and the tags; an `nlb` distributor in the
//! group's subnets.
//!
//! moto runs no instance, so the test stands in for each one as its boot
//! would: it runs the instance's user data, with `lbscale-node` from this
//! build, at the instance's private address. The test VPC is a loopback range
//! (`127.<n>.0.0/16`, which moto takes), so that address is on this machine
//! and the engine reaches the node's API there, as it would in the VPC.

use lbscale_acceptance::*;
use lbscale_cloud_aws::moto_testing::{moto, unique, Moto};
use lbscale_cloud_aws::xml::{Document, Node};
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

const SECRET: &str = "placement-secret-key-value";

fn aws_block(moto: &Moto) -> String {
    format!(
        r#"  aws {{
    region      = "us-east-1"
    endpoint    = "{}"
    credentials = "AKIDPLACEMENT:{SECRET}"
    ca_bundle   = "{}"
    image_id    = "ami-12c6146b"
  }}
"#,
        moto.endpoint,
        moto.ca.display()
    )
}

/// One EC2 query to moto; the answer's XML.
fn ec2(moto: &Moto, query: &str) -> String {
    moto.call(
        "ec2",
        "POST",
        "/",
        Some(&format!("Version=2016-11-15&{query}")),
    )
}

/// The text of the first `<tag>` in `xml`.
fn first(xml: &str, tag: &str) -> String {
    let doc = roxml(xml);
    doc.descendants()
        .find(|n| n.has_tag_name(tag))
        .and_then(|n| n.text())
        .unwrap_or_else(|| panic!("no <{tag}> in {xml}"))
        .to_string()
}

fn roxml(xml: &str) -> Document<'_> {
    Document::parse(xml).unwrap_or_else(|e| panic!("{e}: {xml}"))
}

/// A VPC on `127.<octet>.0.0/16` with a subnet in each of `azs`
/// (`127.<octet>.<i+1>.0/24`): (VPC id, AZ -> subnet id).
fn loopback_vpc(moto: &Moto, octet: u8, azs: &[&str]) -> (String, BTreeMap<String, String>) {
    let vpc = first(
        &ec2(
            moto,
            &format!("Action=CreateVpc&CidrBlock=127.{octet}.0.0/16"),
        ),
        "vpcId",
    );
    let subnets = azs
        .iter()
        .enumerate()
        .map(|(i, az)| {
            let answer = ec2(
                moto,
                &format!(
                    "Action=CreateSubnet&VpcId={vpc}&CidrBlock=127.{octet}.{}.0/24&AvailabilityZone={az}",
                    i + 1
                ),
            );
            (az.to_string(), first(&answer, "subnetId"))
        })
        .collect();
    (vpc, subnets)
}

/// An IAM instance profile: its ARN.
fn instance_profile(moto: &Moto, name: &str) -> String {
    let answer = moto.call(
        "iam",
        "POST",
        "/",
        Some(&format!(
            "Action=CreateInstanceProfile&Version=2010-05-08&InstanceProfileName={name}"
        )),
    );
    first(&answer, "Arn")
}

/// An instance as DescribeInstances shows it.
#[derive(Debug, Clone)]
struct Instance {
    id: String,
    state: String,
    az: String,
    private_ip: String,
    subnet: String,
    instance_type: String,
    security_groups: BTreeSet<String>,
    profile: Option<String>,
    tags: BTreeMap<String, String>,
}

/// The instances tagged with group name `group` (`lbscale:group`).
fn instances(moto: &Moto, group: &str) -> Vec<Instance> {
    let xml = ec2(
        moto,
        &format!(
            "Action=DescribeInstances&Filter.1.Name=tag:lbscale:group&Filter.1.Value.1={group}"
        ),
    );
    let doc = roxml(&xml);
    let child = |n: Node, name: &str| {
        n.children()
            .find(|c| c.has_tag_name(name))
            .and_then(|c| c.text())
            .unwrap_or("")
            .to_string()
    };
    doc.descendants()
        .filter(|n| n.has_tag_name("instancesSet"))
        .flat_map(|s| s.children().filter(|c| c.is_element()))
        .map(|i| {
            let sub = |name: &str| i.children().find(|c| c.has_tag_name(name));
            Instance {
                id: child(i, "instanceId"),
                state: sub("instanceState")
                    .map(|s| child(s, "name"))
                    .unwrap_or_default(),
                az: sub("placement")
                    .map(|p| child(p, "availabilityZone"))
                    .unwrap_or_default(),
                private_ip: child(i, "privateIpAddress"),
                subnet: child(i, "subnetId"),
                instance_type: child(i, "instanceType"),
                security_groups: sub("groupSet")
                    .map(|g| {
                        g.children()
                            .filter(|c| c.is_element())
                            .map(|c| child(c, "groupId"))
                            .collect()
                    })
                    .unwrap_or_default(),
                profile: sub("iamInstanceProfile").map(|p| child(p, "arn")),
                tags: sub("tagSet")
                    .map(|t| {
                        t.children()
                            .filter(|c| c.is_element())
                            .map(|c| (child(c, "key"), child(c, "value")))
                            .collect()
                    })
                    .unwrap_or_default(),
            }
        })
        .collect()
}

/// The security groups tagged as lbscale's for `group_id`: id -> ingress
/// rules as `proto:from-to:cidr`.
fn made_groups(moto: &Moto, group_id: &str) -> BTreeMap<String, BTreeSet<String>> {
    let xml = ec2(
        moto,
        &format!("Action=DescribeSecurityGroups&Filter.1.Name=tag:lbscale:group-id&Filter.1.Value.1={group_id}"),
    );
    let doc = roxml(&xml);
    let child = |n: Node, name: &str| {
        n.children()
            .find(|c| c.has_tag_name(name))
            .and_then(|c| c.text())
            .unwrap_or("")
            .to_string()
    };
    doc.descendants()
        .filter(|n| n.has_tag_name("securityGroupInfo"))
        .flat_map(|s| s.children().filter(|c| c.is_element()))
        .map(|sg| {
            let mut rules = BTreeSet::new();
            if let Some(perms) = sg.children().find(|c| c.has_tag_name("ipPermissions")) {
                for p in perms.children().filter(|c| c.is_element()) {
                    let head = format!(
                        "{}:{}-{}",
                        child(p, "ipProtocol"),
                        child(p, "fromPort"),
                        child(p, "toPort")
                    );
                    for r in p
                        .descendants()
                        .filter(|r| r.has_tag_name("cidrIp") || r.has_tag_name("cidrIpv6"))
                    {
                        rules.insert(format!("{head}:{}", r.text().unwrap_or("")));
                    }
                }
            }
            (child(sg, "groupId"), rules)
        })
        .collect()
}

/// Stands in for the instances of group `group` that moto starts: each one
/// that runs gets its user data run as its boot would (in a directory of its
/// own instead of /etc/lbscale, at its private address instead of every
/// address, the instance metadata's answers given by a `curl` on the PATH),
/// and is stopped when moto says it is terminated.
struct StandIns {
    stop: Arc<AtomicBool>,
    /// Instance id -> the process its user data execs (None once stopped).
    booted: Arc<Mutex<BTreeMap<String, Option<std::process::Child>>>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl StandIns {
    fn start(moto: &Moto, group: &str, dir: &Path) -> StandIns {
        let stop = Arc::new(AtomicBool::new(false));
        let booted = Arc::new(Mutex::new(BTreeMap::new()));
        let moto = Moto {
            endpoint: moto.endpoint.clone(),
            ca: moto.ca.clone(),
        };
        let (group, dir) = (group.to_string(), dir.join("instances"));
        let thread = {
            let (stop, booted) = (stop.clone(), booted.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::SeqCst) {
                    for i in instances(&moto, &group) {
                        let mut b = booted.lock().unwrap();
                        match (i.state.as_str(), b.get_mut(&i.id)) {
                            ("running" | "pending", None) if !i.private_ip.is_empty() => {
                                let child = boot(&moto, &i, &dir.join(&i.id));
                                b.insert(i.id.clone(), Some(child));
                            }
                            ("shutting-down" | "terminated" | "stopped", Some(child)) => {
                                stop_node(child.take());
                            }
                            _ => {}
                        }
                    }
                    std::thread::sleep(Duration::from_millis(200));
                }
            })
        };
        StandIns {
            stop,
            booted,
            thread: Some(thread),
        }
    }

    fn booted(&self) -> usize {
        self.booted.lock().unwrap().len()
    }
}

impl Drop for StandIns {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        for child in self.booted.lock().unwrap().values_mut() {
            stop_node(child.take());
        }
    }
}

/// Kills a stand-in's node and reaps it.
fn stop_node(child: Option<std::process::Child>) {
    if let Some(mut c) = child {
        let _ = c.kill();
        let _ = c.wait();
    }
}

/// Runs instance `i`'s user data in `dir`; the process (it execs the node).
fn boot(moto: &Moto, i: &Instance, dir: &Path) -> std::process::Child {
    std::fs::create_dir_all(dir.join("bin")).unwrap();
    let script = moto
        .user_data(&i.id)
        .replace("/etc/lbscale", &dir.display().to_string())
        .replace(
            "--listen-ip 0.0.0.0",
            &format!("--listen-ip {}", i.private_ip),
        );
    std::fs::write(dir.join("boot.sh"), script).unwrap();
    // The instance metadata service: a token, then the private address.
    let curl = format!(
        "#!/bin/sh\ncase \"$*\" in\n  *api/token*) printf token ;;\n  *local-ipv4*) printf '%s' '{}' ;;\n  *) exit 22 ;;\nesac\n",
        i.private_ip
    );
    let fake = dir.join("bin/curl");
    std::fs::write(&fake, curl).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755)).unwrap();
    let path = format!(
        "{}:{}:{}",
        dir.join("bin").display(),
        bin_dir().display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let log = std::fs::File::create(dir.join("node.log")).unwrap();
    std::process::Command::new("sh")
        .arg(dir.join("boot.sh"))
        .env("PATH", path)
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .expect("run the user data")
}

fn node_log(dir: &Path) -> String {
    let mut out = String::new();
    for e in std::fs::read_dir(dir.join("instances"))
        .into_iter()
        .flatten()
        .flatten()
    {
        let log = std::fs::read_to_string(e.path().join("node.log")).unwrap_or_default();
        out.push_str(&format!("--- {}\n{log}\n", e.path().display()));
    }
    out
}

/// The load balancer named `name`: its subnets (AZ -> subnet) and VPC.
fn load_balancer(moto: &Moto, name: &str) -> Option<(BTreeMap<String, String>, String)> {
    let xml = moto.call(
        "elasticloadbalancing",
        "POST",
        "/",
        Some(&format!(
            "Action=DescribeLoadBalancers&Version=2015-12-01&Names.member.1={name}"
        )),
    );
    if xml.contains("LoadBalancerNotFound") {
        return None;
    }
    let doc = roxml(&xml);
    let lb = doc
        .descendants()
        .find(|n| n.has_tag_name("LoadBalancers"))?;
    let lb = lb.children().find(|c| c.is_element())?;
    let text = |n: Node, t: &str| {
        n.children()
            .find(|c| c.has_tag_name(t))
            .and_then(|c| c.text())
            .unwrap_or("")
            .to_string()
    };
    let zones = lb
        .children()
        .find(|c| c.has_tag_name("AvailabilityZones"))?
        .children()
        .filter(|c| c.is_element())
        .map(|z| (text(z, "ZoneName"), text(z, "SubnetId")))
        .collect();
    Some((zones, text(lb, "VpcId")))
}

/// `address:port` of every target registered in the load balancer's target
/// groups.
fn nlb_targets(moto: &Moto, name: &str) -> BTreeSet<String> {
    let elb = |body: String| moto.call("elasticloadbalancing", "POST", "/", Some(&body));
    let xml = elb(format!(
        "Action=DescribeLoadBalancers&Version=2015-12-01&Names.member.1={name}"
    ));
    let arn = first(&xml, "LoadBalancerArn");
    let xml = elb(format!(
        "Action=DescribeTargetGroups&Version=2015-12-01&LoadBalancerArn={}",
        urlencode(&arn)
    ));
    let groups: Vec<String> = roxml(&xml)
        .descendants()
        .filter(|n| n.has_tag_name("TargetGroupArn"))
        .filter_map(|n| n.text().map(str::to_string))
        .collect();
    let mut out = BTreeSet::new();
    for tg in groups {
        let xml = elb(format!(
            "Action=DescribeTargetHealth&Version=2015-12-01&TargetGroupArn={}",
            urlencode(&tg)
        ));
        let doc = roxml(&xml);
        for t in doc.descendants().filter(|n| n.has_tag_name("Target")) {
            let field = |tag: &str| {
                t.children()
                    .find(|c| c.has_tag_name(tag))
                    .and_then(|c| c.text())
                    .unwrap_or("")
                    .to_string()
            };
            out.insert(format!("{}:{}", field("Id"), field("Port")));
        }
    }
    out
}

fn urlencode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

fn stack(
    group: &str,
    mode: &str,
    node: &str,
    vservers: &[(&str, &str, u16)],
    backend: u16,
) -> String {
    let distributor = if mode == "nlb" {
        format!("  name  = \"{group}-d\"\n  cloud = \"aws\"\n  mode  = \"nlb\"\n")
    } else {
        format!("  name   = \"{group}-d\"\n  cloud  = \"aws\"\n  mode   = \"dns\"\n  domain = \"{group}.lbscale.test\"\n  ttl    = \"1s\"\n")
    };
    let mut out = format!(
        r#"
resource "lbscale_traffic_distributor" "d" {{
{distributor}}}

resource "lbscale_autoscale_group" "g" {{
  name                   = "{group}"
  cloud                  = "aws"
  availability_zones     = ["us-east-1a", "us-east-1b"]
  traffic_distributor_id = lbscale_traffic_distributor.d.id
  min_nodes              = 1
  max_nodes              = 2
  apply_timeout          = "90s"
  drain_timeout          = "1s"
  threshold {{
    metric = "cpu"
    min    = 10
    max    = 70
  }}
  node {{
{node}  }}
}}

resource "lbscale_se_group" "s" {{
  name               = "{group}-se"
  autoscale_group_id = lbscale_autoscale_group.g.id
}}
"#
    );
    for (name, service_type, port) in vservers {
        out.push_str(&format!(
            r#"
resource "lbscale_vserver" "{name}" {{
  name         = "{group}-{name}"
  se_group_id  = lbscale_se_group.s.id
  service_type = "{service_type}"
  port         = {port}
  service {{
    name    = "b"
    address = "127.0.0.1"
    port    = {backend}
  }}
}}
"#
        ));
    }
    out
}

/// A group with subnets in two AZs, an instance profile, tags and the
/// security group that lbscale makes, behind an `nlb`: each node sits in its
/// AZ's subnet with the made group, the profile and the tags (its volumes
/// tagged too); the made group opens the vservers' ports and the node API
/// port to the VPC only, follows a vserver's change, and goes with the group;
/// the load balancer is in the group's subnets.
#[test]
fn an_aws_group_is_placed_as_its_node_block_says_behind_an_nlb() {
    let Some(moto) = moto("an_aws_group_is_placed_as_its_node_block_says_behind_an_nlb") else {
        return;
    };
    let mut ws = Workspace::new("aws-placement-nlb", 132);
    ws.provider_blocks = aws_block(&moto);
    let (vpc, subnets) = loopback_vpc(&moto, 132, &["us-east-1a", "us-east-1b"]);
    let profile_name = unique("lbscale-node");
    let profile = instance_profile(&moto, &profile_name);
    let group = unique("place");
    let _instances = StandIns::start(&moto, &group, &ws.dir);
    let backend = tcp_backend("placed");
    let node = format!(
        "    size     = \"t3.small\"\n    subnets  = {{ \"us-east-1a\" = \"{}\", \"us-east-1b\" = \"{}\" }}\n    identity = \"{profile_name}\"\n    tags     = {{ team = \"web\", \"cost-center\" = \"42\" }}\n",
        subnets["us-east-1a"], subnets["us-east-1b"]
    );
    let vservers = [("tcp", "TCP", 28_080), ("web", "HTTP", 28_081)];
    ws.write(&stack(&group, "nlb", &node, &vservers, backend));
    let o = ws.tf(&["apply", "-auto-approve", "-no-color", "-input=false"]);
    assert_eq!(o.code, 0, "apply:\n{}\n{}", o.all(), node_log(&ws.dir));
    ws.assert_plan_empty("placing an aws group");

    let group_id = ws
        .engine()
        .group_named(&group)
        .unwrap()
        .expect("the group")
        .id;
    let made = made_groups(&moto, &group_id);
    assert_eq!(
        made.len(),
        1,
        "one security group made for the group: {made:?}"
    );
    let (sg, rules) = made.iter().next().unwrap();
    let want = |r: &[&str]| r.iter().map(|s| s.to_string()).collect::<BTreeSet<_>>();
    assert_eq!(
        *rules,
        want(&[
            "tcp:28080-28080:0.0.0.0/0",
            "tcp:28081-28081:0.0.0.0/0",
            "tcp:9990-9990:127.132.0.0/16",
        ]),
        "the vservers' ports from anywhere, the node API from the VPC only"
    );
    let running: Vec<Instance> = instances(&moto, &group)
        .into_iter()
        .filter(|i| i.state == "running")
        .collect();
    assert_eq!(running.len(), 2, "{running:#?}");
    for i in &running {
        assert_eq!(i.subnet, subnets[&i.az], "{i:#?}");
        assert_eq!(i.security_groups, BTreeSet::from([sg.clone()]), "{i:#?}");
        assert_eq!(i.profile.as_deref(), Some(profile.as_str()), "{i:#?}");
        assert_eq!(i.instance_type, "t3.small");
        assert_eq!(
            i.tags.get("team").map(String::as_str),
            Some("web"),
            "{i:#?}"
        );
        assert_eq!(i.tags.get("cost-center").map(String::as_str), Some("42"));
        assert_eq!(i.tags.get("lbscale:group-id"), Some(&group_id));
        // The volumes carry the tags too.
        let volumes = ec2(
            &moto,
            &format!(
                "Action=DescribeVolumes&Filter.1.Name=attachment.instance-id&Filter.1.Value.1={}",
                i.id
            ),
        );
        assert!(
            volumes.contains("<key>team</key>") && volumes.contains("<value>web</value>"),
            "the volume of {} is not tagged: {volumes}",
            i.id
        );
    }
    // The nlb is in the group's subnets, in its VPC.
    let lb_name: String = format!(
        "lbscale-{}",
        ws.resource("lbscale_traffic_distributor.d")["id"]
            .as_str()
            .unwrap()
    )
    .chars()
    .take(32)
    .collect();
    let (lb_subnets, lb_vpc) = load_balancer(&moto, &lb_name).expect("the load balancer");
    assert_eq!(lb_subnets, subnets);
    assert_eq!(lb_vpc, vpc);
    // Its targets are the serving nodes (by address), on each vserver's port.
    let serving: BTreeSet<String> = instances(&moto, &group)
        .into_iter()
        .filter(|i| i.state == "running")
        .flat_map(|i| {
            vservers
                .iter()
                .map(move |(_, _, port)| format!("{}:{port}", i.private_ip))
        })
        .collect();
    assert_eq!(nlb_targets(&moto, &lb_name), serving, "the nlb's targets");

    // A vserver's port changes: the made group's rules follow at the apply.
    let vservers = [("tcp", "TCP", 28_090), ("web", "HTTP", 28_081)];
    ws.write(&stack(&group, "nlb", &node, &vservers, backend));
    let o = ws.tf(&["apply", "-auto-approve", "-no-color", "-input=false"]);
    assert_eq!(o.code, 0, "apply:\n{}\n{}", o.all(), node_log(&ws.dir));
    assert_eq!(
        made_groups(&moto, &group_id)[sg],
        want(&[
            "tcp:28090-28090:0.0.0.0/0",
            "tcp:28081-28081:0.0.0.0/0",
            "tcp:9990-9990:127.132.0.0/16",
        ])
    );

    ws.destroy();
    assert!(
        instances(&moto, &group)
            .iter()
            .all(|i| i.state == "terminated"),
        "an instance outlived its group"
    );
    assert!(
        made_groups(&moto, &group_id).is_empty(),
        "the made security group outlived its group"
    );
    assert!(
        load_balancer(&moto, &lb_name).is_none(),
        "the load balancer outlived its distributor"
    );
    let state = std::fs::read_to_string(ws.dir.join("terraform.tfstate")).unwrap();
    assert!(!state.contains(SECRET));
}

/// Security groups given: the nodes have those and lbscale makes none. Then
/// the block gives none but `management_cidrs`: the group gets the one that
/// lbscale makes, with a UDP vserver's port as UDP and the node API port open
/// to the CIDRs given only, and new nodes use it.
#[test]
fn given_security_groups_are_used_and_a_made_one_follows_the_block() {
    let Some(moto) = moto("given_security_groups_are_used_and_a_made_one_follows_the_block") else {
        return;
    };
    let mut ws = Workspace::new("aws-placement-sg", 133);
    ws.provider_blocks = aws_block(&moto);
    let (vpc, subnets) = loopback_vpc(&moto, 133, &["us-east-1a", "us-east-1b"]);
    let given: Vec<String> = ["a", "b"]
        .iter()
        .map(|n| {
            first(
                &ec2(
                    &moto,
                    &format!(
                        "Action=CreateSecurityGroup&GroupName={}&GroupDescription=test&VpcId={vpc}",
                        unique(n)
                    ),
                ),
                "groupId",
            )
        })
        .collect();
    let group = unique("sgs");
    let _instances = StandIns::start(&moto, &group, &ws.dir);
    let backend = tcp_backend("given");
    let subnets_hcl = format!(
        "    subnets = {{ \"us-east-1a\" = \"{}\", \"us-east-1b\" = \"{}\" }}\n",
        subnets["us-east-1a"], subnets["us-east-1b"]
    );
    let node = format!(
        "{subnets_hcl}    security_groups = [\"{}\", \"{}\"]\n",
        given[0], given[1]
    );
    let vservers = [("tcp", "TCP", 28_180), ("dns", "UDP", 28_153)];
    ws.write(&stack(&group, "dns", &node, &vservers, backend));
    let o = ws.tf(&["apply", "-auto-approve", "-no-color", "-input=false"]);
    assert_eq!(o.code, 0, "apply:\n{}\n{}", o.all(), node_log(&ws.dir));
    let group_id = ws
        .engine()
        .group_named(&group)
        .unwrap()
        .expect("the group")
        .id;
    let running: Vec<Instance> = instances(&moto, &group)
        .into_iter()
        .filter(|i| i.state == "running")
        .collect();
    assert_eq!(running.len(), 2);
    for i in &running {
        assert_eq!(i.security_groups, given.iter().cloned().collect(), "{i:#?}");
        assert_eq!(i.subnet, subnets[&i.az]);
        assert_eq!(i.profile, None);
    }
    assert!(
        made_groups(&moto, &group_id).is_empty(),
        "lbscale made a group although some were given"
    );

    // No groups given now, the node API open to two networks.
    let node =
        format!("{subnets_hcl}    management_cidrs = [\"127.133.0.0/24\", \"192.0.2.0/24\"]\n");
    ws.write(&stack(&group, "dns", &node, &vservers, backend));
    let o = ws.tf(&["apply", "-auto-approve", "-no-color", "-input=false"]);
    assert_eq!(o.code, 0, "apply:\n{}\n{}", o.all(), node_log(&ws.dir));
    ws.assert_plan_empty("making the group's security group");
    let made = made_groups(&moto, &group_id);
    assert_eq!(made.len(), 1, "{made:?}");
    let (sg, rules) = made.iter().next().unwrap();
    let want: BTreeSet<String> = [
        "tcp:28180-28180:0.0.0.0/0",
        "udp:28153-28153:0.0.0.0/0",
        "tcp:9990-9990:127.133.0.0/24",
        "tcp:9990-9990:192.0.2.0/24",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    assert_eq!(*rules, want);
    // A node started from now on has it (the daemon's scale-out, here
    // through the engine as the daemon calls it).
    let before = instances(&moto, &group).len();
    let engine = aws_engine(&moto, &ws);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let node_id = rt
        .block_on(engine.scale_out(&group_id, "us-east-1b", "test"))
        .unwrap_or_else(|e| panic!("scale out: {e}\n{}", node_log(&ws.dir)));
    let new: Vec<Instance> = instances(&moto, &group)
        .into_iter()
        .filter(|i| i.tags.get("lbscale:node-id") == Some(&node_id))
        .collect();
    assert_eq!(instances(&moto, &group).len(), before + 1);
    assert_eq!(new[0].security_groups, BTreeSet::from([sg.clone()]));
    assert_eq!(new[0].subnet, subnets["us-east-1b"]);
    drop(engine);

    ws.destroy();
    assert!(made_groups(&moto, &group_id).is_empty());
    assert!(instances(&moto, &group)
        .iter()
        .all(|i| i.state == "terminated"));
    assert!(_instances.booted() >= 3);
}

/// The engine on the workspace's store with the aws cloud of the provider
/// block, as the daemon opens it.
fn aws_engine(moto: &Moto, ws: &Workspace) -> lbscale_engine::Engine {
    let mut settings = moto.settings();
    settings.image_id = Some("ami-12c6146b".into());
    let clouds =
        lbscale_engine::cloud::Clouds::new().with("aws", lbscale_cloud_aws::drivers(settings));
    lbscale_engine::Engine::open("sqlite://.lbscale/state.db", &ws.dir, clouds)
        .expect("open the engine")
}

/// The image may come from the group's `node` block alone: without one there
/// nor in the provider's aws block, the plan refuses the group, naming both.
#[test]
fn the_image_comes_from_the_node_block_or_the_provider() {
    let Some(moto) = moto("the_image_comes_from_the_node_block_or_the_provider") else {
        return;
    };
    let mut ws = Workspace::new("aws-placement-image", 136);
    ws.provider_blocks = aws_block(&moto).replace("    image_id    = \"ami-12c6146b\"\n", "");
    let group = unique("img");
    let with_image = stack(&group, "dns", "    image = \"ami-12c6146b\"\n", &[], 1);
    ws.write(&with_image);
    let o = ws.plan();
    assert_eq!(o.code, 2, "the block's image is enough:\n{}", o.all());
    ws.write(&stack(&group, "dns", "    size = \"t3.small\"\n", &[], 1));
    let o = ws.plan();
    assert_eq!(o.code, 1, "{}", o.all());
    let d = diagnostics(&o.all());
    assert!(
        d.iter().any(|d| d.summary == "Cloud not usable"
            && d.text.contains(
                "set `image` in the group's node block, or image_id in the provider's aws block"
            )),
        "{d:#?}"
    );
}

/// The shared module `examples/modules/fleet` on moto: the same module as on
/// local (fleet_module.rs), with aws's zones and node block; its instances
/// stand in as above.
#[test]
fn the_fleet_module_comes_up_on_aws_and_goes_with_destroy() {
    let Some(moto) = moto("the_fleet_module_comes_up_on_aws_and_goes_with_destroy") else {
        return;
    };
    let mut ws = Workspace::new("aws-fleet", 137);
    ws.provider_blocks = aws_block(&moto);
    let (_vpc, subnets) = loopback_vpc(&moto, 137, &["us-east-1a", "us-east-1b"]);
    let group = unique("fleet");
    let _instances = StandIns::start(&moto, &group, &ws.dir);
    let backend = tcp_backend("fleet");
    ws.copy_fleet_module();
    ws.write(&format!(
        r#"
module "shop" {{
  source             = "./modules/fleet"
  name               = "{group}"
  cloud              = "aws"
  availability_zones = ["us-east-1a", "us-east-1b"]
  domain             = "{group}.lbscale.test"
  ttl                = "1s"
  node = {{
    size    = "t3.small"
    subnets = {{ "us-east-1a" = "{a}", "us-east-1b" = "{b}" }}
    tags    = {{ app = "fleet" }}
  }}
  vservers = {{
    web = {{
      port     = 28090
      backends = [{{ name = "b1", address = "127.0.0.1", port = {backend} }}]
    }}
  }}
}}
"#,
        a = subnets["us-east-1a"],
        b = subnets["us-east-1b"],
    ));
    let o = ws.tf(&["get", "-no-color"]);
    assert_eq!(o.code, 0, "terraform get:\n{}", o.all());
    let o = ws.tf(&["apply", "-auto-approve", "-no-color", "-input=false"]);
    assert_eq!(o.code, 0, "apply:\n{}\n{}", o.all(), node_log(&ws.dir));
    let running: Vec<Instance> = instances(&moto, &group)
        .into_iter()
        .filter(|i| i.state == "running")
        .collect();
    assert_eq!(running.len(), 2, "an instance per zone");
    ws.assert_plan_empty("the fleet module on aws");
    ws.destroy();
    assert!(
        instances(&moto, &group)
            .iter()
            .all(|i| i.state == "terminated" || i.state == "shutting-down"),
        "instances left running after destroy"
    );
}

/// How many destroy-while-scaling rounds run on aws. Fewer than the local
/// variant's ten (daemon_destroy_race.rs): a round here goes through moto's
/// API for every step and boots a real node for each of up to four instances,
/// about 10 s a round on a loaded 2-core machine and twice that under heavier
/// load; five rounds still move the destroy across the scale-outs (the sleep
/// before it differs each round) and keep the test well under 2 min.
const AWS_RACE_ROUNDS: u64 = 5;

/// A dns distributor and a group in one AZ whose memory threshold always
/// breaches, so that a daemon on its store keeps scaling it out.
fn racing_stack(group: &str, subnet: &str) -> String {
    format!(
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
  availability_zones     = ["us-east-1a"]
  traffic_distributor_id = lbscale_traffic_distributor.d.id
  min_nodes              = 1
  max_nodes              = 4
  apply_timeout          = "90s"
  # Sampled often and no cooldown: the daemon starts the next scale-out
  # right after the last one (each about 1 s on moto), so a destroy lands on
  # one in flight or about to start, not in a quiet cooldown.
  stats_interval         = "200ms"
  watch_time             = "200ms"
  cooldown               = "0"
  drain_timeout          = "1s"
  # Any node uses more than 0.01 % of its memory budget: always a breach.
  threshold {{
    metric = "memory"
    min    = 0.001
    max    = 0.01
  }}
  node {{
    subnets = {{ "us-east-1a" = "{subnet}" }}
  }}
}}
"#
    )
}

/// The daemon's environment for the aws cloud: the same region, endpoint,
/// CA, credentials and image as [`aws_block`] gives the provider.
fn daemon_aws_env(moto: &Moto) -> Vec<(&'static str, String)> {
    let (key, secret) = ("AKIDPLACEMENT", SECRET);
    vec![
        ("AWS_REGION", "us-east-1".into()),
        ("AWS_ENDPOINT_URL", moto.endpoint.clone()),
        ("AWS_CA_BUNDLE", moto.ca.display().to_string()),
        ("AWS_ACCESS_KEY_ID", key.into()),
        ("AWS_SECRET_ACCESS_KEY", secret.into()),
        ("AWS_EC2_METADATA_DISABLED", "true".into()),
        ("LBSCALE_AWS_IMAGE_ID", "ami-12c6146b".into()),
    ]
}

/// The group's instances (by its `lbscale:group-id` tag) that moto does not
/// show as terminated.
fn live_instances(moto: &Moto, group: &str, group_id: &str) -> Vec<Instance> {
    instances(moto, group)
        .into_iter()
        .filter(|i| i.tags.get("lbscale:group-id").map(String::as_str) == Some(group_id))
        .filter(|i| i.state != "terminated")
        .collect()
}

/// The aws variant of daemon_destroy_race.rs: `terraform destroy` while the
/// daemon keeps scaling the group out on moto, a few times. Each destroy
/// waits for the daemon's workflow in the AZ, and a scale-out that read the
/// group before the destroy is refused its lease once the group is gone, so
/// nothing of the group remains: no row (leases included), no instance that
/// is not terminated, no node process of its stand-ins, and none comes back
/// while the daemon keeps running. Timing decides where each destroy lands:
/// the narrow window of a lease taken after the group is gone is held open
/// deterministically by engine/tests/faults.rs (`scale_out_before_lease`).
#[test]
fn destroy_while_the_daemon_scales_out_on_aws_leaves_no_instance() {
    let Some(moto) = moto("destroy_while_the_daemon_scales_out_on_aws_leaves_no_instance") else {
        return;
    };
    let mut ws = Workspace::new("aws-destroy-race", 138);
    ws.provider_blocks = aws_block(&moto);
    let (_vpc, subnets) = loopback_vpc(&moto, 138, &["us-east-1a"]);
    let env = daemon_aws_env(&moto);
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    for round in 1..=AWS_RACE_ROUNDS {
        let group = unique(&format!("race{round}"));
        let stand_ins = StandIns::start(&moto, &group, &ws.dir);
        ws.write(&racing_stack(&group, &subnets["us-east-1a"]));
        let o = ws.tf(&["apply", "-auto-approve", "-no-color", "-input=false"]);
        assert_eq!(
            o.code,
            0,
            "round {round}: apply:\n{}\n{}",
            o.all(),
            node_log(&ws.dir)
        );
        let group_id = ws
            .engine()
            .group_named(&group)
            .unwrap()
            .expect("the group")
            .id;
        let daemon = Daemon::start_with(&ws, 19582, &format!("race{round}"), &env);
        // Destroy once the daemon is scaling out (a second instance on its
        // way), at a point that moves from round to round.
        wait_showing(
            "the daemon to start a scale-out on aws",
            Duration::from_secs(90),
            || {
                let events = ws.engine().events(&group_id, 1000).unwrap();
                let kinds: Vec<String> = events.iter().map(|e| e.kind.clone()).collect();
                if kinds.iter().any(|k| k == "scale_out") {
                    Ok(())
                } else {
                    Err(kinds)
                }
            },
        );
        std::thread::sleep(Duration::from_millis(150 * (round % 5)));
        let o = ws.tf(&["destroy", "-auto-approve", "-no-color", "-input=false"]);
        assert_eq!(
            o.code,
            0,
            "round {round}: destroy:\n{}\n{}",
            o.all(),
            node_log(&ws.dir)
        );
        let store = ws.store();
        assert_eq!(
            store.rows_mentioning(&group_id).unwrap(),
            0,
            "round {round}: rows of the group are left (leases included)"
        );
        let live = live_instances(&moto, &group, &group_id);
        assert!(
            live.is_empty(),
            "round {round}: instances of the group outlived its destroy: {live:#?}"
        );
        // The stand-ins stop a node once moto shows its instance terminated.
        wait_showing(
            "the stand-ins' nodes of the terminated instances to stop",
            Duration::from_secs(15),
            || {
                let p = ws.processes();
                if p.is_empty() {
                    Ok(())
                } else {
                    Err(p)
                }
            },
        );
        ws.assert_nothing_left(&[]);
        // The daemon keeps running a little: nothing of the group comes back.
        std::thread::sleep(Duration::from_secs(2));
        let live = live_instances(&moto, &group, &group_id);
        assert!(
            live.is_empty(),
            "round {round}: an instance of the group came back: {live:#?}"
        );
        assert_eq!(
            store.rows_mentioning(&group_id).unwrap(),
            0,
            "round {round}: rows of the group came back"
        );
        assert!(
            ws.processes().is_empty(),
            "round {round}: node processes came back: {:?}",
            ws.processes()
        );
        daemon.stop();
        drop(stand_ins);
    }
}
