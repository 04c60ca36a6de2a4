"""Picker replicas that decide as one: each publishes its requests in flight and adds the others' to its own.

Envoy balances streams over the picker replicas, so each sees only its share of the pool's traffic. Every decision
that reads ``in_flight`` (load and saturation, a revision's holders with requests in flight, GPU-slot room, the
queue's release) would otherwise judge a pod by a fraction of what it runs. ``InFlightShare`` writes this replica's
counts (``PickerInFlight`` under ``keys.picker_in_flight``, expiring after a few periods) every ``period_s`` while
they change, reads the other replicas' keys in one ``MGET`` and hands their sum to the ``InFlightTracker``, which keeps
the snapshot at own (exact, immediate) + others (at most a period or two old). The replicas are found by a ``SCAN``
every ``discover_s``. A replica that stops leaves with its key's expiry; when Redis cannot be read the others' last
counts are dropped after the same time, so a lost bus degrades to each replica's own view, never to stale load.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable, Sequence

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from loraplane.api import EndpointInFlight, PickerInFlight, keys, read_payload_or_none
from loraplane.picker.snapshot import InFlightTracker
from loraplane.waits import sleep_or_stop

log = logging.getLogger(__name__)

#: seconds between publications of this replica's counts and reads of the others'
SHARE_PERIOD_S = 0.1
#: a replica's key lives this many periods (at least a second) after its last write
TTL_PERIODS = 10
#: seconds between scans for the other replicas' keys
DISCOVER_S = 2.0


def summed(parts: Sequence[PickerInFlight]) -> dict[str, EndpointInFlight]:
    """The replicas' counts summed per endpoint address (and per served name there)."""
    total: dict[str, EndpointInFlight] = {}
    for part in parts:
        for address, counts in part.endpoints.items():
            into = total.get(address)
            if into is None:
                total[address] = counts.model_copy(deep=True)
                continue
            into.requests += counts.requests
            into.prefilling += counts.prefilling
            into.prefill_tokens += counts.prefill_tokens
            for name, n in counts.by_name.items():
                into.by_name[name] = into.by_name.get(name, 0) + n
    return total


class InFlightShare:
    """Publishes ``tracker``'s own counts as ``replica`` of ``pool`` and feeds it the other replicas' (see module)."""

    def __init__(
        self,
        client: aioredis.Redis,
        pool: str,
        replica: str,
        tracker: InFlightTracker,
        clock: Callable[[], float],
        period_s: float = SHARE_PERIOD_S,
        discover_s: float = DISCOVER_S,
    ) -> None:
        self.client = client
        self.pool = pool
        self.replica = replica
        self.tracker = tracker
        self.clock = clock
        self.period_s = period_s
        self.discover_s = discover_s
        self.ttl_ms = max(1000, math.ceil(period_s * TTL_PERIODS * 1000))
        self._own_key = keys.picker_in_flight(pool, replica)
        self._peer_keys: list[str] = []
        self._next_discovery = -math.inf
        self._published: dict[str, EndpointInFlight] | None = None
        self._last_write = -math.inf
        self._last_read = -math.inf

    async def once(self) -> None:
        """One period: publish if the counts changed (or half the key's life went by), read the others' counts."""
        now = self.clock()
        own = self.tracker.own()
        if own != self._published or (now - self._last_write) * 1000 >= self.ttl_ms / 2:
            payload = PickerInFlight(pool=self.pool, replica=self.replica, published_at=now, endpoints=own)
            await self.client.set(self._own_key, payload.to_json(), px=self.ttl_ms)
            self._published, self._last_write = own, now
        if now >= self._next_discovery:
            await self._discover()
            self._next_discovery = now + self.discover_s
        parts: list[PickerInFlight] = []
        if self._peer_keys:
            for raw in await self.client.mget(self._peer_keys):
                part = read_payload_or_none(PickerInFlight, raw, log)
                if part is not None and part.pool == self.pool and part.replica != self.replica:
                    parts.append(part)
        self.tracker.set_remote(summed(parts))
        self._last_read = now

    async def _discover(self) -> None:
        found = []
        async for key in self.client.scan_iter(match=keys.picker_in_flight_pattern(self.pool), count=100):
            name = key.decode() if isinstance(key, bytes) else key
            if name != self._own_key:
                found.append(name)
        self._peer_keys = sorted(found)

    async def tick(self) -> None:
        """``once``, surviving Redis errors: the others' counts are kept for a key's life, then dropped (this
        replica then routes on its own counts alone)."""
        try:
            await self.once()
        except (RedisError, OSError) as exc:
            log.debug("could not share in-flight counts: %s", exc)
            if (self.clock() - self._last_read) * 1000 >= self.ttl_ms and self.tracker.remote:
                log.warning("dropping the other picker replicas' in-flight counts: redis unreadable (%s)", exc)
                self.tracker.set_remote({})

    async def run(self, stop: asyncio.Event) -> None:
        """``tick`` every period until ``stop``."""
        while not stop.is_set():
            await self.tick()
            await sleep_or_stop(stop, self.period_s)

    async def withdraw(self) -> None:
        """Publish no requests in flight (a clean shutdown: the others stop counting this replica's requests at once;
        the key then expires)."""
        payload = PickerInFlight(pool=self.pool, replica=self.replica, published_at=self.clock())
        await self.client.set(self._own_key, payload.to_json(), px=self.ttl_ms)
        self._published, self._last_write = {}, payload.published_at
