"""The simulator's runs of the two newer peers: Dynamo's allocator on the simulator's clock, predicted-latency routing
on the simulator's own TTFT model (``TtftOracle``) with the tenants' priorities."""

from __future__ import annotations

from loraplane.picker.peers.dynamo import DynamoLoraFilter
from loraplane.picker.peers.latency import PredictedLatencyFilter
from loraplane.sim.cluster import Pod, SimConfig, Simulator
from loraplane.sim.peers import PeerRouter, TtftOracle
from loraplane.sim.policies import build_policy
from loraplane.sim.profile import LARGE_GPU
from loraplane.sim.trace import Adapter, Tenant, Trace, scenario
from tests.sim.conftest import ADAPTER_BYTES


def plugin(router: PeerRouter, kind: type) -> object:
    found = [step.run for step in router.scheduler.filters if isinstance(step.run, kind)]
    assert len(found) == 1
    return found[0]


def test_the_oracle_charges_the_queue_ahead_and_the_adapters_tier() -> None:
    adapters = [Adapter("a@v1", 0, ADAPTER_BYTES), Adapter("b@v1", 0, ADAPTER_BYTES)]
    trace = Trace(name="t", tenants=[Tenant("t")], adapters=adapters, arrival=[0.0] * 6, adapter=[0, 0, 0, 0, 0, 1],
                  tenant=[0] * 6, input_tokens=[2000] * 6, output_tokens=[10] * 6)
    oracle = TtftOracle(trace, LARGE_GPU)
    empty, queued, cold = (Pod(i, 4, 16, set()) for i in range(3))
    empty.gpu.add(0)
    queued.gpu.add(0)
    queued.waiting.extend([1, 2, 3])
    empty_s, queued_s, cold_s = oracle.predict(0, [empty, queued, cold])
    assert queued_s > empty_s  # three prompts ahead
    assert cold_s > empty_s + LARGE_GPU.download_ms(ADAPTER_BYTES) / 1e3 * 0.99  # fetched, read, loaded
    cold.disk.add(0)
    assert oracle.predict(0, [cold])[0] < cold_s  # on disk: no fetch


def test_dynamo_ticks_on_the_simulators_clock() -> None:
    trace = scenario("hot-plus-burst", 1200, 1, ADAPTER_BYTES)
    config = SimConfig(pods=4)
    policy = build_policy("dynamo-lora", 0, trace, LARGE_GPU, config)
    assert isinstance(policy.router, PeerRouter)
    dynamo = plugin(policy.router, DynamoLoraFilter)
    assert isinstance(dynamo, DynamoLoraFilter)
    result = Simulator(trace, config, LARGE_GPU, policy.router, policy.eviction, scraper=policy.scraper).run()
    # one tick per 3 s of simulated time (the wall clock would give one or two)
    assert abs(dynamo.allocator.tick - trace.duration / 3.0) <= 2
    assert dynamo.allocator.table  # it placed the adapters
    hot = max(range(len(trace.adapters)), key=list(trace.adapter).count)
    pods = {result.pod[r] for r in range(len(trace)) if trace.adapter[r] == hot}
    assert len(pods) <= config.pods


def test_predicted_latency_reads_the_oracle_and_the_tenants_priority() -> None:
    tenants = [Tenant("gold", priority=1), Tenant("batch", priority=-1)]
    adapters = [Adapter("a@v1", 0, ADAPTER_BYTES)]
    n = 40
    trace = Trace(name="t", tenants=tenants, adapters=adapters, arrival=[0.001 * i for i in range(n)],
                  adapter=[0] * n, tenant=[i % 2 for i in range(n)], input_tokens=[500] * n, output_tokens=[20] * n)
    config = SimConfig(pods=2)
    policy = build_policy("llmd-predicted-latency", 0, trace, LARGE_GPU, config)
    router = policy.router
    assert isinstance(router, PeerRouter)
    latency = plugin(router, PredictedLatencyFilter)
    assert isinstance(latency, PredictedLatencyFilter)
    seen: list[tuple[int, int]] = []
    predictor = latency.predictor

    def spy(request, pool):  # type: ignore[no-untyped-def]
        seen.append((router._rid, request.priority))
        return predictor(request, pool)

    latency.predictor = spy
    Simulator(trace, config, LARGE_GPU, router, policy.eviction, scraper=policy.scraper).run()
    assert seen and all(priority == tenants[trace.tenant[rid]].priority for rid, priority in seen)
    assert {rid for rid, _ in seen} == set(range(n))  # every decision predicted for its own request
