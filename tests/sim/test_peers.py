"""The simulator's peers: their packaged picker configs over the pods' vLLM metrics, scraped on a clock."""

from __future__ import annotations

import math

import numpy as np

from loraplane.engine.policies import LruPolicy
from loraplane.picker.scheduler import Decision
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
    """Records the requests each decision saw on the pods (waiting + running)."""

    seen: list[list[float]]

    def decide(self, now: float, rid: int, trace: Trace, pods: list[Pod]) -> Decision:
        decision = super().decide(now, rid, trace, pods)
        snapshot = self.snapshot()
        self.seen = [*getattr(self, "seen", []), (snapshot.queue_depth + snapshot.running).tolist()]
        return decision


def seen_by_the_second_request(interval_s: float, gap_s: float) -> list[float]:
    trace = two_requests(gap_s)
    base = peer_router("least-request", 0, trace, LARGE_GPU, interval_s)
    router = Seen(base.name, 0, trace, LARGE_GPU, base.scheduler, interval_s)
    config = SimConfig(pods=2, scrape_interval_s=interval_s)
    Simulator(trace, config, LARGE_GPU, router, EngineEviction(LruPolicy(), trace, LARGE_GPU), scraper=router).run()
    return router.seen[1]


def test_decisions_read_the_last_scrape_not_the_live_pods() -> None:
    # 10 ms apart, inside one 50 ms scrape interval: the second request does not see the first
    assert seen_by_the_second_request(0.05, 0.010) == [0.0, 0.0]
    # a scrape tick (t = 50 ms) between them: it does
    assert sorted(seen_by_the_second_request(0.05, 0.060)) == [0.0, 1.0]
    assert seen_by_the_second_request(0.05, 0.049) == [0.0, 0.0]  # the grid starts at the first arrival
    # interval 0: every decision reads the pods as they are
    assert sorted(seen_by_the_second_request(0.0, 0.010)) == [0.0, 1.0]


class Ticks:
    """A scraper that records its ticks and what the pods held then."""

    def __init__(self, period_s: float) -> None:
        self.period_s = period_s
        self.ticks: list[tuple[float, int]] = []

    def scrape(self, now: float, pods: list[Pod]) -> None:
        self.ticks.append((now, sum(len(p.waiting) + p.num_running for p in pods)))


def test_the_simulator_scrapes_on_ticks_and_folds_quiet_ones() -> None:
    trace = scenario("gie-multilora", 600, 3, ADAPTER_BYTES)
    ticks = Ticks(0.05)
    policy = build_policy("round-robin", 0, trace, LARGE_GPU, SimConfig(pods=2))
    result = Simulator(trace, SimConfig(pods=2), LARGE_GPU, policy.router, policy.eviction, scraper=ticks).run()
    times = [t - trace.arrival[0] for t, _ in ticks.ticks]
    assert times == sorted(set(times)) and times[0] == 0.0
    assert all(abs(t / 0.05 - round(t / 0.05)) < 1e-6 for t in times)  # on the 50 ms grid from the first arrival
    assert len(times) <= math.floor(result.sim_seconds / 0.05) + 1
    assert len(times) > len(trace) / 2  # about one per tick with something happening
    assert max(busy for _, busy in ticks.ticks) > 0


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
