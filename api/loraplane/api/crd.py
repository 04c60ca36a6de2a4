"""Generate the ``AdapterRevision`` CustomResourceDefinition from the pydantic models.

The output is a structural openAPIV3Schema: ``$ref`` inlined, optional fields simply not required (the models
never serialise ``null``), ``const`` turned into one-value enums, titles dropped. Rules that JSON Schema cannot
express (immutability, either-or fields) are CEL ``x-kubernetes-validations``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from loraplane.api import adapterrevision as ar

CRD_FILENAME = f"{ar.GROUP}_{ar.PLURAL}.yaml"

_PRINTER_COLUMNS = [
    {"name": "Adapter", "type": "string", "jsonPath": ".spec.adapter"},
    {"name": "Revision", "type": "string", "jsonPath": ".spec.revision"},
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
    {"name": "Weight", "type": "integer", "jsonPath": ".status.trafficWeight"},
    {"name": "GPU", "type": "integer", "jsonPath": ".status.residency.gpu"},
    {"name": "CPU", "type": "integer", "jsonPath": ".status.residency.cpu"},
    {"name": "Reason", "type": "string", "jsonPath": ".status.reason", "priority": 1},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]

# CEL rules, keyed by the JSON path of the schema node they sit on (besides the immutability rules generated on
# every field the models mark ``IMMUTABLE_MARK``).
_CEL_RULES: dict[tuple[str, ...], list[dict[str, str]]] = {
    ("spec", "rollout", "canary"): [
        {"rule": "!(has(self.pods) && has(self.fraction))", "message": "canary: set either pods or fraction, not both"}
    ],
}

_DROP_KEYS = {"title"}
# JSON Schema 2020-12 numeric exclusive bounds -> OpenAPI 3.0 boolean form (what Kubernetes speaks).
_EXCLUSIVE = {"exclusiveMinimum": "minimum", "exclusiveMaximum": "maximum"}


def _structural(node: Any, defs: dict[str, Any], path: tuple[str, ...]) -> Any:
    """Rewrite one pydantic JSON-schema node into its structural Kubernetes form."""
    if isinstance(node, list):
        return [_structural(n, defs, path) for n in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        target = defs[node["$ref"].rsplit("/", 1)[-1]]
        merged = {**target, **{k: val for k, val in node.items() if k != "$ref"}}
        return _structural(merged, defs, path)
    if "anyOf" in node:
        branches = [b for b in node["anyOf"] if b.get("type") != "null"]
        if len(branches) != 1:
            raise ValueError(f"cannot express a union at {'.'.join(path)} in a structural schema")
        rest = {k: val for k, val in node.items() if k != "anyOf" and not (k == "default" and val is None)}
        return _structural({**branches[0], **rest}, defs, path)
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _DROP_KEYS:
            continue
        if key == "const":
            out["enum"] = [value]
        elif key in _EXCLUSIVE and not isinstance(value, bool):
            out[_EXCLUSIVE[key]] = value
            out[key] = True
        elif key == "properties":
            out["properties"] = {name: _structural(sub, defs, (*path, name)) for name, sub in value.items()}
        elif key in ("items", "additionalProperties") and isinstance(value, dict):
            out[key] = _structural(value, defs, path)
        else:
            out[key] = value
    if out.get("type") == "object" and "properties" not in out and "additionalProperties" not in out:
        out["x-kubernetes-preserve-unknown-fields"] = True
    rules = list(_CEL_RULES.get(path, []))
    if out.pop(ar.IMMUTABLE_MARK, False):
        shown = ".".join(path)
        rules.append({"rule": "self == oldSelf", "message": f"{shown} is immutable; create a new AdapterRevision"})
    if rules:
        out["x-kubernetes-validations"] = rules
    return out


def immutable_paths(schema: dict[str, Any] | None = None, path: tuple[str, ...] = ()) -> list[str]:
    """Dotted paths of the fields the CRD makes immutable (those with a ``self == oldSelf`` rule)."""
    node = openapi_schema() if schema is None else schema
    found = [".".join(path)] if any(r["rule"] == "self == oldSelf" for r in node.get("x-kubernetes-validations", [])) else []
    for name, sub in node.get("properties", {}).items():
        found += immutable_paths(sub, (*path, name))
    return found


def openapi_schema() -> dict[str, Any]:
    """The openAPIV3Schema of the AdapterRevision CRD version."""
    raw = ar.AdapterRevision.model_json_schema(by_alias=True, mode="validation")
    defs = raw.pop("$defs", {})
    schema = _structural(raw, defs, ())
    props = schema["properties"]
    props["metadata"] = {"type": "object"}
    props["apiVersion"] = {"type": "string", "description": "loraplane.io/v1alpha1"}
    props["kind"] = {"type": "string", "description": "AdapterRevision"}
    schema["required"] = ["spec"]
    schema.pop("additionalProperties", None)
    schema["description"] = (
        "One immutable revision of one logical LoRA adapter: the artifact, the base model it fits, how warm to "
        "keep it and how to roll it out."
    )
    return schema


def _strip_additional_false(node: Any) -> Any:
    """Kubernetes prunes unknown fields itself; ``additionalProperties: false`` is not allowed beside properties."""
    if isinstance(node, dict):
        return {
            k: _strip_additional_false(val)
            for k, val in node.items()
            if not (k == "additionalProperties" and val is False)
        }
    if isinstance(node, list):
        return [_strip_additional_false(n) for n in node]
    return node


def crd() -> dict[str, Any]:
    """The whole CustomResourceDefinition object."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{ar.PLURAL}.{ar.GROUP}",
            "annotations": {"loraplane.io/generated-by": "loraplane gen-crds"},
        },
        "spec": {
            "group": ar.GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": ar.KIND,
                "listKind": f"{ar.KIND}List",
                "plural": ar.PLURAL,
                "singular": ar.SINGULAR,
                "shortNames": list(ar.SHORT_NAMES),
                "categories": ["loraplane"],
            },
            "versions": [
                {
                    "name": ar.VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": _PRINTER_COLUMNS,
                    "schema": {"openAPIV3Schema": _strip_additional_false(openapi_schema())},
                }
            ],
        },
    }


def render() -> str:
    """The CRD as the YAML text committed under ``crds/``."""
    header = "# Generated by `loraplane gen-crds` from loraplane.api. Do not edit by hand.\n"
    return header + yaml.safe_dump(crd(), sort_keys=False, width=120)


def write(out_dir: Path) -> Path:
    """Write the CRD YAML into ``out_dir``; returns the file's path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / CRD_FILENAME
    path.write_text(render())
    return path


def check(out_dir: Path) -> str | None:
    """None when the committed YAML matches the models, else a message saying what to do."""
    path = out_dir / CRD_FILENAME
    if not path.exists():
        return f"{path} is missing; run `loraplane gen-crds`"
    if path.read_text() != render():
        return f"{path} differs from what the api models generate; run `loraplane gen-crds` and commit the result"
    return None


def to_json_schema(openapi: Any) -> Any:
    """An OpenAPI 3.0 (Kubernetes) schema node as JSON Schema, for validating objects with ``jsonschema``.

    Boolean exclusive bounds become numeric ones, ``nullable`` admits null, and the ``x-kubernetes-*`` keywords
    are dropped (CEL rules are checked separately).
    """
    if isinstance(openapi, list):
        return [to_json_schema(n) for n in openapi]
    if not isinstance(openapi, dict):
        return openapi
    out: dict[str, Any] = {}
    for key, value in openapi.items():
        if key.startswith("x-kubernetes-") or key == "nullable":
            continue
        if key in _EXCLUSIVE and isinstance(value, bool):
            if value and _EXCLUSIVE[key] in openapi:
                out[key] = openapi[_EXCLUSIVE[key]]
            continue
        if key in ("properties", "patternProperties"):
            out[key] = {name: to_json_schema(sub) for name, sub in value.items()}
        else:
            out[key] = to_json_schema(value)
    for key, bound in _EXCLUSIVE.items():
        if key in out:
            out.pop(bound, None)
    if openapi.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    return out
