"""The controller's Kubernetes side, on the official ``kubernetes`` client.

``Informer`` keeps a cache of one resource current with list + watch (resourceVersion, bookmarks, relist on
410 Gone) in a daemon thread; every change is applied on the event loop and wakes the controller. ``KubeApi``
wraps the few writes the controller makes (status merge patches, finalizers, Events) as coroutines. The client's
calls block, so they run in worker threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, cast

from kubernetes import client as k8s
from kubernetes import watch
from kubernetes.client.exceptions import ApiException

from loraplane.api import GROUP, PLURAL, VERSION

log = logging.getLogger(__name__)

#: Added to every AdapterRevision; removed once no pod holds the revision any more.
FINALIZER = "loraplane.io/unload"
POOL_GROUP, POOL_VERSION, POOL_PLURAL = "inference.networking.k8s.io", "v1", "inferencepools"
MERGE_PATCH = "application/merge-patch+json"
COMPONENT = "loraplane-controller"

Key = tuple[str, str]


def _rv(obj: dict[str, Any]) -> int | None:
    raw = obj.get("metadata", {}).get("resourceVersion")
    return int(raw) if isinstance(raw, str) and raw.isdigit() else None


def object_key(obj: dict[str, Any]) -> Key:
    """(namespace, name) of an object."""
    meta = obj.get("metadata", {})
    return meta.get("namespace") or "", meta["name"]


class Informer:
    """A cache of one resource kept current by list + watch (in a daemon thread; changes applied on the loop)."""

    def __init__(
        self,
        name: str,
        list_fn: Callable[..., Any],
        args: tuple[Any, ...],
        on_change: Callable[[], None],
        watch_timeout: int = 60,
    ) -> None:
        self.name = name
        self.list_fn = list_fn
        self.args = args
        self.on_change = on_change
        self.watch_timeout = watch_timeout
        self.items: dict[Key, dict[str, Any]] = {}
        self.synced = asyncio.Event()
        self._stop = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._watch: watch.Watch | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name=f"informer-{self.name}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._watch is not None:
            self._watch.stop()

    def remember(self, obj: dict[str, Any]) -> None:
        """Cache an object the controller just wrote (the watch event may come later), unless the cache is newer."""
        self._apply("MODIFIED", obj)

    # -- loop side -----------------------------------------------------------------------------------------------
    def _replace(self, items: list[dict[str, Any]]) -> None:
        self.items = {object_key(o): o for o in items}
        self.synced.set()
        self.on_change()

    def _apply(self, kind: str, obj: dict[str, Any]) -> None:
        key = object_key(obj)
        if kind == "DELETED":
            self.items.pop(key, None)
        else:
            cached = self.items.get(key)
            new_rv, old_rv = _rv(obj), _rv(cached) if cached else None
            if new_rv is not None and old_rv is not None and new_rv < old_rv:
                return
            self.items[key] = obj
        self.on_change()

    def _post(self, fn: Callable[..., None], *args: Any) -> None:
        assert self._loop is not None
        with contextlib.suppress(RuntimeError):  # the loop is closed: we are shutting down
            self._loop.call_soon_threadsafe(fn, *args)

    # -- thread side ---------------------------------------------------------------------------------------------
    def _run(self) -> None:
        backoff = 0.2
        resource_version: str | None = None
        while not self._stop.is_set():
            try:
                if resource_version is None:
                    response = self.list_fn(*self.args, _preload_content=False)
                    listing = json.loads(response.data)
                    resource_version = listing["metadata"]["resourceVersion"]
                    self._post(self._replace, listing.get("items", []))
                resource_version = self._watch_from(resource_version)
                backoff = 0.2
            except ApiException as exc:
                if exc.status == 410:
                    resource_version = None
                    continue
                log.warning("%s watch failed (%s); relisting in %.1fs", self.name, exc.status, backoff)
                resource_version = None
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 10.0)
            except Exception as exc:
                log.warning("%s watch failed (%s); relisting in %.1fs", self.name, exc, backoff)
                resource_version = None
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 10.0)

    def _watch_from(self, resource_version: str) -> str | None:
        """Follow the watch until it ends; returns where to resume (None: relist)."""
        self._watch = watch.Watch()
        stream = self._watch.stream(
            self.list_fn, *self.args, resource_version=resource_version, allow_watch_bookmarks=True,
            timeout_seconds=self.watch_timeout, _request_timeout=self.watch_timeout + 10,
        )
        for event in stream:
            if self._stop.is_set():
                break
            kind, obj = event["type"], event["raw_object"]
            if kind == "ERROR":
                code = obj.get("code") if isinstance(obj, dict) else None
                if code == 410:
                    return None
                raise RuntimeError(f"watch error: {obj}")
            resource_version = obj.get("metadata", {}).get("resourceVersion", resource_version)
            if kind != "BOOKMARK":
                self._post(self._apply, kind, obj)
        return resource_version


def now_rfc3339(clock: Callable[[], float]) -> str:
    """Wall-clock time as Kubernetes writes it (seconds precision, ``Z``)."""
    return datetime.fromtimestamp(clock(), UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class KubeApi:
    """The controller's writes to the API server, as coroutines (the client blocks; calls run in threads)."""

    def __init__(self, api_client: k8s.ApiClient, identity: str, clock: Callable[[], float] = time.time) -> None:
        self.api_client = api_client
        self.custom = k8s.CustomObjectsApi(api_client)
        self.core = k8s.CoreV1Api(api_client)
        self.identity = identity
        self.clock = clock

    async def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> dict[str, Any]:
        """Merge-patch an AdapterRevision's status subresource; returns the object as stored."""
        result = await asyncio.to_thread(
            self.custom.patch_namespaced_custom_object_status, GROUP, VERSION, namespace, PLURAL, name,
            {"status": status}, _content_type=MERGE_PATCH,
        )
        return cast(dict[str, Any], result)

    async def set_finalizers(self, obj: dict[str, Any], finalizers: list[str]) -> dict[str, Any]:
        """Replace the finalizer list, guarded by the object's resourceVersion (409 when it changed meanwhile)."""
        meta = obj["metadata"]
        body = {"metadata": {"finalizers": finalizers, "resourceVersion": meta["resourceVersion"]}}
        result = await asyncio.to_thread(
            self.custom.patch_namespaced_custom_object, GROUP, VERSION, meta["namespace"], PLURAL, meta["name"],
            body, _content_type=MERGE_PATCH,
        )
        return cast(dict[str, Any], result)

    async def event(self, obj: dict[str, Any], type_: str, reason: str, message: str) -> None:
        """Post a core/v1 Event about ``obj`` (what ``kubectl describe`` lists)."""
        meta = obj["metadata"]
        stamp = now_rfc3339(self.clock)
        body = {
            "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
            "involvedObject": {
                "apiVersion": obj.get("apiVersion"), "kind": obj.get("kind"), "name": meta["name"],
                "namespace": meta["namespace"], "uid": meta.get("uid"), "resourceVersion": meta.get("resourceVersion"),
            },
            "reason": reason,
            "message": message[:1024],
            "type": type_,
            "source": {"component": COMPONENT},
            "reportingComponent": COMPONENT,
            "reportingInstance": self.identity,
            "firstTimestamp": stamp,
            "lastTimestamp": stamp,
            "count": 1,
        }
        await asyncio.to_thread(self.core.create_namespaced_event, meta["namespace"], cast(Any, body))

    def informers(self, namespace: str | None, on_change: Callable[[], None]) -> dict[str, Informer]:
        """Informers for AdapterRevisions, InferencePools and Pods (one namespace, or all with None)."""
        custom, core = self.custom, self.core
        if namespace is None:
            return {
                "revisions": Informer("adapterrevisions", custom.list_cluster_custom_object, (GROUP, VERSION, PLURAL),
                                      on_change),
                "pools": Informer("inferencepools", custom.list_cluster_custom_object,
                                  (POOL_GROUP, POOL_VERSION, POOL_PLURAL), on_change),
                "pods": Informer("pods", core.list_pod_for_all_namespaces, (), on_change),
            }
        return {
            "revisions": Informer("adapterrevisions", custom.list_namespaced_custom_object,
                                  (GROUP, VERSION, namespace, PLURAL), on_change),
            "pools": Informer("inferencepools", custom.list_namespaced_custom_object,
                              (POOL_GROUP, POOL_VERSION, namespace, POOL_PLURAL), on_change),
            "pods": Informer("pods", core.list_namespaced_pod, (namespace,), on_change),
        }
