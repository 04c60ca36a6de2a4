"""The emulator's engine against the simulator (``loraplane.sim.cluster.Simulator``): one pod, a trivial router,
vLLM's LRU eviction (the engine's ``lru`` policy, as the simulator's baselines run), one profile.

On a trace of a few hundred requests over more adapters than slots -- loads from disk and from host memory, chunked
prefill -- with KV not binding, every request's TTFT is the simulator's to the nanosecond. Where the two models of
vLLM part (the simulator's own simplifications, reported in docs/emulator.md) the trace stays clear of them: prompts
are chunked by ``long_prefill_token_threshold`` under a budget they never exhaust (the simulator does not count
decode tokens against ``max_num_batched_tokens``; vLLM does), one GPU slot (the simulator ranks idle adapters by
their last admission; vLLM by the last step that served them), and its queue stays under the simulator's scan limit.
"""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest

from loraplane.emulator.engine import Engine, EngineConfig, LoadTicket, Request
from loraplane.engine.policies import LruPolicy
from loraplane.sim.baselines import RoundRobin
from loraplane.sim.cluster import SCAN_LIMIT, SimConfig, Simulator
from loraplane.sim.policies import EngineEviction
from loraplane.sim.profile import LARGE_GPU, Profile
from loraplane.sim.trace import Adapter, Tenant, Trace
from tests.emulator.conftest import lora

PROFILE = replace(LARGE_GPU, max_batched_tokens=1_000_000, long_prefill_token_threshold=512)
MAX_LORAS, MAX_CPU_LORAS, ADAPTERS = 1, 3, 5


def make_trace(requests: int, rate: float, seed: int) -> Trace:
    rng = random.Random(seed)
    arrival, adapter, prompt, output = [], [], [], []
    now = 0.0
    for _ in range(requests):
        now += rng.expovariate(rate)
        arrival.append(now)
        adapter.append(rng.randrange(ADAPTERS))
        prompt.append(rng.choice((20, 200, 900, 3000)))
        output.append(rng.randint(1, 200))
    adapters = [Adapter(f"a{i}@v1", 0, PROFILE.default_adapter_bytes) for i in range(ADAPTERS)]
    return Trace("emulator-vs-sim", [Tenant("t")], adapters, arrival, adapter, [0] * requests, prompt, output)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_ttft_equals_the_simulators(seed: int) -> None:
    trace = make_trace(300, rate=3.0, seed=seed)
    engine = Engine(EngineConfig(max_loras=MAX_LORAS, max_cpu_loras=MAX_CPU_LORAS,
                                 max_num_seqs=PROFILE.max_num_seqs, max_num_batched_tokens=PROFILE.max_batched_tokens,
                                 max_model_len=100_000, long_prefill_token_threshold=512), PROFILE)
    loras = [lora(a.name, i + 1, a.nbytes) for i, a in enumerate(trace.adapters)]
    for adapter in loras:  # registered as vLLM registers: each load reads it and takes a GPU slot
        engine.load(LoadTicket(adapter), 0.0)
    engine.advance(math.inf)
    start = 100.0

    sim = Simulator(trace, SimConfig(pods=1, max_loras=MAX_LORAS, max_cpu_loras=MAX_CPU_LORAS), PROFILE,
                    RoundRobin(-1), EngineEviction(LruPolicy(), trace, PROFILE))
    pod = sim.pods[0]  # the pod starts where the loads left the engine: same copies, same LRU order
    pod.cpu = {i - 1 for i in engine.cache.host}
    pod.gpu = {i - 1 for i in engine.cache.active}
    for rank, int_id in enumerate(engine.cache.host):
        pod.last_use[int_id - 1] = -1.0 + rank / 1000
    result = sim.run()

    chunked = []  # requests given part of their prompt in a step
    schedule = engine._schedule

    def recording(now: float):  # type: ignore[no-untyped-def]
        plan = schedule(now)
        chunked.extend(req for req, n in plan.batch if req.computed + n < req.num_tokens)
        return plan

    engine._schedule = recording  # type: ignore[method-assign]
    rng = random.Random(seed)
    requests = []
    for i in range(len(trace)):
        prompt = [rng.randrange(4096) for _ in range(trace.input_tokens[i])]  # no prefix shared: no cache hits
        req = Request(str(i), prompt, trace.output_tokens[i], loras[trace.adapter[i]], "x")
        engine.add_request(req, start + trace.arrival[i])
        requests.append(req)
        assert len(engine.waiting) < SCAN_LIMIT
    engine.advance(math.inf)

    assert engine.stats.lora_loads["cpu"] > 0 and engine.stats.lora_loads["disk"] > ADAPTERS  # host and disk loads
    assert chunked and engine.stats.preemptions == 0
    emulated = [req.first_token_at - req.arrival for req in requests]
    assert emulated == pytest.approx(list(result.ttft), abs=1e-9)


def test_request_overhead_is_in_every_ttft_of_both_on_an_idle_pod() -> None:
    """The profile's ``request_overhead_ms``: the emulator holds a request that long before its scheduler, the
    simulator adds it to the TTFT -- the same figure whenever the pod is idle when the request comes."""
    profile = replace(PROFILE, request_overhead_ms=25.0)
    trace = make_trace(40, rate=3.0, seed=5)
    trace.arrival[:] = [10.0 * i for i in range(len(trace))]  # each request alone on the pod
    engine = Engine(EngineConfig(max_loras=MAX_LORAS, max_cpu_loras=MAX_CPU_LORAS, max_model_len=100_000,
                                 long_prefill_token_threshold=512), profile)
    loras = [lora(a.name, i + 1, a.nbytes) for i, a in enumerate(trace.adapters)]
    for adapter in loras:
        engine.load(LoadTicket(adapter), 0.0)
    engine.advance(math.inf)
    host, active = list(engine.cache.host), set(engine.cache.active)

    def simulate(profile: Profile) -> list[float]:
        sim = Simulator(trace, SimConfig(pods=1, max_loras=MAX_LORAS, max_cpu_loras=MAX_CPU_LORAS), profile,
                        RoundRobin(-1), EngineEviction(LruPolicy(), trace, profile))
        pod = sim.pods[0]
        pod.cpu = {i - 1 for i in host}
        pod.gpu = {i - 1 for i in active}
        for rank, int_id in enumerate(host):
            pod.last_use[int_id - 1] = -1.0 + rank / 1000
        return list(sim.run().ttft)

    ttft = simulate(profile)
    requests = []
    for i in range(len(trace)):
        req = Request(str(i), [(i * 7919 + t) % 4096 for t in range(trace.input_tokens[i])], trace.output_tokens[i],
                      loras[trace.adapter[i]], "x")
        engine.add_request(req, 100.0 + trace.arrival[i])
        requests.append(req)
    engine.advance(math.inf)
    emulated = [req.first_token_at - req.received for req in requests]
    assert emulated == pytest.approx(ttft, abs=1e-9)
    assert [a - b for a, b in zip(ttft, simulate(PROFILE), strict=True)] == pytest.approx([0.025] * len(trace))
