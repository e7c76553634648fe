//! A group's `node` block: what differs between fleets (image, size, the
//! subnet of each AZ, security groups, identity, tags), one shape for every
//! cloud. What each field means on each cloud is in
//! docs/resources/autoscale_group.md; which cloud takes which is
//! [`node_fields`], checked at plan time by [`Findings::node_spec`].

use super::{CloudName, Finding, Findings, PathStep, DEFAULT_MEMORY_LIMIT_MB};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// The `node` block, validated. Every field but `memory_limit_mb` is optional;
/// a row stored before they existed (`{"memory_limit_mb":256}`) still reads,
/// and empty fields are not written, so such a row is written back the same.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeSpec {
    #[serde(default = "default_memory_limit_mb")]
    pub memory_limit_mb: i64,
    /// aws: an AMI id; azure: an image URN or resource id; gcp: an image.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
    /// aws: an instance type; azure: a VM size; gcp: a machine type.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size: Option<String>,
    /// AZ (zone) -> the subnet nodes of that AZ start in; empty: the cloud's default.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub subnets: BTreeMap<String, String>,
    /// aws: security group ids; azure: one network security group id; gcp:
    /// network tags. Empty: the driver makes the group's own.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub security_groups: Vec<String>,
    /// Where the engine reaches nodes from: the only sources of the node API
    /// port in the security group that lbscale makes. Empty: the network's range.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub management_cidrs: Vec<String>,
    /// aws: an instance profile name or ARN; azure: a user-assigned identity
    /// id; gcp: a service account email.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub identity: Option<String>,
    /// aws and azure: tags; gcp: labels.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub tags: BTreeMap<String, String>,
}

fn default_memory_limit_mb() -> i64 {
    DEFAULT_MEMORY_LIMIT_MB
}

impl Default for NodeSpec {
    fn default() -> Self {
        NodeSpec {
            memory_limit_mb: DEFAULT_MEMORY_LIMIT_MB,
            image: None,
            size: None,
            subnets: BTreeMap::new(),
            security_groups: Vec::new(),
            management_cidrs: Vec::new(),
            identity: None,
            tags: BTreeMap::new(),
        }
    }
}

impl NodeSpec {
    /// The subnet given for `az`, if any.
    pub fn subnet_for(&self, az: &str) -> Option<&str> {
        self.subnets.get(az).map(String::as_str)
    }

    /// Whether lbscale makes the group's security group (none is given).
    pub fn makes_security_group(&self) -> bool {
        self.security_groups.is_empty()
    }

    /// The fields this spec sets (beyond the always-present memory budget).
    pub fn set_fields(&self) -> Vec<NodeField> {
        let mut out = Vec::new();
        let mut add = |set: bool, f| {
            if set {
                out.push(f)
            }
        };
        add(self.image.is_some(), NodeField::Image);
        add(self.size.is_some(), NodeField::Size);
        add(!self.subnets.is_empty(), NodeField::Subnets);
        add(!self.security_groups.is_empty(), NodeField::SecurityGroups);
        add(
            !self.management_cidrs.is_empty(),
            NodeField::ManagementCidrs,
        );
        add(self.identity.is_some(), NodeField::Identity);
        add(!self.tags.is_empty(), NodeField::Tags);
        out
    }
}

/// A field of the `node` block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NodeField {
    MemoryLimitMb,
    Image,
    Size,
    Subnets,
    SecurityGroups,
    ManagementCidrs,
    Identity,
    Tags,
}

impl NodeField {
    /// Its attribute name in the `node` block.
    pub fn name(self) -> &'static str {
        match self {
            NodeField::MemoryLimitMb => "memory_limit_mb",
            NodeField::Image => "image",
            NodeField::Size => "size",
            NodeField::Subnets => "subnets",
            NodeField::SecurityGroups => "security_groups",
            NodeField::ManagementCidrs => "management_cidrs",
            NodeField::Identity => "identity",
            NodeField::Tags => "tags",
        }
    }
}

const ALL_FIELDS: &[NodeField] = &[
    NodeField::MemoryLimitMb,
    NodeField::Image,
    NodeField::Size,
    NodeField::Subnets,
    NodeField::SecurityGroups,
    NodeField::ManagementCidrs,
    NodeField::Identity,
    NodeField::Tags,
];

/// The fields of the `node` block that `cloud` takes. The `local` cloud's
/// nodes are processes on this machine: only their memory budget means
/// anything there.
pub fn node_fields(cloud: CloudName) -> &'static [NodeField] {
    match cloud {
        CloudName::Local => &[NodeField::MemoryLimitMb],
        CloudName::Aws | CloudName::Azure | CloudName::Gcp => ALL_FIELDS,
    }
}

/// The most tags a user may give on aws: EC2 takes 50 per resource, and
/// lbscale puts its own (`Name`, `lbscale:node-id`, `lbscale:group-id`, ...).
pub const AWS_MAX_USER_TAGS: usize = 40;
/// EC2 takes up to 5 security groups per network interface.
pub const AWS_MAX_SECURITY_GROUPS: usize = 5;

impl Findings {
    /// The `node` block's rules for a group on `cloud` in `zones` (`None`:
    /// not known yet, the rules that need it wait): fields the cloud does not
    /// take, a subnet per AZ, and each value's shape on that cloud. Findings
    /// point at `node[0].<field>`.
    pub fn node_spec(
        &mut self,
        cloud: Option<CloudName>,
        zones: Option<&[String]>,
        node: &NodeSpec,
    ) {
        let at = |field: NodeField| {
            vec![
                PathStep::Attr("node"),
                PathStep::Index(0),
                PathStep::Attr(field.name()),
            ]
        };
        let supported = cloud.map_or(ALL_FIELDS, node_fields);
        for field in node.set_fields() {
            if let (Some(cloud), false) = (cloud, supported.contains(&field)) {
                let takes: Vec<&str> = supported.iter().map(|f| f.name()).collect();
                self.0.push(Finding::error(
                    at(field),
                    format!("node.{} not supported on {cloud}", field.name()),
                    format!(
                        "node.{} is not supported on cloud \"{cloud}\"; the {cloud} cloud takes {} in the node block.",
                        field.name(),
                        takes.join(", ")
                    ),
                ));
            }
        }
        if !(32..=65536).contains(&node.memory_limit_mb) {
            self.0.push(Finding::error(
                at(NodeField::MemoryLimitMb),
                "Invalid memory_limit_mb",
                format!(
                    "node.memory_limit_mb must be between 32 and 65536, got {}.",
                    node.memory_limit_mb
                ),
            ));
        }
        if !supported.contains(&NodeField::Subnets) {
            return;
        }
        if let (Some(zones), false) = (zones, node.subnets.is_empty()) {
            for az in node.subnets.keys() {
                if !zones.contains(az) {
                    self.0.push(Finding::error(
                        at(NodeField::Subnets),
                        "Subnet for an undeclared availability zone",
                        format!(
                            "node.subnets gives a subnet for {az:?}, which is not in availability_zones ({}).",
                            quoted(zones)
                        ),
                    ));
                }
            }
            for az in zones {
                if !node.subnets.contains_key(az) {
                    self.0.push(Finding::error(
                        at(NodeField::Subnets),
                        "Missing subnet",
                        format!(
                            "node.subnets must give a subnet for every availability zone when it is given: {az:?} has none."
                        ),
                    ));
                }
            }
        }
        if !node.management_cidrs.is_empty() && !node.security_groups.is_empty() {
            self.0.push(Finding::error(
                at(NodeField::ManagementCidrs),
                "management_cidrs with security_groups",
                "node.management_cidrs opens the node API port in the security group that lbscale makes, and lbscale makes none when node.security_groups is given: open the port in those groups instead, or leave security_groups out.",
            ));
        }
        for (i, c) in node.management_cidrs.iter().enumerate() {
            if let Err(why) = check_cidr(c) {
                self.0.push(Finding::error(
                    indexed(at(NodeField::ManagementCidrs), i),
                    "Invalid management_cidrs",
                    format!("node.management_cidrs[{i}] must be an IPv4 or IPv6 CIDR such as \"10.0.0.0/16\" ({why}), got {c:?}."),
                ));
            }
        }
        for (field, value) in [
            (NodeField::Image, &node.image),
            (NodeField::Size, &node.size),
        ] {
            if value.as_deref().is_some_and(|v| v.trim().is_empty()) {
                self.0.push(Finding::error(
                    at(field),
                    format!("Invalid {}", field.name()),
                    format!(
                        "node.{} must not be empty; leave it out for the default.",
                        field.name()
                    ),
                ));
            }
        }
        match cloud {
            Some(CloudName::Aws) => self.aws_node(node, &at),
            Some(CloudName::Azure) => self.azure_node(node, &at),
            Some(CloudName::Gcp) => self.gcp_node(node, &at),
            Some(CloudName::Local) | None => {}
        }
    }

    fn aws_node(&mut self, node: &NodeSpec, at: &dyn Fn(NodeField) -> Vec<PathStep>) {
        if let Some(image) = &node.image {
            if !image.starts_with("ami-") {
                self.shape(
                    at(NodeField::Image),
                    "image",
                    "an AMI id such as \"ami-0123456789abcdef0\"",
                    image,
                    "aws",
                );
            }
        }
        for (az, s) in &node.subnets {
            if !s.starts_with("subnet-") {
                self.0.push(Finding::error(
                    at(NodeField::Subnets),
                    "Invalid subnets",
                    format!("node.subnets[{az:?}] on aws must be a subnet id such as \"subnet-0123456789abcdef0\", got {s:?}."),
                ));
            }
        }
        if node.security_groups.len() > AWS_MAX_SECURITY_GROUPS {
            self.0.push(Finding::error(
                at(NodeField::SecurityGroups),
                "Too many security_groups",
                format!("node.security_groups on aws takes at most {AWS_MAX_SECURITY_GROUPS} security group ids (EC2's limit per network interface), got {}.", node.security_groups.len()),
            ));
        }
        for (i, g) in node.security_groups.iter().enumerate() {
            if !g.starts_with("sg-") {
                self.shape(
                    indexed(at(NodeField::SecurityGroups), i),
                    &format!("security_groups[{i}]"),
                    "a security group id such as \"sg-0123456789abcdef0\"",
                    g,
                    "aws",
                );
            }
        }
        if let Some(p) = &node.identity {
            let arn = p.starts_with("arn:") && p.contains(":instance-profile/");
            let name = !p.is_empty()
                && p.len() <= 128
                && p.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "+=,.@_-".contains(c));
            if !arn && !name {
                self.shape(at(NodeField::Identity), "identity", "an IAM instance profile name (letters, digits and +=,.@_-) or its ARN (arn:aws:iam::ACCOUNT:instance-profile/NAME)", p, "aws");
            }
        }
        if node.tags.len() > AWS_MAX_USER_TAGS {
            self.0.push(Finding::error(
                at(NodeField::Tags),
                "Too many tags",
                format!("node.tags on aws takes at most {AWS_MAX_USER_TAGS} tags (EC2 takes 50 and lbscale puts its own), got {}.", node.tags.len()),
            ));
        }
        for (k, v) in &node.tags {
            let lower = k.to_ascii_lowercase();
            let why = if k.is_empty() || k.chars().count() > 128 {
                Some("a key is 1 to 128 characters")
            } else if lower.starts_with("aws:") {
                Some("keys starting with \"aws:\" are AWS's own")
            } else if lower.starts_with("lbscale:") || k == "Name" {
                Some("\"Name\" and keys starting with \"lbscale:\" are lbscale's own")
            } else if v.chars().count() > 256 {
                Some("a value is at most 256 characters")
            } else {
                None
            };
            if let Some(why) = why {
                self.0.push(Finding::error(
                    at(NodeField::Tags),
                    "Invalid tags",
                    format!("node.tags[{k:?}] on aws: {why}."),
                ));
            }
        }
    }

    fn azure_node(&mut self, node: &NodeSpec, at: &dyn Fn(NodeField) -> Vec<PathStep>) {
        if let Some(image) = &node.image {
            let urn = image.split(':').count() == 4 && image.split(':').all(|p| !p.is_empty());
            if !urn && !image.starts_with("/subscriptions/") {
                self.shape(at(NodeField::Image), "image", "an image URN (publisher:offer:sku:version) or an image resource id (/subscriptions/...)", image, "azure");
            }
        }
        for (az, s) in &node.subnets {
            if !(s.starts_with("/subscriptions/") && s.contains("/subnets/")) {
                self.0.push(Finding::error(
                    at(NodeField::Subnets),
                    "Invalid subnets",
                    format!("node.subnets[{az:?}] on azure must be a subnet resource id (/subscriptions/.../virtualNetworks/V/subnets/S), got {s:?}."),
                ));
            }
        }
        if node.security_groups.len() > 1 {
            self.0.push(Finding::error(
                at(NodeField::SecurityGroups),
                "Too many security_groups",
                format!("node.security_groups on azure takes one network security group id (a network interface has one), got {}.", node.security_groups.len()),
            ));
        }
        for (i, g) in node.security_groups.iter().enumerate() {
            if !g.starts_with("/subscriptions/") {
                self.shape(indexed(at(NodeField::SecurityGroups), i), &format!("security_groups[{i}]"), "a network security group resource id (/subscriptions/.../networkSecurityGroups/N)", g, "azure");
            }
        }
        if let Some(id) = &node.identity {
            if !id.starts_with("/subscriptions/") {
                self.shape(at(NodeField::Identity), "identity", "a user-assigned managed identity resource id (/subscriptions/.../userAssignedIdentities/N)", id, "azure");
            }
        }
    }

    fn gcp_node(&mut self, node: &NodeSpec, at: &dyn Fn(NodeField) -> Vec<PathStep>) {
        for (i, t) in node.security_groups.iter().enumerate() {
            if !gcp_name(t) {
                self.shape(
                    indexed(at(NodeField::SecurityGroups), i),
                    &format!("security_groups[{i}]"),
                    "a network tag (1 to 63 of a-z, 0-9 and -, starting with a letter)",
                    t,
                    "gcp",
                );
            }
        }
        if let Some(sa) = &node.identity {
            if !sa.contains('@') {
                self.shape(
                    at(NodeField::Identity),
                    "identity",
                    "a service account email",
                    sa,
                    "gcp",
                );
            }
        }
        for (k, v) in &node.tags {
            let label = |s: &str| {
                s.len() <= 63
                    && s.chars().all(|c| {
                        c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_' || c == '-'
                    })
            };
            let key_ok = label(k) && k.chars().next().is_some_and(|c| c.is_ascii_lowercase());
            if !key_ok || !label(v) {
                self.0.push(Finding::error(
                    at(NodeField::Tags),
                    "Invalid tags",
                    format!("node.tags[{k:?}] on gcp is a label: keys and values are at most 63 of a-z, 0-9, _ and -, and a key starts with a letter; got {k:?} = {v:?}."),
                ));
            }
        }
    }

    fn shape(&mut self, path: Vec<PathStep>, field: &str, allowed: &str, got: &str, cloud: &str) {
        self.0.push(Finding::error(
            path,
            format!("Invalid {}", field.split('[').next().unwrap_or(field)),
            format!("node.{field} on {cloud} must be {allowed}, got {got:?}."),
        ));
    }
}

fn indexed(mut path: Vec<PathStep>, i: usize) -> Vec<PathStep> {
    path.push(PathStep::Index(i));
    path
}

fn quoted(zones: &[String]) -> String {
    zones
        .iter()
        .map(|z| format!("{z:?}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// A GCE resource name (a network tag): `[a-z]([-a-z0-9]{0,61}[a-z0-9])?`.
fn gcp_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.starts_with(|c: char| c.is_ascii_lowercase())
        && !s.ends_with('-')
        && s.chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
}

/// An IPv4 or IPv6 network in CIDR notation.
pub fn check_cidr(s: &str) -> Result<(), &'static str> {
    let (ip, len) = s.split_once('/').ok_or("no prefix length")?;
    let ip: std::net::IpAddr = ip.parse().map_err(|_| "not an IP address")?;
    let len: u8 = len
        .parse()
        .map_err(|_| "the prefix length is not a number")?;
    let max = if ip.is_ipv4() { 32 } else { 128 };
    if len > max {
        return Err("the prefix length is too long");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn zones(z: &[&str]) -> Vec<String> {
        z.iter().map(|s| s.to_string()).collect()
    }

    fn details(cloud: CloudName, z: &[&str], node: &NodeSpec) -> Vec<(String, String)> {
        let mut f = Findings::default();
        f.node_spec(Some(cloud), Some(&zones(z)), node);
        f.0.iter()
            .map(|x| {
                let path = x
                    .path
                    .iter()
                    .map(|p| match p {
                        PathStep::Attr(a) => a.to_string(),
                        PathStep::Index(i) => i.to_string(),
                    })
                    .collect::<Vec<_>>()
                    .join(".");
                (path, x.detail.clone())
            })
            .collect()
    }

    #[test]
    fn an_old_stored_row_reads_and_is_written_back_the_same() {
        let old = r#"{"memory_limit_mb":512}"#;
        let n: NodeSpec = serde_json::from_str(old).unwrap();
        assert_eq!(n.memory_limit_mb, 512);
        assert!(n.set_fields().is_empty());
        assert_eq!(serde_json::to_string(&n).unwrap(), old);
        let full = NodeSpec {
            image: Some("ami-1".into()),
            subnets: BTreeMap::from([("a".into(), "subnet-1".into())]),
            tags: BTreeMap::from([("team".into(), "web".into())]),
            ..NodeSpec::default()
        };
        let back: NodeSpec = serde_json::from_str(&serde_json::to_string(&full).unwrap()).unwrap();
        assert_eq!(back, full);
    }

    #[test]
    fn local_takes_only_the_memory_budget() {
        let n = NodeSpec {
            image: Some("ami-1".into()),
            tags: BTreeMap::from([("team".into(), "web".into())]),
            ..NodeSpec::default()
        };
        let d = details(CloudName::Local, &["az1"], &n);
        assert_eq!(d.len(), 2, "{d:?}");
        assert_eq!(d[0].0, "node.0.image");
        assert_eq!(
            d[0].1,
            "node.image is not supported on cloud \"local\"; the local cloud takes memory_limit_mb in the node block."
        );
        assert_eq!(d[1].0, "node.0.tags");
        assert!(details(CloudName::Local, &["az1"], &NodeSpec::default()).is_empty());
    }

    #[test]
    fn subnets_cover_exactly_the_zones() {
        let n = NodeSpec {
            subnets: BTreeMap::from([
                ("us-east-1a".into(), "subnet-a".into()),
                ("us-east-1c".into(), "subnet-c".into()),
            ]),
            ..NodeSpec::default()
        };
        let d = details(CloudName::Aws, &["us-east-1a", "us-east-1b"], &n);
        assert_eq!(d.len(), 2, "{d:?}");
        assert!(d.iter().all(|(p, _)| p == "node.0.subnets"));
        assert!(d[0].1.contains("\"us-east-1c\", which is not in availability_zones (\"us-east-1a\", \"us-east-1b\")"), "{}", d[0].1);
        assert!(d[1].1.contains("\"us-east-1b\" has none"), "{}", d[1].1);
        // Zones not known yet: only the shape is checked.
        let mut f = Findings::default();
        f.node_spec(Some(CloudName::Aws), None, &n);
        assert!(f.0.is_empty());
    }

    #[test]
    fn aws_shapes() {
        let n = NodeSpec {
            image: Some("img-1".into()),
            subnets: BTreeMap::from([("a".into(), "net-1".into())]),
            security_groups: vec!["sg-1".into(), "default".into()],
            management_cidrs: vec!["10.0.0.0/33".into()],
            identity: Some("arn:aws:iam::1:role/x".into()),
            tags: BTreeMap::from([
                ("aws:x".into(), "1".into()),
                ("lbscale:node-id".into(), "2".into()),
            ]),
            ..NodeSpec::default()
        };
        let d = details(CloudName::Aws, &["a"], &n);
        let paths: Vec<&str> = d.iter().map(|(p, _)| p.as_str()).collect();
        assert_eq!(
            paths,
            [
                "node.0.management_cidrs",
                "node.0.management_cidrs.0",
                "node.0.image",
                "node.0.subnets",
                "node.0.security_groups.1",
                "node.0.identity",
                "node.0.tags",
                "node.0.tags"
            ],
            "{d:#?}"
        );
        assert!(d[1].1.contains("the prefix length is too long"));
        assert!(d[2].1.starts_with("node.image on aws must be an AMI id"));
        let ok = NodeSpec {
            image: Some("ami-1".into()),
            size: Some("t3.small".into()),
            subnets: BTreeMap::from([("a".into(), "subnet-1".into())]),
            management_cidrs: vec!["10.0.0.0/16".into(), "2001:db8::/32".into()],
            identity: Some("lbscale-node".into()),
            tags: BTreeMap::from([("team".into(), "web".into())]),
            ..NodeSpec::default()
        };
        assert!(details(CloudName::Aws, &["a"], &ok).is_empty());
        let arn = NodeSpec {
            identity: Some("arn:aws:iam::123456789012:instance-profile/p".into()),
            security_groups: (0..6).map(|i| format!("sg-{i}")).collect(),
            ..NodeSpec::default()
        };
        let d = details(CloudName::Aws, &["a"], &arn);
        assert_eq!(d.len(), 1, "{d:?}");
        assert!(d[0].1.contains("at most 5 security group ids"));
    }

    #[test]
    fn azure_and_gcp_shapes() {
        let n = NodeSpec {
            image: Some("Canonical:ubuntu:22_04-lts:latest".into()),
            security_groups: vec![
                "/subscriptions/s/nsg1".into(),
                "/subscriptions/s/nsg2".into(),
            ],
            identity: Some("me@example.com".into()),
            ..NodeSpec::default()
        };
        let d = details(CloudName::Azure, &["1"], &n);
        assert_eq!(d.len(), 2, "{d:?}");
        assert!(d[0].1.contains("takes one network security group id"));
        assert!(d[1]
            .1
            .starts_with("node.identity on azure must be a user-assigned managed identity"));
        let g = NodeSpec {
            security_groups: vec!["web-fleet".into(), "Web".into()],
            tags: BTreeMap::from([("Team".into(), "web".into()), ("team".into(), "web".into())]),
            identity: Some("nodes@p.iam.gserviceaccount.com".into()),
            ..NodeSpec::default()
        };
        let d = details(CloudName::Gcp, &["us-central1-a"], &g);
        assert_eq!(d.len(), 2, "{d:?}");
        assert_eq!(d[0].0, "node.0.security_groups.1");
        assert!(d[1].1.starts_with("node.tags[\"Team\"] on gcp is a label"));
    }
}
