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

output "nlb_vips" {
  description = "The VIP of each AZ (filled once a group uses the distributor)."
  value       = lbscale_traffic_distributor.nlb.address
}
