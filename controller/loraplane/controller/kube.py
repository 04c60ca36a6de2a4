"""The controller's Kubernetes side, on the official ``kubernetes`` client.

Its informers (``loraplane.kube.Informer``) feed the work queue; ``KubeApi``
wraps the few writes the controller makes (status merge patches, finalizers, Events) as coroutines. The client's
calls block, so they run in worker threads.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any, cast

from kubernetes import client as k8s

from loraplane.api import GROUP, PLURAL, VERSION
from loraplane.kube import POOL_GROUP, POOL_PLURAL, POOL_VERSION, Informer, OnChange

#: Added to every AdapterRevision; removed once no pod holds the revision any more.
FINALIZER = "loraplane.io/unload"
MERGE_PATCH = "application/merge-patch+json"
COMPONENT = "loraplane-controller"


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

    def informers(self, namespace: str | None, handlers: Mapping[str, OnChange]) -> dict[str, Informer]:
        """Informers for AdapterRevisions, InferencePools and Pods (one namespace, or all with None), each reporting
        its changes to ``handlers["revisions" | "pools" | "pods"]``."""
        custom, core = self.custom, self.core
        if namespace is None:
            sources: dict[str, tuple[str, Callable[..., Any], tuple[Any, ...]]] = {
                "revisions": ("adapterrevisions", custom.list_cluster_custom_object, (GROUP, VERSION, PLURAL)),
                "pools": ("inferencepools", custom.list_cluster_custom_object, (POOL_GROUP, POOL_VERSION, POOL_PLURAL)),
                "pods": ("pods", core.list_pod_for_all_namespaces, ()),
            }
        else:
            sources = {
                "revisions": ("adapterrevisions", custom.list_namespaced_custom_object,
                              (GROUP, VERSION, namespace, PLURAL)),
                "pools": ("inferencepools", custom.list_namespaced_custom_object,
                          (POOL_GROUP, POOL_VERSION, namespace, POOL_PLURAL)),
                "pods": ("pods", core.list_namespaced_pod, (namespace,)),
            }
        return {what: Informer(name, list_fn, args, handlers[what]) for what, (name, list_fn, args) in sources.items()}
