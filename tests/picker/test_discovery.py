"""InferencePool discovery against the devcluster API server (list + watch through the real kubernetes client)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import pytest
from kubernetes import client as k8s
from kubernetes import config as kube_config

from e2e.fixtures.devcluster import DevCluster
from loraplane.picker.discovery import Members, PoolDiscovery, objective_priorities, pool_endpoints


def pod(name: str, labels: dict[str, str]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels},
            "spec": {"containers": [{"name": "server", "image": "vllm"}]}}


def ready_status(ip: str, ready: bool = True) -> dict[str, Any]:
    return {"status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


async def eventually(check: Callable[[], bool], within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    while not check():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.05)


@pytest.mark.slow
async def test_members_follow_the_pool_and_pod_readiness(devcluster: DevCluster) -> None:
    api = kube_config.new_client_from_config(str(devcluster.kubeconfig))
    core, custom = k8s.CoreV1Api(api), k8s.CustomObjectsApi(api)
    custom.create_namespaced_custom_object("inference.networking.k8s.io", "v1", "default", "inferencepools", {
        "apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool", "metadata": {"name": "pool-a"},
        "spec": {"selector": {"matchLabels": {"app": "llm"}}, "targetPorts": [{"number": 8000}],
                 "endpointPickerRef": {"name": "picker", "port": {"number": 9002}}},
    })
    for name, labels in (("llm-0", {"app": "llm"}), ("llm-1", {"app": "llm"}), ("other", {"app": "web"})):
        core.create_namespaced_pod("default", pod(name, labels))
    core.patch_namespaced_pod_status("llm-0", "default", ready_status("10.1.0.1"))
    core.patch_namespaced_pod_status("other", "default", ready_status("10.1.0.9"))
    seen: list[Members] = []
    discovery = PoolDiscovery(api, "default", "pool-a", seen.append)
    discovery.start()
    try:
        await eventually(lambda: bool(seen) and seen[-1] == [("llm-0", "10.1.0.1:8000")])
        core.patch_namespaced_pod_status("llm-1", "default", ready_status("10.1.0.2"))
        await eventually(lambda: seen[-1] == [("llm-0", "10.1.0.1:8000"), ("llm-1", "10.1.0.2:8000")])
        core.patch_namespaced_pod_status("llm-0", "default", ready_status("10.1.0.1", ready=False))
        await eventually(lambda: seen[-1] == [("llm-1", "10.1.0.2:8000")])
        core.delete_namespaced_pod("llm-1", "default")
        await eventually(lambda: seen[-1] == [])
    finally:
        discovery.stop()
        api.close()


def test_pool_endpoints_is_pure() -> None:
    pools = {("ns", "p"): {"spec": {"selector": {"matchLabels": {"a": "b"}}, "targetPorts": [{"number": 81}]}}}
    pods = {
        ("ns", "x"): {"metadata": {"labels": {"a": "b"}}, "status": {"podIP": "fd00::1", "conditions": [{"type": "Ready", "status": "True"}]}},
        ("ns", "gone"): {"metadata": {"labels": {"a": "b"}, "deletionTimestamp": "now"},
                         "status": {"podIP": "10.0.0.2", "conditions": [{"type": "Ready", "status": "True"}]}},
        ("other", "y"): {"metadata": {"labels": {"a": "b"}}, "status": {"podIP": "10.0.0.3", "conditions": [{"type": "Ready", "status": "True"}]}},
    }
    assert pool_endpoints(pools, pods, "ns", "p") == [("x", "[fd00::1]:81")]
    assert pool_endpoints(pools, pods, "ns", "missing") is None


LLMD, LEGACY = "llm-d.ai", "inference.networking.x-k8s.io"


def objective(name: str, pool: str, priority: int | None = None, group: str = LLMD) -> dict[str, Any]:
    spec: dict[str, Any] = {"poolRef": {"name": pool}}
    if priority is not None:
        spec["priority"] = priority
    return {"apiVersion": f"{group}/v1alpha2", "kind": "InferenceObjective", "metadata": {"name": name}, "spec": spec}


@pytest.mark.slow
@pytest.mark.parametrize("group", [LLMD, LEGACY])
async def test_inference_objectives_are_watched_by_name(devcluster: DevCluster, group: str) -> None:
    """In llm-d-router's group (``llm-d.ai``, what v0.10 serves) and GIE's deprecated one alike."""
    api = kube_config.new_client_from_config(str(devcluster.kubeconfig))
    custom = k8s.CustomObjectsApi(api)
    where = (group, "v1alpha2", "default", "inferenceobjectives")
    custom.create_namespaced_custom_object(*where, objective("batch", "pool-a", -2, group))
    custom.create_namespaced_custom_object(*where, objective("other-pool", "pool-b", 5, group))
    discovery = PoolDiscovery(api, "default", "pool-a", lambda _members: None)
    discovery.start()
    try:
        await eventually(lambda: discovery.objective_priorities() == {"batch": -2})
        custom.create_namespaced_custom_object(*where, objective("interactive", "pool-a", group=group))  # unset: 0
        await eventually(lambda: discovery.objective_priorities() == {"batch": -2, "interactive": 0})
        custom.patch_namespaced_custom_object(*where, "batch", {"spec": {"priority": 3}})
        await eventually(lambda: discovery.objective_priorities() == {"batch": 3, "interactive": 0})
        custom.delete_namespaced_custom_object(*where, "batch")
        await eventually(lambda: discovery.objective_priorities() == {"interactive": 0})
    finally:
        discovery.stop()
        api.close()


@pytest.mark.slow
async def test_an_objective_in_the_llm_d_group_wins_over_the_deprecated_groups_of_the_same_name(
        devcluster: DevCluster) -> None:
    api = kube_config.new_client_from_config(str(devcluster.kubeconfig))
    custom = k8s.CustomObjectsApi(api)
    new, old = ((g, "v1alpha2", "default", "inferenceobjectives") for g in (LLMD, LEGACY))
    custom.create_namespaced_custom_object(*old, objective("batch", "pool-a", -5, LEGACY))
    custom.create_namespaced_custom_object(*old, objective("legacy-only", "pool-a", 2, LEGACY))
    custom.create_namespaced_custom_object(*new, objective("batch", "pool-a", -1))
    discovery = PoolDiscovery(api, "default", "pool-a", lambda _members: None)
    discovery.start()
    try:
        await eventually(lambda: discovery.objective_priorities() == {"batch": -1, "legacy-only": 2})
        custom.delete_namespaced_custom_object(*new, "batch")  # the deprecated group's object is what is left
        await eventually(lambda: discovery.objective_priorities() == {"batch": -5, "legacy-only": 2})
        custom.create_namespaced_custom_object(*new, objective("batch", "pool-b", 7))  # another pool's: not ours
        await asyncio.sleep(0.3)
        assert discovery.objective_priorities() == {"batch": -5, "legacy-only": 2}
    finally:
        discovery.stop()
        api.close()


def test_objective_priorities_is_pure() -> None:
    objectives = {
        ("ns", "gold"): objective("gold", "p", 10),
        ("ns", "default"): objective("default", "p"),
        ("ns", "elsewhere"): objective("elsewhere", "q", 1),
        ("other", "gold"): objective("gold", "p", -9),
        ("ns", "broken"): {"metadata": {"name": "broken"}, "spec": {"priority": "high", "poolRef": {"name": "p"}}},
        ("ns", "wrong-kind"): {**objective("wrong-kind", "p", 1), "spec": {"poolRef": {"name": "p", "kind": "Service"}}},
    }
    assert objective_priorities(objectives, "ns", "p") == {"gold": 10, "default": 0}
