"""Eviction policies (plug-ins): which adapter leaves a full tier.

The tier manager passes only evictable candidates (not pinned, no request in flight), so a policy never has to
know about protection; it only ranks.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from loraplane.engine.tiers import AdapterState


class EvictionPolicy(Protocol):
    """Chooses the adapter to evict among candidates (never empty)."""

    name: str

    def victim(self, candidates: Sequence[AdapterState], now: float) -> AdapterState:
        """The candidate to evict."""
        ...


class LruPolicy:
    """vLLM's behaviour: evict the least recently used adapter."""

    name = "lru"

    def victim(self, candidates: Sequence[AdapterState], now: float) -> AdapterState:
        """The candidate whose last request (or arrival in the tier, if never requested) is oldest."""
        return min(candidates, key=lambda a: a.last_used)


@dataclass
class KeepScorePolicy:
    """Evict the adapter least worth keeping, by a score mixing recency, frequency, priority, reload cost and size.

    ``score = w_recency * d + w_frequency * log1p(hits * d) + w_priority * priority + w_reload * log1p(reload ms)
    - w_size * MiB (+ w_residency while younger than min_residency_s)``, where ``d = 2^(-idle / half_life_s)``.
    Hits decay with idle time, so the one-off adapters of a burst score below a steadily used hot set even though
    they are more recent, and the hot set stays resident. The residency bonus keeps a freshly loaded adapter from
    being thrown out at once by the next newcomer (it is smaller than a hot adapter's frequency term).
    """

    half_life_s: float = 60.0
    min_residency_s: float = 2.0
    w_recency: float = 1.0
    w_frequency: float = 1.0
    w_priority: float = 0.5
    w_reload: float = 0.25
    w_size: float = 0.05
    w_residency: float = 0.5
    name: str = "keep-score"

    def score(self, adapter: AdapterState, now: float) -> float:
        """How much keeping ``adapter`` is worth now (higher = keep)."""
        decay = 2.0 ** (-max(0.0, now - adapter.last_used) / self.half_life_s)
        young = now - adapter.tier_since < self.min_residency_s
        return (
            self.w_recency * decay
            + self.w_frequency * math.log1p(adapter.hits * decay)
            + self.w_priority * adapter.priority
            + self.w_reload * math.log1p(adapter.load_seconds * 1000.0)
            - self.w_size * adapter.nbytes / (1 << 20)
            + (self.w_residency if young else 0.0)
        )

    def victim(self, candidates: Sequence[AdapterState], now: float) -> AdapterState:
        """The lowest-scoring candidate."""
        return min(candidates, key=lambda a: self.score(a, now))


#: ``--eviction-policy`` name -> factory.
POLICIES: dict[str, Callable[[], EvictionPolicy]] = {"lru": LruPolicy, "keep-score": KeepScorePolicy}
