#!/usr/bin/env bash
# Remakes the trimmed discovery documents of this folder from Google's
# originals (google-api-python-client's discovery_cache/documents/): run with
# the folder holding compute.v1.json and dns.v1.json.
#
#   clouds/gcp/api/make.sh DIR
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
src=${1:?usage: make.sh DIR-WITH-compute.v1.json-AND-dns.v1.json}
python3 "$here/trim.py" "$src/compute.v1.json" "$here/compute.v1.json" \
    compute.instances.insert compute.instances.get compute.instances.list \
    compute.instances.aggregatedList compute.instances.delete \
    compute.zoneOperations.get compute.zoneOperations.wait \
    compute.regionOperations.get compute.regionOperations.wait \
    compute.zones.get compute.zones.list compute.regions.get \
    compute.subnetworks.get \
    compute.firewalls.insert compute.firewalls.get compute.firewalls.list compute.firewalls.patch \
    compute.firewalls.delete compute.globalOperations.get compute.globalOperations.wait \
    compute.addresses.insert compute.addresses.get compute.addresses.delete compute.addresses.list \
    compute.forwardingRules.insert compute.forwardingRules.get \
    compute.forwardingRules.delete compute.forwardingRules.list compute.forwardingRules.aggregatedList \
    compute.targetPools.insert compute.targetPools.get compute.targetPools.delete \
    compute.targetPools.list compute.targetPools.addInstance compute.targetPools.removeInstance
python3 "$here/trim.py" "$src/dns.v1.json" "$here/dns.v1.json" \
    dns.managedZones.create dns.managedZones.get dns.managedZones.list dns.managedZones.delete \
    dns.resourceRecordSets.list dns.resourceRecordSets.create dns.changes.create dns.changes.get
