"""The simulator's peers: their packaged picker configs over the pods' vLLM metrics, scraped on a clock."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from loraplane.engine.policies import LruPolicy
from loraplane.picker.scheduler import Decision
from loraplane.picker.scrape import scrape_offset
from loraplane.sim.cluster import Pod, SimConfig, Simulator
from loraplane.sim.peers import PEER_POLICIES, PeerRouter, VllmView, peer_router
from loraplane.sim.policies import BASELINES, POLICY_NAMES, EngineEviction, build_policy
from loraplane.sim.profile import LARGE_GPU
from loraplane.sim.trace import Adapter, Tenant, Trace, scenario
from tests.sim.conftest import ADAPTER_BYTES


def two_requests(gap_s: float) -> Trace:
    adapters = [Adapter("a@v1", 0, ADAPTER_BYTES), Adapter("b@v1", 0, ADAPTER_BYTES)]
    return Trace(name="pair", tenants=[Tenant("t")], adapters=adapters, arrival=[0.010, 0.010 + gap_s],
                 adapter=[0, 1], tenant=[0, 0], input_tokens=[200, 200], output_tokens=[50, 50])


class Seen(PeerRouter):
    """Records the requests each decision saw on the pods (waiting + running) and where it sent them; scrapes pod
    ``i`` at ``offsets[i]`` in each interval."""

    seen: list[list[float]]
    offsets: tuple[float, ...] = (0.0, 0.0)

    def offset_s(self, index: int) -> float:
        return self.offsets[index]

    def decide(self, now: float, rid: int, trace: Trace, pods: list[Pod]) -> Decision:
        decision = super().decide(now, rid, trace, pods)
        snapshot = self.snapshot()
        self.seen = [*getattr(self, "seen", []), (snapshot.queue_depth + snapshot.running).tolist()]
        return decision


def second_request(interval_s: float, gap_s: float, offsets: tuple[float, float] = (0.0, 0.0)) -> tuple[list[float], int]:
    """What the second of two requests ``gap_s`` apart saw on the two pods, and the pod the first went to."""
    trace = two_requests(gap_s)
    base = peer_router("least-request", 0, trace, LARGE_GPU, interval_s)
    router = Seen(base.name, 0, trace, LARGE_GPU, base.scheduler, interval_s)
    router.offsets = offsets
    config = SimConfig(pods=2, scrape_interval_s=interval_s)
    result = Simulator(trace, config, LARGE_GPU, router, EngineEviction(LruPolicy(), trace, LARGE_GPU),
                       scraper=router).run()
    return router.seen[1], int(result.pod[0])


def seen_by_the_second_request(interval_s: float, gap_s: float) -> list[float]:
    return second_request(interval_s, gap_s)[0]


def test_decisions_read_the_last_scrape_not_the_live_pods() -> None:
    # 10 ms apart, inside one 50 ms scrape interval: the second request does not see the first
    assert seen_by_the_second_request(0.05, 0.010) == [0.0, 0.0]
    # a scrape tick (t = 50 ms) between them: it does
    assert sorted(seen_by_the_second_request(0.05, 0.060)) == [0.0, 1.0]
    assert seen_by_the_second_request(0.05, 0.049) == [0.0, 0.0]  # the grid starts at the first arrival
    # interval 0: every decision reads the pods as they are
    assert sorted(seen_by_the_second_request(0.0, 0.010)) == [0.0, 1.0]


def test_each_pod_is_scraped_at_its_own_offset() -> None:
    """One pod is scraped 20 ms into each 50 ms interval, the other at 40 ms: 25 ms after the first request only
    the first pod's figures are new, so the second request sees the first only where it went to that pod."""
    seen_early, first = second_request(0.05, 0.025, (0.02, 0.04))
    seen_late, first_again = second_request(0.05, 0.025, (0.04, 0.02))
    assert first == first_again  # the same decision: the offsets swapped around it
    assert (seen_early, seen_late) == (([1.0, 0.0], [0.0, 0.0]) if first == 0 else ([0.0, 0.0], [0.0, 1.0]))
    assert sorted(second_request(0.05, 0.045, (0.02, 0.04))[0]) == [0.0, 1.0]  # both scraped by then
    router = peer_router("least-request", 0, two_requests(0.1), LARGE_GPU, 0.05)
    assert router.offset_s(0) == scrape_offset("10.0.0.1:8000", 0.05)  # the picker's own offsets


class Ticks:
    """A scraper that records each pod's ticks and what the pods held then; pod ``i`` at ``i`` x 10 ms."""

    def __init__(self, period_s: float) -> None:
        self.period_s = period_s
        self.ticks: list[tuple[float, list[int], int]] = []

    def offset_s(self, index: int) -> float:
        return index * 0.01

    def scrape(self, now: float, pods: list[Pod], due: Sequence[int]) -> None:
        self.ticks.append((now, list(due), sum(len(p.waiting) + p.num_running for p in pods)))


def test_the_simulator_scrapes_on_ticks_and_folds_quiet_ones() -> None:
    trace = scenario("gie-multilora", 600, 3, ADAPTER_BYTES)
    ticks = Ticks(0.05)
    policy = build_policy("round-robin", 0, trace, LARGE_GPU, SimConfig(pods=2))
    result = Simulator(trace, SimConfig(pods=2), LARGE_GPU, policy.router, policy.eviction, scraper=ticks).run()
    for pod in (0, 1):
        # a pod's tick is taken at the first event at or after it, once however many quiet ticks passed
        times = [now - trace.arrival[0] for now, due, _ in ticks.ticks if pod in due]
        assert times == sorted(set(times)) and len(times) <= math.floor(result.sim_seconds / 0.05) + 1
        assert len(times) > len(trace) / 4  # about one per tick with something happening
        assert all(t >= pod * 0.01 for t in times)
    assert all(due for _, due, _ in ticks.ticks) and max(busy for _, _, busy in ticks.ticks) > 0
    # at most one scrape per pod per interval: between two scrapes of a pod at least one offset grid point
    for pod in (0, 1):
        grid = [math.floor((now - trace.arrival[0] - pod * 0.01) / 0.05 + 1e-9) for now, due, _ in ticks.ticks
                if pod in due]
        assert grid == sorted(set(grid))


def test_vllm_names_every_busy_adapter_in_both_lists() -> None:
    trace = scenario("gie-multilora", 50, 1, ADAPTER_BYTES)
    pod = Pod(0, 4, 16, set())
    pod.running_adapters = {0: 1}
    pod.waiting_adapters = {1: None, 0: None}  # type: ignore[dict-item]
    pod.gpu, pod.cpu = {0}, {0, 2}
    names = [a.name for a in trace.adapters]
    vllm = VllmView(trace, LARGE_GPU).endpoint(pod)
    assert vllm.running_adapters == vllm.waiting_adapters == {names[0], names[1]}
    split = VllmView(trace, LARGE_GPU, "split").endpoint(pod)
    assert (split.running_adapters, split.waiting_adapters) == ({names[0]}, {names[0], names[1]})
    assert vllm.loaded_adapters is not None
    assert {n: s.gpu for n, s in vllm.loaded_adapters.items()} == {names[0]: True, names[2]: False}
    assert (vllm.gpu_loaded, vllm.gpu_slots) == (1, 4)


def test_the_baselines_are_round_robin_and_the_packaged_peer_configs() -> None:
    assert BASELINES == ["round-robin", "least-request", "gie-default", "gie-lora-affinity", "gie-lora-filter",
                         "llmd-load-state", "llmd-prefix", "llmd-predicted-latency", "dynamo-lora"]
    assert POLICY_NAMES == ["loraplane", *BASELINES] and set(PEER_POLICIES) == set(BASELINES) - {"round-robin"}
    trace = scenario("gie-multilora", 50, 1, ADAPTER_BYTES)
    for name in PEER_POLICIES:
        policy = build_policy(name, 0, trace, LARGE_GPU, SimConfig(pods=2, scrape_interval_s=0.1))
        assert isinstance(policy.router, PeerRouter) and policy.scraper is policy.router
        assert policy.router.period_s == 0.1 and policy.router.name == name


def test_a_peer_run_is_reproducible() -> None:
    trace = scenario("hot-plus-burst", 1500, 2, ADAPTER_BYTES)
    runs = []
    for _ in range(2):
        policy = build_policy("llmd-load-state", 4, trace, LARGE_GPU, SimConfig(pods=4))
        result = Simulator(trace, SimConfig(pods=4), LARGE_GPU, policy.router, policy.eviction,
                           scraper=policy.scraper).run()
        runs.append(np.frombuffer(result.pod, dtype=np.int32).copy())
    assert (runs[0] == runs[1]).all()


def test_a_peer_router_scrapes_on_its_clock_without_being_named_the_scraper() -> None:
    trace = scenario("gie-multilora", 400, 3, ADAPTER_BYTES)
    policy = build_policy("gie-default", 0, trace, LARGE_GPU, SimConfig(pods=2))
    result = Simulator(trace, SimConfig(pods=2), LARGE_GPU, policy.router, policy.eviction).run()
    assert isinstance(policy.router, PeerRouter)
    assert policy.router.scrapes > result.sim_seconds / 0.05 / 4  # ticks, not once
