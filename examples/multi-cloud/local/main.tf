# The fleet on the local cloud: nodes are lbscale-node processes on this
# machine. The same module runs on aws, azure and gcp (the other folders here);
# only the zones, the domain, the node block and the provider block differ.
#
#   terraform init && terraform apply

terraform {
  required_version = ">= 1.0"
  required_providers {
    lbscale = {
      source = "lbscale/lbscale"
    }
  }
}

provider "lbscale" {}

module "shop" {
  source             = "../../modules/fleet"
  name               = "shop"
  cloud              = "local"
  availability_zones = ["az1", "az2"]
  domain             = "shop.lbscale.test"
  node               = { memory_limit_mb = 256 }
  vservers = {
    web = {
      port     = 8080
      backends = [{ name = "app1", address = "127.0.0.1", port = 18101 }]
    }
  }
}

output "dns" { value = module.shop.dns }
