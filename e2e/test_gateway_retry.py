"""The gateway retries vLLM's 404 on the picker's next endpoint: a pod that no longer has a revision registered.

The twin found it (docs/twin.md): the picker routes on reports about a second old, and a vLLM pod that unloaded a
revision a moment before answers its 404 (``The model ... does not exist``) although another pod holds it. Two
emulated vLLM pods behind the real picker and Envoy: pod-a's report says it holds ``claims@v1`` in a GPU slot (the
picker's first choice) but its server has nothing registered, pod-b holds it in host memory. With the gateway's
404 retry (``GatewayPolicy.retry_statuses``, the chart's ``gateway.envoy.retryStatuses``) the request is served by
pod-b; without it the client gets pod-a's 404.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import httpx
import pytest
import redis

from e2e.fixtures.picker import STATIC_REPORT_TTL_S, Gateway, start_gateway
from e2e.fixtures.processes import RedisServer, start_redis
from e2e.fixtures.vllm import ServableModel
from loraplane.api import (
    AdapterResidency,
    ResidencyReport,
    RouteEntry,
    RouteTable,
    Tier,
    WeightedRevision,
    keys,
)
from loraplane.picker.envoy import HARDENED, UPSTREAM_HEADER, ExtProcModes
from loraplane.vllm_server import VllmOptions, VllmServer, start_vllm

pytestmark = pytest.mark.slow

POOL = "pool-retry"
SERVED = "claims@v1"
DIGEST = "sha256:" + "c" * 64


@dataclass
class Pool:
    redis: RedisServer
    pods: dict[str, VllmServer]
    workdir: Path


@pytest.fixture(scope="module")
def pool(servable_model: ServableModel, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    work = tmp_path_factory.mktemp("retry")
    redis_server = start_redis(work)
    options = VllmOptions(model=servable_model.path, emulated=True)
    pods: dict[str, VllmServer] = {}
    try:
        for name in ("pod-a", "pod-b"):
            pods[name] = start_vllm(options, work / f"{name}.log").wait_ready()
        servable_model.adapter(work / "adapter", rank=8, seed=1)
        loaded = httpx.post(f"{pods['pod-b'].url}/v1/load_lora_adapter",
                            json={"lora_name": SERVED, "lora_path": str(work / "adapter")}, timeout=30)
        assert loaded.status_code == 200, loaded.text
        client = redis.Redis.from_url(redis_server.url)
        table = RouteTable(pool=POOL, generation=1, updated_at=time.time(), models={
            "claims": RouteEntry(revisions=[WeightedRevision(revision="v1", served_name=SERVED, digest=DIGEST, weight=100)])})
        client.set(keys.route_table(POOL), table.to_json())
        for name, tier in (("pod-a", Tier.GPU), ("pod-b", Tier.CPU)):  # pod-a's report claims what it lacks
            report = ResidencyReport(pool=POOL, pod=name, address=pods[name].url.removeprefix("http://"),
                                     heartbeat_at=time.time(), ttl_seconds=STATIC_REPORT_TTL_S,
                                     adapters=[AdapterResidency(served_name=SERVED, tier=tier, digest=DIGEST)])
            client.set(keys.residency_report(POOL, name), report.to_json())
            client.sadd(keys.residency_index(POOL), name)
        client.close()
        yield Pool(redis_server, pods, work)
    finally:
        for server in pods.values():
            server.stop()
        redis_server.process.stop()


def _gateway(pool: Pool, retry_statuses: tuple[int, ...], body_mode: str = "BUFFERED") -> Gateway:
    endpoints = [server.url.removeprefix("http://") for server in pool.pods.values()]
    policy = replace(HARDENED, endpoints=endpoints, retry_statuses=retry_statuses, picker_health=None)
    return start_gateway(pool.workdir, POOL, pool.redis.url, policy=policy,
                         modes=ExtProcModes(request_body_mode=body_mode, response_body_mode=body_mode))


def _answers(gateway: Gateway, n: int = 6) -> list[tuple[int, str | None]]:
    out = []
    with httpx.Client(base_url=gateway.url, timeout=30) as client:
        for _ in range(n):
            r = client.post("/v1/completions", json={"model": "claims", "prompt": "hello", "max_tokens": 2})
            out.append((r.status_code, r.headers.get(UPSTREAM_HEADER)))
    return out


@pytest.mark.parametrize("body_mode", ["BUFFERED", "FULL_DUPLEX_STREAMED"])
def test_a_pods_404_for_a_revision_it_lacks_is_retried_on_the_next_endpoint(pool: Pool, body_mode: str) -> None:
    gateway = _gateway(pool, HARDENED.retry_statuses, body_mode)
    try:
        answers = _answers(gateway)
    finally:
        gateway.stop()
    pod_b = pool.pods["pod-b"].url.removeprefix("http://")
    assert answers == [(200, pod_b)] * len(answers)


def test_without_the_retry_the_client_gets_the_pods_404(pool: Pool) -> None:
    """The control: the same pool and gateway without 404 among the retried statuses."""
    gateway = _gateway(pool, ())
    try:
        answers = _answers(gateway)
    finally:
        gateway.stop()
    pod_a = pool.pods["pod-a"].url.removeprefix("http://")
    assert (404, pod_a) in answers
