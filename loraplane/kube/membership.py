"""InferencePool membership: the one rule both the picker and the controller use.

A Pod is a member of an ``InferencePool`` (``inference.networking.k8s.io/v1``) when it lives in the pool's
namespace, its labels match the pool's ``spec.selector.matchLabels`` (every pair; GIE v1 selectors have no
``matchExpressions``), it is not being deleted, it has a pod IP and its ``Ready`` condition is ``True``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from loraplane.api import validation
from loraplane.kube.informer import Key

POOL_GROUP, POOL_VERSION, POOL_PLURAL = "inference.networking.k8s.io", "v1", "inferencepools"


class SelectorError(ValueError):
    """The pool's selector cannot select anything as written (the pool needs fixing, not a retry)."""


@dataclass(frozen=True, order=True)
class Member:
    """One ready member pod: its name and pod IP."""

    name: str
    ip: str

    def address(self, port: int) -> str:
        """``ip:port`` (``[ip]:port`` for IPv6), what the picker routes to."""
        return validation.join_host_port(self.ip, port)


def match_labels(pool: Mapping[str, Any]) -> dict[str, str]:
    """The pool's ``spec.selector.matchLabels``; SelectorError when it is empty, not a string map, or uses
    ``matchExpressions`` (not part of GIE v1)."""
    selector = (pool.get("spec") or {}).get("selector")
    if not isinstance(selector, Mapping):
        raise SelectorError("spec.selector is missing")
    if selector.get("matchExpressions"):
        raise SelectorError("spec.selector.matchExpressions is not supported by InferencePool v1")
    labels = selector.get("matchLabels")
    if not isinstance(labels, Mapping) or not labels:
        raise SelectorError("spec.selector.matchLabels is empty: it would select no pod")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in labels.items()):
        raise SelectorError("spec.selector.matchLabels must map strings to strings")
    return dict(labels)


def is_ready(pod: Mapping[str, Any]) -> bool:
    """The Pod's ``Ready`` condition is ``True``."""
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions if isinstance(c, Mapping))


def pool_members(pool: Mapping[str, Any], pods: Mapping[Key, Mapping[str, Any]]) -> list[Member]:
    """The pool's ready member pods, sorted by name (the rule in the module docstring); SelectorError for a
    selector that cannot select."""
    namespace = (pool.get("metadata") or {}).get("namespace") or "default"
    labels = match_labels(pool)
    members = []
    for (ns, name), pod in pods.items():
        meta = pod.get("metadata") or {}
        ip = (pod.get("status") or {}).get("podIP")
        if (ns or "default") != namespace or meta.get("deletionTimestamp") or not ip or not is_ready(pod):
            continue
        held = meta.get("labels") or {}
        if all(held.get(k) == v for k, v in labels.items()):
            members.append(Member(name, ip))
    return sorted(members)
