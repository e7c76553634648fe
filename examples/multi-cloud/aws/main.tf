# The fleet on aws: EC2 nodes from an image with lbscale-node (see
# docs/image.md) in your subnets, a Route 53 record set for the domain.
# Credentials come from the AWS SDKs' usual chain (environment, profiles,
# instance role; see docs/index.md).
#
#   terraform init && terraform apply -var image=ami-... \
#     -var 'subnets={"eu-west-1a"="subnet-...","eu-west-1b"="subnet-..."}'

terraform {
  required_version = ">= 1.0"
  required_providers {
    lbscale = {
      source = "lbscale/lbscale"
    }
  }
}

variable "image" {
  description = "An AMI with lbscale-node (docs/image.md)."
  type        = string
}

variable "subnets" {
  description = "The subnet of each zone."
  type        = map(string)
}

provider "lbscale" {
  aws {
    region = "eu-west-1"
  }
}

module "shop" {
  source             = "../../modules/fleet"
  name               = "shop"
  cloud              = "aws"
  availability_zones = sort(keys(var.subnets))
  domain             = "shop.example.com"
  node = {
    image   = var.image
    size    = "c5.large"
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
