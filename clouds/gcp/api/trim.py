#!/usr/bin/env python3
"""Trims a Google API Discovery document to the methods lbscale uses.

    python3 clouds/gcp/api/trim.py SOURCE.json OUT.json compute.instances.insert ...

Keeps the document's top level (rootUrl, servicePath, common parameters,
auth), the named methods (by their discovery `id`) under their resources,
and every schema they reach through `$ref` (transitively). Descriptions are
dropped to keep the copy small; nothing else is changed. The method lists
that made the copies in this folder are in README.md (and `make.sh`).
"""
import json
import sys


def strip(node):
    if isinstance(node, dict):
        # A field named `description` is a schema (a dict), kept; prose is a string.
        return {k: strip(v) for k, v in node.items()
                if not (k in ("description", "enumDescriptions", "enumDeprecated") and not isinstance(v, dict))}
    if isinstance(node, list):
        return [strip(v) for v in node]
    return node


def refs(node, out):
    if isinstance(node, dict):
        if "$ref" in node:
            out.add(node["$ref"])
        for v in node.values():
            refs(v, out)
    elif isinstance(node, list):
        for v in node:
            refs(v, out)


def main():
    src, dst, wanted = sys.argv[1], sys.argv[2], set(sys.argv[3:])
    doc = json.load(open(src))
    found = set()

    def walk(resources):
        out = {}
        for name, res in resources.items():
            methods = {m: v for m, v in res.get("methods", {}).items() if v["id"] in wanted}
            found.update(v["id"] for v in methods.values())
            sub = walk(res.get("resources", {}))
            if methods or sub:
                r = {}
                if methods:
                    r["methods"] = methods
                if sub:
                    r["resources"] = sub
                out[name] = r
        return out

    resources = walk(doc["resources"])
    missing = wanted - found
    if missing:
        sys.exit(f"trim.py: no such methods in {src}: {sorted(missing)}")
    schemas, todo = set(), set()
    refs(resources, todo)
    while todo:
        s = todo.pop()
        if s in schemas:
            continue
        schemas.add(s)
        refs(doc["schemas"][s], todo)
    keep = {k: doc[k] for k in ("kind", "discoveryVersion", "id", "name", "version", "revision",
                                 "title", "rootUrl", "servicePath", "basePath", "baseUrl",
                                 "batchPath", "protocol", "parameters", "auth") if k in doc}
    keep["resources"] = resources
    keep["schemas"] = {s: doc["schemas"][s] for s in sorted(schemas)}
    with open(dst, "w") as f:
        json.dump(strip(keep), f, indent=1, sort_keys=True)
        f.write("\n")


if __name__ == "__main__":
    main()
