"""The simulator feeds the picker's prefill-queue signal from its own events: requests sent to a pod with no first
token yet (waiting there, or admitted by the step under way)."""

from __future__ import annotations

from loraplane.sim.cluster import Pod, SimConfig, Simulator
from loraplane.sim.policies import build_policy
from loraplane.sim.profile import LARGE_GPU
from loraplane.sim.trace import Adapter, Tenant, Trace
from tests.sim.conftest import ADAPTER_BYTES

#: three requests a millisecond apart, then one long after the first tokens of all three
ARRIVALS = [0.0, 0.001, 0.002, 1.0]


def _trace() -> Trace:
    n = len(ARRIVALS)
    return Trace(name="first-token", tenants=[Tenant("t")], adapters=[Adapter("a@v1", 0, ADAPTER_BYTES)],
                 arrival=ARRIVALS, adapter=[0] * n, tenant=[0] * n, input_tokens=[2000] * n, output_tokens=[64] * n)


class FirstPod:
    """Sends everything to pod 0 and notes, at each arrival, how many requests there await their first token."""

    name = "first-pod"

    def __init__(self) -> None:
        self.seen: list[int] = []
        self.tokens: list[int] = []

    def pick(self, now: float, rid: int, trace: Trace, pods: list[Pod]) -> int:
        self.seen.append(pods[0].awaiting_first_token(now))
        self.tokens.append(pods[0].awaiting_first_token_tokens(now, trace.input_tokens))
        return 0


def test_requests_count_until_the_step_that_admitted_them_ends() -> None:
    trace, config = _trace(), SimConfig(pods=2)
    policy = build_policy("loraplane", 0, trace, LARGE_GPU, config)
    router = FirstPod()
    result = Simulator(trace, config, LARGE_GPU, router, policy.eviction).run()
    # the first request is admitted at once and its 2,000-token prefill runs ~0.2 s: the next two arrive while it
    # (then it and the one waiting) have no first token; by 1 s all three are decoding
    assert router.seen == [0, 1, 2, 0]
    assert router.tokens == [0, 2000, 4000, 0]  # their prompts, as the picker counts them until the first token
    assert all(t > 0.1 for t in result.ttft)


def test_the_picker_in_the_simulator_reads_the_same_count() -> None:
    trace, config = _trace(), SimConfig(pods=2)
    policy = build_policy("loraplane", 0, trace, LARGE_GPU, config)
    seen: list[list[float]] = []
    decide = policy.router.decide  # type: ignore[attr-defined]

    def recording(now: float, rid: int, trace: Trace, pods: list[Pod]):  # type: ignore[no-untyped-def]
        decision = decide(now, rid, trace, pods)
        snapshot = policy.router._snapshot  # type: ignore[attr-defined]
        seen.append([(snapshot.prefilling[p.index], p.awaiting_first_token(now)) for p in pods])
        seen.append([(snapshot.prefill_tokens[p.index], p.awaiting_first_token_tokens(now, trace.input_tokens))
                     for p in pods])
        return decision

    policy.router.decide = recording  # type: ignore[attr-defined]
    Simulator(trace, config, LARGE_GPU, policy.router, policy.eviction, policy.placement,
              admission=policy.admission).run()
    assert len(seen) == 2 * len(ARRIVALS)
    assert all(fed == counted for row in seen for fed, counted in row)
    assert sum(counted for row in seen[::2] for _, counted in row) >= 2  # the 2nd and 3rd arrivals found some
    assert sum(counted for row in seen[1::2] for _, counted in row) >= 4000
