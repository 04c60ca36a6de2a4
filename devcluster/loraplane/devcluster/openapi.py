"""OpenAPI v3 documents: what kubectl reads to decide on server-side field validation (``fieldValidation`` on each
PATCH) and what ``kubectl explain`` prints.

Custom resources carry their CRD schema; built-in kinds get an open object schema. Built-in PATCH operations do not
advertise strategic merge patch, so kubectl computes client-side apply patches from its compiled-in types, exactly
as it does against servers without OpenAPI patch metadata.
"""

from __future__ import annotations

import copy
import hashlib
from typing import Any

import orjson

from loraplane.devcluster.resources import ResourceType

OBJECT_META = "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"
_OBJECT_META_SCHEMA = {
    "description": "Standard object's metadata.",
    "type": "object",
    "properties": {
        "name": {"type": "string", "description": "Name must be unique within a namespace."},
        "generateName": {"type": "string", "description": "Prefix the server uses to generate a unique name."},
        "namespace": {"type": "string", "description": "The namespace the object lives in."},
        "labels": {"type": "object", "additionalProperties": {"type": "string"}, "description": "Labels for selection."},
        "annotations": {"type": "object", "additionalProperties": {"type": "string"},
                        "description": "Annotations: arbitrary non-identifying metadata."},
        "finalizers": {"type": "array", "items": {"type": "string"},
                       "description": "Must be empty before the object is deleted from the registry."},
        "uid": {"type": "string", "description": "Unique in time and space; set by the server."},
        "resourceVersion": {"type": "string", "description": "Opaque version for optimistic concurrency and watches."},
        "generation": {"type": "integer", "format": "int64", "description": "Incremented on each change of the desired state."},
        "creationTimestamp": {"type": "string", "format": "date-time", "description": "When the object was created."},
        "deletionTimestamp": {"type": "string", "format": "date-time", "description": "When the object will be deleted."},
    },
}
_QUERY_PARAMS = ("dryRun", "fieldManager", "fieldValidation", "pretty")
_LIST_PARAMS = ("labelSelector", "fieldSelector", "limit", "continue", "resourceVersion", "resourceVersionMatch",
                "timeoutSeconds", "watch", "allowWatchBookmarks", "sendInitialEvents")


def schema_name(rt: ResourceType) -> str:
    """``io.loraplane.v1alpha1.AdapterRevision``: the reversed group, the version, the kind."""
    group = ".".join(reversed(rt.group.split("."))) if rt.group else "io.k8s.api.core"
    return f"{group}.{rt.version}.{rt.kind}"


def _kind_schema(rt: ResourceType) -> dict[str, Any]:
    if rt.openapi is not None:
        schema = copy.deepcopy(rt.openapi)
    else:
        schema = {"type": "object", "description": f"{rt.kind} ({rt.api_version}).", "x-kubernetes-preserve-unknown-fields": True,
                  "properties": {"apiVersion": {"type": "string"}, "kind": {"type": "string"}}}
    schema.setdefault("properties", {})["metadata"] = {"$ref": f"#/components/schemas/{OBJECT_META}",
                                                       "description": "Standard object's metadata."}
    schema["x-kubernetes-group-version-kind"] = [{"group": rt.group, "version": rt.version, "kind": rt.kind}]
    return schema


def _params(names: tuple[str, ...]) -> list[dict[str, Any]]:
    return [{"name": n, "in": "query", "schema": {"type": "string"}, "description": n} for n in names]


def _operation(rt: ResourceType, action: str, params: tuple[str, ...], body_types: tuple[str, ...] = ()) -> dict[str, Any]:
    ref = {"$ref": f"#/components/schemas/{schema_name(rt)}"}
    op: dict[str, Any] = {
        "operationId": f"{action}{rt.kind}",
        "parameters": _params(params),
        "responses": {"200": {"description": "OK", "content": {"application/json": {"schema": ref}}}},
        "x-kubernetes-action": action,
        "x-kubernetes-group-version-kind": {"group": rt.group, "version": rt.version, "kind": rt.kind},
    }
    if body_types:
        op["requestBody"] = {"content": {t: {"schema": ref if t == "application/json" else {"type": "object"}}
                                         for t in body_types}, "required": True}
    return op


def _paths(rt: ResourceType) -> dict[str, Any]:
    scope = "/namespaces/{namespace}" if rt.namespaced else ""
    base = f"/{rt.group_version_path}{scope}/{rt.plural}"
    patch_types = ("application/json-patch+json", "application/merge-patch+json")
    item = {
        "get": _operation(rt, "get", ("pretty",)),
        "put": _operation(rt, "put", _QUERY_PARAMS, ("application/json",)),
        "patch": _operation(rt, "patch", _QUERY_PARAMS, patch_types),
        "delete": _operation(rt, "delete", ("dryRun", "gracePeriodSeconds", "propagationPolicy")),
    }
    paths = {
        base: {"get": _operation(rt, "list", _LIST_PARAMS), "post": _operation(rt, "post", _QUERY_PARAMS, ("application/json",)),
               "delete": _operation(rt, "deletecollection", _LIST_PARAMS)},
        f"{base}/{{name}}": item,
    }
    if rt.status_subresource:
        paths[f"{base}/{{name}}/status"] = {k: item[k] for k in ("get", "put", "patch")}
    return paths


def group_version_document(resources: list[ResourceType]) -> dict[str, Any]:
    """The OpenAPI v3 document of one group version."""
    paths: dict[str, Any] = {}
    schemas: dict[str, Any] = {OBJECT_META: _OBJECT_META_SCHEMA}
    for rt in resources:
        paths.update(_paths(rt))
        schemas[schema_name(rt)] = _kind_schema(rt)
    return {"openapi": "3.0.0", "info": {"title": "Kubernetes", "version": "v1.32.0"}, "paths": paths,
            "components": {"schemas": schemas}}


def document_hash(document: dict[str, Any]) -> str:
    """The hash kubectl uses to cache a document (part of its URL in the root index)."""
    return hashlib.sha512(orjson.dumps(document, option=orjson.OPT_SORT_KEYS)).hexdigest()[:32].upper()
