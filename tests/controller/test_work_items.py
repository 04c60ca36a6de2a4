"""The controller's work items against the devcluster and a real redis-server: one pool's failure never stops the
others, a timed gate is reconciled at its due time (not at the next resync), backoff grows and resets, terminal
errors are recorded in status and not retried."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
from kubernetes import client as k8s

from e2e.fixtures.processes import RedisServer
from loraplane.api import GROUP, PLURAL, VERSION, keys
from loraplane.controller.manager import Controller
from loraplane.controller.metrics import ControllerMetrics
from loraplane.controller.store import PoolReadings, RedisStore
from loraplane.devcluster import ServerThread
from loraplane.kube import POOL_GROUP, POOL_PLURAL, POOL_VERSION
from tests.controller.harness import POOL, api_client, create, eventually, get, make_controller, running
from tests.controller.world import revision

pytestmark = pytest.mark.slow


def manifest(rev: str, pool: str = POOL, adapter: str = "claims", **spec: Any) -> dict[str, Any]:
    model = revision(rev, adapter=adapter, **spec)
    model.spec.pool_ref.name = pool
    out = model.to_dict()
    out.pop("status")
    out["metadata"] = {"name": model.metadata.name, "namespace": "default"}
    return out


def set_status(client: k8s.ApiClient, name: str, status: dict[str, Any]) -> None:
    k8s.CustomObjectsApi(client).patch_namespaced_custom_object_status(
        GROUP, VERSION, "default", PLURAL, name, {"status": status}, _content_type="application/merge-patch+json")


def condition(client: k8s.ApiClient, name: str, type_: str) -> dict[str, Any] | None:
    conditions = (get(client, name).get("status") or {}).get("conditions") or []
    return next((c for c in conditions if c["type"] == type_), None)


class FailingStore(RedisStore):
    """A real RedisStore whose reads of the pools in ``failing`` raise (an error that is not Redis's or the OS's)."""

    failing: set[str]

    async def read(self, pool: str) -> PoolReadings:
        if pool in self.failing:
            raise KeyError(f"injected failure of pool {pool}")
        return await super().read(pool)


async def drain(controller: Controller) -> None:
    """Work as the controller's workers do until nothing is due and the watch events of its writes are in."""
    for _ in range(3):
        while (key := controller.queue.pop_ready()) is not None:
            await controller.process(key)
            controller.queue.done(key)
        await asyncio.sleep(0.3)


@contextlib.asynccontextmanager
async def watching_a_canary(controller: Controller, kube: k8s.ApiClient, steps: list[dict[str, Any]],
                            since: datetime) -> AsyncIterator[None]:
    """Create ``claims-v2`` at canary step 1 since ``since``; run the controller's informers for the block (its
    workers are the test's), then stop them and close the probe client."""
    await asyncio.to_thread(create, kube, manifest("v2", steps=steps, rollout={"analysis": {"minRequests": 0}}))
    await asyncio.to_thread(set_status, kube, "claims-v2", {"phase": "Canary", "canaryStep": 0,
                                                            "phaseSince": since.isoformat()})
    stop = asyncio.Event()
    try:
        await controller.watch(stop)
        await eventually(lambda: "claims-v2" in {n for _, n in controller.informers["revisions"].items}, 5)
        yield
    finally:
        stop.set()
        for informer in controller.informers.values():
            informer.stop()
        await controller.prober.client.aclose()


@pytest.fixture
async def redis(redis_srv: RedisServer) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.from_url(redis_srv.url)
    yield client
    await client.aclose()


async def test_a_failing_pool_does_not_stop_the_others_and_its_backoff_resets(
        server: ServerThread, redis: aioredis.Redis, tmp_path: Path) -> None:
    kube = api_client(server.url, tmp_path)
    controller = make_controller(server.url, tmp_path, redis, lease=False)
    store = FailingStore(redis, controller.wall_clock)
    store.failing = {"broken"}
    controller.store = store
    async with running(controller):
        await asyncio.to_thread(create, kube, manifest("v1", pool="broken", adapter="bad"))
        await asyncio.to_thread(create, kube, manifest("v1"))
        # the healthy pool is reconciled (its revision waits for pods: status written) while "broken" fails
        await eventually(lambda: (get(kube, "claims-v1").get("status") or {}).get("reason") == "NoPods", 10,
                         "the healthy pool reconciled")
        await eventually(lambda: controller.queue.failures("broken") >= 3, 10, "broken retried with backoff")
        assert controller.queue.backoff("broken") >= 4 * controller.queue.backoff("pool")  # it grows
        store.failing.clear()
        await eventually(lambda: (get(kube, "bad-v1").get("status") or {}).get("reason") == "NoPods", 10,
                         "broken reconciled once it works")
        # a success resets the backoff (the reset follows the status write, so wait for it too)
        await eventually(lambda: controller.queue.failures("broken") == 0, 10, "broken's backoff reset")


async def test_a_gate_fires_at_its_due_time_on_a_fake_clock(
        server: ServerThread, redis: aioredis.Redis, tmp_path: Path) -> None:
    wall = [datetime(2026, 3, 1, tzinfo=UTC).timestamp()]
    kube = api_client(server.url, tmp_path)
    controller = make_controller(server.url, tmp_path, redis, lease=False, clock=lambda: wall[0],
                                 monotonic=lambda: wall[0])
    controller.config = dataclasses.replace(controller.config, resync_seconds=120)  # no resync before the gate
    steps = [{"weight": 10, "pauseSeconds": 30}, {"weight": 50, "pauseSeconds": 30}]
    since = datetime.fromtimestamp(wall[0], UTC) - timedelta(seconds=10)
    async with watching_a_canary(controller, kube, steps, since):
        await drain(controller)
        due = since.timestamp() + 30
        assert controller.queue.next_due() == pytest.approx(due, abs=0.1)  # requeued for the gate, not a resync
        wall[0] = due - 0.1
        assert controller.queue.pop_ready() is None
        assert get(kube, "claims-v2")["status"]["canaryStep"] == 0
        wall[0] = due
        await drain(controller)
        status = get(kube, "claims-v2")["status"]
        assert (status["phase"], status["canaryStep"]) == ("Canary", 1)
        moved = datetime.fromisoformat(status["phaseSince"]).timestamp()
        assert 0 <= moved - due <= 0.1  # the transition is stamped within 100 ms of the due time
        assert controller.queue.next_due() == pytest.approx(due + 30, abs=0.1)


async def test_events_are_posted_in_the_background_in_the_order_recorded(
        server: ServerThread, redis: aioredis.Redis, tmp_path: Path) -> None:
    kube = api_client(server.url, tmp_path)
    controller = make_controller(server.url, tmp_path, redis, lease=False)
    release, posted = asyncio.Event(), []
    post = controller.kube.event

    async def held(obj: dict[str, Any], type_: str, reason: str, message: str) -> None:
        await release.wait()
        posted.append(message)
        await post(obj, type_, reason, message)

    controller.kube.event = held  # type: ignore[method-assign]
    steps = [{"weight": 10, "pauseSeconds": 30}, {"weight": 50, "pauseSeconds": 1}]
    async with watching_a_canary(controller, kube, steps, datetime.now(UTC) - timedelta(seconds=60)):  # overdue
        await drain(controller)  # step 1 -> step 2: reconciled and written while its Event waits
        assert get(kube, "claims-v2")["status"]["canaryStep"] == 1 and posted == []
        await asyncio.sleep(1.0)
        await drain(controller)  # step 2's pause is over: promoted
        assert get(kube, "claims-v2")["status"]["phase"] == "Stable" and posted == []
        release.set()
        await controller.aclose()  # posts what is still queued
        assert [m.split(":")[0] for m in posted] == ["Canary step 2", "Stable"]
        listed = k8s.CoreV1Api(kube).list_namespaced_event("default").items  # by name: generated, in no order
        listed.sort(key=lambda e: int(e.metadata.resource_version))  # the order the server took them in
        assert [e.message for e in listed if e.involved_object.name == "claims-v2"] == posted


async def test_a_terminal_error_is_recorded_in_status_and_not_retried(
        server: ServerThread, redis: aioredis.Redis, tmp_path: Path) -> None:
    kube = api_client(server.url, tmp_path)
    custom = k8s.CustomObjectsApi(kube)
    pool = {"apiVersion": f"{POOL_GROUP}/{POOL_VERSION}", "kind": "InferencePool",
            "metadata": {"name": POOL, "namespace": "default"},
            "spec": {"selector": {"matchLabels": {}}, "targetPorts": [{"number": 8000}],
                     "endpointPickerRef": {"name": "picker", "port": {"number": 9002}}}}
    await asyncio.to_thread(custom.create_namespaced_custom_object, POOL_GROUP, POOL_VERSION, "default",
                            POOL_PLURAL, pool)
    controller = make_controller(server.url, tmp_path, redis, lease=False)
    controller.metrics = ControllerMetrics()
    async with running(controller):
        await asyncio.to_thread(create, kube, manifest("v1"))
        failed = await eventually(lambda: condition(kube, "claims-v1", "Reconciled"), 10, "Reconciled condition")
        assert failed["status"] == "False" and failed["reason"] == "InvalidPoolSelector"
        assert "matchLabels is empty" in failed["message"]
        errors = controller.metrics.reconcile_errors._value.get()
        await asyncio.sleep(1.0)  # ten resync periods of 0.1 s: none retries the pool
        assert controller.metrics.reconcile_errors._value.get() == errors <= 3
        assert controller.reconciles == 0
        await asyncio.to_thread(custom.patch_namespaced_custom_object, POOL_GROUP, POOL_VERSION, "default",
                                POOL_PLURAL, POOL, {"spec": {"selector": {"matchLabels": {"app": "engine"}}}},
                                _content_type="application/merge-patch+json")
        fixed = await eventually(lambda: (c := condition(kube, "claims-v1", "Reconciled")) and c["status"] == "True"
                                 and c, 10, "the pool reconciled once its selector changed")
        assert fixed["reason"] == "Reconciled"


async def test_a_pass_that_writes_hundreds_of_statuses_takes_one_redis_connection_for_their_records(
        server: ServerThread, redis: aioredis.Redis, tmp_path: Path) -> None:
    """redis-py's asyncio pool refuses a 101st connection (``MaxConnectionsError``); each status's record went out
    on its own, side by side, so a pass over a pool of more than 100 revisions failed at every retry (``bench
    controller`` at 10,000 revisions). Now a pass's records are one pipeline: 150 new revisions all get a status."""
    kube = api_client(server.url, tmp_path)
    names = [f"a{i:03d}" for i in range(150)]
    for name in names:
        await asyncio.to_thread(create, kube, manifest("v1", adapter=name))
    controller = make_controller(server.url, tmp_path, redis, lease=False)
    async with running(controller):
        def statuses() -> list[str | None]:
            return [(get(kube, f"{name}-v1").get("status") or {}).get("reason") for name in names]

        await eventually(lambda: set(statuses()) == {"NoPods"}, 60, "every revision's status")
        assert controller.queue.failures(POOL) == 0
    records = [k async for k in redis.scan_iter(match=keys.revision_status_pattern(POOL), count=1000)]
    assert len(records) >= len(names)
