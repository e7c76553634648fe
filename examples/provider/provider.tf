terraform {
  required_version = ">= 1.0"
  required_providers {
    lbscale = {
      source = "lbscale/lbscale"
    }
  }
}

provider "lbscale" {
  # The store that the provider (and the daemon) keeps specs, nodes and
  # events in. A relative path is taken from Terraform's working directory.
  state = "sqlite://.lbscale/state.db"

  # The local cloud: every node is an lbscale-node process on its own loopback
  # address, the dns distributor an authoritative DNS server process and the nlb
  # distributor an L4 forwarder with one VIP per availability zone.
  local {
    address_prefix = "127.0." # nodes get 127.0.x.y
    dns_port       = 10053    # port of the dns distributors' servers
    node_api_port  = 9990     # management API port on every node
    # node_binary  = "/usr/local/bin/lbscale-node" # default: next to the provider, then PATH
  }

  # The aws cloud: nodes are EC2 instances started from your image, dns
  # distributors are Route 53 record sets, nlb distributors ELBv2 network load
  # balancers. Every attribute falls back to AWS's
  # environment variables (AWS_REGION, AWS_ACCESS_KEY_ID, ...), which is also
  # where `lbscale daemon` takes them, so that no secret sits in a .tf file.
  aws {
    region        = "eu-west-1"
    image_id      = "ami-0123456789abcdef0" # an image with lbscale-node on its PATH
    instance_type = "c5.large"
  }
}
