"""Hostile artifacts end to end: the devcluster + the real kubectl, a real Redis, a real OCI registry, an engine with
its sidecar and a ``loraplane-controller``.

A gzip bomb pushed to the registry, ``https://`` and ``oci://`` artifacts aimed at the Redis port (SSRF), and
``file://`` artifacts outside the sidecar's roots (one existing, one not) each end ``Failed`` with reason
``ArtifactRefused`` and the sidecar's cause in the status message and a Warning event, read with
``kubectl get adapterrevision -o yaml``. A good revision goes Stable, is deleted, and its cache directory goes too.
"""

from __future__ import annotations

import hashlib
import json
import sys
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from e2e.fixtures.devcluster import DevCluster, mark_ready, start_devcluster
from e2e.fixtures.processes import (
    LOOPBACK,
    ManagedProcess,
    RedisServer,
    free_port,
    start_redis,
    wait_for_port,
)
from e2e.fixtures.registry import OciRegistry, start_registry
from e2e.fixtures.waiting import wait_until
from loraplane.api import cache_key
from tests.sidecar.adapters import zero_bomb

pytestmark = pytest.mark.slow

POOL = "pool-hostile"
MODULES = ["q_proj", "v_proj"]


@dataclass
class Stack:
    work: Path
    cluster: DevCluster
    redis: RedisServer
    registry: OciRegistry
    artifacts: Path
    cache_dir: Path
    engine_port: int
    base_digest: str
    processes: list[ManagedProcess]

    def apply(self, name: str, adapter: str, uri: str, digest: str) -> None:
        manifest = {
            "apiVersion": "loraplane.io/v1alpha1", "kind": "AdapterRevision",
            "metadata": {"name": name, "namespace": "default"},
            "spec": {"adapter": adapter, "revision": "v1", "poolRef": {"name": POOL},
                     "baseModel": {"name": "tiny", "digest": self.base_digest},
                     "artifact": {"uri": uri, "digest": digest},
                     "lora": {"rank": 8, "alpha": 8, "dtype": "float32", "targetModules": MODULES}},
        }
        self.cluster.kubectl("apply", "-f", "-", stdin=yaml.safe_dump(manifest))

    def revision_yaml(self, name: str) -> dict[str, Any]:
        return yaml.safe_load(self.cluster.kubectl("get", "adapterrevision", name, "-o", "yaml").stdout)

    def phase(self, name: str) -> str:
        return (self.revision_yaml(name).get("status") or {}).get("phase", "")

    def warnings(self, name: str) -> list[str]:
        events = json.loads(self.cluster.kubectl("get", "events", "-o", "json").stdout)["items"]
        return [f"{e['reason']}: {e['message']}" for e in events
                if e["involvedObject"]["name"] == name and e["type"] == "Warning"]


def _cluster_objects() -> str:
    pool = {"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
            "metadata": {"name": POOL, "namespace": "default"},
            "spec": {"selector": {"matchLabels": {"app": "engine"}}, "targetPorts": [{"number": 8000}],
                     "endpointPickerRef": {"name": "picker", "port": {"number": 9002}}}}
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "pod-0", "namespace": "default",
                                                            "labels": {"app": "engine"}},
           "spec": {"containers": [{"name": "engine", "image": "loraplane:dev"}]}}
    return yaml.safe_dump_all([pool, pod])


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    work = tmp_path_factory.mktemp("hostile-artifacts")
    redis_server = start_redis(work)
    cluster = start_devcluster(work / "devcluster")
    registry = start_registry(work / "registry")
    processes: list[ManagedProcess] = []
    artifacts, cache_dir = work / "artifacts", work / "pod-0"
    artifacts.mkdir()
    cache_dir.mkdir()
    try:
        port = free_port()
        engine = ManagedProcess(
            [sys.executable, "-m", "loraplane.engine", "--model", "tiny", "--port", str(port), "--max-loras", "2",
             "--adapter-root", str(cache_dir), "--enable-lora-runtime-updating", "--max-model-len", "128"],
            work / "engine.log").start()
        processes.append(engine)
        wait_for_port(port, proc=engine.proc, timeout=120)
        # the registry's own port is the one internal target this sidecar may reach (not Redis, not anything else)
        processes.append(ManagedProcess(
            [sys.executable, "-m", "loraplane.sidecar", "--pool", POOL, "--pod", "pod-0", "--runtime", "engine",
             "--runtime-url", f"http://{LOOPBACK}:{port}", "--redis-url", redis_server.url,
             "--cache-dir", str(cache_dir), "--heartbeat", "0.3", "--report-ttl", "3", "--metrics-port", "0",
             "--file-root", str(artifacts), "--oci-plain-http", registry.host,
             "--artifact-allow-internal", registry.host, "--fetch-read-timeout", "5"],
            work / "sidecar.log").start())
        processes.append(ManagedProcess(
            [sys.executable, "-m", "loraplane.controller.cli", "--kubeconfig", str(cluster.kubeconfig),
             "--redis-url", redis_server.url, "--identity", "controller-a", "--resync-seconds", "0.3"],
            work / "controller.log").start())
        base_digest = httpx.get(f"http://{LOOPBACK}:{port}/admin/adapters", timeout=10).json()["base_model_digest"]
        cluster.kubectl("apply", "-f", "-", stdin=_cluster_objects())
        mark_ready(cluster, "pod-0")
        yield Stack(work, cluster, redis_server, registry, artifacts, cache_dir, port, base_digest, processes)
    finally:
        for process in processes:
            process.stop()
        registry.stop()
        cluster.stop()
        redis_server.stop()


def _sha256(path: Path) -> str:
    return "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()


def test_hostile_artifacts_fail_with_their_reason_and_deleted_revisions_free_their_cache(stack: Stack) -> None:
    bomb = zero_bomb(stack.work / "bomb.tar.gz", 1 << 30)
    redis_port = stack.redis.port
    outside = stack.work / "outside.tar"
    outside.write_bytes(b"not below the file roots")
    cases = {  # name -> (uri, digest, the sidecar's own reason word expected in the message)
        "bomb": (stack.registry.push("adapters/bomb", "v1", bomb), _sha256(bomb), "CompressionRatioTooHigh"),
        "ssrf-https": (f"https://{LOOPBACK}:{redis_port}/adapter.tar", "sha256:" + "1" * 64, "InternalAddress"),
        "ssrf-oci": (f"oci://{LOOPBACK}:{redis_port}/adapters/x:v1", "sha256:" + "2" * 64, "InternalAddress"),
        "outside-file": (f"file://{outside}", _sha256(outside), "FileOutsideRoots"),
        "outside-missing": (f"file://{stack.work}/missing.tar", "sha256:" + "3" * 64, "FileOutsideRoots"),
    }
    for name, (uri, digest, _) in cases.items():
        stack.apply(name, name, uri, digest)

    from loraplane.engine.make_adapters import model_config, write_adapter

    write_adapter(stack.work / "good", model_config("tiny"), 8, seed=1, targets=MODULES)
    good = stack.artifacts / "good.tar"
    with tarfile.open(good, "w") as tar:
        tar.add(stack.work / "good", arcname="good")
    stack.apply("good", "good", f"file://{good}", _sha256(good))

    for name, (_, _, cause) in cases.items():
        wait_until(lambda name=name: stack.phase(name) == "Failed", 90, f"{name} failed", *stack.processes)
        status = stack.revision_yaml(name)["status"]
        print(f"\n[kubectl get adapterrevision {name} -o yaml] phase={status['phase']} reason={status['reason']} "
              f"message={status['message']}")
        assert status["reason"] == "ArtifactRefused", status
        assert cause in status["message"] and "pod-0" in status["message"], status
        assert any(w.startswith("ArtifactRefused") and cause in w for w in stack.warnings(name)), stack.warnings(name)
    # the bomb never reached the disk in full: nothing of it is left, and the cache holds no big file
    assert all(p.stat().st_size < 64 << 20 for p in stack.cache_dir.rglob("*") if p.is_file())

    wait_until(lambda: stack.phase("good") == "Stable", 120, "good stable", *stack.processes)
    entry = stack.cache_dir / "adapters" / cache_key(stack.base_digest, "good", "v1", _sha256(good)).removeprefix("sha256:")
    assert (entry / "adapter_model.safetensors").is_file()
    stack.cluster.kubectl("delete", "adapterrevision", "good", "--wait=false")
    wait_until(lambda: stack.cluster.kubectl("get", "adapterrevision", "good", check=False).returncode != 0, 60,
               "good deleted (finalizer released)", *stack.processes)
    wait_until(lambda: not entry.exists(), 30, "the deleted revision's cache directory removed", *stack.processes)
    listing = httpx.get(f"http://{LOOPBACK}:{stack.engine_port}/admin/adapters", timeout=10).json()["adapters"]
    assert "good@v1" not in {a["served_name"] for a in listing}
