//! The `aws` `nlb` distributor: one ELBv2 network load balancer per
//! distributor, with a subnet in each AZ of its groups (the subnet the
//! groups' `node.subnets` give there, else the AZ's default subnet; all in one
//! VPC), a TCP listener per vserver port, and a target group per port whose
//! targets are the nodes' private IPs.
//!
//! A network load balancer hashes each flow to a target, in the AZ where the
//! client reached it (cross-zone load balancing is off by default): the
//! `local` nlb's per-AZ VIP and its flow hash. A port whose vserver has a
//! native primary (`Balance::First`) gets that primary only; the load balancer
//! has no ordered failover, and the engine republishes when the primary fails.

use super::{api::Service, xml, AwsCloud, DistributorRuntime};
use lbscale_engine::cloud::{Balance, CloudError, Publication, Result};
use std::collections::{BTreeMap, BTreeSet};

const VERSION: &str = "2015-12-01";
/// How long a deleted listener or load balancer may keep its target group in use.
const TARGET_GROUP_RELEASE: std::time::Duration = std::time::Duration::from_secs(120);

impl AwsCloud {
    async fn elb(&self, action: &str, params: Vec<(String, String)>) -> Result<String> {
        self.api.query(Service::Elb, action, VERSION, &params).await
    }

    /// The load balancer's name: `lbscale-` and the distributor's id (ELBv2
    /// allows 32 characters).
    fn lb_name(id: &str) -> String {
        format!("lbscale-{id}").chars().take(32).collect()
    }

    /// The target group of `port`: the load balancer's name and the port.
    fn tg_name(id: &str, port: u16) -> String {
        let base: String = Self::lb_name(id).chars().take(26).collect();
        format!("{base}-{port}")
    }

    /// The subnet of each of `azs`: the one the groups give there (`given`),
    /// else the AZ's default subnet. AZ -> (subnet id, VPC id); every subnet
    /// in one VPC, one subnet per AZ.
    async fn subnets_for(
        &self,
        azs: &BTreeSet<String>,
        given: &BTreeMap<String, BTreeSet<String>>,
    ) -> Result<BTreeMap<String, (String, String)>> {
        let mut ids = Vec::new();
        for az in azs {
            match given.get(az).map(|s| s.iter().collect::<Vec<_>>()).as_deref() {
                None | Some([]) => {}
                Some([one]) => ids.push(((*one).clone(), az.clone())),
                Some(many) => {
                    return Err(CloudError::Failed(format!(
                        "the groups of this nlb distributor give different subnets in {az} ({}): a load balancer has one subnet per AZ, so its groups' node.subnets must agree",
                        many.iter().map(|s| s.as_str()).collect::<Vec<_>>().join(", ")
                    )))
                }
            }
        }
        let defaults: BTreeSet<String> = azs
            .iter()
            .filter(|az| !ids.iter().any(|(_, a)| a == *az))
            .cloned()
            .collect();
        let mut out = if defaults.is_empty() {
            BTreeMap::new()
        } else {
            self.default_subnets(&defaults).await?
        };
        if !ids.is_empty() {
            let mut params = Vec::new();
            for (i, (id, _)) in ids.iter().enumerate() {
                params.push((format!("SubnetId.{}", i + 1), id.clone()));
            }
            let body = self
                .api
                .query(Service::Ec2, "DescribeSubnets", super::EC2_VERSION, &params)
                .await?;
            let doc = xml::parse("ec2 DescribeSubnets", &body)?;
            let found: BTreeMap<String, (String, String)> = xml::find_all(doc.root(), "subnetSet")
                .flat_map(|s| s.children().filter(|c| c.is_element()))
                .filter_map(|s| {
                    Some((
                        xml::child_text(s, "subnetId")?,
                        (
                            xml::child_text(s, "availabilityZone")?,
                            xml::child_text(s, "vpcId")?,
                        ),
                    ))
                })
                .collect();
            for (id, az) in ids {
                match found.get(&id) {
                    Some((in_az, vpc)) if *in_az == az => {
                        out.insert(az, (id, vpc.clone()));
                    }
                    Some((in_az, _)) => {
                        return Err(CloudError::Failed(format!(
                            "subnet {id}, given for {az} in node.subnets, is in {in_az}"
                        )))
                    }
                    None => {
                        return Err(CloudError::Failed(format!(
                            "AWS ec2 DescribeSubnets: subnet {id} (node.subnets of {az}) not found"
                        )))
                    }
                }
            }
        }
        let vpcs: BTreeSet<&String> = out.values().map(|(_, v)| v).collect();
        if vpcs.len() > 1 {
            return Err(CloudError::Failed(format!(
                "the subnets of this nlb distributor are in more than one VPC ({}): a load balancer lives in one VPC; give every AZ of its groups a subnet of one VPC in node.subnets",
                out.iter()
                    .map(|(az, (s, v))| format!("{az}: {s} in {v}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            )));
        }
        Ok(out)
    }

    /// The default subnet of each of `azs`: AZ -> (subnet id, VPC id).
    async fn default_subnets(
        &self,
        azs: &BTreeSet<String>,
    ) -> Result<BTreeMap<String, (String, String)>> {
        let mut params = vec![
            ("Filter.1.Name".to_string(), "default-for-az".to_string()),
            ("Filter.1.Value.1".to_string(), "true".to_string()),
            ("Filter.2.Name".to_string(), "availability-zone".to_string()),
        ];
        for (i, az) in azs.iter().enumerate() {
            params.push((format!("Filter.2.Value.{}", i + 1), az.clone()));
        }
        let body = self
            .api
            .query(Service::Ec2, "DescribeSubnets", super::EC2_VERSION, &params)
            .await?;
        let doc = xml::parse("ec2 DescribeSubnets", &body)?;
        let found: BTreeMap<String, (String, String)> = xml::find_all(doc.root(), "subnetSet")
            .flat_map(|s| s.children().filter(|c| c.is_element()))
            .filter_map(|s| {
                Some((
                    xml::child_text(s, "availabilityZone")?,
                    (
                        xml::child_text(s, "subnetId")?,
                        xml::child_text(s, "vpcId")?,
                    ),
                ))
            })
            .collect();
        if let Some(missing) = azs.iter().find(|az| !found.contains_key(*az)) {
            return Err(CloudError::Failed(format!(
                "no default subnet in {missing}: an aws nlb distributor puts its load balancer in each AZ's default subnet"
            )));
        }
        Ok(found)
    }

    /// The load balancer of distributor `id` as ELBv2 has it: (ARN, DNS name,
    /// AZ -> its IP address there when ELBv2 reports one, AZs).
    async fn find_lb(&self, id: &str) -> Result<Option<LoadBalancer>> {
        let body = match self
            .elb(
                "DescribeLoadBalancers",
                vec![("Names.member.1".into(), Self::lb_name(id))],
            )
            .await
        {
            Ok(b) => b,
            Err(CloudError::Failed(m)) if m.contains("LoadBalancerNotFound") => return Ok(None),
            Err(e) => return Err(e),
        };
        parse_lb("elasticloadbalancing DescribeLoadBalancers", &body)
    }

    /// Makes the load balancer hand out `publication`: subnets in its AZs, a
    /// listener and target group per port, and exactly the targets wanted.
    pub(super) async fn publish_nlb(&self, id: &str, publication: &Publication) -> Result<()> {
        let azs: BTreeSet<String> = publication
            .ports
            .iter()
            .filter(|(_, ports)| !ports.is_empty())
            .map(|(az, _)| az.clone())
            .collect();
        // Port -> targets (private IPs), over every AZ.
        let mut wanted: BTreeMap<u16, BTreeSet<String>> = BTreeMap::new();
        for (az, ports) in &publication.ports {
            let nodes = publication.endpoints.get(az).cloned().unwrap_or_default();
            for port in ports {
                let placed = publication.port_targets.get(az).and_then(|p| p.get(port));
                let targets: Vec<String> = match placed {
                    Some(t) if t.balance == Balance::First => {
                        t.addresses.iter().take(1).cloned().collect()
                    }
                    Some(t) => t.addresses.clone(),
                    None => nodes.clone(),
                };
                wanted.entry(*port).or_default().extend(targets);
            }
        }
        let existing = self.find_lb(id).await?;
        if azs.is_empty() {
            // Nothing to serve: no load balancer (it costs money while it exists).
            if existing.is_some() {
                self.remove_nlb(id).await?;
            }
            return self.save_nlb_runtime(id, None);
        }
        let subnets = self.subnets_for(&azs, &publication.subnets).await?;
        let vpc = subnets
            .values()
            .next()
            .map(|(_, v)| v.clone())
            .unwrap_or_default();
        let in_place = |lb: &LoadBalancer| {
            subnets
                .iter()
                .all(|(az, (subnet, _))| lb.subnets.get(az) == Some(subnet))
        };
        let lb = match existing {
            Some(lb) if in_place(&lb) => lb,
            Some(lb) => {
                // ELBv2 takes the whole list: the subnets wanted in the AZs
                // served, and those it has in other AZs, as they are.
                let mut all: BTreeMap<String, String> = lb.subnets.clone();
                for (az, (subnet, _)) in &subnets {
                    all.insert(az.clone(), subnet.clone());
                }
                let mut params = vec![("LoadBalancerArn".to_string(), lb.arn.clone())];
                for (i, subnet) in all.values().enumerate() {
                    params.push((format!("Subnets.member.{}", i + 1), subnet.clone()));
                }
                self.elb("SetSubnets", params).await?;
                // What it has now (its addresses in the new AZs).
                self.find_lb(id).await?.unwrap_or(lb)
            }
            None => {
                let mut params = vec![
                    ("Name".to_string(), Self::lb_name(id)),
                    ("Type".to_string(), "network".to_string()),
                    ("Scheme".to_string(), "internet-facing".to_string()),
                    (
                        "Tags.member.1.Key".to_string(),
                        "lbscale:distributor-id".to_string(),
                    ),
                    ("Tags.member.1.Value".to_string(), id.to_string()),
                ];
                for (i, (subnet, _)) in subnets.values().enumerate() {
                    params.push((format!("Subnets.member.{}", i + 1), subnet.clone()));
                }
                // From the answer: a describe right after may not list it yet.
                let body = self.elb("CreateLoadBalancer", params).await?;
                parse_lb("elasticloadbalancing CreateLoadBalancer", &body)?.ok_or_else(|| {
                    CloudError::Failed(format!(
                        "AWS elasticloadbalancing CreateLoadBalancer: no load balancer {} in the answer",
                        Self::lb_name(id)
                    ))
                })?
            }
        };

        // Listeners: one per wanted port; others are deleted with their group.
        let body = self
            .elb(
                "DescribeListeners",
                vec![("LoadBalancerArn".into(), lb.arn.clone())],
            )
            .await?;
        let doc = xml::parse("elasticloadbalancing DescribeListeners", &body)?;
        let listeners: BTreeMap<u16, String> = xml::find_all(doc.root(), "Listeners")
            .flat_map(|l| l.children().filter(|c| c.is_element()))
            .filter_map(|l| {
                Some((
                    xml::child_text(l, "Port")?.parse().ok()?,
                    xml::child_text(l, "ListenerArn")?,
                ))
            })
            .collect();
        for (port, listener) in &listeners {
            if !wanted.contains_key(port) {
                match self
                    .elb(
                        "DeleteListener",
                        vec![("ListenerArn".into(), listener.clone())],
                    )
                    .await
                {
                    Ok(_) => {}
                    Err(CloudError::Failed(m)) if m.contains("ListenerNotFound") => {}
                    Err(e) => return Err(e),
                }
            }
        }
        for (port, arn) in self.target_groups_of(id).await? {
            if !wanted.contains_key(&port) {
                self.delete_target_group_arn(&arn).await?;
            }
        }
        for (port, targets) in &wanted {
            let tg = self.target_group(id, *port, &vpc).await?;
            if !listeners.contains_key(port) {
                self.elb(
                    "CreateListener",
                    vec![
                        ("LoadBalancerArn".into(), lb.arn.clone()),
                        ("Protocol".into(), "TCP".into()),
                        ("Port".into(), port.to_string()),
                        ("DefaultActions.member.1.Type".into(), "forward".into()),
                        ("DefaultActions.member.1.TargetGroupArn".into(), tg.clone()),
                    ],
                )
                .await?;
            }
            self.set_targets(&tg, *port, targets).await?;
        }
        self.save_nlb_runtime(id, Some(&lb))
    }

    /// The ARNs of the target groups named `name` (none or one).
    async fn target_groups_named(&self, name: &str) -> Result<Vec<String>> {
        let body = match self
            .elb(
                "DescribeTargetGroups",
                vec![("Names.member.1".into(), name.to_string())],
            )
            .await
        {
            Ok(b) => b,
            Err(CloudError::Failed(m)) if m.contains("TargetGroupNotFound") => return Ok(vec![]),
            Err(e) => return Err(e),
        };
        let doc = xml::parse("elasticloadbalancing DescribeTargetGroups", &body)?;
        Ok(xml::find_all(doc.root(), "TargetGroupArn")
            .filter_map(|n| n.text().map(|t| t.trim().to_string()))
            .collect())
    }

    /// The target group of `port`, created when missing.
    async fn target_group(&self, id: &str, port: u16, vpc: &str) -> Result<String> {
        if let Some(arn) = self
            .target_groups_named(&Self::tg_name(id, port))
            .await?
            .into_iter()
            .next()
        {
            return Ok(arn);
        }
        let body = self
            .elb(
                "CreateTargetGroup",
                vec![
                    ("Name".into(), Self::tg_name(id, port)),
                    ("Protocol".into(), "TCP".into()),
                    ("Port".into(), port.to_string()),
                    ("VpcId".into(), vpc.to_string()),
                    ("TargetType".into(), "ip".into()),
                    ("HealthCheckProtocol".into(), "TCP".into()),
                    // A failed node leaves in about 20 s rather than a minute
                    // and a half (ELBv2's defaults: 30 s, 3 checks).
                    ("HealthCheckIntervalSeconds".into(), "10".into()),
                    ("HealthyThresholdCount".into(), "2".into()),
                    ("UnhealthyThresholdCount".into(), "2".into()),
                ],
            )
            .await?;
        let doc = xml::parse("elasticloadbalancing CreateTargetGroup", &body)?;
        xml::text(doc.root(), "TargetGroupArn").ok_or_else(|| {
            CloudError::Failed(
                "AWS elasticloadbalancing CreateTargetGroup: no TargetGroupArn in the answer"
                    .into(),
            )
        })
    }

    /// Registers the targets `wanted` lacks and deregisters the others.
    async fn set_targets(&self, tg: &str, port: u16, wanted: &BTreeSet<String>) -> Result<()> {
        let body = self
            .elb(
                "DescribeTargetHealth",
                vec![("TargetGroupArn".into(), tg.to_string())],
            )
            .await?;
        let doc = xml::parse("elasticloadbalancing DescribeTargetHealth", &body)?;
        let now = registered_targets(doc.root());
        let add: Vec<&String> = wanted.difference(&now).collect();
        let drop: Vec<&String> = now.difference(wanted).collect();
        for (action, ips) in [("RegisterTargets", add), ("DeregisterTargets", drop)] {
            if ips.is_empty() {
                continue;
            }
            let mut params = vec![("TargetGroupArn".to_string(), tg.to_string())];
            for (i, ip) in ips.iter().enumerate() {
                params.push((format!("Targets.member.{}.Id", i + 1), ip.to_string()));
                params.push((format!("Targets.member.{}.Port", i + 1), port.to_string()));
            }
            self.elb(action, params).await?;
        }
        Ok(())
    }

    /// Deletes a target group; one still in use by a listener or load balancer
    /// that is going (ELBv2 lets go of it some seconds later) is tried again.
    async fn delete_target_group_arn(&self, arn: &str) -> Result<()> {
        let deadline = std::time::Instant::now() + TARGET_GROUP_RELEASE;
        loop {
            match self
                .elb(
                    "DeleteTargetGroup",
                    vec![("TargetGroupArn".into(), arn.to_string())],
                )
                .await
            {
                Ok(_) => return Ok(()),
                Err(CloudError::Failed(m)) if m.contains("TargetGroupNotFound") => return Ok(()),
                Err(CloudError::Failed(m))
                    if m.contains("ResourceInUse") && std::time::Instant::now() < deadline =>
                {
                    tokio::time::sleep(std::time::Duration::from_secs(5)).await;
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// The target groups of distributor `id` (named `lbscale-<id>-<port>`),
    /// whatever listener or load balancer still uses them: port -> ARN.
    async fn target_groups_of(&self, id: &str) -> Result<BTreeMap<u16, String>> {
        let prefix = format!(
            "{}-",
            Self::lb_name(id).chars().take(26).collect::<String>()
        );
        let mut out = BTreeMap::new();
        let mut marker: Option<String> = None;
        loop {
            let mut params = vec![("PageSize".to_string(), "400".to_string())];
            if let Some(m) = &marker {
                params.push(("Marker".into(), m.clone()));
            }
            let body = self.elb("DescribeTargetGroups", params).await?;
            let doc = xml::parse("elasticloadbalancing DescribeTargetGroups", &body)?;
            for tg in xml::find_all(doc.root(), "TargetGroups")
                .flat_map(|t| t.children().filter(|c| c.is_element()))
            {
                let (Some(name), Some(arn)) = (
                    xml::child_text(tg, "TargetGroupName"),
                    xml::child_text(tg, "TargetGroupArn"),
                ) else {
                    continue;
                };
                if let Some(port) = name.strip_prefix(&prefix).and_then(|p| p.parse().ok()) {
                    out.insert(port, arn);
                }
            }
            marker = xml::text(doc.root(), "NextMarker").filter(|m| !m.is_empty());
            if marker.is_none() {
                return Ok(out);
            }
        }
    }

    /// Deletes the load balancer (its listeners go with it), then every target
    /// group of the distributor, also those that no listener used any more (a
    /// crash between creating one and its listener, an earlier failed delete).
    pub(super) async fn remove_nlb(&self, id: &str) -> Result<()> {
        if let Some(lb) = self.find_lb(id).await? {
            self.elb(
                "DeleteLoadBalancer",
                vec![("LoadBalancerArn".into(), lb.arn)],
            )
            .await?;
        }
        for arn in self.target_groups_of(id).await?.into_values() {
            self.delete_target_group_arn(&arn).await?;
        }
        Ok(())
    }

    fn save_nlb_runtime(&self, id: &str, lb: Option<&LoadBalancer>) -> Result<()> {
        let mut rt: DistributorRuntime = self.runtime(id);
        rt.nlb_addresses = lb
            .map(|lb| {
                lb.azs
                    .iter()
                    .map(|az| {
                        // Without an IP of its own in the AZ, the load balancer's
                        // zonal name, which resolves to its address there only.
                        let a = lb
                            .addresses
                            .get(az)
                            .cloned()
                            .unwrap_or_else(|| format!("{az}.{}", lb.dns_name));
                        (az.clone(), a)
                    })
                    .collect()
            })
            .unwrap_or_default();
        self.save_runtime(id, &rt)
    }
}

struct LoadBalancer {
    arn: String,
    dns_name: String,
    /// AZ -> its IP address there, when ELBv2 reports one.
    addresses: BTreeMap<String, String>,
    azs: BTreeSet<String>,
    /// AZ -> the subnet it is in.
    subnets: BTreeMap<String, String>,
}

/// The first load balancer of a `DescribeLoadBalancers` or
/// `CreateLoadBalancer` answer.
fn parse_lb(what: &str, body: &str) -> Result<Option<LoadBalancer>> {
    let doc = xml::parse(what, body)?;
    let Some(lb) =
        xml::find(doc.root(), "LoadBalancers").and_then(|l| l.children().find(|c| c.is_element()))
    else {
        return Ok(None);
    };
    let mut addresses = BTreeMap::new();
    let mut azs = BTreeSet::new();
    let mut subnets = BTreeMap::new();
    if let Some(zones) = xml::find(lb, "AvailabilityZones") {
        for z in zones.children().filter(|c| c.is_element()) {
            let Some(name) = xml::child_text(z, "ZoneName") else {
                continue;
            };
            if let Some(ip) = xml::text(z, "IpAddress").filter(|ip| !ip.is_empty()) {
                addresses.insert(name.clone(), ip);
            }
            if let Some(subnet) = xml::child_text(z, "SubnetId") {
                subnets.insert(name.clone(), subnet);
            }
            azs.insert(name);
        }
    }
    Ok(Some(LoadBalancer {
        arn: xml::child_text(lb, "LoadBalancerArn").unwrap_or_default(),
        dns_name: xml::child_text(lb, "DNSName").unwrap_or_default(),
        addresses,
        azs,
        subnets,
    }))
}

/// The targets of a `DescribeTargetHealth` answer that stay registered. One
/// being deregistered (`draining`, or `unavailable` while it goes) does not
/// count: wanted again, it is registered again.
fn registered_targets(root: xml::Node<'_, '_>) -> BTreeSet<String> {
    xml::find_all(root, "TargetHealthDescriptions")
        .flat_map(|d| d.children().filter(|c| c.is_element()))
        .filter(|d| {
            let state = xml::find(*d, "TargetHealth").and_then(|h| xml::child_text(h, "State"));
            !matches!(state.as_deref(), Some("draining") | Some("unavailable"))
        })
        .filter_map(|d| xml::find(d, "Target").and_then(|t| xml::child_text(t, "Id")))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draining_targets_are_not_registered() {
        let answer = r#"<DescribeTargetHealthResponse xmlns="http://elasticloadbalancing.amazonaws.com/doc/2015-12-01/"><DescribeTargetHealthResult><TargetHealthDescriptions>
<member><HealthCheckPort>80</HealthCheckPort><Target><Port>80</Port><Id>10.0.0.1</Id></Target><TargetHealth><State>healthy</State></TargetHealth></member>
<member><Target><Port>80</Port><Id>10.0.0.2</Id></Target><TargetHealth><State>draining</State><Reason>Target.DeregistrationInProgress</Reason></TargetHealth></member>
<member><Target><Port>80</Port><Id>10.0.0.3</Id></Target><TargetHealth><State>initial</State></TargetHealth></member>
</TargetHealthDescriptions></DescribeTargetHealthResult></DescribeTargetHealthResponse>"#;
        let doc = xml::parse("test", answer).unwrap();
        let ids: Vec<String> = registered_targets(doc.root()).into_iter().collect();
        assert_eq!(ids, ["10.0.0.1", "10.0.0.3"]);
    }
}
