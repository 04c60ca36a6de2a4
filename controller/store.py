"""The controller's Redis side: read what sidecars and pickers publish, write target states and routes incrementally.

The controller is the only writer of ``TargetState`` and ``RouteTable`` keys. It remembers what it last wrote (read
back from Redis when it becomes leader) and writes a key only when its content changed, bumping the key's
``generation`` and publishing a change notice, so a reconcile that changes nothing writes nothing.

It is level-triggered against Redis too: ``repair`` (every reconcile pass) reads the keys back and rewrites any that
is missing or differs from what was last written (a Redis restart, a forged or stale copy), with a generation above
both, so a lost or overwritten key is back within one resync period. Every payload names its ``writer``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field

import orjson
import redis.asyncio as aioredis

from loraplane.api import (
    AdapterTarget,
    PickerCounters,
    RequestRates,
    ResidencyReport,
    RouteEntry,
    RouteTable,
    TargetState,
    keys,
    read_payload_or_none,
    validation,
)

log = logging.getLogger(__name__)


@dataclass
class PoolReadings:
    """What Redis says about one pool right now."""

    reports: list[ResidencyReport] = field(default_factory=list)
    #: the pool's rates: every picker replica's summed (``RequestRates.combine``)
    rates: RequestRates | None = None
    counters: list[PickerCounters] = field(default_factory=list)
    #: each replica's own rates, as it published them
    replica_rates: list[RequestRates] = field(default_factory=list)


def _text(raw: bytes | str) -> str:
    return raw.decode() if isinstance(raw, bytes) else raw


class RedisStore:
    """Reads a pool's reports, rates and counters; writes its target states and route table when they change."""

    def __init__(self, client: aioredis.Redis, clock: Callable[[], float], writer: str | None = None) -> None:
        """``writer`` names this controller incarnation in every payload (e.g. ``identity@start-ms``)."""
        self.client = client
        self.clock = clock
        self.writer = writer
        self.targets: dict[str, dict[str, TargetState]] = {}
        self.routes: dict[str, RouteTable | None] = {}
        #: SET commands issued since start (target states + route tables)
        self.writes = 0
        #: keys rewritten by ``repair`` since start
        self.repairs = 0

    async def read(self, pool: str) -> PoolReadings:
        """Every report (stale ones included; the caller filters), the rates summed over every picker replica and
        every replica's counters. The replicas are those with a counters key; each writes its rates with them."""
        pods = sorted(_text(p) for p in await self.client.smembers(keys.residency_index(pool)))
        pods = [p for p in pods if validation.is_pod_name(p)]
        counter_keys = [_text(k) async for k in self.client.scan_iter(match=keys.picker_counters_pattern(pool),
                                                                       count=500)]
        prefix = keys.picker_counters_pattern(pool).removesuffix("*")
        replicas = sorted(r for k in counter_keys if validation.is_pod_name(r := k.removeprefix(prefix)))
        async with self.client.pipeline(transaction=False) as pipe:
            pipe.mget([keys.residency_report(pool, p) for p in pods] or [keys.residency_report(pool, "none")])
            pipe.mget([keys.request_rates(pool, r) for r in replicas] or [keys.request_rates(pool, "none")])
            pipe.mget(counter_keys or [keys.picker_counters(pool, "none")])
            raw_reports, raw_rates, raw_counters = await pipe.execute()
        reports = [read_payload_or_none(ResidencyReport, raw, log) for raw in raw_reports]
        rates = [read_payload_or_none(RequestRates, raw, log) for raw in raw_rates]
        counters = [read_payload_or_none(PickerCounters, raw, log) for raw in raw_counters]
        replica_rates = [r for r in rates if r is not None and r.pool == pool]
        return PoolReadings(
            reports=[r for r in reports if r is not None and r.pool == pool],
            rates=RequestRates.combine(pool, replica_rates),
            counters=[c for c in counters if c is not None],
            replica_rates=replica_rates,
        )

    async def load_written(self, pool: str) -> dict[str, TargetState]:
        """Read back the target states and route table last written for ``pool`` (on becoming leader)."""
        target_keys = [k async for k in self.client.scan_iter(match=keys.target_state_pattern(pool), count=500)]
        raws = await self.client.mget(target_keys) if target_keys else []
        states = [read_payload_or_none(TargetState, raw, log) for raw in raws]
        self.targets[pool] = {s.pod: s for s in states if s is not None and s.pool == pool}
        self.routes[pool] = read_payload_or_none(RouteTable, await self.client.get(keys.route_table(pool)), log)
        return self.targets[pool]

    def written_targets(self, pool: str) -> dict[str, TargetState]:
        """The target states last written (or read back) for ``pool``."""
        return self.targets.get(pool, {})

    async def write_routes(self, pool: str, models: Mapping[str, RouteEntry], base_model: str | None,
                           staging_pods: Collection[str] = ()) -> bool:
        """Write the route table if its models, base model or staging pods changed; True when written."""
        old = self.routes.get(pool)
        staging = sorted(staging_pods)
        if old is not None and (old.models, old.base_model, old.staging_pods) == (dict(models), base_model, staging):
            return False
        table = RouteTable(pool=pool, generation=(old.generation + 1) if old else 1, base_model=base_model,
                           models=dict(sorted(models.items())), staging_pods=staging, updated_at=self.clock(),
                           writer=self.writer)
        await self._write_routes(table)
        return True

    async def _write_routes(self, table: RouteTable) -> None:
        async with self.client.pipeline(transaction=False) as pipe:
            pipe.set(keys.route_table(table.pool), table.to_json())
            pipe.publish(keys.routes_changed_channel(table.pool), str(table.generation))
            await pipe.execute()
        self.routes[table.pool] = table
        self.writes += 1

    async def _write_target_states(self, pool: str, states: Sequence[TargetState]) -> None:
        async with self.client.pipeline(transaction=False) as pipe:
            for state in states:
                pipe.set(keys.target_state(pool, state.pod), state.to_json())
                pipe.publish(keys.target_changed_channel(pool), state.pod)
            await pipe.execute()
        written = self.targets.setdefault(pool, {})
        for state in states:
            written[state.pod] = state
        self.writes += len(states)

    async def repair(self, pool: str) -> list[str]:
        """Rewrite every key of ``pool`` whose stored value is not what this controller last wrote (missing after a
        Redis restart, or overwritten); returns the keys rewritten. Each gets a generation above both copies'."""
        table = self.routes.get(pool)
        states = sorted(self.targets.get(pool, {}).values(), key=lambda s: s.pod)
        wanted: list[tuple[str, RouteTable | TargetState]] = [(keys.target_state(pool, s.pod), s) for s in states]
        if table is not None:
            wanted.append((keys.route_table(pool), table))
        if not wanted:
            return []
        stored = await self.client.mget([key for key, _ in wanted])
        bad = [(key, ours, raw) for (key, ours), raw in zip(wanted, stored, strict=True) if raw != ours.to_json()]
        if not bad:
            return []
        now = self.clock()
        fixed_states = []
        for key, ours, raw in bad:
            fixed = ours.model_copy(update={"generation": max(ours.generation, _generation(raw)) + 1,
                                            "updated_at": now, "writer": self.writer})
            log.warning("redis key %s %s; rewriting generation %d", key,
                        "was missing" if raw is None else "held another copy", fixed.generation)
            if isinstance(fixed, RouteTable):
                await self._write_routes(fixed)
            else:
                fixed_states.append(fixed)
        if fixed_states:
            await self._write_target_states(pool, fixed_states)
        self.repairs += len(bad)
        return [key for key, _, _ in bad]

    async def write_targets(self, pool: str, targets: Mapping[str, Sequence[AdapterTarget]],
                            retired: Sequence[str] = ()) -> list[str]:
        """Write each pod's target state whose adapters (or the pool's ``retired`` served names) changed; returns the
        pods written."""
        written = self.targets.setdefault(pool, {})
        retired_names = sorted(retired)
        changed = []
        for pod, adapters in sorted(targets.items()):
            wanted = sorted(adapters, key=lambda a: a.served_name)
            old = written.get(pod)
            if old is not None and old.adapters == wanted and old.retired == retired_names:
                continue
            changed.append(TargetState(pool=pool, pod=pod, generation=(old.generation + 1) if old else 1,
                                       adapters=wanted, updated_at=self.clock(), writer=self.writer,
                                       retired=retired_names))
        if not changed:
            return []
        await self._write_target_states(pool, changed)
        return [s.pod for s in changed]


def _generation(raw: bytes | str | None) -> int:
    """The ``generation`` of a stored payload (0 when there is none or it does not parse)."""
    if raw is None:
        return 0
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return 0
    generation = value.get("generation") if isinstance(value, dict) else None
    return generation if isinstance(generation, int) and generation >= 0 else 0

