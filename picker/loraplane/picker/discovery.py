"""Endpoint discovery in Kubernetes: the ready pods an ``InferencePool`` (``inference.networking.k8s.io/v1``) selects.

Two list + watch informers (``loraplane.kube.Informer``: resourceVersion, bookmarks, relist on 410 Gone) keep the
pool object and the namespace's pods current; every change recomputes the members and hands them to the picker's
``PoolState`` when they differ. Members follow ``loraplane.kube.pool_members`` (the rule the controller uses too:
the pool's namespace, ``spec.selector.matchLabels``, ready pods with an IP), addressed at
``spec.targetPorts[0].number``. Two more informers follow the
namespace's ``InferenceObjective``s for the pool, in llm-d-router's group (``llm-d.ai``) and GIE's deprecated one
(``inference.networking.x-k8s.io``): their priorities by name, the new group's winning (``ObjectiveWatch``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from kubernetes import client as k8s
from pydantic import ValidationError

from loraplane.api import OBJECTIVE_GROUPS, OBJECTIVE_PLURAL, OBJECTIVE_VERSION, InferenceObjective
from loraplane.kube import POOL_GROUP, POOL_PLURAL, POOL_VERSION, Informer, Key, SelectorError, pool_members

log = logging.getLogger(__name__)

Members = list[tuple[str, str]]


def pool_endpoints(pools: Mapping[Key, Mapping[str, Any]], pods: Mapping[Key, Mapping[str, Any]],
                   namespace: str, pool: str) -> Members | None:
    """(pod name, ip:port) of the pool's ready members, sorted; None when the InferencePool does not exist."""
    obj = pools.get((namespace, pool))
    if obj is None:
        return None
    ports = (obj.get("spec") or {}).get("targetPorts") or []
    port = ports[0].get("number") if ports else None
    if not isinstance(port, int):
        log.warning("InferencePool %s/%s has no target port: no endpoints", namespace, pool)
        return []
    try:
        members = pool_members({**obj, "metadata": {**(obj.get("metadata") or {}), "namespace": namespace}}, pods)
    except SelectorError as exc:
        log.warning("InferencePool %s/%s selects no endpoints: %s", namespace, pool, exc)
        return []
    return [(m.name, m.address(port)) for m in members]


class PoolDiscovery:
    """Follows one InferencePool, its pods and its InferenceObjectives; calls ``on_members`` whenever the member
    list changes (readiness waits for the pool and the pods, not the objectives: their CRD is optional)."""

    def __init__(self, api_client: k8s.ApiClient, namespace: str, pool: str,
                 on_members: Callable[[Members], None]) -> None:
        """Watch ``namespace`` for InferencePool ``pool`` and its pods."""
        custom, core = k8s.CustomObjectsApi(api_client), k8s.CoreV1Api(api_client)
        self.namespace = namespace
        self.pool = pool
        self.on_members = on_members
        self.members: Members | None = None
        self.pools = Informer("inferencepools", custom.list_namespaced_custom_object,
                              (POOL_GROUP, POOL_VERSION, namespace, POOL_PLURAL), self._changed)
        self.pods = Informer("pods", core.list_namespaced_pod, (namespace,), self._changed)
        self.objectives = ObjectiveWatch(api_client, namespace, pool)

    @property
    def synced(self) -> bool:
        """Both caches have been listed at least once."""
        return self.pools.synced.is_set() and self.pods.synced.is_set()

    def start(self) -> None:
        """Start both informers (call on the event loop)."""
        self.pools.start()
        self.pods.start()
        self.objectives.start()

    def stop(self) -> None:
        """Stop watching."""
        self.pools.stop()
        self.pods.stop()
        self.objectives.stop()

    def objective_priorities(self) -> Mapping[str, int]:
        """The pool's InferenceObjectives by name -> priority (empty until listed, or without the CRD)."""
        return self.objectives.priorities

    def _changed(self, kind: str, obj: Mapping[str, Any] | None) -> None:
        if not self.synced:
            return
        members = pool_endpoints(self.pools.items, self.pods.items, self.namespace, self.pool) or []
        if members != self.members:
            self.members = members
            self.on_members(members)


def objective_priorities(objectives: Mapping[Key, Mapping[str, Any]], namespace: str, pool: str) -> dict[str, int]:
    """Objective name -> priority for the ``InferenceObjective``s of ``namespace`` that name ``pool``; objects that
    do not validate are skipped (with a warning), never half-read."""
    out = {}
    for (ns, name), obj in objectives.items():
        if ns != namespace:
            continue
        try:
            objective = InferenceObjective.model_validate(obj)
        except ValidationError as exc:
            log.warning("InferenceObjective %s/%s ignored: %s", ns, name, exc.errors()[0]["msg"])
            continue
        ref = objective.spec.pool_ref
        if ref.name == pool and ref.kind == "InferencePool" and ref.group == POOL_GROUP:
            out[name] = objective.effective_priority
    return out


class ObjectiveWatch:
    """Follows the namespace's ``InferenceObjective``s in every group of ``OBJECTIVE_GROUPS`` (list + watch each; a
    group whose CRD is not installed lists nothing); ``priorities`` is the current name -> priority, an objective of
    the preferred group (``llm-d.ai``) winning over one of the same name in the deprecated group."""

    def __init__(self, api_client: k8s.ApiClient, namespace: str, pool: str) -> None:
        """Watch ``namespace`` for objectives of ``pool``."""
        custom = k8s.CustomObjectsApi(api_client)
        self.namespace = namespace
        self.pool = pool
        self.priorities: dict[str, int] = {}
        self.informers = [Informer(f"inferenceobjectives.{group}", custom.list_namespaced_custom_object,
                                   (group, OBJECTIVE_VERSION, namespace, OBJECTIVE_PLURAL), self._changed)
                          for group in OBJECTIVE_GROUPS]

    def start(self) -> None:
        """Start the informers (call on the event loop)."""
        for informer in self.informers:
            informer.start()

    def stop(self) -> None:
        """Stop watching."""
        for informer in self.informers:
            informer.stop()

    def _changed(self, kind: str, obj: Mapping[str, Any] | None) -> None:
        priorities: dict[str, int] = {}
        for informer in reversed(self.informers):  # the preferred group last: its names win
            priorities |= objective_priorities(informer.items, self.namespace, self.pool)
        self.priorities = priorities
