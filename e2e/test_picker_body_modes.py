"""The picker behind a real Envoy in GIE's reference mode: request and response bodies ``FULL_DUPLEX_STREAMED``.

Real Redis (reports and routes written as the sidecars and the controller would), two small real HTTP backends
that echo what they received, the real picker CLI and Envoy.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
import redis

from e2e.fixtures.picker import Gateway, gateway
from e2e.fixtures.processes import LOOPBACK, ManagedProcess, free_port, start_redis, wait_for_port
from loraplane.api import (
    AdapterResidency,
    ResidencyReport,
    RouteEntry,
    RouteTable,
    Tier,
    WeightedRevision,
    keys,
)
from loraplane.picker.envoy import UPSTREAM_HEADER, ExtProcModes

pytestmark = pytest.mark.slow

POOL = "pool-duplex"
DIGEST = "sha256:" + "e" * 64
MAX_BODY = 300_000


@dataclass
class Setup:
    gateway: Gateway
    pods: dict[str, str]  # address -> pod

    def post(self, body: bytes | dict[str, object], **kw: object) -> httpx.Response:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        return httpx.post(f"{self.gateway.url}/v1/completions", content=content,
                          headers={"content-type": "application/json"}, timeout=30, **kw)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    work = tmp_path_factory.mktemp("duplex")
    redis_server = start_redis(work)
    backends: list[ManagedProcess] = []
    try:
        client = redis.Redis.from_url(redis_server.url)
        table = RouteTable(pool=POOL, generation=1, updated_at=time.time(), models={
            "claims": RouteEntry(revisions=[WeightedRevision(revision="v1", served_name="claims@v1", digest=DIGEST, weight=100)])})
        client.set(keys.route_table(POOL), table.to_json())
        pods = {}
        for pod, tier in (("pod-a", Tier.GPU), ("pod-b", Tier.CPU)):
            port = free_port()
            proc = ManagedProcess([sys.executable, "-m", "e2e.fixtures.echo_backend", "--port", str(port), "--pod", pod],
                                  work / f"{pod}.log").start()
            backends.append(proc)
            wait_for_port(port, proc=proc.proc)
            address = f"{LOOPBACK}:{port}"
            pods[address] = pod
            report = ResidencyReport(pool=POOL, pod=pod, address=address, heartbeat_at=time.time() + 3600,
                                     adapters=[AdapterResidency(served_name="claims@v1", tier=tier, digest=DIGEST)])
            client.set(keys.residency_report(POOL, pod), report.to_json())
            client.sadd(keys.residency_index(POOL), pod)
        modes = ExtProcModes(request_body_mode="FULL_DUPLEX_STREAMED", response_body_mode="FULL_DUPLEX_STREAMED")
        gateways = gateway(work, POOL, redis_server.url, modes=modes, extra_args=["--max-body-bytes", str(MAX_BODY)])
        yield Setup(next(gateways), pods)
        gateways.close()
    finally:
        for proc in backends:
            proc.stop()
        redis_server.stop()


def test_bodies_are_reassembled_rewritten_and_rewritten_back(setup: Setup) -> None:
    small = setup.post({"model": "claims", "prompt": "hi"})
    assert small.status_code == 200, small.text
    assert setup.pods[small.headers[UPSTREAM_HEADER]] == "pod-a"  # GPU-warm
    assert small.json()["received"] == "claims@v1" and small.json()["model"] == "claims"
    big = json.dumps({"model": "claims", "prompt": "x" * 200_000}).encode()  # several 62,000-byte chunks back
    response = setup.post(big)
    assert response.status_code == 200, response.text
    assert response.json()["body_bytes"] == len(big) + len("@v1")
    assert response.json()["received"] == "claims@v1"


def test_sse_is_streamed_through_with_the_model_rewritten_back(setup: Setup) -> None:
    with httpx.stream("POST", f"{setup.gateway.url}/v1/completions", json={"model": "claims", "stream": True},
                      timeout=30) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    parsed = [json.loads(e) for e in events[:-1]]
    assert [e["text"] for e in parsed] == ["a", "b", "c"]
    assert {e["model"] for e in parsed} == {"claims"} and {e["received"] for e in parsed} == {"claims@v1"}


@pytest.mark.parametrize(
    ("body", "status"),
    [(b'{"model": "unknown"}', 404), (b"{broken", 400), (b'{"prompt": "no model"}', 400),
     (json.dumps({"model": "claims", "prompt": "y" * (MAX_BODY + 1)}).encode(), 413)],
)
def test_client_errors_come_back_as_http_statuses(setup: Setup, body: bytes, status: int) -> None:
    response = setup.post(body)
    assert response.status_code == status
    assert response.text.startswith(f"inference error: {status} - ")
