# A group and the data source that reads it, with a `terraform test` of it in
# group.tftest.hcl (Terraform 1.6+): `terraform test` applies this configuration
# in a state of its own, checks the assertions, then destroys what it made.
#
#   terraform test                                  # nodes on 127.0.x.y
#   terraform test -var address_prefix=127.42.      # on another loopback prefix

terraform {
  required_providers {
    lbscale = {
      source = "lbscale/lbscale"
    }
  }
}

variable "address_prefix" {
  description = "Loopback prefix of the nodes' and the distributor's addresses."
  type        = string
  default     = "127.0."
}

variable "min_nodes" {
  description = "Nodes per AZ that the group keeps serving."
  type        = number
  default     = 1
}

provider "lbscale" {
  local {
    address_prefix = var.address_prefix
  }
}

resource "lbscale_traffic_distributor" "web" {
  name   = "tested-dns"
  cloud  = "local"
  mode   = "dns"
  domain = "tested.example.test"
  ttl    = "1s"
}

resource "lbscale_autoscale_group" "web" {
  name                   = "tested"
  cloud                  = "local"
  availability_zones     = ["az1", "az2"]
  traffic_distributor_id = lbscale_traffic_distributor.web.id
  min_nodes              = var.min_nodes
  max_nodes              = 3
  drain_timeout          = "2s"

  threshold {
    metric = "cpu"
    min    = 20
    max    = 80
  }
}

# Read after the group is created (its name comes from the resource).
data "lbscale_autoscale_group" "web" {
  name = lbscale_autoscale_group.web.name
}

output "status" {
  value = data.lbscale_autoscale_group.web.status
}
