# A fleet on aws placed in your own VPC: a subnet per availability zone, the
# security group that lbscale makes for the group (the vservers' ports open to
# clients, the node API port to the daemon's network only), an instance
# profile and tags, behind an nlb distributor in the same subnets.
#
#   terraform apply -var 'subnets={"eu-west-1a"="subnet-…","eu-west-1b"="subnet-…"}'

terraform {
  required_version = ">= 1.0"
  required_providers {
    lbscale = {
      source = "lbscale/lbscale"
    }
  }
}

variable "subnets" {
  description = "Per availability zone, the subnet of its nodes (all in one VPC)."
  type        = map(string)
  default = {
    "eu-west-1a" = "subnet-0a1b2c3d4e5f60718"
    "eu-west-1b" = "subnet-0f1e2d3c4b5a69788"
  }
}

variable "management_cidrs" {
  description = "Where Terraform and the lbscale daemon reach the nodes' API from."
  type        = list(string)
  default     = ["10.20.0.0/24"]
}

provider "lbscale" {
  aws {
    region = "eu-west-1"
  }
}

resource "lbscale_traffic_distributor" "edge" {
  name  = "edge"
  cloud = "aws"
  mode  = "nlb" # one load balancer, in the group's subnets
}

resource "lbscale_autoscale_group" "edge" {
  name                   = "edge"
  cloud                  = "aws"
  availability_zones     = keys(var.subnets)
  traffic_distributor_id = lbscale_traffic_distributor.edge.id
  min_nodes              = 2
  max_nodes              = 6

  threshold {
    metric = "cpu"
    min    = 20
    max    = 70
  }

  node {
    image            = "ami-0123456789abcdef0" # an image with lbscale-node (see docs/image.md)
    size             = "c6i.large"
    subnets          = var.subnets
    management_cidrs = var.management_cidrs # no security_groups: lbscale makes one
    identity         = "lbscale-node"       # an IAM instance profile
    tags = {
      team        = "edge"
      cost-center = "42"
    }
  }
}

resource "lbscale_se_group" "edge" {
  name               = "edge-se"
  autoscale_group_id = lbscale_autoscale_group.edge.id
}

resource "lbscale_vserver" "https" {
  name         = "edge-tls"
  se_group_id  = lbscale_se_group.edge.id
  service_type = "TCP"
  port         = 443
  service {
    name    = "app-1"
    address = "10.20.1.10"
    port    = 8443
  }
}
