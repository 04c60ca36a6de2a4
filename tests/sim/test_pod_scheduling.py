"""The simulated pod's scheduler: its waiting queue under vLLM's two scheduling policies, ``fcfs`` (the order
requests reached the pod) and ``priority`` (by ``(priority, that order)``, lower first, as vLLM's
``PriorityRequestQueue``), chunked prefill under the step's token budget, and the pods each policy runs."""

from __future__ import annotations

from dataclasses import replace

import pytest

from loraplane.sim.cluster import SimConfig, Simulator
from loraplane.sim.policies import BASELINES, LORAPLANE_MAX_BATCHED_TOKENS, build_policy, runtime_priorities
from loraplane.sim.profile import LARGE_GPU
from loraplane.sim.runner import run_all
from loraplane.sim.trace import Adapter, Tenant, Trace, scenario
from tests.sim.conftest import ADAPTER_BYTES, free_loads

ONE_POD = SimConfig(pods=1, max_loras=2, max_cpu_loras=4)
#: one request at a time: who goes next is the queue's order alone
ONE_SEQ = replace(free_loads(), max_num_seqs=1)


def queued_behind_a_long_request() -> Trace:
    """A batch request that holds the pod's only sequence slot for 200 steps, then two more batch requests and,
    last, a gold one: all four arrive while the first runs."""
    tenants = [Tenant("gold", priority=1), Tenant("batch", cls="burst", priority=-1)]
    adapters = [Adapter("gold@v1", 0, ADAPTER_BYTES), Adapter("batch@v1", 1, ADAPTER_BYTES)]
    who = [1, 1, 1, 0]
    return Trace(
        name="queued",
        tenants=tenants,
        adapters=adapters,
        arrival=[0.0, 0.001, 0.002, 0.003],
        adapter=who,
        tenant=who,
        input_tokens=[64] * 4,
        output_tokens=[200, 4, 4, 4],
    )


def admitted_order(trace: Trace, priority: bool) -> list[int]:
    policy = build_policy("round-robin", 0, trace, ONE_SEQ, ONE_POD)
    sim = Simulator(
        trace, ONE_POD, ONE_SEQ, policy.router, policy.eviction, priority=runtime_priorities(trace) if priority else None
    )  # fmt: skip
    result = sim.run()
    return list(result.admitted)


def test_fcfs_admits_in_arrival_order() -> None:
    assert admitted_order(queued_behind_a_long_request(), priority=False) == [0, 1, 2, 3]


def test_priority_admits_the_gold_request_before_earlier_batch_ones_and_ties_in_arrival_order() -> None:
    # request 0 runs already (vLLM never preempts a running request for a waiting one); then gold, then the batch
    # requests in the order they came
    assert admitted_order(queued_behind_a_long_request(), priority=True) == [0, 3, 1, 2]


def test_runtime_priorities_are_the_negated_tenant_priorities() -> None:
    trace = queued_behind_a_long_request()
    assert list(runtime_priorities(trace)) == [1, 1, 1, -1]


def test_loraplane_pods_schedule_by_priority_and_the_baselines_pods_by_arrival() -> None:
    trace = scenario("hot-plus-burst", 400, seed=0, adapter_bytes=ADAPTER_BYTES)
    config = SimConfig(pods=2)
    loraplane = build_policy("loraplane", 0, trace, LARGE_GPU, config)
    assert loraplane.priority is not None and list(loraplane.priority) == list(runtime_priorities(trace))
    assert loraplane.pod_profile is not None
    assert loraplane.pod_profile.max_batched_tokens == LORAPLANE_MAX_BATCHED_TOKENS < LARGE_GPU.max_batched_tokens
    for name in BASELINES:
        baseline = build_policy(name, 0, trace, LARGE_GPU, config)
        assert baseline.priority is None and baseline.pod_profile is None, name


@pytest.mark.parametrize("priority", [False, True])
def test_every_request_is_admitted_once_under_either_policy(priority: bool) -> None:
    trace = scenario("hot-plus-burst", 3000, seed=2, adapter_bytes=ADAPTER_BYTES)
    config = SimConfig(pods=2)
    policy = build_policy("least-request", 0, trace, LARGE_GPU, config)
    sim = Simulator(
        trace, config, LARGE_GPU, policy.router, policy.eviction, priority=runtime_priorities(trace) if priority else None
    )  # fmt: skip
    result = sim.run()
    assert sorted(result.admitted) == list(range(len(trace)))


def one_adapter_requests(prompts: list[int], behind_a_short_one: bool = False) -> Trace:
    """Requests of one adapter with the given prompt lengths and 3 output tokens each, all arriving at once; with
    ``behind_a_short_one`` a 16-token request comes just before them, so they wait for its step together."""
    prompts = [16, *prompts] if behind_a_short_one else prompts
    n = len(prompts)
    arrival = [0.0] + [1e-4] * (n - 1) if behind_a_short_one else [0.0] * n
    return Trace(
        name="prompts",
        tenants=[Tenant("gold", priority=1)],
        adapters=[Adapter("gold@v1", 0, ADAPTER_BYTES)],
        arrival=arrival,
        adapter=[0] * n,
        tenant=[0] * n,
        input_tokens=prompts,
        output_tokens=[3] * n,
    )


def ttfts(trace: Trace, **limits: int) -> list[float]:
    profile = replace(free_loads(), **limits)
    policy = build_policy("round-robin", 0, trace, profile, ONE_POD)
    return list(Simulator(trace, ONE_POD, profile, policy.router, policy.eviction).run().ttft)


def step_s(batch: int) -> float:
    """One step's cost with ``batch`` sequences of one adapter, prefill aside."""
    p = LARGE_GPU
    return (p.step_overhead_ms + p.decode_base_ms + p.decode_per_seq_ms * batch + p.lora_base_ms
            + p.lora_per_adapter_ms) / 1e3  # fmt: skip


PREFILL_S = LARGE_GPU.prefill_per_token_ms / 1e3


def test_a_prompt_longer_than_the_budget_is_prefilled_in_chunks_over_several_steps() -> None:
    (alone,) = ttfts(one_adapter_requests([1000]), max_batched_tokens=256)
    assert alone == pytest.approx(4 * step_s(1) + 1000 * PREFILL_S)  # 256 + 256 + 256 + 232
    (whole,) = ttfts(one_adapter_requests([1000]), max_batched_tokens=8192)
    assert whole == pytest.approx(step_s(1) + 1000 * PREFILL_S)


def test_a_second_request_takes_what_the_first_left_of_the_budget() -> None:
    short, first, second = ttfts(one_adapter_requests([700, 700], behind_a_short_one=True), max_batched_tokens=1000)
    assert short == pytest.approx(step_s(1) + 16 * PREFILL_S)
    # the next step: the short one's decode token, all 700 of the first and 299 of the second (vLLM counts every
    # decode token against the budget and chunks a waiting request into what is left rather than keep it for a
    # step of its own); the step after: two decode tokens and the second's other 401
    assert first == pytest.approx(short - 1e-4 + step_s(3) + 999 * PREFILL_S)
    assert second == pytest.approx(first + step_s(3) + 401 * PREFILL_S)


def test_long_prefill_token_threshold_caps_each_request_per_step_only_when_another_is_eligible() -> None:
    (alone,) = ttfts(one_adapter_requests([1000]), long_prefill_token_threshold=400)
    assert alone == pytest.approx(step_s(1) + 1000 * PREFILL_S)
    short, first, second = ttfts(one_adapter_requests([1000, 1000], behind_a_short_one=True),
                                 long_prefill_token_threshold=400)  # fmt: skip
    # after the short one's step: 400 + 400, then 400 + 400, then 200 + 200; both have their first token then
    assert first == second == pytest.approx(short - 1e-4 + step_s(3) * 2 + step_s(2) + 2000 * PREFILL_S)


def test_the_report_says_what_the_pods_run_and_vllm_defaults_turn_loraplanes_to_the_baselines() -> None:
    trace = scenario("hot-plus-burst", 300, seed=0, adapter_bytes=ADAPTER_BYTES)
    defaults = {"scheduling_policy": "fcfs", "max_num_batched_tokens": LARGE_GPU.max_batched_tokens}
    report = run_all(trace, SimConfig(pods=2), LARGE_GPU, ["loraplane", "round-robin"], seed=0, jobs=1)
    assert report["pods"] == {
        "loraplane": {"scheduling_policy": "priority", "max_num_batched_tokens": LORAPLANE_MAX_BATCHED_TOKENS},
        "baselines": defaults,
    }
    plain = run_all(trace, SimConfig(pods=2), LARGE_GPU, ["loraplane"], seed=0, jobs=1, chart_pods=False)
    assert plain["pods"] == {"loraplane": defaults, "baselines": defaults}
    built = build_policy("loraplane", 0, trace, LARGE_GPU, SimConfig(pods=2), chart_pods=False)
    assert built.priority is None and built.pod_profile is None


class PrefetchAt:
    """A placement that asks pod 0 to bring ``adapter`` to a GPU slot at ``when``."""

    period_s = 0.5

    def __init__(self, adapter: int, when: float) -> None:
        self.adapter, self.when = adapter, when

    def apply(self, now: float, sim: Simulator) -> None:
        if now >= self.when:
            sim.prefetch(sim.pods[0], self.adapter)


def test_a_prefetch_the_eviction_policy_refuses_costs_nothing() -> None:
    """Adapter 0 runs in the pod's only slot, so a placement's prefetch of adapter 1 is refused: the step goes on as
    if none was asked (it once took a second off the step)."""
    config = SimConfig(pods=1, max_loras=1, max_cpu_loras=2)
    trace = Trace(name="prefetch", tenants=[Tenant("t")],
                  adapters=[Adapter("a@v1", 0, ADAPTER_BYTES), Adapter("b@v1", 0, ADAPTER_BYTES)],
                  arrival=[0.0, 1.0], adapter=[0, 0], tenant=[0, 0], input_tokens=[64, 64],
                  output_tokens=[500, 4])  # fmt: skip
    profile = free_loads()

    def run(placement: PrefetchAt | None) -> list[float]:
        policy = build_policy("round-robin", 0, trace, profile, config)
        return list(Simulator(trace, config, profile, policy.router, policy.eviction, placement).run().ttft)

    assert run(PrefetchAt(1, 0.5)) == pytest.approx(run(None), abs=1e-12)
