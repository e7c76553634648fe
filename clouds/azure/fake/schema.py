"""Azure's OpenAPI 2.0 (swagger) definitions, loaded for the fake ARM server.

`Specs` reads the definition files under `clouds/azure/api/specification`,
matches a request to its operation (path template, HTTP method, the file's
api-version) and validates a body against an operation's schema:

- `$ref` across files (resolved relative to the file that holds it);
- `allOf` merged (properties, required);
- types, enums (`enum`; an `x-ms-enum` with `modelAsString: true` is
  extensible, as AutoRest defines it), `required`;
- unknown properties refused where a schema lists its properties and gives
  no `additionalProperties` (ARM refuses them too, or worse, drops them);
- read-only properties refused in requests (Azure's SDKs never send them).

What is not checked: `discriminator` polymorphism (none of the resources the
driver uses needs it), string formats and numeric ranges.
"""

import json
import os
import re


class Invalid(Exception):
    """A body or request that does not follow the definitions."""

    def __init__(self, where, why):
        super().__init__(f"{where or '(body)'}: {why}")
        self.where = where
        self.why = why


class Operation:
    def __init__(self, spec, file, template, method, op, params):
        self.spec = spec
        self.file = file
        self.template = template
        self.method = method
        self.op = op
        self.params = params
        self.id = op.get("operationId", f"{method} {template}")
        self.lro = bool(op.get("x-ms-long-running-operation"))
        self.final_via = (op.get("x-ms-long-running-operation-options") or {}).get(
            "final-state-via"
        )
        names = re.findall(r"{([^}]+)}", template)
        pattern = re.sub(r"{[^}]+}", "([^/]+)", re.escape(template).replace(r"\{", "{").replace(r"\}", "}"))
        self.regex = re.compile("^" + pattern + "$", re.IGNORECASE)
        self.names = names
        # More literal segments first: ".../recordsets" before ".../{recordType}".
        self.literals = sum(1 for s in template.split("/") if s and not s.startswith("{"))

    def body_param(self):
        for p in self.params:
            if p.get("in") == "body":
                return p
        return None

    def response_schema(self, status):
        r = self.op.get("responses", {}).get(str(status))
        if r is None:
            return None, False
        return r.get("schema"), True


class Specs:
    def __init__(self, root):
        self.root = os.path.abspath(root)
        self.files = {}
        self.operations = []
        for dirpath, _, names in os.walk(self.root):
            for n in names:
                if n.endswith(".json"):
                    path = os.path.join(dirpath, n)
                    with open(path, encoding="utf-8") as f:
                        self.files[path] = json.load(f)
        for path, doc in self.files.items():
            if "paths" not in doc:
                continue
            version = doc["info"]["version"]
            for template, ops in doc["paths"].items():
                shared = ops.get("parameters", [])
                for method, op in ops.items():
                    if method == "parameters":
                        continue
                    params = [self.deref(path, p)[0] for p in shared + op.get("parameters", [])]
                    o = Operation(version, path, template, method.upper(), op, params)
                    self.operations.append(o)
        self.operations.sort(key=lambda o: -o.literals)

    # -- references ------------------------------------------------------
    def deref(self, file, node):
        """The node a `$ref` names (followed until it is not one), and its file."""
        seen = 0
        while isinstance(node, dict) and "$ref" in node:
            ref = node["$ref"]
            target, _, pointer = ref.partition("#")
            if target:
                file = os.path.normpath(os.path.join(os.path.dirname(file), target))
            doc = self.files.get(file)
            if doc is None:
                raise KeyError(f"$ref {ref}: no file {file}")
            node = doc
            for part in [p for p in pointer.split("/") if p]:
                node = node[part.replace("~1", "/").replace("~0", "~")]
            seen += 1
            if seen > 50:
                raise KeyError(f"$ref loop at {ref}")
        return node, file

    def flatten(self, file, schema):
        """The schema with its `allOf` merged: (schema, file, properties, required).
        properties maps a name to (schema, file)."""
        schema, file = self.deref(file, schema)
        props = {}
        required = set(schema.get("required", []))
        for part in schema.get("allOf", []):
            _, _, p, r = self.flatten(file, part)
            props.update(p)
            required |= r
        for name, s in schema.get("properties", {}).items():
            props[name] = (s, file)
        return schema, file, props, required

    # -- matching --------------------------------------------------------
    def match(self, method, path):
        """Operations whose template matches `path` (any method): a list of
        (operation, path parameters)."""
        out = []
        for o in self.operations:
            m = o.regex.match(path)
            if m:
                out.append((o, dict(zip(o.names, m.groups()))))
        return out

    # -- validation ------------------------------------------------------
    def validate(self, file, schema, value, where, request):
        schema, file, props, required = self.flatten(file, schema)
        if request and schema.get("readOnly") and where:
            raise Invalid(where, "is read-only: it is never sent")
        enum = schema.get("enum")
        stype = schema.get("type")
        if stype is None and props:
            stype = "object"
        if value is None:
            if schema.get("x-nullable") or not request:
                return
            raise Invalid(where, "is null")
        if stype == "object" or (stype is None and isinstance(value, dict) and (props or "additionalProperties" in schema)):
            if not isinstance(value, dict):
                raise Invalid(where, f"must be an object, not {type(value).__name__}")
            for name in sorted(required):
                if name not in value:
                    ps = props.get(name)
                    ro = ps and self.deref(ps[1], ps[0])[0].get("readOnly")
                    if request and ro:
                        continue
                    raise Invalid(f"{where}.{name}".lstrip("."), "is required")
            extra = schema.get("additionalProperties")
            for name, v in value.items():
                sub = f"{where}.{name}".lstrip(".")
                if name in props:
                    s, sf = props[name]
                    ss, _ = self.deref(sf, s)
                    if request and ss.get("readOnly"):
                        raise Invalid(sub, "is read-only: it is never sent")
                    self.validate(sf, s, v, sub, request)
                elif isinstance(extra, dict):
                    self.validate(file, extra, v, sub, request)
                elif extra is True or (not props and extra is None):
                    continue
                else:
                    raise Invalid(sub, "is not a property of this resource in the API definition")
            return
        if stype == "array":
            if not isinstance(value, list):
                raise Invalid(where, f"must be an array, not {type(value).__name__}")
            for i, v in enumerate(value):
                self.validate(file, schema.get("items", {}), v, f"{where}[{i}]", request)
            return
        if stype == "string":
            if not isinstance(value, str):
                raise Invalid(where, f"must be a string, not {json.dumps(value)}")
        elif stype == "integer":
            if isinstance(value, bool) or not isinstance(value, int):
                raise Invalid(where, f"must be an integer, not {json.dumps(value)}")
        elif stype == "number":
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise Invalid(where, f"must be a number, not {json.dumps(value)}")
        elif stype == "boolean":
            if not isinstance(value, bool):
                raise Invalid(where, f"must be a boolean, not {json.dumps(value)}")
        # `x-ms-enum` with `modelAsString: true` is an extensible enum: the
        # values listed are the known ones, not the only ones (VM sizes, say).
        extensible = (schema.get("x-ms-enum") or {}).get("modelAsString", False)
        if enum is not None and not extensible and value not in enum:
            # ARM compares enum values without case.
            if not (isinstance(value, str) and value.lower() in [str(e).lower() for e in enum]):
                raise Invalid(where, f"{json.dumps(value)} is not one of {enum}")

    def check_parameters(self, op, path_params, query):
        """Path and query parameters: required ones present, enums kept, no
        query parameter the operation does not declare."""
        declared = {}
        for p in op.params:
            if p.get("in") == "query":
                declared[p["name"].lower()] = p
            if p.get("in") == "path":
                v = path_params.get(p["name"])
                if v is not None and "enum" in p and v.lower() not in [e.lower() for e in p["enum"]]:
                    raise Invalid(p["name"], f"{v!r} is not one of {p['enum']}")
                if v is not None and p.get("pattern") and not re.search(p["pattern"], v):
                    raise Invalid(p["name"], f"{v!r} does not match {p['pattern']}")
        for name in query:
            if name.lower() not in declared:
                raise Invalid(name, "is not a query parameter of this operation")
        for name, p in declared.items():
            if p.get("required") and name not in {k.lower() for k in query}:
                raise Invalid(p["name"], "is a required query parameter")
