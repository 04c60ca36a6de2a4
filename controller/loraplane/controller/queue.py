"""A rate-limited work queue in controller-runtime's shape (client-go's ``workqueue``), on asyncio.

- ``add(key)``: queue a key now. A key already waiting is not queued twice; a key being processed is queued again
  only once it is ``done`` (so it is never processed by two workers at once, and never loses a change).
- ``add_after(key, delay, background=False)``: queue it at ``clock() + delay`` (the earliest of several such
  requests wins). A ``background`` item (a periodic resync) yields to every other due key: a change or a due gate
  is handed out first.
- ``add_rate_limited(key)``: queue it after its per-key exponential backoff (``base * 2**failures``, capped), and
  count one more failure; ``forget(key)`` resets the count after a success.
- ``get()`` waits for the next due key and marks it processing; ``done(key)`` ends that.

The clock is injected (monotonic seconds).
"""

from __future__ import annotations

import asyncio
import heapq
import time
from collections import deque
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class ShutDown(Exception):
    """The queue was shut down while a worker waited."""


class WorkQueue(Generic[K]):
    """See the module docstring."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, base_delay: float = 0.05,
                 max_delay: float = 30.0) -> None:
        self.clock = clock
        self.base_delay = base_delay
        self.max_delay = max_delay
        self._ready: deque[K] = deque()
        #: due background items, handed out after ``_ready``
        self._background: deque[K] = deque()
        self._delayed_background: set[K] = set()
        #: keys added in the background while being processed
        self._dirty_background: set[K] = set()
        self._dirty: set[K] = set()
        self._processing: set[K] = set()
        self._due: dict[K, float] = {}
        self._heap: list[tuple[float, int, K]] = []
        self._seq = 0
        self._failures: dict[K, int] = {}
        self._changed = asyncio.Event()
        self._shut = False

    def __len__(self) -> int:
        """Keys waiting now (not counting delayed ones)."""
        return len(self._ready) + len(self._background)

    def add(self, key: K) -> None:
        """Queue ``key`` now (see the module docstring for dedup)."""
        self._add(key, background=False)

    def _add(self, key: K, background: bool) -> None:
        if self._shut:
            return
        if key in self._dirty:
            if not background:  # a change outranks the resync it was waiting as
                self._dirty_background.discard(key)
                if key in self._background:
                    self._background.remove(key)
                    self._ready.append(key)
            return
        self._dirty.add(key)
        self._due.pop(key, None)
        self._delayed_background.discard(key)
        if key in self._processing:
            if background:
                self._dirty_background.add(key)
        else:
            (self._background if background else self._ready).append(key)
            self._changed.set()

    def knows(self, key: K) -> bool:
        """True when ``key`` is waiting, delayed or being processed."""
        return key in self._dirty or key in self._processing or key in self._due

    def add_after(self, key: K, delay: float, background: bool = False) -> None:
        """Queue ``key`` once ``delay`` seconds have passed (at once when ``delay <= 0``)."""
        if delay <= 0:
            self._add(key, background)
            return
        if self._shut or key in self._dirty:
            return
        at = self.clock() + delay
        if at < self._due.get(key, float("inf")):
            self._due[key] = at
            if background:
                self._delayed_background.add(key)
            else:
                self._delayed_background.discard(key)
            self._seq += 1
            heapq.heappush(self._heap, (at, self._seq, key))
            self._changed.set()

    def backoff(self, key: K) -> float:
        """The delay ``add_rate_limited`` would use for ``key`` now."""
        return min(self.max_delay, self.base_delay * 2 ** self._failures.get(key, 0))

    def add_rate_limited(self, key: K) -> float:
        """Queue ``key`` after its backoff and count a failure; returns the delay used."""
        delay = self.backoff(key)
        self._failures[key] = self._failures.get(key, 0) + 1
        self.add_after(key, delay)
        return delay

    def failures(self, key: K) -> int:
        """Failures counted for ``key`` since it was last forgotten."""
        return self._failures.get(key, 0)

    def forget(self, key: K) -> None:
        """Reset ``key``'s backoff (after a successful reconcile)."""
        self._failures.pop(key, None)

    def next_due(self) -> float | None:
        """When the earliest delayed key becomes due (clock seconds); None when none is delayed."""
        self._drop_stale()
        return self._heap[0][0] if self._heap else None

    def _drop_stale(self) -> None:
        while self._heap and self._due.get(self._heap[0][2]) != self._heap[0][0]:
            heapq.heappop(self._heap)

    def _promote_due(self) -> None:
        now = self.clock()
        self._drop_stale()
        while self._heap and self._heap[0][0] <= now:
            _, _, key = heapq.heappop(self._heap)
            del self._due[key]
            background = key in self._delayed_background
            self._delayed_background.discard(key)
            self._add(key, background)
            self._drop_stale()

    def pop_ready(self) -> K | None:
        """The next due key, marked processing; None when nothing is due."""
        self._promote_due()
        if not self._ready and not self._background:
            return None
        key = (self._ready or self._background).popleft()
        self._dirty.discard(key)
        self._processing.add(key)
        return key

    async def get(self) -> K:
        """Wait for the next due key and mark it processing; ShutDown once the queue is shut down."""
        while True:
            if self._shut:
                raise ShutDown
            key = self.pop_ready()
            if key is not None:
                return key
            self._changed.clear()
            due = self.next_due()
            timeout = None if due is None else max(0.0, due - self.clock())
            try:
                await asyncio.wait_for(self._changed.wait(), timeout)
            except TimeoutError:
                pass

    def done(self, key: K) -> None:
        """``key``'s processing ended; it is queued again if it was added meanwhile."""
        self._processing.discard(key)
        if key in self._dirty:
            background = key in self._dirty_background
            self._dirty_background.discard(key)
            (self._background if background else self._ready).append(key)
            self._changed.set()

    def shut_down(self) -> None:
        """Stop handing out keys; waiting workers get ShutDown."""
        self._shut = True
        self._changed.set()
