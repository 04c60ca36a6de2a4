"""The field's routing policies, reimplemented from their public descriptions.

Each router sees what its real counterpart sees: GIE's scorers read the model-server metrics of the GIE protocol
(``num_requests_waiting``, ``kv_cache_usage_perc`` and ``lora_requests_info``, whose adapter lists name only adapters
with requests in flight); the llm-d load-state scorer reads the proposed vLLM residency gauges (GPU / CPU). Ties
are broken by a seeded random choice, as the reference EPP's max-score picker does.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from loraplane.picker.prefix import ApproximateIndex
from loraplane.sim.cluster import Pod, Router
from loraplane.sim.prefix import PrefixLayout
from loraplane.sim.trace import Trace

#: GIE default profile weights (the prefix-cache scorer only in ``llmd-prefix``)
QUEUE_WEIGHT = 2.0
KV_WEIGHT = 2.0
#: weight given to the LoRA scorers added to the default profile (the same as queue and KV)
LORA_WEIGHT = 2.0
#: llm-d's inference-scheduling profile: queue 2, KV utilisation 2, prefix cache 3; the prefix plugin's defaults
#: (16-token blocks, at most 256 matched, an LRU of 31,250 block hashes per pod, no TTL)
LLMD_PREFIX_WEIGHT = 3.0
LLMD_MAX_PREFIX_BLOCKS = 256
LLMD_LRU_CAPACITY_PER_SERVER = 31_250
#: the old GIE LoRA filter: probability of keeping affinity pods, and the queue length above which a pod is skipped
LORA_FILTER_PROBABILITY = 0.999
LORA_QUEUE_THRESHOLD = 128


class RoundRobin:
    """Pods in turn, blind to load and adapters."""

    name = "round-robin"

    def __init__(self, seed: int) -> None:
        self._next = seed

    def pick(self, now: float, rid: int, trace: Trace, pods: list[Pod]) -> int:
        """The next pod."""
        self._next = (self._next + 1) % len(pods)
        return self._next


class _MaxScore:
    """Max score over pods with a seeded random tie-break."""

    name = ""

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)

    def _best(self, scores: list[float]) -> int:
        top = max(scores)
        best = [i for i, s in enumerate(scores) if s >= top - 1e-12]
        return best[0] if len(best) == 1 else self._rng.choice(best)


class LeastRequest(_MaxScore):
    """Fewest requests in flight (waiting + running), as Envoy's least-request balancer."""

    name = "least-request"

    def pick(self, now: float, rid: int, trace: Trace, pods: list[Pod]) -> int:
        """The pod with the fewest requests in flight."""
        return self._best([-float(len(p.waiting) + p.num_running) for p in pods])


def _default_scores(pods: list[Pod], kv_capacity: int) -> list[float]:
    """GIE default profile: queue scorer (max-q)/(max-q - min-q) x 2 + (1 - KV utilisation) x 2."""
    queues = [len(p.waiting) for p in pods]
    lo, hi = min(queues), max(queues)
    span = hi - lo
    return [
        QUEUE_WEIGHT * ((hi - q) / span if span else 1.0) + KV_WEIGHT * (1.0 - p.kv_reserved / kv_capacity)
        for q, p in zip(queues, pods, strict=True)
    ]


class GieDefault(_MaxScore):
    """The GIE default scheduling profile (queue 2, KV-cache 2), max-score picker."""

    name = "gie-default"

    def __init__(self, seed: int, kv_capacity: int) -> None:
        super().__init__(seed)
        self._kv = kv_capacity

    def _lora(self, adapter: int, pod: Pod) -> float:
        return 0.0

    def pick(self, now: float, rid: int, trace: Trace, pods: list[Pod]) -> int:
        """The best pod by the profile's weighted scores."""
        a = trace.adapter[rid]
        scores = _default_scores(pods, self._kv)
        return self._best([s + LORA_WEIGHT * self._lora(a, p) for s, p in zip(scores, pods, strict=True)])


class GieLoraAffinity(GieDefault):
    """GIE default + the LoRA affinity scorer on ``lora_requests_info``: 1.0 if the adapter is running, 0.8 if the
    running + waiting adapters leave room, 0.6 if it is only waiting, else 0."""

    name = "gie-lora-affinity"

    def _lora(self, adapter: int, pod: Pod) -> float:
        if adapter in pod.running_adapters:
            return 1.0
        if len(pod.running_adapters) + len(pod.waiting_adapters) < pod.max_loras:
            return 0.8
        if adapter in pod.waiting_adapters:
            return 0.6
        return 0.0


class LlmdLoadState(GieDefault):
    """GIE default + the llm-d "lora load state" scorer on vLLM residency gauges: GPU-resident 1.0, CPU-resident
    0.7, free GPU slot 0.6, an evictable slot 0.3, full 0."""

    name = "llmd-load-state"

    def _lora(self, adapter: int, pod: Pod) -> float:
        if adapter in pod.gpu:
            return 1.0
        if adapter in pod.cpu:
            return 0.7
        if len(pod.gpu) < pod.max_loras:
            return 0.6
        if any(a not in pod.running_adapters and a not in pod.pinned for a in pod.gpu):
            return 0.3
        return 0.0


class LlmdPrefix(GieDefault):
    """llm-d's default scheduling profile: queue scorer x2 + KV-cache scorer x2 + approximate prefix-cache scorer x3
    (matched / total prefix blocks of the request, from an LRU per pod of the block hashes it routed there; the
    served name is part of the hash, nothing else about adapters)."""

    name = "llmd-prefix"

    def __init__(self, seed: int, kv_capacity: int) -> None:
        super().__init__(seed, kv_capacity)
        self._now = 0.0
        self._index = ApproximateIndex(LLMD_LRU_CAPACITY_PER_SERVER, ttl_s=1e18, clock=lambda: self._now)
        self._layout: tuple[Trace, PrefixLayout] | None = None
        self._names: list[str] = []

    def pick(self, now: float, rid: int, trace: Trace, pods: list[Pod]) -> int:
        """The best pod by the weighted scores; the request's blocks are recorded on it."""
        scores = _default_scores(pods, self._kv)
        if not trace.has_prefixes:
            return self._best(scores)
        if self._layout is None or self._layout[0] is not trace:
            self._layout = (trace, PrefixLayout(trace))
        if len(self._names) != len(pods):
            self._names = [f"pod-{p.index}" for p in pods]
        self._now = now
        request = self._layout[1].request(rid, LLMD_MAX_PREFIX_BLOCKS)
        if request.hashes:
            matched = self._index.match(self._names, request)
            share = LLMD_PREFIX_WEIGHT / len(request.hashes)
            scores = [s + share * int(m) for s, m in zip(scores, matched, strict=True)]
        chosen = self._best(scores)
        self._index.record(self._names[chosen], request)
        return chosen


class GieLoraFilter(_MaxScore):
    """The old GIE filter chain: pods with queue < 128; with probability 0.999 those where the adapter is running or
    waiting, else (or if none) those with room for another adapter; then least queue, then least KV usage."""

    name = "gie-lora-filter"

    def __init__(self, seed: int, kv_capacity: int) -> None:
        super().__init__(seed)
        self._kv = kv_capacity

    def pick(self, now: float, rid: int, trace: Trace, pods: list[Pod]) -> int:
        """Filter, then least queue and least KV usage."""
        a = trace.adapter[rid]
        cands = [p for p in pods if len(p.waiting) < LORA_QUEUE_THRESHOLD] or pods
        affine: list[Pod] = []
        if self._rng.random() < LORA_FILTER_PROBABILITY:
            affine = [p for p in cands if a in p.running_adapters or a in p.waiting_adapters]
        if not affine:
            affine = [p for p in cands if len(p.running_adapters) + len(p.waiting_adapters) < p.max_loras]
        cands = affine or cands
        least_q = min(len(p.waiting) for p in cands)
        cands = [p for p in cands if len(p.waiting) == least_q]
        least_kv = min(p.kv_reserved for p in cands)
        cands = [p for p in cands if p.kv_reserved == least_kv]
        return cands[0].index if len(cands) == 1 else self._rng.choice(cands).index


#: baseline name -> factory(seed, kv capacity in tokens)
BASELINES: dict[str, Callable[[int, int], Router]] = {
    "round-robin": lambda seed, kv: RoundRobin(seed),
    "least-request": lambda seed, kv: LeastRequest(seed),
    "gie-default": GieDefault,
    "gie-lora-affinity": GieLoraAffinity,
    "gie-lora-filter": GieLoraFilter,
    "llmd-load-state": LlmdLoadState,
    "llmd-prefix": LlmdPrefix,
}
