"""The route table written by change: a snapshot, a head and one delta key per generation.

A pool's ``RouteTable`` lives in three kinds of keys (``keys.route_table``, ``keys.route_head``,
``keys.route_delta``):

- the **snapshot**: a whole ``RouteTable`` (what every reader read before deltas; a table written whole, by an
  older controller or by hand, is still read as before);
- the **head**: a small ``RouteHead`` naming the latest generation, the snapshot's generation and the writer;
- one **delta** per generation after the snapshot: a ``RouteDelta`` holding only the logical names it sets or
  removes (and the table's other fields when they changed), each naming the generation it applies to (``base``).

The controller writes a change as one delta key and then the head (kilobytes, however large the table), and
writes the table whole again (a new snapshot, with its head) when that is cheaper: the table is small, the deltas
since the snapshot add up to more bytes than it, or the chain is long. A reader applies the deltas from its own
generation up to the head's, all or none, to a copy (``apply``) and swaps it in: it never routes on half a change.
A delta it cannot find or that does not chain onto what it holds (lost, reordered, from another writer) makes it
read the snapshot and the chain after it instead (``read_route_table``), and the controller's level-triggered
repair rewrites a snapshot when any key of the chain is missing or not its own.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

from pydantic import Field

from loraplane.api import keys
from loraplane.api.base import PayloadModel
from loraplane.api.payload import read_payload_or_none
from loraplane.api.routing import RouteEntry, RouteTable, supersedes
from loraplane.api.runtime import SCHEMA_VERSION

log = logging.getLogger(__name__)

#: the most deltas a reader fetches to catch up; further behind it reads the snapshot instead
MAX_CATCH_UP = 512
#: a snapshot larger than this is parsed in a worker thread: the event loop keeps its turns every GIL switch
#: interval (5 ms) instead of stalling for the whole parse (~0.2 s at 10,000 names)
PARSE_ASIDE_BYTES = 256 << 10


class RouteHead(PayloadModel):
    """The pool's latest route table generation and where its chain starts."""

    schema_version: int = SCHEMA_VERSION
    pool: str
    generation: int = Field(ge=0)
    snapshot: int = Field(ge=0, description="the generation the snapshot key holds; deltas follow it one by one")
    writer: str | None = None


class RouteDelta(PayloadModel):
    """One change of the route table: generation ``base`` + this = ``generation``."""

    schema_version: int = SCHEMA_VERSION
    pool: str
    generation: int = Field(ge=1)
    base: int = Field(ge=0)
    writer: str | None = None
    updated_at: float
    upserts: dict[str, RouteEntry] = Field(default_factory=dict, description="logical names set (added or changed)")
    removes: list[str] = Field(default_factory=list, description="logical names no longer routed")
    base_model: str | None = None
    staging_pods: list[str] | None = Field(default=None, description="the new staging pods; None: unchanged")
    base_model_changed: bool = False


def diff(old: RouteTable, new: RouteTable) -> RouteDelta:
    """The delta that turns ``old`` into ``new`` (``new``'s generation, writer and time)."""
    before = old.models
    upserts = {name: entry for name, entry in new.models.items()
               if (was := before.get(name)) is not entry and was != entry}  # identity first: models compare slowly
    removes = sorted(name for name in old.models if name not in new.models)
    return RouteDelta(
        pool=new.pool, generation=new.generation, base=old.generation, writer=new.writer, updated_at=new.updated_at,
        upserts=upserts, removes=removes,
        base_model=new.base_model, base_model_changed=new.base_model != old.base_model,
        staging_pods=new.staging_pods if new.staging_pods != old.staging_pods else None,
    )


def apply(table: RouteTable, deltas: Sequence[RouteDelta]) -> RouteTable | None:
    """``table`` with ``deltas`` applied in order, as a new object (``table`` is left as it was); None when they do
    not chain onto it one by one (a lost or reordered delta, another writer's): nothing of them is applied."""
    generation = table.generation
    for delta in deltas:
        if delta.base != generation or delta.writer != table.writer or delta.pool != table.pool:
            return None
        generation = delta.generation
    if not deltas:
        return table
    models = dict(table.models)
    update: dict[str, Any] = {}
    names: set[str] = set()
    for delta in deltas:
        for name in delta.removes:
            models.pop(name, None)
        models.update(delta.upserts)
        names.update(delta.removes)
        names.update(delta.upserts)
        if delta.base_model_changed:
            update["base_model"] = delta.base_model
        if delta.staging_pods is not None:
            update["staging_pods"] = list(delta.staging_pods)
    last = deltas[-1]
    applied = table.model_copy(update={**update, "models": models, "generation": last.generation,
                                       "updated_at": last.updated_at})
    if len(_APPLIED) >= _APPLIED_KEPT:
        del _APPLIED[next(iter(_APPLIED))]
    _APPLIED[id(applied)] = (applied, table.generation, frozenset(names))
    return applied


#: id of a table ``apply`` made -> (that table, the generation it was made from, the names its deltas set or removed):
#: the latest few, so ``changed_names`` names a change without comparing every name (kept out of the model: it is
#: this process's knowledge, and a model's private attributes take part in its equality)
_APPLIED: dict[int, tuple[RouteTable, int, frozenset[str]]] = {}
_APPLIED_KEPT = 8


def changed_names(old: RouteTable | None, new: RouteTable | None) -> set[str] | None:
    """The logical names whose entry differs between two tables; None when they do not share a lineage (a reader
    rebuilds everything)."""
    if old is None or new is None or old.writer != new.writer or old.pool != new.pool:
        return None
    made = _APPLIED.get(id(new))
    if made is not None and made[0] is new and made[1] == old.generation:  # ``apply`` made it from ``old``'s generation
        return set(made[2])
    if len(old.models) != len(new.models) or old.models.keys() != new.models.keys():
        names = old.models.keys() ^ new.models.keys()
    else:
        names = set()
    return names | {n for n, e in new.models.items() if n in old.models and old.models[n] is not e
                    and old.models[n] != e}


async def _deltas(client: Any, pool: str, after: int, upto: int) -> list[RouteDelta] | None:
    """Deltas ``after + 1 .. upto``; None when any is missing or does not parse."""
    if upto <= after:
        return []
    raws = await client.mget([keys.route_delta(pool, g) for g in range(after + 1, upto + 1)])
    deltas = [read_payload_or_none(RouteDelta, raw, log) for raw in raws]
    if any(d is None for d in deltas):
        return None
    return [d for d in deltas if d is not None]


async def read_route_table(client: Any, pool: str, current: RouteTable | None = None) -> RouteTable | None:
    """The pool's route table as its keys hold it now, reading as little as it can: ``current`` when the head
    names it, ``current`` plus the deltas after it when they chain onto it, else the snapshot plus the deltas after
    it (as far as they chain: a lost one is the controller's to repair). None when Redis holds no usable table."""
    head = read_payload_or_none(RouteHead, await client.get(keys.route_head(pool)), log)
    if head is not None and current is not None and current.writer == head.writer:
        if current.generation == head.generation:
            return current
        if current.generation < head.generation <= current.generation + MAX_CATCH_UP:
            # a restarted chain (``head.snapshot`` past ``current``) usually kept the delta of its first generation
            deltas = await _deltas(client, pool, current.generation, head.generation)
            caught_up = apply(current, deltas) if deltas is not None else None
            if caught_up is not None:
                return caught_up
    raw = await client.get(keys.route_table(pool))
    if raw is not None and len(raw) > PARSE_ASIDE_BYTES:  # megabytes at 10,000 names: parsed off the event loop
        snapshot = await asyncio.to_thread(read_payload_or_none, RouteTable, raw, log)
    else:
        snapshot = read_payload_or_none(RouteTable, raw, log)
    if snapshot is None or head is None or snapshot.writer != head.writer or snapshot.generation >= head.generation:
        return snapshot  # a table written whole (no chain after it), or newer than the head read before it
    upto = min(head.generation, snapshot.generation + MAX_CATCH_UP)
    raws = await client.mget([keys.route_delta(pool, g) for g in range(snapshot.generation + 1, upto + 1)])
    table = snapshot
    for raw in raws:
        delta = read_payload_or_none(RouteDelta, raw, log)
        following = apply(table, [delta]) if delta is not None else None
        if following is None:
            log.warning("route table of %s: the delta after generation %d is missing or does not follow; "
                        "routing on generation %d until the controller repairs it", pool, table.generation,
                        table.generation)
            break
        table = following
    return table


def newer(table: RouteTable | None, current: RouteTable | None) -> bool:
    """True when ``table`` should replace ``current`` (``supersedes``, and not the same object)."""
    return table is not None and table is not current and supersedes(table, current)
