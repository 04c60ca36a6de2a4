"""The picker behind a real Envoy in each ext_proc body mode: ``BUFFERED``, ``STREAMED`` and ``FULL_DUPLEX_STREAMED``
(GIE's reference), with subset hints passed through Envoy's ``envoy.lb.subset_hint`` metadata.

Real Redis (reports and routes written as the sidecars and the controller would), three small real HTTP backends
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

from e2e.fixtures.picker import STATIC_REPORT_TTL_S, Gateway, gateway
from e2e.fixtures.processes import LOOPBACK, ManagedProcess, free_port, start_redis, wait_for_port
from e2e.fixtures.waiting import wait_until
from loraplane.api import (
    AdapterResidency,
    ResidencyReport,
    RouteEntry,
    RouteTable,
    Tier,
    WeightedRevision,
    keys,
)
from loraplane.api.headers import DROPPED_REASON_HEADER
from loraplane.picker.envoy import UPSTREAM_HEADER, ExtProcModes

pytestmark = pytest.mark.slow

POOL = "pool-modes"
DIGEST = "sha256:" + "e" * 64
MAX_BODY = 300_000
SUBSET_HEADER = "x-test-subset"


@dataclass
class Setup:
    gateway: Gateway
    pods: dict[str, str]  # address -> pod

    def post(self, body: bytes | dict[str, object], path: str = "/v1/completions", subset: str | None = None,
             headers: dict[str, str] | None = None) -> httpx.Response:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        sent = {"content-type": "application/json", **({SUBSET_HEADER: subset} if subset is not None else {}),
                **(headers or {})}
        return httpx.post(f"{self.gateway.url}{path}", content=content, headers=sent, timeout=30)

    def address_of(self, pod: str) -> str:
        return next(address for address, name in self.pods.items() if name == pod)


@pytest.fixture(scope="module", params=["BUFFERED", "STREAMED", "FULL_DUPLEX_STREAMED"])
def setup(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    work = tmp_path_factory.mktemp("modes")
    redis_server = start_redis(work)
    backends: list[ManagedProcess] = []
    try:
        client = redis.Redis.from_url(redis_server.url)
        table = RouteTable(pool=POOL, generation=1, updated_at=time.time(), models={
            "claims": RouteEntry(revisions=[WeightedRevision(revision="v1", served_name="claims@v1", digest=DIGEST, weight=100)])})
        client.set(keys.route_table(POOL), table.to_json())
        pods = {}
        for pod, tier in (("pod-a", Tier.GPU), ("pod-b", Tier.CPU), ("pod-c", Tier.DISK)):
            port = free_port()
            proc = ManagedProcess([sys.executable, "-m", "e2e.fixtures.echo_backend", "--port", str(port), "--pod", pod],
                                  work / f"{pod}.log").start()
            backends.append(proc)
            wait_for_port(port, proc=proc.proc)
            address = f"{LOOPBACK}:{port}"
            pods[address] = pod
            report = ResidencyReport(pool=POOL, pod=pod, address=address, heartbeat_at=time.time(),
                                     ttl_seconds=STATIC_REPORT_TTL_S, adapters=[AdapterResidency(served_name="claims@v1", tier=tier, digest=DIGEST)])
            client.set(keys.residency_report(POOL, pod), report.to_json())
            client.sadd(keys.residency_index(POOL), pod)
        modes = ExtProcModes(request_body_mode=request.param, response_body_mode=request.param,
                             subset_hint_header=SUBSET_HEADER)
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
    big = json.dumps({"model": "claims", "prompt": "x" * 200_000}).encode()  # full duplex: several 62,000-byte chunks
    response = setup.post(big)
    assert response.status_code == 200, response.text
    assert response.json()["body_bytes"] == len(big) + len("@v1")
    assert response.json()["received"] == "claims@v1"


def test_sse_is_streamed_through_with_the_model_rewritten_back(setup: Setup) -> None:
    with httpx.stream("POST", f"{setup.gateway.url}/v1/completions", json={"model": "claims", "prompt": "p", "stream": True},
                      timeout=30) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    parsed = [json.loads(e) for e in events[:-1]]
    assert [e["text"] for e in parsed] == ["a", "b", "c"]
    assert {e["model"] for e in parsed} == {"claims"} and {e["received"] for e in parsed} == {"claims@v1"}


@pytest.mark.parametrize(
    ("body", "path", "status", "code", "reason"),
    [(b'{"model": "unknown", "prompt": "p"}', "/v1/completions", 404, "NotFound", "model-not-found"),
     (b"{broken", "/v1/completions", 400, "BadRequest", "bad-request"),
     (b'{"prompt": "no model"}', "/v1/completions", 400, "BadRequest", "bad-request"),
     (b'{"model": "claims"}', "/v1/completions", 400, "BadRequest", "bad-request"),  # a completion needs a prompt
     (b'{"model": "claims", "messages": []}', "/v1/chat/completions", 400, "BadRequest", "bad-request"),
     # llm-d-router v0.10's parser: a message's role must be a string; an image generation needs a prompt
     (b'{"model": "claims", "messages": [{"role": 1, "content": "hi"}]}', "/v1/chat/completions", 400, "BadRequest",
      "bad-request"),
     (b'{"model": "claims", "n": 1}', "/v1/images/generations", 400, "BadRequest", "bad-request"),
     (json.dumps({"model": "claims", "prompt": "y" * (MAX_BODY + 1)}).encode(), "/v1/completions", 413,
      "PayloadTooLarge", "body-too-large")],
)
def test_client_errors_come_back_as_http_statuses(setup: Setup, body: bytes, path: str, status: int, code: str,
                                                  reason: str) -> None:
    response = setup.post(body, path)
    assert response.status_code == status
    assert response.text.startswith(f"inference error: {code} - ")
    assert response.headers[DROPPED_REASON_HEADER] == reason  # every refusal says why, through Envoy too


def test_subset_hints_through_envoy_metadata(setup: Setup) -> None:
    body = {"model": "claims", "prompt": "hi"}
    cold = setup.address_of("pod-c")
    for hint in (cold, f"9.9.9.9:1, {cold}"):  # the disk-only pod, though the GPU pod is warmer; unknown entries ignored
        response = setup.post(body, subset=hint)
        assert response.status_code == 200, response.text
        assert setup.pods[response.headers[UPSTREAM_HEADER]] == "pod-c"
    warm_two = f"{setup.address_of('pod-b')},{cold}"
    assert setup.pods[setup.post(body, subset=warm_two).headers[UPSTREAM_HEADER]] == "pod-b"  # best inside the hint
    port_mismatch = setup.address_of("pod-a").rpartition(":")[0] + ":1"
    for hint in ("9.9.9.9:8000", port_mismatch):
        refused = setup.post(body, subset=hint)
        assert refused.status_code == 503, (hint, refused.text)
        assert refused.text.startswith("inference error: ServiceUnavailable - ")
        assert refused.headers[DROPPED_REASON_HEADER] == "rejected-no-endpoints"


def _picker_gauges(setup: Setup) -> tuple[float, float]:
    """(requests in flight, of those awaiting their first token) from the picker's /metrics."""
    text = httpx.get(f"http://{LOOPBACK}:{setup.gateway.metrics_port}/metrics", timeout=5).text
    values = dict(line.split(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    return (float(values["loraplane_picker_in_flight_requests"]),
            float(values["loraplane_picker_requests_awaiting_first_token"]))


def test_the_first_streamed_token_through_envoy_ends_the_wait_for_it(setup: Setup, request: pytest.FixtureRequest) -> None:
    # the backend streams its headers at once, its first event 1.5 s later, then one a second (as vLLM: headers,
    # prefill, tokens): the picker counts the request as awaiting its first token until that event passes it
    body = {"model": "claims", "prompt": "p", "stream": True, "first_token_s": 1.5, "token_gap_s": 1.0}
    buffered = request.node.callspec.params["setup"] == "BUFFERED"
    with httpx.stream("POST", f"{setup.gateway.url}/v1/completions", json=body, timeout=30) as response:
        assert response.status_code == 200
        if not buffered:
            assert _picker_gauges(setup) == (1, 1)  # headers are through; no token yet
        lines = response.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first[6:])["text"] == "a"
        if buffered:  # Envoy sends the picker the body only once the whole response is in: it started at the end
            assert _picker_gauges(setup) == (0, 0)
        else:
            wait_until(lambda: _picker_gauges(setup) == (1, 0), 0.8, "the first token to end the wait")  # before the 2nd
        assert [line for line in lines if line.startswith("data: ")][-1] == "data: [DONE]"
    wait_until(lambda: _picker_gauges(setup) == (0, 0), 5, "the request to end", setup.gateway.picker)


@pytest.mark.parametrize("name", ["x-llm-d-model-name-rewrite", "X-LLM-D-Model-Name-Rewrite",
                                  "x-gateway-model-name-rewrite", "X-Gateway-Model-Name-Rewrite"])
def test_the_model_name_rewrite_header_names_what_the_server_gets(setup: Setup, name: str) -> None:
    """llm-d-router v0.10's rewrite, current and deprecated header names in any case: the body's model has no route,
    so the header's value is what the server gets (a served revision, routed with its affinity), and the response
    says the client's name; a header naming a logical name is not resolved (404); a route for the body's model beats
    the header."""
    response = setup.post({"model": "my-alias", "prompt": "hi"}, headers={name: "claims@v1"})
    assert response.status_code == 200, response.text
    assert response.json()["received"] == "claims@v1" and response.json()["model"] == "my-alias"
    assert setup.pods[response.headers[UPSTREAM_HEADER]] == "pod-a"  # the GPU-warm pod of that revision
    logical = setup.post({"model": "my-alias", "prompt": "hi"}, headers={name: "claims"})
    assert logical.status_code == 404 and logical.text.startswith("inference error: NotFound - "), logical.text
    routed = setup.post({"model": "claims", "prompt": "hi"}, headers={name: "something-else"})
    assert routed.status_code == 200 and routed.json()["received"] == "claims@v1", routed.text


def test_the_current_rewrite_header_wins_over_the_deprecated_one(setup: Setup) -> None:
    response = setup.post({"model": "my-alias", "prompt": "hi"},
                          headers={"x-gateway-model-name-rewrite": "nothing-served",
                                   "X-LLM-D-Model-Name-Rewrite": "claims@v1"})
    assert response.status_code == 200 and response.json()["received"] == "claims@v1", response.text
