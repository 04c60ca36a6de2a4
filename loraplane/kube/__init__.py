"""Kubernetes plumbing shared by the picker and the controller: list + watch informers and InferencePool
membership (one rule: namespaced, the pool's selector, ready pods)."""

from loraplane.kube.informer import Informer, Key, OnChange, object_key
from loraplane.kube.membership import (
    POOL_GROUP,
    POOL_PLURAL,
    POOL_VERSION,
    Member,
    SelectorError,
    is_ready,
    match_labels,
    pool_members,
)

__all__ = [
    "POOL_GROUP",
    "POOL_PLURAL",
    "POOL_VERSION",
    "Informer",
    "Key",
    "Member",
    "OnChange",
    "SelectorError",
    "is_ready",
    "match_labels",
    "object_key",
    "pool_members",
]
