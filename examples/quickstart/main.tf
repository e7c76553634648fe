# lbscale quickstart: an autoscaled fleet of load-balancer nodes on this machine.
#
# Run it with ./scripts/quickstart.sh, which builds the provider, starts three
# backends on 127.0.0.1:18101-18103, applies this configuration, starts the
# `lbscale daemon`, drives HTTP load through the fleet until the group scales out,
# stops it until the group scales back in, and destroys everything.
#
# What it creates (the `local` cloud: every node is a real `lbscale-node`
# process on its own loopback address):
#   - a `dns` traffic distributor: an authoritative DNS server for
#     app.lbscale.test that answers with the address of every serving node
#     (TTL 2 s, so clients pick up a new node, and drop a leaving one, quickly);
#   - an autoscale group with one cluster in one availability zone, 1 to 2 nodes,
#     scaled on throughput: out above 8 Mbps per node, in below 1 Mbps per node.
#     Every interval is in seconds so that a whole scale-out / scale-in cycle
#     takes about a minute; production values are minutes;
#   - an SE group and an HTTP vserver on port 8080 that round-robins over the
#     backends.

terraform {
  required_version = ">= 1.0"
  required_providers {
    lbscale = {
      source = "lbscale/lbscale"
    }
  }
}

variable "address_prefix" {
  description = "Loopback prefix that node and distributor addresses are taken from."
  type        = string
  default     = "127.0."
}

variable "node_binary" {
  description = "Path of lbscale-node; null: next to the provider, then PATH."
  type        = string
  default     = null
}

variable "backend_ports" {
  description = "Ports of the HTTP backends on 127.0.0.1 (started by scripts/quickstart.sh)."
  type        = list(number)
  default     = [18101, 18102, 18103]
}

provider "lbscale" {
  # The store shared with the daemon; this is the default.
  state = "sqlite://.lbscale/state.db"

  local {
    address_prefix = var.address_prefix
    node_binary    = var.node_binary
  }
}

resource "lbscale_traffic_distributor" "dns" {
  name   = "quickstart-dns"
  cloud  = "local"
  mode   = "dns"
  domain = "app.lbscale.test"
  ttl    = "2s"
}

resource "lbscale_autoscale_group" "web" {
  name                   = "quickstart"
  cloud                  = "local"
  availability_zones     = ["az1"]
  traffic_distributor_id = lbscale_traffic_distributor.dns.id

  min_nodes = 1
  max_nodes = 2

  # The daemon samples every node each second; 3 samples in a row beyond a
  # threshold make a decision; after a scale-out it waits 5 s before the next
  # evaluation; a node leaving gets 3 s to finish its connections.
  stats_interval = "1s"
  watch_time     = "3s"
  cooldown       = "5s"
  drain_timeout  = "3s"
  apply_timeout  = "2m"

  # Mean throughput of the serving nodes, in Mbps. `lbscale load` at 24
  # requests/s of 64 KiB moves about 13 Mbps: above 8 on one node (scale out),
  # about 6.5 on each of two (stay), 0 when it stops (scale in).
  threshold {
    metric = "throughput"
    min    = 1
    max    = 8
  }

  node {
    memory_limit_mb = 256
  }
}

resource "lbscale_se_group" "web" {
  name               = "quickstart"
  autoscale_group_id = lbscale_autoscale_group.web.id
}

resource "lbscale_vserver" "web" {
  name         = "web"
  se_group_id  = lbscale_se_group.web.id
  service_type = "HTTP"
  port         = 8080
  lb_method    = "ROUNDROBIN"

  dynamic "service" {
    for_each = var.backend_ports
    content {
      name    = "backend-${service.key + 1}"
      address = "127.0.0.1"
      port    = service.value
    }
  }

  # A node that joins ramps each backend up by 1 request/s every 2 s; what its
  # backends may not take yet goes to the node that was already serving.
  slow_start {
    new_service_request = 1
    unit                = "PER_SECOND"
    increment_interval  = 2
  }
}

output "dns_server" {
  description = "Address (IP:PORT) of the distributor's DNS server."
  value       = lbscale_traffic_distributor.dns.address["dns"]
}

output "nodes" {
  description = "The group's nodes right after apply."
  value = [
    for n in lbscale_autoscale_group.web.nodes :
    "${n.id} ${n.availability_zone} ${n.private_ip} ${n.state}"
  ]
}

output "node_addresses" {
  description = "Private addresses of the group's nodes."
  value       = [for n in lbscale_autoscale_group.web.nodes : n.private_ip]
}

output "vip" {
  description = "Where clients reach the vserver in each AZ."
  value       = lbscale_vserver.web.vip
}
