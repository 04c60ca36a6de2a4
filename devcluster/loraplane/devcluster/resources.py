"""The kinds the server serves: built-in ones (Namespaces, Pods, Events, Leases, CRDs) and those CRDs define."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from loraplane.devcluster import tables
from loraplane.devcluster.crds import CRD_SCHEMA
from loraplane.devcluster.patch import PatchMeta
from loraplane.devcluster.schema import CustomResourceSchema
from loraplane.devcluster.tables import Column

VERBS = ["create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"]
Converter = Callable[[dict[str, Any]], dict[str, Any]]


def _same(obj: dict[str, Any]) -> dict[str, Any]:
    return obj


@dataclass
class ResourceType:
    """One served resource of one group version, and how its objects are stored, patched and printed."""

    group: str
    version: str
    kind: str
    plural: str
    singular: str
    namespaced: bool
    columns: list[Column]
    short_names: list[str] = field(default_factory=list)
    categories: list[str] = field(default_factory=list)
    status_subresource: bool = False
    #: storage key shared by every version of the same objects (``events`` and ``events.events.k8s.io`` share one).
    storage: str = ""
    #: the validation schema (custom resources and CRDs; other built-in kinds are not schema-validated).
    schema: CustomResourceSchema | None = None
    #: the kind's openAPIV3Schema for the OpenAPI documents (``kubectl explain``).
    openapi: dict[str, Any] | None = None
    #: list merge keys for strategic merge patch; None when the kind takes no strategic merge patch (CRs).
    patch_meta: PatchMeta | None = None
    field_labels: tuple[str, ...] = ()
    to_storage: Converter = _same
    from_storage: Converter = _same
    #: the CRD that defines this kind (None for built-in kinds).
    crd_name: str | None = None

    def __post_init__(self) -> None:
        self.storage = self.storage or (f"{self.plural}.{self.group}" if self.group else self.plural)

    @property
    def api_version(self) -> str:
        """``group/version`` (``v1`` for the core group)."""
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def group_version_path(self) -> str:
        """``api/v1`` or ``apis/<group>/<version>``."""
        return f"apis/{self.group}/{self.version}" if self.group else f"api/{self.version}"

    @property
    def selectable_fields(self) -> tuple[str, ...]:
        """Field selector labels this kind accepts."""
        scoped = ("metadata.name", "metadata.namespace") if self.namespaced else ("metadata.name",)
        return scoped + self.field_labels

    def _aliases(self) -> dict[str, list[str]]:
        """Short names and categories, when there are any (both discovery formats omit empty ones)."""
        out = {"shortNames": self.short_names, "categories": self.categories}
        return {k: v for k, v in out.items() if v}

    def api_resources(self) -> list[dict[str, Any]]:
        """Its entries of an ``APIResourceList`` (the resource and its subresources)."""
        main = {"name": self.plural, "singularName": self.singular, "namespaced": self.namespaced, "kind": self.kind,
                "verbs": VERBS, **self._aliases()}
        out = [main]
        if self.status_subresource:
            out.append({"name": f"{self.plural}/status", "singularName": "", "namespaced": self.namespaced,
                        "kind": self.kind, "verbs": ["get", "patch", "update"]})
        return out

    def discovery(self) -> dict[str, Any]:
        """Its ``APIResourceDiscovery`` entry (aggregated discovery, ``apidiscovery.k8s.io/v2``)."""
        kind = {"group": self.group, "version": self.version, "kind": self.kind}
        entry: dict[str, Any] = {"resource": self.plural, "responseKind": kind,
                                 "scope": "Namespaced" if self.namespaced else "Cluster",
                                 "singularResource": self.singular, "verbs": VERBS, **self._aliases()}
        if self.status_subresource:
            entry["subresources"] = [{"subresource": "status", "responseKind": kind, "verbs": ["get", "patch", "update"]}]
        return entry


def _list_meta(*merge_keys: tuple[tuple[str, ...], str | None]) -> PatchMeta:
    meta: PatchMeta = {("metadata", "finalizers"): None, ("metadata", "ownerReferences"): "uid"}
    meta.update(dict(merge_keys))
    return meta


def _pod_patch_meta() -> PatchMeta:
    keys: list[tuple[tuple[str, ...], str | None]] = [
        (("spec", "volumes"), "name"),
        (("spec", "imagePullSecrets"), "name"),
        (("spec", "hostAliases"), "ip"),
        (("spec", "schedulingGates"), "name"),
        (("spec", "resourceClaims"), "name"),
        (("status", "conditions"), "type"),
        (("status", "podIPs"), "ip"),
    ]
    for containers in ("containers", "initContainers", "ephemeralContainers"):
        keys.append((("spec", containers), "name"))
        keys.append((("spec", containers, "ports"), "containerPort"))
        keys.append((("spec", containers, "env"), "name"))
        keys.append((("spec", containers, "volumeMounts"), "mountPath"))
        keys.append((("spec", containers, "volumeDevices"), "devicePath"))
    return _list_meta(*keys)


# Events: stored in core/v1 form; events.k8s.io/v1 is a view of the same objects with renamed fields.
_EVENT_RENAMES = {
    "involvedObject": "regarding",
    "message": "note",
    "source": "deprecatedSource",
    "firstTimestamp": "deprecatedFirstTimestamp",
    "lastTimestamp": "deprecatedLastTimestamp",
    "count": "deprecatedCount",
    "reportingComponent": "reportingController",
}


def _rename(obj: dict[str, Any], renames: dict[str, str], api_version: str) -> dict[str, Any]:
    out = {renames.get(k, k): copy.deepcopy(v) for k, v in obj.items()}
    out["apiVersion"] = api_version
    return out


def event_to_core(obj: dict[str, Any]) -> dict[str, Any]:
    """An ``events.k8s.io/v1`` Event as the ``v1`` Event it is stored as."""
    return _rename(obj, {v: k for k, v in _EVENT_RENAMES.items()}, "v1")


def event_from_core(obj: dict[str, Any]) -> dict[str, Any]:
    """A stored ``v1`` Event as ``events.k8s.io/v1``."""
    return _rename(obj, _EVENT_RENAMES, "events.k8s.io/v1")


def _event_columns(view: Converter) -> list[Column]:
    """The event table, computed on the core form whatever version is asked for."""
    def viewed(column: Column) -> Column:
        def value(obj: dict[str, Any], now: datetime) -> tables.Cell:
            return column.value(view(obj), now)

        return Column(column.name, column.type, value, column.description, column.format, column.priority)

    return [viewed(c) for c in tables.EVENT_COLUMNS]


_INVOLVED = ("involvedObject.kind", "involvedObject.namespace", "involvedObject.name", "involvedObject.uid",
             "involvedObject.apiVersion", "involvedObject.resourceVersion", "involvedObject.fieldPath", "reason",
             "reportingComponent", "source", "type")


def builtin_types() -> list[ResourceType]:
    """The kinds every devcluster serves."""
    return [
        ResourceType("", "v1", "Namespace", "namespaces", "namespace", False, tables.NAMESPACE_COLUMNS,
                     short_names=["ns"], status_subresource=True, patch_meta=_list_meta((("status", "conditions"), "type")),
                     field_labels=("status.phase",)),
        ResourceType("", "v1", "Pod", "pods", "pod", True, tables.POD_COLUMNS, short_names=["po"], categories=["all"],
                     status_subresource=True, patch_meta=_pod_patch_meta(),
                     field_labels=("spec.nodeName", "spec.restartPolicy", "spec.schedulerName",
                                   "spec.serviceAccountName", "status.phase", "status.podIP", "status.nominatedNodeName")),
        ResourceType("", "v1", "Event", "events", "event", True, tables.EVENT_COLUMNS, short_names=["ev"],
                     patch_meta=_list_meta(), field_labels=_INVOLVED),
        ResourceType("events.k8s.io", "v1", "Event", "events", "event", True, _event_columns(event_to_core),
                     short_names=["ev"], storage="events", patch_meta=_list_meta(),
                     field_labels=tuple(f.replace("involvedObject", "regarding").replace("reportingComponent", "reportingController")
                                        for f in _INVOLVED),
                     to_storage=event_to_core, from_storage=event_from_core),
        ResourceType("coordination.k8s.io", "v1", "Lease", "leases", "lease", True, tables.LEASE_COLUMNS,
                     patch_meta=_list_meta()),
        ResourceType("apiextensions.k8s.io", "v1", "CustomResourceDefinition", "customresourcedefinitions",
                     "customresourcedefinition", False, tables.CRD_COLUMNS, short_names=["crd", "crds"],
                     categories=["api-extensions"], status_subresource=True, schema=CustomResourceSchema(CRD_SCHEMA),
                     openapi=CRD_SCHEMA),
    ]


def _with_api_version(api_version: str) -> Converter:
    def convert(obj: dict[str, Any]) -> dict[str, Any]:
        return {**obj, "apiVersion": api_version}

    return convert


def custom_resource_types(crd: dict[str, Any]) -> list[ResourceType]:
    """The resources a CustomResourceDefinition serves (one per served version; versions share storage)."""
    spec = crd["spec"]
    names = spec["names"]
    group = spec["group"]
    out = []
    for version in spec["versions"]:
        if not version.get("served", True):
            continue
        openapi = (version.get("schema") or {}).get("openAPIV3Schema") or {"type": "object",
                                                                          "x-kubernetes-preserve-unknown-fields": True}
        api_version = f"{group}/{version['name']}"
        selectable = tuple(f["jsonPath"].lstrip(".") for f in version.get("selectableFields") or [])
        out.append(ResourceType(
            group, version["name"], names["kind"], names["plural"], names.get("singular") or names["kind"].lower(),
            spec.get("scope", "Namespaced") == "Namespaced",
            tables.custom_resource_columns(version.get("additionalPrinterColumns") or []),
            short_names=list(names.get("shortNames") or []), categories=list(names.get("categories") or []),
            status_subresource="status" in (version.get("subresources") or {}),
            schema=CustomResourceSchema(openapi), openapi=openapi, field_labels=selectable,
            to_storage=_with_api_version(api_version), from_storage=_with_api_version(api_version),
            crd_name=crd["metadata"]["name"],
        ))
    return out
