"""The rendered manifests apply with the real kubectl to the embedded API server (``loraplane devcluster``).

The embedded server serves Namespaces, Pods, Events, Leases, CRDs and the kinds CRDs define, not Deployments,
Services or RBAC (those are checked against Kubernetes' own schemas by kubernetes-validate in test_render.py).
This test applies every rendered object of a kind the server serves: the chart's CRD, the InferencePool and the
AdapterRevisions, checked server-side against the CRD schemas the chart installs.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from e2e.fixtures.devcluster import DevCluster, start_devcluster
from loraplane.devcluster.crds import inference_pool_crd
from tests.charts.conftest import NAMESPACE, RenderFn, helm_template
from tests.charts.test_render import matrix_values


@pytest.fixture(scope="module")
def bare_cluster(tmp_path_factory: pytest.TempPathFactory, helm_bin: str) -> Iterator[DevCluster]:
    """A devcluster started without CRDs, then given the chart's CRD (what `helm install` applies from crds/),
    GIE's InferencePool CRD (the documented prerequisite) and the release namespace."""
    cluster = start_devcluster(tmp_path_factory.mktemp("devcluster"), ["--no-default-crds"])
    try:
        result = helm_template(helm_bin, {}, tmp_path_factory.mktemp("render"), "--include-crds")
        assert result.returncode == 0, result.stderr
        crds = [o for o in yaml.safe_load_all(result.stdout) if o and o["kind"] == "CustomResourceDefinition"]
        namespace = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}}
        _apply(cluster, [*crds, inference_pool_crd(), namespace])
        yield cluster
    finally:
        cluster.stop()


def _served_kinds(cluster: DevCluster) -> set[tuple[str, str]]:
    """(apiVersion, kind) of every resource the server's discovery lists."""
    served = set()
    core = json.loads(cluster.kubectl("get", "--raw", "/api/v1").stdout)
    served |= {("v1", r["kind"]) for r in core["resources"] if "/" not in r["name"]}
    for group in json.loads(cluster.kubectl("get", "--raw", "/apis").stdout)["groups"]:
        for version in group["versions"]:
            listing = json.loads(cluster.kubectl("get", "--raw", f"/apis/{version['groupVersion']}").stdout)
            served |= {(version["groupVersion"], r["kind"]) for r in listing["resources"] if "/" not in r["name"]}
    return served


def _apply(cluster: DevCluster, objects: list[dict[str, Any]], check: bool = True) -> str:
    result = cluster.kubectl("apply", "-f", "-", stdin=yaml.safe_dump_all(objects), check=check)
    return result.stdout + result.stderr


@pytest.mark.slow
def test_rendered_manifests_apply_cleanly(bare_cluster: DevCluster, render: RenderFn) -> None:
    served = _served_kinds(bare_cluster)
    rendered = render(matrix_values("engine", "bundled", "envoy"))
    applicable = [o for o in rendered.objects if (o["apiVersion"], o["kind"]) in served]
    kinds = {o["kind"] for o in applicable}
    assert {"InferencePool", "AdapterRevision"} <= kinds, f"nothing to apply of the custom kinds: {kinds}"

    out = _apply(bare_cluster, applicable)
    assert out.count("created") == len(applicable), out
    assert _apply(bare_cluster, applicable).count("unchanged") == len(applicable), "a re-apply changed something"

    for obj in applicable:
        plural = {"InferencePool": "inferencepools", "AdapterRevision": "adapterrevisions"}[obj["kind"]]
        stored = json.loads(bare_cluster.kubectl("get", plural, obj["metadata"]["name"], "-n", NAMESPACE,
                                                 "-o", "json").stdout)
        # Nothing pruned: every field the chart renders is one the CRD schema knows.
        assert _is_subset(obj["spec"], stored["spec"]), (obj["kind"], obj["spec"], stored["spec"])
        assert stored["metadata"]["labels"] == obj["metadata"]["labels"]


def _is_subset(small: Any, big: Any) -> bool:
    if isinstance(small, dict):
        return isinstance(big, dict) and all(k in big and _is_subset(v, big[k]) for k, v in small.items())
    if isinstance(small, list):
        return isinstance(big, list) and len(small) == len(big) and all(map(_is_subset, small, big))
    return bool(small == big)


@pytest.mark.slow
def test_the_charts_crd_rejects_an_invalid_adapter_revision(bare_cluster: DevCluster, render: RenderFn) -> None:
    values = matrix_values("engine", "bundled", "envoy")
    values["adapterRevisions"][0]["spec"]["lora"]["rank"] = 0
    values["adapterRevisions"][0]["name"] = "invalid-rank"
    bad = render(values).get("AdapterRevision", "invalid-rank")
    out = _apply(bare_cluster, [bad], check=False)
    assert "rank" in out and "created" not in out, out
    listed = bare_cluster.kubectl("get", "adapterrevisions", "-n", NAMESPACE, "-o", "name").stdout
    assert bad["metadata"]["name"] not in listed
