"""The API semantics on top of the store: create, read, update, patch, delete and watch, with the rules of the
real API server (generation, status subresource, finalizers, namespaces, CRDs, schema validation)."""

from __future__ import annotations

import base64
import binascii
import copy
import json
import random
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Protocol

from loraplane.api import validation as names
from loraplane.devcluster import errors as e
from loraplane.devcluster import patch as patches
from loraplane.devcluster.resources import ResourceType, builtin_types, custom_resource_types
from loraplane.devcluster.schema import schema_errors
from loraplane.devcluster.store import Change, Key, Store, Subscription

DEFAULT_NAMESPACES = ("default", "kube-system", "kube-public", "kube-node-lease")
PROTECTED_NAMESPACES = ("default", "kube-system", "kube-public")
_SERVER_META = ("uid", "creationTimestamp", "deletionTimestamp", "deletionGracePeriodSeconds", "generation")
_DROPPED_META = ("managedFields", "selfLink")
_OBJECT_META_FIELDS = frozenset({
    "name", "generateName", "namespace", "uid", "resourceVersion", "generation", "creationTimestamp",
    "deletionTimestamp", "deletionGracePeriodSeconds", "labels", "annotations", "ownerReferences", "finalizers",
    "managedFields", "selfLink"})
#: The real API server's size limits (besides a request body's 3 MiB, ``ServerConfig.max_body_bytes``, and the name
#: and label lengths): every annotation key and value together (apimachinery's ``TotalAnnotationSizeLimitB``), and
#: the stored object (etcd's default ``--max-request-bytes``, 1.5 MiB, which refuses a larger write).
MAX_ANNOTATIONS_BYTES = 256 * 1024
MAX_OBJECT_BYTES = 1536 * 1024
_NAMESPACES = "namespaces"
_CRDS = "customresourcedefinitions.apiextensions.k8s.io"
_DNS_SUBDOMAIN_HELP = (
    "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must start "
    "and end with an alphanumeric character (e.g. 'example.com', regex used for validation is "
    "'[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')"
)
_DNS_LABEL_HELP = (
    "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and must start and end "
    "with an alphanumeric character (e.g. 'my-name',  or '123-abc', regex used for validation is "
    "'[a-z0-9]([-a-z0-9]*[a-z0-9])?')"
)


class Clock(Protocol):
    """Where the server's wall-clock time comes from (timestamps, ages)."""

    def now(self) -> datetime:
        """The current time, timezone-aware."""
        ...


class SystemClock:
    """The real wall clock."""

    def now(self) -> datetime:
        """The current UTC time."""
        return datetime.now(UTC)


def timestamp(when: datetime) -> str:
    """RFC 3339 with seconds, as Kubernetes writes ``metav1.Time``."""
    return when.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class Selection:
    """What a list or watch asks for: one namespace (or all) and a predicate from the selectors."""

    namespace: str | None
    matches: Callable[[dict[str, Any]], bool]


@dataclass
class Watch:
    """An open watch: the events to send first, then the subscription's changes filtered and converted."""

    rt: ResourceType
    selection: Selection
    initial: list[tuple[str, dict[str, Any]]]
    subscription: Subscription

    def translate(self, change: Change) -> tuple[str, dict[str, Any]] | None:
        """The event a change means for this watcher (None when it does not see it), as the watch cache does."""
        return _translate(self.rt, self.selection, change)


def _translate(rt: ResourceType, selection: Selection, change: Change) -> tuple[str, dict[str, Any]] | None:
    if selection.namespace is not None and (change.obj["metadata"].get("namespace") or "") != selection.namespace:
        return None
    obj = rt.from_storage(change.obj)
    now_matches = selection.matches(obj)
    was_matching = change.prev is not None and selection.matches(rt.from_storage(change.prev))
    if change.type == "DELETED":
        return ("DELETED", obj) if was_matching else None
    if now_matches:
        return ("MODIFIED" if was_matching else "ADDED", obj)
    return ("DELETED", obj) if was_matching else None


def _spec_part(obj: dict[str, Any], rt: ResourceType) -> dict[str, Any]:
    """What a generation counts: everything but metadata (and status when it is a subresource)."""
    skip = ("metadata", "status") if rt.status_subresource else ("metadata",)
    return {k: v for k, v in obj.items() if k not in skip}


def _without_version(obj: dict[str, Any]) -> dict[str, Any]:
    meta = {k: v for k, v in obj.get("metadata", {}).items() if k != "resourceVersion"}
    return {**obj, "metadata": meta}


def _encode_continue(revision: int, key: Key) -> str:
    return base64.urlsafe_b64encode(json.dumps({"rv": revision, "start": list(key)}).encode()).decode()


def _decode_continue(token: str) -> tuple[int, Key]:
    try:
        data = json.loads(base64.urlsafe_b64decode(token.encode()))
        return int(data["rv"]), (str(data["start"][0]), str(data["start"][1]))
    except (ValueError, KeyError, IndexError, TypeError, binascii.Error) as exc:
        raise e.bad_request("continue key is not valid: malformed token") from exc


_QUALIFIED_NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
_NAME_HELP = ("name part must consist of alphanumeric characters, '-', '_' or '.', and must start and end with an "
              "alphanumeric character (e.g. 'MyName',  or 'my.name',  or '123-abc', regex used for validation is "
              "'([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]')")


def _label_errors(values: dict[str, Any], check_values: bool) -> list[e.FieldError]:
    """Kubernetes' rules for label (and annotation) keys, and for label values."""
    field = "metadata.labels" if check_values else "metadata.annotations"
    errors = []
    for key, value in values.items():
        prefix, _, name = key.rpartition("/")
        if prefix and (len(prefix) > names.DNS1123_SUBDOMAIN_MAX or not re.fullmatch(names.DNS1123_SUBDOMAIN, prefix)):
            errors.append(e.invalid(field, key, "prefix part " + _DNS_SUBDOMAIN_HELP))
        if len(name) > 63 or not _QUALIFIED_NAME.fullmatch(name):
            errors.append(e.invalid(field, key, _NAME_HELP if len(name) <= 63 else "name part must be no more than 63 characters"))
        if check_values and value and (len(value) > 63 or not _QUALIFIED_NAME.fullmatch(value)):
            errors.append(e.invalid(field, value, "a valid label must be an empty string or consist of alphanumeric "
                                    "characters, '-', '_' or '.', must start and end with an alphanumeric character and "
                                    "be no more than 63 characters"))
    return errors


def _meta_errors(rt: ResourceType, meta: dict[str, Any]) -> list[e.FieldError]:
    """The name, label and annotation rules every kind shares."""
    name = meta.get("name", "")
    errors = []
    pattern, limit, help_text = ((names.DNS1123_LABEL, names.DNS1123_LABEL_MAX, _DNS_LABEL_HELP)
                                 if rt.storage == _NAMESPACES else
                                 (names.DNS1123_SUBDOMAIN, names.DNS1123_SUBDOMAIN_MAX, _DNS_SUBDOMAIN_HELP))
    if not isinstance(name, str) or not re.fullmatch(pattern, name):
        errors.append(e.invalid("metadata.name", name, help_text))
    elif len(name) > limit:
        errors.append(e.too_long("metadata.name", limit))
    finalizers = meta.get("finalizers")
    if finalizers is not None and (not isinstance(finalizers, list) or not all(isinstance(f, str) for f in finalizers)):
        errors.append(e.invalid("metadata.finalizers", finalizers, "must be a list of strings"))
    for field_name in ("labels", "annotations"):
        values = meta.get(field_name)
        if values is not None and (not isinstance(values, dict) or not all(isinstance(v, str) for v in values.values())):
            errors.append(e.invalid(f"metadata.{field_name}", values, "must be a map of strings"))
        elif values:
            errors += _label_errors(values, check_values=field_name == "labels")
    annotations = meta.get("annotations")
    if isinstance(annotations, dict) and sum(
            len(str(k).encode()) + len(str(v).encode()) for k, v in annotations.items()) > MAX_ANNOTATIONS_BYTES:
        errors.append(e.too_long("metadata.annotations", MAX_ANNOTATIONS_BYTES))
    return errors


def _check_stored_size(obj: dict[str, Any]) -> None:
    """Refuse an object larger than etcd stores (a real API server relays etcd's refusal)."""
    size = len(json.dumps(obj, separators=(",", ":")).encode())
    if size > MAX_OBJECT_BYTES:
        raise e.ApiError(413, "RequestEntityTooLarge",
                         f"etcdserver: request is too large (the object is {size} bytes; at most {MAX_OBJECT_BYTES})")


def _crd_status(crd: dict[str, Any]) -> dict[str, Any]:
    """A CRD's status once served: names accepted, established, its storage version recorded."""
    spec, since = crd["spec"], crd["metadata"]["creationTimestamp"]
    return {
        "acceptedNames": spec["names"],
        "storedVersions": [v["name"] for v in spec["versions"] if v.get("storage")],
        "conditions": [
            {"type": "NamesAccepted", "status": "True", "reason": "NoConflicts", "message": "no conflicts found",
             "lastTransitionTime": since},
            {"type": "Established", "status": "True", "reason": "InitialNamesAccepted",
             "message": "the initial names have been accepted", "lastTransitionTime": since},
        ],
    }


class Cluster:
    """The API server's state and semantics, independent of HTTP."""

    def __init__(self, clock: Clock | None = None, store: Store | None = None, rng: random.Random | None = None) -> None:
        self.clock = clock or SystemClock()
        self.store = store or Store()
        self.rng = rng or random.Random()
        self.types: dict[tuple[str, str, str], ResourceType] = {}
        for rt in builtin_types():
            self._register(rt)
        for crd in self.store.items(_CRDS):
            for rt in custom_resource_types(crd):
                self._register(rt)
        for name in DEFAULT_NAMESPACES:
            if self.store.get(_NAMESPACES, ("", name)) is None:
                self.create(self.resource("", "v1", _NAMESPACES), None, {"metadata": {"name": name}})

    # ----- kinds -----

    def _register(self, rt: ResourceType) -> None:
        self.types[(rt.group, rt.version, rt.plural)] = rt

    def resource(self, group: str, version: str, plural: str) -> ResourceType:
        """The served resource, 404 when there is none."""
        rt = self.types.get((group, version, plural))
        if rt is None:
            raise e.ApiError(404, "NotFound", "the server could not find the requested resource")
        return rt

    def group_versions(self) -> dict[str, list[str]]:
        """Served versions per API group ("" is the core group), preferred first."""
        out: dict[str, list[str]] = {}
        for group, version, _ in self.types:
            versions = out.setdefault(group, [])
            if version not in versions:
                versions.append(version)
        return out

    def resources_of(self, group: str, version: str) -> list[ResourceType]:
        """The resources of one group version."""
        return [rt for (g, v, _), rt in self.types.items() if g == group and v == version]

    def _namespaced_storages(self) -> set[str]:
        return {rt.storage for rt in self.types.values() if rt.namespaced}

    def install_crd(self, crd: dict[str, Any]) -> None:
        """Create a CRD, or replace the spec of an installed one (used for the CRDs installed at start)."""
        rt = self.resource("apiextensions.k8s.io", "v1", "customresourcedefinitions")
        existing = self.store.get(_CRDS, ("", crd["metadata"]["name"]))
        if existing is None:
            self.create(rt, None, copy.deepcopy(crd))
        else:
            self.update(rt, None, existing["metadata"]["name"], {**copy.deepcopy(crd), "metadata": existing["metadata"]})

    # ----- reads -----

    def get(self, rt: ResourceType, namespace: str | None, name: str) -> dict[str, Any]:
        """One object, 404 when absent."""
        return rt.from_storage(self._stored(rt, namespace, name))

    def _stored(self, rt: ResourceType, namespace: str | None, name: str) -> dict[str, Any]:
        obj = self.store.get(rt.storage, (namespace or "" if rt.namespaced else "", name))
        if obj is None:
            raise e.not_found(rt.plural, rt.group, name)
        return obj

    def list_objects(self, rt: ResourceType, selection: Selection, limit: int = 0, token: str = "") -> dict[str, Any]:
        """A ``<Kind>List`` with ``metadata.resourceVersion`` (and ``continue`` when ``limit`` cut it short)."""
        revision, start = _decode_continue(token) if token else (self.store.revision, None)
        items = []
        for stored in self.store.items(rt.storage, selection.namespace):
            if start is not None and (stored["metadata"].get("namespace") or "", stored["metadata"]["name"]) <= start:
                continue
            obj = rt.from_storage(stored)
            if selection.matches(obj):
                items.append(obj)
        meta: dict[str, Any] = {"resourceVersion": str(revision)}
        if limit and len(items) > limit:
            last = items[limit - 1]["metadata"]
            meta["continue"] = _encode_continue(revision, (last.get("namespace") or "", last["name"]))
            meta["remainingItemCount"] = len(items) - limit
            items = items[:limit]
        return {"kind": f"{rt.kind}List", "apiVersion": rt.api_version, "metadata": meta, "items": items}

    def watch(self, rt: ResourceType, selection: Selection, resource_version: str | None,
              send_initial_events: bool = False) -> Watch:
        """Open a watch. Without a resourceVersion (or "0") it starts with ADDED events for what exists; with
        one it replays the changes after it; 410 Gone when those are compacted."""
        initial: list[tuple[str, dict[str, Any]]] = []
        if not resource_version or resource_version == "0" or send_initial_events:
            initial = [("ADDED", obj) for obj in self.list_objects(rt, selection)["items"]]
        else:
            try:
                since = int(resource_version)
            except ValueError as exc:
                raise e.bad_request(f"Invalid value for resourceVersion: {resource_version!r}") from exc
            changes = self.store.changes_since(rt.storage, since)
            if changes is None:
                raise e.gone(f"too old resource version: {since} ({self.store.compacted + 1})")
            initial = [ev for c in changes if (ev := _translate(rt, selection, c)) is not None]
        return Watch(rt, selection, initial, self.store.subscribe(rt.storage))

    # ----- writes -----

    def create(self, rt: ResourceType, namespace: str | None, body: dict[str, Any], *, dry_run: bool = False,
               field_validation: str = "Warn") -> tuple[dict[str, Any], list[str]]:
        """Create an object; returns it as stored and the warnings to send."""
        obj = self._decoded(rt, body)
        meta = obj.setdefault("metadata", {})
        self._place(rt, meta, namespace)
        if not meta.get("name"):
            if not isinstance(meta.get("generateName"), str) or not meta["generateName"]:
                raise e.invalid_object(rt.kind, rt.group, "", [e.required("metadata.name", "name or generateName is required")])
            meta["name"] = meta["generateName"] + "".join(self.rng.choice("bcdfghjklmnpqrstvwxz2456789") for _ in range(5))
        for key in (*_SERVER_META, *_DROPPED_META, "resourceVersion"):
            meta.pop(key, None)
        meta["uid"] = str(uuid.UUID(int=self.rng.getrandbits(128), version=4))
        meta["creationTimestamp"] = timestamp(self.clock.now())
        meta["generation"] = 1
        self._prepare_create(rt, obj)
        warnings = self._admit(rt, obj, None, field_validation)
        if rt.storage == _CRDS:
            obj["status"] = _crd_status(obj)
        if rt.namespaced:
            self._check_namespace_open(meta["namespace"])
        if self.store.get(rt.storage, (meta.get("namespace") or "", meta["name"])) is not None:
            raise e.already_exists(rt.plural, rt.group, meta["name"])
        if dry_run:
            return obj, warnings
        stored = self.store.put(rt.storage, rt.to_storage(obj))
        if rt.storage == _CRDS:
            self._serve_crd(stored)
        return rt.from_storage(stored), warnings

    def update(self, rt: ResourceType, namespace: str | None, name: str, body: dict[str, Any], *,
               subresource: str = "", dry_run: bool = False, field_validation: str = "Warn") -> tuple[dict[str, Any], list[str]]:
        """Replace an object (``subresource="status"`` replaces only its status); 409 on a stale resourceVersion."""
        old = rt.from_storage(self._stored(rt, namespace, name))
        return self._replace(rt, old, self._decoded(rt, body), subresource, dry_run, field_validation)

    def patch(self, rt: ResourceType, namespace: str | None, name: str, patch_type: str, patch: Any, *,
              subresource: str = "", dry_run: bool = False, field_validation: str = "Warn") -> tuple[dict[str, Any], list[str]]:
        """Apply a JSON merge, JSON or strategic merge patch (``json``, ``merge``, ``strategic``)."""
        old = rt.from_storage(self._stored(rt, namespace, name))
        try:
            if patch_type == "merge":
                new = patches.merge_patch(old, patch)
            elif patch_type == "json":
                new = patches.json_patch(old, patch)
            elif rt.patch_meta is not None:
                new = patches.strategic_merge(old, patch, rt.patch_meta)
            else:
                raise e.unsupported_media_type(
                    "the body of the request was in an unknown format - accepted media types include: "
                    "application/json-patch+json, application/merge-patch+json")
        except patches.PatchError as exc:
            raise e.ApiError(422, "Invalid", f"the server rejected our request due to an error in our request: {exc}") from exc
        return self._replace(rt, old, self._decoded(rt, new), subresource, dry_run, field_validation)

    def _replace(self, rt: ResourceType, old: dict[str, Any], new: dict[str, Any], subresource: str, dry_run: bool,
                 field_validation: str) -> tuple[dict[str, Any], list[str]]:
        old_meta = old["metadata"]
        name = old_meta["name"]
        meta = new.setdefault("metadata", {})
        if meta.get("name", name) != name:
            raise e.bad_request(f"the name of the object ({meta.get('name')}) does not match the name on the URL ({name})")
        sent_version = meta.get("resourceVersion")
        if sent_version and sent_version != old_meta["resourceVersion"]:
            raise e.conflict(rt.plural, rt.group, name,
                             "the object has been modified; please apply your changes to the latest version and try again")
        if subresource == "status":
            merged = copy.deepcopy(old)
            if "status" in new:
                merged["status"] = new["status"]
            else:
                merged.pop("status", None)
        else:
            merged = new
            for key in _DROPPED_META:
                meta.pop(key, None)
            for key in ("name", "namespace", *_SERVER_META, "resourceVersion"):
                if key in old_meta:
                    meta[key] = old_meta[key]
                else:
                    meta.pop(key, None)
            if rt.status_subresource:
                if "status" in old:
                    merged["status"] = old["status"]
                else:
                    merged.pop("status", None)
            if old_meta.get("deletionTimestamp") and set(meta.get("finalizers") or []) - set(old_meta.get("finalizers") or []):
                raise e.invalid_object(rt.kind, rt.group, name, [
                    e.forbidden("metadata.finalizers", "no new finalizers can be added if the object is being deleted")])
        warnings = self._admit(rt, merged, old, field_validation)
        if rt.storage == _CRDS:
            merged["status"] = _crd_status(merged)
        if _spec_part(merged, rt) != _spec_part(old, rt):
            merged["metadata"]["generation"] = int(old_meta.get("generation") or 0) + 1
        if _without_version(merged) == _without_version(old) or dry_run:
            return merged, warnings
        if merged["metadata"].get("deletionTimestamp") and not merged["metadata"].get("finalizers"):
            return self._remove(rt, merged), warnings
        stored = self.store.put(rt.storage, rt.to_storage(merged))
        if rt.storage == _CRDS:
            self._serve_crd(stored)
        return rt.from_storage(stored), warnings

    def delete(self, rt: ResourceType, namespace: str | None, name: str, options: dict[str, Any] | None = None, *,
               dry_run: bool = False) -> tuple[dict[str, Any], bool]:
        """Delete an object: at once without finalizers, else mark it (``deletionTimestamp``) until they are gone.
        Returns the object and whether it is gone."""
        old = rt.from_storage(self._stored(rt, namespace, name))
        meta = old["metadata"]
        pre = (options or {}).get("preconditions") or {}
        if not isinstance(pre, dict):
            raise e.bad_request("preconditions must be an object")
        if pre.get("uid") and pre["uid"] != meta.get("uid"):
            raise e.conflict(rt.plural, rt.group, name, f"Precondition failed: UID in precondition: {pre['uid']}, "
                             f"UID in object meta: {meta.get('uid')}")
        if pre.get("resourceVersion") and pre["resourceVersion"] != meta.get("resourceVersion"):
            raise e.conflict(rt.plural, rt.group, name, "Precondition failed: ResourceVersion in precondition: "
                             f"{pre['resourceVersion']}, ResourceVersion in object meta: {meta.get('resourceVersion')}")
        if rt.storage == _NAMESPACES and name in PROTECTED_NAMESPACES:
            raise e.ApiError(403, "Forbidden", f'namespaces "{name}" is forbidden: this namespace may not be deleted',
                             {"name": name, "kind": "namespaces"})
        if dry_run:
            return old, False
        if rt.storage in (_NAMESPACES, _CRDS) or meta.get("finalizers"):
            if not meta.get("deletionTimestamp"):
                meta["deletionTimestamp"] = timestamp(self.clock.now())
                meta["deletionGracePeriodSeconds"] = 0
                meta["generation"] = int(meta.get("generation") or 0) + 1
                if rt.storage == _NAMESPACES:
                    old.setdefault("status", {})["phase"] = "Terminating"
                old = rt.from_storage(self.store.put(rt.storage, rt.to_storage(old)))
            if rt.storage == _NAMESPACES:
                self._empty_namespace(name)
            elif rt.storage == _CRDS:
                self._empty_crd(old)
            current = self.store.get(rt.storage, ("", name) if not rt.namespaced else (meta.get("namespace") or "", name))
            return (rt.from_storage(current), False) if current is not None else (old, True)
        return self._remove(rt, old), True

    def delete_collection(self, rt: ResourceType, selection: Selection, *, dry_run: bool = False) -> dict[str, Any]:
        """Delete every object a list would return; returns the list of what was deleted or marked."""
        listed = self.list_objects(rt, selection)
        listed["items"] = [self.delete(rt, obj["metadata"].get("namespace"), obj["metadata"]["name"], dry_run=dry_run)[0]
                           for obj in listed["items"]]
        return listed

    # ----- rules -----

    def _decoded(self, rt: ResourceType, body: Any) -> dict[str, Any]:
        if not isinstance(body, dict):
            raise e.bad_request("the request body must be a JSON object")
        obj = copy.deepcopy(body)
        for field_name, expected in (("kind", rt.kind), ("apiVersion", rt.api_version)):
            if obj.setdefault(field_name, expected) != expected:
                raise e.bad_request(f"the {field_name} in the data ({obj[field_name]}) does not match the expected "
                                    f"{field_name} ({expected})")
        if not isinstance(obj.get("metadata", {}), dict):
            raise e.bad_request("metadata must be an object")
        return obj

    def _place(self, rt: ResourceType, meta: dict[str, Any], namespace: str | None) -> None:
        if not rt.namespaced:
            meta.pop("namespace", None)
            return
        given = meta.get("namespace")
        if namespace and given and given != namespace:
            raise e.bad_request("the namespace of the provided object does not match the namespace sent on the request")
        meta["namespace"] = namespace or given or "default"

    def _check_namespace_open(self, namespace: str) -> None:
        ns = self.store.get(_NAMESPACES, ("", namespace))
        if ns is None:
            raise e.not_found("namespaces", "", namespace)
        if ns["metadata"].get("deletionTimestamp"):
            raise e.ApiError(403, "Forbidden", f"unable to create new content in namespace {namespace} because it is "
                             "being terminated", {"name": namespace, "kind": "namespaces"})

    def _prepare_create(self, rt: ResourceType, obj: dict[str, Any]) -> None:
        if rt.storage == _NAMESPACES:
            obj["status"] = {"phase": "Active"}
        elif rt.storage == "pods":
            obj["status"] = {"phase": "Pending"}
        elif rt.schema is not None and rt.status_subresource:
            obj.pop("status", None)

    def _admit(self, rt: ResourceType, obj: dict[str, Any], old: dict[str, Any] | None, field_validation: str) -> list[str]:
        """Prune undeclared fields, default and validate an object about to be written; returns its warnings."""
        meta = obj["metadata"]
        unknown = [f"metadata.{key}" for key in meta if key not in _OBJECT_META_FIELDS]
        for path in unknown:
            del meta[path.removeprefix("metadata.")]
        if rt.schema is not None:
            pruned, undeclared = rt.schema.prune(obj)
            obj.clear()
            obj.update(pruned)
            unknown += undeclared
        if unknown and field_validation == "Strict":
            fields = ", ".join(f'unknown field "{path}"' for path in unknown)
            raise e.bad_request(f'{rt.kind} in version "{rt.version}" cannot be handled as a {rt.kind}: '
                                f"strict decoding error: {fields}")
        warnings = [f'unknown field "{path}"' for path in unknown] if field_validation == "Warn" else []
        errors = _meta_errors(rt, meta)
        if rt.schema is not None and not errors:
            rt.schema.default(obj)
            errors += rt.schema.validate(obj, old)
        if rt.storage == _CRDS and not errors:
            errors += self._crd_errors(obj)
        if errors:
            raise e.invalid_object(rt.kind, rt.group, meta.get("name", ""), errors)
        _check_stored_size(obj)
        return warnings

    def _crd_errors(self, crd: dict[str, Any]) -> list[e.FieldError]:
        """What the CRD schema cannot say: the name, one storage version, valid schemas and CEL rules."""
        spec = crd["spec"]
        errors = []
        if crd["metadata"].get("name") != f"{spec['names']['plural']}.{spec['group']}":
            errors.append(e.invalid("metadata.name", crd["metadata"].get("name"), 'must be spec.names.plural+"."+spec.group'))
        if sum(1 for v in spec["versions"] if v["storage"]) != 1:
            errors.append(e.invalid("spec.versions", len(spec["versions"]), "must have exactly one version marked as storage version"))
        for i, version in enumerate(spec["versions"]):
            schema = (version.get("schema") or {}).get("openAPIV3Schema")
            if schema is not None:
                errors += schema_errors(schema, f"spec.versions[{i}].schema.openAPIV3Schema")
        return errors

    def _serve_crd(self, crd: dict[str, Any]) -> None:
        """(Re)serve the kinds of a stored CRD."""
        for key in [k for k, rt in self.types.items() if rt.crd_name == crd["metadata"]["name"]]:
            del self.types[key]
        for rt in custom_resource_types(crd):
            self._register(rt)

    def _remove(self, rt: ResourceType, obj: dict[str, Any]) -> dict[str, Any]:
        meta = obj["metadata"]
        last = rt.from_storage(self.store.remove(rt.storage, (meta.get("namespace") or "", meta["name"])))
        if rt.storage == _CRDS:
            for key in [k for k, served in self.types.items() if served.crd_name == meta["name"]]:
                del self.types[key]
        if meta.get("namespace"):
            self._finish_namespace(meta["namespace"])
        if rt.crd_name:
            self._finish_crd(rt.crd_name)
        return last

    def _delete_all(self, storage: str, namespace: str | None) -> None:
        rt = next(t for t in self.types.values() if t.storage == storage)
        for obj in self.store.items(storage, namespace):
            self.delete(rt, obj["metadata"].get("namespace"), obj["metadata"]["name"])

    def _empty_namespace(self, namespace: str) -> None:
        for storage in self._namespaced_storages():
            self._delete_all(storage, namespace)
        self._finish_namespace(namespace)

    def _finish_namespace(self, namespace: str) -> None:
        ns = self.store.get(_NAMESPACES, ("", namespace))
        if ns is None or not ns["metadata"].get("deletionTimestamp") or ns["metadata"].get("finalizers"):
            return
        if all(self.store.count(storage, namespace) == 0 for storage in self._namespaced_storages()):
            self.store.remove(_NAMESPACES, ("", namespace))

    def _crd_storage(self, crd: dict[str, Any]) -> str:
        return f"{crd['spec']['names']['plural']}.{crd['spec']['group']}"

    def _empty_crd(self, crd: dict[str, Any]) -> None:
        storage = self._crd_storage(crd)
        if any(rt.storage == storage for rt in self.types.values()):
            self._delete_all(storage, None)
        self._finish_crd(crd["metadata"]["name"])

    def _finish_crd(self, crd_name: str) -> None:
        crd = self.store.get(_CRDS, ("", crd_name))
        if crd is None or not crd["metadata"].get("deletionTimestamp") or crd["metadata"].get("finalizers"):
            return
        if self.store.count(self._crd_storage(crd)) == 0:
            self._remove(self.resource("apiextensions.k8s.io", "v1", "customresourcedefinitions"), crd)
