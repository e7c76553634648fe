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
  min_nodes              = 1
  max_nodes              = 4

  threshold {
    metric = "cpu"
    min    = 20
    max    = 80
  }
}

# How a vserver spreads over the group's nodes: native scale-out over 1 to 4
# nodes, with the primary forwarding a share of new connections. A vserver starts
# on one node (its primary); `lbscale daemon` adds nodes to it as its holders'
# CPU passes the group's cpu max (80 here), and takes them away as it falls.
resource "lbscale_se_group" "web" {
  name                    = "web-se"
  autoscale_group_id      = lbscale_autoscale_group.web.id
  scaling_mode            = "native"
  min_scaleout_per_vs     = 1
  max_scaleout_per_vs     = 4
  vs_scalein_timeout      = "30s"
  se_tunnel_mode          = 0
  primary_forwarding_cost = 0.3
}

output "se_group_id" {
  value = lbscale_se_group.web.id
}
