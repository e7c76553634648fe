//! Every validation rule of the schema, through real Terraform: the diagnostic's
//! text says what is allowed, and it points at the attribute's line.

use lbscale_acceptance::*;

const BASE: &str = r#"
resource "lbscale_traffic_distributor" "d" {
  name  = "val-nlb"
  cloud = "local"
  mode  = "nlb"
}

resource "lbscale_autoscale_group" "g" {
  name                   = "val"
  cloud                  = "local"
  availability_zones     = ["az1", "az2"]
  traffic_distributor_id = lbscale_traffic_distributor.d.id
  threshold {
    metric = "cpu"
    min    = 10
    max    = 80
  }
}

resource "lbscale_se_group" "s" {
  name               = "val-se"
  autoscale_group_id = lbscale_autoscale_group.g.id
}
"#;

/// (marker on the offending line, text the diagnostic must contain)
type Rule = (&'static str, &'static str);

fn check(ws: &Workspace, out: &Output, rules: &[Rule], severity: &str) {
    let diags = diagnostics(&out.all());
    assert!(
        !out.all().contains("stack backtrace") && !out.all().contains("panicked"),
        "{}",
        out.all()
    );
    for (marker, text) in rules {
        let line = line_of(ws, marker);
        let found = diags
            .iter()
            .find(|d| d.severity == severity && d.text.contains(text));
        let d =
            found.unwrap_or_else(|| panic!("no {severity} containing {text:?}; got:\n{diags:#?}"));
        assert_eq!(
            d.line,
            Some(line),
            "{text:?} should point at line {line} ({marker:?}): {d:?}"
        );
    }
}

#[test]
fn schema_rules_are_refused_at_validate_with_the_attribute() {
    let ws = Workspace::new("validate", 114);
    ws.write(
        r#"
resource "lbscale_traffic_distributor" "bad" {
  name  = "bad"
  cloud = "openstack" # cloud
  mode  = "anycast"   # mode
  ttl   = "5 minutes" # ttl
}

resource "lbscale_traffic_distributor" "nodomain" {
  name  = "nodomain"
  cloud = "local"
  mode  = "dns"       # nodomain
}

resource "lbscale_autoscale_group" "g" {
  name                   = "g"
  cloud                  = "local"
  availability_zones     = ["az1"]
  traffic_distributor_id = "td-x"
  min_nodes              = 5 # min_nodes
  max_nodes              = 2
  stats_interval         = "1m"
  watch_time             = "90s" # watch_time
  threshold {
    metric = "memory"
    min    = 90 # memory min
    max    = 80
  }
  threshold {
    metric = "cpu"
    min    = 10
    max    = 20
  }
  threshold {
    metric = "cpu" # duplicate
    min    = 10
    max    = 20
  }
  threshold {
    metric = "disk" # metric
    min    = 1
    max    = 2
  }
}

# Bounds are checked as written, not clamped first.
resource "lbscale_autoscale_group" "negative_min" {
  name                   = "negative-min"
  cloud                  = "local"
  availability_zones     = ["az1"]
  traffic_distributor_id = "td-x"
  min_nodes              = -1 # negative min
  threshold {
    metric = "cpu"
    min    = 1
    max    = 2
  }
}

resource "lbscale_autoscale_group" "negative_max" {
  name                   = "negative-max"
  cloud                  = "local"
  availability_zones     = ["az1"]
  traffic_distributor_id = "td-x"
  max_nodes              = -1 # negative max
  threshold {
    metric = "cpu"
    min    = 1
    max    = 2
  }
}

resource "lbscale_se_group" "s" {
  name                    = "s"
  autoscale_group_id      = "asg-x"
  scaling_mode            = "anycast" # scaling_mode
  min_scaleout_per_vs     = 5 # scaleout
  max_scaleout_per_vs     = 2
  primary_forwarding_cost = 1.5 # cost
  se_tunnel_mode          = 3 # tunnel
}

resource "lbscale_vserver" "v" {
  name         = "v"
  se_group_id  = "seg-x"
  service_type = "SCTP" # service_type
  port         = 70000 # port
  lb_method    = "RANDOM" # lb_method
  persistence  = "SESSION" # persistence
  service {
    name    = "a"
    address = "127.0.0.1"
    port    = 8080
    weight  = 0 # weight
  }
  slow_start {
    new_service_request = 5
    unit                = "PER_MINUTE" # unit
    increment_interval  = 5000 # interval
  }
}

# Every other number, negative: the message shows it as written.
resource "lbscale_se_group" "negative" {
  name                = "negative-se"
  autoscale_group_id  = "asg-x"
  min_scaleout_per_vs = -2 # negative scaleout
  se_tunnel_mode      = -1 # negative tunnel
}

resource "lbscale_vserver" "negative" {
  name         = "negative"
  se_group_id  = "seg-x"
  service_type = "TCP"
  port         = -1 # negative port
  service {
    name    = "a"
    address = "127.0.0.1"
    port    = -8080 # negative service port
    weight  = -3 # negative weight
  }
  slow_start {
    new_service_request = -5 # negative request
    increment_interval  = -10 # negative interval
  }
}

# Whole numbers given a fraction: refused by name, showing it.
resource "lbscale_autoscale_group" "fractional" {
  name                   = "fractional"
  cloud                  = "local"
  availability_zones     = ["az1"]
  traffic_distributor_id = "td-x"
  min_nodes              = 1.5 # fractional min
  threshold {
    metric = "cpu"
    min    = 1
    max    = 2
  }
  node {
    memory_limit_mb = 100.5 # fractional memory
  }
}

resource "lbscale_se_group" "fractional" {
  name               = "fractional-se"
  autoscale_group_id = "asg-x"
  se_tunnel_mode     = 0.5 # fractional tunnel
}

resource "lbscale_vserver" "fractional" {
  name         = "fractional"
  se_group_id  = "seg-x"
  service_type = "TCP"
  port         = 80.5 # fractional port
  service {
    name    = "a"
    address = "127.0.0.1"
    port    = 8080
    weight  = 1.5 # fractional weight
  }
}

resource "lbscale_vserver" "cookie" {
  name         = "cookie"
  se_group_id  = "seg-x"
  service_type = "TCP"
  port         = 8443
  persistence  = "COOKIE" # cookie
}
"#,
    );
    // RUST_BACKTRACE=1 as on many users' machines: diagnostics must stay clean.
    let out = ws.tf_env(&["validate", "-no-color"], &[("RUST_BACKTRACE", "1")]);
    assert_eq!(out.code, 1, "{}", out.all());
    check(
        &ws,
        &out,
        &[
            ("# cloud", "cloud must be one of \"local\", \"aws\", \"azure\", \"gcp\", got \"openstack\""),
            ("# mode", "mode must be one of \"dns\", \"nlb\", got \"anycast\""),
            ("# ttl", "ttl must be a duration such as \"30s\", \"2m\" or \"1h30m\""),
            ("resource \"lbscale_traffic_distributor\" \"nodomain\"", "domain is required with mode = \"dns\""),
            ("max_nodes              = 2", "max_nodes: must be at least min_nodes (5), got 2"),
            ("# negative min", "min_nodes: must be at least 1, got -1."),
            ("# negative max", "max_nodes: must be at least min_nodes (1), got -1."),
            ("# negative scaleout", "min_scaleout_per_vs must be between 1 and 64, got -2."),
            ("# negative tunnel", "se_tunnel_mode must be between 0 and 2, got -1."),
            ("# negative port", "port must be between 1 and 65535, got -1."),
            ("# negative service port", "service.port must be between 1 and 65535, got -8080."),
            ("# negative weight", "service.weight must be between 1 and 100, got -3."),
            ("# negative request", "slow_start.new_service_request must be 0 or more, got -5."),
            ("# negative interval", "slow_start.increment_interval must be between 0 and 3600, got -10."),
            ("# fractional min", "min_nodes must be a whole number, got 1.5."),
            ("# fractional memory", "node.memory_limit_mb must be a whole number, got 100.5."),
            ("# fractional tunnel", "se_tunnel_mode must be a whole number, got 0.5."),
            ("# fractional port", "port must be a whole number, got 80.5."),
            ("# fractional weight", "service.weight must be a whole number, got 1.5."),
            ("# watch_time", "watch_time: must be a positive multiple of stats_interval (60s), got 90s"),
            ("# memory min", "threshold[0].min: must be below max (80), got 90"),
            ("# duplicate", "threshold[2].metric: must name a metric that no other threshold block sets (cpu is set by"),
            ("# metric", "threshold[3].metric: must be one of cpu, memory, throughput, got \"disk\""),
            ("# scaling_mode", "scaling_mode must be one of \"native\", \"bgp\", \"native_and_bgp\""),
            ("# scaleout", "min_scaleout_per_vs must be less than or equal to max_scaleout_per_vs"),
            ("# cost", "primary_forwarding_cost must be between 0 and 1 (both excluded), got 1.5"),
            ("# tunnel", "se_tunnel_mode must be between 0 and 2, got 3"),
            ("# service_type", "service_type must be one of \"HTTP\", \"TCP\", \"UDP\", got \"SCTP\""),
            ("# port", "port must be between 1 and 65535, got 70000"),
            ("# lb_method", "lb_method must be one of \"ROUNDROBIN\", \"LEASTCONNECTION\""),
            ("# persistence", "persistence must be one of \"NONE\", \"COOKIE\", \"SOURCEIP\", got \"SESSION\""),
            ("# cookie", "COOKIE persistence needs an HTTP vserver: a TCP vserver has no HTTP headers"),
            ("# weight", "service.weight must be between 1 and 100, got 0"),
            ("# unit", "slow_start.unit must be one of \"PER_SECOND\", \"PERCENT\", got \"PER_MINUTE\""),
            ("# interval", "slow_start.increment_interval must be between 0 and 3600, got 5000"),
        ],
        "error",
    );
}

#[test]
fn placement_rules_are_checked_at_plan_against_the_store() {
    let mut ws = Workspace::new("placement", 115);
    ws.write(BASE);
    ws.apply();

    ws.write(&format!(
        r#"{BASE}
resource "lbscale_vserver" "udp" {{
  name         = "dns-app"
  se_group_id  = lbscale_se_group.s.id
  service_type = "UDP" # udp
  port         = 5353
  service {{
    name    = "a"
    address = "127.0.0.1"
    port    = 53
  }}
}}

resource "lbscale_vserver" "sticky" {{
  name         = "sticky"
  se_group_id  = lbscale_se_group.s.id
  service_type = "HTTP"
  port         = 8080
  persistence  = "SOURCEIP" # sourceip
  service {{
    name    = "a"
    address = "127.0.0.1"
    port    = 8081
  }}
}}

data "lbscale_scaling_simulation" "negative" {{
  availability_zones = ["az1"]
  min_nodes          = -1 # simulation min
  watch_time         = "3m"
  cooldown           = "10m"
  drain_timeout      = "1m"
  distributor        = "nlb"
  threshold {{
    metric = "cpu"
    min    = 10
    max    = 70
  }}
  samples = []
  until   = 60
}}

resource "lbscale_traffic_distributor" "on_gcp" {{
  name   = "on-gcp"
  cloud  = "gcp" # gcp distributor
  mode   = "dns"
  domain = "gcp.lbscale.test"
}}

resource "lbscale_autoscale_group" "other" {{
  name                   = "other"
  cloud                  = "gcp" # cloud
  availability_zones     = ["az1"]
  traffic_distributor_id = lbscale_traffic_distributor.d.id
  threshold {{
    metric = "memory"
    min    = 10
    max    = 80
  }}
}}
"#
    ));
    let out = ws.tf_env(&["plan", "-no-color"], &[("RUST_BACKTRACE", "1")]);
    assert_eq!(out.code, 1, "{}", out.all());
    check(
        &ws,
        &out,
        &[
            ("# udp", "UDP applications need a dns traffic distributor"),
            (
                "# simulation min",
                "group.min_nodes: must be a whole number from 0 to 4294967295, got -1",
            ),
        ],
        "error",
    );
    check(
        &ws,
        &out,
        &[(
            "# cloud",
            "cloud must equal the traffic distributor's cloud (\"local\"), got \"gcp\"",
        )],
        "error",
    );
    // A gcp distributor without the gcp settings (no gcp block, none of
    // Google's variables): refused on its `cloud`, naming what to set.
    check(
        &ws,
        &out,
        &[(
            "# gcp distributor",
            "the gcp cloud is not usable: no GCP project: set `project` in the provider's gcp block, or GOOGLE_CLOUD_PROJECT",
        )],
        "error",
    );
    check(
        &ws,
        &out,
        &[(
            "# sourceip",
            "Only COOKIE persistence works across AZ clusters",
        )],
        "warning",
    );
    ws.write(BASE);
    ws.destroy();
    ws.assert_nothing_left(&[]);
}

/// The `node` block's rules at validate time: a field that the group's cloud
/// does not take is named with the cloud; subnets cover exactly the zones;
/// each value's shape on its cloud.
#[test]
fn node_block_fields_are_checked_per_cloud() {
    let ws = Workspace::new("validate-node", 134);
    let group = |name: &str, cloud: &str, zones: &str, node: &str| {
        format!(
            r#"
resource "lbscale_autoscale_group" "{name}" {{
  name                   = "{name}"
  cloud                  = "{cloud}"
  availability_zones     = [{zones}]
  traffic_distributor_id = "td-x"
  threshold {{
    metric = "cpu"
    min    = 10
    max    = 80
  }}
  node {{
{node}  }}
}}
"#
        )
    };
    let config = [
        group(
            "onlocal",
            "local",
            "\"az1\"",
            "    memory_limit_mb = 128\n    image           = \"ami-1\"   # local image\n    identity        = \"nodes\"   # local identity\n",
        ),
        group(
            "onaws",
            "aws",
            "\"us-east-1a\", \"us-east-1b\"",
            "    image            = \"debian-12\" # aws image\n    subnets          = { \"us-east-1a\" = \"subnet-1\", \"us-east-1c\" = \"subnet-3\" } # aws subnets\n    security_groups  = [\"sg-1\", \"default\"] # aws groups\n    management_cidrs = [\"10.0.0.0/33\"] # aws cidrs\n    tags             = { \"lbscale:node-id\" = \"x\" } # aws tags\n    memory_limit_mb  = 16 # aws memory\n",
        ),
        group(
            "onazure",
            "azure",
            "\"1\"",
            "    security_groups = [\"/subscriptions/s/a\", \"/subscriptions/s/b\"] # azure groups\n    subnets         = { \"1\" = \"subnet-1\" } # azure subnets\n    tags            = {} # azure empty tags\n",
        ),
        group(
            "ongcp",
            "gcp",
            "\"us-central1-a\"",
            "    tags     = { Team = \"web\" } # gcp tags\n    identity = \"nodes\"          # gcp identity\n",
        ),
    ]
    .concat();
    ws.write(&config);
    let out = ws.tf(&["validate", "-no-color"]);
    assert_eq!(out.code, 1, "{}", out.all());
    check(
        &ws,
        &out,
        &[
            ("# local image", "node.image is not supported on cloud \"local\"; the local cloud takes memory_limit_mb in the node block."),
            ("# local identity", "node.identity is not supported on cloud \"local\""),
            ("# aws image", "node.image on aws must be an AMI id such as \"ami-0123456789abcdef0\", got \"debian-12\"."),
            ("# aws subnets", "node.subnets gives a subnet for \"us-east-1c\", which is not in availability_zones (\"us-east-1a\", \"us-east-1b\")."),
            ("# aws subnets", "node.subnets must give a subnet for every availability zone when it is given: \"us-east-1b\" has none."),
            ("# aws groups", "node.security_groups[1] on aws must be a security group id such as \"sg-0123456789abcdef0\", got \"default\"."),
            ("# aws cidrs", "node.management_cidrs opens the node API port in the security group that lbscale makes, and lbscale makes none when node.security_groups is given"),
            ("# aws cidrs", "node.management_cidrs[0] must be an IPv4 or IPv6 CIDR such as \"10.0.0.0/16\" (the prefix length is too long), got \"10.0.0.0/33\"."),
            ("# aws tags", "node.tags[\"lbscale:node-id\"] on aws: \"Name\" and keys starting with \"lbscale:\" are lbscale's own."),
            ("# aws memory", "node.memory_limit_mb must be between 32 and 65536, got 16."),
            ("# azure groups", "node.security_groups on azure takes one network security group id (a network interface has one), got 2."),
            ("# azure subnets", "node.subnets[\"1\"] on azure must be a subnet resource id"),
            ("# gcp tags", "node.tags[\"Team\"] on gcp is a label"),
            ("# gcp identity", "node.identity on gcp must be a service account email, got \"nodes\"."),
            ("# azure empty tags", "node.tags is empty: leave it out (or set it to null) when there is nothing to give."),
        ],
        "error",
    );
    // Nothing else is refused.
    let errors: Vec<Diag> = diagnostics(&out.all())
        .into_iter()
        .filter(|d| d.severity == "error")
        .collect();
    assert_eq!(errors.len(), 15, "{errors:#?}");
}
