"""The controller's Redis side: read what sidecars and pickers publish, write target states and routes incrementally.

The controller is the only writer of ``TargetState`` and ``RouteTable`` keys. It remembers what it last wrote (read
back from Redis when it becomes leader) and writes a key only when its content changed, bumping the key's
``generation`` and publishing a change notice, so a reconcile that changes nothing writes nothing.

A target state is written by reference (``TargetState.by_reference``): each served revision's ``TargetSpec`` once
per pool in its catalogue key (``keys.target_spec``, before any state naming it), each pod's state as served names,
tiers and the spec's ``cache_key`` -- about 100 bytes an entry instead of 800, so a change to one pod writes
kilobytes. A catalogue entry no state names any more is left to expire (``SPEC_EXPIRY_SECONDS``). In memory the
store keeps each state whole (planning reads ``previous_targets``).

It is level-triggered against Redis too: ``repair`` (every reconcile pass) reads the keys back and rewrites any that
is missing or differs from what was last written (a Redis restart, a forged or stale copy), with a generation above
both, so a lost or overwritten key is back within one resync period. Every payload names its ``writer``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
import redis.asyncio as aioredis

from loraplane.api import (
    AdapterTarget,
    MissingSpecs,
    PickerCounters,
    RequestRates,
    ResidencyReport,
    RouteEntry,
    RouteTable,
    StatusRecord,
    TargetSpec,
    TargetState,
    keys,
    read_payload_or_none,
    validation,
)
from loraplane.api.routedeltas import RouteDelta, RouteHead, apply, diff

log = logging.getLogger(__name__)

#: a catalogue entry that no target state names any more expires after this long (a reader that read a state naming
#: it just before has long resolved it)
SPEC_EXPIRY_SECONDS = 3600


@dataclass
class PoolReadings:
    """What Redis says about one pool right now."""

    reports: list[ResidencyReport] = field(default_factory=list)
    #: the pool's rates: every picker replica's summed (``RequestRates.combine``)
    rates: RequestRates | None = None
    counters: list[PickerCounters] = field(default_factory=list)
    #: each replica's own rates, as it published them
    replica_rates: list[RequestRates] = field(default_factory=list)
    #: pod -> a number that changes whenever what planning reads of its report changes (heartbeat, load figures
    #: and per-adapter counters left out)
    report_versions: dict[str, int] = field(default_factory=dict)


def _text(raw: bytes | str) -> str:
    return raw.decode() if isinstance(raw, bytes) else raw


#: what a report's heartbeat is spelled as in its JSON (``ResidencyReport.to_json``)
_HEARTBEAT = b'"heartbeatAt":'
#: the parts of a report planning does not read: they change with every heartbeat
_DYNAMIC: dict[str, Any] = {
    "heartbeat_at": True,
    "load": {"queue_depth", "running", "active_tokens", "kv_utilization", "recent_evictions", "load_seconds"},
    "adapters": {"__all__": {"in_flight", "hits", "loads", "evictions"}},
}


#: what a picker payload's publishing time is spelled as (``RequestRates``, ``PickerCounters``)
_PUBLISHED = b'"publishedAt":'


def _without_heartbeat(raw: bytes, marker: bytes = _HEARTBEAT) -> tuple[bytes, float | None]:
    """The payload's bytes with one number field's value (the report's heartbeat) cut out, and that value (None:
    not found where expected)."""
    at = raw.find(marker)
    if at < 0:
        return raw, None
    start = at + len(marker)
    end = raw.find(b",", start)
    if end < 0:
        return raw, None
    try:
        return raw[:start] + raw[end:], float(raw[start:end])
    except ValueError:
        return raw, None


class _ReadCache:
    """One pool's payloads as last read: each parsed again only when its bytes change."""

    def __init__(self) -> None:
        #: pod -> (its report's bytes without the heartbeat, the report as read, what planning reads of it, the
        #: heartbeat its sidecar wrote)
        self.reports: dict[str, tuple[bytes, ResidencyReport, dict[str, Any], float]] = {}
        self.versions: dict[str, int] = {}
        self.payloads: dict[tuple[str, str], tuple[bytes, Any]] = {}
        self._combined: tuple[tuple[int, ...], RequestRates | None] | None = None

    def report(self, pod: str, raw: bytes | str | None, now: float) -> ResidencyReport | None:
        """``pod``'s report with ``heartbeat_at`` the time this controller first read its heartbeat (``now`` when the
        sidecar wrote a new one): reports are aged by the controller's clock, never the sidecar's."""
        if raw is None:
            return None
        data = raw.encode() if isinstance(raw, str) else raw
        rest, heartbeat = _without_heartbeat(data)
        hit = self.reports.get(pod)
        if hit is not None and heartbeat is not None and hit[0] == rest:
            if hit[3] == heartbeat:
                return hit[1]
            report = hit[1].model_copy(update={"heartbeat_at": now})
            self.reports[pod] = (rest, report, hit[2], heartbeat)
            return report
        parsed = read_payload_or_none(ResidencyReport, data, log)
        if parsed is None:
            return None
        sent = parsed.heartbeat_at
        received = hit[1].heartbeat_at if hit is not None and hit[3] == sent else now
        report = parsed.model_copy(update={"heartbeat_at": received})
        view = report.model_dump(exclude=_DYNAMIC)
        if hit is None or hit[2] != view:
            self.versions[pod] = self.versions.get(pod, 0) + 1
        self.reports[pod] = (rest if heartbeat is not None else b"", report, view, sent)
        return report

    def payload(self, model: type[Any], key: tuple[str, str], raw: bytes | str | None) -> Any:
        if raw is None:
            return None
        data = raw.encode() if isinstance(raw, str) else raw
        rest, published = _without_heartbeat(data, _PUBLISHED)
        hit = self.payloads.get(key)
        if hit is not None and published is not None and hit[0] == rest:  # only republished: not parsed again
            parsed = hit[1]
            if parsed is not None and parsed.published_at != published:
                parsed = parsed.model_copy(update={"published_at": published})
                self.payloads[key] = (rest, parsed)
            return parsed
        parsed = read_payload_or_none(model, data, log)
        self.payloads[key] = (rest if published is not None else b"", parsed)
        return parsed

    def combined(self, pool: str, parts: list[RequestRates]) -> RequestRates | None:
        """``RequestRates.combine``, the same object while every part is (the planner compares by identity first)."""
        ids = tuple(id(p) for p in parts)
        if self._combined is None or self._combined[0] != ids:
            self._combined = (ids, RequestRates.combine(pool, parts))
        return self._combined[1]

    def forget(self, pods: set[str], keys_: set[tuple[str, str]]) -> None:
        for pod in [p for p in self.reports if p not in pods]:
            del self.reports[pod]
        for key in [k for k in self.payloads if k not in keys_]:
            del self.payloads[key]


#: the most deltas after a snapshot before the table is written whole again
MAX_CHAIN = 256
#: seconds after a snapshot before the table is written whole again at its next change
CHAIN_SECONDS = 3600.0
#: a delta key's TTL (the chain is rewritten as a snapshot long before: ``CHAIN_SECONDS``)
DELTA_TTL_SECONDS = 86400


@dataclass
class _Chain:
    """One pool's route keys as written: the snapshot (its generation, its size), then the deltas and the head."""

    snapshot: int
    snapshot_bytes: int
    #: (key, the bytes written there), the snapshot first, the head last
    raws: list[tuple[str, bytes]]
    started: float
    delta_bytes: int = 0
    writer: str | None = None


def chain_writer(chain: _Chain) -> str | None:
    return chain.writer


def _bytes_of(raw: bytes | str | None) -> bytes | None:
    return raw.encode() if isinstance(raw, str) else raw


class RedisStore:
    """Reads a pool's reports, rates and counters; writes its target states and route table when they change."""

    def __init__(self, client: aioredis.Redis, clock: Callable[[], float], writer: str | None = None,
                 route_snapshot_bytes: int = 64 << 10) -> None:
        """``writer`` names this controller incarnation in every payload (e.g. ``identity@start-ms``)."""
        self.client = client
        self.clock = clock
        self.writer = writer
        #: pool -> pod -> the target state last written, whole (its refs resolved)
        self.targets: dict[str, dict[str, TargetState]] = {}
        #: pool -> served name -> the catalogue entry written (or read back) and named by some state
        self.specs: dict[str, dict[str, TargetSpec]] = {}
        #: pool -> pod -> the target list last compared with its written state (``write_targets``)
        self._compared: dict[str, dict[str, Sequence[AdapterTarget]]] = {}
        self.routes: dict[str, RouteTable | None] = {}
        #: SET commands issued since start (target states + route tables)
        self.writes = 0
        #: keys rewritten by ``repair`` since start
        self.repairs = 0
        #: bytes of the values written since start (target states + route tables)
        self.bytes_written = 0
        #: pool -> its payloads as last read (``read``)
        self._parsed: dict[str, _ReadCache] = {}
        #: key -> the bytes this controller last wrote there (``repair`` compares Redis with them)
        self._raw: dict[str, bytes] = {}
        #: pool -> its route table's keys as this controller wrote (or read back) them
        self._chains: dict[str, _Chain] = {}
        #: a route table whose snapshot is at most this many bytes is always written whole (a delta saves little)
        self.route_snapshot_bytes = route_snapshot_bytes
        #: ``check``: pools whose keys hold more bytes are compared key by key only every ``thorough_seconds``
        self.thorough_bytes = 1 << 20
        self.thorough_seconds = 10.0
        self._thorough_at: dict[str, float] = {}

    async def read(self, pool: str) -> PoolReadings:
        """Every report (stale ones included; the caller filters), each with ``heartbeat_at`` when this controller
        received it (its own clock: a sidecar's clock that runs ahead or behind ages nothing), the rates summed over
        every picker replica and every replica's counters. The replicas are those with a counters key; each writes its rates with them.

        A payload is parsed only when its bytes changed since the last read (a report whose only change is its
        heartbeat is not parsed again), and ``report_versions`` counts, per pod, the changes of what planning reads
        of its report (not its load figures or per-adapter counters): the planner's input signature."""
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
        cache = self._parsed.setdefault(pool, _ReadCache())
        now = self.clock()
        reports = [cache.report(pod, raw, now) for pod, raw in zip(pods or ["none"], raw_reports, strict=True)]
        rates = [cache.payload(RequestRates, ("rates", r), raw) for r, raw in zip(replicas or ["none"], raw_rates,
                                                                                    strict=True)]
        counters = [cache.payload(PickerCounters, ("counters", k), raw)
                    for k, raw in zip(counter_keys or ["none"], raw_counters, strict=True)]
        cache.forget(set(pods), {("rates", r) for r in replicas} | {("counters", k) for k in counter_keys})
        replica_rates = [r for r in rates if r is not None and r.pool == pool]
        fresh = [r for r in reports if r is not None and r.pool == pool]
        return PoolReadings(
            reports=fresh,
            rates=cache.combined(pool, replica_rates),
            counters=[c for c in counters if c is not None],
            replica_rates=replica_rates,
            report_versions={r.pod: cache.versions.get(r.pod, 0) for r in fresh},
        )

    async def load_written(self, pool: str) -> dict[str, TargetState]:
        """Read back the target states and route table last written for ``pool`` (on becoming leader)."""
        target_keys = [k async for k in self.client.scan_iter(match=keys.target_state_pattern(pool), count=500)]
        raws = await self.client.mget(target_keys) if target_keys else []
        states = [s for raw in raws if (s := read_payload_or_none(TargetState, raw, log)) is not None and s.pool == pool]
        spec_keys = [k async for k in self.client.scan_iter(match=keys.target_spec_pattern(pool), count=500)]
        specs = [read_payload_or_none(TargetSpec, raw, log) for raw in (await self.client.mget(spec_keys) if spec_keys else [])]
        catalogue = {s.served_name: s for s in specs if s is not None and s.pool == pool}
        self.targets[pool] = {}
        self._compared.pop(pool, None)
        for state in states:
            try:
                self.targets[pool][state.pod] = state.resolve(catalogue)
            except MissingSpecs as exc:  # not taken as written: the next plan writes the pod's state again
                log.warning("target state of pod %s in pool %s not read back: %s", state.pod, pool, exc)
        named = {a.served_name for state in self.targets[pool].values() for a in state.adapters}
        self.specs[pool] = {n: s for n, s in catalogue.items() if n in named}
        for prefix in (keys.target_state_pattern(pool), keys.target_spec_pattern(pool)):
            self._raw = {k: v for k, v in self._raw.items() if not k.startswith(prefix.removesuffix("*"))}
        await self._load_routes(pool)
        return self.targets[pool]

    async def _load_routes(self, pool: str) -> None:
        """The route table as its keys hold it (snapshot, head, deltas), and those keys' bytes as the chain this
        controller goes on from (``repair`` compares them)."""
        head_raw, snapshot_raw = (_bytes_of(r) for r in await self.client.mget([keys.route_head(pool),
                                                                                keys.route_table(pool)]))
        table = read_payload_or_none(RouteTable, snapshot_raw, log)
        head = read_payload_or_none(RouteHead, head_raw, log)
        self.routes[pool] = table
        self._chains.pop(pool, None)
        if table is None or snapshot_raw is None:
            return
        chain = _Chain(table.generation, len(snapshot_raw), [(keys.route_table(pool), snapshot_raw)], self.clock(),
                       writer=table.writer)
        if head is not None and head_raw is not None and head.writer == table.writer and head.snapshot == table.generation:
            chain.raws.append((keys.route_head(pool), head_raw))
            after = [keys.route_delta(pool, g) for g in range(table.generation + 1, head.generation + 1)]
            for key, raw in zip(after, [_bytes_of(r) for r in await self.client.mget(after)] if after else [],
                                strict=True):
                delta = read_payload_or_none(RouteDelta, raw, log)
                following = apply(table, [delta]) if delta is not None else None
                if following is None or raw is None:
                    return  # the chain is broken: the next repair writes a snapshot
                table = following
                chain.raws.append((key, raw))
                chain.delta_bytes += len(raw)
            self.routes[pool] = table
            self._chains[pool] = chain
        elif head is None:
            self._chains[pool] = chain  # a table written whole, without a head (before deltas): it is the chain

    def written_targets(self, pool: str) -> dict[str, TargetState]:
        """The target states last written (or read back) for ``pool``."""
        return self.targets.get(pool, {})

    async def write_status_records(self, records: Sequence[StatusRecord]) -> None:
        """Record the statuses about to be written to revisions (before they are: a leader that dies between the two
        leaves its successor the status it meant, never an older one), in one pipeline: a pass over a pool of
        thousands of revisions takes one connection, not one each (redis-py's pool refuses more than 100)."""
        if not records:
            return
        async with self.client.pipeline(transaction=False) as pipe:
            for record in records:
                pipe.set(keys.revision_status(record.pool, record.namespace, record.name), record.to_json())
            await pipe.execute()
        self.writes += len(records)

    async def forget_status_record(self, pool: str, namespace: str, name: str) -> None:
        """Drop a deleted revision's record (``EXPIRE 0``: the controller's ACL allows no ``DEL``)."""
        await self.client.expire(keys.revision_status(pool, namespace, name), 0)

    async def read_status_records(self, pool: str) -> list[StatusRecord]:
        """Every revision's status record in ``pool`` (a replica that becomes leader reads them back)."""
        found = [k async for k in self.client.scan_iter(match=keys.revision_status_pattern(pool), count=500)]
        raws = await self.client.mget(found) if found else []
        return [r for raw in raws if (r := read_payload_or_none(StatusRecord, raw, log)) is not None and r.pool == pool]

    async def write_routes(self, pool: str, models: Mapping[str, RouteEntry], base_model: str | None,
                           staging_pods: Collection[str] = ()) -> bool:
        """Write the route table if its models, base model or staging pods changed; True when written."""
        old = self.routes.get(pool)
        staging = sorted(staging_pods)
        if old is not None and (old.models, old.base_model, old.staging_pods) == (dict(models), base_model, staging):
            if any(old.models.get(name) is not entry for name, entry in models.items()):
                # equal, other objects: kept as the plan's, so the next comparison is by identity (10,000 entries)
                self.routes[pool] = old.model_copy(update={"models": dict(models)})
            return False
        table = RouteTable(pool=pool, generation=(old.generation + 1) if old else 1, base_model=base_model,
                           models=dict(sorted(models.items())), staging_pods=staging, updated_at=self.clock(),
                           writer=self.writer)
        await self._write_routes(table, old)
        return True

    async def _write_routes(self, table: RouteTable, previous: RouteTable | None = None) -> None:
        """Write ``table``: as one delta from ``previous`` (the table this controller wrote last) and the head, or
        whole (a new snapshot and its head) where that is cheaper or there is no chain of this writer to extend
        (``routedeltas``)."""
        pool = table.pool
        chain = self._chains.get(pool)
        head_key = keys.route_head(pool)
        if (previous is not None and chain is not None and previous.writer == table.writer == chain_writer(chain)
                and previous.generation + 1 == table.generation and chain.snapshot_bytes > self.route_snapshot_bytes
                and len(chain.raws) - 2 < MAX_CHAIN and self.clock() - chain.started < CHAIN_SECONDS):
            delta_raw = diff(previous, table).to_json()
            if chain.delta_bytes + len(delta_raw) <= chain.snapshot_bytes:
                head_raw = RouteHead(pool=pool, generation=table.generation, snapshot=chain.snapshot,
                                     writer=table.writer).to_json()
                delta_key = keys.route_delta(pool, table.generation)
                async with self.client.pipeline(transaction=False) as pipe:
                    pipe.set(delta_key, delta_raw, ex=DELTA_TTL_SECONDS)
                    pipe.set(head_key, head_raw)  # after its delta: a reader that sees the head finds the delta
                    pipe.publish(keys.routes_changed_channel(pool), str(table.generation))
                    await pipe.execute()
                chain.raws = [r for r in chain.raws if r[0] != head_key] + [(delta_key, delta_raw),
                                                                           (head_key, head_raw)]
                chain.delta_bytes += len(delta_raw)
                self.routes[pool] = table
                self.writes += 1
                self.bytes_written += len(delta_raw) + len(head_raw)
                return
        raw = table.to_json()
        head_raw = RouteHead(pool=pool, generation=table.generation, snapshot=table.generation,
                             writer=table.writer).to_json()
        # the change as a delta too, where it chains onto the table written before: a reader holding that one
        # catches up by the delta instead of parsing the whole table again (a restarted chain)
        first_delta = (diff(previous, table).to_json() if previous is not None and previous.writer == table.writer
                       and previous.generation + 1 == table.generation else None)
        if first_delta is not None and 2 * len(first_delta) > len(raw):
            first_delta = None
        async with self.client.pipeline(transaction=False) as pipe:
            if first_delta is not None:
                pipe.set(keys.route_delta(pool, table.generation), first_delta, ex=DELTA_TTL_SECONDS)
            pipe.set(keys.route_table(pool), raw)
            pipe.set(head_key, head_raw)
            pipe.publish(keys.routes_changed_channel(pool), str(table.generation))
            await pipe.execute()
        self._chains[pool] = _Chain(table.generation, len(raw), [(keys.route_table(pool), raw), (head_key, head_raw)],
                                    self.clock(), writer=table.writer)
        self.routes[pool] = table
        self.writes += 1
        self.bytes_written += len(raw) + len(head_raw) + len(first_delta or b"")

    async def _write_target_states(self, pool: str, states: Sequence[TargetState]) -> None:
        """Write ``states`` (whole, in memory) by reference: the catalogue entries they name that are new or changed
        first, then the states; then let the entries no state names any more expire."""
        written = self.targets.setdefault(pool, {})
        catalogue = self.specs.setdefault(pool, {})
        specs: dict[str, TargetSpec] = {}
        raws = []
        for state in states:
            compact, named = state.by_reference()
            raws.append((keys.target_state(pool, state.pod), compact.to_json()))
            specs.update((spec.served_name, spec) for spec in named if catalogue.get(spec.served_name) != spec)
        for state in states:
            written[state.pod] = state
        unnamed = catalogue.keys() - {a.served_name for state in written.values() for a in state.adapters}
        spec_raws = [(keys.target_spec(pool, name), spec.to_json()) for name, spec in sorted(specs.items())]
        async with self.client.pipeline(transaction=False) as pipe:
            for key, raw in spec_raws:  # before any state that names them
                pipe.set(key, raw)
            for state, (key, raw) in zip(states, raws, strict=True):
                pipe.set(key, raw)
                pipe.publish(keys.target_changed_channel(pool), state.pod)
            for name in sorted(unnamed):
                pipe.expire(keys.target_spec(pool, name), SPEC_EXPIRY_SECONDS)
            await pipe.execute()
        catalogue.update(specs)
        for name in unnamed:
            del catalogue[name]
            self._raw.pop(keys.target_spec(pool, name), None)
        self._raw.update(raws)
        self._raw.update(spec_raws)
        self.writes += len(states) + len(spec_raws)
        self.bytes_written += sum(len(raw) for _, raw in raws) + sum(len(raw) for _, raw in spec_raws)

    def _owned(self, pool: str) -> list[tuple[str, bytes]]:
        """The target state and route keys of ``pool`` this controller wrote, with the bytes it wrote there (the
        catalogue is left to ``repair``: a state names its entries, and a sidecar missing one keeps its last good
        target until then)."""
        states = sorted(self.targets.get(pool, {}).values(), key=lambda s: s.pod)
        owned = [(keys.target_state(pool, s.pod), self._bytes(keys.target_state(pool, s.pod), s)) for s in states]
        chain = self._chains.get(pool)
        return owned + (chain.raws if chain is not None else [])

    def _spec_raws(self, pool: str) -> list[tuple[str, bytes]]:
        """The catalogue keys of ``pool`` this controller wrote, with their bytes."""
        out = []
        for name, spec in sorted(self.specs.get(pool, {}).items()):
            key = keys.target_spec(pool, name)
            raw = self._raw.get(key)
            if raw is None:
                raw = self._raw[key] = spec.to_json()
            out.append((key, raw))
        return out

    async def check(self, pool: str) -> list[str]:
        """``repair`` where it is cheap or due: a pool whose keys hold at most ``thorough_bytes`` is compared key by
        key every time; a larger one every ``thorough_seconds``, and in between only counted (one ``EXISTS`` over
        its target state and route keys: a key lost to a Redis restart or a failover is back at once, a key
        overwritten in place or a catalogue entry lost alone within ``thorough_seconds``)."""
        owned = self._owned(pool)
        size = sum(len(raw) for _, raw in owned)
        now = self.clock()
        if size > self.thorough_bytes and now - self._thorough_at.get(pool, -math.inf) < self.thorough_seconds:
            if not owned or await self.client.exists(*(key for key, _ in owned)) == len(owned):
                return []
        return await self.repair(pool)

    async def repair(self, pool: str) -> list[str]:
        """Rewrite every key of ``pool`` whose stored value is not what this controller last wrote (missing after a
        Redis restart, or overwritten); returns the keys rewritten. Each gets a generation above both copies'."""
        self._thorough_at[pool] = self.clock()
        table = self.routes.get(pool)
        states = sorted(self.targets.get(pool, {}).values(), key=lambda s: s.pod)
        wanted: list[tuple[str, bytes]] = [(keys.target_state(pool, s.pod), self._bytes(keys.target_state(pool, s.pod), s))
                                           for s in states]
        spec_raws = self._spec_raws(pool)
        chain = self._chains.get(pool)
        route_raws = [] if table is None else chain.raws if chain is not None else [(keys.route_table(pool), b"")]
        if not wanted and not route_raws and not spec_raws:
            return []
        stored = await self.client.mget([key for key, _ in wanted] + [key for key, _ in spec_raws]
                                        + [key for key, _ in route_raws])
        bad_states = [(state, raw) for state, (_, ours), raw in zip(states, wanted, stored, strict=False) if raw != ours]
        after_states = stored[len(wanted):]
        bad_specs = [(key, ours) for (key, ours), raw in zip(spec_raws, after_states, strict=False) if raw != ours]
        bad_routes = [(key, raw) for (key, ours), raw in zip(route_raws, after_states[len(spec_raws):], strict=True)
                      if raw != ours]
        now = self.clock()
        repaired: list[str] = []
        if bad_specs:  # content-addressed by their served name and cache key: written back as they were
            for key, _ in bad_specs:
                log.warning("redis key %s was missing or held another copy; rewriting it", key)
            async with self.client.pipeline(transaction=False) as pipe:
                for key, ours in bad_specs:
                    pipe.set(key, ours)
                await pipe.execute()
            self.writes += len(bad_specs)
            self.bytes_written += sum(len(raw) for _, raw in bad_specs)
            repaired.extend(key for key, _ in bad_specs)
        if bad_routes and table is not None:
            generation = max([table.generation, *(_generation(raw) for _, raw in bad_routes)]) + 1
            fixed = table.model_copy(update={"generation": generation, "updated_at": now, "writer": self.writer})
            for key, raw in bad_routes:
                log.warning("redis key %s %s; rewriting the route table whole at generation %d", key,
                            "was missing" if raw is None else "held another copy", generation)
            await self._write_routes(fixed)
            repaired.append(keys.route_table(pool))
        fixed_states = []
        for state, raw in bad_states:
            key = keys.target_state(pool, state.pod)
            fixed_state = state.model_copy(update={"generation": max(state.generation, _generation(raw)) + 1,
                                                   "updated_at": now, "writer": self.writer})
            log.warning("redis key %s %s; rewriting generation %d", key,
                        "was missing" if raw is None else "held another copy", fixed_state.generation)
            fixed_states.append(fixed_state)
            repaired.append(key)
        if fixed_states:
            await self._write_target_states(pool, fixed_states)
        self.repairs += len(repaired)
        return repaired

    def _bytes(self, key: str, ours: TargetState) -> bytes:
        """What this controller wrote at ``key`` (``ours`` by reference, serialized once)."""
        raw = self._raw.get(key)
        if raw is None:
            raw = self._raw[key] = ours.by_reference()[0].to_json()
        return raw

    async def write_targets(self, pool: str, targets: Mapping[str, Sequence[AdapterTarget]],
                            retired: Collection[str] = ()) -> list[str]:
        """Write each pod's target state whose adapters (or its ``retired`` served names) changed; returns the pods
        written. A pod's ``retired`` names are those of the revisions being deleted (``retired``) that it holds: named
        by its last state, or in its last report read (any tier, its disk cache included; with no report, those its
        last state retired), so deleting a revision writes the pods that hold it, not the pool."""
        written = self.targets.setdefault(pool, {})
        compared = self._compared.setdefault(pool, {})
        deleting = set(retired)
        reports = self._parsed[pool].reports if deleting and pool in self._parsed else {}
        changed = []
        for pod, adapters in sorted(targets.items()):
            old = written.get(pod)
            if not deleting and old is not None and not old.retired and compared.get(pod) is adapters:
                continue  # the very list last found equal to what is written (a plan keeps an unchanged pod's list)
            compared[pod] = adapters
            wanted = sorted(adapters, key=lambda a: a.served_name)
            retired_names: list[str] = []
            if deleting:
                held = {a.served_name for a in old.adapters} if old is not None else set()
                if pod in reports:
                    held.update(a.served_name for a in reports[pod][1].adapters)
                elif old is not None:
                    held.update(old.retired)
                retired_names = sorted(deleting & held)
            if old is not None and old.adapters == wanted and old.retired == retired_names:
                if any(a is not b for a, b in zip(old.adapters, wanted, strict=True)):
                    # equal, other objects: kept as the plan's, so the next comparison is by identity
                    written[pod] = old.model_copy(update={"adapters": wanted})
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

