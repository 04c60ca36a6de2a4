"""Flow control through a real Envoy: saturated requests wait in the picker, go out in band order and fair turns,
are refused with llm-d-router v0.10's statuses and ``x-llm-d-request-dropped-reason`` values (429
``rejected-ttl-expired`` at their deadline in every band, 429 ``rejected-saturated`` when their band is full, 503
``rejected-no-endpoints`` / ``rejected-shutting-down``), and a picker stopped (or killed) with requests waiting leaves
none hanging. A second picker with flow control off sheds sheddable requests 429 ``rejected-saturated`` while the
pool is saturated, as llm-d-router does without its flowControl feature gate.

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


def picker_config(flow_control: bool = True) -> str:
    config = EndpointPickerConfig.load().with_parameters(
        "flow-control", enabled=flow_control, deadlineSeconds=DEADLINES,
        queueLimit={"gold": 8, "standard": 8, "sheddable": 2})
    data = config.model_dump(by_alias=True)
    data["saturationDetector"]["inFlightThreshold"] = 1
    return EndpointPickerConfig.model_validate(data).to_yaml()


@dataclass
class Setup:
    gateway: Gateway
    health_port: int
    heartbeats: Heartbeats
    #: the same pool behind a picker with flow control off
    shedding: Gateway


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
        (work / "shedding").mkdir()
        shedding = gateway(work / "shedding", POOL, redis_server.url, config_yaml=picker_config(flow_control=False))
        try:
            yield Setup(gw, health_port, heartbeats, next(shedding))
        finally:
            shedding.close()
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
               delay: float = 0.0, via: Gateway | None = None, **headers: str) -> Result:
    """POST a completion through ``via`` (default: the flow-control gateway); ``headers`` with ``_`` for ``-``."""
    await asyncio.sleep(delay)
    body = {"model": model, "prompt": name, "sleep_s": sleep_s}
    response = await client.post(f"{(via or setup.gateway).url}/v1/completions", json=body, timeout=30,
                                 headers={k.replace("_", "-"): v for k, v in headers.items()})
    return Result(name, response.status_code, response.headers.get(REASON), time.monotonic())


async def run(*calls: object) -> list[Result]:
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=32)) as client:
        return await asyncio.gather(*(call(client) for call in calls))  # type: ignore[operator]


def test_waiting_requests_go_out_gold_first_then_tenants_in_turn(setup: Setup) -> None:
    fair = "x_gateway_inference_fairness_id"  # the deprecated name
    # b1 also sends the current name, in mixed case (Envoy lower-cases it): it wins, so b1 is tenant-b's, not a's
    current = {fair: "tenant-a", "X_LLM_D_Inference_Fairness_Id": "tenant-b"}
    results = asyncio.run(run(
        lambda c: post(c, setup, "blocker", sleep_s=1.5),
        lambda c: post(c, setup, "a1", delay=0.3, **{fair: "tenant-a"}),
        lambda c: post(c, setup, "a2", delay=0.4, **{fair: "tenant-a"}),
        lambda c: post(c, setup, "a3", delay=0.5, **{fair: "tenant-a"}),
        lambda c: post(c, setup, "b1", delay=0.6, **current),
        lambda c: post(c, setup, "gold", model="vip", delay=0.8),
    ))
    assert all(r.status == 200 for r in results), results
    order = [r.name for r in sorted(results, key=lambda r: r.done_at)]
    # one at a time on the only pod: the gold band first, then tenant-a and tenant-b take turns
    assert order == ["blocker", "gold", "a1", "b1", "a2", "a3"], order


def test_a_request_that_outwaits_its_deadline_gets_429_ttl_expired_in_every_band(setup: Setup) -> None:
    """llm-d-router v0.10: a queue deadline is backpressure while the pool has endpoints, 429 whatever the band
    (before: 503 for a standard request). The sheddable objective comes in ``X-LLM-D-Inference-Objective``."""
    blocker, shed, standard = asyncio.run(run(
        lambda c: post(c, setup, "blocker", sleep_s=DEADLINES["standard"] + 1.0),
        lambda c: post(c, setup, "shed", delay=0.2, X_LLM_D_Inference_Objective="sheddable"),
        lambda c: post(c, setup, "standard", delay=0.2),
    ))
    assert blocker.status == 200
    assert (shed.status, shed.reason) == (429, "rejected-ttl-expired")
    assert (standard.status, standard.reason) == (429, "rejected-ttl-expired")
    assert shed.done_at < standard.done_at < blocker.done_at  # each at its own deadline: sheddable's is first


def test_a_full_band_refuses_at_once(setup: Setup) -> None:
    results = asyncio.run(run(
        lambda c: post(c, setup, "blocker", sleep_s=1.5),
        *(lambda c, i=i: post(c, setup, f"shed-{i}", delay=0.2 + 0.05 * i, x_gateway_inference_objective="sheddable")
          for i in range(3)),
    ))
    by_name = {r.name: r for r in results}
    # the sheddable limit is 2: the third is refused on capacity
    assert (by_name["shed-2"].status, by_name["shed-2"].reason) == (429, "rejected-saturated")


def test_requests_waiting_when_their_pod_turns_not_ready_are_each_answered_at_the_next_round(setup: Setup) -> None:
    """Issue 31, item 4: four requests wait behind a blocker; the pod then reports not ready, so the scheduler
    refuses each one at its next dispatch round (503 rejected-no-endpoints). Before, the first refusal raised ``KeyError`` in
    ``FlowControl.dispatch`` (the refused request left the queue twice), the round ended there and armed no next one:
    the others waited for another arrival or a completion, or for their deadline."""
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
    assert answers == [(503, "rejected-no-endpoints")] * 4, answers
    assert tracebacks == 0
    assert results[0].status == 200  # the blocker was on its way already


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["stopped", "killed"])
def test_a_picker_restart_with_requests_waiting_answers_each_with_a_retryable_error(setup: Setup, sig: int) -> None:
    picker = setup.gateway.picker

    async def restart_while_waiting(client: httpx.AsyncClient) -> None:
        await asyncio.sleep(0.6)
        await asyncio.to_thread(picker.stop, 10.0, sig)

    results = asyncio.run(run(
        lambda c: post(c, setup, "blocker", sleep_s=2.0),
        *(lambda c, i=i: post(c, setup, f"waiting-{i}", delay=0.2) for i in range(3)),
        restart_while_waiting,
    ))[:4]
    waited = [r for r in results if r.name != "blocker"]
    if sig == signal.SIGTERM:  # a graceful stop answers every waiting request itself, as it goes (a queue deadline
        # would have answered 429 rejected-ttl-expired)
        assert [(r.status, r.reason) for r in waited] == [(503, "rejected-shutting-down")] * 3
    else:  # a killed picker's streams break: Envoy answers them with a server error
        assert all(500 <= r.status < 600 for r in waited), waited
    picker.start()
    wait_picker_ready(setup.health_port, picker)
    (again,) = asyncio.run(run(lambda c: post(c, setup, "retry", sleep_s=0.0)))
    assert again.status == 200  # the retried request is served


def test_without_flow_control_a_sheddable_request_is_shed_while_the_pool_is_saturated(setup: Setup) -> None:
    """Flow control off: the blocker in flight saturates the only pod (in-flight threshold 1), so the pool's mean
    utilisation is 1.0: a sheddable request gets 429 ``rejected-saturated`` at once, a standard one is routed; once
    the pool is idle the sheddable one is routed too."""
    via = setup.shedding
    blocker, shed, standard = asyncio.run(run(
        lambda c: post(c, setup, "blocker", sleep_s=1.5, via=via),
        lambda c: post(c, setup, "shed", delay=0.3, via=via, x_llm_d_inference_objective="sheddable"),
        lambda c: post(c, setup, "standard", delay=0.3, via=via),
    ))
    assert (shed.status, shed.reason) == (429, "rejected-saturated")
    assert shed.done_at < blocker.done_at  # refused at once, not held
    assert blocker.status == standard.status == 200
    (later,) = asyncio.run(run(lambda c: post(c, setup, "shed-idle", sleep_s=0.0, via=via,
                                              x_gateway_inference_objective="sheddable")))
    assert later.status == 200
