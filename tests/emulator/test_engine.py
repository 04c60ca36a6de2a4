"""The emulated engine core on a virtual clock: vLLM's scheduler (budget, LoRA slots, priority, preemption), its
KV blocks and prefix cache, its worker LoRA caches, and time charged from the profile in runs of identical steps."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from loraplane.api import Tier
from loraplane.emulator.engine import Engine, EngineConfig, LoadTicket, Request, Status
from loraplane.emulator.lora_cache import Lora
from loraplane.emulator.tokens import expected_tokens
from loraplane.sim.profile import LARGE_GPU
from tests.emulator.conftest import lora, small_profile

P = LARGE_GPU


def request(rid: str, prompt: int | list[int], max_tokens: int, adapter: Lora | None = None, priority: int = 0,
            stream: bool = False) -> Request:
    ids = [hash((rid, i)) % 4096 for i in range(prompt)] if isinstance(prompt, int) else prompt
    return Request(rid, ids, max_tokens, adapter, adapter.files.digest if adapter else "base", priority=priority,
                   stream=stream)


def step_ms(batch: int, adapters: int, prefill: int = 0, loads: float = 0.0) -> float:
    return P.decode_step_ms(batch, adapters) + P.prefill_per_token_ms * prefill + loads


def test_one_request_costs_its_prefill_step_then_one_step_per_token_in_one_run() -> None:
    engine = Engine(EngineConfig(), P)
    begins = 0
    original = engine._begin

    def counting(now: float) -> None:
        nonlocal begins
        begins += 1
        original(now)

    engine._begin = counting  # type: ignore[method-assign]
    req = request("r", 100, 1000)
    engine.add_request(req, 0.0)
    engine.advance(math.inf)
    first = step_ms(1, 0, prefill=100) / 1e3
    assert req.first_token_at == pytest.approx(first)
    assert req.finished_at == pytest.approx(first + 999 * step_ms(1, 0) / 1e3)
    assert req.output == 1000 and req.finish_reason == "length"
    assert begins <= 3  # the first step, one run of 999 identical steps, the idle boundary: not a wake per token
    assert engine.stats.generation_tokens == 1000 and engine.stats.itl.count == 999


def test_loads_by_tier_stall_the_step_and_lru_keeps_the_most_recently_served() -> None:
    engine = Engine(EngineConfig(max_loras=1, max_cpu_loras=2), P)
    a, b, c = lora("a", 1), lora("b", 2), lora("c", 3)
    for ticket in (LoadTicket(a), LoadTicket(b), LoadTicket(c)):  # registered: c in the slot, b in host memory
        engine.load(ticket, 0.0)
    engine.advance(10.0)
    assert [engine.cache.tier(x.int_id) for x in (a, b, c)] == [Tier.DISK, Tier.CPU, Tier.GPU]
    for start, (name, adapter, tier) in zip((20.0, 30.0, 40.0), (("on-gpu", c, Tier.GPU), ("on-host", b, Tier.CPU),
                                                                  ("on-disk", a, Tier.DISK)), strict=True):
        req = request(name, 10, 2, adapter)
        engine.add_request(req, start)
        engine.advance(start + 5.0)
        load = P.load_ms(tier, adapter.nbytes)
        assert req.first_token_at - req.arrival == pytest.approx(step_ms(1, 1, 10, load) / 1e3), name
    # a from disk pushed out c, the least recently served host copy
    assert [engine.cache.tier(x.int_id) for x in (a, b, c)] == [Tier.GPU, Tier.CPU, Tier.DISK]
    assert engine.stats.lora_loads == {"cpu": 1, "disk": 4}
    assert engine.stats.lora_api_loads == 3  # the three registrations; the requests made the other two


def test_every_step_touches_its_adapters_so_the_last_served_not_the_last_admitted_stays() -> None:
    """vLLM's LRUCacheWorkerLoRAManager touches the batch's adapters at every step: a long request admitted first
    keeps its adapter more recent than a short one admitted later."""
    engine = Engine(EngineConfig(max_loras=2, max_cpu_loras=2), P)
    a, b, c = lora("a", 1), lora("b", 2), lora("c", 3)
    long_a, short_b = request("long", 10, 500, a), request("short", 10, 2, b)
    engine.add_request(long_a, 0.0)
    engine.add_request(short_b, 0.5)
    engine.advance(20.0)
    assert long_a.finished and short_b.finished and short_b.finished_at < long_a.finished_at
    engine.add_request(request("c", 10, 2, c), 30.0)
    engine.advance(40.0)
    assert engine.cache.tier(a.int_id) is Tier.GPU and engine.cache.tier(b.int_id) is Tier.DISK


def test_decode_tokens_take_their_share_of_the_step_budget() -> None:
    """vLLM counts every scheduled token against max_num_batched_tokens, a decode's one included: a prompt that
    arrives while two requests decode gets the budget less two."""
    engine = Engine(EngineConfig(max_num_batched_tokens=64), P)
    for rid in ("x", "y"):
        engine.add_request(request(rid, 8, 100), 0.0)
    engine.advance(0.1)
    late = request("late", 200, 5)
    engine.add_request(late, 0.1)
    while not late.computed:
        engine.advance(engine.next_due())
    assert late.computed == 62


def test_long_prefill_threshold_chunks_a_prompt_when_others_are_eligible() -> None:
    engine = Engine(EngineConfig(long_prefill_token_threshold=100), P)
    alone = request("alone", 250, 1)
    engine.add_request(alone, 0.0)
    engine.advance(engine.next_due())
    assert alone.computed == 250  # the only eligible request: no cap
    engine.advance(1.0)
    engine.add_request(request("decoding", 10, 1000), 2.0)
    engine.advance(2.1)
    chunked = request("chunked", 250, 1)
    engine.add_request(chunked, 2.1)
    progress = []
    while chunked.output == 0:
        engine.advance(engine.next_due())
        progress.append(chunked.computed)
    assert sorted(set(progress)) == [0, 100, 200, 250]


def test_max_loras_skips_requests_of_other_adapters_and_they_overtake() -> None:
    engine = Engine(EngineConfig(max_loras=1, max_cpu_loras=2), P)
    a, b = lora("a", 1), lora("b", 2)
    first, other, same = request("first", 10, 50, a), request("other", 10, 5, b), request("same", 10, 5, a)
    engine.add_request(first, 0.0)
    engine.add_request(other, 0.001)
    engine.add_request(same, 0.002)
    engine.advance(math.inf)
    assert same.first_token_at < first.finished_at <= other.first_token_at


def test_priority_policy_admits_by_priority_then_arrival() -> None:
    engine = Engine(EngineConfig(max_num_seqs=1, priority_policy=True), P)
    hog = request("hog", 10, 100, priority=5)
    engine.add_request(hog, 0.0)
    late = [request(f"p{p}-{i}", 10, 1, priority=p) for i, p in enumerate((3, 1, 3, 1))]
    for i, req in enumerate(late):
        engine.add_request(req, 0.01 + i * 0.001)
    engine.advance(math.inf)
    order = sorted(late, key=lambda r: r.first_token_at or 0)
    assert [r.request_id for r in order] == ["p1-1", "p1-3", "p3-0", "p3-2"]
    assert hog.first_token_at < order[0].first_token_at  # a waiting request never preempts a running one


def test_fcfs_ignores_priority() -> None:
    engine = Engine(EngineConfig(max_num_seqs=1), P)
    engine.add_request(request("hog", 10, 100), 0.0)
    late = [request(f"r{i}", 10, 1, priority=-i) for i in range(3)]
    for i, req in enumerate(late):
        engine.add_request(req, 0.01 + i * 0.001)
    engine.advance(math.inf)
    assert sorted(late, key=lambda r: r.first_token_at or 0) == late


@pytest.mark.parametrize("priority_policy", [False, True])
def test_kv_pressure_preempts_and_the_victim_recomputes(priority_policy: bool) -> None:
    """Five free blocks of 16 tokens: two requests of 20 prompt tokens (2 blocks each) grow until one needs a
    block that is not there; vLLM preempts the most recently admitted one (fcfs) or the one of the highest
    (priority, arrival) -- here the first, given priority 9 -- which then waits at the front and prefills again."""
    engine = Engine(EngineConfig(priority_policy=priority_policy, block_size=16),
                    small_profile(kv_capacity_tokens=80))
    first, second = request("first", 20, 40, priority=9), request("second", 20, 40, priority=0)
    engine.add_request(first, 0.0)
    engine.add_request(second, 0.0001)
    engine.advance(math.inf)
    victim = first if priority_policy else second
    survivor = second if priority_policy else first
    assert engine.stats.preemptions >= 1 and victim.preemptions >= 1 and survivor.preemptions == 0
    assert first.output == second.output == 40 and first.finished and second.finished
    assert victim.finished_at > survivor.finished_at
    assert engine.stats.ttft.count == 2  # a recompute is no new first token
    assert engine.pool.num_free == engine.pool.num_blocks


def test_prefix_cache_hits_only_the_same_adapter_name_and_charges_only_new_tokens() -> None:
    engine = Engine(EngineConfig(max_loras=2, max_cpu_loras=2, block_size=16), P)
    a, b = lora("a", 1), lora("b", 2)
    prompt = list(range(40))
    cold, warm, other = request("cold", prompt, 2, a), request("warm", prompt, 2, a), request("other", prompt, 2, b)
    engine.add_request(cold, 0.0)
    engine.advance(1.0)
    engine.add_request(warm, 2.0)
    engine.advance(3.0)
    engine.add_request(other, 4.0)
    engine.advance(5.0)
    assert (cold.cached_tokens, warm.cached_tokens, other.cached_tokens) == (0, 32, 0)
    assert warm.first_token_at - warm.arrival == pytest.approx(step_ms(1, 1, 8) / 1e3)
    assert engine.stats.prefix_queries == 120 and engine.stats.prefix_hits == 32


def test_an_api_load_waits_for_the_step_boundary_and_stalls_the_next_step() -> None:
    engine = Engine(EngineConfig(max_loras=1, max_cpu_loras=1), P)
    decoding = request("decoding", 10, 1000)
    engine.add_request(decoding, 0.0)
    engine.advance(0.5)
    replied: list[float] = []
    ticket = LoadTicket(lora("a", 1), on_done=lambda: replied.append(1.0))
    engine.load(ticket, 0.5)
    assert ticket.done_at is None  # the engine finishes its step first
    boundary = engine.next_due()
    assert 0.5 <= boundary < 0.5 + step_ms(1, 0) / 1e3 + 1e-9
    engine.advance(boundary)
    load_s = P.load_ms(Tier.DISK, P.default_adapter_bytes) / 1e3
    assert ticket.done_at == pytest.approx(boundary + load_s) and not replied
    engine.advance(ticket.done_at)
    assert replied == [1.0]
    engine.advance(math.inf)
    gaps = decoding.finished_at - decoding.first_token_at
    assert gaps == pytest.approx((999 * step_ms(1, 0)) / 1e3 + load_s)


def test_abort_frees_a_running_request_at_the_next_boundary() -> None:
    engine = Engine(EngineConfig(), P)
    req = request("gone", 10, 1000)
    engine.add_request(req, 0.0)
    engine.advance(1.0)
    engine.abort(req, 1.0)
    engine.advance(1.1)
    assert req.finished and req.finish_reason == "abort" and not engine.running
    assert engine.pool.num_free == engine.pool.num_blocks and engine.next_due() == math.inf
    assert engine.stats.finished["abort"] == 1


def test_streaming_requests_get_tokens_every_stream_interval_without_a_wake_per_step() -> None:
    engine = Engine(EngineConfig(stream_interval=0.25), P)
    req = request("s", 10, 200, stream=True)
    seen: list[int] = []
    req.on_update = lambda: seen.append(req.delivered)
    engine.add_request(req, 0.0)
    wakes = 0
    while engine.next_due() < math.inf:
        wakes += 1
        engine.advance(engine.next_due())
    assert seen[0] == 1 and seen[-1] == 200 and seen == sorted(seen)
    duration = req.finished_at - req.arrival
    assert wakes <= 2 + duration / 0.25 + 1
    assert req.outputs.first(200) == expected_tokens("base", req.prompt, 200)


def test_lora_requests_info_lists_adapters_with_requests_and_stamps_the_newest() -> None:
    engine = Engine(EngineConfig(max_loras=2, max_cpu_loras=2), P)
    a, b = lora("a", 1), lora("b", 2)
    ra, rb = request("ra", 10, 50, a), request("rb", 10, 50, b)
    engine.add_request(ra, 0.0)
    engine.add_request(rb, 0.01)
    engine.advance(0.3)
    series = engine.lora_requests_series()
    assert max(series, key=series.__getitem__) == "a,b"
    engine.advance(math.inf)
    series = engine.lora_requests_series()
    assert max(series, key=series.__getitem__) == ""
    assert set(series) == {"a,b", "b", ""}  # ra finished first; "a" alone was never the list at a step's end
    assert ra.status is Status.FINISHED and ra.finished_at < rb.finished_at


def test_request_overhead_delays_each_request_before_the_scheduler_and_aborts_there_count_nothing() -> None:
    profile = replace(P, request_overhead_ms=40.0)
    engine = Engine(EngineConfig(), profile)
    first = request("first", 10, 3)
    engine.add_request(first, 1.0)
    assert engine.next_due() == pytest.approx(1.04) and not engine.waiting
    engine.advance(1.03)
    assert not engine.waiting and not engine.running  # still in the API server
    engine.advance(math.inf)
    assert first.arrival == pytest.approx(1.04) and first.received == 1.0
    assert first.first_token_at - first.received == pytest.approx(0.04 + step_ms(1, 0, 10) / 1e3)
    # a request arriving while another decodes joins the batch at the first step boundary after its overhead
    long = request("long", 10, 1000)
    engine.add_request(long, 5.0)
    late = request("late", 10, 2)
    engine.add_request(late, 5.1)
    engine.advance(5.1 + 0.039)
    assert late not in engine.waiting and late.status is Status.WAITING
    engine.advance(math.inf)
    assert late.arrival == pytest.approx(5.14) and late.first_token_at > 5.14
    assert late.finished and long.output == 1000
    gone = request("gone", 10, 2, lora("a", 1))
    engine.add_request(gone, 20.0)
    engine.abort(gone, 20.01)
    assert gone.finished and gone.finish_reason == "abort" and engine.lora_requests_series().get("a") is None
    engine.advance(math.inf)
    assert gone.first_token_at is None and engine.next_due() == math.inf


def test_a_load_between_steps_can_push_out_a_running_adapter_and_the_next_step_brings_it_back() -> None:
    """vLLM's LRU evicts the least recently touched GPU copy whether its requests run or not: with both slots
    running, a registration pushes out a running adapter, and the next step's activations bring the batch's
    adapters back, each pushing out the next oldest (counted in ``running_evictions``)."""

    def run(register: bool) -> Engine:
        engine = Engine(EngineConfig(max_loras=2, max_cpu_loras=4), P)
        a, b = lora("a", 1), lora("b", 2)
        for adapter in (a, b):
            engine.load(LoadTicket(adapter), 0.0)
        engine.advance(0.1)
        for rid, adapter in (("ra", a), ("rb", b)):
            engine.add_request(request(rid, 10, 200, adapter), 0.1)
        engine.advance(0.5)
        if register:
            engine.load(LoadTicket(lora("c", 3)), 0.5)
        engine.advance(math.inf)
        return engine

    quiet, loaded = run(register=False).stats, run(register=True).stats
    assert quiet.running_evictions == 0 and quiet.lora_loads == {"cpu": 0, "disk": 2}
    assert loaded.running_evictions == 2 and loaded.lora_loads == {"cpu": 2, "disk": 3}
