"""The offline bound: Belady's optimal eviction on one cache that holds every pod's GPU slots.

Any routing, placement and eviction serves each request from a GPU slot of some pod; all pods' slots together are
one cache of ``pods x max_loras`` entries. Belady (evict the adapter whose next use is farthest away) is the fewest
loads such a cache can do on a request sequence, prefetching included.

On the arrival order this is the issue's bound, exact for any policy that serves requests in arrival order. A
queueing system may serve them in another order (vLLM skips a request whose adapter has no slot and serves later
ones of running adapters first), so under overload it can batch the requests of one adapter and load less often
than the arrival-order bound. Belady on a run's own admission order is a lower bound on that run's loads without
any assumption; the simulator reports both.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence


def belady_misses(sequence: Sequence[int], capacity: int) -> int:
    """Misses (loads) of an optimal cache of ``capacity`` entries on ``sequence``."""
    if capacity < 1:
        raise ValueError("capacity must be >= 1")
    n = len(sequence)
    next_use = [0] * n
    last: dict[int, int] = {}
    for i in range(n - 1, -1, -1):
        a = sequence[i]
        next_use[i] = last.get(a, n)
        last[a] = i
    cache: dict[int, int] = {}
    farthest: list[tuple[int, int]] = []  # (-next use, adapter), stale entries skipped lazily
    misses = 0
    for i, a in enumerate(sequence):
        nxt = next_use[i]
        if a not in cache:
            misses += 1
            if len(cache) >= capacity:
                while True:
                    neg, victim = heapq.heappop(farthest)
                    if cache.get(victim) == -neg:
                        del cache[victim]
                        break
        cache[a] = nxt
        heapq.heappush(farthest, (-nxt, a))
    return misses
