"""Round-robin, the one baseline no endpoint picker runs (it is what a gateway does without one).

The peers' routing policies (least-request, GIE's default profile, LoRA affinity, the legacy LoRA filter chain,
llm-d's load-state and prefix profiles) are packaged picker configs, run in the simulator by the picker's own
``Scheduler`` over the pods' vLLM metrics: ``loraplane.sim.peers``.
"""

from __future__ import annotations

from loraplane.sim.cluster import Pod
from loraplane.sim.trace import Trace

ROUND_ROBIN = "round-robin"


class RoundRobin:
    """Pods in turn, blind to load and adapters."""

    name = ROUND_ROBIN

    def __init__(self, seed: int) -> None:
        self._next = seed

    def pick(self, now: float, rid: int, trace: Trace, pods: list[Pod]) -> int:
        """The next pod."""
        self._next = (self._next + 1) % len(pods)
        return self._next
