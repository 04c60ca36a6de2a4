"""Per-tenant fairness under pressure, keyed by ``x-llm-d-inference-fairness-id`` (or its deprecated alias
``x-gateway-inference-fairness-id``).

The picker never queues requests, so fairness is a refusal rule: while every candidate endpoint is saturated, a
non-gold request whose fairness key already holds more than ``factor`` times the average in-flight count of the
active keys is refused (429), so one tenant's burst cannot take the whole saturated pool from the others.
"""

from __future__ import annotations


class FairShare:
    """In-flight requests per fairness key."""

    def __init__(self, factor: float) -> None:
        """``factor`` > 1: how far above the average share a key may go while the pool is saturated."""
        if factor <= 1:
            raise ValueError("the fair-share factor must be above 1")
        self.factor = factor
        self.counts: dict[str, int] = {}
        self.total = 0

    def over_share(self, key: str) -> bool:
        """Would one more request put ``key`` above ``factor`` x the average in-flight per active key?"""
        mine = self.counts.get(key, 0) + 1
        active = len(self.counts) + (key not in self.counts)
        return mine > self.factor * max(1.0, (self.total + 1) / active)

    def start(self, key: str) -> None:
        """A request of ``key`` went out."""
        self.counts[key] = self.counts.get(key, 0) + 1
        self.total += 1

    def finish(self, key: str) -> None:
        """A request of ``key`` ended."""
        count = self.counts.get(key, 0) - 1
        if count < 0:
            return
        self.total -= 1
        if count:
            self.counts[key] = count
        else:
            del self.counts[key]
