# The fleet on gcp: Compute Engine nodes from an image with lbscale-node in
# your subnetworks, A records in the Cloud DNS managed zone that holds the
# domain. Credentials: GOOGLE_APPLICATION_CREDENTIALS or the instance's
# service account (docs/gcp.md).
#
#   terraform init && terraform apply -var project=P -var image=IMAGE

terraform {
  required_version = ">= 1.0"
  required_providers {
    lbscale = {
      source = "lbscale/lbscale"
    }
  }
}

variable "project" {
  description = "The project of the nodes and of the managed zone."
  type        = string
}

variable "image" {
  description = "An image with lbscale-node (projects/P/global/images/NAME)."
  type        = string
}

provider "lbscale" {
  gcp {
    project = var.project
    region  = "europe-west1"
  }
}

module "shop" {
  source             = "../../modules/fleet"
  name               = "shop"
  cloud              = "gcp"
  availability_zones = ["europe-west1-b", "europe-west1-c"]
  domain             = "shop.example.com"
  node = {
    image = var.image
    size  = "e2-standard-2"
    tags  = { app = "shop" }
  }
  vservers = {
    web = {
      port     = 80
      backends = [{ name = "app1", address = "10.0.1.10", port = 8080 }]
    }
  }
}

output "dns" { value = module.shop.dns }
