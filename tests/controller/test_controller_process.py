"""The controller process against the devcluster over HTTP and a real redis-server.

Rollouts end to end through the controller's real I/O: informers, status patches, Events, finalizers, the Lease,
target states and routes in Redis, probes over HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
from kubernetes import client as k8s

from e2e.fixtures.processes import RedisServer
from loraplane.api import PickerCounters, RevisionCounters, RouteTable, TargetState, keys
from loraplane.controller.kube import FINALIZER
from loraplane.controller.leader import LeaseConfig
from loraplane.controller.manager import Controller
from loraplane.controller.metrics import ControllerMetrics
from loraplane.devcluster import ServerThread
from tests.controller.harness import (
    FAST_LEASE,
    POOL,
    ScriptedPods,
    api_client,
    create,
    eventually,
    get,
    make_controller,
    patch_spec,
    running,
)
from tests.controller.world import BASE_DIGEST, revision

pytestmark = pytest.mark.slow

FAST = {
    "steps": [{"weight": 10, "pauseSeconds": 1}, {"weight": 50, "pauseSeconds": 1}],
    "analysis": {"minRequests": 5},
    "rollbackWindowSeconds": 1,
    "evictionDelaySeconds": 1,
    "healthProbe": {"ttftBoundMs": 5000, "timeoutSeconds": 5},
}


#: a lease that outlives any test: only its holder's release hands it over
LONG_LEASE = LeaseConfig(lease_duration=600.0, renew_deadline=1.5, retry_period=0.2)


def body(rev: str, n: int, **spec: Any) -> dict[str, Any]:
    """An AdapterRevision manifest for pool ``pool`` with fast rollout timings."""
    model = revision(rev, n=n, rollout=FAST, **spec)
    model.spec.pool_ref.name = POOL
    out = model.to_dict()
    out.pop("status")
    out["metadata"] = {"name": model.metadata.name, "namespace": "default"}
    return out


@dataclass
class Env:
    server: ServerThread
    redis: aioredis.Redis
    pods: ScriptedPods
    kube: k8s.ApiClient
    workdir: Path
    loop: asyncio.AbstractEventLoop

    def controller(self, identity: str = "controller-a", lease: LeaseConfig = FAST_LEASE) -> Controller:
        return make_controller(self.server.url, self.workdir, self.redis, identity, lease_config=lease)

    def phase(self, name: str) -> str | None:
        status = get(self.kube, name).get("status") or {}
        phase = status.get("phase")
        return f"{phase}({status['canaryStep']})" if phase == "Canary" else phase

    async def routes(self) -> dict[str, int]:
        raw = await self.redis.get(keys.route_table(POOL))
        if raw is None:
            return {}
        return {w.revision: w.weight for e in RouteTable.from_json(raw).models.values() for w in e.revisions}

    async def held(self, served: str) -> dict[str, str]:
        out = {}
        for pod in self.pods.pods:
            raw = await self.redis.get(keys.target_state(POOL, pod))
            tier = TargetState.from_json(raw).tiers().get(served) if raw else None
            if tier is not None:
                out[pod] = tier.value
        return out

    async def traffic(self, *served: str, requests: int = 50, errors: int = 0) -> None:
        counters = PickerCounters(pool=POOL, replica="picker-0", published_at=0.0, revisions={
            s: RevisionCounters(requests=requests, errors=errors, ttft_seconds_sum=requests * 0.05, ttft_count=requests)
            for s in served})
        await self.redis.set(keys.picker_counters(POOL, "picker-0"), counters.to_json())

    def routes_now(self) -> dict[str, int]:
        """``routes()`` from a worker thread (the predicates ``eventually`` polls)."""
        return asyncio.run_coroutine_threadsafe(self.routes(), self.loop).result(5)

    def held_now(self, served: str) -> dict[str, str]:
        return asyncio.run_coroutine_threadsafe(self.held(served), self.loop).result(5)

    def events(self, name: str) -> list[tuple[str, str]]:
        items = k8s.CoreV1Api(self.kube).list_namespaced_event("default").items
        return [(e.reason or "", e.message or "") for e in items if e.involved_object.name == name]


@pytest.fixture
async def env(server: ServerThread, redis_srv: RedisServer, tmp_path: Path) -> AsyncIterator[Env]:
    redis = aioredis.from_url(redis_srv.url)
    stop = asyncio.Event()
    pods = ScriptedPods(redis, ["pod-a", "pod-b", "pod-c"], BASE_DIGEST)
    runner = asyncio.ensure_future(pods.run(stop))
    try:
        yield Env(server, redis, pods, api_client(server.url, tmp_path), tmp_path, asyncio.get_running_loop())
    finally:
        stop.set()
        await runner
        await redis.aclose()


async def _watch_phases(env: Env, name: str, until: str, within: float = 30.0) -> list[str]:
    seen: list[str] = []

    def check() -> bool:
        phase = env.phase(name)
        if phase and (not seen or seen[-1] != phase):
            seen.append(phase)
        return phase == until

    await eventually(check, within, f"{name} to reach {until} (seen {seen})")
    return seen


async def test_release_canary_promote_retire(env: Env) -> None:
    async with running(env.controller()):
        await asyncio.to_thread(create, env.kube, body("v1", 1))
        await _watch_phases(env, "claims-v1", "Stable")
        assert await env.routes() == {"v1": 100}
        v1 = await asyncio.to_thread(get, env.kube, "claims-v1")
        assert FINALIZER in v1["metadata"]["finalizers"]
        assert v1["status"]["trafficWeight"] == 100 and v1["status"]["residency"]["gpu"] >= 1
        await env.traffic("claims@v1", "claims@v2")

        await asyncio.to_thread(create, env.kube, body("v2", 2))
        canary_routes: list[dict[str, int]] = []

        def sample() -> bool:
            canary_routes.append(env.routes_now())
            return env.phase("claims-v2") == "Stable"

        await eventually(sample, 30, "v2 stable")
        assert {"v1": 90, "v2": 10} in canary_routes and {"v1": 50, "v2": 50} in canary_routes
        assert await env.routes() == {"v2": 100}
        await eventually(lambda: env.phase("claims-v1") == "Retired", 10, "v1 retired")
        assert await env.held("claims@v1") == {}
        reasons = sorted(r for r, _ in await asyncio.to_thread(env.events, "claims-v2"))
        assert reasons == ["CanaryStep", "CanaryStep", *["GatePassed"] * 4, "Promoted"]  # every phase, once


async def test_a_pool_at_rest_keeps_its_plan_and_the_plans_are_counted_by_kind(env: Env) -> None:
    """Once v1 is Stable and nothing moves, resyncs reuse the plan; ``loraplane_controller_plans_total`` counts the
    plans by how they were come by (the twin reports them beside the simulator's)."""
    controller = env.controller()
    controller.metrics = ControllerMetrics()

    def plans(kind: str) -> float:
        assert controller.metrics is not None
        return controller.metrics.registry.get_sample_value("loraplane_controller_plans_total",
                                                            {"outcome": kind}) or 0.0

    async with running(controller):
        await asyncio.to_thread(create, env.kube, body("v1", 1))
        await _watch_phases(env, "claims-v1", "Stable")
        settled = plans("reused")
        await eventually(lambda: plans("reused") >= settled + 2, 30, "two resyncs reusing the plan")
        made = {kind: plans(kind) for kind in ("whole", "part", "delta")}
        await eventually(lambda: plans("reused") >= settled + 4, 30, "two more")
        assert made["whole"] >= 1 and {kind: plans(kind) for kind in made} == made


async def test_wrong_digest_fails_at_verifying_and_stable_keeps_traffic(env: Env) -> None:
    async with running(env.controller()):
        await asyncio.to_thread(create, env.kube, body("v1", 1))
        await _watch_phases(env, "claims-v1", "Stable")
        env.pods.wrong_digest["claims@v3"] = "sha256:" + "0" * 64
        await asyncio.to_thread(create, env.kube, body("v3", 3))
        await _watch_phases(env, "claims-v3", "Failed")
        status = (await asyncio.to_thread(get, env.kube, "claims-v3"))["status"]
        assert status["reason"] == "DigestMismatch" and status["message"].startswith("Verifying: ")
        assert await env.routes() == {"v1": 100}
        assert ("DigestMismatch", f"Failed: {status['message']}") in await asyncio.to_thread(env.events, "claims-v3")


async def test_failed_probe_rolls_back(env: Env) -> None:
    async with running(env.controller()):
        await asyncio.to_thread(create, env.kube, body("v1", 1))
        await _watch_phases(env, "claims-v1", "Stable")
        env.pods.status["claims@v4"] = 500
        await asyncio.to_thread(create, env.kube, body("v4", 4))
        await _watch_phases(env, "claims-v4", "RolledBack")
        status = (await asyncio.to_thread(get, env.kube, "claims-v4"))["status"]
        assert status["reason"] == "ProbeFailed" and "HTTP 500" in status["message"]
        assert await env.routes() == {"v1": 100}
        await eventually(lambda: env.held_now("claims@v4") == {}, 10, "v4 unloaded")


async def test_manual_rollback_and_pause(env: Env) -> None:
    async with running(env.controller()):
        await asyncio.to_thread(create, env.kube, body("v1", 1))
        await _watch_phases(env, "claims-v1", "Stable")
        await env.traffic("claims@v1", "claims@v2")
        await asyncio.to_thread(create, env.kube, body("v2", 2, paused=True))
        await eventually(lambda: (get(env.kube, "claims-v2").get("status") or {}).get("reason") == "Paused", 10)
        assert await asyncio.to_thread(env.phase, "claims-v2") == "Pending"
        await asyncio.to_thread(patch_spec, env.kube, "claims-v2", {"paused": False})
        await _watch_phases(env, "claims-v2", "Canary(0)")
        await asyncio.to_thread(patch_spec, env.kube, "claims-v2", {"rollback": True})
        await _watch_phases(env, "claims-v2", "RolledBack", within=5)
        assert await env.routes() == {"v1": 100}


async def test_restart_mid_canary_resumes_without_repeating_a_gate(env: Env) -> None:
    first = env.controller("controller-a")
    async with running(first):
        await asyncio.to_thread(create, env.kube, body("v1", 1))
        await _watch_phases(env, "claims-v1", "Stable")
        await env.traffic("claims@v1", "claims@v2")
        slow = {**FAST, "steps": [{"weight": 10, "pauseSeconds": 3}, {"weight": 50, "pauseSeconds": 1}]}
        manifest = body("v2", 2)
        manifest["spec"]["rollout"] = slow
        await asyncio.to_thread(create, env.kube, manifest)
        await _watch_phases(env, "claims-v2", "Canary(0)")
    probes_before = env.pods.probes["claims@v2"]
    events_before = await asyncio.to_thread(env.events, "claims-v2")
    async with running(env.controller("controller-b")):
        await _watch_phases(env, "claims-v2", "Stable", within=30)
    assert env.pods.probes["claims@v2"] == probes_before  # the probe gate was not repeated
    after = Counter(r for r, _ in await asyncio.to_thread(env.events, "claims-v2"))
    after.subtract(Counter(r for r, _ in events_before))
    assert +after == Counter({"CanaryStep": 1, "Promoted": 1})  # nor skipped: step 2 came before promotion


async def test_two_replicas_never_both_act(env: Env) -> None:
    a, b = env.controller("controller-a"), env.controller("controller-b")
    both = 0
    async with running(a), running(b):
        await asyncio.to_thread(create, env.kube, body("v1", 1))
        for _ in range(40):
            both += a.is_leader() and b.is_leader()
            await asyncio.sleep(0.05)
        assert a.is_leader() != b.is_leader()
        leader, follower = (a, b) if a.is_leader() else (b, a)
        assert follower.reconciles == 0 and leader.reconciles > 0
    assert both == 0


async def test_leadership_moves_when_the_leader_stops(env: Env) -> None:
    """The leader releases the Lease on its way out, so the other replica takes over at once: the lease lasts far
    longer than the test, so its expiry cannot be what hands it over."""
    a, b = env.controller("controller-a", LONG_LEASE), env.controller("controller-b", LONG_LEASE)
    async with contextlib.AsyncExitStack() as b_runs:
        async with running(a):
            await eventually(a.is_leader, 10, "a to lead")
            await b_runs.enter_async_context(running(b))
            await asyncio.to_thread(create, env.kube, body("v1", 1))
            await _watch_phases(env, "claims-v1", "Stable")
            assert not b.is_leader() and b.reconciles == 0
        await eventually(b.is_leader, 10, "b to lead")
        assert (await asyncio.to_thread(_lease_holder, env)) == "controller-b"
        await env.traffic("claims@v1", "claims@v2")
        await asyncio.to_thread(create, env.kube, body("v2", 2))
        await _watch_phases(env, "claims-v2", "Stable")
        assert b.reconciles > 0


def _lease_holder(env: Env) -> str | None:
    lease = k8s.CoordinationV1Api(env.kube).read_namespaced_lease("loraplane-controller", "default")
    return lease.spec.holder_identity if lease.spec else None


async def test_deleting_a_revision_unloads_it_before_the_finalizer_goes(env: Env) -> None:
    """The controller asks every pod to unload a deleted revision and keeps its finalizer, pass after pass, while a
    pod still reports it; the object goes once no pod does."""
    controller = env.controller()
    async with running(controller):
        await asyncio.to_thread(create, env.kube, body("v1", 1))
        await _watch_phases(env, "claims-v1", "Stable")
        env.pods.slow_unload.add("claims@v1")  # the pods go on reporting it after their targets drop it
        await asyncio.to_thread(k8s.CustomObjectsApi(env.kube).delete_namespaced_custom_object, "loraplane.io",
                                "v1alpha1", "default", "adapterrevisions", "claims-v1")
        await eventually(lambda: env.held_now("claims@v1") == {}, 10, "every target without claims@v1")
        assert await env.routes() == {}
        passes = controller.reconciles
        await eventually(lambda: controller.reconciles >= passes + 5, 10, "five more passes")
        held = await asyncio.to_thread(get, env.kube, "claims-v1")
        assert held["metadata"]["deletionTimestamp"] and FINALIZER in held["metadata"]["finalizers"]
        env.pods.slow_unload.clear()

        def gone() -> bool:
            try:
                get(env.kube, "claims-v1")
            except k8s.ApiException as exc:
                return exc.status == 404
            return False

        await eventually(gone, 10, "claims-v1 deleted")
        assert await env.routes() == {}
        assert await env.held("claims@v1") == {}


async def _second_revision_in_canary_step_one(env: Env) -> None:
    """claims-v1 Stable, then claims-v2 in Canary step 1 (10 %, a 4 s pause) with traffic to both."""
    await asyncio.to_thread(create, env.kube, body("v1", 1))
    await _watch_phases(env, "claims-v1", "Stable")
    await env.traffic("claims@v1", "claims@v2")
    manifest = body("v2", 2)
    manifest["spec"]["rollout"] = {**FAST, "steps": [{"weight": 10, "pauseSeconds": 4},
                                                     {"weight": 50, "pauseSeconds": 1}]}
    await asyncio.to_thread(create, env.kube, manifest)
    await _watch_phases(env, "claims-v2", "Canary(0)")


async def _forge_promotion(env: Env) -> dict[str, Any]:
    """Patch claims-v2's status to ``phase: Stable`` at weight 100 as someone else would; the status before."""
    ours = (await asyncio.to_thread(get, env.kube, "claims-v2"))["status"]
    forged = {"status": {"phase": "Stable", "trafficWeight": 100, "reason": "Promoted"}}
    await asyncio.to_thread(k8s.CustomObjectsApi(env.kube).patch_namespaced_custom_object_status,
                            "loraplane.io", "v1alpha1", "default", "adapterrevisions", "claims-v2", forged)
    return ours


async def _restored(env: Env, ours: dict[str, Any], controller: Controller, samples: int) -> None:
    """claims-v2 gets the controller's own status back (Canary step 1, its pause running on from where it was), no
    route ever gives it more than its step's 10 % meanwhile, and the repair is counted."""
    weights: list[int] = []

    def sample() -> bool:
        weights.append(env.routes_now().get("v2", 0))
        status = get(env.kube, "claims-v2")["status"]
        return status["phase"] == "Canary" and status.get("canaryStep") == 0 and len(weights) >= samples

    await eventually(sample, 10, "the controller's own status back")
    restored = (await asyncio.to_thread(get, env.kube, "claims-v2"))["status"]
    assert max(weights) == 10, weights
    assert restored["phaseSince"] == ours["phaseSince"]
    assert controller.metrics is not None
    assert controller.metrics.registry.get_sample_value("loraplane_controller_status_repairs_total") >= 1


async def test_a_status_patch_cannot_skip_a_gate(env: Env) -> None:
    """Someone patches ``status.phase: Stable`` (and weight 100) during Canary step 1: no route ever sends the new
    revision more than its step's 10 %, the controller writes its own status back, says so in a Warning Event and
    a metric, and the canary goes on through its gates (step 2 before promotion)."""
    controller = env.controller()
    controller.metrics = ControllerMetrics()
    async with running(controller):
        await _second_revision_in_canary_step_one(env)
        ours = await _forge_promotion(env)
        await _restored(env, ours, controller, samples=20)
        events = await asyncio.to_thread(env.events, "claims-v2")
        assert any(reason == "StatusOverwritten" and "restored Canary step 1" in message for reason, message in events)
        seen = await _watch_phases(env, "claims-v2", "Stable", within=30)
        assert "Canary(1)" in seen  # step 2 was not skipped


async def test_a_status_patched_while_no_controller_leads_skips_no_gate(env: Env) -> None:
    """The forged ``phase: Stable`` lands between two leaders (the first stopped, the next not yet started): the new
    leader reads the status the last one recorded in Redis (``StatusRecord``, which only the controller writes) and
    restores it, instead of taking the stored status as the last leader's."""
    async with running(env.controller("controller-a")):
        await _second_revision_in_canary_step_one(env)
    ours = await _forge_promotion(env)
    successor = env.controller("controller-b")
    successor.metrics = ControllerMetrics()
    async with running(successor):
        await _restored(env, ours, successor, samples=10)
        seen = await _watch_phases(env, "claims-v2", "Stable", within=30)
        assert "Canary(1)" in seen  # step 2 was not skipped
