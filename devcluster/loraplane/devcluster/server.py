"""The HTTP face of the devcluster: Kubernetes REST paths, discovery, OpenAPI, Tables and watch streams
(Starlette on uvicorn)."""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import orjson
import yaml
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from loraplane.devcluster import errors as e
from loraplane.devcluster import openapi, selectors, tables
from loraplane.devcluster.cluster import Cluster, Selection, Watch
from loraplane.devcluster.resources import ResourceType

KUBERNETES_VERSION = ("1", "32")
TABLE_CONTENT_TYPE = "application/json;as=Table;v=v1;g=meta.k8s.io"
DISCOVERY_CONTENT_TYPE = "application/json;g=apidiscovery.k8s.io;v=v2;as=APIGroupDiscoveryList"
_PATCH_TYPES = {
    "application/merge-patch+json": "merge",
    "application/json-patch+json": "json",
    "application/strategic-merge-patch+json": "strategic",
}
_HEALTH = ("healthz", "livez", "readyz")
_METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE"]


@dataclass
class ServerConfig:
    """Knobs of the HTTP layer."""

    #: seconds between BOOKMARK events on watches that allow them.
    bookmark_interval: float = 60.0
    #: how long a watch without ``timeoutSeconds`` stays open.
    watch_timeout: float = 1800.0
    #: when set, every request but the health checks needs ``Authorization: Bearer <token>``.
    token: str | None = None
    #: the largest request body accepted (the real API server's limit).
    max_body_bytes: int = 3 * 1024 * 1024


def _warning_header(text: str) -> str:
    """One RFC 7234 warning as the API server sends it: ``299 - "<text>"`` with the text escaped."""
    escaped = text.replace("\\", "\\\\").replace('"', '\\"')
    return f'299 - "{escaped}"'


def _json(data: Any, status: int = 200, content_type: str = "application/json", warnings: list[str] | None = None) -> Response:
    headers = {"Warning": ", ".join(_warning_header(w) for w in warnings)} if warnings else None
    return Response(orjson.dumps(data), status_code=status, media_type=content_type, headers=headers)


def _accepts(request: Request, kind: str, group: str, version: str) -> bool:
    """Whether the Accept header asks for ``application/json;as=<kind>;g=<group>;v=<version>``."""
    for media_range in request.headers.get("accept", "").split(","):
        params = dict(p.strip().partition("=")[::2] for p in media_range.split(";")[1:])
        if params.get("as") == kind and params.get("g") == group and params.get("v") == version:
            return True
    return False


def _flag(params: Any, name: str) -> bool:
    value = params.get(name)
    if value is None or value == "":
        return False
    if value.lower() in ("true", "1"):
        return True
    if value.lower() in ("false", "0"):
        return False
    raise e.bad_request(f"invalid value for {name}: {value!r}")


def _number(params: Any, name: str) -> int:
    value = params.get(name)
    if not value:
        return 0
    try:
        number = int(value)
    except ValueError as exc:
        raise e.bad_request(f"invalid value for {name}: {value!r}") from exc
    if number < 0:
        raise e.bad_request(f"{name} must not be negative")
    return number


def _dry_run(params: Any) -> bool:
    values = params.getlist("dryRun")
    if any(v != "All" for v in values):
        raise e.bad_request(f"Invalid value for dryRun: {values}: supported values: \"All\"")
    return bool(values)


def _field_validation(params: Any) -> str:
    value = params.get("fieldValidation") or "Warn"
    if value not in ("Ignore", "Warn", "Strict"):
        raise e.bad_request(f'fieldValidation must be one of "Ignore", "Warn", "Strict"; got {value!r}')
    return value


@dataclass(frozen=True)
class _Target:
    rt: ResourceType
    namespace: str | None
    name: str | None
    subresource: str


class ApiServer:
    """The ASGI application serving one ``Cluster``."""

    def __init__(self, cluster: Cluster, config: ServerConfig | None = None) -> None:
        self.cluster = cluster
        self.config = config or ServerConfig()
        self.closing = asyncio.Event()
        self.app = Starlette(routes=[Route("/{path:path}", self.handle, methods=_METHODS)])

    async def handle(self, request: Request) -> Response:
        """Answer one request; every failure is a Kubernetes ``Status``."""
        parts = [p for p in request.url.path.split("/") if p]
        try:
            if parts[:1] and parts[0] in _HEALTH and len(parts) == 1:
                return PlainTextResponse("ok")
            self._authorize(request)
            return await self._dispatch(request, parts)
        except e.ApiError as err:
            return _json(err.status(), err.code)

    def _authorize(self, request: Request) -> None:
        if self.config.token is None:
            return
        header = request.headers.get("authorization", "")
        if not hmac.compare_digest(header.encode(), f"Bearer {self.config.token}".encode()):
            raise e.ApiError(401, "Unauthorized", "Unauthorized")

    async def _dispatch(self, request: Request, parts: list[str]) -> Response:
        if request.method != "GET" and (len(parts) < 3 or parts[0] not in ("api", "apis")):
            raise e.method_not_allowed("the server does not allow this method on the requested resource")
        if parts == ["version"]:
            major, minor = KUBERNETES_VERSION
            return _json({"major": major, "minor": minor, "gitVersion": f"v{major}.{minor}.0+loraplane-devcluster",
                          "gitCommit": "", "gitTreeState": "clean", "buildDate": "", "goVersion": "",
                          "compiler": "", "platform": "linux/amd64"})
        if parts[:1] == ["openapi"]:
            return self._openapi(request, parts[1:])
        if not parts:
            return _json({"paths": ["/api", "/api/v1", "/apis", "/healthz", "/livez", "/openapi/v3", "/readyz",
                                    "/version"]})
        if parts in (["api"], ["apis"]) and _accepts(request, "APIGroupDiscoveryList", "apidiscovery.k8s.io", "v2"):
            return self._aggregated_discovery(core=parts == ["api"])
        if parts == ["api"]:
            return _json({"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": [
                {"clientCIDR": "0.0.0.0/0", "serverAddress": request.url.netloc}]})
        if parts == ["apis"]:
            return _json({"kind": "APIGroupList", "apiVersion": "v1",
                          "groups": [self._api_group(g) for g in self.cluster.group_versions() if g]})
        if parts[0] == "apis" and len(parts) == 2:
            if parts[1] not in self.cluster.group_versions() or not parts[1]:
                raise e.not_found("", "", parts[1])
            return _json({"kind": "APIGroup", "apiVersion": "v1", **self._api_group(parts[1])})
        if parts[0] == "api" and len(parts) >= 2:
            group, version, rest = "", parts[1], parts[2:]
        elif parts[0] == "apis" and len(parts) >= 3:
            group, version, rest = parts[1], parts[2], parts[3:]
        else:
            raise e.ApiError(404, "NotFound", "the server could not find the requested resource")
        if not rest:
            resources = self.cluster.resources_of(group, version)
            if not resources:
                raise e.ApiError(404, "NotFound", "the server could not find the requested resource")
            return _json({"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": resources[0].api_version,
                          "resources": [r for rt in resources for r in rt.api_resources()]})
        return await self._resource(request, self._target(group, version, rest))

    def _aggregated_discovery(self, core: bool) -> Response:
        """``/api`` or ``/apis`` as one ``APIGroupDiscoveryList`` (what kubectl asks for first)."""
        items = [
            {"metadata": {"name": group} if group else {},
             "versions": [{"version": v, "freshness": "Current",
                           "resources": [rt.discovery() for rt in self.cluster.resources_of(group, v)]}
                          for v in versions]}
            for group, versions in self.cluster.group_versions().items() if (group == "") == core
        ]
        return _json({"kind": "APIGroupDiscoveryList", "apiVersion": "apidiscovery.k8s.io/v2", "metadata": {},
                      "items": items}, content_type=DISCOVERY_CONTENT_TYPE)

    def _api_group(self, group: str) -> dict[str, Any]:
        versions = [{"groupVersion": f"{group}/{v}", "version": v} for v in self.cluster.group_versions()[group]]
        return {"name": group, "versions": versions, "preferredVersion": versions[0]}

    def _openapi(self, request: Request, rest: list[str]) -> Response:
        if rest == ["v3"]:
            index = {}
            for group, versions in self.cluster.group_versions().items():
                for version in versions:
                    path = f"apis/{group}/{version}" if group else f"api/{version}"
                    doc = openapi.group_version_document(self.cluster.resources_of(group, version))
                    index[path] = {"serverRelativeURL": f"/openapi/v3/{path}?hash={openapi.document_hash(doc)}"}
            return _json({"paths": index})
        if rest[:1] == ["v3"] and len(rest) in (3, 4):
            group, version = ("", rest[2]) if rest[1] == "api" and len(rest) == 3 else (rest[2], rest[-1])
            resources = self.cluster.resources_of(group, version) if (rest[1] == "apis") == bool(group) else []
            if resources:
                return _json(openapi.group_version_document(resources))
        raise e.ApiError(404, "NotFound", "the server could not find the requested resource "
                         "(the devcluster serves OpenAPI v3 only)")

    def _target(self, group: str, version: str, rest: list[str]) -> _Target:
        namespace: str | None = None
        if rest[0] == "namespaces" and len(rest) >= 3 and (group, version, rest[2]) in self.cluster.types \
                and self.cluster.types[(group, version, rest[2])].namespaced:
            namespace, rest = rest[1], rest[2:]
        if len(rest) > 3:
            raise e.ApiError(404, "NotFound", "the server could not find the requested resource")
        rt = self.cluster.resource(group, version, rest[0])
        name = rest[1] if len(rest) > 1 else None
        subresource = rest[2] if len(rest) > 2 else ""
        if (namespace is not None and not rt.namespaced) or (subresource and (subresource != "status" or not rt.status_subresource)):
            raise e.ApiError(404, "NotFound", "the server could not find the requested resource")
        if rt.namespaced and namespace is None and name is not None:
            raise e.ApiError(404, "NotFound", "the server could not find the requested resource")
        return _Target(rt, namespace, name, subresource)

    async def _body(self, request: Request) -> Any:
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > self.config.max_body_bytes:
            raise e.ApiError(413, "RequestEntityTooLarge", "the request body is too large")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.config.max_body_bytes:
                raise e.ApiError(413, "RequestEntityTooLarge", "the request body is too large")
            chunks.append(chunk)
        raw = b"".join(chunks)
        content_type = request.headers.get("content-type", "application/json").split(";")[0].strip().lower()
        if "protobuf" in content_type:
            raise e.unsupported_media_type(
                "the devcluster does not decode protobuf request bodies; send JSON or YAML (kubectl: apply or create "
                "a manifest with -f instead of generators such as `kubectl create namespace`)")
        try:
            if content_type.endswith("yaml"):
                return yaml.safe_load(raw) if raw else None
            return orjson.loads(raw) if raw else None
        except (orjson.JSONDecodeError, yaml.YAMLError) as exc:
            raise e.bad_request(f"the request body is not valid {'YAML' if content_type.endswith('yaml') else 'JSON'}: {exc}") from exc

    def _selection(self, request: Request, target: _Target) -> Selection:
        params = request.query_params
        labels = selectors.parse_label_selector(params.get("labelSelector"))
        fields = selectors.parse_field_selector(params.get("fieldSelector"), target.rt.selectable_fields)
        return Selection(target.namespace, selectors.matcher(labels, fields))

    async def _resource(self, request: Request, target: _Target) -> Response:
        params, rt, method = request.query_params, target.rt, request.method
        if target.name is None:
            if method == "GET":
                selection = self._selection(request, target)
                if _flag(params, "watch"):
                    return self._watch(request, target, selection)
                listed = self.cluster.list_objects(rt, selection, _number(params, "limit"), params.get("continue") or "")
                return self._answer(request, rt, listed, listed["items"], listed["metadata"])
            if method == "POST":
                if target.namespace is None and rt.namespaced:
                    raise e.method_not_allowed("create a namespaced object under /namespaces/<namespace>/")
                obj, warnings = self.cluster.create(rt, target.namespace, await self._body(request), dry_run=_dry_run(params),
                                                    field_validation=_field_validation(params))
                return _json(obj, 201, warnings=warnings)
            if method == "DELETE":
                listed = self.cluster.delete_collection(rt, self._selection(request, target), dry_run=_dry_run(params))
                return _json(listed)
            raise e.method_not_allowed(f"{method} is not allowed on a collection")
        if method == "GET":
            obj = self.cluster.get(rt, target.namespace, target.name)
            return self._answer(request, rt, obj, [obj], {"resourceVersion": obj["metadata"]["resourceVersion"]})
        if method == "PUT":
            obj, warnings = self.cluster.update(rt, target.namespace, target.name, await self._body(request),
                                                subresource=target.subresource, dry_run=_dry_run(params),
                                                field_validation=_field_validation(params))
            return _json(obj, warnings=warnings)
        if method == "PATCH":
            content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
            if content_type not in _PATCH_TYPES:
                raise e.unsupported_media_type(
                    f"the body of the request was in an unknown format - accepted media types include: {', '.join(_PATCH_TYPES)}"
                    " (server-side apply is not implemented by the devcluster)")
            obj, warnings = self.cluster.patch(rt, target.namespace, target.name, _PATCH_TYPES[content_type],
                                               await self._body(request), subresource=target.subresource,
                                               dry_run=_dry_run(params), field_validation=_field_validation(params))
            return _json(obj, warnings=warnings)
        if method == "DELETE":
            if target.subresource:
                raise e.method_not_allowed("delete is not allowed on a subresource")
            options = await self._body(request)
            obj, gone = self.cluster.delete(rt, target.namespace, target.name, options if isinstance(options, dict) else None,
                                            dry_run=_dry_run(params))
            return _json(obj, 200 if gone else 202)
        raise e.method_not_allowed(f"{method} is not allowed on an object")

    def _answer(self, request: Request, rt: ResourceType, data: dict[str, Any], rows: list[dict[str, Any]],
                list_meta: dict[str, Any]) -> Response:
        """The object or list as JSON, or as a ``Table`` when the client asks for one."""
        if not _accepts(request, "Table", "meta.k8s.io", "v1"):
            return _json(data)
        include = request.query_params.get("includeObject") or "Metadata"
        if include not in ("None", "Metadata", "Object"):
            raise e.bad_request(f"includeObject must be None, Metadata or Object; got {include!r}")
        now = self.cluster.clock.now()
        return _json(tables.table(rt.columns, [(r, r) for r in rows], now, include, list_meta), content_type=TABLE_CONTENT_TYPE)

    def _watch(self, request: Request, target: _Target, selection: Selection) -> Response:
        params = request.query_params
        bookmarks = _flag(params, "allowWatchBookmarks")
        timeout = _number(params, "timeoutSeconds") or self.config.watch_timeout
        as_table = _accepts(request, "Table", "meta.k8s.io", "v1")
        include = request.query_params.get("includeObject") or "Metadata"
        try:
            watch = self.cluster.watch(target.rt, selection, params.get("resourceVersion"), _flag(params, "sendInitialEvents"))
        except e.ApiError as err:
            if err.code != 410:
                raise
            return StreamingResponse(_once(orjson.dumps({"type": "ERROR", "object": err.status()}) + b"\n"),
                                     media_type="application/json")
        stream = self._events(watch, timeout, bookmarks, _flag(params, "sendInitialEvents"), as_table, include)
        return StreamingResponse(stream, media_type="application/json")

    async def _events(self, watch: Watch, seconds: float, bookmarks: bool, initial_end: bool, as_table: bool,
                      include: str) -> AsyncIterator[bytes]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds
        rt, store = watch.rt, self.cluster.store

        def encode(kind: str, obj: dict[str, Any]) -> bytes:
            if as_table and kind != "BOOKMARK":
                obj = tables.table(rt.columns, [(obj, obj)], self.cluster.clock.now(), include, {})
            return orjson.dumps({"type": kind, "object": obj}) + b"\n"

        def bookmark(annotate: bool = False) -> bytes:
            meta: dict[str, Any] = {"resourceVersion": str(store.revision)}
            if annotate:
                meta["annotations"] = {"k8s.io/initial-events-end": "true"}
            return encode("BOOKMARK", {"kind": rt.kind, "apiVersion": rt.api_version, "metadata": meta})

        try:
            for kind, obj in watch.initial:
                yield encode(kind, obj)
            if initial_end and bookmarks:
                yield bookmark(annotate=True)
            closing = asyncio.ensure_future(self.closing.wait())
            try:
                while (remaining := deadline - loop.time()) > 0 and not self.closing.is_set():
                    getter = asyncio.ensure_future(watch.subscription.queue.get())
                    wait = min(remaining, self.config.bookmark_interval) if bookmarks else remaining
                    done, _ = await asyncio.wait({getter, closing}, timeout=wait, return_when=asyncio.FIRST_COMPLETED)
                    if getter not in done:
                        getter.cancel()
                        if bookmarks and not self.closing.is_set() and loop.time() < deadline:
                            yield bookmark()
                        continue
                    if (event := watch.translate(getter.result())) is not None:
                        yield encode(*event)
            finally:
                closing.cancel()
            while not watch.subscription.queue.empty():
                if (event := watch.translate(watch.subscription.queue.get_nowait())) is not None:
                    yield encode(*event)
            if bookmarks:
                yield bookmark()
        finally:
            store.unsubscribe(watch.subscription)


async def _once(data: bytes) -> AsyncIterator[bytes]:
    yield data
