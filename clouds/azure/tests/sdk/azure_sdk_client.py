#!/usr/bin/env python3
"""Azure's own Python SDKs (azure-identity, azure-mgmt-network, -compute,
-trafficmanager, -dns; pinned in scripts/azure-sdk.sh) as clients of the fake
ARM server: the proof that the fake speaks Azure's wire format, and an
independent reader of what the driver made.

    azure_sdk_client.py COMMAND ARGS...   prints one JSON document

The environment gives the endpoint (AZURE_FAKE_ENDPOINT), its CA
(REQUESTS_CA_BUNDLE) and a service principal (AZURE_TENANT_ID,
AZURE_CLIENT_ID, AZURE_CLIENT_SECRET, with AZURE_AUTHORITY_HOST = the fake).
The network and compute calls name the api-version of the definitions the
fake follows (those SDKs' defaults are newer); the DNS and Traffic Manager
SDKs' own versions are the definitions' (checked at the start).
"""

import json
import os
import sys

from azure.identity import ClientSecretCredential
from azure.mgmt.compute import ComputeManagementClient
from azure.mgmt.dns import DnsManagementClient
from azure.mgmt.network import NetworkManagementClient
from azure.mgmt.trafficmanager import TrafficManagerManagementClient

NETWORK = "2025-07-01"
COMPUTE = "2025-04-01"
DNS = "2018-05-01"
TM = "2026-09-01"

endpoint = os.environ["AZURE_FAKE_ENDPOINT"]
sub = os.environ["AZURE_SUBSCRIPTION_ID"]
cred = ClientSecretCredential(
    os.environ["AZURE_TENANT_ID"], os.environ["AZURE_CLIENT_ID"], os.environ["AZURE_CLIENT_SECRET"],
    authority=os.environ["AZURE_AUTHORITY_HOST"], disable_instance_discovery=True,
)
kw = dict(base_url=endpoint, credential_scopes=["https://management.azure.com/.default"], polling_interval=0)


def check_versions():
    import azure.mgmt.dns._configuration as d
    import azure.mgmt.trafficmanager._configuration as t
    for mod, want in ((d, DNS), (t, TM)):
        src = open(mod.__file__).read()
        if f'"{want}"' not in src:
            raise SystemExit(f"{mod.__name__} does not default to api-version {want}")


def network():
    return NetworkManagementClient(cred, sub, **kw)


def main(cmd, *a):
    if cmd == "network":
        # network RG VNET LOCATION ZONE=PREFIX...: a virtual network with a subnet per zone.
        rg, vnet, location, *subnets = a
        n = network()
        body = {"location": location, "properties": {
            "addressSpace": {"addressPrefixes": ["10.0.0.0/16"]},
            "subnets": [{"name": s.split("=")[0], "properties": {"addressPrefix": s.split("=")[1]}} for s in subnets]}}
        r = n.virtual_networks.begin_create_or_update(rg, vnet, body, api_version=NETWORK).result()
        return {"id": r.id, "subnets": {s.name: s.id for s in r.subnets}}
    if cmd == "lb":
        rg, name = a
        lb = network().load_balancers.get(rg, name, api_version=NETWORK)
        return {
            "etag": lb.etag,
            "sku": lb.sku.name,
            "frontends": {f.name: {"zones": f.zones, "ip": f.private_ip_address,
                                   "public_ip": f.public_ip_address.id if f.public_ip_address else None}
                          for f in lb.frontend_ip_configurations},
            "pools": {p.name: sorted(x.ip_address for x in (p.load_balancer_backend_addresses or [])) for p in lb.backend_address_pools},
            "rules": {r.name: {"port": r.frontend_port, "backend_port": r.backend_port, "protocol": r.protocol,
                               "frontend": r.frontend_ip_configuration.id.rsplit("/", 1)[-1],
                               "pool": r.backend_address_pool.id.rsplit("/", 1)[-1],
                               "probe": r.probe.id.rsplit("/", 1)[-1]} for r in lb.load_balancing_rules},
            "probes": {p.name: {"port": p.port, "protocol": p.protocol} for p in lb.probes},
        }
    if cmd == "lb-drop-address":
        # lb-drop-address RG NAME POOL IP: another writer changes the pool.
        rg, name, pool, ip = a
        n = network()
        lb = n.load_balancers.get(rg, name, api_version=NETWORK)
        for p in lb.backend_address_pools:
            if p.name == pool:
                p.load_balancer_backend_addresses = [x for x in p.load_balancer_backend_addresses if x.ip_address != ip]
        r = n.load_balancers.begin_create_or_update(rg, name, lb, api_version=NETWORK, headers={"If-Match": lb.etag}).result()
        return {"etag": r.etag}
    if cmd == "tm":
        rg, name = a
        p = TrafficManagerManagementClient(cred, sub, **kw).profiles.get(rg, name)
        return {
            "routing": p.traffic_routing_method, "ttl": p.dns_config.ttl, "fqdn": p.dns_config.fqdn,
            "monitor": {"protocol": p.monitor_config.protocol, "port": p.monitor_config.port},
            "endpoints": sorted(e.target for e in p.endpoints),
            "names": sorted(e.name for e in p.endpoints),
        }
    if cmd == "tm-delete-endpoint":
        rg, name, endpoint_name = a
        TrafficManagerManagementClient(cred, sub, **kw).endpoints.delete(rg, name, "ExternalEndpoints", endpoint_name)
        return {}
    if cmd == "zone":
        rg, zone = a
        z = DnsManagementClient(cred, sub, **kw).zones.create_or_update(rg, zone, {"location": "global"})
        return {"id": z.id, "name_servers": z.name_servers}
    if cmd == "cname":
        rg, zone, name = a
        d = DnsManagementClient(cred, sub, **kw)
        try:
            r = d.record_sets.get(rg, zone, name, "CNAME")
        except Exception as e:
            return {"error": type(e).__name__}
        return {"cname": r.cname_record.cname if r.cname_record else None, "ttl": r.ttl, "metadata": r.metadata, "fqdn": r.fqdn}
    if cmd == "put-cname":
        rg, zone, name, target = a
        d = DnsManagementClient(cred, sub, **kw)
        r = d.record_sets.create_or_update(rg, zone, name, "CNAME", {"ttl": 300, "cname_record": {"cname": target}})
        return {"fqdn": r.fqdn}
    if cmd == "pips":
        # pips RG: the resource group's public IP addresses.
        rg, = a
        return {p.name: {"id": p.id, "zones": p.zones, "sku": p.sku.name, "method": p.public_ip_allocation_method,
                         "address": p.ip_address, "tags": p.tags,
                         "attached_to": p.ip_configuration.id if p.ip_configuration else None}
                for p in network().public_ip_addresses.list(rg, api_version=NETWORK)}
    if cmd == "nic":
        rg, name = a
        n = network().network_interfaces.get(rg, name, api_version=NETWORK)
        ipc = n.ip_configurations[0]
        return {"private": ipc.private_ip_address,
                "public_ip": ipc.public_ip_address.id if ipc.public_ip_address else None,
                "nsg": n.network_security_group.id if n.network_security_group else None}
    if cmd == "nsg":
        # nsg RG NAME: its inbound rules, or the error's type.
        rg, name = a
        try:
            g = network().network_security_groups.get(rg, name, api_version=NETWORK)
        except Exception as e:
            return {"error": type(e).__name__}
        return {"tags": g.tags, "rules": {r.name: {"priority": r.priority, "access": r.access, "protocol": r.protocol,
                                                    "direction": r.direction, "port": r.destination_port_range,
                                                    "sources": sorted(r.source_address_prefixes or [r.source_address_prefix])}
                                           for r in g.security_rules},
                "defaults": sorted(r.name for r in g.default_security_rules)}
    if cmd == "nsg-add-rule":
        # nsg-add-rule RG NAME RULE PRIORITY PORT: another writer opens a port.
        rg, name, rule, priority, port = a
        n = network()
        n.security_rules.begin_create_or_update(rg, name, rule, {"properties": {
            "protocol": "Tcp", "access": "Allow", "direction": "Inbound", "priority": int(priority),
            "sourceAddressPrefix": "*", "sourcePortRange": "*", "destinationAddressPrefix": "*",
            "destinationPortRange": port}}, api_version=NETWORK).result()
        return {}
    if cmd == "vms":
        rg, = a
        c = ComputeManagementClient(cred, sub, **kw)
        return {v.name: {"zones": v.zones, "size": v.hardware_profile.vm_size, "tags": v.tags,
                         "state": v.provisioning_state} for v in c.virtual_machines.list(rg, api_version=COMPUTE)}
    raise SystemExit(f"unknown command {cmd}")


if __name__ == "__main__":
    check_versions()
    print(json.dumps(main(*sys.argv[1:])))
