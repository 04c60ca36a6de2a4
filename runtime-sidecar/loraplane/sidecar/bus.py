"""Redis: read this pod's TargetState, watch its change notices, publish its ResidencyReport (and KvBlockSet).

Redis is a bus, not a lifeline: when it is unreachable every call fails fast (short socket timeouts) and further
attempts wait for an exponential backoff; the sidecar keeps its last good target and keeps the runtime as it is.
A missing target key means "no instruction", never "unload everything" (an emptied or restarted Redis must not
empty the pods); only a TargetState with an empty adapter list does that.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from redis.exceptions import RedisError, ResponseError

from loraplane.api import (
    KvBlockSet,
    MissingSpecs,
    PayloadError,
    ResidencyReport,
    TargetState,
    keys,
    read_payload,
)
from loraplane.api.catalogue import SpecCache
from loraplane.credentials import async_redis
from loraplane.sidecar.reconcile import Backoff
from loraplane.waits import sleep_or_stop

log = logging.getLogger(__name__)


class RedisUnavailable(Exception):
    """Redis did not answer (or is in its backoff window)."""


class RedisRefused(RedisUnavailable):
    """Redis answered but refused the command (an error reply: out of memory under ``noeviction``, no permission):
    the write did not land, as if Redis were down, but Redis is reachable and the next attempt is not held back."""


class InvalidTarget(ValueError):
    """The stored TargetState is not one this sidecar may apply."""


class RedisBus:
    """This pod's view of the shared Redis."""

    def __init__(
        self,
        url: str,
        pool: str,
        pod: str,
        backoff: Backoff | None = None,
        clock: Callable[[], float] = time.monotonic,
        socket_timeout_s: float = 1.0,
    ) -> None:
        self.pool, self.pod = pool, pod
        self.target_key = keys.target_state(pool, pod)
        #: the catalogue entries this pod's states named (a state's refs are resolved through it)
        self.specs = SpecCache(pool)
        self.report_key = keys.residency_report(pool, pod)
        self._redis = async_redis(
            url, socket_timeout=socket_timeout_s, socket_connect_timeout=socket_timeout_s, retry_on_timeout=False
        )
        self._backoff = backoff or Backoff(base_s=0.2, cap_s=5.0)
        self._clock = clock
        self._failures = 0
        self._not_before = 0.0
        self.connected = False
        #: the last refusal logged (one warning per kind of refusal in a row, not one per heartbeat)
        self._refusal: str | None = None
        #: commands Redis refused since start
        self.refusals = 0

    def _check_window(self) -> None:
        if self._failures and self._clock() < self._not_before:
            raise RedisUnavailable(f"redis down, next attempt in {self._not_before - self._clock():.1f} s")

    def _ok(self) -> None:
        if self._failures:
            log.info("redis reachable again")
        elif self._refusal is not None:
            log.info("redis accepts writes again")
        self._failures, self.connected, self._refusal = 0, True, None

    def _failed(self, exc: Exception) -> RedisUnavailable:
        if isinstance(exc, ResponseError):  # an answer, not a dead connection: say what Redis said
            self.refusals += 1
            kind = str(exc).rsplit(": ", 1)[-1]
            if kind != self._refusal:
                log.warning("redis refused the write (%s: %s); it is reachable, retrying every heartbeat and keeping "
                            "the last good target", type(exc).__name__, exc)
            self._refusal = kind
            return RedisRefused(str(exc))
        self._failures += 1
        self._not_before = self._clock() + self._backoff.delay(self._failures)
        if self.connected:
            log.warning("redis unreachable, keeping the last good target: %s", exc)
        self.connected = False
        return RedisUnavailable(str(exc))

    async def read_target(self) -> TargetState | None:
        """The stored target, its refs resolved from the pool's catalogue (None when there is no key);
        RedisUnavailable or InvalidTarget otherwise (a ref whose catalogue entry is missing included: the whole
        target waits, never half of it)."""
        self._check_window()
        try:
            raw = await self._redis.get(self.target_key)
        except (RedisError, OSError) as exc:
            raise self._failed(exc) from exc
        self._ok()
        if raw is None:
            return None
        try:
            target = read_payload(TargetState, raw)
        except PayloadError as exc:
            raise InvalidTarget(f"{self.target_key}: {exc}") from exc
        if (target.pool, target.pod) != (self.pool, self.pod):
            raise InvalidTarget(f"{self.target_key} names pool/pod {target.pool}/{target.pod}")
        try:
            return await self.specs.resolve(self._redis, target)
        except (RedisError, OSError) as exc:
            raise self._failed(exc) from exc
        except MissingSpecs as exc:
            raise InvalidTarget(f"{self.target_key} generation {target.generation}: {exc}") from exc

    async def publish(self, report: ResidencyReport) -> None:
        """SET the report with its TTL, add the pod to the index, and PUBLISH the change notice (one round trip)."""
        self._check_window()
        ttl_ms = max(1, int(report.ttl_seconds * 1000))
        try:
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.set(self.report_key, report.to_json(), px=ttl_ms)
                pipe.sadd(keys.residency_index(self.pool), self.pod)
                pipe.publish(keys.residency_changed_channel(self.pool), self.pod)
                await pipe.execute()
        except (RedisError, OSError) as exc:
            raise self._failed(exc) from exc
        self._ok()

    async def publish_blocks(self, block_set: KvBlockSet) -> None:
        """SET the pod's prefix-cache block set with its TTL and PUBLISH its change notice (one round trip)."""
        self._check_window()
        try:
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.set(keys.kv_blocks(self.pool, self.pod), block_set.to_json(),
                         px=max(1, int(block_set.ttl_seconds * 1000)))
                pipe.publish(keys.kv_blocks_changed_channel(self.pool), self.pod)
                await pipe.execute()
        except (RedisError, OSError) as exc:
            raise self._failed(exc) from exc
        self._ok()

    async def watch_targets(self, notify: Callable[[], None], stop: asyncio.Event) -> None:
        """Call ``notify`` on every change notice for this pod, and after every (re)subscription."""
        channel = keys.target_changed_channel(self.pool)
        failures = 0
        while not stop.is_set():
            pubsub = self._redis.pubsub()
            try:
                await pubsub.subscribe(channel)
                failures = 0
                notify()
                while not stop.is_set():
                    message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                    if message is not None and message.get("data") in (self.pod, self.pod.encode()):
                        notify()
            except (RedisError, OSError) as exc:
                failures += 1
                log.debug("target subscription lost: %s", exc)
                await sleep_or_stop(stop, self._backoff.delay(failures))
            finally:
                with contextlib.suppress(RedisError, OSError):
                    await pubsub.aclose()

    async def close(self) -> None:
        """Close the connections."""
        await self._redis.aclose()
