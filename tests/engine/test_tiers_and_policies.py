"""Adapter tiers: eviction policies on a hot-set + burst trace, protection of busy and pinned adapters, slot limits."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from loraplane.api import Tier
from loraplane.engine.adapters import AdapterFiles, parse_adapter
from loraplane.engine.app import EngineOptions, build
from loraplane.engine.core import Engine, Request, SamplingParams
from loraplane.engine.model import PRESETS, LlamaModel, seeded_weights
from loraplane.engine.policies import KeepScorePolicy, LruPolicy
from loraplane.engine.tiers import AdapterState, AdapterTiers
from loraplane.kernels.peft import PeftAdapter
from tests.engine.helpers import GeneratedAdapter, completion, inprocess


class FakeClock:
    """Unix seconds that move only when told."""

    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


async def _hot_set_then_burst(policy: str, adapters: list[GeneratedAdapter]) -> dict[str, Tier]:
    clock = FakeClock()
    hot, cold = adapters[:2], adapters[2:10]
    options = EngineOptions(max_loras=2, max_cpu_loras=4, eviction_policy=policy,
                            lora_modules={a.name: a.path for a in hot + cold})
    async with inprocess(options, wall_clock=clock) as (built, http):
        for _ in range(6):  # the hot set: steady traffic
            for adapter in hot:
                assert (await http.post("/v1/completions", json=completion(adapter.name, "hot", 2))).status_code == 200
                clock.now += 2
        for adapter in cold:  # a burst of one-off adapters
            assert (await http.post("/v1/completions", json=completion(adapter.name, "cold", 2))).status_code == 200
            clock.now += 2
        return {a.name: built.engine.tiers.registered[a.name].tier for a in hot}


async def test_keep_score_keeps_the_hot_set_through_a_burst_and_lru_does_not(
    tiny_adapters: list[GeneratedAdapter],
) -> None:
    lru = await _hot_set_then_burst("lru", tiny_adapters)
    keep = await _hot_set_then_burst("keep-score", tiny_adapters)
    assert set(lru.values()) == {Tier.DISK}, lru
    assert all(tier in (Tier.GPU, Tier.CPU) for tier in keep.values()), keep


def test_keep_score_ranks_frequency_priority_and_fresh_loads() -> None:
    policy = KeepScorePolicy()
    now = 10_000.0

    def state(name: str, hits: int, idle: float, priority: int = 0, age: float = 100.0) -> AdapterState:
        return AdapterState(name=name, path=Path(name), digest="", disk_bytes=0, hits=hits, last_access=now - idle,
                            priority=priority, tier_since=now - age)

    hot, one_off = state("hot", hits=20, idle=30), state("one-off", hits=1, idle=1)
    assert policy.victim([hot, one_off], now) is one_off
    assert LruPolicy().victim([hot, one_off], now) is hot
    gold = state("gold", hits=1, idle=1, priority=10)
    assert policy.victim([gold, one_off], now) is one_off
    fresh, settled = state("fresh", hits=1, idle=1, age=0.5), state("settled", hits=1, idle=1)
    assert policy.victim([fresh, settled], now) is settled


@pytest.fixture
def tiers_and_weights(tiny_adapters: list[GeneratedAdapter]) -> tuple[AdapterTiers, list[tuple[AdapterState, PeftAdapter]]]:
    config = PRESETS["tiny"]
    model = LlamaModel(config, seeded_weights(config, 0), max_loras=1, max_lora_rank=16)
    tiers = AdapterTiers(model, max_loras=1, max_cpu_loras=2, max_lora_rank=16, policy=LruPolicy(), clock=FakeClock())
    loaded = []
    for adapter in tiny_adapters[:4]:
        files = AdapterFiles.read(adapter.path)
        state = AdapterState(adapter.name, adapter.path, files.digest, len(files.weights))
        loaded.append((state, parse_adapter(files, config, 16)))
    return tiers, loaded


def test_busy_and_pinned_adapters_are_never_evicted(tiers_and_weights: tuple[AdapterTiers, list]) -> None:
    tiers, loaded = tiers_and_weights
    (a, _), (b, _), (c, wc), (d, wd) = loaded
    for state, weights in loaded[:2]:
        tiers.register(state)
        tiers.insert_host(state, weights, 0.01)
    tiers.acquire(a)
    assert tiers.activate(a)
    tiers.pin(b)
    tiers.register(c)
    tiers.insert_host(c, wc, 0.01)  # nothing evictable: the cache holds 3 > 2 for now
    assert [s.tier for s in (a, b, c)] == [Tier.GPU, Tier.CPU, Tier.CPU]
    assert not tiers.activate(c)  # the only slot serves a request in flight
    tiers.release(a)  # a is idle again: the cache trims back to capacity, evicting a (b is pinned, c is new)
    assert (a.tier, b.tier, c.tier) == (Tier.DISK, Tier.CPU, Tier.CPU)
    assert a.evictions == 1 and b.evictions == 0
    tiers.register(d)
    tiers.insert_host(d, wd, 0.01)
    assert (b.tier, c.tier, d.tier) == (Tier.CPU, Tier.DISK, Tier.CPU)


def test_unloading_a_busy_adapter_frees_it_when_its_last_request_ends(tiers_and_weights: tuple[AdapterTiers, list]) -> None:
    tiers, loaded = tiers_and_weights
    (a, wa) = loaded[0]
    tiers.register(a)
    tiers.insert_host(a, wa, 0.01)
    tiers.acquire(a)
    assert tiers.activate(a)
    tiers.unregister(a.name)
    assert a.tier is Tier.GPU and a.name not in tiers.registered  # still serving its request
    tiers.release(a)
    assert a.tier is Tier.DISK and tiers.slots == [None] and tiers.host == []
    assert all(rank == 0 for linear in tiers.model.lora_linears() for rank in linear.slots.ranks)


async def test_a_step_never_holds_more_adapters_than_slots(tiny_adapters: list[GeneratedAdapter]) -> None:
    adapters = tiny_adapters[:6]
    options = EngineOptions(max_loras=2, max_cpu_loras=3, lora_modules={a.name: a.path for a in adapters})
    distinct_per_step: list[int] = []
    built = build(options)
    forward = built.engine.model.forward

    def recording_forward(*args: object, **kwargs: object) -> object:
        plan = args[3]
        distinct_per_step.append(len({int(s) for s in plan.token_slots.tolist() if s >= 0}))  # type: ignore[attr-defined]
        return forward(*args, **kwargs)  # type: ignore[arg-type]

    built.engine.model.forward = recording_forward  # type: ignore[method-assign,assignment]
    async with built.app.router.lifespan_context(built.app):
        submitted = [built.engine.submit([256, 72, 105], SamplingParams(max_tokens=4, temperature=0),
                                         built.engine.tiers.registered[a.name]) for a in adapters * 2]
        finals = await asyncio.gather(*[_drain(built.engine, r) for r in submitted])
    assert all(reason in ("stop", "length") for reason in finals)
    assert distinct_per_step and max(distinct_per_step) <= 2
    assert max(distinct_per_step) == 2  # the slots were actually shared within steps


async def _drain(engine: Engine, request: Request) -> str | None:
    reason = None
    async for event in engine.stream(request):
        reason = event.finish_reason
    return reason
