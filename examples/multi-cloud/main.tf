# One configuration, every cloud: the same resources with `cloud` as a
# variable. Only the names of the availability zones and of the application's
# domain differ between clouds.
#
#   terraform apply                  # local: nodes are processes on this machine
#   terraform apply -var cloud=aws   # aws: EC2 nodes, a Route 53 record set
#                                    # (region, image and credentials from the
#                                    # provider's aws block or AWS_* variables)
#   terraform apply -var cloud=gcp -var gcp_project=P -var gcp_image=IMAGE
#                                    # gcp: Compute Engine nodes, a Cloud DNS
#                                    # record set in your managed zone that
#                                    # holds the domain (credentials from
#                                    # GOOGLE_APPLICATION_CREDENTIALS or the
#                                    # instance's service account; see docs/gcp.md)

terraform {
  required_version = ">= 1.0"
  required_providers {
    lbscale = {
      source = "lbscale/lbscale"
    }
  }
}

variable "cloud" {
  description = "Where the fleet runs: local, aws or gcp."
  type        = string
  default     = "local"
  validation {
    condition     = contains(["local", "aws", "gcp"], var.cloud)
    error_message = "The cloud must be \"local\", \"aws\" or \"gcp\" (the azure driver is not built yet)."
  }
}

variable "gcp_project" {
  description = "gcp: the project of the nodes and of the managed zone."
  type        = string
  default     = "my-project"
}

variable "gcp_image" {
  description = "gcp: the image of the nodes, with lbscale-node installed (projects/P/global/images/NAME)."
  type        = string
  default     = "projects/my-project/global/images/lbscale-node"
}

variable "domain" {
  description = "The application's domain (a zone of your AWS account holds it on aws)."
  type        = string
  default     = "shop.lbscale.test"
}

locals {
  availability_zones = {
    local = ["az1", "az2"]
    aws   = ["eu-west-1a", "eu-west-1b"]
    gcp   = ["europe-west1-b", "europe-west1-c"]
  }
}

provider "lbscale" {
  aws {
    region = "eu-west-1"
  }
  gcp {
    project = var.gcp_project
    region  = "europe-west1"
  }
}

resource "lbscale_traffic_distributor" "shop" {
  name   = "shop"
  cloud  = var.cloud
  mode   = "dns"
  domain = var.domain
  ttl    = "30s"
}

resource "lbscale_autoscale_group" "shop" {
  name                   = "shop"
  cloud                  = var.cloud
  availability_zones     = local.availability_zones[var.cloud]
  traffic_distributor_id = lbscale_traffic_distributor.shop.id
  min_nodes              = 1
  max_nodes              = 4

  # On gcp the node block names the image (aws takes the provider's image_id).
  dynamic "node" {
    for_each = var.cloud == "gcp" ? [var.gcp_image] : []
    content {
      image = node.value
      size  = "e2-standard-2"
    }
  }

  threshold {
    metric = "cpu"
    min    = 20
    max    = 70
  }
}

resource "lbscale_se_group" "shop" {
  name               = "shop-se"
  autoscale_group_id = lbscale_autoscale_group.shop.id
}

resource "lbscale_vserver" "shop" {
  name         = "shop-web"
  se_group_id  = lbscale_se_group.shop.id
  service_type = "HTTP"
  port         = 80

  service {
    name    = "app1"
    address = "10.0.1.10"
    port    = 8080
  }
}

output "dns" {
  description = "Where clients resolve the domain: the local DNS server, or the zone's name server."
  value       = lbscale_traffic_distributor.shop.address["dns"]
}
