"""The picker end to end: a real Envoy, a real Redis, three real engines with their sidecars, the real picker CLI.

The test plays the controller: it writes TargetStates (the sidecars load the adapters into their engines and report
residency) and RouteTables. Every request goes client -> Envoy -> ext_proc picker -> engine; the response headers
say which pod answered (Envoy's upstream address) and which revision (the engine's served-adapter header).
"""

from __future__ import annotations

import asyncio
import hashlib
import sys
import tarfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import redis

from e2e.fixtures.picker import Gateway, gateway
from e2e.fixtures.processes import (
    LOOPBACK,
    ManagedProcess,
    RedisServer,
    free_port,
    start_redis,
    wait_for_port,
)
from e2e.fixtures.waiting import wait_until
from loraplane.api import (
    SERVED_ADAPTER_HEADER,
    AdapterTarget,
    Artifact,
    LoraSpec,
    ResidencyReport,
    RevisionRole,
    RouteEntry,
    RouteTable,
    TargetState,
    Tier,
    WeightedRevision,
    cache_key,
    keys,
)
from loraplane.picker.envoy import UPSTREAM_HEADER
from loraplane.picker.routes import sticky_bucket

pytestmark = pytest.mark.slow

POOL = "pool-e2e"
PODS = ("pod-0", "pod-1", "pod-2")
MODULES = ["q_proj", "v_proj"]
IN_FLIGHT_THRESHOLD = 3
PICKER_CONFIG = f"""
saturationDetector: {{queueThreshold: 50, kvThreshold: 0.95, inFlightThreshold: {IN_FLIGHT_THRESHOLD}}}
plugins:
- type: ready-filter
- type: staleness-filter
  parameters: {{failOpen: true}}
- type: residency-filter
- type: saturation-filter
  parameters: {{headroom: 0.2, failOpen: true}}
- type: residency-affinity-scorer
- type: in-flight-scorer
- type: max-score-picker
schedulingProfiles:
- plugins: [{{pluginRef: ready-filter}}, {{pluginRef: staleness-filter}}, {{pluginRef: residency-filter}},
            {{pluginRef: saturation-filter}},
            {{pluginRef: residency-affinity-scorer, weight: 100}}, {{pluginRef: in-flight-scorer, weight: 4}},
            {{pluginRef: max-score-picker}}]
"""


@dataclass
class Pod:
    name: str
    engine_port: int
    engine: ManagedProcess
    sidecar: ManagedProcess

    @property
    def address(self) -> str:
        return f"{LOOPBACK}:{self.engine_port}"


@dataclass
class Revision:
    served_name: str
    uri: str
    digest: str


@dataclass
class Cluster:
    redis: RedisServer
    client: redis.Redis
    pods: list[Pod]
    revisions: dict[str, Revision]
    base_digest: str
    gateway: Gateway

    def pod_of(self, response: httpx.Response) -> str:
        upstream = response.headers[UPSTREAM_HEADER]
        return next(p.name for p in self.pods if p.address == upstream)


def _sha256(path: Path) -> str:
    return "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()




def _target(revision: Revision, tier: Tier, base_digest: str) -> AdapterTarget:
    adapter, rev = revision.served_name.split("@")
    return AdapterTarget(
        served_name=revision.served_name, adapter=adapter, revision=rev, tier=tier,
        artifact=Artifact(uri=revision.uri, digest=revision.digest),
        lora=LoraSpec(rank=8, alpha=8, dtype="float32", target_modules=MODULES),
        base_model_digest=base_digest, cache_key=cache_key(base_digest, adapter, rev, revision.digest),
    )


def _routes(generation: int, canary_weight: int, revisions: dict[str, Revision]) -> RouteTable:
    weighted = [WeightedRevision(revision="v1", served_name="claims@v1", digest=revisions["claims@v1"].digest,
                                 weight=100 - canary_weight)]
    if canary_weight:
        weighted.append(WeightedRevision(revision="v2", served_name="claims@v2", digest=revisions["claims@v2"].digest,
                                         weight=canary_weight, role=RevisionRole.CANARY))
    return RouteTable(pool=POOL, generation=generation, updated_at=time.time(),
                      models={"claims": RouteEntry(tenant="acme", revisions=weighted)})


def _publish_routes(client: redis.Redis, table: RouteTable) -> None:
    client.set(keys.route_table(POOL), table.to_json())
    client.publish(keys.routes_changed_channel(POOL), str(table.generation))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    from loraplane.engine.make_adapters import model_config, write_adapter

    work = tmp_path_factory.mktemp("picker-e2e")
    redis_server = start_redis(work)
    client = redis.Redis.from_url(redis_server.url)
    artifacts = work / "artifacts"
    revisions = {}
    for seed, name in enumerate(("claims@v1", "claims@v2")):
        directory = artifacts / name.replace("@", "-")
        write_adapter(directory, model_config("tiny"), 8, seed=seed, targets=MODULES)
        tar_path = artifacts / f"{directory.name}.tar"
        with tarfile.open(tar_path, "w") as tar:
            tar.add(directory, arcname=directory.name)
        revisions[name] = Revision(name, f"file://{tar_path}", _sha256(tar_path))
    pods: list[Pod] = []
    try:
        for pod in PODS:
            port = free_port()
            root = work / pod
            root.mkdir()
            engine = ManagedProcess(
                [sys.executable, "-m", "loraplane.engine", "--model", "tiny", "--port", str(port), "--max-loras", "2",
                 "--max-cpu-loras", "4", "--adapter-root", str(root), "--enable-lora-runtime-updating",
                 "--max-model-len", "128", "--max-num-seqs", "8"], work / f"engine-{pod}.log").start()
            sidecar = ManagedProcess(
                [sys.executable, "-m", "loraplane.sidecar", "--pool", POOL, "--pod", pod, "--runtime", "engine",
                 "--runtime-url", f"http://{LOOPBACK}:{port}", "--redis-url", redis_server.url, "--cache-dir", str(root),
                 "--heartbeat", "0.3", "--report-ttl", "3", "--metrics-port", "0", "--file-root", str(artifacts)],
                work / f"sidecar-{pod}.log")
            pods.append(Pod(pod, port, engine, sidecar))
        for pod in pods:
            wait_for_port(pod.engine_port, proc=pod.engine.proc, timeout=120)
            pod.sidecar.start()
        base_digest = httpx.get(f"http://{pods[0].address}/admin/adapters", timeout=10).json()["base_model_digest"]
        # the controller's placement: v1 GPU-warm on pod-0 only (CPU elsewhere), the canary v2 GPU-warm on pod-1
        placement = {"pod-0": [("claims@v1", Tier.GPU)],
                     "pod-1": [("claims@v2", Tier.GPU), ("claims@v1", Tier.CPU)],
                     "pod-2": [("claims@v1", Tier.CPU)]}
        for pod_name, wanted in placement.items():
            state = TargetState(pool=POOL, pod=pod_name, generation=1, updated_at=time.time(),
                                adapters=[_target(revisions[n], tier, base_digest) for n, tier in wanted])
            client.set(keys.target_state(POOL, pod_name), state.to_json())
            client.publish(keys.target_changed_channel(POOL), pod_name)

        def placed() -> bool:
            for pod_name, wanted in placement.items():
                raw = client.get(keys.residency_report(POOL, pod_name))
                if raw is None:
                    return False
                held = ResidencyReport.from_json(raw).by_name()
                for name, tier in wanted:
                    if name not in held or held[name].tier is not tier or held[name].digest != revisions[name].digest:
                        return False
            return True

        wait_until(placed, 120, "the sidecars to report the placement")
        _publish_routes(client, _routes(1, 0, revisions))
        gateways = gateway(work, POOL, redis_server.url, config_yaml=PICKER_CONFIG)
        gw = next(gateways)
        try:
            yield Cluster(redis_server, client, pods, revisions, base_digest, gw)
        finally:
            gateways.close()
    finally:
        for pod in pods:
            pod.sidecar.stop()
            pod.engine.stop()
        redis_server.stop()


def _completion(cluster: Cluster, session: str, max_tokens: int = 1, client: httpx.Client | None = None) -> httpx.Response:
    body = {"model": "claims", "prompt": "hello there", "max_tokens": max_tokens, "temperature": 0}
    return (client or httpx).post(f"{cluster.gateway.url}/v1/completions", json=body,  # type: ignore[attr-defined]
                                  headers={"x-session-id": session}, timeout=60)


def test_warm_pod_takes_the_traffic_until_it_saturates_then_load_wins(cluster: Cluster) -> None:
    with httpx.Client() as client:
        sequential = [_completion(cluster, f"seq-{i}", client=client) for i in range(20)]
    assert all(r.status_code == 200 for r in sequential), sequential[0].text
    assert {cluster.pod_of(r) for r in sequential} == {"pod-0"}
    assert {r.headers[SERVED_ADAPTER_HEADER] for r in sequential} == {"claims@v1"}
    assert {r.json()["model"] for r in sequential} == {"claims"}  # the response names what the client asked for

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=32)) as client:
            body = {"model": "claims", "prompt": "hello there", "max_tokens": 48, "temperature": 0}
            return await asyncio.gather(*(
                client.post(f"{cluster.gateway.url}/v1/completions", json=body, headers={"x-session-id": f"burst-{i}"},
                            timeout=120) for i in range(12)))

    responses = asyncio.run(burst())
    assert all(r.status_code == 200 for r in responses)
    where = Counter(cluster.pod_of(r) for r in responses)
    # pod-0 takes requests until its in-flight count reaches the threshold; the rest spill to the CPU-warm pods
    assert 1 <= where["pod-0"] <= IN_FLIGHT_THRESHOLD + 1, where
    assert where["pod-1"] + where["pod-2"] >= 12 - IN_FLIGHT_THRESHOLD - 1, where
    assert {r.headers[SERVED_ADAPTER_HEADER] for r in responses} == {"claims@v1"}  # spilled requests load v1 there
    metrics = httpx.get(f"http://{LOOPBACK}:{cluster.gateway.metrics_port}/metrics", timeout=5).text
    assert 'loraplane_picker_decisions_total{outcome="spilled-saturated"}' in metrics
    spilled = next(line for line in metrics.splitlines() if line.startswith('loraplane_picker_decisions_total{outcome="spilled-saturated"}'))
    assert float(spilled.split()[-1]) >= 1


def test_canary_weight_is_honoured_and_sticky_per_session(cluster: Cluster) -> None:
    _publish_routes(cluster.client, _routes(2, 10, cluster.revisions))
    probe = next(f"probe-{i}" for i in range(1000) if sticky_bucket("claims", f"probe-{i}") >= 90)  # a canary session
    wait_until(lambda: _completion(cluster, probe).headers[SERVED_ADAPTER_HEADER] == "claims@v2", 15, "the new route table")

    async def send(sessions: list[str]) -> list[httpx.Response]:
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=16)) as client:
            semaphore = asyncio.Semaphore(16)
            body = {"model": "claims", "prompt": "hi", "max_tokens": 1, "temperature": 0}

            async def one(session: str) -> httpx.Response:
                async with semaphore:
                    return await client.post(f"{cluster.gateway.url}/v1/completions", json=body,
                                             headers={"x-session-id": session}, timeout=60)

            return await asyncio.gather(*(one(s) for s in sessions))

    sessions = [f"user-{i}" for i in range(2000)]
    responses = asyncio.run(send(sessions))
    assert all(r.status_code == 200 for r in responses)
    served = {s: r.headers[SERVED_ADAPTER_HEADER] for s, r in zip(sessions, responses, strict=True)}
    share = Counter(served.values())["claims@v2"] / len(served)
    assert 0.07 <= share <= 0.13, share
    # every response came from the revision the route table names for that session
    for session, name in served.items():
        assert name == ("claims@v1" if sticky_bucket("claims", session) < 90 else "claims@v2")
    # and a session stays on its side
    again = asyncio.run(send(sessions[:100]))
    assert [r.headers[SERVED_ADAPTER_HEADER] for r in again] == [served[s] for s in sessions[:100]]
    v2_pods = {cluster.pod_of(r) for r in responses if r.headers[SERVED_ADAPTER_HEADER] == "claims@v2"}
    assert "pod-1" in v2_pods  # the canary's warm pod
