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
  name  = "web-nlb"
  cloud = "local"
  mode  = "nlb"
}

resource "lbscale_autoscale_group" "web" {
  name                   = "web"
  cloud                  = "local"
  availability_zones     = ["az1", "az2"]
  traffic_distributor_id = lbscale_traffic_distributor.web.id

  threshold {
    metric = "cpu"
    min    = 20
    max    = 70
  }
}

resource "lbscale_se_group" "web" {
  name               = "web-se"
  autoscale_group_id = lbscale_autoscale_group.web.id
}

resource "lbscale_vserver" "web" {
  name         = "web"
  se_group_id  = lbscale_se_group.web.id
  service_type = "HTTP"
  port         = 8080

  service {
    name    = "app"
    address = "10.0.0.10"
    port    = 80
  }
}

# What the distributor hands out now. depends_on makes the first apply read it
# once the vservers (which make the nlb's VIPs) and the group (whose nodes it
# registers) are applied; later plans read it live. Elsewhere the name alone is
# enough: name = "web-nlb".
data "lbscale_traffic_distributor" "web" {
  name       = lbscale_traffic_distributor.web.name
  depends_on = [lbscale_vserver.web]
}

output "vips" {
  description = "The VIP of each AZ, e.g. for a DNS record per zone."
  value       = data.lbscale_traffic_distributor.web.address
}

output "endpoints" {
  description = "The node addresses registered now (they move when the daemon scales)."
  value       = data.lbscale_traffic_distributor.web.endpoints
}
