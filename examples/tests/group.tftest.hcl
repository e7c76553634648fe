# terraform test (Terraform 1.6+): the group serves its minimum in every AZ as
# soon as the apply that creates it ends, as the data source reads it.

run "serves_min_nodes_in_every_az" {
  command = apply

  assert {
    condition     = data.lbscale_autoscale_group.web.status == "ok"
    error_message = "every AZ has its min_nodes serving: the data source says ${data.lbscale_autoscale_group.web.status}"
  }

  assert {
    condition     = data.lbscale_autoscale_group.web.node_count == 2 * var.min_nodes
    error_message = "every AZ has its min_nodes serving: ${data.lbscale_autoscale_group.web.node_count} nodes serve in 2 AZs, expected ${2 * var.min_nodes}"
  }

  assert {
    condition     = alltrue([for n in data.lbscale_autoscale_group.web.nodes : n.state == "active"])
    error_message = "every node is active: ${jsonencode(data.lbscale_autoscale_group.web.nodes[*].state)}"
  }

  assert {
    condition     = contains(data.lbscale_autoscale_group.web.events[*].kind, "node_active")
    error_message = "the group's events include node_active: ${jsonencode(data.lbscale_autoscale_group.web.events[*].kind)}"
  }
}
