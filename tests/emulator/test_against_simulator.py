"""The emulator's engine against the simulator (``loraplane.sim.cluster.Simulator``): one pod, a trivial router,
vLLM's LRU eviction (the engine's ``lru`` policy, as the simulator's baselines run), one profile.

The emulator reproduces vLLM 0.32's scheduler, KV blocks and LoRA caches and is held to real vLLM (the vLLM driver's
tests run against both), so it is the simulator's reference: on every trace here each request's TTFT is the
simulator's to the nanosecond. Besides the base case (loads from disk and from host memory, chunked prefill), each
trace exercises one place where the simulator used to part from vLLM, and each fails on the simulator from before:

- several GPU slots over many adapters: vLLM's worker touches every adapter of the batch at every step (both LRU
  caches), so an idle adapter ranks by the last step that ran it, not by its last admission;
- a step budget that decode tokens exhaust: every scheduled token counts, a running request's decode included, and
  requests the budget does not reach make no token that step;
- a waiting queue longer than the 128 requests the simulator used to look at: vLLM scans it whole;
- KV pressure: a request is admitted when its prompt's blocks are free and takes a block as its sequence crosses a
  block boundary; with none free the most recently admitted running request (``priority``: the lowest priority, then
  the latest) is preempted and prefilled again later (finding its blocks still cached where not reused since);
- loads between steps (a sidecar's ``load_lora_adapter``): vLLM's activation evicts the least recently touched copy
  even when its requests run, and the next step brings the batch back in its order, each reload evicting the next.
"""

from __future__ import annotations

import math
import random
from array import array
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import pytest

from loraplane.emulator.engine import Engine, EngineConfig, LoadTicket, Request, _Plan
from loraplane.engine.policies import LruPolicy
from loraplane.sim.baselines import RoundRobin
from loraplane.sim.cluster import SimConfig, SimResult, Simulator
from loraplane.sim.policies import EngineEviction
from loraplane.sim.profile import LARGE_GPU, Profile
from loraplane.sim.trace import Adapter, Tenant, Trace
from tests.emulator.conftest import lora

PROFILE = replace(LARGE_GPU, max_batched_tokens=1_000_000, long_prefill_token_threshold=512)
MAX_LORAS, MAX_CPU_LORAS, ADAPTERS = 1, 3, 5


@dataclass(frozen=True)
class Case:
    """One pod's settings and the trace's shape."""

    max_loras: int = MAX_LORAS
    max_cpu_loras: int = MAX_CPU_LORAS
    adapters: int = ADAPTERS
    requests: int = 300
    rate: float = 3.0
    prompts: tuple[int, ...] = (20, 200, 900, 3000)
    max_output: int = 200
    profile: Profile = PROFILE
    #: vLLM's ``--scheduling-policy priority``: requests of two tenants, priority 0 and 1 (lower first)
    priority: bool = False
    #: adapters no request names, each registered (``load_lora_adapter``) at its own time during the trace
    registrations: int = 0
    #: also register while the pod runs nothing (else only registrations due while requests run are made)
    idle_registrations: bool = False
    #: registrations come in bursts of this many, 10 ms apart
    burst: int = 1


@dataclass
class Observed:
    """What the emulator did besides its TTFTs."""

    ttft: list[float]
    engine: Engine
    #: steps that spent the whole budget with requests waiting, more than half of it on decode tokens
    decode_filled: int = 0
    longest_queue: int = 0
    chunked: list[Request] = field(default_factory=list)
    #: the registrations made, (trace time, adapter): those due while requests ran (on an idle pod vLLM's load
    #: stalls nothing the simulator counts)
    registered: list[tuple[float, int]] = field(default_factory=list)
    #: the engine's GPU loads and running evictions once the trace began
    loads: int = 0
    running_evictions: int = 0


def make_trace(case: Case, seed: int) -> Trace:
    rng = random.Random(seed)
    arrival, adapter, prompt, output, tenant = [], [], [], [], []
    now = 0.0
    for _ in range(case.requests):
        now += rng.expovariate(case.rate)
        arrival.append(now)
        adapter.append(rng.randrange(case.adapters))
        prompt.append(rng.choice(case.prompts))
        output.append(rng.randint(1, case.max_output))
        tenant.append(rng.randrange(2) if case.priority else 0)
    adapters = [Adapter(f"a{i}@v1", 0, case.profile.default_adapter_bytes)
                for i in range(case.adapters + case.registrations)]
    tenants = [Tenant("gold"), Tenant("batch")] if case.priority else [Tenant("t")]
    return Trace("emulator-vs-sim", tenants, adapters, arrival, adapter, tenant, prompt, output)


def emulate(case: Case, trace: Trace, seed: int, start: float = 100.0,
            registrations: Sequence[tuple[float, int]] = ()) -> tuple[Observed, list[int], set[int]]:
    """Every request of ``trace`` through the emulator's engine (the requested adapters registered first, as vLLM
    registers them: each load reads it and takes a GPU slot; then each of ``registrations``, (trace time, adapter),
    that falls while requests run); also returns its host cache (least recently used first) and GPU slots as the
    first loads left them."""
    p = case.profile
    engine = Engine(EngineConfig(max_loras=case.max_loras, max_cpu_loras=case.max_cpu_loras,
                                 max_num_seqs=p.max_num_seqs, max_num_batched_tokens=p.max_batched_tokens,
                                 max_model_len=100_000, long_prefill_token_threshold=p.long_prefill_token_threshold,
                                 priority_policy=case.priority), p)
    loras = [lora(a.name, i + 1, a.nbytes) for i, a in enumerate(trace.adapters)]
    for adapter in loras[:case.adapters]:
        engine.load(LoadTicket(adapter), 0.0)
    engine.advance(math.inf)
    host, active = [i - 1 for i in engine.cache.host], {i - 1 for i in engine.cache.active}
    observed = Observed([], engine)
    setup_loads = sum(engine.stats.lora_loads.values())
    due = deque(registrations)
    schedule = engine._schedule

    def recording(now: float) -> _Plan:
        plan = schedule(now)
        observed.chunked.extend(req for req, n in plan.batch if req.computed + n < req.num_tokens)
        decodes = sum(n for req, n in plan.batch if not req.in_prefill)
        spent = sum(n for _, n in plan.batch)
        if spent == p.max_batched_tokens and 2 * decodes > spent and engine.waiting:
            observed.decode_filled += 1
        return plan

    engine._schedule = recording  # type: ignore[method-assign]
    begin, held = engine._begin, []

    def sidecar_gate(now: float) -> None:
        """The sidecar holds a load while every GPU slot runs requests (``SLOTS_BUSY_WAIT_S``), as the simulator's
        pod does, looking at each step boundary."""
        running = {req.lora.int_id for req in engine.running if req.lora is not None}
        if len(engine.cache.active) >= case.max_loras and running.issuperset(engine.cache.active):
            held.extend(engine._loads)
            engine._loads = []
        else:
            engine._loads[:0] = held
            held.clear()
        begin(now)

    engine._begin = sidecar_gate  # type: ignore[method-assign]
    rng = random.Random(seed)
    requests = []
    for i in range(len(trace)):
        while due and due[0][0] <= trace.arrival[i]:
            at, adapter = due.popleft()
            engine.advance(start + at)
            if engine.running or case.idle_registrations:
                engine.load(LoadTicket(loras[adapter]), start + at)
                observed.registered.append((at, adapter))
        prompt = [rng.randrange(4096) for _ in range(trace.input_tokens[i])]  # no prefix shared: no cache hits
        req = Request(str(i), prompt, trace.output_tokens[i], loras[trace.adapter[i]], "x",
                      priority=trace.tenant[i])
        engine.add_request(req, start + trace.arrival[i])
        observed.longest_queue = max(observed.longest_queue, len(engine.waiting))
        requests.append(req)
    engine.advance(math.inf)
    assert all(req.finish_reason == "length" for req in requests)
    observed.ttft = [req.first_token_at - req.received for req in requests]
    observed.loads = sum(engine.stats.lora_loads.values()) - setup_loads
    observed.running_evictions = engine.stats.running_evictions
    return observed, host, active


@dataclass
class Registrations:
    """A placement on the simulator's clock that registers each adapter at its time, (trace time, adapter), with
    the one pod, as a vLLM pod's sidecar does (``Simulator.register``: a load between steps)."""

    due: deque[tuple[float, int]]
    period_s: float = 1.0

    def apply(self, now: float, sim: Simulator) -> float | None:
        while self.due and self.due[0][0] <= now:
            sim.register(sim.pods[0], self.due.popleft()[1])
        return self.due[0][0] - now if self.due else None


def simulate(case: Case, trace: Trace, host: list[int], active: set[int], profile: Profile | None = None,
             registrations: Sequence[tuple[float, int]] = ()) -> SimResult:
    """The trace through the simulator, its pod starting where the emulator's loads left vLLM's caches; a vLLM pod
    behind a sidecar (it serves the registered adapters) when ``registrations`` come."""
    profile = profile or case.profile
    sim = Simulator(trace, SimConfig(pods=1, max_loras=case.max_loras, max_cpu_loras=case.max_cpu_loras), profile,
                    RoundRobin(-1), EngineEviction(LruPolicy(), trace, profile),
                    Registrations(deque(registrations)) if registrations else None,
                    priority=array("q", trace.tenant) if case.priority else None)
    pod = sim.pods[0]
    if registrations:
        pod.registered = set(range(case.adapters))
    pod.cpu = set(host)
    pod.gpu = set(active)
    for rank, adapter in enumerate(host):  # same copies, same LRU order
        pod.touch(adapter, -1.0 + rank / 1000)
    return sim.run()


def agree(case: Case, seed: int) -> tuple[Observed, SimResult]:
    trace = make_trace(case, seed)
    every = trace.arrival[-1] / (case.registrations // case.burst + 1)
    observed, host, active = emulate(case, trace, seed,
                                     registrations=[((k // case.burst + 1) * every + k % case.burst * 0.01,
                                                     case.adapters + k) for k in range(case.registrations)])
    result = simulate(case, trace, host, active, registrations=observed.registered)
    assert observed.ttft == pytest.approx(list(result.ttft), abs=1e-9)
    assert result.preemptions == observed.engine.stats.preemptions
    return observed, result


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_ttft_equals_the_simulators(seed: int) -> None:
    observed, _ = agree(Case(), seed)
    stats = observed.engine.stats
    assert stats.lora_loads["cpu"] > 0 and stats.lora_loads["disk"] > ADAPTERS  # host and disk loads
    assert observed.chunked and stats.preemptions == 0


#: three GPU slots and five host copies over eight adapters, a few requests at a time: idle adapters compete for
#: slots by recency
LRU = Case(max_loras=3, max_cpu_loras=5, adapters=8, requests=400, rate=2.0)


@pytest.mark.parametrize("seed", [0, 1])
def test_lru_recency_is_the_last_step_that_ran_an_adapter(seed: int) -> None:
    observed, result = agree(LRU, seed)
    stats = observed.engine.stats
    assert stats.lora_loads["cpu"] > 40 and stats.lora_loads["disk"] > 100 and result.gpu_evictions > 150


#: a 96-token budget under a crowd of long answers: the running requests' decode tokens fill it while requests wait
BUDGET = Case(max_loras=2, max_cpu_loras=4, adapters=3, requests=400, rate=40.0, prompts=(8, 40, 150),
              max_output=300, profile=replace(PROFILE, max_batched_tokens=96, long_prefill_token_threshold=0))


@pytest.mark.parametrize("seed", [0, 1])
def test_decode_tokens_count_against_the_step_budget(seed: int) -> None:
    observed, _ = agree(BUDGET, seed)
    assert observed.decode_filled > 300 and observed.longest_queue > 100
    assert observed.engine.stats.preemptions == 0


#: an overloaded pod of eight sequences and one GPU slot: hundreds wait, most of them skipped at every step
LONG_QUEUE = Case(max_loras=1, max_cpu_loras=2, adapters=3, requests=600, rate=40.0, prompts=(20, 200),
                  max_output=60, profile=replace(PROFILE, max_num_seqs=8))


def test_the_whole_waiting_queue_is_scanned() -> None:
    observed, _ = agree(LONG_QUEUE, 3)
    assert observed.longest_queue > 300  # well past the 128 the simulator used to look at


#: KV for 6,400 tokens (400 blocks) under prompts up to 1,500 tokens with answers up to 600
KV = Case(max_loras=2, max_cpu_loras=4, adapters=4, requests=300, rate=4.0, prompts=(100, 700, 1500),
          max_output=600, profile=replace(PROFILE, kv_capacity_tokens=6400))


@pytest.mark.parametrize("priority", [False, True])
def test_kv_pressure_preempts_as_vllm_does(priority: bool) -> None:
    observed, _ = agree(replace(KV, priority=priority), 4)
    assert observed.engine.stats.preemptions > 200


def test_request_overhead_is_in_every_ttft_of_both_on_an_idle_pod() -> None:
    """The profile's ``request_overhead_ms``: the emulator holds a request that long before its scheduler, the
    simulator adds it to the TTFT -- the same figure whenever the pod is idle when the request comes."""
    case = Case(requests=40, profile=replace(PROFILE, request_overhead_ms=25.0))
    trace = make_trace(case, 5)
    trace.arrival[:] = [10.0 * i for i in range(len(trace))]  # each request alone on the pod
    observed, host, active = emulate(case, trace, 5)
    ttft = list(simulate(case, trace, host, active).ttft)
    assert observed.ttft == pytest.approx(ttft, abs=1e-9)
    without = list(simulate(case, trace, host, active, PROFILE).ttft)
    assert [a - b for a, b in zip(ttft, without, strict=True)] == pytest.approx([0.025] * len(trace))


#: three GPU slots always busy with four adapters' requests, and forty new adapters registered while they run
REGISTER = Case(max_loras=3, max_cpu_loras=8, adapters=4, requests=400, rate=4.0, registrations=40)


@pytest.mark.parametrize("seed", [0, 2])
def test_a_load_between_steps_evicts_by_touch_order_and_the_next_step_brings_the_batch_back(seed: int) -> None:
    """Seed 2 also has a load from disk whose host-cache victim is a running adapter's copy (it leaves its GPU slot
    too, and the next step reads it from disk again)."""
    observed, result = agree(REGISTER, seed)
    assert len(observed.registered) > 30 and observed.running_evictions > 10
    assert (result.gpu_loads, result.running_evictions) == (observed.loads, observed.running_evictions)



IDLE_REGISTER = Case(max_loras=2, max_cpu_loras=8, adapters=4, requests=400, rate=1.0, registrations=60,
                     idle_registrations=True, burst=2)


@pytest.mark.parametrize("seed", [0, 1])
def test_a_load_on_an_idle_pod_holds_its_next_step_and_is_the_most_recently_touched(seed: int) -> None:
    """Registrations in pairs, on an idle pod too: vLLM's engine makes a load before its next step (a request that
    arrives meanwhile waits for it), and the registered copy is the most recently touched (the next registration
    evicts the last step's batch first)."""
    observed, result = agree(IDLE_REGISTER, seed)
    assert len(observed.registered) == IDLE_REGISTER.registrations
    assert (result.gpu_loads, result.running_evictions) == (observed.loads, observed.running_evictions)
