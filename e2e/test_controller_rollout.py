"""Rollouts end to end: the devcluster + the real kubectl, a real Redis, three real engines with their sidecars,
the real picker behind a real Envoy, and two ``loraplane-controller`` processes sharing a Lease.

One scenario, in order: v1 applied -> Stable and served through Envoy; v2 -> every phase, traffic follows the
canary steps, promoted, v1 Retiring then evicted from every engine; v3 with a wrong digest -> Failed at Verifying
while v2 keeps 100 %; v4 whose probe fails -> rolled back; v5 mid-canary: the leading controller is killed (SIGKILL)
and the other replica resumes without repeating or skipping a gate, then a manual rollback returns all traffic to
v2 at once. An invalid AdapterRevision is refused by the API server with the schema's message. Throughout, a client
sends requests through Envoy and every response must come from a revision the RouteTable named at that moment
(or one request earlier: the picker follows a change by a notice).
"""

from __future__ import annotations

import hashlib
import json
import signal
import subprocess
import sys
import tarfile
import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import yaml

from e2e.fixtures.devcluster import DevCluster, mark_ready, start_devcluster
from e2e.fixtures.picker import Gateway, start_gateway
from e2e.fixtures.processes import LOOPBACK, ManagedProcess, free_port, start_redis, wait_for_port
from e2e.fixtures.waiting import wait_until
from loraplane.api import SERVED_ADAPTER_HEADER, RouteTable, keys
from loraplane.picker.envoy import UPSTREAM_HEADER

pytestmark = pytest.mark.slow

POOL = "pool-ctl"
PODS = ("pod-0", "pod-1", "pod-2")
MODULES = ["q_proj", "v_proj"]
REVISIONS = ("v1", "v2", "v3", "v4", "v5")




@dataclass
class Traffic:
    """A client sending completions through Envoy; each response is checked against the route table around it."""

    url: str
    client: redis.Redis
    phase: str = "v1"
    records: list[tuple[str, str, bool]] = field(default_factory=list)  # (phase label, served name, named?)
    errors: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def named(self) -> set[str]:
        raw = self.client.get(keys.route_table(POOL))
        if raw is None:
            return set()
        return {w.served_name for e in RouteTable.from_json(raw).models.values() for w in e.revisions}

    def run(self) -> None:
        i = 0
        earlier: set[str] = set()
        with httpx.Client(timeout=60) as http:
            while not self.stop.is_set():
                i += 1
                before = self.named()
                response = http.post(f"{self.url}/v1/completions", headers={"x-session-id": f"user-{i}"},
                                     json={"model": "claims", "prompt": "hello", "max_tokens": 1, "temperature": 0})
                after = self.named()
                if response.status_code != 200:
                    upstream = response.headers.get(UPSTREAM_HEADER, "?")
                    self.errors.append(f"{self.phase} via {upstream}: {response.status_code} {response.text[:100]}")
                    continue
                served = response.headers[SERVED_ADAPTER_HEADER]
                # the picker follows the table by a change notice: a request sent just after a change may still be
                # routed by the table read before the previous request, never by an older one
                self.records.append((self.phase, served, served in earlier | before | after))
                earlier = before

    def served_during(self, phase: str) -> Counter[str]:
        return Counter(served for label, served, _ in self.records if label == phase)


@dataclass
class Stack:
    work: Path
    cluster: DevCluster
    client: redis.Redis
    base_digest: str
    artifacts: dict[str, tuple[str, str]]  # revision -> (uri, digest)
    engines: dict[str, int]
    controllers: dict[str, ManagedProcess]
    gateway: Gateway
    redis_url: str

    def start_controller(self, identity: str) -> ManagedProcess:
        args = [sys.executable, "-m", "loraplane.controller.cli", "--kubeconfig", str(self.cluster.kubeconfig),
                "--redis-url", self.redis_url, "--identity", identity, "--resync-seconds", "0.3",
                "--lease-duration", "3", "--renew-deadline", "2", "--retry-period", "0.5"]
        process = ManagedProcess(args, self.work / f"controller-{identity}.log").start()
        self.controllers[identity] = process
        return process

    def kubectl(self, *args: str, stdin: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
        return self.cluster.kubectl(*args, stdin=stdin, check=check)

    def apply(self, manifest: dict[str, Any], check: bool = True) -> subprocess.CompletedProcess[str]:
        return self.kubectl("apply", "-f", "-", stdin=yaml.safe_dump(manifest), check=check)

    def status(self, rev: str) -> dict[str, Any]:
        out = self.kubectl("get", "adapterrevision", f"claims-{rev}", "-o", "json").stdout
        return json.loads(out).get("status") or {}

    def label(self, rev: str) -> str:
        status = self.status(rev)
        phase = status.get("phase", "")
        return f"{phase}({status['canaryStep']})" if phase == "Canary" else phase

    def routes(self) -> dict[str, int]:
        raw = self.client.get(keys.route_table(POOL))
        table = RouteTable.from_json(raw) if raw else None
        return {w.revision: w.weight for e in (table.models.values() if table else []) for w in e.revisions}

    def engine_holds(self, served: str) -> list[str]:
        return [pod for pod, port in self.engines.items()
                if served in {a["served_name"] for a in httpx.get(f"http://{LOOPBACK}:{port}/admin/adapters",
                                                                    timeout=10).json()["adapters"]}]

    def events(self, rev: str) -> Counter[str]:
        out = json.loads(self.kubectl("get", "events", "-o", "json").stdout)
        return Counter(e["reason"] for e in out["items"] if e["involvedObject"]["name"] == f"claims-{rev}")

    def leader(self) -> str:
        return self.kubectl("get", "lease", "loraplane-controller", "-o", "jsonpath={.spec.holderIdentity}").stdout


def manifest(stack: Stack, rev: str, *, artifact: str | None = None, digest_of: str | None = None,
             **rollout: Any) -> dict[str, Any]:
    uri, _ = stack.artifacts[artifact or rev]
    _, digest = stack.artifacts[digest_of or artifact or rev]
    return {
        "apiVersion": "loraplane.io/v1alpha1",
        "kind": "AdapterRevision",
        "metadata": {"name": f"claims-{rev}", "namespace": "default"},
        "spec": {
            "adapter": "claims", "revision": rev, "poolRef": {"name": POOL},
            "baseModel": {"name": "tiny", "digest": stack.base_digest},
            "artifact": {"uri": uri, "digest": digest},
            "lora": {"rank": 8, "alpha": 8, "dtype": "float32", "targetModules": MODULES},
            "tenant": "acme",
            "rollout": {
                "canary": {"pods": 1},
                "steps": [{"weight": 10, "pauseSeconds": 3}, {"weight": 50, "pauseSeconds": 3}],
                "analysis": {"minRequests": 2, "maxErrorRateIncrease": 0.5, "maxTtftRatio": 50},
                "healthProbe": {"prompt": "hello", "maxTokens": 2, "ttftBoundMs": 20000, "timeoutSeconds": 60},
                "rollbackWindowSeconds": 3,
                "evictionDelaySeconds": 2,
                **rollout,
            },
        },
    }


def _cluster_objects() -> str:
    pool = {"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
            "metadata": {"name": POOL, "namespace": "default"},
            "spec": {"selector": {"matchLabels": {"app": "engine"}}, "targetPorts": [{"number": 8000}],
                     "endpointPickerRef": {"name": "picker", "port": {"number": 9002}}}}
    pods = [{"apiVersion": "v1", "kind": "Pod", "metadata": {"name": p, "namespace": "default", "labels": {"app": "engine"}},
             "spec": {"containers": [{"name": "engine", "image": "loraplane:dev"}]}} for p in PODS]
    return yaml.safe_dump_all([pool, *pods])


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    from loraplane.engine.make_adapters import model_config, write_adapter

    work = tmp_path_factory.mktemp("controller-e2e")
    redis_server = start_redis(work)
    cluster = start_devcluster(work / "devcluster")
    processes: list[ManagedProcess] = []
    artifacts_dir = work / "artifacts"
    artifacts = {}
    for seed, rev in enumerate(REVISIONS):
        directory = artifacts_dir / f"claims-{rev}"
        write_adapter(directory, model_config("tiny"), 8, seed=seed, targets=MODULES)
        tar_path = artifacts_dir / f"claims-{rev}.tar"
        with tarfile.open(tar_path, "w") as tar:
            tar.add(directory, arcname=directory.name)
        artifacts[rev] = (f"file://{tar_path}", "sha256:" + hashlib.sha256(tar_path.read_bytes()).hexdigest())
    engines = {}
    gateway = None
    try:
        for pod in PODS:
            port = free_port()
            root = work / pod
            root.mkdir()
            processes.append(ManagedProcess(
                [sys.executable, "-m", "loraplane.engine", "--model", "tiny", "--port", str(port), "--max-loras", "2",
                 "--max-cpu-loras", "4", "--adapter-root", str(root), "--enable-lora-runtime-updating",
                 "--max-model-len", "128", "--max-num-seqs", "8"], work / f"engine-{pod}.log").start())
            engines[pod] = port
        for pod, port in engines.items():
            wait_for_port(port, proc=processes[list(engines).index(pod)].proc, timeout=120)
            processes.append(ManagedProcess(
                [sys.executable, "-m", "loraplane.sidecar", "--pool", POOL, "--pod", pod, "--runtime", "engine",
                 "--runtime-url", f"http://{LOOPBACK}:{port}", "--redis-url", redis_server.url,
                 "--cache-dir", str(work / pod), "--heartbeat", "0.3", "--report-ttl", "3", "--metrics-port", "0",
                 "--file-root", str(artifacts_dir)], work / f"sidecar-{pod}.log").start())
        base_digest = httpx.get(f"http://{LOOPBACK}:{engines['pod-0']}/admin/adapters", timeout=10).json()[
            "base_model_digest"]
        gateway = start_gateway(work, POOL, redis_server.url)
        cluster.kubectl("apply", "-f", "-", stdin=_cluster_objects())
        mark_ready(cluster, *PODS)
        stack = Stack(work, cluster, redis.Redis.from_url(redis_server.url), base_digest, artifacts, engines, {},
                      gateway, redis_server.url)
        stack.start_controller("controller-a")
        stack.start_controller("controller-b")
        yield stack
    finally:
        for process in processes:
            process.stop()
        if gateway is not None:
            gateway.stop()
        for identity in ("controller-a", "controller-b"):
            if "stack" in locals() and identity in stack.controllers:
                stack.controllers[identity].stop()
        cluster.stop()
        redis_server.stop()


def test_rollouts_end_to_end(stack: Stack, kubectl_bin: str) -> None:
    watch = subprocess.Popen(
        [kubectl_bin, "--kubeconfig", str(stack.cluster.kubeconfig), "--cache-dir", str(stack.work / "kube-cache-w"),
         "get", "adapterrevisions", "-w", "--no-headers"],
        stdout=open(stack.work / "watch.txt", "w"), stderr=subprocess.STDOUT)
    try:
        _scenario(stack)
    finally:
        watch.send_signal(signal.SIGTERM)
        watch.wait(10)
    lines = (stack.work / "watch.txt").read_text().splitlines()

    def phases(name: str) -> list[str]:
        return [line.split()[3] for line in lines if line.startswith(f"{name} ") and len(line.split()) > 4]

    v2 = phases("claims-v2")
    # kubectl get -w showed every phase, in order
    assert [p for i, p in enumerate(v2) if i == 0 or v2[i - 1] != p] == [
        "Verifying", "Prewarming", "Activating", "Probing", "Canary", "Stable"], v2
    assert phases("claims-v1")[-1] == "Retired" and "Retiring" in phases("claims-v1")


def _scenario(stack: Stack) -> None:
    # an invalid revision is refused with the schema's message, and kubectl shows it
    bad = manifest(stack, "v1")
    bad["spec"]["lora"]["rank"] = 3
    refused = stack.apply(bad, check=False)
    assert refused.returncode != 0 and "rank" in refused.stderr, refused.stderr

    # v1: Stable and served
    stack.apply(manifest(stack, "v1"))
    wait_until(lambda: stack.label("v1") == "Stable", 120, "v1 stable")
    assert stack.routes() == {"v1": 100}
    traffic = Traffic(stack.gateway.url, stack.client)
    sender = threading.Thread(target=traffic.run, daemon=True)
    sender.start()
    try:
        wait_until(lambda: traffic.served_during("v1")["claims@v1"] >= 3, 60, "v1 served through Envoy")

        # v2: every phase, canary steps, promotion; v1 retiring then evicted everywhere
        stack.apply(manifest(stack, "v2"))
        canary_routes: list[dict[str, int]] = []

        def v2_progress() -> bool:
            label = stack.label("v2")
            traffic.phase = f"v2:{label}"
            canary_routes.append(stack.routes())
            return label == "Stable"

        wait_until(v2_progress, 180, "v2 stable")
        traffic.phase = "v2:Stable"
        assert {"v1": 90, "v2": 10} in canary_routes and {"v1": 50, "v2": 50} in canary_routes
        canary = traffic.served_during("v2:Canary(0)") + traffic.served_during("v2:Canary(1)")
        assert canary["claims@v2"] >= 1 and canary["claims@v1"] >= 1, canary
        wait_until(lambda: traffic.served_during("v2:Stable")["claims@v2"] >= 3, 30, "v2 served after promotion")
        assert stack.routes() == {"v2": 100}
        wait_until(lambda: stack.label("v1") == "Retired", 60, "v1 retired")
        wait_until(lambda: stack.engine_holds("claims@v1") == [], 30, "v1 evicted from every engine")

        # v3: a wrong digest stops it at Verifying; v2 keeps all traffic
        traffic.phase = "v3"
        stack.apply(manifest(stack, "v3", digest_of="v2"))
        wait_until(lambda: stack.label("v3") == "Failed", 60, "v3 failed")
        status = stack.status("v3")
        assert status["reason"] == "DigestMismatch" and status["message"].startswith("Verifying: "), status
        assert stack.routes() == {"v2": 100}

        traffic.phase = "v4"
        # v4: its health probe fails (TTFT bound no engine can meet): rolled back automatically
        stack.apply(manifest(stack, "v4", healthProbe={"ttftBoundMs": 0.001}))
        wait_until(lambda: stack.label("v4") == "RolledBack", 120, "v4 rolled back")
        assert stack.status("v4")["reason"] == "ProbeFailed"
        assert stack.routes() == {"v2": 100}

        traffic.phase = "v5"
        # v5: kill the leader mid-canary; the other replica resumes without repeating or skipping a gate
        stack.apply(manifest(stack, "v5", steps=[{"weight": 10, "pauseSeconds": 6}, {"weight": 50, "pauseSeconds": 600}]))
        wait_until(lambda: stack.label("v5") == "Canary(0)", 120, "v5 canary")
        leader = stack.leader()
        killed = stack.controllers[leader].proc
        assert killed is not None
        killed.send_signal(signal.SIGKILL)
        killed.wait(10)
        wait_until(lambda: stack.label("v5") == "Canary(1)", 60, "v5 second step under the other replica")
        assert stack.leader() != leader
        events = stack.events("v5")
        assert events["GatePassed"] == 4 and events["CanaryStep"] == 2, events  # each gate once, none skipped
        assert stack.routes() == {"v2": 50, "v5": 50}

        # manual rollback during the canary: all traffic back to stable within one reconcile
        traffic.phase = "v5-rollback"
        stack.kubectl("patch", "adapterrevision", "claims-v5", "--type", "merge", "-p", '{"spec":{"rollback":true}}')
        wait_until(lambda: stack.routes() == {"v2": 100}, 3, "v2 at 100 % again")
        assert stack.label("v5") == "RolledBack"
    finally:
        traffic.stop.set()
        sender.join(60)
    # no failed request at all: a revision leaving a pod is reported draining (the picker stops routing there) and
    # unloaded only after the sidecar's drain grace and its requests in flight, so no request reaches a pod that just
    # unloaded its revision (404)
    assert traffic.errors == [], traffic.errors[:5]
    unnamed = [(label, served) for label, served, named in traffic.records if not named]
    assert unnamed == [], unnamed[:5]  # zero responses from a revision the route table did not name
    assert len(traffic.records) >= 20
