# A fleet: a dns traffic distributor, an autoscale group with one cluster per
# zone, an SE group and HTTP vservers, on whichever cloud `cloud` names. What
# differs between clouds (zone names, the node block) comes in as variables,
# so one module serves every cloud (see examples/multi-cloud/).
#
# Written for Terraform 1.0 (no optional object attributes): `node` is any
# object, and each field of the node block is taken from it when present.

terraform {
  required_version = ">= 1.0"
  required_providers {
    lbscale = {
      source = "lbscale/lbscale"
    }
  }
}

variable "name" {
  description = "The fleet's name: its objects are named after it."
  type        = string
}

variable "cloud" {
  description = "Where the fleet runs: local, aws, azure or gcp."
  type        = string
}

variable "availability_zones" {
  description = "The zones of the fleet, one cluster each (az1 on local, eu-west-1a on aws, 1 on azure, europe-west1-b on gcp)."
  type        = list(string)
}

variable "domain" {
  description = "The application's domain, which the dns distributor answers for."
  type        = string
}

variable "ttl" {
  description = "How long clients keep an answer."
  type        = string
  default     = "30s"
}

variable "min_nodes" {
  description = "Nodes per zone at least."
  type        = number
  default     = 1
}

variable "max_nodes" {
  description = "Nodes per zone at most."
  type        = number
  default     = 4
}

variable "stats_interval" {
  description = "How often the daemon samples the nodes."
  type        = string
  default     = "1m"
}

variable "thresholds" {
  description = "When to scale: out above max, in below min, per metric (cpu and memory in percent, throughput in Mbps)."
  type = list(object({
    metric = string
    min    = number
    max    = number
  }))
  default = [{ metric = "cpu", min = 20, max = 70 }]
}

variable "node" {
  description = "The group's node block for the cloud: any of memory_limit_mb, image, size, subnets, security_groups, management_cidrs, identity, tags (docs/resources/autoscale_group.md says what each means on each cloud). Empty: the cloud's defaults."
  type        = any
  default     = {}
}

variable "vservers" {
  description = "The HTTP vservers: their port and backends (name, address, port)."
  type = map(object({
    port = number
    backends = list(object({
      name    = string
      address = string
      port    = number
    }))
  }))
}

resource "lbscale_traffic_distributor" "this" {
  name   = "${var.name}-dns"
  cloud  = var.cloud
  mode   = "dns"
  domain = var.domain
  ttl    = var.ttl
}

resource "lbscale_autoscale_group" "this" {
  name                   = var.name
  cloud                  = var.cloud
  availability_zones     = var.availability_zones
  traffic_distributor_id = lbscale_traffic_distributor.this.id
  min_nodes              = var.min_nodes
  max_nodes              = var.max_nodes
  stats_interval         = var.stats_interval

  dynamic "node" {
    for_each = length(keys(var.node)) > 0 ? [var.node] : []
    content {
      memory_limit_mb  = try(node.value.memory_limit_mb, null)
      image            = try(node.value.image, null)
      size             = try(node.value.size, null)
      subnets          = try(node.value.subnets, null)
      security_groups  = try(node.value.security_groups, null)
      management_cidrs = try(node.value.management_cidrs, null)
      identity         = try(node.value.identity, null)
      tags             = try(node.value.tags, null)
    }
  }

  dynamic "threshold" {
    for_each = var.thresholds
    content {
      metric = threshold.value.metric
      min    = threshold.value.min
      max    = threshold.value.max
    }
  }
}

resource "lbscale_se_group" "this" {
  name               = "${var.name}-se"
  autoscale_group_id = lbscale_autoscale_group.this.id
}

resource "lbscale_vserver" "this" {
  for_each     = var.vservers
  name         = "${var.name}-${each.key}"
  se_group_id  = lbscale_se_group.this.id
  service_type = "HTTP"
  port         = each.value.port

  dynamic "service" {
    for_each = each.value.backends
    content {
      name    = service.value.name
      address = service.value.address
      port    = service.value.port
    }
  }
}

output "dns" {
  description = "Where clients resolve the domain: the distributor's DNS server."
  value       = lbscale_traffic_distributor.this.address["dns"]
}

output "group_id" {
  description = "The autoscale group's id (for lbscale status and the daemon)."
  value       = lbscale_autoscale_group.this.id
}

output "endpoints" {
  description = "The addresses the distributor hands out, as of the last apply."
  value       = lbscale_traffic_distributor.this.endpoints
}
