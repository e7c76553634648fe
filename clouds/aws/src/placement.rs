//! Where and as what a node instance starts: the group's `node` block read
//! for EC2 (docs/resources/autoscale_group.md), with the provider's `aws`
//! block as the fallback for the image and the instance type.
//!
//! - `image` is the AMI, `size` the instance type;
//! - `subnets[az]` is the instance's subnet (RunInstances `SubnetId`); an AZ
//!   without one: the AZ's default subnet (`Placement.AvailabilityZone`);
//! - `security_groups` are the instance's groups; without them, the one that
//!   lbscale makes for the group ([`crate::security_group`]);
//! - `identity` is the IAM instance profile, by name or ARN;
//! - `tags` go on the instance and its volumes, after lbscale's own.

use super::{xml, AwsCloud};
use lbscale_engine::cloud::{CloudError, ProvisionRequest, Result};
use lbscale_engine::model::NodeSpec;
use std::collections::BTreeSet;

/// The tags that lbscale puts on a node instance (and its volumes).
pub(crate) fn lbscale_tags(req: &ProvisionRequest) -> Vec<(String, String)> {
    vec![
        ("Name".into(), format!("lbscale-{}", req.node_id)),
        ("lbscale:node-id".into(), req.node_id.clone()),
        ("lbscale:group-id".into(), req.group_id.clone()),
        ("lbscale:group".into(), req.group_name.clone()),
    ]
}

impl AwsCloud {
    /// The image of nodes of `node`: the block's, else the provider's.
    pub(crate) fn image_for(&self, node: &NodeSpec) -> Option<String> {
        node.image.clone().or_else(|| self.image_id.clone())
    }

    /// RunInstances' parameters for `req`, but its client token and user data.
    pub(crate) async fn placement_params(
        &self,
        req: &ProvisionRequest,
    ) -> Result<Vec<(String, String)>> {
        let node = &req.node;
        let image = self.image_for(node).ok_or_else(|| {
            CloudError::Failed(
                "no image for AWS nodes: set `image` in the group's node block, or `image_id` in the provider's aws block (or LBSCALE_AWS_IMAGE_ID)".into(),
            )
        })?;
        let mut params: Vec<(String, String)> = vec![
            ("ImageId".into(), image),
            (
                "InstanceType".into(),
                node.size
                    .clone()
                    .unwrap_or_else(|| self.instance_type.clone()),
            ),
            ("MinCount".into(), "1".into()),
            ("MaxCount".into(), "1".into()),
        ];
        match node.subnet_for(&req.az) {
            // The subnet is in one AZ: a placement beside it could only disagree.
            Some(subnet) => params.push(("SubnetId".into(), subnet.to_string())),
            None => params.push(("Placement.AvailabilityZone".into(), req.az.clone())),
        }
        let groups = if node.makes_security_group() {
            vec![self.made_security_group(req).await?]
        } else {
            node.security_groups.clone()
        };
        for (i, g) in groups.iter().enumerate() {
            params.push((format!("SecurityGroupId.{}", i + 1), g.clone()));
        }
        if let Some(profile) = &node.identity {
            let key = if profile.starts_with("arn:") {
                "IamInstanceProfile.Arn"
            } else {
                "IamInstanceProfile.Name"
            };
            params.push((key.into(), profile.clone()));
        }
        let mut tags = lbscale_tags(req);
        tags.extend(node.tags.iter().map(|(k, v)| (k.clone(), v.clone())));
        for (spec, resource) in ["instance", "volume"].iter().enumerate() {
            let n = spec + 1;
            params.push((
                format!("TagSpecification.{n}.ResourceType"),
                resource.to_string(),
            ));
            for (i, (k, v)) in tags.iter().enumerate() {
                params.push((format!("TagSpecification.{n}.Tag.{}.Key", i + 1), k.clone()));
                params.push((
                    format!("TagSpecification.{n}.Tag.{}.Value", i + 1),
                    v.clone(),
                ));
            }
        }
        Ok(params)
    }

    /// The VPC of a group's nodes: that of its subnets (all in one), else the
    /// region's default VPC.
    pub(crate) async fn vpc_of(&self, group_id: &str, node: &NodeSpec) -> Result<String> {
        if node.subnets.is_empty() {
            return self.default_vpc().await;
        }
        let mut params = Vec::new();
        for (i, s) in node.subnets.values().enumerate() {
            params.push((format!("SubnetId.{}", i + 1), s.clone()));
        }
        let body = self.ec2("DescribeSubnets", params).await?;
        let doc = xml::parse("ec2 DescribeSubnets", &body)?;
        let vpcs: BTreeSet<String> = xml::find_all(doc.root(), "subnetSet")
            .flat_map(|s| s.children().filter(|c| c.is_element()))
            .filter_map(|s| xml::child_text(s, "vpcId"))
            .collect();
        match vpcs.len() {
            1 => Ok(vpcs.into_iter().next().unwrap_or_default()),
            0 => Err(CloudError::Failed(format!(
                "AWS ec2 DescribeSubnets: none of the subnets of group {group_id} ({}) was found",
                node.subnets.values().cloned().collect::<Vec<_>>().join(", ")
            ))),
            _ => Err(CloudError::Failed(format!(
                "the subnets of group {group_id} are in more than one VPC ({}): node.subnets must be subnets of one VPC",
                vpcs.into_iter().collect::<Vec<_>>().join(", ")
            ))),
        }
    }

    /// The region's default VPC.
    pub(crate) async fn default_vpc(&self) -> Result<String> {
        let body = self
            .ec2(
                "DescribeVpcs",
                vec![
                    ("Filter.1.Name".into(), "isDefault".into()),
                    ("Filter.1.Value.1".into(), "true".into()),
                ],
            )
            .await?;
        let doc = xml::parse("ec2 DescribeVpcs", &body)?;
        let vpc = xml::find_all(doc.root(), "vpcSet")
            .flat_map(|s| s.children().filter(|c| c.is_element()))
            .find_map(|v| xml::child_text(v, "vpcId"))
            .ok_or_else(|| {
                CloudError::Failed(
                    "AWS ec2 DescribeVpcs: the region has no default VPC: give the group's node.subnets (and node.security_groups or node.management_cidrs)".into(),
                )
            });
        vpc
    }

    /// The IPv4 and IPv6 CIDR blocks of `vpc`.
    pub(crate) async fn vpc_cidrs(&self, vpc: &str) -> Result<Vec<String>> {
        let body = self
            .ec2("DescribeVpcs", vec![("VpcId.1".into(), vpc.to_string())])
            .await?;
        let doc = xml::parse("ec2 DescribeVpcs", &body)?;
        let mut cidrs: BTreeSet<String> = BTreeSet::new();
        for v in xml::find_all(doc.root(), "vpcSet")
            .flat_map(|s| s.children().filter(|c| c.is_element()))
        {
            cidrs.extend(xml::child_text(v, "cidrBlock"));
            for set in ["cidrBlockAssociationSet", "ipv6CidrBlockAssociationSet"] {
                for a in xml::find_all(v, set).flat_map(|s| s.children().filter(|c| c.is_element()))
                {
                    let state = xml::find(a, "cidrBlockState")
                        .or_else(|| xml::find(a, "ipv6CidrBlockState"))
                        .and_then(|s| xml::child_text(s, "state"));
                    if state.as_deref().is_some_and(|s| s != "associated") {
                        continue;
                    }
                    cidrs.extend(xml::child_text(a, "cidrBlock"));
                    cidrs.extend(xml::child_text(a, "ipv6CidrBlock"));
                }
            }
        }
        if cidrs.is_empty() {
            return Err(CloudError::Failed(format!(
                "AWS ec2 DescribeVpcs: no CIDR block of VPC {vpc} in the answer"
            )));
        }
        Ok(cidrs.into_iter().collect())
    }
}
