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

# DNS distribution: an authoritative DNS server for app.example.test that
# answers with the address of every serving node of the groups that use it.
resource "lbscale_traffic_distributor" "dns" {
  name   = "web-dns"
  cloud  = "local"
  mode   = "dns"
  domain = "app.example.test"
  ttl    = "30s"
}

# NLB distribution: one static VIP per availability zone that forwards TCP to
# the nodes of that zone. No domain, no TTL.
resource "lbscale_traffic_distributor" "nlb" {
  name  = "web-nlb"
  cloud = "local"
  mode  = "nlb"
}

output "dns_server" {
  description = "IP:PORT of the DNS server, e.g. for dig @IP -p PORT app.example.test."
  value       = lbscale_traffic_distributor.dns.address["dns"]
}

# An nlb's VIPs are made with the first vserver of each AZ, which Terraform
# applies after the distributor: read them from that vserver's `vip`, or from
# the lbscale_traffic_distributor data source with depends_on on the vservers
# (examples/data-sources/lbscale_traffic_distributor). The resource's own
# `address` and `endpoints` are what its apply saw, and a refresh keeps them.
