#!/usr/bin/env python3
"""A stateful stand-in for Google's Compute Engine v1 and Cloud DNS v1 REST
APIs, for the tests of lbscale's gcp driver (nothing real can run here).

It routes every request by the methods of Google's discovery documents
(clouds/gcp/api/*.json, trimmed copies), checks path and query parameters
against them, validates each request body and each response it sends against
their schemas (an unknown field is refused, as Google refuses one), answers
errors in Google's JSON error envelope, and returns operations that finish
later (waited on through zoneOperations/regionOperations get and wait; DNS
changes go from `pending` to `done`). OAuth: an emulated token endpoint
verifies the RS256 JWT of a service-account key that the fake made, and a
metadata server (plain HTTP, `GCE_METADATA_HOST`) hands out tokens; every API
call needs a bearer token the fake issued and that has not expired.

Control endpoints (no auth, loopback only) under /_fake/: `state` (GET, all
it holds), `faults` (POST {"method": id, "status": 429, "reason": "...",
"times": N}: the next N calls of that method fail), `token` (POST: a token for
a client such as gcloud), `images` and `subnetworks` (POST: add one),
`config` (POST {"token_lifetime": s, "operation_delay": s}).

Usage: gcp_fake.py --dir DIR --port P --metadata-port M --cert C --key K
Writes DIR/service-account.json (a key whose token_uri is this fake).
Traffic goes as JSON lines to $LBSCALE_FAKE_TRAFFIC_LOG when it is set.
"""
import argparse
import base64
import copy
import hashlib
import http.server
import ipaddress
import json
import os
import re
import secrets
import ssl
import subprocess
import sys
import threading
import time
import urllib.parse

HERE = os.path.dirname(os.path.abspath(__file__))
API_DIR = os.path.join(HERE, "..", "api")
PROJECT = "lbscale-test"
# Region -> its zones and its default subnetwork's range.
REGIONS = {
    "us-central1": (["us-central1-a", "us-central1-b", "us-central1-c"], "10.128.0.0/20"),
    "europe-west1": (["europe-west1-b", "europe-west1-c", "europe-west1-d"], "10.132.0.0/20"),
}
MACHINE_TYPES = {"e2-micro", "e2-small", "e2-medium", "e2-standard-2", "n2-standard-2", "c3-standard-4"}
# External addresses (instances' and load balancers') from a loopback range.
EXTERNAL = ipaddress.ip_network("127.77.0.0/16")
# Query parameters that Google's API takes and the Cloud SDK sends, but that
# the documents' revision does not list: gcloud 528 asks aggregated lists for
# `returnPartialSuccess`. Named here, one by one, rather than let any through.
UNLISTED_QUERY = {"returnPartialSuccess": {"type": "boolean", "location": "query"}}


class ApiError(Exception):
    def __init__(self, code, reason, message, status=None):
        super().__init__(message)
        self.code, self.reason, self.message = code, reason, message
        self.status = status or {400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED",
                                 404: "NOT_FOUND", 409: "ALREADY_EXISTS", 412: "FAILED_PRECONDITION",
                                 429: "RESOURCE_EXHAUSTED", 500: "INTERNAL",
                                 503: "UNAVAILABLE"}.get(code, "UNKNOWN")

    def envelope(self):
        return {"error": {"code": self.code, "message": self.message, "status": self.status,
                          "errors": [{"message": self.message, "domain": "global", "reason": self.reason}]}}


def bad(message, reason="invalid"):
    return ApiError(400, reason, message)


# --- The discovery documents: routes and schema validation -------------------

class Discovery:
    def __init__(self, path):
        self.doc = json.load(open(path))
        self.schemas = self.doc["schemas"]
        self.common = self.doc.get("parameters", {})
        self.routes = []
        self._walk(self.doc["resources"])

    def _walk(self, resources):
        for res in resources.values():
            for m in res.get("methods", {}).values():
                template = "/" + self.doc["servicePath"] + m.get("flatPath", m["path"])
                rx = re.sub(r"\{\+?([A-Za-z_]+)\}", lambda g: "(?P<%s>[^/]+)" % g.group(1), template)
                self.routes.append((m["httpMethod"], re.compile(rx + "$"), m))
            self._walk(res.get("resources", {}))

    def route(self, verb, path):
        for v, rx, m in self.routes:
            g = rx.match(path)
            if g and v == verb:
                return m, {k: urllib.parse.unquote(x) for k, x in g.groupdict().items()}
        return None, None

    def check_params(self, m, path_params, query):
        params = m.get("parameters", {})
        for name, value in path_params.items():
            p = params[name]
            if "pattern" in p and not re.fullmatch(p["pattern"], value):
                raise bad(f"Invalid value for field '{name}': '{value}'. Must match the pattern {p['pattern']}")
        for name, values in query.items():
            p = params.get(name) or self.common.get(name)
            if p is None and m["id"].endswith(".aggregatedList"):
                p = UNLISTED_QUERY.get(name)
            if p is None or p.get("location") != "query":
                raise bad(f"Invalid JSON payload received. Unknown name \"{name}\": Cannot bind query parameter.")
            if len(values) > 1 and not p.get("repeated"):
                raise bad(f"query parameter {name} given {len(values)} times")
            for v in values:
                self.check_scalar(p, v, name, from_query=True)
        for name, p in params.items():
            if p.get("required") and p.get("location") == "query" and name not in query:
                raise bad(f"Required parameter {name} is missing")

    def check_scalar(self, p, v, where, from_query=False):
        t = p.get("type")
        if t == "string":
            if not isinstance(v, str):
                raise bad(f"Invalid value at '{where}': expected a string, got {json.dumps(v)}")
            if p.get("format") in ("int64", "uint64") and not re.fullmatch(r"-?[0-9]+", v):
                raise bad(f"Invalid value at '{where}' ({p['format']}), \"{v}\"")
            if "enum" in p and v not in p["enum"]:
                raise bad(f"Invalid value at '{where}', \"{v}\": allowed {p['enum']}")
            if p.get("format") == "byte":
                try:
                    base64.b64decode(v.replace("-", "+").replace("_", "/"), validate=True)
                except ValueError:
                    raise bad(f"Invalid value at '{where}' (TYPE_BYTES), Base64 decoding failed for \"{v}\"")
            if "pattern" in p and not from_query and not re.fullmatch(p["pattern"], v):
                raise bad(f"Invalid value for field '{where}': '{v}'. Must match the pattern {p['pattern']}")
        elif t == "integer":
            if from_query:
                if not re.fullmatch(r"-?[0-9]+", v):
                    raise bad(f"Invalid value at '{where}' (TYPE_INT32), \"{v}\"")
                v = int(v)
            if not isinstance(v, int) or isinstance(v, bool):
                raise bad(f"Invalid value at '{where}' (TYPE_INT32), {json.dumps(v)}")
            if "minimum" in p and v < int(p["minimum"]):
                raise bad(f"Invalid value at '{where}': below {p['minimum']}")
        elif t == "boolean":
            ok = v.lower() in ("true", "false") if from_query else isinstance(v, bool)
            if not ok:
                raise bad(f"Invalid value at '{where}' (TYPE_BOOL), {json.dumps(v)}")
        elif t == "number":
            if from_query:
                try:
                    float(v)
                except ValueError:
                    raise bad(f"Invalid value at '{where}' (TYPE_DOUBLE), \"{v}\"")
            elif not isinstance(v, (int, float)) or isinstance(v, bool):
                raise bad(f"Invalid value at '{where}' (TYPE_DOUBLE), {json.dumps(v)}")

    def validate(self, value, schema, where, method_id=None):
        """Raises ApiError(400) naming the first field that does not fit."""
        if "$ref" in schema:
            schema = self.schemas[schema["$ref"]]
        t = schema.get("type")
        if t == "object":
            if not isinstance(value, dict):
                raise bad(f"Invalid value at '{where}': expected an object")
            props = schema.get("properties", {})
            extra = schema.get("additionalProperties")
            for k, v in value.items():
                if k in props:
                    self.validate(v, props[k], f"{where}.{k}" if where else k, method_id)
                elif extra is not None:
                    self.validate(v, extra, f"{where}[{k}]", method_id)
                else:
                    raise bad(f"Invalid JSON payload received. Unknown name \"{k}\" at '{where}': Cannot find field.")
            if method_id:
                for k, p in props.items():
                    if method_id in p.get("annotations", {}).get("required", []) and k not in value:
                        raise bad(f"Invalid value for field '{where + '.' if where else ''}{k}': required", "required")
        elif t == "array":
            if not isinstance(value, list):
                raise bad(f"Invalid value at '{where}': expected a list")
            for i, v in enumerate(value):
                self.validate(v, schema.get("items", {}), f"{where}[{i}]", method_id)
        elif t == "any" or t is None:
            return
        else:
            self.check_scalar(schema, value, where)


# --- Tokens: the JWT grant and the metadata server -------------------------

def b64url(data):
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def fingerprint():
    """A `format: byte` value: base64 with its padding, as Google sends one."""
    return base64.b64encode(os.urandom(8)).decode()


def unb64url(s):
    return base64.urlsafe_b64decode(s + "=" * (-len(s) % 4))


SHA256_PREFIX = bytes.fromhex("3031300d060960864801650304020105000420")


def rsa_verify(n, e, message, signature):
    """RSASSA-PKCS1-v1_5 with SHA-256 (RS256)."""
    k = (n.bit_length() + 7) // 8
    if len(signature) != k:
        return False
    em = pow(int.from_bytes(signature, "big"), e, n).to_bytes(k, "big")
    digest = SHA256_PREFIX + hashlib.sha256(message).digest()
    expected = b"\x00\x01" + b"\xff" * (k - 3 - len(digest)) + b"\x00" + digest
    return secrets.compare_digest(em, expected)


def make_key(dir, token_uri):
    """A service-account key (openssl makes the RSA key) and its public part."""
    pem = os.path.join(dir, "sa-key.pem")
    subprocess.run(["openssl", "genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048", "-out", pem],
                   check=True, capture_output=True)
    out = subprocess.run(["openssl", "rsa", "-in", pem, "-noout", "-modulus"], check=True,
                         capture_output=True, text=True).stdout
    n = int(out.strip().split("=", 1)[1], 16)
    key_id = secrets.token_hex(20)
    key = {
        "type": "service_account",
        "project_id": PROJECT,
        "private_key_id": key_id,
        "private_key": open(pem).read(),
        "client_email": f"lbscale@{PROJECT}.iam.gserviceaccount.com",
        "client_id": str(secrets.randbelow(10**20)),
        "auth_uri": "https://accounts.google.com/o/oauth2/auth",
        "token_uri": token_uri,
    }
    path = os.path.join(dir, "service-account.json")
    with open(path, "w") as f:
        json.dump(key, f, indent=1)
    os.chmod(path, 0o600)
    os.remove(pem)
    return key_id, key["client_email"], n


# --- State ------------------------------------------------------------------

def now_rfc3339(t=None):
    t = time.time() if t is None else t
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + ".%03d-00:00" % (int(t * 1000) % 1000)


class Fake:
    def __init__(self, args):
        self.lock = threading.RLock()
        self.compute = Discovery(os.path.join(API_DIR, "compute.v1.json"))
        self.dns = Discovery(os.path.join(API_DIR, "dns.v1.json"))
        self.token_lifetime = 3600
        self.operation_delay = 0.3
        self.tokens = {}  # token -> expiry (epoch seconds)
        self.faults = []  # {"method", "status", "reason", "times"}
        self.next_id = 1000
        self.images = {f"projects/{PROJECT}/global/images/lbscale-node"}
        # Region -> subnetwork name -> range; the next host of each.
        self.subnets = {r: {"default": cidr} for r, (_, cidr) in REGIONS.items()}
        self.next_host = {}
        self.next_external = 2
        self.instances = {}  # (zone, name) -> Instance
        self.addresses = {}  # (region, name) -> Address
        self.pools = {}  # (region, name) -> TargetPool
        self.rules = {}  # (region, name) -> ForwardingRule
        self.firewalls = {}  # name -> Firewall
        self.operations = {}  # (scope, name) -> [Operation, due, on_done]
        self.request_ids = {}  # requestId -> (scope, operation name)
        self.zones = {}  # managed zone name -> ManagedZone
        self.records = {}  # zone -> {(name, type): ResourceRecordSet}
        self.changes = {}  # zone -> {id: [Change, due]}
        self.key_id, self.client_email, self.modulus = make_key(args.dir, f"https://127.0.0.1:{args.port}/token")
        self.log_path = os.environ.get("LBSCALE_FAKE_TRAFFIC_LOG")
        self.dir = args.dir
        self.node_bin = args.node_bin
        self.booted = {}  # (zone, name) -> pid of its startup script's process group

    def boot(self, zone, instance):
        """Runs an instance's startup script as its boot would, when its
        private address is on this machine (a loopback subnetwork) and the
        fake was given lbscale-node: files in a directory of its own instead
        of /etc/lbscale, listening on its address instead of every address,
        the metadata server's answer about its address given by a `curl` on
        the PATH."""
        ip = instance["networkInterfaces"][0].get("networkIP", "")
        items = {i["key"]: i.get("value", "") for i in instance["metadata"].get("items", [])}
        if not self.node_bin or not ip.startswith("127.") or "startup-script" not in items:
            return
        d = os.path.join(self.dir, "instances", zone, instance["name"])
        os.makedirs(os.path.join(d, "bin"), exist_ok=True)
        script = items["startup-script"].replace("/etc/lbscale", d).replace("--listen-ip 0.0.0.0", f"--listen-ip {ip}")
        with open(os.path.join(d, "boot.sh"), "w") as f:
            f.write(script)
        curl = os.path.join(d, "bin", "curl")
        with open(curl, "w") as f:
            f.write(f"#!/bin/sh\ncase \"$*\" in\n  *network-interfaces/0/ip*) printf '%s' '{ip}' ;;\n  *) exit 22 ;;\nesac\n")
        os.chmod(curl, 0o755)
        env = dict(os.environ, PATH=f"{d}/bin:{self.node_bin}:{os.environ.get('PATH', '')}")
        log = open(os.path.join(d, "node.log"), "ab")
        p = subprocess.Popen(["sh", os.path.join(d, "boot.sh")], env=env, stdout=log, stderr=log,
                             stdin=subprocess.DEVNULL, start_new_session=True)
        self.booted[(zone, instance["name"])] = p.pid

    def halt(self, zone, name):
        pid = self.booted.pop((zone, name), None)
        if pid:
            try:
                os.killpg(pid, 9)
            except ProcessLookupError:
                pass

    def new_id(self):
        self.next_id += 1
        return str(self.next_id * 7919)

    def issue_token(self):
        token = "ya29.fake-" + secrets.token_urlsafe(24)
        self.tokens[token] = time.time() + self.token_lifetime
        return {"access_token": token, "expires_in": self.token_lifetime, "token_type": "Bearer"}

    def check_auth(self, headers):
        h = headers.get("Authorization", "")
        token = h[len("Bearer "):] if h.startswith("Bearer ") else None
        expiry = self.tokens.get(token)
        if expiry is None:
            raise ApiError(401, "authError", "Request had invalid authentication credentials. Expected OAuth 2 access token.")
        if expiry < time.time():
            raise ApiError(401, "authError", "Request had invalid authentication credentials: the access token expired.")

    def jwt_grant(self, form):
        def refuse(why):
            return 400, {"error": "invalid_grant", "error_description": why}
        if form.get("grant_type") != ["urn:ietf:params:oauth:grant-type:jwt-bearer"]:
            return 400, {"error": "unsupported_grant_type", "error_description": "Invalid grant_type"}
        parts = form.get("assertion", [""])[0].split(".")
        if len(parts) != 3:
            return refuse("Invalid JWT: not three parts")
        try:
            header, claims = json.loads(unb64url(parts[0])), json.loads(unb64url(parts[1]))
            sig = unb64url(parts[2])
        except Exception:
            return refuse("Invalid JWT: undecodable")
        if header.get("alg") != "RS256" or header.get("kid") != self.key_id:
            return refuse("Invalid JWT: alg must be RS256 and kid the key's private_key_id")
        if not rsa_verify(self.modulus, 65537, (parts[0] + "." + parts[1]).encode(), sig):
            return refuse("Invalid JWT Signature.")
        t = time.time()
        if claims.get("iss") != self.client_email:
            return refuse("Invalid JWT: iss is not the key's client_email")
        if not str(claims.get("aud", "")).endswith("/token"):
            return refuse("Invalid JWT: aud must be the token_uri")
        if "scope" not in claims:
            return refuse("Invalid JWT: no scope")
        iat, exp = claims.get("iat", 0), claims.get("exp", 0)
        if not (iat - 300 <= t <= exp + 300) or exp - iat > 3600:
            return refuse("Invalid JWT: Token must be a short-lived token (60 minutes) and in a reasonable timeframe.")
        return 200, self.issue_token()

    def take_fault(self, method_id):
        for f in self.faults:
            if f["method"] == method_id and f["times"] > 0:
                f["times"] -= 1
                return ApiError(f["status"], f.get("reason", "backendError"), f.get("message", "injected fault"))
        return None

    # -- operations --

    def operation(self, base, kind, scope, target_link, op_type, on_done, request_id=None, error=None):
        """A pending operation that finishes (runs on_done) after the delay."""
        if request_id and request_id in self.request_ids:
            key = self.request_ids[request_id]
            return self.op_view(base, key)
        name = "operation-%d-%s" % (int(time.time() * 1000), secrets.token_hex(4))
        op = {"kind": "compute#operation", "id": self.new_id(), "name": name, "operationType": op_type,
              "targetLink": target_link, "targetId": self.new_id(), "status": "PENDING", "progress": 0,
              "insertTime": now_rfc3339(), "user": self.client_email}
        op[kind] = scope  # "zone" or "region": its name; made a URL in views
        key = (kind, scope, name)
        self.operations[key] = [op, time.time() + self.operation_delay, on_done, error]
        if request_id:
            self.request_ids[request_id] = key
        return self.op_view(base, key)

    def advance(self):
        t = time.time()
        for entry in self.operations.values():
            op, due, on_done, error = entry
            if op["status"] != "DONE" and t >= due:
                op["status"], op["progress"], op["endTime"] = "DONE", 100, now_rfc3339()
                if error:
                    op["error"] = {"errors": [{"code": error[0], "message": error[1]}]}
                    op["httpErrorStatusCode"], op["httpErrorMessage"] = 400, "BAD REQUEST"
                elif on_done:
                    on_done()
            elif op["status"] == "PENDING":
                op["status"], op["startTime"], op["progress"] = "RUNNING", now_rfc3339(), 50
        for zone in self.changes.values():
            for entry in zone.values():
                if entry[0]["status"] == "pending" and t >= entry[1]:
                    entry[0]["status"] = "done"

    def op_view(self, base, key):
        op = copy.deepcopy(self.operations[key][0])
        kind, scope, name = key
        if kind == "global":
            op.pop("global", None)
            op["selfLink"] = f"{base}projects/{PROJECT}/global/operations/{name}"
            return op
        where = "zones" if kind == "zone" else "regions"
        op[kind] = f"{base}projects/{PROJECT}/{where}/{scope}"
        op["selfLink"] = f"{base}projects/{PROJECT}/{where}/{scope}/operations/{name}"
        return op


def region_of(zone):
    for r, (zones, _) in REGIONS.items():
        if zone in zones:
            return r
    return None


def short(ref):
    """A resource reference without its URL base and project: `zones/z/...`."""
    ref = re.sub(r"^https?://[^/]+/compute/v1/", "", ref)
    return re.sub(r"^projects/[^/]+/", "", ref)


def parse_filter(expr):
    """Compute's list filter, as far as clients use it: `field = value`
    terms (labels.K, name, status), optionally in parentheses, joined by AND
    or blanks. Anything else is refused, never ignored."""
    terms = []
    rest = expr.strip()
    term = re.compile(r'\(?\s*([A-Za-z][\w.\-]*)\s*(=|eq|!=|ne)\s*"?([^"()\s]*)"?\s*\)?\s*(?:AND\s+)?')
    while rest:
        m = term.match(rest)
        if not m:
            raise bad(f"Invalid value for field 'filter': '{expr}'. Invalid list filter expression.")
        terms.append((m.group(1), m.group(2), m.group(3)))
        rest = rest[m.end():]
    return terms


def matches(resource, terms):
    for field, op, value in terms:
        v = resource
        for part in field.split("."):
            v = v.get(part) if isinstance(v, dict) else None
        if op in ("eq", "ne"):  # RE2 full match
            hit = v is not None and re.fullmatch(value, str(v)) is not None
        else:
            hit = v is not None and str(v) == value
        if hit != (op in ("=", "eq")):
            return False
    return True


# --- Compute Engine ---------------------------------------------------------

class Compute:
    def __init__(self, fake):
        self.f = fake

    def url(self, base, *parts):
        return base + f"projects/{PROJECT}/" + "/".join(parts)

    def zone_or_404(self, zone):
        if region_of(zone) is None:
            raise ApiError(404, "notFound", f"The resource 'projects/{PROJECT}/zones/{zone}' was not found")

    def region_or_404(self, region):
        if region not in REGIONS:
            raise ApiError(404, "notFound", f"The resource 'projects/{PROJECT}/regions/{region}' was not found")

    def page(self, items, q, kind, base, scope):
        """A list answer, paged by maxResults and pageToken, filtered by filter."""
        if "filter" in q:
            terms = parse_filter(q["filter"][0])
            items = [i for i in items if matches(i, terms)]
        items = sorted(items, key=lambda i: i["name"])
        start = int(q.get("pageToken", ["0"])[0] or 0)
        size = int(q.get("maxResults", ["500"])[0])
        out = {"kind": kind, "id": f"projects/{PROJECT}/{scope}", "items": items[start:start + size],
               "selfLink": base + f"projects/{PROJECT}/{scope}"}
        if start + size < len(items):
            out["nextPageToken"] = str(start + size)
        return out

    # zones, regions, subnetworks

    def zone_view(self, base, zone):
        region = region_of(zone)
        return {"kind": "compute#zone", "id": self.f.new_id(), "name": zone, "status": "UP",
                "region": self.url(base, "regions", region), "selfLink": self.url(base, "zones", zone),
                "creationTimestamp": "2014-05-30T18:35:16.514-07:00", "description": zone}

    def zones_get(self, base, p, q, body):
        self.zone_or_404(p["zone"])
        return self.zone_view(base, p["zone"])

    def zones_list(self, base, p, q, body):
        items = [self.zone_view(base, z) for zs, _ in REGIONS.values() for z in zs]
        return self.page(items, q, "compute#zoneList", base, "zones")

    def regions_get(self, base, p, q, body):
        self.region_or_404(p["region"])
        zones, _ = REGIONS[p["region"]]
        return {"kind": "compute#region", "id": self.f.new_id(), "name": p["region"], "status": "UP",
                "zones": [self.url(base, "zones", z) for z in zones],
                "selfLink": self.url(base, "regions", p["region"])}

    def subnetworks_get(self, base, p, q, body):
        self.region_or_404(p["region"])
        cidr = self.f.subnets[p["region"]].get(p["subnetwork"])
        if cidr is None:
            raise ApiError(404, "notFound", f"The resource 'projects/{PROJECT}/regions/{p['region']}/subnetworks/{p['subnetwork']}' was not found")
        return {"kind": "compute#subnetwork", "id": self.f.new_id(), "name": p["subnetwork"], "ipCidrRange": cidr,
                "network": self.url(base, "global/networks/default"), "region": self.url(base, "regions", p["region"]),
                "gatewayAddress": str(next(ipaddress.ip_network(cidr).hosts())),
                "selfLink": self.url(base, "regions", p["region"], "subnetworks", p["subnetwork"])}

    def next_private(self, region, subnet):
        net = ipaddress.ip_network(self.f.subnets[region][subnet])
        n = self.f.next_host.get((region, subnet), 2)
        self.f.next_host[(region, subnet)] = n + 1
        return str(net.network_address + n)

    def next_external(self):
        n = self.f.next_external
        self.f.next_external += 1
        return str(EXTERNAL.network_address + n)

    # instances

    def instances_insert(self, base, p, q, body):
        zone = p["zone"]
        self.zone_or_404(zone)
        region = region_of(zone)
        name = body["name"]
        rid = q.get("requestId", [None])[0]
        if rid in self.f.request_ids:  # the same request again: its operation
            return self.f.op_view(base, self.f.request_ids[rid])
        if (zone, name) in self.f.instances:
            raise ApiError(409, "alreadyExists", f"The resource 'projects/{PROJECT}/zones/{zone}/instances/{name}' already exists")
        mt = short(body.get("machineType", ""))
        m = re.fullmatch(r"zones/([^/]+)/machineTypes/([^/]+)", mt)
        if not m or m.group(1) != zone or m.group(2) not in MACHINE_TYPES:
            raise bad(f"Invalid value for field 'resource.machineType': '{body.get('machineType')}'. Machine type with name '{mt.split('/')[-1]}' does not exist in zone '{zone}'.")
        disks = body.get("disks", [])
        boot = [d for d in disks if d.get("boot")]
        if len(boot) != 1:
            raise bad("Invalid value for field 'resource.disks': exactly one boot disk is required.")
        image = boot[0].get("initializeParams", {}).get("sourceImage", "")
        image_ref = re.sub(r"^https?://[^/]+/compute/v1/", "", image)
        if not image_ref.startswith("projects/"):
            image_ref = f"projects/{PROJECT}/" + image_ref
        if image_ref not in self.f.images:
            raise ApiError(404, "notFound", f"The resource '{image_ref}' was not found")
        nics = body.get("networkInterfaces", [])
        if len(nics) != 1:
            raise bad("Invalid value for field 'resource.networkInterfaces': one network interface is expected by this fake.")
        nic = copy.deepcopy(nics[0])
        sub = short(nic.get("subnetwork", f"regions/{region}/subnetworks/default"))
        m = re.fullmatch(r"regions/([^/]+)/subnetworks/([^/]+)", sub)
        if not m or m.group(1) != region or m.group(2) not in self.f.subnets.get(region, {}):
            raise bad(f"Invalid value for field 'resource.networkInterfaces[0].subnetwork': '{nic.get('subnetwork')}'. The referenced subnetwork resource cannot be found (or is not in the zone's region {region}).")
        for k, v in (body.get("labels") or {}).items():
            if not re.fullmatch(r"[a-z][a-z0-9_-]{0,62}", k) or not re.fullmatch(r"[a-z0-9_-]{0,63}", v):
                raise bad(f"Invalid value for field 'resource.labels': '{k}={v}'. Label keys and values must be lowercase letters, digits, - or _.")
        nic.update({"kind": "compute#networkInterface", "name": "nic0", "network": self.url(base, "global/networks/default"),
                    "subnetwork": self.url(base, "regions", region, "subnetworks", m.group(2)), "stackType": "IPV4_ONLY"})
        nic_external = []
        for ac in nic.get("accessConfigs", []):
            ac = dict(ac)
            ac.setdefault("type", "ONE_TO_ONE_NAT")
            ac.setdefault("name", "External NAT")
            ac["kind"] = "compute#accessConfig"
            nic_external.append(ac)
        nic["accessConfigs"] = nic_external
        metadata = body.get("metadata") or {}
        keys = [i.get("key") for i in metadata.get("items", [])]
        if len(keys) != len(set(keys)):
            raise bad("Invalid value for field 'resource.metadata': duplicate keys.")
        instance = {
            "kind": "compute#instance", "id": self.f.new_id(), "name": name, "status": "PROVISIONING",
            "creationTimestamp": now_rfc3339(), "zone": self.url(base, "zones", zone),
            "machineType": self.url(base, "zones", zone, "machineTypes", m and mt.split("/")[-1]),
            "selfLink": self.url(base, "zones", zone, "instances", name),
            "labels": body.get("labels", {}), "labelFingerprint": fingerprint(),
            "metadata": {"kind": "compute#metadata", "fingerprint": fingerprint(),
                         "items": metadata.get("items", [])},
            "networkInterfaces": [nic],
            "disks": [{"kind": "compute#attachedDisk", "boot": True, "autoDelete": True, "index": 0,
                       "type": "PERSISTENT", "mode": "READ_WRITE", "deviceName": "persistent-disk-0",
                       "source": self.url(base, "zones", zone, "disks", name)}],
            "serviceAccounts": body.get("serviceAccounts", []),
            "tags": body.get("tags", {}),
            "scheduling": body.get("scheduling", {"automaticRestart": True, "onHostMaintenance": "MIGRATE"}),
        }
        if "description" in body:
            instance["description"] = body["description"]

        def done():
            nic["networkIP"] = self.next_private(region, m.group(2))
            for ac in nic["accessConfigs"]:
                ac.setdefault("natIP", self.next_external())
            instance["status"] = "RUNNING"
            instance["lastStartTimestamp"] = now_rfc3339()
            self.f.boot(zone, instance)

        self.f.instances[(zone, name)] = instance
        return self.f.operation(base, "zone", zone, instance["selfLink"], "insert", done, rid)

    def instance_or_404(self, zone, name):
        i = self.f.instances.get((zone, name))
        if i is None:
            raise ApiError(404, "notFound", f"The resource 'projects/{PROJECT}/zones/{zone}/instances/{name}' was not found")
        return i

    def instances_get(self, base, p, q, body):
        self.zone_or_404(p["zone"])
        return copy.deepcopy(self.instance_or_404(p["zone"], p["instance"]))

    def instances_list(self, base, p, q, body):
        self.zone_or_404(p["zone"])
        items = [copy.deepcopy(i) for (z, _), i in self.f.instances.items() if z == p["zone"]]
        return self.page(items, q, "compute#instanceList", base, f"zones/{p['zone']}/instances")

    def instances_aggregated(self, base, p, q, body):
        terms = parse_filter(q["filter"][0]) if "filter" in q else []
        out = {}
        for zs, _ in REGIONS.values():
            for z in zs:
                items = [copy.deepcopy(i) for (iz, _), i in self.f.instances.items() if iz == z and matches(i, terms)]
                out[f"zones/{z}"] = {"instances": sorted(items, key=lambda i: i["name"])} if items else {
                    "warning": {"code": "NO_RESULTS_ON_PAGE", "message": f"There are no results for scope 'zones/{z}' on this page.",
                                "data": [{"key": "scope", "value": f"zones/{z}"}]}}
        return {"kind": "compute#instanceAggregatedList", "id": f"projects/{PROJECT}/aggregated/instances",
                "items": out, "selfLink": self.url(base, "aggregated/instances")}

    def instances_delete(self, base, p, q, body):
        zone = p["zone"]
        self.zone_or_404(zone)
        i = self.instance_or_404(zone, p["instance"])
        i["status"] = "STOPPING"

        def done():
            self.f.instances.pop((zone, p["instance"]), None)
            self.f.halt(zone, p["instance"])
            for pool in self.f.pools.values():
                pool["instances"] = [u for u in pool.get("instances", []) if short(u) != short(i["selfLink"])]

        return self.f.operation(base, "zone", zone, i["selfLink"], "delete", done, q.get("requestId", [None])[0])

    # operations

    def op_get(self, kind):
        def get(base, p, q, body, wait=False):
            scope = {"zone": p.get("zone"), "region": p.get("region"), "global": "global"}[kind]
            key = (kind, scope, p["operation"])
            if key not in self.f.operations:
                where = {"zone": "zones", "region": "regions", "global": "global"}[kind]
                raise ApiError(404, "notFound", f"The resource 'projects/{PROJECT}/{where}/{scope}/operations/{p['operation']}' was not found")
            return self.f.op_view(base, key)
        return get

    # addresses (regional, external: a load balancer's VIP)

    def regional(self, table, kind_name, region, name):
        r = table.get((region, name))
        if r is None:
            raise ApiError(404, "notFound", f"The resource 'projects/{PROJECT}/regions/{region}/{kind_name}/{name}' was not found")
        return r

    def addresses_insert(self, base, p, q, body):
        region = p["region"]
        self.region_or_404(region)
        name = body["name"]
        if (region, name) in self.f.addresses:
            raise ApiError(409, "alreadyExists", f"The resource 'projects/{PROJECT}/regions/{region}/addresses/{name}' already exists")
        if body.get("addressType", "EXTERNAL") != "EXTERNAL":
            raise bad("this fake makes EXTERNAL addresses only")
        a = {"kind": "compute#address", "id": self.f.new_id(), "name": name, "status": "RESERVING",
             "addressType": "EXTERNAL", "networkTier": body.get("networkTier", "PREMIUM"), "ipVersion": "IPV4",
             "address": body.get("address") or self.next_external(), "creationTimestamp": now_rfc3339(),
             "region": self.url(base, "regions", region), "selfLink": self.url(base, "regions", region, "addresses", name)}
        for k in ("description", "labels"):
            if k in body:
                a[k] = body[k]
        self.f.addresses[(region, name)] = a

        def done():
            a["status"] = "RESERVED"
        return self.f.operation(base, "region", region, a["selfLink"], "insert", done, q.get("requestId", [None])[0])

    def addresses_get(self, base, p, q, body):
        self.region_or_404(p["region"])
        return copy.deepcopy(self.regional(self.f.addresses, "addresses", p["region"], p["address"]))

    def addresses_list(self, base, p, q, body):
        self.region_or_404(p["region"])
        items = [copy.deepcopy(a) for (r, _), a in self.f.addresses.items() if r == p["region"]]
        return self.page(items, q, "compute#addressList", base, f"regions/{p['region']}/addresses")

    def addresses_delete(self, base, p, q, body):
        region = p["region"]
        a = self.regional(self.f.addresses, "addresses", region, p["address"])
        users = [r["name"] for (rr, _), r in self.f.rules.items() if rr == region and r["IPAddress"] == a["address"]]
        if users:
            raise ApiError(400, "resourceInUseByAnotherResource", f"The address resource '{a['selfLink']}' is already being used by forwarding rules {users}")

        def done():
            self.f.addresses.pop((region, p["address"]), None)
        return self.f.operation(base, "region", region, a["selfLink"], "delete", done, q.get("requestId", [None])[0])

    # target pools

    def pools_insert(self, base, p, q, body):
        region = p["region"]
        self.region_or_404(region)
        name = body["name"]
        if (region, name) in self.f.pools:
            raise ApiError(409, "alreadyExists", f"The resource 'projects/{PROJECT}/regions/{region}/targetPools/{name}' already exists")
        instances = [self.instance_ref(base, region, u, "resource.instances") for u in body.get("instances", [])]
        pool = {"kind": "compute#targetPool", "id": self.f.new_id(), "name": name, "instances": instances,
                "sessionAffinity": body.get("sessionAffinity", "NONE"), "creationTimestamp": now_rfc3339(),
                "region": self.url(base, "regions", region), "selfLink": self.url(base, "regions", region, "targetPools", name)}
        for k in ("description", "healthChecks"):
            if k in body:
                pool[k] = body[k]

        def done():
            self.f.pools[(region, name)] = pool
        return self.f.operation(base, "region", region, pool["selfLink"], "insert", done, q.get("requestId", [None])[0])

    def instance_ref(self, base, region, ref, field):
        m = re.fullmatch(r"zones/([^/]+)/instances/([^/]+)", short(ref))
        if not m or (m.group(1), m.group(2)) not in self.f.instances:
            raise bad(f"Invalid value for field '{field}': '{ref}'. The resource was not found.")
        if region_of(m.group(1)) != region:
            raise bad(f"Invalid value for field '{field}': '{ref}'. Instance is not in the target pool's region {region}.")
        return self.url(base, "zones", m.group(1), "instances", m.group(2))

    def pools_get(self, base, p, q, body):
        self.region_or_404(p["region"])
        return copy.deepcopy(self.regional(self.f.pools, "targetPools", p["region"], p["targetPool"]))

    def pools_list(self, base, p, q, body):
        self.region_or_404(p["region"])
        items = [copy.deepcopy(x) for (r, _), x in self.f.pools.items() if r == p["region"]]
        return self.page(items, q, "compute#targetPoolList", base, f"regions/{p['region']}/targetPools")

    def pools_delete(self, base, p, q, body):
        region = p["region"]
        pool = self.regional(self.f.pools, "targetPools", region, p["targetPool"])
        users = [r["name"] for (rr, _), r in self.f.rules.items() if rr == region and short(r.get("target", "")) == short(pool["selfLink"])]
        if users:
            raise ApiError(400, "resourceInUseByAnotherResource", f"The target_pool resource '{pool['selfLink']}' is already being used by {users}")

        def done():
            self.f.pools.pop((region, p["targetPool"]), None)
        return self.f.operation(base, "region", region, pool["selfLink"], "delete", done, q.get("requestId", [None])[0])

    def pools_members(self, add):
        def change(base, p, q, body):
            region = p["region"]
            pool = self.regional(self.f.pools, "targetPools", region, p["targetPool"])
            refs = [self.instance_ref(base, region, i.get("instance", ""), "request.instances") for i in body.get("instances", [])]
            if not refs:
                raise bad("Invalid value for field 'request.instances': at least one instance is required.")

            def done():
                have = [short(u) for u in pool["instances"]]
                for r in refs:
                    if add and short(r) not in have:
                        pool["instances"].append(r)
                    if not add:
                        pool["instances"] = [u for u in pool["instances"] if short(u) != short(r)]
            return self.f.operation(base, "region", region, pool["selfLink"], "addInstance" if add else "removeInstance",
                                    done, q.get("requestId", [None])[0])
        return change

    # forwarding rules

    def rules_insert(self, base, p, q, body):
        region = p["region"]
        self.region_or_404(region)
        name = body["name"]
        if (region, name) in self.f.rules:
            raise ApiError(409, "alreadyExists", f"The resource 'projects/{PROJECT}/regions/{region}/forwardingRules/{name}' already exists")
        target = short(body.get("target", ""))
        m = re.fullmatch(r"regions/([^/]+)/targetPools/([^/]+)", target)
        if not m or m.group(1) != region or (region, m.group(2)) not in self.f.pools:
            raise bad(f"Invalid value for field 'resource.target': '{body.get('target')}'. The target pool was not found in region {region}.")
        if body.get("loadBalancingScheme", "EXTERNAL") != "EXTERNAL":
            raise bad("Invalid value for field 'resource.loadBalancingScheme': a target pool takes EXTERNAL")
        protocol = body.get("IPProtocol", "TCP")
        ports = body.get("portRange", "")
        if not re.fullmatch(r"[0-9]+(-[0-9]+)?", ports):
            raise bad(f"Invalid value for field 'resource.portRange': '{ports}'. A target pool's rule takes a port range.")
        ip = body.get("IPAddress")
        if ip:
            ip = short(ip)
            ma = re.fullmatch(r"regions/([^/]+)/addresses/([^/]+)", ip)
            if ma:
                a = self.f.addresses.get((ma.group(1), ma.group(2)))
                if a is None:
                    raise bad(f"Invalid value for field 'resource.IPAddress': '{body['IPAddress']}'. The address was not found.")
                ip = a["address"]
            elif not any(a["address"] == ip for (r, _), a in self.f.addresses.items() if r == region):
                raise bad(f"Invalid value for field 'resource.IPAddress': '{ip}'. Specified IP address is not reserved in region {region}.")
        else:
            ip = self.next_external()
        lo, _, hi = ports.partition("-")
        lo, hi = int(lo), int(hi or lo)
        for r in self.f.rules.values():
            if r["IPAddress"] == ip and r["IPProtocol"] == protocol:
                rlo, _, rhi = r["portRange"].partition("-")
                if not (hi < int(rlo) or lo > int(rhi or rlo)):
                    raise ApiError(409, "conflict", f"IP {ip} with protocol {protocol} and port range {ports} overlaps forwarding rule {r['name']}")
        rule = {"kind": "compute#forwardingRule", "id": self.f.new_id(), "name": name, "IPAddress": ip,
                "IPProtocol": protocol, "portRange": f"{lo}-{hi}", "target": self.url(base, target),
                "loadBalancingScheme": "EXTERNAL", "networkTier": body.get("networkTier", "PREMIUM"),
                "creationTimestamp": now_rfc3339(), "region": self.url(base, "regions", region),
                "selfLink": self.url(base, "regions", region, "forwardingRules", name),
                "labelFingerprint": fingerprint(), "fingerprint": fingerprint()}
        for k in ("description", "labels"):
            if k in body:
                rule[k] = body[k]

        def done():
            self.f.rules[(region, name)] = rule
            for a in self.f.addresses.values():
                if a["address"] == ip:
                    a["status"] = "IN_USE"
                    a["users"] = a.get("users", []) + [rule["selfLink"]]
        return self.f.operation(base, "region", region, rule["selfLink"], "insert", done, q.get("requestId", [None])[0])

    def rules_aggregated(self, base, p, q, body):
        terms = parse_filter(q["filter"][0]) if "filter" in q else []
        out = {}
        for region in REGIONS:
            items = [copy.deepcopy(x) for (r, _), x in self.f.rules.items() if r == region and matches(x, terms)]
            out[f"regions/{region}"] = {"forwardingRules": sorted(items, key=lambda i: i["name"])} if items else {
                "warning": {"code": "NO_RESULTS_ON_PAGE", "message": f"There are no results for scope 'regions/{region}' on this page.",
                            "data": [{"key": "scope", "value": f"regions/{region}"}]}}
        return {"kind": "compute#forwardingRuleAggregatedList", "id": f"projects/{PROJECT}/aggregated/forwardingRules",
                "items": out, "selfLink": self.url(base, "aggregated/forwardingRules")}

    def rules_get(self, base, p, q, body):
        self.region_or_404(p["region"])
        return copy.deepcopy(self.regional(self.f.rules, "forwardingRules", p["region"], p["forwardingRule"]))

    def rules_list(self, base, p, q, body):
        self.region_or_404(p["region"])
        items = [copy.deepcopy(x) for (r, _), x in self.f.rules.items() if r == p["region"]]
        return self.page(items, q, "compute#forwardingRuleList", base, f"regions/{p['region']}/forwardingRules")

    def rules_delete(self, base, p, q, body):
        region = p["region"]
        rule = self.regional(self.f.rules, "forwardingRules", region, p["forwardingRule"])

        def done():
            self.f.rules.pop((region, p["forwardingRule"]), None)
            for a in self.f.addresses.values():
                if rule["selfLink"] in a.get("users", []):
                    a["users"].remove(rule["selfLink"])
                    if not a["users"]:
                        a.pop("users")
                        a["status"] = "RESERVED"
        return self.f.operation(base, "region", region, rule["selfLink"], "delete", done, q.get("requestId", [None])[0])

    # firewalls (global)

    def firewall_check(self, body, name):
        if body.get("direction", "INGRESS") != "INGRESS":
            raise bad("this fake makes INGRESS rules only")
        for i, a in enumerate(body.get("allowed", [])):
            if a.get("IPProtocol") not in ("tcp", "udp", "icmp", "all"):
                raise bad(f"Invalid value for field 'resource.allowed[{i}].IPProtocol': '{a.get('IPProtocol')}'.")
            for port in a.get("ports", []):
                if not re.fullmatch(r"[0-9]{1,5}(-[0-9]{1,5})?", port):
                    raise bad(f"Invalid value for field 'resource.allowed[{i}].ports': '{port}'.")
        for r in body.get("sourceRanges", []):
            try:
                ipaddress.ip_network(r)
            except ValueError:
                raise bad(f"Invalid value for field 'resource.sourceRanges': '{r}'. Must be a CIDR address range.")
        if not body.get("allowed") and not body.get("denied"):
            raise bad(f"Invalid value for field 'resource': firewall {name} needs allowed or denied.", "required")

    def firewalls_insert(self, base, p, q, body):
        name = body["name"]
        if name in self.f.firewalls:
            raise ApiError(409, "alreadyExists", f"The resource 'projects/{PROJECT}/global/firewalls/{name}' already exists")
        self.firewall_check(body, name)
        network = short(body.get("network", "global/networks/default"))
        if network != "global/networks/default":
            raise bad(f"Invalid value for field 'resource.network': '{body.get('network')}'. The network was not found.")
        rule = dict(body)
        rule.update({"kind": "compute#firewall", "id": self.f.new_id(), "creationTimestamp": now_rfc3339(),
                     "network": self.url(base, network), "direction": "INGRESS", "priority": body.get("priority", 1000),
                     "selfLink": self.url(base, "global/firewalls", name)})

        def done():
            self.f.firewalls[name] = rule
        return self.f.operation(base, "global", "global", rule["selfLink"], "insert", done, q.get("requestId", [None])[0])

    def firewall_or_404(self, name):
        r = self.f.firewalls.get(name)
        if r is None:
            raise ApiError(404, "notFound", f"The resource 'projects/{PROJECT}/global/firewalls/{name}' was not found")
        return r

    def firewalls_get(self, base, p, q, body):
        return copy.deepcopy(self.firewall_or_404(p["firewall"]))

    def firewalls_list(self, base, p, q, body):
        return self.page([copy.deepcopy(r) for r in self.f.firewalls.values()], q, "compute#firewallList", base, "global/firewalls")

    def firewalls_patch(self, base, p, q, body):
        rule = self.firewall_or_404(p["firewall"])
        merged = dict(rule)
        merged.update(body)
        self.firewall_check(merged, p["firewall"])

        def done():
            rule.update({k: v for k, v in body.items() if k not in ("name", "selfLink", "id")})
        return self.f.operation(base, "global", "global", rule["selfLink"], "patch", done, q.get("requestId", [None])[0])

    def firewalls_delete(self, base, p, q, body):
        rule = self.firewall_or_404(p["firewall"])

        def done():
            self.f.firewalls.pop(p["firewall"], None)
        return self.f.operation(base, "global", "global", rule["selfLink"], "delete", done, q.get("requestId", [None])[0])

    def handlers(self):
        return {
            "compute.firewalls.insert": self.firewalls_insert, "compute.firewalls.get": self.firewalls_get,
            "compute.firewalls.list": self.firewalls_list, "compute.firewalls.patch": self.firewalls_patch,
            "compute.firewalls.delete": self.firewalls_delete,
            "compute.globalOperations.get": self.op_get("global"), "compute.globalOperations.wait": self.op_get("global"),
            "compute.zones.get": self.zones_get, "compute.zones.list": self.zones_list,
            "compute.regions.get": self.regions_get, "compute.subnetworks.get": self.subnetworks_get,
            "compute.instances.insert": self.instances_insert, "compute.instances.get": self.instances_get,
            "compute.instances.list": self.instances_list, "compute.instances.aggregatedList": self.instances_aggregated,
            "compute.instances.delete": self.instances_delete,
            "compute.zoneOperations.get": self.op_get("zone"), "compute.zoneOperations.wait": self.op_get("zone"),
            "compute.regionOperations.get": self.op_get("region"), "compute.regionOperations.wait": self.op_get("region"),
            "compute.addresses.insert": self.addresses_insert, "compute.addresses.get": self.addresses_get,
            "compute.addresses.list": self.addresses_list, "compute.addresses.delete": self.addresses_delete,
            "compute.targetPools.insert": self.pools_insert, "compute.targetPools.get": self.pools_get,
            "compute.targetPools.list": self.pools_list, "compute.targetPools.delete": self.pools_delete,
            "compute.targetPools.addInstance": self.pools_members(True),
            "compute.targetPools.removeInstance": self.pools_members(False),
            "compute.forwardingRules.insert": self.rules_insert, "compute.forwardingRules.get": self.rules_get,
            "compute.forwardingRules.list": self.rules_list, "compute.forwardingRules.aggregatedList": self.rules_aggregated, "compute.forwardingRules.delete": self.rules_delete,
        }


# --- Cloud DNS ----------------------------------------------------------------

class Dns:
    def __init__(self, fake):
        self.f = fake

    def zone_or_404(self, name):
        z = self.f.zones.get(name)
        if z is None:
            raise ApiError(404, "notFound", f"The 'parameters.managedZone' resource named '{name}' does not exist.")
        return z

    def zones_create(self, base, p, q, body):
        name = body.get("name", "")
        if not re.fullmatch(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?", name):
            raise bad(f"Invalid value for 'entity.managedZone.name': '{name}'", "invalid")
        dns_name = body.get("dnsName", "")
        if not dns_name.endswith("."):
            raise bad(f"Invalid value for 'entity.managedZone.dnsName': '{dns_name}'", "invalid")
        if name in self.f.zones:
            raise ApiError(409, "alreadyExists", f"The resource 'entity.managedZone' named '{name}' already exists")
        n = len(self.f.zones) % 8 + 1
        zone = {"kind": "dns#managedZone", "name": name, "dnsName": dns_name, "id": self.f.new_id(),
                "description": body.get("description", ""), "visibility": body.get("visibility", "public"),
                "creationTime": now_rfc3339(),
                "nameServers": [f"ns-cloud-{c}{n}.googledomains.com." for c in "abcd"]}
        if "labels" in body:
            zone["labels"] = body["labels"]
        self.f.zones[name] = zone
        soa = {"kind": "dns#resourceRecordSet", "name": dns_name, "type": "SOA", "ttl": 21600,
               "rrdatas": [f"ns-cloud-a{n}.googledomains.com. cloud-dns-hostmaster.google.com. 1 21600 3600 259200 300"]}
        ns = {"kind": "dns#resourceRecordSet", "name": dns_name, "type": "NS", "ttl": 21600, "rrdatas": zone["nameServers"]}
        self.f.records[name] = {(dns_name, "SOA"): soa, (dns_name, "NS"): ns}
        self.f.changes[name] = {}
        return copy.deepcopy(zone)

    def zones_get(self, base, p, q, body):
        return copy.deepcopy(self.zone_or_404(p["managedZone"]))

    def zones_list(self, base, p, q, body):
        zones = sorted(self.f.zones.values(), key=lambda z: z["name"])
        if "dnsName" in q:
            want = q["dnsName"][0].lower().rstrip(".") + "."
            zones = [z for z in zones if z["dnsName"].lower() == want]
        return self.paged(zones, q, "managedZones", "dns#managedZonesListResponse")

    def paged(self, items, q, field, kind):
        start = int(q.get("pageToken", ["0"])[0] or 0)
        size = int(q.get("maxResults", ["100"])[0])
        out = {"kind": kind, field: copy.deepcopy(items[start:start + size])}
        if start + size < len(items):
            out["nextPageToken"] = str(start + size)
        return out

    def zones_delete(self, base, p, q, body):
        self.zone_or_404(p["managedZone"])
        if any(t not in ("SOA", "NS") for (_, t) in self.f.records[p["managedZone"]]):
            raise ApiError(400, "containerNotEmpty", f"The resource named '{p['managedZone']}' cannot be deleted because it is not empty")
        del self.f.zones[p["managedZone"]]
        return None

    def rrsets_list(self, base, p, q, body):
        zone = self.zone_or_404(p["managedZone"])
        sets = sorted(self.f.records[p["managedZone"]].values(), key=lambda r: (r["name"], r["type"]))
        if "type" in q and "name" not in q:
            raise bad("Invalid value for 'parameters.type': a type needs a name")
        if "name" in q:
            want = q["name"][0].lower()
            if not want.endswith("."):
                raise bad(f"Invalid value for 'parameters.name': '{q['name'][0]}': a fully qualified name ends with a dot")
            sets = [r for r in sets if r["name"] == want]
        if "type" in q:
            sets = [r for r in sets if r["type"] == q["type"][0]]
        del zone
        return self.paged(sets, q, "rrsets", "dns#resourceRecordSetsListResponse")

    def changes_create(self, base, p, q, body):
        zname = p["managedZone"]
        zone = self.zone_or_404(zname)
        records = self.f.records[zname]
        additions, deletions = body.get("additions", []), body.get("deletions", [])
        if not additions and not deletions:
            raise bad("The 'entity.change' resource has neither additions nor deletions", "required")
        after = dict(records)
        for r in deletions:
            key = (r.get("name", ""), r.get("type", ""))
            have = after.get(key)
            if have is None:
                raise ApiError(404, "notFound", f"The 'entity.change.deletions[{key[0]}][{key[1]}]' resource named '{key[0]}' does not exist.")
            if have.get("ttl") != r.get("ttl") or sorted(have.get("rrdatas", [])) != sorted(r.get("rrdatas", [])):
                raise ApiError(412, "conditionNotMet", f"Precondition not met for 'entity.change.deletions[{key[0]}][{key[1]}]'")
            del after[key]
        for r in additions:
            name, rtype = r.get("name", ""), r.get("type", "")
            if name != name.lower() or not name.endswith(".") or not (name == zone["dnsName"] or name.endswith("." + zone["dnsName"])):
                raise bad(f"Invalid value for 'entity.change.additions[{name}].name': not in zone {zone['dnsName']}")
            if not r.get("rrdatas") or "ttl" not in r:
                raise bad(f"Invalid value for 'entity.change.additions[{name}]': rrdatas and ttl are required", "required")
            if rtype == "A":
                for v in r["rrdatas"]:
                    try:
                        ipaddress.IPv4Address(v)
                    except ValueError:
                        raise bad(f"Invalid value for 'entity.change.additions[{name}][A].rrdata[0]': '{v}'")
            if (name, rtype) in after:
                raise ApiError(409, "alreadyExists", f"The resource 'entity.change.additions[{name}][{rtype}]' named '{name} ({rtype})' already exists")
            after[(name, rtype)] = {"kind": "dns#resourceRecordSet", "name": name, "type": rtype,
                                    "ttl": r["ttl"], "rrdatas": list(r["rrdatas"])}
        self.f.records[zname] = after
        cid = str(len(self.f.changes[zname]) + 1)
        change = {"kind": "dns#change", "id": cid, "status": "pending", "startTime": now_rfc3339(),
                  "additions": copy.deepcopy(additions), "deletions": copy.deepcopy(deletions)}
        self.f.changes[zname][cid] = [change, time.time() + self.f.operation_delay]
        return copy.deepcopy(change)

    def rrsets_create(self, base, p, q, body):
        """One record set added (a change of one addition, applied at once)."""
        self.changes_create(base, p, q, {"additions": [body]})
        return copy.deepcopy(self.f.records[p["managedZone"]][(body["name"], body["type"])])

    def changes_get(self, base, p, q, body):
        self.zone_or_404(p["managedZone"])
        entry = self.f.changes[p["managedZone"]].get(p["changeId"])
        if entry is None:
            raise ApiError(404, "notFound", f"The 'parameters.changeId' resource named '{p['changeId']}' does not exist.")
        return copy.deepcopy(entry[0])

    def handlers(self):
        return {
            "dns.managedZones.create": self.zones_create, "dns.managedZones.get": self.zones_get,
            "dns.managedZones.list": self.zones_list, "dns.managedZones.delete": self.zones_delete,
            "dns.resourceRecordSets.list": self.rrsets_list, "dns.resourceRecordSets.create": self.rrsets_create,
            "dns.changes.create": self.changes_create,
            "dns.changes.get": self.changes_get,
        }


# --- HTTP ---------------------------------------------------------------------

def make_handler(fake, handlers, metadata):
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):
            pass

        def reply(self, status, obj, extra_headers=()):
            data = b"" if obj is None else json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json; charset=UTF-8")
            self.send_header("Content-Length", str(len(data)))
            for k, v in extra_headers:
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self.serve("GET")

        def do_POST(self):
            self.serve("POST")

        def do_DELETE(self):
            self.serve("DELETE")

        def do_PATCH(self):
            self.serve("PATCH")

        def do_PUT(self):
            self.serve("PUT")

        def serve(self, verb):
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            url = urllib.parse.urlsplit(self.path)
            query = urllib.parse.parse_qs(url.query, keep_blank_values=True)
            record = {"time": time.time(), "verb": verb, "path": url.path}
            self.method_id = None
            try:
                status, obj, method_id = self.dispatch(verb, url.path, query, raw)
            except ApiError as e:
                status, obj, method_id = e.code, e.envelope(), self.method_id
            except Exception as e:  # a bug of the fake: said, never hidden
                print(f"gcp_fake: {verb} {url.path}: {e!r}", file=sys.stderr, flush=True)
                status, obj, method_id = 500, ApiError(500, "backendError", f"fake failure: {e!r}").envelope(), None
            record.update({"method": method_id, "status": status})
            if fake.log_path and not url.path.startswith("/_fake/"):
                with fake.lock, open(fake.log_path, "a") as f:
                    f.write(json.dumps(record) + "\n")
            headers = [("Metadata-Flavor", "Google")] if metadata else []
            self.reply(status, obj, headers)

        def dispatch(self, verb, path, query, raw):
            if metadata:
                return self.metadata(verb, path)
            if path.startswith("/_fake/"):
                return self.control(verb, path, raw)
            if path == "/token" and verb == "POST":
                form = urllib.parse.parse_qs(raw.decode())
                with fake.lock:
                    status, obj = fake.jwt_grant(form)
                return status, obj, "oauth2.token"
            doc = fake.compute if path.startswith("/compute/") else fake.dns
            m, params = doc.route(verb, path)
            if m is None:
                raise ApiError(404, "notFound", f"The requested URL {path} was not found on this server ({verb}).")
            self.method_id = m["id"]
            with fake.lock:
                fake.check_auth(self.headers)
                fault = fake.take_fault(m["id"])
            if fault:
                raise fault
            doc.check_params(m, params, query)
            body = None
            if "request" in m:
                try:
                    body = json.loads(raw or b"null")
                except ValueError:
                    raise bad("Invalid JSON payload received.", "parseError")
                if body is None:
                    raise bad("The request has no body", "required")
                doc.validate(body, m["request"], "", m["id"])
            elif raw.strip() not in (b"", b"{}", b"null"):
                raise bad(f"{m['id']} takes no request body")
            host = self.headers.get("Host", "127.0.0.1")
            base = f"https://{host}/compute/v1/"
            wait = m["id"].endswith("Operations.wait")
            deadline = time.time() + 30
            while True:
                with fake.lock:
                    fake.advance()
                    obj = handlers[m["id"]](base, params, query, body)
                if not wait or obj.get("status") == "DONE" or time.time() > deadline:
                    break
                time.sleep(0.05)
            if "response" in m:
                try:
                    doc.validate(obj, m["response"], "response")
                except ApiError as e:
                    raise ApiError(500, "backendError", f"fake bug: its {m['id']} answer fails the schema: {e.message}")
            return 200, obj, m["id"]

        def metadata(self, verb, path):
            if self.headers.get("Metadata-Flavor") != "Google":
                return 403, {"error": "Missing Metadata-Flavor:Google header"}, "metadata"
            if path == "/computeMetadata/v1/instance/service-accounts/default/token":
                with fake.lock:
                    return 200, fake.issue_token(), "metadata.token"
            if path == "/computeMetadata/v1/project/project-id":
                return 200, PROJECT, "metadata.project"
            if path in ("/", "/computeMetadata/v1/"):
                return 200, {}, "metadata.ping"
            return 404, {"error": "not found"}, "metadata"

        def control(self, verb, path, raw):
            arg = json.loads(raw or b"{}")
            with fake.lock:
                fake.advance()
                if path == "/_fake/state":
                    return 200, {
                        "instances": list(fake.instances.values()), "addresses": list(fake.addresses.values()),
                        "targetPools": list(fake.pools.values()), "forwardingRules": list(fake.rules.values()),
                        "firewalls": list(fake.firewalls.values()),
                        "managedZones": list(fake.zones.values()),
                        "rrsets": {z: list(r.values()) for z, r in fake.records.items()},
                        "faults": fake.faults,
                        "booted": sorted(f"{z}/{n}" for z, n in fake.booted),
                    }, None
                if path == "/_fake/faults":
                    fake.faults.append({"method": arg["method"], "status": int(arg.get("status", 503)),
                                        "reason": arg.get("reason", "backendError"),
                                        "message": arg.get("message", "injected fault"), "times": int(arg.get("times", 1))})
                    return 200, {}, None
                if path == "/_fake/token":
                    return 200, fake.issue_token(), None
                if path == "/_fake/images":
                    fake.images.add(arg["image"])
                    return 200, {}, None
                if path == "/_fake/subnetworks":
                    fake.subnets[arg["region"]][arg["name"]] = arg["range"]
                    return 200, {}, None
                if path == "/_fake/config":
                    fake.token_lifetime = int(arg.get("token_lifetime", fake.token_lifetime))
                    fake.operation_delay = float(arg.get("operation_delay", fake.operation_delay))
                    return 200, {}, None
            return 404, {"error": f"no control endpoint {path}"}, None

    return Handler


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--metadata-port", type=int, required=True)
    ap.add_argument("--cert", required=True)
    ap.add_argument("--key", required=True)
    ap.add_argument("--node-bin", help="a directory with lbscale-node: instances on loopback run their startup script")
    args = ap.parse_args()
    fake = Fake(args)
    handlers = {**Compute(fake).handlers(), **Dns(fake).handlers()}
    for doc in (fake.compute, fake.dns):
        for _, _, m in doc.routes:
            assert m["id"] in handlers, f"no handler for {m['id']}"
    api = http.server.ThreadingHTTPServer(("127.0.0.1", args.port), make_handler(fake, handlers, False))
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(args.cert, args.key)
    api.socket = ctx.wrap_socket(api.socket, server_side=True)
    meta = http.server.ThreadingHTTPServer(("127.0.0.1", args.metadata_port), make_handler(fake, handlers, True))
    threading.Thread(target=meta.serve_forever, daemon=True).start()
    import signal

    def stop(*_):
        with fake.lock:
            for zone, name in list(fake.booted):
                fake.halt(zone, name)
        os._exit(0)
    signal.signal(signal.SIGTERM, stop)
    print(f"gcp_fake: serving on https://127.0.0.1:{args.port} (metadata http://127.0.0.1:{args.metadata_port})", flush=True)
    api.serve_forever()


if __name__ == "__main__":
    main()
