//! The security group that lbscale makes for a group whose `node` block
//! gives no `security_groups`: `lbscale-<group id>` in the nodes' VPC,
//! tagged `lbscale:group-id`. Its ingress rules are exactly the vservers'
//! ports (TCP or UDP as each vserver says, from anywhere) and the node API
//! port from `management_cidrs` only (default: the VPC's CIDR blocks); every
//! apply brings them back to that, and the group's destroy deletes it once
//! its instances are gone. Egress stays EC2's default (all).

use super::{xml, AwsCloud, NODE_API_PORT};
use lbscale_engine::cloud::{
    CloudError, GroupResources, Listener, ProvisionRequest, Result, Transport,
};
use std::collections::BTreeSet;
use std::time::{Duration, Instant};

/// How long a destroy waits for the group's terminated instances to let go
/// of its security group (EC2 refuses to delete one in use).
const RELEASE_TIMEOUT: Duration = Duration::from_secs(300);
const RELEASE_POLL: Duration = Duration::from_secs(5);

/// One ingress rule: protocol (`tcp`, `udp`, or `-1` for all), port range
/// (none for `-1`), source CIDR.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct Rule {
    protocol: String,
    ports: Option<(i32, i32)>,
    cidr: String,
}

/// A security group that lbscale made.
struct MadeGroup {
    id: String,
    vpc: String,
    rules: BTreeSet<Rule>,
}

/// The rules a made group must have: each listener from anywhere, the node
/// API port from each of `management`.
pub(crate) fn wanted_rules(listeners: &[Listener], management: &[String]) -> BTreeSet<Rule> {
    let port = |protocol: &str, p: u16, cidr: &str| Rule {
        protocol: protocol.into(),
        ports: Some((i32::from(p), i32::from(p))),
        cidr: cidr.into(),
    };
    let mut rules: BTreeSet<Rule> = listeners
        .iter()
        .map(|l| {
            let protocol = match l.protocol {
                Transport::Tcp => "tcp",
                Transport::Udp => "udp",
            };
            port(protocol, l.port, "0.0.0.0/0")
        })
        .collect();
    rules.extend(management.iter().map(|c| port("tcp", NODE_API_PORT, c)));
    rules
}

fn group_name(group_id: &str) -> String {
    format!("lbscale-{group_id}")
}

impl AwsCloud {
    /// The made group of `req`'s group in its nodes' VPC: its id. The
    /// engine's `prepare_group` made it before any provisioning; one that is
    /// missing (deleted outside lbscale, or a driver used without the engine)
    /// is made here with the node API port open, and the group's next apply
    /// opens the vservers' ports.
    pub(crate) async fn made_security_group(&self, req: &ProvisionRequest) -> Result<String> {
        let vpc = self.vpc_of(&req.group_id, &req.node).await?;
        let found = self
            .made_groups(&req.group_id)
            .await?
            .into_iter()
            .find(|g| g.vpc == vpc)
            .map(|g| g.id);
        if let Some(id) = found {
            return Ok(id);
        }
        let group = GroupResources {
            group_id: req.group_id.clone(),
            group_name: req.group_name.clone(),
            availability_zones: vec![req.az.clone()],
            node: req.node.clone(),
            listeners: vec![],
        };
        self.prepare_security_group(&group).await?;
        self.made_groups(&req.group_id)
            .await?
            .into_iter()
            .find(|g| g.vpc == vpc)
            .map(|g| g.id)
            .ok_or_else(|| {
                CloudError::Failed(format!(
                    "the security group {} that lbscale makes for group {} is not found in {vpc} right after it was made",
                    group_name(&req.group_id),
                    req.group_id
                ))
            })
    }

    /// Makes the group's security group, or brings its rules in step; with
    /// `security_groups` given, deletes one made earlier once nothing uses it.
    pub(crate) async fn prepare_security_group(&self, g: &GroupResources) -> Result<()> {
        let made = self.made_groups(&g.group_id).await?;
        if !g.node.makes_security_group() {
            for old in made {
                self.delete_if_unused(&old.id).await?;
            }
            return Ok(());
        }
        let vpc = self.vpc_of(&g.group_id, &g.node).await?;
        let (sg, current) = match made.into_iter().find(|m| m.vpc == vpc) {
            Some(m) => (m.id, m.rules),
            None => (self.create_group(g, &vpc).await?, BTreeSet::new()),
        };
        let sources = if g.node.management_cidrs.is_empty() {
            self.vpc_cidrs(&vpc).await?
        } else {
            g.node.management_cidrs.clone()
        };
        let wanted = wanted_rules(&g.listeners, &sources);
        let add: Vec<&Rule> = wanted.difference(&current).collect();
        let drop: Vec<&Rule> = current.difference(&wanted).collect();
        for (action, rules) in [
            ("AuthorizeSecurityGroupIngress", add),
            ("RevokeSecurityGroupIngress", drop),
        ] {
            if rules.is_empty() {
                continue;
            }
            let mut params = vec![("GroupId".to_string(), sg.clone())];
            for (i, r) in rules.iter().enumerate() {
                let n = i + 1;
                params.push((format!("IpPermissions.{n}.IpProtocol"), r.protocol.clone()));
                if let Some((from, to)) = r.ports {
                    params.push((format!("IpPermissions.{n}.FromPort"), from.to_string()));
                    params.push((format!("IpPermissions.{n}.ToPort"), to.to_string()));
                }
                if r.cidr.contains(':') {
                    params.push((
                        format!("IpPermissions.{n}.Ipv6Ranges.1.CidrIpv6"),
                        r.cidr.clone(),
                    ));
                } else {
                    params.push((
                        format!("IpPermissions.{n}.IpRanges.1.CidrIp"),
                        r.cidr.clone(),
                    ));
                }
            }
            self.ec2(action, params).await.map_err(|e| {
                in_context(e, &format!("security group {sg} of group {}", g.group_id))
            })?;
        }
        Ok(())
    }

    /// Deletes every security group lbscale made for `group_id`, waiting (at
    /// most [`RELEASE_TIMEOUT`]) while terminated instances still hold it.
    pub(crate) async fn release_security_groups(&self, group_id: &str) -> Result<()> {
        let deadline = Instant::now() + RELEASE_TIMEOUT;
        for g in self.made_groups(group_id).await? {
            loop {
                match self.delete_group(&g.id).await {
                    Ok(()) => break,
                    Err(CloudError::Failed(m))
                        if m.contains("DependencyViolation") && Instant::now() < deadline =>
                    {
                        tokio::time::sleep(RELEASE_POLL).await;
                    }
                    Err(CloudError::Failed(m)) if m.contains("DependencyViolation") => {
                        return Err(CloudError::Failed(format!(
                            "security group {} of group {group_id} still in use after {}s (waited for the group's instances to be terminated): {m}",
                            g.id,
                            RELEASE_TIMEOUT.as_secs()
                        )))
                    }
                    Err(e) => return Err(in_context(e, &format!("security group {} of group {group_id}", g.id))),
                }
            }
        }
        Ok(())
    }

    /// Deletes `id` unless something still uses it (then it stays until the
    /// group's destroy).
    async fn delete_if_unused(&self, id: &str) -> Result<()> {
        match self.delete_group(id).await {
            Err(CloudError::Failed(m)) if m.contains("DependencyViolation") => {
                tracing::info!(security_group = %id, "the security group lbscale made is still in use; it goes with the group");
                Ok(())
            }
            other => other,
        }
    }

    async fn delete_group(&self, id: &str) -> Result<()> {
        match self
            .ec2(
                "DeleteSecurityGroup",
                vec![("GroupId".into(), id.to_string())],
            )
            .await
        {
            Err(CloudError::Failed(m)) if m.contains("InvalidGroup.NotFound") => Ok(()),
            other => other.map(|_| ()),
        }
    }

    async fn create_group(&self, g: &GroupResources, vpc: &str) -> Result<String> {
        let name = group_name(&g.group_id);
        let tags = [
            ("Name", name.clone()),
            ("lbscale:group-id", g.group_id.clone()),
            ("lbscale:group", g.group_name.clone()),
        ];
        let mut params = vec![
            ("GroupName".to_string(), name.clone()),
            (
                "GroupDescription".to_string(),
                format!("lbscale group {} nodes", g.group_name),
            ),
            ("VpcId".to_string(), vpc.to_string()),
            (
                "TagSpecification.1.ResourceType".to_string(),
                "security-group".to_string(),
            ),
        ];
        for (i, (k, v)) in tags.iter().enumerate() {
            params.push((
                format!("TagSpecification.1.Tag.{}.Key", i + 1),
                k.to_string(),
            ));
            params.push((format!("TagSpecification.1.Tag.{}.Value", i + 1), v.clone()));
        }
        let body = match self.ec2("CreateSecurityGroup", params).await {
            Ok(b) => b,
            // Made meanwhile by another workflow of the group (two AZs
            // scaling out at once): that one is it.
            Err(CloudError::Failed(m)) if m.contains("InvalidGroup.Duplicate") => {
                return self
                    .made_groups(&g.group_id)
                    .await?
                    .into_iter()
                    .find(|m| m.vpc == vpc)
                    .map(|m| m.id)
                    .ok_or_else(|| {
                        CloudError::Failed(format!(
                            "a security group named {name} exists in {vpc} but is not lbscale's (no tag lbscale:group-id = {}): {m}",
                            g.group_id
                        ))
                    })
            }
            Err(e) => return Err(in_context(e, &format!("security group {name} in {vpc}"))),
        };
        let doc = xml::parse("ec2 CreateSecurityGroup", &body)?;
        xml::text(doc.root(), "groupId").ok_or_else(|| {
            CloudError::Failed("AWS ec2 CreateSecurityGroup: no groupId in the answer".into())
        })
    }

    /// The security groups tagged as lbscale's for `group_id`, with their rules.
    async fn made_groups(&self, group_id: &str) -> Result<Vec<MadeGroup>> {
        let body = self
            .ec2(
                "DescribeSecurityGroups",
                vec![
                    ("Filter.1.Name".into(), "tag:lbscale:group-id".into()),
                    ("Filter.1.Value.1".into(), group_id.to_string()),
                ],
            )
            .await?;
        let doc = xml::parse("ec2 DescribeSecurityGroups", &body)?;
        Ok(xml::find_all(doc.root(), "securityGroupInfo")
            .flat_map(|s| s.children().filter(|c| c.is_element()))
            .filter_map(|sg| {
                Some(MadeGroup {
                    id: xml::child_text(sg, "groupId")?,
                    vpc: xml::child_text(sg, "vpcId").unwrap_or_default(),
                    rules: ingress_rules(sg),
                })
            })
            .collect())
    }
}

/// A security group item's ingress rules, one per source.
fn ingress_rules(sg: xml::Node<'_, '_>) -> BTreeSet<Rule> {
    let mut out = BTreeSet::new();
    let Some(perms) = sg.children().find(|c| c.has_tag_name("ipPermissions")) else {
        return out;
    };
    for p in perms.children().filter(|c| c.is_element()) {
        let protocol = xml::child_text(p, "ipProtocol").unwrap_or_default();
        let port = |n: &str| xml::child_text(p, n).and_then(|v| v.parse::<i32>().ok());
        let ports = match (port("fromPort"), port("toPort")) {
            (Some(f), Some(t)) if protocol != "-1" => Some((f, t)),
            _ => None,
        };
        for (set, field) in [("ipRanges", "cidrIp"), ("ipv6Ranges", "cidrIpv6")] {
            let Some(ranges) = p.children().find(|c| c.has_tag_name(set)) else {
                continue;
            };
            for r in ranges.children().filter(|c| c.is_element()) {
                if let Some(cidr) = xml::child_text(r, field) {
                    out.insert(Rule {
                        protocol: protocol.clone(),
                        ports,
                        cidr,
                    });
                }
            }
        }
    }
    out
}

/// `e` with the resource it was about.
pub(crate) fn in_context(e: CloudError, resource: &str) -> CloudError {
    match e {
        CloudError::Failed(m) => CloudError::Failed(format!("{m} ({resource})")),
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules_read_from_an_answer_and_compare_with_the_wanted_ones() {
        let answer = r#"<DescribeSecurityGroupsResponse xmlns="http://ec2.amazonaws.com/doc/2016-11-15/"><securityGroupInfo><item>
<groupId>sg-1</groupId><vpcId>vpc-1</vpcId>
<ipPermissions>
<item><ipProtocol>tcp</ipProtocol><fromPort>80</fromPort><toPort>80</toPort><ipRanges><item><cidrIp>0.0.0.0/0</cidrIp></item></ipRanges><ipv6Ranges/></item>
<item><ipProtocol>tcp</ipProtocol><fromPort>9990</fromPort><toPort>9990</toPort><ipRanges><item><cidrIp>10.0.0.0/16</cidrIp></item><item><cidrIp>192.0.2.0/24</cidrIp></item></ipRanges></item>
<item><ipProtocol>-1</ipProtocol><ipRanges><item><cidrIp>0.0.0.0/0</cidrIp></item></ipRanges></item>
</ipPermissions>
<ipPermissionsEgress><item><ipProtocol>-1</ipProtocol><ipRanges><item><cidrIp>0.0.0.0/0</cidrIp></item></ipRanges></item></ipPermissionsEgress>
</item></securityGroupInfo></DescribeSecurityGroupsResponse>"#;
        let doc = xml::parse("test", answer).unwrap();
        let sg = xml::find_all(doc.root(), "securityGroupInfo")
            .flat_map(|s| s.children().filter(|c| c.is_element()))
            .next()
            .unwrap();
        let current = ingress_rules(sg);
        assert_eq!(current.len(), 4, "{current:?}");
        let wanted = wanted_rules(
            &[
                Listener {
                    port: 80,
                    protocol: Transport::Tcp,
                },
                Listener {
                    port: 53,
                    protocol: Transport::Udp,
                },
            ],
            &["10.0.0.0/16".into()],
        );
        let add: Vec<_> = wanted.difference(&current).collect();
        let drop: Vec<_> = current
            .difference(&wanted)
            .map(|r| (r.protocol.as_str(), r.cidr.as_str()))
            .collect();
        assert_eq!(add.len(), 1);
        assert_eq!(
            (add[0].protocol.as_str(), add[0].ports),
            ("udp", Some((53, 53)))
        );
        assert_eq!(drop, [("-1", "0.0.0.0/0"), ("tcp", "192.0.2.0/24")]);
    }
}
