"""The live half of ``loraplane bench controller``: the controller's whole loop against a devcluster and Redis.

A ``loraplane devcluster`` child process holds ``--live-revisions`` stable AdapterRevisions spread over
``--live-pools`` pools (each pool's pods report their capacity in a real redis-server); the real ``Controller``
(informers, work queue, Redis store) runs in this process. Measured:

- ``apply_to_target_ms``: a kubectl-style create (one POST) of a new revision until a ``TargetState`` in Redis
  holds it (the controller moved it to Verifying and placed it on its canary pod), p50/p99 over
  ``--apply-samples`` creates;
- ``gate_delay_ms``: for ``--gate-adapters`` canaries (one more pool, held paused until the controller is warm)
  stepping through ``--gate-steps`` timed steps, each step's due time (its ``phaseSince`` + ``pauseSeconds``) to
  the moment a watch of the API server sees the next step's status, p50/p99 (the first step, overdue when the
  canaries are unpaused, does not count).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import redis.asyncio as aioredis
from kubernetes import client as k8s
from kubernetes import config as k8s_config

from loraplane.api import GROUP, PLURAL, VERSION, PodLoad, ResidencyReport, TargetState, keys, read_payload
from loraplane.controller.kube import KubeApi
from loraplane.controller.manager import Controller, ControllerConfig
from loraplane.controller.metrics import ControllerMetrics
from loraplane.controller.probe import HealthProber
from loraplane.controller.store import RedisStore
from loraplane.kube import Informer
from loraplane.processes import process_usage

BASE_DIGEST = "sha256:" + "b" * 64
GATES_POOL = "gates"
MERGE_PATCH = "application/merge-patch+json"
MIB = 1 << 20


def _manifest(adapter: str, revision: str, pool: str, n: int, rollout: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "AdapterRevision",
        "metadata": {"name": f"{adapter}-{revision}", "namespace": "default"},
        "spec": {
            "adapter": adapter, "revision": revision, "poolRef": {"name": pool},
            "baseModel": {"name": "base/model", "digest": BASE_DIGEST},
            "artifact": {"uri": f"oci://registry.local/{adapter}:{revision}", "digest": f"sha256:{n:064x}",
                         "sizeBytes": 16 << 20},
            "lora": {"rank": 16, "alpha": 32, "targetModules": ["q_proj", "v_proj"]},
            "rollout": rollout or {"canary": {"pods": 1}},
        },
    }


def _percentiles(samples: list[float]) -> dict[str, float | int]:
    if not samples:
        return {"p50": float("nan"), "p99": float("nan"), "n": 0}
    p50, p99 = np.percentile(np.array(samples), [50, 99])
    return {"p50": round(float(p50), 1), "p99": round(float(p99), 1), "n": len(samples)}


class _Cluster:
    """Blocking calls to the devcluster (run in threads)."""

    def __init__(self, kubeconfig: Path) -> None:
        self.api_client = k8s_config.new_client_from_config(config_file=str(kubeconfig))
        self.custom = k8s.CustomObjectsApi(self.api_client)

    def unpause(self, name: str) -> None:
        self.custom.patch_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, name,
                                                   {"spec": {"paused": False}}, _content_type=MERGE_PATCH)

    def create(self, body: dict[str, Any], status: dict[str, Any] | None = None) -> None:
        self.custom.create_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, body)
        if status is not None:
            self.custom.patch_namespaced_custom_object_status(
                GROUP, VERSION, "default", PLURAL, body["metadata"]["name"], {"status": status},
                _content_type=MERGE_PATCH)


async def _publish_pods(client: aioredis.Redis, pool: str, pods: int) -> list[str]:
    names = [f"{pool}-pod-{i}" for i in range(pods)]
    async with client.pipeline(transaction=False) as pipe:
        for i, pod in enumerate(names):
            report = ResidencyReport(pool=pool, pod=pod, address=f"10.0.{i // 250}.{i % 250}:8000",
                                     base_model_digest=BASE_DIGEST, max_lora_rank=64, heartbeat_at=time.time(),
                                     ttl_seconds=3600, load=PodLoad(max_gpu_slots=8, max_cpu_slots=32))
            pipe.set(keys.residency_report(pool, pod), report.to_json())
            pipe.sadd(keys.residency_index(pool), pod)
        await pipe.execute()
    return names


async def _seed(cluster: _Cluster, client: aioredis.Redis, args: argparse.Namespace) -> dict[str, list[str]]:
    """Stable revisions over the pools, and the gate canaries (stable v1 + v2 at its first step); pool -> pods."""
    stamp = datetime.now(UTC).isoformat()
    stable = {"phase": "Stable", "trafficWeight": 100, "phaseSince": stamp}
    jobs: list[tuple[dict[str, Any], dict[str, Any]]] = []
    for i in range(_live_revisions(args)):
        jobs.append((_manifest(f"adapter-{i:04d}", "v1", f"pool-{i % args.live_pools:02d}", i + 1), stable))
    steps = [{"weight": 10 * (k + 1), "pauseSeconds": 1} for k in range(args.gate_steps)]
    for i in range(args.gate_adapters):
        rollout = {"canary": {"pods": 1}, "analysis": {"minRequests": 0},
                   "steps": [{**s, "pauseSeconds": 1 + i % 3} for s in steps]}
        jobs.append((_manifest(f"gate-{i:02d}", "v1", GATES_POOL, 100_000 + i), stable))
        canary = _manifest(f"gate-{i:02d}", "v2", GATES_POOL, 200_000 + i, rollout)
        canary["spec"]["paused"] = True  # held until the controller is warm (``_unpause``)
        jobs.append((canary, {"phase": "Canary", "canaryStep": 0, "phaseSince": stamp}))
    with ThreadPoolExecutor(max_workers=4) as pool:
        list(pool.map(lambda job: cluster.create(*job), jobs))
    pools = {f"pool-{p:02d}": await _publish_pods(client, f"pool-{p:02d}", args.live_pods) for p in range(args.live_pools)}
    pools[GATES_POOL] = await _publish_pods(client, GATES_POOL, args.live_pods)
    return pools


class _GateWatch:
    """Watches the gate canaries' statuses: each step change's delay after the previous step's due time."""

    def __init__(self, cluster: _Cluster, pauses: dict[str, int]) -> None:
        self.pauses = pauses
        self.seen: dict[str, tuple[Any, Any, float]] = {}
        self.delays_ms: list[float] = []
        self.after = float("inf")
        self.finished = asyncio.Event()
        self.informer = Informer("gates", cluster.custom.list_namespaced_custom_object,
                                 (GROUP, VERSION, "default", PLURAL), self._changed)

    def _changed(self, kind: str, obj: dict[str, Any] | None) -> None:
        for o in [obj] if obj is not None else list(self.informer.items.values()):
            name = o["metadata"]["name"]
            status = o.get("status") or {}
            if name not in self.pauses or not status.get("phaseSince"):
                continue
            state = (status.get("phase"), status.get("canaryStep"),
                     datetime.fromisoformat(status["phaseSince"]).timestamp())
            before = self.seen.get(name)
            self.seen[name] = state
            if before is None or before[:2] == state[:2] or before[0] != "Canary":
                continue
            due = before[2] + self.pauses[name]
            if due >= self.after:  # a due time while the controller was warm (not its start-up)
                self.delays_ms.append((time.time() - due) * 1000)
        if len(self.seen) == len(self.pauses) and all(s[0] != "Canary" for s in self.seen.values()):
            self.finished.set()


def _written(controller: Controller) -> tuple[int, float | None]:
    """Redis keys and status patches the controller has written so far."""
    assert controller.metrics is not None
    patches = controller.metrics.registry.get_sample_value("loraplane_controller_status_patches_total")
    return controller.store.writes, patches


async def _wait_idle(controller: Controller, quiet: float = 0.5, within: float = 120.0) -> None:
    """Until the controller has reconciled everything: nothing queued and nothing written (Redis keys, status
    patches) for ``quiet`` seconds. Resyncs that change nothing go on all the while (21 pools every 1.5-2 s leave
    few quiet half-seconds), so they do not count."""
    deadline = time.monotonic() + within
    last, since = _written(controller), time.monotonic()
    while time.monotonic() < deadline:
        if _written(controller) != last or len(controller.queue) or not controller.reconciles:
            last, since = _written(controller), time.monotonic()
        elif time.monotonic() - since >= quiet:
            return
        await asyncio.sleep(0.05)
    raise TimeoutError("the controller did not settle")


async def _apply_one(cluster: _Cluster, client: aioredis.Redis, pool: str, pods: list[str], n: int) -> float:
    """Create one revision; milliseconds until a target state of its pool holds it."""
    body = _manifest(f"applied-{n:04d}", "v1", pool, 300_000 + n)
    served = f"applied-{n:04d}@v1"
    pubsub = client.pubsub()
    await pubsub.subscribe(keys.target_changed_channel(pool))
    try:
        started = time.perf_counter()
        create = asyncio.ensure_future(asyncio.to_thread(cluster.create, body))
        while True:
            message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
            if message is None:
                if time.perf_counter() - started > 30:
                    raise TimeoutError(f"{served} never reached a target state")
                continue
            pod = message["data"].decode() if isinstance(message["data"], bytes) else str(message["data"])
            raw = await client.get(keys.target_state(pool, pod))
            if raw and served in read_payload(TargetState, raw).tiers():
                elapsed = (time.perf_counter() - started) * 1000
                await create
                return elapsed
    finally:
        await pubsub.aclose()


def _live_revisions(args: argparse.Namespace) -> int:
    """``--live-revisions``, or as many as the planned pool's ``--revisions``."""
    return int(args.live_revisions if args.live_revisions is not None else args.revisions)


async def run(args: argparse.Namespace, redis_url: str, workdir: Path) -> dict[str, Any]:
    """Seed the cluster, run the controller, measure both figures."""
    from loraplane.stack.services import start_devcluster

    devcluster = start_devcluster(workdir / "devcluster")
    client = aioredis.from_url(redis_url)
    cluster = _Cluster(devcluster.kubeconfig)
    stop = asyncio.Event()
    try:
        pools = await _seed(cluster, client, args)
        pauses = {f"gate-{i:02d}-v2": 1 + i % 3 for i in range(args.gate_adapters)}
        gates = _GateWatch(cluster, pauses)
        gates.informer.start()
        async with httpx.AsyncClient() as http:
            controller = Controller(KubeApi(cluster.api_client, "bench"), RedisStore(client, time.time),
                                    HealthProber(http), None, ControllerConfig(resync_seconds=args.resync_seconds),
                                    metrics=ControllerMetrics())
            task = asyncio.ensure_future(controller.run(stop))
            # the first passes patch every revision's conditions and finalizer: ~2 API calls per revision
            await _wait_idle(controller, within=120.0 + 0.06 * _live_revisions(args))
            gates.after = time.time()
            with ThreadPoolExecutor(max_workers=4) as threads:  # their first step is overdue: only later ones count
                await asyncio.get_running_loop().run_in_executor(
                    None, lambda: list(threads.map(cluster.unpause, pauses)))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(gates.finished.wait(), 10 + 3 * args.gate_steps)
            gates.informer.stop()
            await _wait_idle(controller)
            applied = []
            names = sorted(p for p in pools if p != GATES_POOL)
            for n in range(args.apply_samples):
                pool = names[n % len(names)]
                applied.append(await _apply_one(cluster, client, pool, pools[pool], n))
                await _wait_idle(controller, quiet=0.2)
            stop.set()
            await task
            await controller.aclose()
        peaks = {"live_process_rss_mb": round(process_usage(os.getpid())[1] / MIB, 1),
                 "devcluster_peak_rss_mb": round(process_usage(devcluster.process.pid)[2] / MIB, 1)}
    finally:
        stop.set()
        await client.aclose()
        cluster.api_client.close()
        devcluster.stop()
    return {
        "live_revisions": _live_revisions(args) + 2 * args.gate_adapters,
        "live_pools": args.live_pools + 1,
        "apply_to_target_ms": _percentiles(applied),
        "gate_delay_ms": _percentiles(gates.delays_ms),
        **peaks,
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The live benchmark's flags."""
    p.add_argument("--live-revisions", type=int, default=None,
                   help="stable revisions in the devcluster for the live figures (default: as many as --revisions)")
    p.add_argument("--live-pools", type=int, default=20, help="pools they are spread over (default 20)")
    p.add_argument("--live-pods", type=int, default=4, help="pods reporting per pool (default 4)")
    p.add_argument("--apply-samples", type=int, default=40, help="revisions created for apply_to_target_ms (default 40)")
    p.add_argument("--gate-adapters", type=int, default=10, help="canaries timed for gate_delay_ms (default 10)")
    p.add_argument("--gate-steps", type=int, default=4, help="timed canary steps of each (default 4)")
    p.add_argument("--resync-seconds", type=float, default=2.0, help="the controller's resync period (default 2)")
    p.add_argument("--no-live", action="store_true", help="skip the live figures (placement and Redis only)")
