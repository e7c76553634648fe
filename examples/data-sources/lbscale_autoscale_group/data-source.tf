terraform {
  required_providers {
    lbscale = {
      source = "lbscale/lbscale"
    }
  }
}

provider "lbscale" {
  local {
    address_prefix = "127.0."
  }
}

resource "lbscale_traffic_distributor" "web" {
  name   = "web"
  cloud  = "local"
  mode   = "dns"
  domain = "app.example.test"
}

resource "lbscale_autoscale_group" "web" {
  name                   = "web"
  cloud                  = "local"
  availability_zones     = ["az1"]
  traffic_distributor_id = lbscale_traffic_distributor.web.id

  threshold {
    metric = "memory"
    min    = 40
    max    = 85
  }
}

# Reads the group as it is now, including what the daemon changed since the
# last apply. Elsewhere (another configuration, a dashboard module) the name
# alone is enough: name = "web".
data "lbscale_autoscale_group" "web" {
  name = lbscale_autoscale_group.web.name
}

output "status" {
  description = "ok, or degraded (az: n/min serving, ...)."
  value       = data.lbscale_autoscale_group.web.status
}

output "node_count" {
  value = data.lbscale_autoscale_group.web.node_count
}

output "recent_events" {
  value = [for e in data.lbscale_autoscale_group.web.events : "${e.time} ${coalesce(e.availability_zone, "-")} ${e.kind}: ${e.reason}"]
}
