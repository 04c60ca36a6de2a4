"""Redis key and channel names: the one place they are spelled.

Every key of a pool shares the hash tag ``{pool}`` so that one pool's keys live in one Redis Cluster slot and can
be read in one pipeline or transaction.
"""

from __future__ import annotations

from loraplane.api import validation as v

PREFIX = "loraplane"


def _pool(pool: str) -> str:
    if not v.matches(v.DNS1123_SUBDOMAIN, pool):
        raise ValueError(f"pool name {pool!r} is not a DNS-1123 subdomain")
    return f"{PREFIX}:{{{pool}}}"


def _pod(pod: str) -> str:
    if not v.is_pod_name(pod):
        raise ValueError(f"pod name {pod!r} is not a DNS-1123 subdomain")
    return pod


def target_state(pool: str, pod: str) -> str:
    """The pod's ``TargetState`` (written by the controller)."""
    return f"{_pool(pool)}:target:{_pod(pod)}"


def target_state_pattern(pool: str) -> str:
    """A SCAN pattern matching every pod's target state key in the pool."""
    return f"{_pool(pool)}:target:*"


def target_spec(pool: str, served_name: str) -> str:
    """The pool's catalogue entry for one served revision (a ``TargetSpec``, written by the controller): what every
    pod's ``TargetState`` names by reference."""
    if not served_name or any(c in served_name for c in "*?[]\\ "):
        raise ValueError(f"served name {served_name!r} cannot name a key")
    return f"{_pool(pool)}:target-spec:{served_name}"


def target_spec_pattern(pool: str) -> str:
    """A SCAN pattern (and ACL key pattern) matching every catalogue entry of the pool."""
    return f"{_pool(pool)}:target-spec:*"


def residency_report(pool: str, pod: str) -> str:
    """The pod's ``ResidencyReport`` (written by its sidecar, with a TTL)."""
    return f"{_pool(pool)}:residency:{_pod(pod)}"


def residency_index(pool: str) -> str:
    """A set of the pod names that have reported (members may have expired reports)."""
    return f"{_pool(pool)}:residency-pods"


def route_table(pool: str) -> str:
    """The pool's ``RouteTable`` (written by the controller)."""
    return f"{_pool(pool)}:routes"


def route_head(pool: str) -> str:
    """The pool's ``RouteHead``: the latest route table generation and the snapshot's (``routedeltas``)."""
    return f"{_pool(pool)}:routes:head"


def route_delta(pool: str, generation: int) -> str:
    """The ``RouteDelta`` that makes route table ``generation`` from the one before (``routedeltas``)."""
    if generation < 1:
        raise ValueError(f"route delta generation {generation} is not positive")
    return f"{_pool(pool)}:routes:delta:{generation}"


def revision_status(pool: str, namespace: str, name: str) -> str:
    """The ``StatusRecord`` of one AdapterRevision (written by the controller before the status itself)."""
    if not v.matches(v.DNS1123_LABEL, namespace) or not v.matches(v.DNS1123_SUBDOMAIN, name):
        raise ValueError(f"revision {namespace!r}/{name!r} is not a Kubernetes namespace and name")
    return f"{_pool(pool)}:status:{namespace}/{name}"


def revision_status_pattern(pool: str) -> str:
    """A SCAN pattern (and ACL key pattern) matching every revision's status record in the pool."""
    return f"{_pool(pool)}:status:*"


def route_keys_pattern(pool: str) -> str:
    """A pattern matching the route table, its head and its deltas (the controller's ACL write pattern)."""
    return f"{_pool(pool)}:routes*"


def request_rates(pool: str, replica: str) -> str:
    """One picker replica's ``RequestRates`` (the requests it routed); the pool's rates are the sum over replicas
    (``RequestRates.combine``). Each replica writes it with its ``picker_counters``, so a reader finds the replicas
    by the counters keys."""
    return f"{_pool(pool)}:rates:{_pod(replica)}"


def picker_counters(pool: str, replica: str) -> str:
    """One picker replica's ``PickerCounters``."""
    return f"{_pool(pool)}:counters:{_pod(replica)}"


def picker_counters_pattern(pool: str) -> str:
    """A SCAN pattern matching every picker replica's counters key in the pool."""
    return f"{_pool(pool)}:counters:*"


def picker_in_flight(pool: str, replica: str) -> str:
    """One picker replica's ``PickerInFlight`` (its requests in flight, per endpoint), with a TTL of a few periods:
    the other replicas add it to their own counts."""
    return f"{_pool(pool)}:in-flight:{_pod(replica)}"


def picker_in_flight_pattern(pool: str) -> str:
    """A SCAN pattern matching every picker replica's in-flight key in the pool."""
    return f"{_pool(pool)}:in-flight:*"


def target_changed_channel(pool: str) -> str:
    """Pub/sub channel: the message is the pod name whose target state changed."""
    return f"{_pool(pool)}:target-changed"


def residency_changed_channel(pool: str) -> str:
    """Pub/sub channel: the message is the pod name whose residency report changed."""
    return f"{_pool(pool)}:residency-changed"


def routes_changed_channel(pool: str) -> str:
    """Pub/sub channel: the message is the new route table generation."""
    return f"{_pool(pool)}:routes-changed"


def kv_blocks(pool: str, pod: str) -> str:
    """The pod's ``KvBlockSet`` (written by its sidecar from the runtime's KV-cache events, with a TTL)."""
    return f"{_pool(pool)}:kv-blocks:{_pod(pod)}"


def kv_blocks_changed_channel(pool: str) -> str:
    """Pub/sub channel: the message is the pod name whose ``KvBlockSet`` changed."""
    return f"{_pool(pool)}:kv-blocks-changed"
