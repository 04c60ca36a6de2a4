"""A step in which nothing runs leaves the running requests' KV accounting as it was.

Under vLLM's ``priority`` policy the request first in the running list may be the lowest-priority one: when it finds
no free block it preempts itself, the scheduler stops there and the step schedules nothing (no token, no step). The
other running requests made no progress in a step that never ran, so their computed tokens and the blocks they will
give back when they finish are what they were."""

from __future__ import annotations

from dataclasses import replace

from loraplane.sim.cluster import BLOCK_TOKENS, Pod, SimConfig, Simulator
from loraplane.sim.policies import build_policy, runtime_priorities
from loraplane.sim.trace import Adapter, Tenant, Trace
from tests.sim.conftest import ADAPTER_BYTES, free_loads

ONE_POD = SimConfig(pods=1, max_loras=2, max_cpu_loras=4)
#: KV for five blocks
FIVE_BLOCKS = replace(free_loads(), kv_capacity_tokens=5 * BLOCK_TOKENS)


def batch_then_gold() -> Trace:
    """A batch request (one block of prompt) admitted in step 1, a gold one (18 prompt tokens) in step 2. After
    step 17 the batch request has 32 tokens computed (2 blocks), the gold one 33 (3 blocks: it took its third in
    step 17) and no block is free, so in step 18 the batch request, first in the running list and the lowest
    priority, needs its third block and preempts itself: step 18 schedules nothing."""
    tenants = [Tenant("gold", priority=1), Tenant("batch", cls="burst", priority=-1)]
    adapters = [Adapter("gold@v1", 0, ADAPTER_BYTES), Adapter("batch@v1", 1, ADAPTER_BYTES)]
    who = [1, 0]
    return Trace(
        name="self-preemption",
        tenants=tenants,
        adapters=adapters,
        arrival=[0.0, 0.0],
        adapter=who,
        tenant=who,
        input_tokens=[BLOCK_TOKENS, BLOCK_TOKENS + 2],
        output_tokens=[40, 30],
    )


class CountingSimulator(Simulator):
    """Counts the steps that preempted something and scheduled nothing (the pod is left idle)."""

    empty_steps = 0

    def _begin(self, pod: Pod, now: float) -> None:
        preemptions = self.result.preemptions
        super()._begin(pod, now)
        if self.result.preemptions > preemptions and not pod.busy:
            self.empty_steps += 1


def test_a_step_that_preempts_its_first_request_and_schedules_nothing_leaks_no_kv_block() -> None:
    trace = batch_then_gold()
    built = build_policy("round-robin", 0, trace, FIVE_BLOCKS, ONE_POD)
    sim = CountingSimulator(trace, ONE_POD, FIVE_BLOCKS, built.router, built.eviction,
                            priority=runtime_priorities(trace))
    result = sim.run()
    assert sim.empty_steps == 1 and result.preemptions == 1
    assert list(result.admitted) == [0, 1]
    assert all(t > 0 for t in result.ttft)
    pod = sim.pods[0]
    assert pod.kv_blocks == 0 and not pod.running and not pod.prefilling and not any(pod.block_phase)
    assert pod.queue_tail - pod.queue_head == pod.kv_capacity_blocks and not pod.queue_taken
