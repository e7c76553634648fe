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
  ttl    = "30s"
}

# Two clusters (one per AZ), each kept between 1 and 4 nodes. Scale-out when
# any metric stays above its max for watch_time; scale-in when every metric
# stays below its min.
resource "lbscale_autoscale_group" "web" {
  name                   = "web"
  cloud                  = "local" # must equal the distributor's cloud
  availability_zones     = ["az1", "az2"]
  traffic_distributor_id = lbscale_traffic_distributor.web.id

  min_nodes = 1
  max_nodes = 4

  stats_interval = "1m"
  watch_time     = "3m" # 3 consecutive samples
  cooldown       = "10m"
  drain_timeout  = "10m"
  apply_timeout  = "5m"

  threshold {
    metric = "cpu" # percent
    min    = 20
    max    = 80
  }

  threshold {
    metric = "memory" # percent of node.memory_limit_mb
    min    = 40
    max    = 85
  }

  threshold {
    metric = "throughput" # Mbps per node
    min    = 10
    max    = 800
  }

  node {
    memory_limit_mb = 256
  }
}

output "node_count" {
  value = lbscale_autoscale_group.web.node_count
}

output "nodes" {
  value = [for n in lbscale_autoscale_group.web.nodes : "${n.availability_zone} ${n.private_ip} ${n.state}"]
}
