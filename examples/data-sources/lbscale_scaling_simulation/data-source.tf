# What-if: replay a memory trace against a policy before applying it.
# The ticks and events are exactly what `lbscale simulate` prints for the same input.
terraform {
  required_providers {
    lbscale = {
      source = "lbscale/lbscale"
    }
  }
}

provider "lbscale" {}

locals {
  # Memory of az1 at each minute: a breach of 3 samples at minutes 4-6, then calm.
  memory = [90, 90, 80, 90, 90, 90, 60, 60, 60, 60, 60, 60, 60, 60, 60, 60, 60, 30, 30, 30]
}

data "lbscale_scaling_simulation" "memory_spike" {
  availability_zones = ["az1"]
  min_nodes          = 1
  max_nodes          = 4
  stats_interval     = "1m"
  watch_time         = "3m"
  cooldown           = "10m"
  drain_timeout      = "10m"
  distributor        = "dns"
  dns_ttl            = "60s"

  threshold {
    metric = "memory"
    min    = 40
    max    = 85
  }

  samples = [for i, m in local.memory : {
    t                 = (i + 1) * 60
    availability_zone = "az1"
    cpu               = null
    memory            = m
    throughput        = null
  }]
  until = 2400
}

output "scale_events" {
  value = [for e in data.lbscale_scaling_simulation.memory_spike.events : "${e.t}s ${e.kind}: ${e.reason}"]
}
