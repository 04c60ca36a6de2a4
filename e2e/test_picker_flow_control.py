"""Flow control through a real Envoy: saturated requests wait in the picker, go out in band order and fair turns,
are refused 429 / 503 at their deadline, and a picker stopped (or killed) with requests waiting leaves none hanging.

Real Redis (reports and routes as the sidecars and the controller write them), one real HTTP backend that echoes
and can hold a request open (``sleep_s``), the real picker CLI with its flow-control plugin on, and Envoy. The
in-flight threshold is 1: while one request runs on the pod, the pod is saturated and the next ones wait.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
import redis

from e2e.fixtures.heartbeat import Heartbeats
from e2e.fixtures.picker import Gateway, gateway, wait_picker_ready
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
from loraplane.picker.scheduler import EndpointPickerConfig

pytestmark = pytest.mark.slow

POOL = "pool-flow"
DIGEST = "sha256:" + "f" * 64
REASON = "x-llm-d-request-dropped-reason"
DEADLINES = {"gold": 4.0, "standard": 3.0, "sheddable": 0.8}  # below Envoy's 5 s ext_proc message timeout


def picker_config() -> str:
    config = EndpointPickerConfig.load().with_parameters(
        "flow-control", enabled=True, deadlineSeconds=DEADLINES, queueLimit={"gold": 8, "standard": 8, "sheddable": 2})
    data = config.model_dump(by_alias=True)
    data["saturationDetector"]["inFlightThreshold"] = 1
    return EndpointPickerConfig.model_validate(data).to_yaml()


@dataclass
class Setup:
    gateway: Gateway
    health_port: int
    heartbeats: Heartbeats


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    work = tmp_path_factory.mktemp("flow")
    redis_server = start_redis(work)
    backend: ManagedProcess | None = None
    try:
        client = redis.Redis.from_url(redis_server.url)
        revision = [WeightedRevision(revision="v1", served_name="claims@v1", digest=DIGEST, weight=100)]
        table = RouteTable(pool=POOL, generation=1, updated_at=time.time(), models={
            "claims": RouteEntry(tenant="acme", revisions=revision),
            "vip": RouteEntry(tenant="bank", priority=10, revisions=revision)})  # a gold tenant, same revision
        client.set(keys.route_table(POOL), table.to_json())
        port = free_port()
        backend = ManagedProcess([sys.executable, "-m", "e2e.fixtures.echo_backend", "--port", str(port), "--pod", "pod-a"],
                                 work / "pod-a.log").start()
        wait_for_port(port, proc=backend.proc)
        report = ResidencyReport(pool=POOL, pod="pod-a", address=f"{LOOPBACK}:{port}", heartbeat_at=time.time(),
                                 adapters=[AdapterResidency(served_name="claims@v1", tier=Tier.GPU, digest=DIGEST)])
        heartbeats = Heartbeats(client, [report]).start()  # the pod's sidecar
        gateways = gateway(work, POOL, redis_server.url, config_yaml=picker_config())
        gw = next(gateways)
        health_port = int(gw.picker.args[gw.picker.args.index("--health-address") + 1].rpartition(":")[2])
        try:
            yield Setup(gw, health_port, heartbeats)
        finally:
            gateways.close()
            heartbeats.stop()
    finally:
        if backend is not None:
            backend.stop()
        redis_server.stop()


@dataclass
class Result:
    name: str
    status: int
    reason: str | None
    done_at: float


async def post(client: httpx.AsyncClient, setup: Setup, name: str, model: str = "claims", sleep_s: float = 0.2,
               delay: float = 0.0, **headers: str) -> Result:
    await asyncio.sleep(delay)
    body = {"model": model, "prompt": name, "sleep_s": sleep_s}
    response = await client.post(f"{setup.gateway.url}/v1/completions", json=body, timeout=30,
                                 headers={k.replace("_", "-"): v for k, v in headers.items()})
    return Result(name, response.status_code, response.headers.get(REASON), time.monotonic())


async def run(*calls: object) -> list[Result]:
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=32)) as client:
        return await asyncio.gather(*(call(client) for call in calls))  # type: ignore[operator]


def test_waiting_requests_go_out_gold_first_then_tenants_in_turn(setup: Setup) -> None:
    fair = "x_gateway_inference_fairness_id"
    results = asyncio.run(run(
        lambda c: post(c, setup, "blocker", sleep_s=1.5),
        lambda c: post(c, setup, "a1", delay=0.3, **{fair: "tenant-a"}),
        lambda c: post(c, setup, "a2", delay=0.4, **{fair: "tenant-a"}),
        lambda c: post(c, setup, "a3", delay=0.5, **{fair: "tenant-a"}),
        lambda c: post(c, setup, "b1", delay=0.6, **{fair: "tenant-b"}),
        lambda c: post(c, setup, "gold", model="vip", delay=0.8),
    ))
    assert all(r.status == 200 for r in results), results
    order = [r.name for r in sorted(results, key=lambda r: r.done_at)]
    # one at a time on the only pod: the gold band first, then tenant-a and tenant-b take turns
    assert order == ["blocker", "gold", "a1", "b1", "a2", "a3"], order


def test_a_request_that_outwaits_its_deadline_gets_429_sheddable_or_503(setup: Setup) -> None:
    started = time.monotonic()
    blocker, shed, standard = asyncio.run(run(
        lambda c: post(c, setup, "blocker", sleep_s=DEADLINES["standard"] + 1.0),
        lambda c: post(c, setup, "shed", delay=0.2, x_gateway_inference_objective="sheddable"),
        lambda c: post(c, setup, "standard", delay=0.2),
    ))
    assert blocker.status == 200
    assert (shed.status, shed.reason) == (429, "queue-deadline")
    assert (standard.status, standard.reason) == (503, "queue-deadline")
    assert shed.done_at - started < DEADLINES["standard"] < standard.done_at - started  # each at its own deadline


def test_a_full_band_refuses_at_once(setup: Setup) -> None:
    results = asyncio.run(run(
        lambda c: post(c, setup, "blocker", sleep_s=1.5),
        *(lambda c, i=i: post(c, setup, f"shed-{i}", delay=0.2 + 0.05 * i, x_gateway_inference_objective="sheddable")
          for i in range(3)),
    ))
    by_name = {r.name: r for r in results}
    assert (by_name["shed-2"].status, by_name["shed-2"].reason) == (429, "queue-full")  # the sheddable limit is 2


def test_requests_waiting_when_their_pod_turns_not_ready_are_each_answered_at_the_next_round(setup: Setup) -> None:
    """Issue 31, item 4: four requests wait behind a blocker; the pod then reports not ready, so the scheduler
    refuses each one at its next dispatch round (503 no-endpoint). Before, the first refusal raised ``KeyError`` in
    ``FlowControl.dispatch`` (the refused request left the queue twice), the round ended there and armed no next one:
    the others waited for another arrival or a completion, or for their deadline (503 queue-deadline)."""
    ready = setup.heartbeats.reports["pod-a"]
    log_size = setup.gateway.picker.log_path.stat().st_size

    async def not_ready_while_waiting(_client: httpx.AsyncClient) -> None:
        await asyncio.sleep(0.8)
        await asyncio.to_thread(setup.heartbeats.set, ready.model_copy(update={"ready": False}))

    try:
        results = asyncio.run(run(
            lambda c: post(c, setup, "blocker", sleep_s=DEADLINES["standard"] + 2.0),
            *(lambda c, i=i: post(c, setup, f"waiting-{i}", delay=0.2) for i in range(4)),
            not_ready_while_waiting,
        ))[:5]
    finally:
        setup.heartbeats.set(ready)
    waited = sorted(results[1:], key=lambda r: r.done_at)
    with setup.gateway.picker.log_path.open() as log:
        log.seek(log_size)
        tracebacks = log.read().count("KeyError")
    answers = [(r.status, r.reason) for r in waited]
    print(f"FLOW-CONTROL-REFUSAL {{'answers': {answers}, 'answered_within_s': "
          f"{round(waited[-1].done_at - waited[0].done_at, 3)}, 'key_errors_logged': {tracebacks}}}")
    assert answers == [(503, "no-endpoint")] * 4, answers
    assert tracebacks == 0
    assert results[0].status == 200  # the blocker was on its way already


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["stopped", "killed"])
def test_a_picker_restart_with_requests_waiting_answers_each_with_a_retryable_error(setup: Setup, sig: int) -> None:
    picker = setup.gateway.picker

    async def restart_while_waiting(client: httpx.AsyncClient) -> None:
        await asyncio.sleep(0.6)
        await asyncio.to_thread(picker.stop, 10.0, sig)

    started = time.monotonic()
    results = asyncio.run(run(
        lambda c: post(c, setup, "blocker", sleep_s=2.0),
        *(lambda c, i=i: post(c, setup, f"waiting-{i}", delay=0.2) for i in range(3)),
        restart_while_waiting,
    ))[:4]
    waited = [r for r in results if r.name != "blocker"]
    assert all(r.done_at - started < 3.0 for r in waited), waited  # answered when the picker went, not at a timeout
    if sig == signal.SIGTERM:  # a graceful stop answers every waiting request itself
        assert [(r.status, r.reason) for r in waited] == [(503, "picker-stopping")] * 3
    else:  # a killed picker's streams break: Envoy answers them with a server error
        assert all(500 <= r.status < 600 for r in waited), waited
    picker.start()
    wait_picker_ready(setup.health_port, picker)
    (again,) = asyncio.run(run(lambda c: post(c, setup, "retry", sleep_s=0.0)))
    assert again.status == 200  # the retried request is served
