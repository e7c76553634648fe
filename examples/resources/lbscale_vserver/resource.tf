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

# An nlb distributor: one VIP per AZ, forwarding TCP to the AZ's nodes.
resource "lbscale_traffic_distributor" "edge" {
  name  = "edge"
  cloud = "local"
  mode  = "nlb"
}

resource "lbscale_autoscale_group" "edge" {
  name                   = "edge"
  cloud                  = "local"
  availability_zones     = ["az1", "az2"]
  traffic_distributor_id = lbscale_traffic_distributor.edge.id
  min_nodes              = 1
  max_nodes              = 3

  threshold {
    metric = "cpu"
    min    = 20
    max    = 80
  }
}

resource "lbscale_se_group" "edge" {
  name               = "edge"
  autoscale_group_id = lbscale_autoscale_group.edge.id
}

# An HTTP vserver on port 8080 of every node, round-robin over two backends.
# A service that is newly bound (or back UP) ramps up by 5 requests per second
# every 10 seconds. A client keeps its backend through any node: the node sets a
# cookie that names the service (COOKIE persistence needs an HTTP vserver).
resource "lbscale_vserver" "api" {
  name         = "api"
  se_group_id  = lbscale_se_group.edge.id
  service_type = "HTTP"
  port         = 8080
  lb_method    = "ROUNDROBIN"
  persistence  = "COOKIE"

  service {
    name    = "api-1"
    address = "127.0.0.1"
    port    = 18201
  }

  service {
    name    = "api-2"
    address = "127.0.0.1"
    port    = 18202
    weight  = 2
  }

  service {
    name    = "api-3"
    address = "127.0.0.1"
    port    = 18203
    enabled = false # bound, but gets no traffic
  }

  slow_start {
    new_service_request = 5
    unit                = "PER_SECOND"
    increment_interval  = 10
  }
}

output "vip" {
  description = "VIP:PORT of the vserver in each AZ."
  value       = lbscale_vserver.api.vip
}

output "slow_start" {
  value = lbscale_vserver.api.slow_start_summary
}
