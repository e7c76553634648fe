# The fleet on azure: virtual machines from an image with lbscale-node in your
# subnets, each with a public IP of its own and the group's network security
# group, and a Traffic Manager profile of their public IPs for the domain
# (docs/azure.md). The engine reaches the nodes at their private addresses:
# run Terraform and the daemon where the subnets are reachable.
# Credentials: ARM_* / AZURE_* variables, workload identity or a managed
# identity.
#
#   terraform init && terraform apply -var subscription_id=S -var image=IMAGE \
#     -var 'subnets={"1"="/subscriptions/.../subnets/a","2"="/subscriptions/.../subnets/b"}'

terraform {
  required_version = ">= 1.0"
  required_providers {
    lbscale = {
      source = "lbscale/lbscale"
    }
  }
}

variable "subscription_id" {
  description = "The subscription of the fleet."
  type        = string
}

variable "image" {
  description = "An image with lbscale-node (publisher:offer:sku:version or an image resource id)."
  type        = string
}

variable "subnets" {
  description = "The subnet resource id of each zone (\"1\", \"2\", \"3\")."
  type        = map(string)
}

provider "lbscale" {
  azure {
    subscription_id = var.subscription_id
    resource_group  = "shop"
    location        = "westeurope"
  }
}

module "shop" {
  source             = "../../modules/fleet"
  name               = "shop"
  cloud              = "azure"
  availability_zones = sort(keys(var.subnets))
  domain             = "shop.example.com"
  node = {
    image   = var.image
    size    = "Standard_D2s_v5"
    subnets = var.subnets
    tags    = { app = "shop" }
  }
  vservers = {
    web = {
      port     = 80
      backends = [{ name = "app1", address = "10.0.1.10", port = 8080 }]
    }
  }
}

output "dns" { value = module.shop.dns }
