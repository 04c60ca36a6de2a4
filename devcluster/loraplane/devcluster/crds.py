"""The CRDs a devcluster installs by default: loraplane's AdapterRevision and the GIE InferencePool."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from loraplane.api.crd import crd as adapter_revision_crd

_PORT = {"type": "object", "required": ["number"],
         "properties": {"number": {"type": "integer", "format": "int32", "minimum": 1, "maximum": 65535}}}
_CONDITION = {
    "type": "object",
    "required": ["type", "status", "lastTransitionTime", "reason", "message"],
    "properties": {
        "type": {"type": "string", "maxLength": 316},
        "status": {"type": "string", "enum": ["True", "False", "Unknown"]},
        "observedGeneration": {"type": "integer", "format": "int64", "minimum": 0},
        "lastTransitionTime": {"type": "string", "format": "date-time"},
        "reason": {"type": "string", "maxLength": 1024, "minLength": 1},
        "message": {"type": "string", "maxLength": 32768},
    },
}


_STRING = {"type": "string"}
_NAME = {"type": "string", "minLength": 1}
_STRINGS = {"type": "array", "items": _STRING}
_OPEN = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}

#: The shape of a CustomResourceDefinition, as far as the devcluster reads it (everything else is kept as sent).
CRD_SCHEMA: dict[str, Any] = {
    "type": "object",
    "description": "A CustomResourceDefinition: the devcluster serves the kind it defines.",
    "required": ["spec"],
    "properties": {
        "apiVersion": _STRING,
        "kind": _STRING,
        "metadata": {"type": "object"},
        "spec": {
            "type": "object",
            "required": ["group", "names", "scope", "versions"],
            "x-kubernetes-preserve-unknown-fields": True,
            "properties": {
                "group": _NAME,
                "scope": {"type": "string", "enum": ["Cluster", "Namespaced"]},
                "names": {"type": "object", "required": ["plural", "kind"], "properties": {
                    "plural": _NAME, "singular": _STRING, "kind": _NAME, "listKind": _STRING,
                    "shortNames": _STRINGS, "categories": _STRINGS}},
                "versions": {"type": "array", "minItems": 1, "items": {
                    "type": "object",
                    "required": ["name", "served", "storage"],
                    "x-kubernetes-preserve-unknown-fields": True,
                    "properties": {
                        "name": _NAME,
                        "served": {"type": "boolean"},
                        "storage": {"type": "boolean"},
                        "schema": {"type": "object", "properties": {"openAPIV3Schema": _OPEN}},
                        "subresources": _OPEN,
                        "additionalPrinterColumns": {"type": "array", "items": {
                            "type": "object", "required": ["name", "type", "jsonPath"],
                            "properties": {"name": _STRING, "type": _STRING, "format": _STRING, "description": _STRING,
                                           "priority": {"type": "integer"}, "jsonPath": _STRING}}},
                        "selectableFields": {"type": "array", "items": {
                            "type": "object", "required": ["jsonPath"], "properties": {"jsonPath": _STRING}}},
                    },
                }},
            },
        },
        "status": _OPEN,
    },
}


def inference_pool_crd() -> dict[str, Any]:
    """The Gateway API Inference Extension ``InferencePool`` (``inference.networking.k8s.io/v1``) CRD."""
    spec_schema = {
        "type": "object",
        "description": "The pool of model-server pods an endpoint picker routes to.",
        "required": ["selector", "targetPorts", "endpointPickerRef"],
        "properties": {
            "selector": {
                "type": "object",
                "description": "Which pods are members of the pool.",
                "properties": {"matchLabels": {"type": "object", "maxProperties": 64,
                                               "additionalProperties": {"type": "string", "maxLength": 63}}},
            },
            "targetPorts": {"type": "array", "minItems": 1, "maxItems": 8, "items": _PORT,
                            "x-kubernetes-list-type": "atomic"},
            "appProtocol": {"type": "string", "enum": ["http", "kubernetes.io/h2c"]},
            "endpointPickerRef": {
                "type": "object",
                "description": "The endpoint picker (EPP) serving this pool.",
                "required": ["name"],
                "properties": {
                    "group": {"type": "string", "default": "", "maxLength": 253},
                    "kind": {"type": "string", "default": "Service", "minLength": 1, "maxLength": 63},
                    "name": {"type": "string", "minLength": 1, "maxLength": 253},
                    "port": _PORT,
                    "failureMode": {"type": "string", "enum": ["FailOpen", "FailClose"], "default": "FailClose"},
                },
                "x-kubernetes-validations": [{
                    "rule": "self.kind != 'Service' || has(self.port)",
                    "message": "port is required when kind is 'Service' or unspecified (defaults to 'Service')",
                }],
            },
        },
    }
    status_schema = {
        "type": "object",
        "properties": {"parents": {"type": "array", "maxItems": 32, "items": {
            "type": "object",
            "required": ["parentRef"],
            "properties": {
                "parentRef": {"type": "object", "required": ["name"], "properties": {
                    k: {"type": "string"} for k in ("group", "kind", "name", "namespace")}},
                "conditions": {"type": "array", "maxItems": 8, "items": _CONDITION},
            },
        }}},
    }
    return _namespaced_crd(
        "inference.networking.k8s.io", "v1", "InferencePool", "inferencepools", spec_schema, status_schema,
        short_names=["infpool"], description="InferencePool is the Schema for the InferencePools API.")


def inference_objective_crd(group: str = "llm-d.ai") -> dict[str, Any]:
    """The ``InferenceObjective`` CRD (``<group>/v1alpha2``): a named request priority. llm-d-router serves it as
    ``llm-d.ai`` (the default); ``inference.networking.x-k8s.io`` is GIE's deprecated group of the same schema."""
    spec_schema = {
        "type": "object",
        "required": ["poolRef"],
        "properties": {
            "priority": {"type": "integer", "format": "int32"},
            "poolRef": {"type": "object", "required": ["name"], "properties": {
                "group": {"type": "string", "default": "inference.networking.k8s.io", "maxLength": 253},
                "kind": {"type": "string", "default": "InferencePool", "maxLength": 63},
                "name": {"type": "string", "minLength": 1, "maxLength": 253},
            }},
        },
    }
    status_schema = {"type": "object", "properties": {
        "conditions": {"type": "array", "maxItems": 8, "items": _CONDITION}}}
    return _namespaced_crd(group, "v1alpha2", "InferenceObjective", "inferenceobjectives", spec_schema, status_schema)


def _namespaced_crd(group: str, version: str, kind: str, plural: str, spec_schema: dict[str, Any],
                    status_schema: dict[str, Any], short_names: list[str] | None = None,
                    description: str | None = None) -> dict[str, Any]:
    """A namespaced CRD of one served, stored version with a status subresource and a required spec."""
    names: dict[str, Any] = {"kind": kind, "listKind": f"{kind}List", "plural": plural, "singular": kind.lower()}
    if short_names:
        names["shortNames"] = short_names
    schema: dict[str, Any] = {
        "type": "object",
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": spec_schema,
            "status": status_schema,
        },
        "required": ["spec"],
    }
    if description:
        schema["description"] = description
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{group}"},
        "spec": {
            "group": group,
            "scope": "Namespaced",
            "names": names,
            "versions": [{"name": version, "served": True, "storage": True, "subresources": {"status": {}},
                          "schema": {"openAPIV3Schema": schema}}],
        },
    }


def default_crds() -> list[dict[str, Any]]:
    """AdapterRevision (generated from ``loraplane.api``), InferencePool and InferenceObjective in both its groups."""
    return [adapter_revision_crd(), inference_pool_crd(), inference_objective_crd("llm-d.ai"),
            inference_objective_crd("inference.networking.x-k8s.io")]


def load_crds(folder: Path) -> list[dict[str, Any]]:
    """Every CustomResourceDefinition in the ``*.yaml`` / ``*.yml`` / ``*.json`` files of a folder."""
    out = []
    for path in sorted(folder.iterdir()):
        if path.suffix not in (".yaml", ".yml", ".json"):
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            if isinstance(doc, dict) and doc.get("kind") == "CustomResourceDefinition":
                out.append(doc)
    return out
