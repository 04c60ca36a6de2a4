"""Checks for the custom kinds the chart renders.

AdapterRevision is checked against our own CRD schema (``loraplane.api.crd``) and the pydantic model. The other
custom kinds belong to CRDs we do not ship (GIE's InferencePool, Gateway API's HTTPRoute, Prometheus Operator's
monitors): they get minimal structural schemas written from those APIs' documented required fields, not their full
CRDs.
"""

from __future__ import annotations

from typing import Any

import jsonschema

from loraplane.api import AdapterRevision, crd

_NAME = {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$", "maxLength": 253}
_PORT = {"type": "integer", "minimum": 1, "maximum": 65535}
_METADATA = {"type": "object", "required": ["name", "namespace"], "properties": {"name": _NAME}}
_LABEL_SELECTOR = {
    "type": "object",
    "required": ["matchLabels"],
    "properties": {"matchLabels": {"type": "object", "minProperties": 1, "additionalProperties": {"type": "string"}}},
}


def _kind(api_version: str, kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {"apiVersion": {"const": api_version}, "kind": {"const": kind}, "metadata": _METADATA, "spec": spec},
    }


# inference.networking.k8s.io/v1 InferencePool, as the GIE API defines its fields.
INFERENCE_POOL = _kind("inference.networking.k8s.io/v1", "InferencePool", {
    "type": "object",
    "additionalProperties": False,
    "required": ["selector", "targetPorts", "endpointPickerRef"],
    "properties": {
        "selector": _LABEL_SELECTOR,
        "targetPorts": {
            "type": "array", "minItems": 1, "maxItems": 8,
            "items": {"type": "object", "required": ["number"], "additionalProperties": False,
                      "properties": {"number": _PORT}},
        },
        "appProtocol": {"enum": ["http", "kubernetes.io/h2c"]},
        "endpointPickerRef": {
            "type": "object",
            "additionalProperties": False,
            "required": ["name", "port"],
            "properties": {
                "group": {"type": "string"},
                "kind": {"const": "Service"},
                "name": _NAME,
                "port": {"type": "object", "required": ["number"], "properties": {"number": _PORT}},
                "failureMode": {"enum": ["FailOpen", "FailClose"]},
            },
        },
    },
})

# gateway.networking.k8s.io/v1 HTTPRoute: the fields the chart uses.
HTTP_ROUTE = _kind("gateway.networking.k8s.io/v1", "HTTPRoute", {
    "type": "object",
    "required": ["parentRefs", "rules"],
    "properties": {
        "parentRefs": {"type": "array", "minItems": 1, "items": {"type": "object", "required": ["name"]}},
        "hostnames": {"type": "array", "items": {"type": "string"}},
        "rules": {"type": "array", "minItems": 1, "maxItems": 16, "items": {
            "type": "object",
            "properties": {
                "matches": {"type": "array", "minItems": 1, "maxItems": 64, "items": {
                    "type": "object",
                    "properties": {"path": {"type": "object", "required": ["type", "value"], "properties": {
                        "type": {"enum": ["Exact", "PathPrefix", "RegularExpression"]},
                        "value": {"type": "string", "pattern": "^/"}}}}}},
                "backendRefs": {"type": "array", "minItems": 1, "items": {
                    "type": "object", "required": ["name"],
                    "properties": {"group": {"type": "string"}, "kind": {"type": "string"}, "name": _NAME}}},
                "timeouts": {"type": "object", "properties": {
                    "request": {"type": "string", "pattern": r"^([0-9]{1,5}(h|m|s|ms)){1,4}$"}}},
            },
        }},
    },
})

_MONITOR_ENDPOINT = {"type": "object", "required": ["port"], "properties": {
    "port": {"type": "string"}, "path": {"type": "string", "pattern": "^/"},
    "interval": {"type": "string", "pattern": r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"}}}

SERVICE_MONITOR = _kind("monitoring.coreos.com/v1", "ServiceMonitor", {
    "type": "object", "required": ["selector", "endpoints"],
    "properties": {"selector": _LABEL_SELECTOR, "endpoints": {"type": "array", "minItems": 1, "items": _MONITOR_ENDPOINT}},
})

POD_MONITOR = _kind("monitoring.coreos.com/v1", "PodMonitor", {
    "type": "object", "required": ["selector", "podMetricsEndpoints"],
    "properties": {"selector": _LABEL_SELECTOR,
                   "podMetricsEndpoints": {"type": "array", "minItems": 1, "items": _MONITOR_ENDPOINT}},
})

_STRUCTURAL = {
    "InferencePool": INFERENCE_POOL,
    "HTTPRoute": HTTP_ROUTE,
    "ServiceMonitor": SERVICE_MONITOR,
    "PodMonitor": POD_MONITOR,
}


def _adapter_revision_validator() -> jsonschema.Draft202012Validator:
    schema = crd.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return jsonschema.Draft202012Validator(crd.to_json_schema(schema))


_VALIDATORS = {kind: jsonschema.Draft202012Validator(schema) for kind, schema in _STRUCTURAL.items()}
_VALIDATORS["AdapterRevision"] = _adapter_revision_validator()

CUSTOM_KINDS = frozenset(_VALIDATORS)


def validate_custom(obj: dict[str, Any]) -> None:
    """Raise ``jsonschema.ValidationError`` (or pydantic's) when a custom resource does not fit its schema."""
    _VALIDATORS[obj["kind"]].validate(obj)
    if obj["kind"] == "AdapterRevision":
        AdapterRevision.model_validate(obj)
