"""InferencePool membership: one rule (namespaced, the pool's selector, ready pods) for the picker and controller."""

from __future__ import annotations

from typing import Any

import pytest

from loraplane.api import validation
from loraplane.kube import Member, SelectorError, pool_members


def pool(namespace: str = "serving", selector: Any = None) -> dict[str, Any]:
    return {"metadata": {"name": "pool", "namespace": namespace},
            "spec": {"selector": {"matchLabels": {"app": "engine", "tier": "a"}} if selector is None else selector}}


def pod(labels: dict[str, str], ip: str | None = "10.0.0.1", ready: str | None = "True",
        deleting: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {"labels": labels}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    status: dict[str, Any] = {"podIP": ip} if ip else {}
    if ready is not None:
        status["conditions"] = [{"type": "PodScheduled", "status": "True"}, {"type": "Ready", "status": ready}]
    return {"metadata": meta, "status": status}


MATCH = {"app": "engine", "tier": "a"}


def test_only_pods_of_the_pools_namespace_are_members() -> None:
    pods = {("serving", "a"): pod(MATCH), ("other", "b"): pod(MATCH), ("", "c"): pod(MATCH)}
    assert pool_members(pool(), pods) == [Member("a", "10.0.0.1")]
    assert [m.name for m in pool_members(pool("default"), pods)] == ["c"]  # no namespace means "default"


def test_every_match_label_must_match() -> None:
    pods = {("serving", "both"): pod(MATCH), ("serving", "extra"): pod({**MATCH, "zone": "x"}),
            ("serving", "one"): pod({"app": "engine"}), ("serving", "wrong"): pod({"app": "engine", "tier": "b"}),
            ("serving", "none"): pod({})}
    assert [m.name for m in pool_members(pool(), pods)] == ["both", "extra"]


def test_only_ready_pods_with_an_ip_that_are_not_deleting() -> None:
    pods = {("serving", "ready"): pod(MATCH), ("serving", "unready"): pod(MATCH, ready="False"),
            ("serving", "unknown"): pod(MATCH, ready=None), ("serving", "no-ip"): pod(MATCH, ip=None),
            ("serving", "deleting"): pod(MATCH, deleting=True)}
    assert [m.name for m in pool_members(pool(), pods)] == ["ready"]


@pytest.mark.parametrize("selector", [{}, {"matchLabels": {}}, {"matchLabels": {"app": 1}},
                                      {"matchLabels": {"app": "engine"},
                                       "matchExpressions": [{"key": "app", "operator": "Exists"}]}])
def test_a_selector_that_cannot_select_is_an_error_not_everything(selector: dict[str, Any]) -> None:
    with pytest.raises(SelectorError):
        pool_members(pool(selector=selector), {("serving", "a"): pod(MATCH)})


def test_member_addresses_and_the_one_address_parser() -> None:
    assert Member("a", "fd00::1").address(8000) == "[fd00::1]:8000"
    assert Member("a", "10.0.0.1").address(8000) == "10.0.0.1:8000"
    assert validation.parse_host_port("[fd00::1]:8000") == ("fd00::1", 8000)
    assert validation.parse_host_port("pod-a.ns:80") == ("pod-a.ns", 80)
    for bad in ("fd00::1:80", "host", "host:", ":80", "host:http", "host:65536", "[::1]"):
        with pytest.raises(ValueError):
            validation.parse_host_port(bad)
    # the port optional (subset hints, CIDR allowances): the same parser
    assert validation.split_host_port("[fd00::/8]:443") == ("fd00::/8", 443)
    assert validation.split_host_port("fd00::1") == ("fd00::1", None)
    assert validation.split_host_port("[fd00::1]") == ("fd00::1", None)
    assert validation.split_host_port("10.0.0.0/8:80") == ("10.0.0.0/8", 80)
    for bad in ("", "[]", "[::1]80", "[::1", "host:", "host:65536"):
        with pytest.raises(ValueError):
            validation.split_host_port(bad)


def test_the_one_pod_name_validator() -> None:
    assert validation.is_pod_name("pod-0.example")
    assert not validation.is_pod_name("Pod_0") and not validation.is_pod_name("a" * 254) and not validation.is_pod_name("")
