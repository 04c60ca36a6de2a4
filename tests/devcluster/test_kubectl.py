"""The real kubectl against a devcluster process, through the kubeconfig it writes."""

from __future__ import annotations

import itertools
import json
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.fixtures.devcluster import DevCluster
from tests.devcluster.conftest import adapter_revision

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "claims-assistant-v18.yaml"


_NAMESPACES = itertools.count()


@dataclass
class Namespaced:
    """kubectl against the session's devcluster, in one test's namespace."""

    cluster: DevCluster
    namespace: str

    @property
    def kubeconfig(self) -> Path:
        return self.cluster.kubeconfig

    def kubectl(self, *args: str, stdin: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
        return self.cluster.kubectl("-n", self.namespace, *args, stdin=stdin, check=check)


@pytest.fixture
def devcluster(devcluster_session: DevCluster) -> Namespaced:
    """The session's devcluster, in a namespace of this test's own."""
    namespace = f"test-{next(_NAMESPACES)}"
    devcluster_session.kubectl("apply", "-f", "-", stdin=json.dumps(
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}}))
    return Namespaced(devcluster_session, namespace)


def _apply(cluster: Namespaced, obj: dict[str, Any], check: bool = True) -> subprocess.CompletedProcess[str]:
    return cluster.kubectl("apply", "-f", "-", stdin=yaml.safe_dump(obj), check=check)


def _wait_for_lines(path: Path, wanted: int, timeout: float = 15.0) -> list[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = path.read_text().splitlines() if path.exists() else []
        if len(lines) >= wanted:
            return lines
        time.sleep(0.05)
    raise AssertionError(f"wanted {wanted} lines, got: {path.read_text() if path.exists() else ''!r}")


def test_apply_get_and_reapply(devcluster: Namespaced) -> None:
    example = yaml.safe_load(EXAMPLE.read_text())
    example["metadata"]["namespace"] = devcluster.namespace
    assert _apply(devcluster, example).stdout.strip() == "adapterrevision.loraplane.io/claims-assistant-v18 created"
    table = devcluster.kubectl("get", "adapterrevisions").stdout.splitlines()
    assert table[0].split() == ["NAME", "ADAPTER", "REVISION", "PHASE", "WEIGHT", "GPU", "CPU", "AGE"]
    assert table[1].split()[:3] == ["claims-assistant-v18", "claims-assistant", "v18"]
    assert "REASON" in devcluster.kubectl("get", "ar", "-o", "wide").stdout
    stored = yaml.safe_load(devcluster.kubectl("get", "ar", "claims-assistant-v18", "-o", "yaml").stdout)
    assert stored["spec"]["lora"]["rank"] == 16 and stored["metadata"]["generation"] == 1
    assert "kubectl.kubernetes.io/last-applied-configuration" in stored["metadata"]["annotations"]
    assert _apply(devcluster, example).stdout.strip().endswith("unchanged")
    changed = example
    changed["spec"]["paused"] = True
    del changed["spec"]["tenant"]
    assert _apply(devcluster, changed).stdout.strip().endswith("configured")
    after = json.loads(devcluster.kubectl("get", "ar", "claims-assistant-v18", "-o", "json").stdout)
    assert after["spec"]["paused"] is True
    assert after["spec"]["tenant"] == "default"  # removed from the manifest: the merge patch deleted it, default applies
    assert after["metadata"]["generation"] == 2


def test_invalid_adapter_revision_is_refused_with_the_schema_message(devcluster: Namespaced) -> None:
    bad = adapter_revision("bad-rank")
    bad["spec"]["lora"]["rank"] = 7
    result = _apply(devcluster, bad, check=False)
    assert result.returncode != 0
    assert ('The AdapterRevision "bad-rank" is invalid: spec.lora.rank: Unsupported value: 7: supported values: '
            '"1", "8", "16", "32", "64", "128", "256", "320", "512"') in result.stderr
    typo = adapter_revision("typo")
    typo["spec"]["tenat"] = "x"
    result = _apply(devcluster, typo, check=False)
    assert result.returncode != 0 and 'unknown field "spec.tenat"' in result.stderr
    _apply(devcluster, adapter_revision("good"))
    moved = adapter_revision("good", adapter="other")
    result = _apply(devcluster, moved, check=False)
    assert "spec.adapter is immutable; create a new AdapterRevision" in result.stderr
    assert devcluster.kubectl("get", "ar", "-o", "name").stdout.split() == ["adapterrevision.loraplane.io/good"]


def test_get_watch_shows_every_phase(devcluster: Namespaced, tmp_path: Path, kubectl_bin: str) -> None:
    _apply(devcluster, adapter_revision("claims-v2", revision="v2"))
    out = tmp_path / "watch.txt"
    with out.open("w") as sink:
        watcher = subprocess.Popen(
            [kubectl_bin, "--kubeconfig", str(devcluster.kubeconfig), "--cache-dir", str(tmp_path / "cache"),
             "-n", devcluster.namespace, "get", "ar", "-w", "--request-timeout=30s"], stdout=sink, stderr=subprocess.STDOUT)
    try:
        _wait_for_lines(out, 2)
        for phase, weight in [("Verifying", 0), ("Canary", 10), ("Stable", 100)]:
            devcluster.kubectl("patch", "ar", "claims-v2", "--subresource=status", "--type=merge",
                               "-p", json.dumps({"status": {"phase": phase, "trafficWeight": weight}}))
        lines = _wait_for_lines(out, 5)
    finally:
        watcher.terminate()
        watcher.wait(10)
    assert lines[0].split()[:4] == ["NAME", "ADAPTER", "REVISION", "PHASE"]
    assert [line.split()[3:5] for line in lines[2:5]] == [["Verifying", "0"], ["Canary", "10"], ["Stable", "100"]]


def test_describe_shows_the_objects_events(devcluster: Namespaced) -> None:
    _apply(devcluster, adapter_revision("claims-v1"))
    uid = devcluster.kubectl("get", "ar", "claims-v1", "-o", "jsonpath={.metadata.uid}").stdout
    event = {"apiVersion": "v1", "kind": "Event", "metadata": {"name": "claims-v1.verifying"},
             "involvedObject": {"apiVersion": "loraplane.io/v1alpha1", "kind": "AdapterRevision", "name": "claims-v1",
                                "namespace": devcluster.namespace, "uid": uid},
             "reason": "DigestVerified", "message": "artifact digest matches on 1 canary pod", "type": "Normal",
             "source": {"component": "loraplane-controller"}, "count": 1}
    devcluster.kubectl("create", "-f", "-", stdin=json.dumps(event))
    described = devcluster.kubectl("describe", "ar", "claims-v1").stdout
    assert "Name:         claims-v1" in described
    events = described.split("Events:")[1]
    assert "DigestVerified" in events and "artifact digest matches on 1 canary pod" in events


def test_delete_waits_for_finalizers(devcluster: Namespaced) -> None:
    held = adapter_revision("held")
    held["metadata"]["finalizers"] = ["loraplane.io/unload"]
    _apply(devcluster, held)
    _apply(devcluster, adapter_revision("plain"))
    # kubectl >= 1.33 names the namespace after "deleted"
    assert devcluster.kubectl("delete", "ar", "plain").stdout.startswith('adapterrevision.loraplane.io "plain" deleted')
    devcluster.kubectl("delete", "ar", "held", "--wait=false")
    marked = json.loads(devcluster.kubectl("get", "ar", "held", "-o", "json").stdout)
    assert marked["metadata"]["deletionTimestamp"]
    devcluster.kubectl("patch", "ar", "held", "--type=merge", "-p", '{"metadata":{"finalizers":null}}')
    gone = devcluster.kubectl("get", "ar", "held", check=False)
    assert gone.returncode != 0
    assert 'adapterrevisions.loraplane.io "held" not found' in gone.stderr


def test_pods_apply_through_strategic_merge_patch(devcluster: Namespaced) -> None:
    pod: dict[str, Any] = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "engine-0", "labels": {"pool": "llama3-8b"}},
           "spec": {"containers": [{"name": "engine", "image": "engine:1", "env": [{"name": "A", "value": "1"}]},
                                   {"name": "sidecar", "image": "sidecar:1"}]}}
    _apply(devcluster, pod)
    pod["spec"]["containers"][0]["image"] = "engine:2"
    assert _apply(devcluster, pod).stdout.strip() == "pod/engine-0 configured"
    got = json.loads(devcluster.kubectl("get", "pod", "engine-0", "-o", "json").stdout)
    assert [(c["name"], c["image"]) for c in got["spec"]["containers"]] == [("engine", "engine:2"), ("sidecar", "sidecar:1")]
    assert got["spec"]["containers"][0]["env"] == [{"name": "A", "value": "1"}]
    listed = devcluster.kubectl("get", "pods", "-l", "pool=llama3-8b").stdout.splitlines()
    assert listed[0].split() == ["NAME", "READY", "STATUS", "RESTARTS", "AGE"]
    assert listed[1].split()[:3] == ["engine-0", "0/2", "Pending"]


def test_explain_and_api_resources(devcluster: Namespaced) -> None:
    explained = devcluster.kubectl("explain", "adapterrevisions.spec.lora.rank").stdout
    assert "LoRA rank r" in explained
    resources = devcluster.kubectl("api-resources", "--api-group=loraplane.io").stdout
    assert "adapterrevisions" in resources and "ar,adrev" in resources
    pools = devcluster.kubectl("get", "inferencepools").stderr
    assert "No resources found" in pools
