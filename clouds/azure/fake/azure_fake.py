#!/usr/bin/env python3
"""A stateful fake of Azure Resource Manager for the tests of lbscale's azure
driver: the resources the driver uses (virtual machines, network interfaces,
public IPs, virtual networks, load balancers, Traffic Manager profiles, DNS
zones and record sets), an emulated login endpoint and instance metadata
identity endpoint.

Public IP addresses are given from their own loopback range (127.92/16 by
default; private addresses come from 127.91/16). Traffic to them is what
Azure's 1:1 NAT and network security groups make of it: the fake listens on
a node's public address and relays each TCP connection to the node's
private address, for the ports that the network security groups of its
interface and subnet allow from the Internet (rules that name their ports,
or ranges of up to 64; a Standard address with no security group takes
nothing: Azure's "secure by default"). A public load balancer's frontend
address relays each TCP connection of a rule's frontend port to a member of
the rule's backend pool (at random, as a 5-tuple hash spreads them), through
that member's security groups alike. UDP is not relayed.

Every ARM request is matched to its operation in Azure's published OpenAPI
definitions (clouds/azure/api: path, method, api-version, query parameters,
body) and refused with ARM's error envelope when it does not follow them;
every answer the fake sends is validated against the operation's response
schema too (a failure is a 500 `FakeResponseInvalid`, so a test sees it).
Operations that the definitions mark long-running answer 201/202 with
`Azure-AsyncOperation` and/or `Location` and `Retry-After`, and finish at a
later poll. Resources carry ETags; `If-Match` and `If-None-Match` are honoured
(412 `PreconditionFailed`). Faults (429, 5xx, a failed long-running
operation) are injected through `/_fake/faults`.

A virtual machine that reaches `Succeeded` runs its custom data with `sh`
when the fake was started with `--run-custom-data`, in a directory of its
own (`LBSCALE_NODE_ROOT`) and with its private address in
`LBSCALE_NODE_LISTEN_IP`; deleting the VM kills what it started.

Control (no authentication; loopback only): `GET /_fake/state`,
`POST /_fake/faults`, `POST /_fake/tokens` ({"expires_in": s}),
`POST /_fake/clients` ({"client_id", "secret"}), `GET /_fake/grants`,
`GET /_fake/requests`.
"""

import argparse
import base64
import copy
import http.server
import ipaddress
import random
import socket
import json
import os
import re
import signal
import socketserver
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import uuid

# No __pycache__ in the source tree.
sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import schema  # noqa: E402

LOCK = threading.RLock()


class ArmError(Exception):
    def __init__(self, status, code, message, headers=None):
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.headers = headers or {}


class Addresses:
    """Loopback addresses handed out, one range per kind."""

    def __init__(self, prefix):
        self.prefix = prefix
        self.next = 1

    def take(self):
        n = self.next
        self.next += 1
        return f"{self.prefix}.{n // 250}.{n % 250 + 2}"


class State:
    def __init__(self, args):
        self.args = args
        self.resources = {}  # lower-case id -> body
        self.disks = {}  # lower-case id -> VM id (Compute disks: not in the copied definitions)
        self.operations = {}  # id -> dict
        self.faults = []
        self.tokens = {}  # token -> {expires, subject, how}
        self.grants = []  # (subject, how, time)
        self.clients = {}  # client id -> secret
        self.expires_in = 3600
        self.requests = []  # (method, path, operation id, status, if-match)
        self.private = Addresses(args.private_prefix)
        self.public = Addresses(args.public_prefix)
        self.frontend = Addresses(args.frontend_prefix)
        self.processes = {}  # VM id -> Popen
        self.relays = {}  # (address, port) -> Relay


def etag():
    return 'W/"' + str(uuid.uuid4()) + '"'


def resource_type(path):
    """`Microsoft.Network/loadBalancers` of a resource id (nested types joined)."""
    parts = path.strip("/").split("/")
    try:
        i = [p.lower() for p in parts].index("providers")
    except ValueError:
        return ""
    if i + 1 >= len(parts):
        return ""
    ns = parts[i + 1]
    types = parts[i + 2 :: 2]
    return "/".join([ns] + types)


# Child collections that live in their parent's body: (parent type, segment)
# -> the parent's property.
CHILDREN = {
    ("microsoft.network/loadbalancers", "backendaddresspools"): "backendAddressPools",
    ("microsoft.network/loadbalancers", "frontendipconfigurations"): "frontendIPConfigurations",
    ("microsoft.network/loadbalancers", "loadbalancingrules"): "loadBalancingRules",
    ("microsoft.network/loadbalancers", "probes"): "probes",
    ("microsoft.network/loadbalancers", "inboundnatrules"): "inboundNatRules",
    ("microsoft.network/loadbalancers", "outboundrules"): "outboundRules",
    ("microsoft.network/networkinterfaces", "ipconfigurations"): "ipConfigurations",
    ("microsoft.network/virtualnetworks", "subnets"): "subnets",
    ("microsoft.network/networksecuritygroups", "securityrules"): "securityRules",
    ("microsoft.network/trafficmanagerprofiles", "externalendpoints"): "endpoints",
    ("microsoft.network/trafficmanagerprofiles", "azureendpoints"): "endpoints",
    ("microsoft.network/trafficmanagerprofiles", "nestedendpoints"): "endpoints",
}
TM_TYPES = {
    "externalendpoints": "externalEndpoints",
    "azureendpoints": "azureEndpoints",
    "nestedendpoints": "nestedEndpoints",
}


def child_of(path):
    """(parent id, segment, name, parent property) when `path` names a child
    kept in its parent's body, else None."""
    parts = path.rstrip("/").split("/")
    if len(parts) < 3:
        return None
    parent = "/".join(parts[:-2])
    key = CHILDREN.get((resource_type(parent).lower(), parts[-2].lower()))
    if key and resource_type(parent).count("/") == 1:
        return parent, parts[-2], parts[-1], key
    return None


def collection_of(path):
    """(parent id, segment, parent property) when `path` lists such children."""
    parts = path.rstrip("/").split("/")
    parent = "/".join(parts[:-1])
    key = CHILDREN.get((resource_type(parent).lower(), parts[-1].lower()))
    if key and resource_type(parent).count("/") == 1:
        return parent, parts[-1], key
    return None


class Fake:
    def __init__(self, args):
        self.args = args
        self.specs = schema.Specs(args.specs)
        self.state = State(args)
        self.log = os.environ.get("LBSCALE_FAKE_TRAFFIC_LOG")

    # -- authentication ----------------------------------------------------
    def issue(self, subject, how):
        token = base64.urlsafe_b64encode(os.urandom(24)).decode().rstrip("=")
        with LOCK:
            self.state.tokens[token] = {
                "expires": time.time() + self.state.expires_in,
                "subject": subject,
                "how": how,
            }
            self.state.grants.append({"subject": subject, "how": how, "time": time.time()})
            return token, self.state.expires_in

    def login(self, tenant, form):
        grant = form.get("grant_type")
        client = form.get("client_id", "")
        scope = form.get("scope", "")
        if grant != "client_credentials":
            return 400, {"error": "unsupported_grant_type", "error_description": f"AADSTS70003: grant_type {grant!r} is not supported by the fake"}
        if not scope.endswith("/.default"):
            return 400, {"error": "invalid_scope", "error_description": "AADSTS70011: the scope must be a resource's /.default"}
        if not client:
            return 400, {"error": "invalid_request", "error_description": "AADSTS900144: client_id is missing"}
        if "client_assertion" in form:
            if form.get("client_assertion_type") != "urn:ietf:params:oauth:client-assertion-type:jwt-bearer":
                return 400, {"error": "invalid_request", "error_description": "AADSTS700023: wrong client_assertion_type"}
            if form["client_assertion"].count(".") != 2:
                return 400, {"error": "invalid_client", "error_description": "AADSTS50027: the client assertion is not a JWT"}
            how = "federated"
        elif "client_secret" in form:
            wanted = self.state.clients.get(client)
            if wanted is not None and wanted != form["client_secret"]:
                return 401, {"error": "invalid_client", "error_description": "AADSTS7000215: Invalid client secret provided."}
            how = "secret"
        else:
            return 400, {"error": "invalid_client", "error_description": "AADSTS7000218: a client_secret or client_assertion is required"}
        token, expires_in = self.issue(f"{tenant}/{client}", how)
        return 200, {"token_type": "Bearer", "expires_in": expires_in, "ext_expires_in": expires_in, "access_token": token}

    def metadata_token(self, query, headers):
        if headers.get("metadata", "").lower() != "true":
            return 400, {"error": "invalid_request", "error_description": "Required metadata header not specified"}
        if query.get("api-version") is None or query.get("resource") is None:
            return 400, {"error": "invalid_request", "error_description": "api-version and resource are required"}
        subject = query.get("client_id") or "system-assigned"
        token, expires_in = self.issue(f"managed-identity/{subject}", "managed-identity")
        now = int(time.time())
        return 200, {
            "access_token": token,
            "client_id": subject,
            "expires_in": str(expires_in),
            "expires_on": str(now + expires_in),
            "ext_expires_in": str(expires_in),
            "not_before": str(now),
            "resource": query["resource"],
            "token_type": "Bearer",
        }

    def authenticate(self, headers):
        auth = headers.get("authorization", "")
        if not auth.startswith("Bearer "):
            raise ArmError(401, "AuthenticationFailed", "Authentication failed. The 'Authorization' header is missing.",
                           {"WWW-Authenticate": 'Bearer authorization_uri="https://login.microsoftonline.com/"'})
        t = self.state.tokens.get(auth[7:])
        if t is None:
            raise ArmError(401, "InvalidAuthenticationToken", "The access token is invalid.")
        if t["expires"] < time.time():
            raise ArmError(401, "ExpiredAuthenticationToken", "The access token expiry UTC time is earlier than current UTC time.")

    # -- faults --------------------------------------------------------------
    def fault(self, method, path, kind):
        with LOCK:
            for f in self.state.faults:
                if f.get("kind", "response") != kind or f["count"] <= 0:
                    continue
                if f.get("method", "*") not in ("*", method):
                    continue
                if not re.search(f.get("path", ""), path, re.IGNORECASE):
                    continue
                f["count"] -= 1
                return f
        return None

    # -- the ARM request -----------------------------------------------------
    def arm(self, method, path, query, headers, raw):
        self.authenticate(headers)
        f = self.fault(method, path, "response")
        if f:
            h = {}
            if "retry_after" in f:
                h["Retry-After"] = str(f["retry_after"])
            raise ArmError(f["status"], f.get("code", "TooManyRequests" if f["status"] == 429 else "InternalServerError"),
                           f.get("message", "injected by the fake"), h)
        m = re.match(r"^(/subscriptions/[^/]+/providers/[^/]+/locations/[^/]+/)(operations|operationResults)/([^/]+)$", path, re.I)
        if m and method == "GET":
            return self.poll(m.group(2).lower(), m.group(3))
        candidates = self.specs.match(method, path)
        if not candidates:
            raise ArmError(404, "InvalidResourceType", f"The resource type of {path} is not one the fake knows (no operation in the API definitions matches the path).")
        for_method = [(o, p) for o, p in candidates if o.method == method]
        if not for_method:
            raise ArmError(405, "MethodNotAllowed", f"{method} is not an operation of {candidates[0][0].template}.")
        version = query.get("api-version")
        if version is None:
            raise ArmError(400, "MissingApiVersionParameter", "The api-version query parameter (?api-version=) is required for all requests.")
        chosen = None
        for o, p in for_method:
            if o.spec != version:
                continue
            try:
                self.specs.check_parameters(o, p, query)
            except schema.Invalid:
                if chosen is None:
                    chosen = (o, p)
                continue
            chosen = (o, p)
            break
        if chosen is None:
            versions = sorted({o.spec for o, _ in for_method})
            raise ArmError(400, "InvalidApiVersionParameter",
                           f"The api-version '{version}' is invalid. The supported versions are '{','.join(versions)}'.")
        op, params = chosen
        try:
            self.specs.check_parameters(op, params, query)
        except schema.Invalid as e:
            raise ArmError(400, "InvalidParameter", f"{op.id}: parameter {e}")
        body = None
        bp = op.body_param()
        if raw:
            try:
                body = json.loads(raw)
            except ValueError as e:
                raise ArmError(400, "InvalidRequestContent", f"The request content is not valid JSON: {e}")
        if bp is not None:
            if body is None and bp.get("required"):
                raise ArmError(400, "InvalidRequestContent", f"{op.id}: the request body is required.")
            if body is not None:
                try:
                    self.specs.validate(op.file, bp["schema"], body, "", True)
                except schema.Invalid as e:
                    raise ArmError(400, "InvalidRequestContent", f"{op.id}: {e}")
        elif body is not None:
            raise ArmError(400, "InvalidRequestContent", f"{op.id} takes no request body.")
        with LOCK:
            try:
                status, out, h = self.dispatch(op, method, path, query, headers, body)
            finally:
                if method != "GET":
                    self.sync_relays()
            self.state.requests.append({"method": method, "path": path, "operation": op.id, "status": status,
                                        "if_match": headers.get("if-match"), "if_none_match": headers.get("if-none-match")})
        rs, declared = op.response_schema(status)
        if not declared:
            raise ArmError(500, "FakeResponseInvalid", f"the fake answered {op.id} with {status}, which the definitions do not list")
        if rs is not None and out is not None:
            try:
                self.specs.validate(op.file, rs, out, "", False)
            except schema.Invalid as e:
                raise ArmError(500, "FakeResponseInvalid", f"the fake's answer to {op.id} does not follow the definitions: {e}")
        return status, out, h

    # -- long-running operations ----------------------------------------------
    def start_operation(self, path, kind, finish):
        """A long-running operation on `path`: (operation id, its headers)."""
        oid = str(uuid.uuid4())
        fail = self.fault("LRO", path, "operation")
        self.state.operations[oid] = {"polls": 0, "started": time.time(), "finish": finish, "status": "InProgress",
                                      "fail": fail, "path": path, "kind": kind}
        parts = path.split("/")
        sub = "/".join(parts[:3])
        ns = resource_type(path).split("/")[0]
        base = f"{self.args.url}{sub}/providers/{ns}/locations/{self.args.location}"
        h = {
            "Azure-AsyncOperation": f"{base}/operations/{oid}?api-version=fake",
            "Retry-After": str(self.args.retry_after),
        }
        if kind == "delete":
            h["Location"] = f"{base}/operationResults/{oid}?api-version=fake"
        return oid, h

    def advance(self, o):
        if o["status"] != "InProgress":
            return
        o["polls"] += 1
        if o["polls"] <= self.args.lro_polls or time.time() - o["started"] < self.args.lro_seconds:
            return
        if o["fail"]:
            o["status"] = "Failed"
            o["error"] = {"code": o["fail"].get("code", "InternalServerError"),
                          "message": o["fail"].get("message", "the long-running operation failed (injected by the fake)")}
            body = self.state.resources.get(o["path"].lower())
            if body is not None and isinstance(body.get("properties"), dict) and "provisioningState" in body["properties"]:
                body["properties"]["provisioningState"] = "Failed"
            return
        o["status"] = "Succeeded"
        o["finish"]()

    def poll(self, kind, oid):
        with LOCK:
            o = self.state.operations.get(oid)
            if o is None:
                raise ArmError(404, "OperationNotFound", f"no operation {oid}")
            self.advance(o)
            self.sync_relays()
            h = {}
            if o["status"] == "InProgress":
                h["Retry-After"] = str(self.args.retry_after)
            if kind == "operationresults":
                if o["status"] == "InProgress":
                    return 202, None, h
                if o["status"] == "Failed":
                    raise ArmError(400, o["error"]["code"], o["error"]["message"])
                return 204, None, h
            out = {"id": oid, "name": oid, "status": o["status"], "startTime": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(o["started"]))}
            if o["status"] == "Failed":
                out["error"] = o["error"]
            return 200, out, h

    # -- dispatch ---------------------------------------------------------------
    def dispatch(self, op, method, path, query, headers, body):
        if method == "GET":
            return self.get(op, path, query)
        if method == "PUT":
            return self.put(op, path, headers, body)
        if method == "PATCH":
            return self.patch(op, path, headers, body)
        if method == "DELETE":
            return self.delete(op, path, headers)
        raise ArmError(400, "UnsupportedOperation", f"the fake does not implement {op.id}")

    def lookup(self, path):
        """The body at `path` (a resource or a child in its parent), or None."""
        r = self.state.resources.get(path.lower())
        if r is not None:
            return r
        c = child_of(path)
        if c:
            parent = self.state.resources.get(c[0].lower())
            if parent is not None:
                for item in parent.get("properties", {}).get(c[3], []):
                    if item.get("name", "").lower() == c[2].lower() and (
                            c[3] != "endpoints" or item.get("type", "").lower().endswith("/" + c[1].lower())):
                        return item
        return None

    def get(self, op, path, query):
        r = self.lookup(path)
        if r is not None:
            out = copy.deepcopy(r)
            if resource_type(path).lower() == "microsoft.compute/virtualmachines" and query.get("$expand") == "instanceView":
                out["properties"]["instanceView"] = self.instance_view(r)
            return 200, out, {}
        rs, _ = op.response_schema(200)
        if rs is not None:
            s, _, props, _ = self.specs.flatten(op.file, rs)
            if "value" in props:
                return 200, {"value": self.list(path, query)}, {}
        raise ArmError(404, "ResourceNotFound" if child_of(path) is None else "NotFound",
                       f"The Resource '{resource_type(path)}/{path.rsplit('/', 1)[-1]}' under resource group '{self.group(path)}' was not found.")

    def group(self, path):
        m = re.search(r"/resourceGroups/([^/]+)", path, re.I)
        return m.group(1) if m else ""

    def list(self, path, query):
        c = collection_of(path)
        if c:
            parent = self.state.resources.get(c[0].lower())
            if parent is None:
                raise ArmError(404, "ResourceNotFound", f"The parent {c[0]} was not found.")
            return copy.deepcopy(parent.get("properties", {}).get(c[2], []))
        low = path.lower().rstrip("/")
        out = []
        if low.endswith("/recordsets") or low.endswith("/all"):
            zone = low.rsplit("/", 1)[0]
            for k, v in self.state.resources.items():
                if k.startswith(zone + "/") and k.count("/") == zone.count("/") + 2:
                    out.append(v)
        elif "/resourcegroups/" in low:
            for k, v in self.state.resources.items():
                if k.startswith(low + "/") and k.count("/") == low.count("/") + 1:
                    out.append(v)
        else:
            sub, _, rest = low.partition("/providers/")
            for k, v in self.state.resources.items():
                if k.startswith(sub + "/resourcegroups/") and k.endswith("") and re.match(
                        re.escape(sub) + r"/resourcegroups/[^/]+/providers/" + re.escape(rest) + r"/[^/]+$", k):
                    out.append(v)
        return copy.deepcopy(sorted(out, key=lambda v: v["id"].lower()))

    def check_preconditions(self, current, headers):
        im = headers.get("if-match")
        inm = headers.get("if-none-match")
        if im is not None and im != "*" and (current is None or current.get("etag") != im):
            raise ArmError(412, "PreconditionFailed", "The condition specified using HTTP conditional header(s) is not met (If-Match: the resource changed since it was read).")
        if im == "*" and current is None:
            raise ArmError(412, "PreconditionFailed", "If-Match: * and the resource does not exist.")
        if inm == "*" and current is not None:
            raise ArmError(412, "PreconditionFailed", "If-None-Match: * and the resource already exists.")

    def put(self, op, path, headers, body):
        current = self.lookup(path)
        self.check_preconditions(current, headers)
        c = child_of(path)
        if c:
            parent = self.state.resources.get(c[0].lower())
            if parent is None:
                raise ArmError(404, "ParentResourceNotFound", f"The parent resource {c[0]} was not found.")
            new_parent = copy.deepcopy(parent)
            items = new_parent.setdefault("properties", {}).setdefault(c[3], [])
            body = dict(body)
            body["name"] = c[2]
            if c[3] == "endpoints":
                body["type"] = "Microsoft.Network/trafficManagerProfiles/" + TM_TYPES[c[1].lower()]
            items[:] = [i for i in items if i.get("name", "").lower() != c[2].lower()] + [body]
            _, _, h = self.store(op, c[0], new_parent, True)
            return (200 if current else 201), copy.deepcopy(self.lookup(path)), h
        return self.store(op, path, body, current is not None)

    def store(self, op, path, body, exists):
        """Stores `body` at `path` with what Azure computes, through a
        long-running operation when the definitions say so."""
        new = self.complete(path, copy.deepcopy(body), exists)
        rtype = resource_type(path).lower()
        lro = op.lro and op.method == "PUT"
        if lro:
            props = new.get("properties")
            final = props.get("provisioningState") if isinstance(props, dict) else None
            if final is not None:
                # Microsoft.Network's ProvisioningState has no "Creating".
                creating = "Updating" if rtype.startswith("microsoft.network/") else "Creating"
                props["provisioningState"] = "Updating" if exists else creating
            key = path.lower()

            def finish():
                b = self.state.resources.get(key)
                if b is not None and final is not None:
                    b["properties"]["provisioningState"] = final
                if rtype == "microsoft.compute/virtualmachines":
                    self.boot(b)

            self.state.resources[key] = new
            oid, h = self.start_operation(path, "put", finish)
            return (200 if exists else 201), copy.deepcopy(new), h
        self.state.resources[path.lower()] = new
        return (200 if exists else 201), copy.deepcopy(new), {}

    def patch(self, op, path, headers, body):
        current = self.lookup(path)
        if current is None:
            raise ArmError(404, "ResourceNotFound", f"The Resource {path} was not found.")
        self.check_preconditions(current, headers)
        merged = merge(copy.deepcopy(current), body)
        self.state.resources[path.lower()] = self.complete(path, merged, True)
        return 200, copy.deepcopy(self.state.resources[path.lower()]), {}

    def delete(self, op, path, headers):
        current = self.lookup(path)
        c = child_of(path)
        if current is None:
            return (204 if "204" in op.op.get("responses", {}) else 200), None, {}
        self.check_preconditions(current, headers)
        if c:
            parent = copy.deepcopy(self.state.resources[c[0].lower()])
            items = parent["properties"][c[3]]
            items[:] = [i for i in items if i is not current and i.get("name", "").lower() != c[2].lower()]
            self.state.resources[c[0].lower()] = self.complete(c[0], parent, True)
            if op.lro:
                _, h = self.start_operation(path, "delete", lambda: None)
                return 202, None, h
            return 200, self.deleted(op), {}
        self.refuse_in_use(path)
        key = path.lower()

        def finish():
            self.remove(key)

        if op.lro:
            props = current.get("properties")
            if isinstance(props, dict) and "provisioningState" in props:
                props["provisioningState"] = "Deleting"
            _, h = self.start_operation(path, "delete", finish)
            return 202, None, h
        finish()
        return 200, self.deleted(op), {}

    def deleted(self, op):
        """The body of a 200 to a DELETE: Traffic Manager's DeleteOperationResult, else none."""
        rs, _ = op.response_schema(200)
        if rs is None:
            return None
        _, _, props, _ = self.specs.flatten(op.file, rs)
        return {"boolean": True} if "boolean" in props else None

    def refuse_in_use(self, path):
        low = path.lower()
        for k, v in self.state.resources.items():
            if k == low or k.startswith(low + "/"):
                continue
            if re.search(re.escape('"' + low) + r'["/]', json.dumps(v).lower()) and resource_type(k).lower() != "microsoft.network/dnszones/cname":
                if resource_type(path).lower() == "microsoft.network/virtualnetworks" and "/subnets/" in json.dumps(v).lower():
                    raise ArmError(400, "InUseSubnetCannotBeDeleted", f"{path} is in use by {v['id']}")
                if resource_type(path).lower() in ("microsoft.network/networkinterfaces", "microsoft.network/publicipaddresses"):
                    raise ArmError(400, "InUse", f"{path} is in use by {v['id']} and cannot be deleted.")
                if resource_type(path).lower() == "microsoft.network/networksecuritygroups":
                    raise ArmError(400, "InUseNetworkSecurityGroupCannotBeDeleted",
                                   f"Network security group {path} cannot be deleted because it is in use by the following resources: {v['id']}.")

    def remove(self, key):
        body = self.state.resources.pop(key, None)
        if body is None:
            return
        if resource_type(key).lower() in ("microsoft.network/networkinterfaces", "microsoft.network/loadbalancers"):
            self.detach_public_ips(key)
        if resource_type(key) == "microsoft.compute/virtualmachines":
            self.halt(body)
            props = body.get("properties", {})
            disk = props.get("storageProfile", {}).get("osDisk", {})
            if disk.get("deleteOption") == "Delete":
                self.state.disks.pop(disk.get("managedDisk", {}).get("id", "").lower(), None)
            for nic in props.get("networkProfile", {}).get("networkInterfaces", []):
                if nic.get("properties", {}).get("deleteOption") == "Delete":
                    self.remove_nic(nic["id"].lower())
                else:
                    n = self.state.resources.get(nic["id"].lower())
                    if n:
                        n["properties"].pop("virtualMachine", None)
        if key.endswith("") and resource_type(key).startswith("microsoft.network/dnszones") and key.count("/") == 8:
            for k in [k for k in self.state.resources if k.startswith(key + "/")]:
                del self.state.resources[k]

    def detach_public_ips(self, owner):
        """Public IPs whose ipConfiguration is `owner`'s (lower-case id) let go."""
        for k, v in self.state.resources.items():
            if resource_type(k).lower() == "microsoft.network/publicipaddresses":
                ipc = (v.get("properties", {}).get("ipConfiguration") or {}).get("id", "")
                if ipc.lower().startswith(owner.lower() + "/"):
                    v["properties"].pop("ipConfiguration", None)

    def remove_nic(self, key):
        nic = self.state.resources.pop(key, None)
        if nic is None:
            return
        for ipc in nic.get("properties", {}).get("ipConfigurations", []):
            pip = ipc.get("properties", {}).get("publicIPAddress")
            if not pip:
                continue
            # The address's own deleteOption (or one given in the reference).
            res = self.state.resources.get(pip.get("id", "").lower())
            option = (res or {}).get("properties", {}).get("deleteOption") or pip.get("properties", {}).get("deleteOption")
            if option == "Delete":
                self.state.resources.pop(pip["id"].lower(), None)
            elif res is not None:
                res["properties"].pop("ipConfiguration", None)

    # -- what Azure computes ---------------------------------------------------
    def complete(self, path, body, exists):
        rtype = resource_type(path)
        old = self.state.resources.get(path.lower())
        body["id"] = path
        body["name"] = path.rstrip("/").rsplit("/", 1)[-1]
        body["type"] = rtype
        low = rtype.lower()
        if low.startswith("microsoft.network/dnszones/"):
            body["type"] = "Microsoft.Network/dnszones/" + rtype.split("/")[-1].upper()
        if low == "microsoft.network/trafficmanagerprofiles":
            body["type"] = "Microsoft.Network/trafficManagerProfiles"
        has_etag = low not in ("microsoft.network/trafficmanagerprofiles",)
        if has_etag:
            body["etag"] = etag()
        props = body.setdefault("properties", {})
        hook = {
            "microsoft.network/loadbalancers": self.complete_lb,
            "microsoft.network/networkinterfaces": self.complete_nic,
            "microsoft.network/publicipaddresses": self.complete_pip,
            "microsoft.network/networksecuritygroups": self.complete_nsg,
            "microsoft.network/virtualnetworks": self.complete_vnet,
            "microsoft.compute/virtualmachines": self.complete_vm,
            "microsoft.network/trafficmanagerprofiles": self.complete_tm,
            "microsoft.network/dnszones": self.complete_zone,
        }.get(low)
        if low.startswith("microsoft.network/dnszones/"):
            zone = path.rsplit("/", 2)[0]
            z = self.state.resources.get(zone.lower())
            if z is None:
                raise ArmError(404, "ParentResourceNotFound", f"The DNS zone {zone} was not found.")
            name = body["name"]
            zname = zone.rsplit("/", 1)[-1]
            props["fqdn"] = (zname if name == "@" else f"{name}.{zname}") + "."
            props["provisioningState"] = "Succeeded"
        if hook:
            hook(path, body, props, old)
        return body

    def sub(self, parent, key, items, typ, state=True):
        for i in items:
            i["id"] = f"{parent}/{key}/{i.get('name', '')}"
            if typ:
                i["type"] = typ
            i["etag"] = etag()
            if state:
                i.setdefault("properties", {})["provisioningState"] = "Succeeded"

    def require(self, ref, what):
        if ref and ref.get("id") and self.lookup_id(ref["id"]) is None:
            raise ArmError(400, "InvalidResourceReference", f"Resource {ref['id']} referenced by {what} was not found.")

    def lookup_id(self, rid):
        return self.lookup(rid)

    def complete_lb(self, path, body, props, old):
        props["provisioningState"] = "Succeeded"
        props.setdefault("resourceGuid", str(uuid.uuid4()))
        if body.get("sku", {}).get("name") not in (None, "Standard", "Basic", "Gateway"):
            raise ArmError(400, "InvalidSku", "unknown sku")
        old_front = {f["name"]: f for f in (old or {}).get("properties", {}).get("frontendIPConfigurations", [])}
        self.detach_public_ips(path)
        for key, typ in [("frontendIPConfigurations", "Microsoft.Network/loadBalancers/frontendIPConfigurations"),
                         ("backendAddressPools", "Microsoft.Network/loadBalancers/backendAddressPools"),
                         ("loadBalancingRules", "Microsoft.Network/loadBalancers/loadBalancingRules"),
                         ("probes", "Microsoft.Network/loadBalancers/probes"),
                         ("inboundNatRules", "Microsoft.Network/loadBalancers/inboundNatRules"),
                         ("outboundRules", "Microsoft.Network/loadBalancers/outboundRules")]:
            self.sub(path, key, props.get(key, []), typ)
        for f in props.get("frontendIPConfigurations", []):
            fp = f["properties"]
            self.require(fp.get("subnet"), f"frontend {f['name']}")
            self.require(fp.get("publicIPAddress"), f"frontend {f['name']}")
            if fp.get("publicIPAddress"):
                # A public frontend takes its zone from its address (the
                # fake's error code: Azure refuses `zones` here too).
                if f.get("zones"):
                    raise ArmError(400, "LoadBalancerFrontendIPConfigurationZonesNotSupported",
                                   f"frontend {f['name']}: zones can be given for an internal frontend only; a public frontend takes its address's zone.")
                pip = self.lookup(fp["publicIPAddress"]["id"])
                if body.get("sku", {}).get("name") == "Standard" and pip.get("sku", {}).get("name") != "Standard":
                    raise ArmError(400, "LoadBalancerWithStandardSkuCannotReferenceBasicSkuPublicIP",
                                   f"frontend {f['name']}: a Standard load balancer takes Standard public IP addresses only.")
                if fp.get("subnet"):
                    raise ArmError(400, "InvalidRequestFormat", f"frontend {f['name']} has both a subnet and a public IP address")
                pip["properties"]["ipConfiguration"] = {"id": f"{path}/frontendIPConfigurations/{f['name']}"}
            if fp.get("subnet") and not fp.get("privateIPAddress"):
                prev = old_front.get(f["name"], {}).get("properties", {}).get("privateIPAddress")
                fp["privateIPAddress"] = prev or self.state.frontend.take()
                fp.setdefault("privateIPAllocationMethod", "Dynamic")
        ids = {i["id"].lower() for k in ("frontendIPConfigurations", "backendAddressPools", "probes") for i in props.get(k, [])}
        for r in props.get("loadBalancingRules", []):
            rp = r["properties"]
            for ref in ("frontendIPConfiguration", "backendAddressPool", "probe"):
                v = rp.get(ref)
                if v and v.get("id", "").lower() not in ids:
                    raise ArmError(400, "InvalidResourceReference", f"Resource {v.get('id')} referenced by rule {r['name']} was not found in the load balancer.")
            if rp.get("frontendIPConfiguration") is None:
                raise ArmError(400, "LoadBalancingRuleMustReferenceFrontendIPConfiguration", f"rule {r['name']} has no frontend")
        for p in props.get("backendAddressPools", []):
            for a in p["properties"].get("loadBalancerBackendAddresses", []):
                self.require(a.get("properties", {}).get("virtualNetwork"), f"backend address {a.get('name')}")

    def complete_vnet(self, path, body, props, old):
        props["provisioningState"] = "Succeeded"
        props.setdefault("resourceGuid", str(uuid.uuid4()))
        self.sub(path, "subnets", props.get("subnets", []), "Microsoft.Network/virtualNetworks/subnets")

    def complete_pip(self, path, body, props, old):
        sku = body.get("sku", {}).get("name", "Basic")
        method = props.get("publicIPAllocationMethod", "Dynamic")
        # The fake's error codes; Azure refuses these too.
        if sku == "Standard" and method != "Static":
            raise ArmError(400, "StandardSkuPublicIPAddressesMustBeStatic",
                           f"{path}: a Standard SKU public IP address must be allocated Static, got {method}.")
        if old is not None and sorted(old.get("zones", [])) != sorted(body.get("zones", [])):
            raise ArmError(400, "ResourceAvailabilityZonesCannotBeModified",
                           f"{path}: the zones of a public IP address cannot change ({old.get('zones', [])} to {body.get('zones', [])}).")
        props["provisioningState"] = "Succeeded"
        props.setdefault("resourceGuid", str(uuid.uuid4()))
        props["publicIPAllocationMethod"] = method
        props.setdefault("publicIPAddressVersion", "IPv4")
        prev = (old or {}).get("properties", {}).get("ipAddress")
        props["ipAddress"] = prev or self.state.public.take()
        if old and old.get("properties", {}).get("ipConfiguration"):
            props["ipConfiguration"] = old["properties"]["ipConfiguration"]

    def complete_nsg(self, path, body, props, old):
        props["provisioningState"] = "Succeeded"
        props.setdefault("resourceGuid", str(uuid.uuid4()))
        rules = props.get("securityRules", [])
        self.sub(path, "securityRules", rules, "Microsoft.Network/networkSecurityGroups/securityRules")
        seen = {}
        for r in rules:
            rp = r["properties"]
            pr = rp.get("priority")
            # The fake's error codes; Azure refuses these too.
            if not isinstance(pr, int) or not 100 <= pr <= 4096:
                raise ArmError(400, "SecurityRuleInvalidPriority", f"security rule {r['name']}: priority must be from 100 to 4096, got {pr}.")
            key = (rp.get("direction"), pr)
            if key in seen:
                raise ArmError(400, "SecurityRulesInvalidPriorityConflict",
                               f"security rules {seen[key]} and {r['name']} have the same priority {pr} and direction {key[0]}.")
            seen[key] = r["name"]
            for side in ("source", "destination"):
                if rp.get(f"{side}AddressPrefix") and rp.get(f"{side}AddressPrefixes"):
                    raise ArmError(400, "SecurityRuleParameterContainsUnsupportedValue",
                                   f"security rule {r['name']}: {side}AddressPrefix and {side}AddressPrefixes cannot both be given.")
                if not (rp.get(f"{side}PortRange") or rp.get(f"{side}PortRanges")):
                    raise ArmError(400, "SecurityRuleInvalidPortRange", f"security rule {r['name']}: {side}PortRange is required.")
            for prefix in [rp.get("sourceAddressPrefix")] + list(rp.get("sourceAddressPrefixes") or []):
                if prefix and "/" in prefix:
                    try:
                        ipaddress.ip_network(prefix, strict=False)
                    except ValueError:
                        raise ArmError(400, "SecurityRuleInvalidAddressPrefix", f"security rule {r['name']}: {prefix!r} is not an address prefix.")
        defaults = []
        for name, pr, direction, access, src, dst in [
                ("AllowVnetInBound", 65000, "Inbound", "Allow", "VirtualNetwork", "VirtualNetwork"),
                ("AllowAzureLoadBalancerInBound", 65001, "Inbound", "Allow", "AzureLoadBalancer", "*"),
                ("DenyAllInBound", 65500, "Inbound", "Deny", "*", "*"),
                ("AllowVnetOutBound", 65000, "Outbound", "Allow", "VirtualNetwork", "VirtualNetwork"),
                ("AllowInternetOutBound", 65001, "Outbound", "Allow", "*", "Internet"),
                ("DenyAllOutBound", 65500, "Outbound", "Deny", "*", "*")]:
            defaults.append({"name": name, "id": f"{path}/defaultSecurityRules/{name}", "etag": etag(),
                             "type": "Microsoft.Network/networkSecurityGroups/defaultSecurityRules",
                             "properties": {"description": name, "protocol": "*", "sourcePortRange": "*",
                                            "destinationPortRange": "*", "sourceAddressPrefix": src,
                                            "destinationAddressPrefix": dst, "access": access, "priority": pr,
                                            "direction": direction, "provisioningState": "Succeeded"}})
        props["defaultSecurityRules"] = defaults

    def complete_nic(self, path, body, props, old):
        props["provisioningState"] = "Succeeded"
        props.setdefault("resourceGuid", str(uuid.uuid4()))
        olds = {i["name"]: i for i in (old or {}).get("properties", {}).get("ipConfigurations", [])}
        self.sub(path, "ipConfigurations", props.get("ipConfigurations", []), "Microsoft.Network/networkInterfaces/ipConfigurations")
        if not props.get("ipConfigurations"):
            raise ArmError(400, "NetworkInterfaceMustHaveIpConfiguration", "a network interface needs an IP configuration")
        self.require(props.get("networkSecurityGroup"), "the network interface")
        for i, ipc in enumerate(props["ipConfigurations"]):
            p = ipc["properties"]
            if not p.get("subnet"):
                raise ArmError(400, "InvalidRequestFormat", f"ipConfigurations[{i}] has no subnet")
            self.require(p.get("subnet"), f"IP configuration {ipc['name']}")
            pip = p.get("publicIPAddress")
            if pip:
                self.require(pip, f"IP configuration {ipc['name']}")
                res = self.lookup(pip["id"])
                other = (res.get("properties", {}).get("ipConfiguration") or {}).get("id", "")
                if other and not other.lower().startswith(path.lower() + "/"):
                    raise ArmError(400, "PublicIPAddressInUse", f"public IP address {pip['id']} is in use by {other}.")
                res["properties"]["ipConfiguration"] = {"id": f"{path}/ipConfigurations/{ipc['name']}"}
            if p.get("privateIPAllocationMethod", "Dynamic") == "Dynamic" or not p.get("privateIPAddress"):
                prev = olds.get(ipc["name"], {}).get("properties", {}).get("privateIPAddress")
                p["privateIPAddress"] = prev or self.state.private.take()
                p["privateIPAllocationMethod"] = p.get("privateIPAllocationMethod", "Dynamic")
            p.setdefault("primary", i == 0)
        if old and old.get("properties", {}).get("virtualMachine"):
            props["virtualMachine"] = old["properties"]["virtualMachine"]

    def complete_vm(self, path, body, props, old):
        props["provisioningState"] = "Succeeded"
        props["vmId"] = (old or {}).get("properties", {}).get("vmId") or str(uuid.uuid4())
        props["timeCreated"] = (old or {}).get("properties", {}).get("timeCreated") or time.strftime("%Y-%m-%dT%H:%M:%SZ")
        nics = props.get("networkProfile", {}).get("networkInterfaces", [])
        if not nics:
            raise ArmError(400, "InvalidParameter", "networkProfile.networkInterfaces: a VM needs a network interface")
        for n in nics:
            nic = self.state.resources.get(n.get("id", "").lower())
            if nic is None:
                raise ArmError(400, "InvalidResourceReference", f"network interface {n.get('id')} was not found")
            attached = nic["properties"].get("virtualMachine", {}).get("id")
            if attached and attached.lower() != path.lower():
                raise ArmError(400, "NicInUse", f"network interface {n['id']} is attached to {attached}")
            nic["properties"]["virtualMachine"] = {"id": path}
            for ipc in nic["properties"].get("ipConfigurations", []):
                pip = self.lookup((ipc["properties"].get("publicIPAddress") or {}).get("id", ""))
                zones = (pip or {}).get("zones") or []
                if zones and body.get("zones") and not set(body["zones"]) & set(zones):
                    # The fake's error code; Azure refuses it too.
                    raise ArmError(400, "ZonalPublicIPAddressNotInVirtualMachineZone",
                                   f"public IP address {pip['id']} is in zone(s) {zones}; virtual machine {body['name']} is in zone(s) {body['zones']}.")
        if not props.get("hardwareProfile", {}).get("vmSize"):
            raise ArmError(400, "InvalidParameter", "hardwareProfile.vmSize is required")
        os_disk = props.setdefault("storageProfile", {}).setdefault("osDisk", {"createOption": "FromImage"})
        md = os_disk.setdefault("managedDisk", {})
        disk_name = os_disk.get("name") or f"{body['name']}_OsDisk_1"
        os_disk["name"] = disk_name
        md["id"] = f"{path.split('/providers/')[0]}/providers/Microsoft.Compute/disks/{disk_name}"
        self.state.disks[md["id"].lower()] = path
        custom = props.get("osProfile", {}).get("customData")
        if custom is not None:
            try:
                base64.b64decode(custom, validate=True)
            except ValueError:
                raise ArmError(400, "InvalidParameter", "osProfile.customData must be base64")
            # Azure never returns custom data.
            self.state.__dict__.setdefault("custom", {})[path.lower()] = custom
            del props["osProfile"]["customData"]
        if old is None:
            pass

    def instance_view(self, vm):
        power = "PowerState/running" if vm["properties"].get("provisioningState") == "Succeeded" else "PowerState/starting"
        return {"statuses": [
            {"code": f"ProvisioningState/{vm['properties'].get('provisioningState', '').lower()}", "level": "Info"},
            {"code": power, "level": "Info"}]}

    def complete_tm(self, path, body, props, old):
        rel = props.get("dnsConfig", {}).get("relativeName")
        if not rel:
            raise ArmError(400, "BadRequest", "dnsConfig.relativeName is required")
        for k, v in self.state.resources.items():
            if k != path.lower() and resource_type(k).lower() == "microsoft.network/trafficmanagerprofiles" and \
                    v["properties"]["dnsConfig"]["relativeName"].lower() == rel.lower():
                raise ArmError(409, "Conflict", f"The domain name {rel}.trafficmanager.net is already in use.")
        props["dnsConfig"]["fqdn"] = f"{rel}.trafficmanager.net".lower()
        props.setdefault("profileStatus", "Enabled")
        mc = props.setdefault("monitorConfig", {})
        mc["profileMonitorStatus"] = "Online" if props.get("endpoints") else "Inactive"
        if props.get("trafficRoutingMethod") == "MultiValue":
            if not props.get("maxReturn"):
                raise ArmError(400, "BadRequest", "MultiValue routing needs maxReturn")
        for e in props.get("endpoints", []):
            t = e.get("type", "")
            seg = t.rsplit("/", 1)[-1].lower()
            if seg not in TM_TYPES:
                raise ArmError(400, "BadRequest", f"endpoint {e.get('name')}: unknown type {t!r}")
            e["type"] = "Microsoft.Network/trafficManagerProfiles/" + TM_TYPES[seg]
            e["id"] = f"{path}/{TM_TYPES[seg]}/{e.get('name')}"
            ep = e.setdefault("properties", {})
            if seg == "externalendpoints" and not ep.get("target"):
                raise ArmError(400, "BadRequest", f"external endpoint {e.get('name')} needs a target")
            ep.setdefault("endpointStatus", "Enabled")
            ep["endpointMonitorStatus"] = "CheckingEndpoint" if ep["endpointStatus"] == "Enabled" else "Disabled"

    def complete_zone(self, path, body, props, old):
        props["nameServers"] = [f"ns{i}-0{i}.azure-dns.fake." for i in range(1, 5)]
        props["maxNumberOfRecordSets"] = 10000
        props["numberOfRecordSets"] = sum(1 for k in self.state.resources if k.startswith(path.lower() + "/"))
        props.setdefault("zoneType", "Public")
        body.pop("etag", None)
        body["etag"] = etag()

    # -- traffic to public addresses ------------------------------------------
    def security_groups_of(self, nic):
        """The NSGs that filter traffic to `nic`: its own and its subnet's."""
        out = []
        own = (nic["properties"].get("networkSecurityGroup") or {}).get("id")
        if own and self.lookup(own):
            out.append(self.lookup(own))
        for ipc in nic["properties"].get("ipConfigurations", [])[:1]:
            subnet = self.lookup((ipc["properties"].get("subnet") or {}).get("id", ""))
            sid = ((subnet or {}).get("properties", {}).get("networkSecurityGroup") or {}).get("id")
            if sid and self.lookup(sid):
                out.append(self.lookup(sid))
        return out

    def open_ports(self, nic, wanted=None):
        """The TCP ports that reach `nic` from the Internet: allowed by every
        NSG on its way, none without one (Standard SKU). `wanted`: the ports
        to ask about; else the ports the NSGs' rules name."""
        nsgs = self.security_groups_of(nic)
        if not nsgs:
            return set()
        if wanted is None:
            wanted = set()
            for nsg in nsgs:
                for r in nsg["properties"].get("securityRules", []):
                    ports = rule_ports(r["properties"])
                    if ports is not None and len(ports) <= 64:
                        wanted |= ports
        return {p for p in wanted if all(allows_from_internet(n, p) for n in nsgs)}

    def wanted_relays(self):
        """(address, port) -> targets, for every public address in use."""
        res = self.state.resources
        out = {}
        nic_of_ip = {}
        for k, v in res.items():
            t = resource_type(k).lower()
            if t == "microsoft.network/networkinterfaces":
                ipc = v["properties"]["ipConfigurations"][0]["properties"]
                nic_of_ip[ipc.get("privateIPAddress")] = v
                vm = res.get((v["properties"].get("virtualMachine") or {}).get("id", "").lower())
                pip = res.get((ipc.get("publicIPAddress") or {}).get("id", "").lower())
                if vm is None or pip is None or vm["properties"].get("provisioningState") != "Succeeded":
                    continue
                for port in self.open_ports(v):
                    out[(pip["properties"]["ipAddress"], port)] = [(ipc["privateIPAddress"], port)]
        for k, lb in res.items():
            if resource_type(k).lower() != "microsoft.network/loadbalancers":
                continue
            lp = lb["properties"]
            fronts = {f["id"].lower(): f for f in lp.get("frontendIPConfigurations", [])}
            pools = {b["id"].lower(): b for b in lp.get("backendAddressPools", [])}
            for r in lp.get("loadBalancingRules", []):
                rp = r["properties"]
                if rp.get("protocol", "").lower() not in ("tcp", "all"):
                    continue
                f = fronts.get(rp["frontendIPConfiguration"]["id"].lower())
                pip = res.get(((f or {}).get("properties", {}).get("publicIPAddress") or {}).get("id", "").lower())
                pool = pools.get((rp.get("backendAddressPool") or {}).get("id", "").lower())
                if pip is None or pool is None:
                    continue
                port = rp.get("backendPort", rp["frontendPort"])
                targets = []
                for a in pool["properties"].get("loadBalancerBackendAddresses", []):
                    ip = a.get("properties", {}).get("ipAddress")
                    nic = nic_of_ip.get(ip)
                    if nic is not None and port in self.open_ports(nic, {port}):
                        targets.append((ip, port))
                out[(pip["properties"]["ipAddress"], rp["frontendPort"])] = targets
        return out

    def sync_relays(self):
        wanted = self.wanted_relays()
        relays = self.state.relays
        for key in [k for k in relays if k not in wanted]:
            relays.pop(key).close()
        for key, targets in wanted.items():
            if key in relays:
                relays[key].targets = targets
                continue
            try:
                relays[key] = Relay(key[0], key[1], targets)
            except OSError as e:
                # Tried again at the next change.
                sys.stderr.write(f"azure-fake: cannot listen on {key[0]}:{key[1]}: {e}\n")

    # -- virtual machines that run --------------------------------------------
    def boot(self, vm):
        if not self.args.run_custom_data or vm is None:
            return
        key = vm["id"].lower()
        custom = self.state.__dict__.get("custom", {}).get(key)
        if custom is None or key in self.state.processes:
            return
        nic = self.state.resources.get(vm["properties"]["networkProfile"]["networkInterfaces"][0]["id"].lower())
        ip = nic["properties"]["ipConfigurations"][0]["properties"]["privateIPAddress"]
        root = tempfile.mkdtemp(prefix="vm-", dir=self.args.vm_dir)
        script = os.path.join(root, "custom-data")
        with open(script, "wb") as f:
            f.write(base64.b64decode(custom))
        env = dict(os.environ, LBSCALE_NODE_ROOT=root, LBSCALE_NODE_LISTEN_IP=ip)
        if self.args.node_bin:
            env["LBSCALE_NODE_BIN"] = self.args.node_bin
        log = open(os.path.join(root, "log"), "ab")
        self.state.processes[key] = subprocess.Popen(["sh", script], cwd=root, env=env, stdout=log, stderr=log,
                                                     stdin=subprocess.DEVNULL, start_new_session=True)

    def halt(self, vm):
        p = self.state.processes.pop(vm["id"].lower(), None)
        if p is not None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()


class Relay:
    """A TCP listener on (address, port) that relays each connection to one
    of its targets; the targets change in place, close() ends it."""

    def __init__(self, address, port, targets):
        self.address, self.port, self.targets = address, port, list(targets)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((address, port))
        self.sock.listen(64)
        self.sock.settimeout(0.5)
        self.closed = False
        threading.Thread(target=self.serve, daemon=True).start()

    def close(self):
        self.closed = True
        try:
            self.sock.close()
        except OSError:
            pass

    def serve(self):
        while not self.closed:
            try:
                client, _ = self.sock.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            threading.Thread(target=self.relay, args=(client,), daemon=True).start()

    def relay(self, client):
        targets = list(self.targets)
        if not targets:
            client.close()
            return
        try:
            upstream = socket.create_connection(random.choice(targets), timeout=5)
        except OSError:
            client.close()
            return
        upstream.settimeout(None)
        client.settimeout(None)

        def pump(a, b):
            try:
                while True:
                    data = a.recv(65536)
                    if not data:
                        break
                    b.sendall(data)
            except OSError:
                pass
            finally:
                try:
                    b.shutdown(socket.SHUT_WR)
                except OSError:
                    pass

        t = threading.Thread(target=pump, args=(upstream, client), daemon=True)
        t.start()
        pump(client, upstream)
        t.join(timeout=600)
        client.close()
        upstream.close()


INTERNET = ("*", "internet", "0.0.0.0/0", "any")


def rule_ports(rp):
    """The ports a security rule names: a set, or None for every port ("*")."""
    specs = list(rp.get("destinationPortRanges") or []) + ([rp["destinationPortRange"]] if rp.get("destinationPortRange") else [])
    out = set()
    for spec in specs:
        if spec == "*":
            return None
        lo, _, hi = spec.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def allows_from_internet(nsg, port):
    """Whether `nsg` lets a TCP connection from the Internet to `port`: its
    inbound rules and default rules by priority, the first that matches."""
    rules = nsg.get("properties", {}).get("securityRules", []) + nsg.get("properties", {}).get("defaultSecurityRules", [])
    for r in sorted(rules, key=lambda r: r["properties"].get("priority", 99999)):
        rp = r["properties"]
        if rp.get("direction", "").lower() != "inbound" or rp.get("protocol", "").lower() not in ("tcp", "*"):
            continue
        sources = [rp.get("sourceAddressPrefix")] if rp.get("sourceAddressPrefix") else list(rp.get("sourceAddressPrefixes") or [])
        if not any(str(x).lower() in INTERNET for x in sources):
            continue
        ports = rule_ports(rp)
        if ports is not None and port not in ports:
            continue
        return rp.get("access", "").lower() == "allow"
    return False


def merge(a, b):
    if isinstance(a, dict) and isinstance(b, dict):
        for k, v in b.items():
            a[k] = merge(a.get(k), v) if k in a else v
        return a
    return b


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    fake = None

    def log_message(self, fmt, *args):
        if self.fake.args.verbose:
            sys.stderr.write("azure-fake: " + (fmt % args) + "\n")

    def do_GET(self):
        self.handle_any("GET")

    def do_PUT(self):
        self.handle_any("PUT")

    def do_PATCH(self):
        self.handle_any("PATCH")

    def do_DELETE(self):
        self.handle_any("DELETE")

    def do_POST(self):
        self.handle_any("POST")

    def handle_any(self, method):
        url = urllib.parse.urlsplit(self.path)
        path = urllib.parse.unquote(url.path)
        query = dict(urllib.parse.parse_qsl(url.query, keep_blank_values=True))
        n = int(self.headers.get("content-length") or 0)
        raw = self.rfile.read(n) if n else b""
        headers = {k.lower(): v for k, v in self.headers.items()}
        h = {}
        try:
            if path.startswith("/_fake/"):
                status, out = self.control(method, path, raw)
            elif method == "POST" and re.match(r"^/[^/]+/oauth2/v2\.0/token$", path):
                form = dict(urllib.parse.parse_qsl(raw.decode()))
                status, out = self.fake.login(path.split("/")[1], form)
            elif method == "GET" and re.match(r"^/[^/]+/v2\.0/\.well-known/openid-configuration$", path):
                # What MSAL (azure-identity) reads before it asks for a token.
                tenant = path.split("/")[1]
                base = f"{self.fake.args.url}/{tenant}"
                status, out = 200, {"token_endpoint": f"{base}/oauth2/v2.0/token",
                                    "authorization_endpoint": f"{base}/oauth2/v2.0/authorize",
                                    "device_authorization_endpoint": f"{base}/oauth2/v2.0/devicecode",
                                    "issuer": f"{base}/v2.0", "tenant_region_scope": None,
                                    "token_endpoint_auth_methods_supported": ["client_secret_post", "private_key_jwt"]}
            elif method == "GET" and path == "/metadata/identity/oauth2/token":
                status, out = self.fake.metadata_token(query, headers)
            else:
                status, out, h = self.fake.arm(method, path, query, headers, raw)
        except ArmError as e:
            status, out, h = e.status, {"error": {"code": e.code, "message": e.message}}, e.headers
        except Exception as e:  # a bug of the fake: said, not hidden
            import traceback
            traceback.print_exc()
            status, out, h = 500, {"error": {"code": "FakeInternalError", "message": f"{type(e).__name__}: {e}"}}, {}
        data = b"" if out is None else json.dumps(out).encode()
        self.send_response(status)
        h = dict(h)
        h.setdefault("x-ms-request-id", str(uuid.uuid4()))
        if out is not None:
            h["Content-Type"] = "application/json; charset=utf-8"
        if isinstance(out, dict) and out.get("etag") and method in ("GET", "PUT", "PATCH"):
            h["ETag"] = out["etag"]
        for k, v in h.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
        if self.fake.log and not path.startswith("/_fake/"):
            entry = {
                "time": time.time(), "method": method, "path": path, "query": query,
                "request_headers": {k: v for k, v in headers.items() if k != "authorization"},
                "request_body": raw.decode(errors="replace") if raw and "oauth2" not in path else None,
                "status": status, "response_headers": h,
                "response_body": None if out is None or "access_token" in (out or {}) else out,
            }
            with LOCK, open(self.fake.log, "a") as f:
                f.write(json.dumps(entry) + "\n")

    def control(self, method, path, raw):
        st = self.fake.state
        body = json.loads(raw) if raw else {}
        with LOCK:
            if path == "/_fake/state" and method == "GET":
                return 200, {"resources": st.resources, "disks": st.disks,
                             "processes": {k: p.pid for k, p in st.processes.items() if p.poll() is None},
                             "relays": {f"{a}:{p}": [f"{h}:{q}" for h, q in r.targets] for (a, p), r in st.relays.items()},
                             "prefixes": {"private": st.private.prefix + ".", "public": st.public.prefix + "."}}
            if path == "/_fake/faults" and method == "POST":
                body.setdefault("count", 1)
                st.faults.append(body)
                return 200, {"faults": st.faults}
            if path == "/_fake/tokens" and method == "POST":
                st.expires_in = int(body["expires_in"])
                return 200, {"expires_in": st.expires_in}
            if path == "/_fake/clients" and method == "POST":
                st.clients[body["client_id"]] = body["secret"]
                return 200, {}
            if path == "/_fake/grants" and method == "GET":
                return 200, {"grants": st.grants}
            if path == "/_fake/requests" and method == "GET":
                return 200, {"requests": st.requests}
        return 404, {"error": {"code": "NotFound", "message": f"no control {method} {path}"}}


class Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    allow_reuse_address = True


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--cert")
    ap.add_argument("--key")
    ap.add_argument("--specs", default=os.path.join(here, "..", "api", "specification"))
    ap.add_argument("--location", default="westeurope")
    ap.add_argument("--retry-after", type=int, default=1, help="Retry-After of long-running operations, seconds")
    ap.add_argument("--lro-polls", type=int, default=1, help="polls an operation answers InProgress to first")
    ap.add_argument("--lro-seconds", type=float, default=0.0)
    ap.add_argument("--private-prefix", default="127.91")
    ap.add_argument("--public-prefix", default="127.92")
    ap.add_argument("--frontend-prefix", default="127.93")
    ap.add_argument("--run-custom-data", action="store_true")
    ap.add_argument("--vm-dir", default=tempfile.gettempdir())
    ap.add_argument("--node-bin", help="the lbscale-node that VMs' custom data runs (LBSCALE_NODE_BIN)")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args()
    scheme = "https" if args.cert else "http"
    args.url = f"{scheme}://{args.host}:{args.port}"
    Handler.fake = Fake(args)
    srv = Server((args.host, args.port), Handler)
    if args.cert:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(args.cert, args.key)
        srv.socket = ctx.wrap_socket(srv.socket, server_side=True)

    def stop(*_):
        for r in list(Handler.fake.state.relays.values()):
            r.close()
        for p in list(Handler.fake.state.processes.values()):
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        os._exit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    print(f"azure-fake: {len(Handler.fake.specs.operations)} operations, listening on {args.url}", file=sys.stderr, flush=True)
    srv.serve_forever()


if __name__ == "__main__":
    main()
