"""``loraplane bench controller``: reconcile time, Redis writes and placement churn at scale.

A pool of ``--pods`` pods (reports in a real redis-server) and ``--revisions`` stable AdapterRevisions with Zipf
request rates. Measured, each as one reconcile = read Redis + ``plan_pool`` + incremental writes:

- ``cold``: the first reconcile (every target state and the route table are new);
- ``idle``: the next one with nothing changed (must write nothing);
- the reconcile after every adapter's rates moved by up to +-``--rate-change`` (10 %): ``reconcile_s`` and
  ``redis_writes`` are this one's, ``churn_adapters_moved`` the GPU replicas it adds and ``churn_minimum`` the
  fewest any placement with the from-scratch plan's replica counts would add (``placement.minimum_gpu_loads``).

Status patches are not part of it: stable revisions whose status does not change cause none.

Then, unless ``--no-live``, the controller's whole loop against a devcluster (``controller_live``): ``apply_to_target_ms``
and ``gate_delay_ms``.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import random
import resource
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from loraplane.api import (
    AdapterResidency,
    AdapterRevision,
    PickerCounters,
    PodLoad,
    RequestRates,
    ResidencyReport,
    Tier,
    keys,
)
from loraplane.bench import controller_live
from loraplane.controller.incremental import DEFAULT_FULL_PLAN_SECONDS, DEFAULT_HYSTERESIS, IncrementalPlanner
from loraplane.controller.placement import Placement, gpu_loads, minimum_gpu_loads, place
from loraplane.controller.pool import PoolInputs, PoolPlan, clear_target_cache
from loraplane.controller.store import RedisStore
from loraplane.helptext import HelpFormatter
from loraplane.processes import start_redis

POOL = "bench"
BASE_DIGEST = "sha256:" + "b" * 64
MB = 1 << 20


def _revisions(n: int, rng: random.Random, now: datetime, first: int = 0) -> list[AdapterRevision]:
    revs = []
    for i in range(first, first + n):
        rank = rng.choice([8, 16, 32, 64])
        revs.append(AdapterRevision.model_validate({
            "metadata": {"name": f"adapter-{i:04d}-v1", "namespace": "default", "generation": 1,
                         "creationTimestamp": now.isoformat()},
            "spec": {
                "adapter": f"adapter-{i:04d}", "revision": "v1", "poolRef": {"name": POOL},
                "baseModel": {"name": "base/model", "digest": BASE_DIGEST},
                "artifact": {"uri": f"oci://registry.local/adapter-{i:04d}:v1", "digest": f"sha256:{i + 1:064x}",
                             "sizeBytes": rank * MB},
                "lora": {"rank": rank, "alpha": 2 * rank, "targetModules": ["q_proj", "v_proj"]},
                "tenant": f"tenant-{i % 20}",
                "priorityClass": "gold" if i % 50 == 0 else "standard",
            },
            "status": {"phase": "Stable", "trafficWeight": 100, "phaseSince": now.isoformat()},
        }))
    return revs


def _rates(revs: Sequence[AdapterRevision], rng: random.Random, top_rate: float) -> dict[str, float]:
    order = list(range(len(revs)))
    rng.shuffle(order)
    return {revs[i].served_name: top_rate / (rank + 1) ** 1.1 for rank, i in enumerate(order)}


def _request_rates(rates: dict[str, float]) -> RequestRates:
    return RequestRates(pool=POOL, published_at=time.time(), windows={"5m": rates, "1h": rates, "24h": rates})


def _reports(pods: int, plan: PoolPlan | None, gpu_slots: int, cpu_slots: int) -> list[ResidencyReport]:
    """What sidecars report once they have applied ``plan`` (empty pods before the first one)."""
    out = []
    for p in range(pods):
        name = f"pod-{p:02d}"
        held = plan.targets.get(name, []) if plan else []
        out.append(ResidencyReport(
            pool=POOL, pod=name, address=f"10.0.0.{p}:8000", base_model_digest=BASE_DIGEST, max_lora_rank=64,
            heartbeat_at=time.time(), ttl_seconds=600,
            adapters=[AdapterResidency(served_name=t.served_name, tier=t.tier, digest=t.artifact.digest,
                                       bytes=t.artifact.size_bytes or 0) for t in held],
            load=PodLoad(max_gpu_slots=gpu_slots, max_cpu_slots=cpu_slots),
        ))
    return out


async def _publish(client: aioredis.Redis, reports: list[ResidencyReport], rates: dict[str, float]) -> None:
    async with client.pipeline(transaction=False) as pipe:
        for r in reports:
            pipe.set(keys.residency_report(POOL, r.pod), r.to_json())
            pipe.sadd(keys.residency_index(POOL), r.pod)
        # one picker replica's rates, found (as the controller finds every replica) by its counters key
        pipe.set(keys.request_rates(POOL, "bench"), _request_rates(rates).to_json())
        pipe.set(keys.picker_counters(POOL, "bench"),
                 PickerCounters(pool=POOL, replica="bench", published_at=time.time()).to_json())
        await pipe.execute()


@dataclass
class _Run:
    """One timed reconcile."""

    wall_s: float
    cpu_s: float
    writes: int
    bytes: int
    plan: PoolPlan
    #: how it was planned: reused, placement delta, part or full
    how: str

    @property
    def reused(self) -> bool:
        return self.how == "reused"


async def _reconcile(store: RedisStore, planner: IncrementalPlanner, revs: list[AdapterRevision]) -> _Run:
    """One reconcile as the controller runs it: read, plan (or keep the last plan: ``IncrementalPlanner``), repair
    and write what changed."""
    writes, written = store.writes, store.bytes_written
    started, cpu = time.perf_counter(), time.process_time()
    readings = await store.read(POOL)
    if POOL not in store.targets:
        await store.load_written(POOL)
    outcome = planner.plan(PoolInputs(pool=POOL, now=datetime.now(UTC), revisions=revs, reports=readings.reports,
                                      rates=readings.rates, counters=readings.counters,
                                      previous_targets=store.written_targets(POOL)),
                           id(revs), readings.report_versions)
    plan = outcome.plan
    if outcome.reused or outcome.delta or outcome.decided is not None:
        await store.check(POOL)  # the level-triggered repair where cheap (the controller's ``_repair``)
    else:
        await store.repair(POOL)
    if not outcome.reused and not outcome.delta:  # a few revisions placed again: target states only
        await store.write_routes(POOL, plan.routes, plan.base_model, plan.placement.staging)
    if not outcome.reused:
        await store.write_targets(POOL, plan.targets)
    how = ("reused" if outcome.reused else "placement delta" if outcome.delta
           else "part" if outcome.decided is not None else "full")
    return _Run(time.perf_counter() - started, time.process_time() - cpu, store.writes - writes,
                store.bytes_written - written, plan, how)


def _with_statuses(revs: list[AdapterRevision], plan: PoolPlan) -> list[AdapterRevision]:
    """The revisions as the API server holds them after the controller patched their statuses."""
    statuses = {name: rp.status for outcome in plan.adapters.values() for name, rp in outcome.revisions.items()}
    return [r.model_copy(update={"status": statuses[r.metadata.name]}) for r in revs]


async def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        server = start_redis(Path(tmp))
        client = aioredis.from_url(server.url)
        try:
            static = await _static(args, client)
            await client.flushdb()
            clear_target_cache()  # the live half's controller starts as a process would: without the first's objects
            gc.collect()
            live = {} if args.no_live else await controller_live.run(args, server.url, Path(tmp))
        finally:
            await client.aclose()
            server.stop()
    return {**static, **live}


async def _static(args: argparse.Namespace, client: aioredis.Redis) -> dict[str, Any]:
    """The planned pool's figures (everything but the live loop's)."""
    rng = random.Random(args.seed)
    now = datetime.now(UTC)
    revs = _revisions(args.revisions, rng, now)
    rates = _rates(revs, rng, args.top_rate)
    store = RedisStore(client, time.time)
    planner = IncrementalPlanner(args.hysteresis, args.full_plan_seconds)
    await _publish(client, _reports(args.pods, None, args.gpu_slots, args.cpu_slots), rates)
    cold = await _reconcile(store, planner, revs)
    plan = cold.plan
    revs = _with_statuses(revs, plan)
    await _publish(client, _reports(args.pods, plan, args.gpu_slots, args.cpu_slots), rates)
    settle = await _reconcile(store, planner, revs)  # the statuses as patched: planned once more
    await _publish(client, _reports(args.pods, settle.plan, args.gpu_slots, args.cpu_slots), rates)
    idle = [await _reconcile(store, planner, revs) for _ in range(args.repeat)]
    before = settle.plan.placement
    changed = {n: r * (1 + rng.uniform(-args.rate_change, args.rate_change)) for n, r in rates.items()}
    await _publish(client, _reports(args.pods, idle[-1].plan, args.gpu_slots, args.cpu_slots), changed)
    change = await _reconcile(store, planner, revs)
    after_plan = change.plan
    # single changes that must be planned and written: one adapter's traffic grows tenfold (its placement
    # grows), then a new adapter with traffic joins the pool (a new stable revision: placed and routed)
    hot = revs[len(revs) // 2].served_name
    changed[hot] *= 10
    await _publish(client, _reports(args.pods, after_plan, args.gpu_slots, args.cpu_slots), changed)
    spike = await _reconcile(store, planner, revs)
    revs = [*revs, *_revisions(1, rng, now, first=args.revisions)]
    changed[revs[-1].served_name] = changed[hot] / 10
    await _publish(client, _reports(args.pods, spike.plan, args.gpu_slots, args.cpu_slots), changed)
    added = await _reconcile(store, planner, revs)
    max_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    fresh = _fresh_placement(after_plan)
    return {
        "revisions": args.revisions,
        "pods": args.pods,
        "gpu_slots_per_pod": args.gpu_slots,
        "cpu_slots_per_pod": args.cpu_slots,
        "reconcile_s": round(change.wall_s, 4),
        "reconcile_cpu_s": round(change.cpu_s, 4),
        "redis_writes": change.writes,
        "rate_change_replanned": not change.reused,
        "cold_reconcile_s": round(cold.wall_s, 4),
        "cold_reconcile_cpu_s": round(cold.cpu_s, 4),
        "cold_redis_writes": cold.writes,
        "cold_redis_bytes": cold.bytes,
        "idle_reconcile_s": round(statistics.median(r.wall_s for r in idle), 4),
        "idle_reconcile_cpu_s": round(statistics.median(r.cpu_s for r in idle), 4),
        "idle_redis_writes": sum(r.writes for r in idle),
        "spike_reconcile_cpu_s": round(spike.cpu_s, 4),
        "spike_planned": spike.how,
        "spike_redis_writes": spike.writes,
        "spike_redis_bytes": spike.bytes,
        "new_revision_reconcile_cpu_s": round(added.cpu_s, 4),
        "new_revision_planned": added.how,
        "new_revision_redis_writes": added.writes,
        "new_revision_redis_bytes": added.bytes,
        "redis_bytes_per_change": max(spike.bytes, added.bytes),
        "max_rss_mb": round(max_rss_mb, 1),
        "rate_change": args.rate_change,
        "rate_hysteresis": args.hysteresis,
        "churn_adapters_moved": gpu_loads(before, after_plan.placement),
        "churn_minimum": minimum_gpu_loads(before, fresh),
        "gpu_replicas": sum(len(p) for p in after_plan.placement.replicas(Tier.GPU).values()),
    }


def _fresh_placement(plan: PoolPlan) -> Placement:
    """The from-scratch placement for the same demands (the reference for the churn minimum)."""
    return place(plan.capacity, plan.demands)


def main(argv: Sequence[str] | None = None) -> int:
    """``loraplane bench controller [--json]``."""
    p = argparse.ArgumentParser(prog="loraplane bench controller", description=__doc__.splitlines()[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--json", action="store_true", help="print one JSON object (the default output too)")
    p.add_argument("--revisions", type=int, default=1000, help="stable AdapterRevisions in the planned pool")
    p.add_argument("--pods", type=int, default=50, help="pods reporting in that pool")
    p.add_argument("--gpu-slots", type=int, default=8, help="GPU adapter slots per pod")
    p.add_argument("--cpu-slots", type=int, default=32, help="host-memory adapter slots per pod")
    p.add_argument("--top-rate", type=float, default=200.0, help="requests/s of the most popular adapter")
    p.add_argument("--rate-change", type=float, default=0.10, help="largest relative rate change in the churn reconcile")
    p.add_argument("--repeat", type=int, default=3, help="idle reconciles to time")
    p.add_argument("--seed", type=int, default=1, help="seed of the rates")
    p.add_argument("--hysteresis", type=float, default=DEFAULT_HYSTERESIS,
                   help="relative rate change that plans the pool again (the controller's --rate-hysteresis)")
    p.add_argument("--full-plan-seconds", type=float, default=DEFAULT_FULL_PLAN_SECONDS,
                   help="a pool at rest is planned again at least this often (the controller's --full-plan-seconds)")
    controller_live.add_arguments(p)
    args = p.parse_args(argv)
    print(json.dumps(asyncio.run(run(args))))
    return 0
