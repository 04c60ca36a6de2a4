"""The in-memory pool snapshot the scheduler scores: no Redis, no gRPC, no clock inside.

A ``PoolSnapshot`` is built from ``EndpointState`` values (the simulator makes those directly) or from the
sidecars' ``ResidencyReport`` objects (``PoolSnapshot.from_reports``). Per-endpoint numbers are numpy arrays so a
scheduling cycle over 1,000 endpoints costs a handful of vector operations, and residency is indexed by
``(served name, digest)`` so the affinity lookup is one dict access. Revisions a sidecar reports as draining (about to
be unloaded from its pod) are indexed apart: never warm, and routed to only when no other pod holds them. The only field that changes between rebuilds is
``in_flight``, the picker's own count of requests it sent and that have not finished, kept by ``InFlightTracker``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Collection, Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

import numpy as np
import numpy.typing as npt

from loraplane.api import AdapterResidency, EndpointInFlight, LoadCosts, ResidencyReport, Tier, validation
from loraplane.api.vllm_metrics import LoadedAdapter

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.intp]
BoolArray = npt.NDArray[np.bool_]
T = TypeVar("T")

_MISSING = object()
NAN = float("nan")

#: Memory a snapshot's memo may hold (entries are whole-pool vectors of 1-8 bytes per endpoint).
MEMO_BYTES = 4 << 20


@dataclass(frozen=True, slots=True)
class EndpointState:
    """One model-server pod as the picker knows it at snapshot time."""

    name: str
    address: str
    ready: bool = True
    stale: bool = False
    #: stale, but its last report is kept (``from_reports``): where it held a revision is a fallback (routed to only
    #: when no fresh endpoint holds the revision: its sidecar went silent, the runtime kept what it held) and its load
    #: counts as last heard, not as saturated. False on a stale endpoint: unknown (no report at all)
    last_heard: bool = False
    #: when the picker received the report this state comes from (its own clock, not the sidecar's); NaN: none
    received_at: float = NAN
    queue_depth: int = 0
    running: int = 0
    active_tokens: int = 0
    kv_utilization: float = 0.0
    recent_evictions: int = 0
    #: measured seconds to make an adapter servable from (CPU, disk, not on the pod); NaN: not measured
    load_seconds: tuple[float, float, float] = (NAN, NAN, NAN)
    #: adapters the runtime batches at once (vLLM's ``max_loras``); 0: not reported (no slot limit assumed)
    gpu_slots: int = 0
    #: the pod serves a revision it does not hold, loading it on the request: the simulator's serving model only.
    #: Real runtimes (vLLM without a LoRA resolver, the engine) answer 404 for a name they have not registered, so
    #: a pod built from a sidecar's report never does
    loads_on_demand: bool = False
    #: served name -> (tier, digest the runtime loaded); entries without a digest never count as warm.
    residency: Mapping[str, tuple[Tier, str | None]] = field(default_factory=dict)
    #: served names in ``residency`` that are leaving this pod (the sidecar will unload them): not resident here.
    draining: frozenset[str] = frozenset()
    #: what the peers' LoRA plugins read (``loraplane.picker.peers``), from vLLM's metrics (the scrape data source,
    #: the simulator's peer view): the adapters the newest ``vllm:lora_requests_info`` lists as running / waiting
    running_adapters: frozenset[str] = frozenset()
    waiting_adapters: frozenset[str] = frozenset()
    #: vLLM's residency gauges (``vllm:lora_adapter_loaded``, vLLM PR #54830): adapter -> on a GPU / pinned;
    #: None: the runtime exports none (residency unknown)
    loaded_adapters: Mapping[str, LoadedAdapter] | None = None
    #: adapters in GPU slots (``vllm:num_gpu_loaded_lora_adapters``)
    gpu_loaded: int = 0

    @property
    def ip(self) -> str:
        """The host part of ``address`` (what a subset hint matches on)."""
        return _ip_of(self.address)


@functools.lru_cache(maxsize=65_536)
def _ip_of(address: str) -> str:
    try:
        return validation.parse_host_port(address)[0]
    except ValueError:
        return address


@dataclass(frozen=True, slots=True)
class ResidencyEntry:
    """Where one (served name, digest) is resident: endpoint indices and their tier levels (0 = GPU)."""

    indices: IntArray
    levels: npt.NDArray[np.int8]
    #: endpoint index -> tier level, for per-decision lookups without numpy
    level_of: dict[int, int]

    @classmethod
    def of(cls, level_of: dict[int, int]) -> ResidencyEntry:
        """The entry for these endpoint indices and tier levels (in the dict's order)."""
        return cls(np.fromiter(level_of, np.intp, len(level_of)),
                   np.fromiter(level_of.values(), np.int8, len(level_of)), level_of)


class PoolSnapshot:
    """Every endpoint of the pool with its load and residency, ready to be scored."""

    def __init__(self, endpoints: Sequence[EndpointState], priorities: Mapping[str, int] | None = None,
                 staging: Collection[str] = ()) -> None:
        """Index ``endpoints``; ``priorities`` maps served names to route priority (gold > 0) for protection;
        ``staging`` names the pods that take a revision no pod holds (``RouteTable.staging_pods``)."""
        priorities = priorities or {}
        self.endpoints: tuple[EndpointState, ...] = tuple(endpoints)
        self.addresses: tuple[str, ...] = tuple(e.address for e in self.endpoints)
        self.ips: tuple[str, ...] = tuple(e.ip for e in self.endpoints)
        self.index_by_address: dict[str, int] = {a: i for i, a in enumerate(self.addresses)}
        self.indices_by_ip: dict[str, list[int]] = {}
        for i, ip in enumerate(self.ips):
            self.indices_by_ip.setdefault(ip, []).append(i)
        n = len(self.endpoints)
        self.size = n
        self.all_indices: IntArray = np.arange(n, dtype=np.intp)
        self.ready: BoolArray = np.fromiter((e.ready for e in self.endpoints), np.bool_, n)
        self.stale: BoolArray = np.fromiter((e.stale for e in self.endpoints), np.bool_, n)
        self.last_heard: BoolArray = np.fromiter((e.stale and e.last_heard for e in self.endpoints), np.bool_, n)
        #: when the picker received each endpoint's report (its own clock); NaN where it has none
        self.received_at: FloatArray = np.fromiter((e.received_at for e in self.endpoints), np.float64, n)
        self.queue_depth: FloatArray = np.fromiter((e.queue_depth for e in self.endpoints), np.float64, n)
        self.running: FloatArray = np.fromiter((e.running for e in self.endpoints), np.float64, n)
        self.active_tokens: FloatArray = np.fromiter((e.active_tokens for e in self.endpoints), np.float64, n)
        self.kv_utilization: FloatArray = np.fromiter((e.kv_utilization for e in self.endpoints), np.float64, n)
        self.recent_evictions: FloatArray = np.fromiter((e.recent_evictions for e in self.endpoints), np.float64, n)
        self.in_flight: FloatArray = np.zeros(n, dtype=np.float64)
        #: of those, the requests whose response has not started (no first token yet: queued for or in prefill)
        self.prefilling: FloatArray = np.zeros(n, dtype=np.float64)
        #: their prompts' estimated tokens (``SchedulingRequest.prompt_tokens``): the prefill queued there
        self.prefill_tokens: FloatArray = np.zeros(n, dtype=np.float64)
        #: the picker's own in-flight requests per served name: name -> {endpoint index: count} (``InFlightTracker``)
        self.in_flight_by_name: dict[str, dict[int, int]] = {}
        #: per endpoint, the distinct served names among those in flight
        self.adapters_in_flight: FloatArray = np.zeros(n, dtype=np.float64)
        self._names_at: list[set[str]] = [set() for _ in range(n)]
        #: per endpoint, the revisions in flight there that it does not hold (being fetched)
        self.fetching: FloatArray = np.zeros(n, dtype=np.float64)
        #: per endpoint, its GPU slots (``gpu_slots``), inf where not reported
        self.slot_limit: FloatArray = np.fromiter(
            (e.gpu_slots or np.inf for e in self.endpoints), np.float64, n
        )
        #: per endpoint, seconds to make a revision servable from tier level 0 (GPU: 0), 1, 2, 3 (absent); NaN where
        #: the pod reported no measurement
        self.load_seconds: FloatArray = np.zeros((n, 4), dtype=np.float64)
        self.load_seconds[:, 1:] = [e.load_seconds for e in self.endpoints] if n else np.empty((0, 3))
        #: the endpoints that serve a revision they do not hold (``EndpointState.loads_on_demand``)
        self.on_demand: BoolArray = np.fromiter((e.loads_on_demand for e in self.endpoints), np.bool_, n)
        #: the endpoints that take a revision no endpoint holds (the placement's staging pods); None: any endpoint
        self.staging: BoolArray | None = None
        if staging:
            mask = np.fromiter((e.name in staging for e in self.endpoints), np.bool_, n)
            self.staging = mask if mask.any() else None
        #: GPU-resident revisions with a positive route priority (gold) on each endpoint.
        self.protected_warm: FloatArray = np.zeros(n, dtype=np.float64)
        self._priorities = priorities
        holders: dict[tuple[str, str], dict[int, int]] = {}
        leaving: dict[tuple[str, str], list[int]] = {}
        heard: dict[tuple[str, str], list[int]] = {}
        for i, endpoint in enumerate(self.endpoints):
            for key, level, draining in _resident_rows(endpoint):
                if draining:
                    leaving.setdefault(key, []).append(i)
                else:
                    holders.setdefault(key, {})[i] = level
            for key in _last_heard_rows(endpoint):
                heard.setdefault(key, []).append(i)
            self.protected_warm[i] = self._protected_count(endpoint)
        self.residency: dict[tuple[str, str], ResidencyEntry] = {
            key: ResidencyEntry.of(level_of) for key, level_of in holders.items()
        }
        #: (served name, digest) -> endpoints that still hold it but are draining it (leaving soon)
        self.draining: dict[tuple[str, str], IntArray] = {
            key: np.asarray(idx, dtype=np.intp) for key, idx in leaving.items()
        }
        #: (served name, digest) -> stale endpoints whose last report held it (not draining): the fallback
        self.last_heard_residency: dict[tuple[str, str], IntArray] = {
            key: np.asarray(idx, dtype=np.intp) for key, idx in heard.items()
        }
        self._memo: dict[Hashable, Any] = {}
        self._memo_entries = max(64, MEMO_BYTES // (8 * max(1, n)))
        self._per_version: dict[Hashable, tuple[int, Any]] = {}
        #: bumped by every in-place update, so caches keyed on the snapshot know when to recompute
        self.version = 0
        self._derive_flags()

    def _derive_flags(self) -> None:
        self.all_ready = bool(self.ready.all())
        self.any_stale = bool(self.stale.any())
        #: stale endpoints without a report kept: their load is unknown (counted as saturated)
        self.unknown: BoolArray = self.stale & ~self.last_heard
        self.any_unknown = bool(self.unknown.any())
        self.has_protected = bool(self.protected_warm.any())
        #: 1.0 where no gold revision is GPU-resident
        self.unprotected: FloatArray = (self.protected_warm == 0).astype(np.float64)
        self.fresh: BoolArray = ~self.stale
        #: some endpoint loads on demand (simulated and scraped pools; never a pool of sidecars' reports)
        self.any_on_demand = bool(self.on_demand.any())

    def _protected_count(self, endpoint: EndpointState) -> int:
        return sum(1 for (name, _), level, draining in _resident_rows(endpoint)
                   if level == 0 and not draining and self._priorities.get(name, 0) > 0)

    def update_endpoint(self, index: int, state: EndpointState) -> None:
        """Replace endpoint ``index`` (same address) in place: load, readiness, staleness and residency.

        Costs O(its residency rows) when residency changed and O(1) otherwise (plus a few whole-pool flag
        recomputations), instead of re-indexing the pool. ``in_flight`` is kept; ``version`` is bumped.
        """
        self.update_endpoints([(index, state)])

    def update_endpoints(self, updates: Sequence[tuple[int, EndpointState]]) -> None:
        """``update_endpoint`` for several endpoints at once (the whole-pool flags recomputed once, one version)."""
        if not updates:
            return
        endpoints = list(self.endpoints)
        for index, state in updates:
            if state.address != endpoints[index].address:
                raise ValueError(f"endpoint {index} is {endpoints[index].address}, not {state.address}: build a new "
                                 "snapshot")
        olds = []
        for index, state in updates:
            olds.append(endpoints[index])
            endpoints[index] = state
        self.endpoints = tuple(endpoints)
        for (index, state), old in zip(updates, olds, strict=True):
            self._update_arrays(index, old, state)
        self._derive_flags()
        self.version += 1

    def _update_arrays(self, index: int, old: EndpointState, state: EndpointState) -> None:
        self.ready[index], self.stale[index] = state.ready, state.stale
        self.last_heard[index], self.received_at[index] = state.stale and state.last_heard, state.received_at
        self.queue_depth[index], self.running[index] = state.queue_depth, state.running
        self.active_tokens[index], self.kv_utilization[index] = state.active_tokens, state.kv_utilization
        self.recent_evictions[index] = state.recent_evictions
        self.load_seconds[index, 1:] = state.load_seconds
        self.slot_limit[index] = state.gpu_slots or np.inf
        self.on_demand[index] = state.loads_on_demand
        self._count_fetching(index)
        if ((old.stale, old.last_heard, old.residency, old.draining)
                != (state.stale, state.last_heard, state.residency, state.draining)):
            self._reindex(index, old, state)

    def _reindex(self, index: int, old: EndpointState, new: EndpointState) -> None:
        """Re-index only the revisions whose (tier level, draining) on this endpoint changed: O(its rows)."""
        before = {key: (level, draining) for key, level, draining in _resident_rows(old)}
        after = {key: (level, draining) for key, level, draining in _resident_rows(new)}
        for key in before.keys() | after.keys():
            row = after.get(key)
            if row == before.get(key):
                continue
            entry = self.residency.get(key)
            level_of = {i: level for i, level in entry.level_of.items() if i != index} if entry else {}
            leaving = [i for i in self.draining.get(key, ()) if i != index]
            if row is not None:
                level, draining = row
                if draining:
                    leaving.append(index)
                else:
                    level_of[index] = level
            self._set_holders(key, level_of, leaving)
        heard_before, heard_after = set(_last_heard_rows(old)), set(_last_heard_rows(new))
        for key in heard_before ^ heard_after:
            others = [i for i in self.last_heard_residency.get(key, ()) if i != index]
            if key in heard_after:
                others.append(index)
            if others:
                self.last_heard_residency[key] = np.asarray(sorted(others), dtype=np.intp)
            else:
                self.last_heard_residency.pop(key, None)
        self.protected_warm[index] = self._protected_count(new)
        self._memo.clear()

    def _set_holders(self, key: tuple[str, str], level_of: dict[int, int], leaving: list[int]) -> None:
        if level_of:
            self.residency[key] = ResidencyEntry.of(dict(sorted(level_of.items())))
        else:
            self.residency.pop(key, None)
        if leaving:
            self.draining[key] = np.asarray(sorted(leaving), dtype=np.intp)
        else:
            self.draining.pop(key, None)

    def __len__(self) -> int:
        return self.size

    def memo(self, key: Hashable, compute: Callable[[], T]) -> T:
        """A value derived from this snapshot alone, computed once (plugins cache per-revision vectors here)."""
        value = self._memo.get(key, _MISSING)  # not try/except: a miss (common with many revisions) raises nothing
        if value is _MISSING:
            if len(self._memo) >= self._memo_entries:
                del self._memo[next(iter(self._memo))]  # bounded: the oldest entry goes (one at a time, no spikes)
            value = self._memo[key] = compute()
        return cast(T, value)

    def per_version(self, key: Hashable, compute: Callable[[], T]) -> T:
        """A value derived from this snapshot, computed once per ``version`` (recomputed after any in-place update,
        whatever it changed; the peers' LoRA view is kept here)."""
        cached = self._per_version.get(key)
        if cached is not None and cached[0] == self.version:
            return cast(T, cached[1])
        value = compute()
        self._per_version[key] = (self.version, value)
        return value

    def lookup(self, served_name: str | None, digest: str | None) -> ResidencyEntry | None:
        """Where this exact revision (name and digest) is resident, or None."""
        if served_name is None or digest is None:
            return None
        return self.residency.get((served_name, digest))

    def last_heard_holders(self, served_name: str | None, digest: str | None) -> IntArray | None:
        """Stale endpoints whose last report held this exact revision (not draining), or None."""
        if served_name is None or digest is None or not self.last_heard_residency:
            return None
        return self.last_heard_residency.get((served_name, digest))

    def draining_holders(self, served_name: str | None, digest: str | None) -> IntArray | None:
        """Endpoints that still hold this exact revision but are draining it, or None."""
        if served_name is None or digest is None:
            return None
        return self.draining.get((served_name, digest))

    def has_room(self, served_name: str | None, digest: str | None = None) -> BoolArray | None:
        """Endpoints with room for this revision by the picker's own in-flight count: requests of it are in flight
        there; or fewer distinct revisions than the pod's GPU slots are (a pod already running ``max_loras`` other
        adapters batches this one only after one of them drains: vLLM's queue holds it meanwhile) and, where the pod
        does not hold the revision, no other revision it lacks is in flight there (its fetch would queue behind that
        fetch). None: every endpoint has room."""
        if served_name is None:
            return None
        blocked = self.adapters_in_flight >= self.slot_limit
        if self.any_fetching:
            cold = self.fetching > 0
            entry = self.lookup(served_name, digest)
            if entry is not None:
                cold[entry.indices] = False
            blocked |= cold
        if not np.count_nonzero(blocked):  # count_nonzero: C, where .any() goes through a Python wrapper
            return None
        room = ~blocked
        for i in self.in_flight_by_name.get(served_name, ()):
            room[i] = True
        return room

    def room_at(self, index: int, served_name: str | None, digest: str | None = None) -> bool:
        """``has_room`` for one endpoint."""
        if served_name is None or index in self.in_flight_by_name.get(served_name, ()):
            return True
        if self.adapters_in_flight[index] >= self.slot_limit[index]:
            return False
        if not self.fetching[index]:
            return True
        entry = self.lookup(served_name, digest)
        return entry is not None and index in entry.level_of

    @property
    def any_fetching(self) -> bool:
        """Does some endpoint have requests in flight for a revision it does not hold (fetching it)?"""
        return bool(np.count_nonzero(self.fetching))

    def set_in_flight(self, by_endpoint: Sequence[Mapping[str, int]], prefilling: Sequence[int] | None = None,
                      prefill_tokens: Sequence[int] | None = None) -> None:
        """Every endpoint's in-flight requests per served name at once (a driver that counts them itself: the
        simulator), replacing the counts an ``InFlightTracker`` keeps; ``prefilling``: per endpoint, how many of
        them have no first token yet, ``prefill_tokens`` their prompt tokens (None: leave as it is)."""
        if prefilling is not None:
            self.prefilling[:] = prefilling
        if prefill_tokens is not None:
            self.prefill_tokens[:] = prefill_tokens
        self.in_flight_by_name.clear()
        for index, by_name in enumerate(by_endpoint):
            self.in_flight[index] = sum(by_name.values())
            self.adapters_in_flight[index] = len(by_name)
            self._names_at[index] = set(by_name)
            for name, count in by_name.items():
                self.in_flight_by_name.setdefault(name, {})[index] = count
            self._count_fetching(index)

    def note_in_flight(self, index: int, served_name: str, count: int) -> None:
        """Endpoint ``index`` now has ``count`` requests of ``served_name`` in flight."""
        at = self.in_flight_by_name.get(served_name)
        names = self._names_at[index]
        if count:
            if at is None:
                at = self.in_flight_by_name[served_name] = {}
            at[index] = count
            if served_name in names:
                return  # the revisions in flight here are the same: so are their number and the fetching count
            names.add(served_name)
        else:
            if at is not None:
                at.pop(index, None)
                if not at:
                    del self.in_flight_by_name[served_name]
            if served_name not in names:
                return
            names.discard(served_name)
        self.adapters_in_flight[index] = len(names)
        self._count_fetching(index)

    def _count_fetching(self, index: int) -> None:
        """How many revisions in flight at ``index`` its report does not show it holding (unknown when stale)."""
        endpoint = self.endpoints[index]
        if endpoint.stale:
            self.fetching[index] = 0
            return
        residency = endpoint.residency
        self.fetching[index] = sum(1 for name in self._names_at[index] if not _holds(residency.get(name)))

    @classmethod
    def from_reports(
        cls,
        reports: Iterable[ResidencyReport],
        now: float,
        priorities: Mapping[str, int] | None = None,
        endpoints: Sequence[tuple[str, str]] | None = None,
        stale_grace_s: float = 0.0,
        staging: Collection[str] = (),
        received: Mapping[str, float] | None = None,
        max_ttl_s: float = math.inf,
    ) -> PoolSnapshot:
        """Build from sidecar reports; a report older than its TTL plus ``stale_grace_s`` makes its endpoint stale.

        A report's age is ``now`` less when the picker received it (``received``: pod -> time on the clock ``now``
        reads), never the sidecar's ``heartbeat_at``: a pod whose clock runs ahead would stay fresh long after it
        died, one whose clock runs behind would never be. Without ``received`` (the simulator, whose clock is the
        pods' clock) the heartbeat is the receive time. Its TTL counts up to ``max_ttl_s``.

        Within the grace a report past its TTL still counts as it was last heard (its residency and load): while
        Redis or a sidecar is briefly silent, requests keep going to the pods last known to hold their revision
        instead of to pods without it. Past the grace the endpoint is stale but last heard (``last_heard``): the
        staleness filter keeps it only where no fresh endpoint holds the request's revision. ``endpoints`` ((pod
        name, address) pairs from discovery) fixes the membership: pods without a report are stale and unknown,
        reports of pods outside it are ignored. Without it every reporting pod is a member.
        """
        by_pod = {r.pod: r for r in reports}
        members = endpoints if endpoints is not None else [(r.pod, r.address) for r in by_pod.values()]
        states = [member_state(pod, address, by_pod.get(pod), now, received, stale_grace_s, max_ttl_s)
                  for pod, address in members]
        return cls(states, priorities, staging)


def member_state(pod: str, address: str, report: ResidencyReport | None, now: float,
                 received: Mapping[str, float] | None = None, stale_grace_s: float = 0.0,
                 max_ttl_s: float = math.inf) -> EndpointState:
    """One member's ``EndpointState`` at ``now`` (``PoolSnapshot.from_reports``): stale and unknown without a
    report, stale but last heard once its report is older than its TTL plus ``stale_grace_s``."""
    if report is None:
        return EndpointState(name=pod, address=address, ready=True, stale=True)
    received_at = received.get(pod, report.heartbeat_at) if received is not None else report.heartbeat_at
    state = endpoint_from_report(report, address, received_at)
    if now - received_at > min(report.ttl_seconds, max_ttl_s) + stale_grace_s:
        state = dataclasses.replace(state, stale=True, last_heard=True)
    return state


def _resident_rows(endpoint: EndpointState) -> Iterator[tuple[tuple[str, str], int, bool]]:
    """((served name, digest), tier level, draining) for each residency row that counts (none when stale)."""
    if endpoint.stale:
        return  # unknown residency is not truth
    for name, (tier, digest) in endpoint.residency.items():
        if digest is not None and tier is not Tier.ABSENT:
            yield (name, digest), tier.level, name in endpoint.draining


def _last_heard_rows(endpoint: EndpointState) -> Iterator[tuple[str, str]]:
    """(served name, digest) of each revision a stale endpoint's last report held servable (not draining)."""
    if not endpoint.last_heard or not endpoint.stale:
        return
    for name, (tier, digest) in endpoint.residency.items():
        if digest is not None and tier is not Tier.ABSENT and name not in endpoint.draining:
            yield name, digest


def _holds(row: tuple[Tier, str | None] | None) -> bool:
    return row is not None and row[1] is not None and row[0] is not Tier.ABSENT


def endpoint_from_report(report: ResidencyReport, address: str | None = None,
                         received_at: float = NAN) -> EndpointState:
    """The ``EndpointState`` a fresh report describes (received at ``received_at`` on the picker's clock)."""
    load = report.load
    return EndpointState(
        name=report.pod,
        address=address or report.address,
        ready=report.ready,
        stale=False,
        received_at=received_at,
        queue_depth=load.queue_depth,
        running=load.running,
        active_tokens=load.active_tokens,
        kv_utilization=load.kv_utilization,
        recent_evictions=load.recent_evictions,
        load_seconds=_load_seconds(load.load_seconds),
        gpu_slots=load.max_gpu_slots,
        residency={a.served_name: (a.tier, a.digest) for a in report.adapters if _servable(a)},
        draining=frozenset(a.served_name for a in report.adapters if a.draining),
    )


def _load_seconds(costs: LoadCosts | None) -> tuple[float, float, float]:
    if costs is None:
        return (NAN, NAN, NAN)
    return tuple(NAN if v is None else v for v in (costs.cpu, costs.disk, costs.fetch))  # type: ignore[return-value]


def _servable(adapter: AdapterResidency) -> bool:
    """A reported row the runtime can serve: no sidecar error, or one about an action on an adapter still loaded
    (e.g. ``RequestsInFlight`` while it waits to offload: it still serves those requests and new ones). A row the
    sidecar marks as not registered in the runtime (only in its disk cache) is not servable: the runtime would 404;
    one it marks as registered is, at any tier (e.g. kept on disk below its target tier, ``CapacityExceeded``)."""
    if adapter.registered is not None:
        return adapter.registered
    return adapter.error is None or adapter.tier in (Tier.GPU, Tier.CPU)


class InFlightTracker:
    """The picker's own in-flight count per endpoint address (and per served name there), carried across snapshot
    rebuilds, plus the other picker replicas' last published counts (``set_remote``): the snapshot holds the sum."""

    def __init__(self) -> None:
        """Start with nothing in flight."""
        self.counts: dict[str, int] = {}
        #: address -> requests in flight there whose response has not started (no first token yet)
        self.prefilling: dict[str, int] = {}
        #: address -> those requests' estimated prompt tokens
        self.prefill_tokens: dict[str, int] = {}
        #: address -> served name -> requests in flight
        self.by_name: dict[str, dict[str, int]] = {}
        #: address -> the other replicas' requests in flight there, summed
        self.remote: dict[str, EndpointInFlight] = {}
        self._snapshot: PoolSnapshot | None = None

    def own(self) -> dict[str, EndpointInFlight]:
        """This replica's counts, per address, in the shape replicas publish."""
        return {address: EndpointInFlight(requests=count, prefilling=self.prefilling.get(address, 0),
                                          prefill_tokens=self.prefill_tokens.get(address, 0),
                                          by_name=dict(self.by_name.get(address, {})))
                for address, count in self.counts.items()}

    def attach(self, snapshot: PoolSnapshot) -> None:
        """Make ``snapshot.in_flight`` (and its per-name counts) reflect the current counts and keep them updated."""
        self._snapshot = snapshot
        for address in self.counts.keys() | self.prefilling.keys() | self.remote.keys():
            if (i := snapshot.index_by_address.get(address)) is not None:
                self._write(snapshot, i, address, self._names(address))

    def set_remote(self, endpoints: Mapping[str, EndpointInFlight]) -> None:
        """Replace the other replicas' counts (summed per address); the snapshot shows this replica's plus theirs."""
        before, self.remote = self.remote, dict(endpoints)
        snapshot = self._snapshot
        if snapshot is None:
            return
        for address in before.keys() | self.remote.keys():
            old, new = before.get(address), self.remote.get(address)
            if old != new and (i := snapshot.index_by_address.get(address)) is not None:
                names = self._names(address) | (old.by_name.keys() if old is not None else set())
                self._write(snapshot, i, address, names)

    def _names(self, address: str) -> set[str]:
        remote = self.remote.get(address)
        return set(self.by_name.get(address, ())) | (set(remote.by_name) if remote is not None else set())

    def _write(self, snapshot: PoolSnapshot, i: int, address: str, names: Iterable[str]) -> None:
        """Endpoint ``i``'s counts in ``snapshot`` (total, prefilling, and the served names ``names``): own + remote."""
        remote = self.remote.get(address)
        snapshot.in_flight[i] = self.counts.get(address, 0) + (remote.requests if remote is not None else 0)
        self._write_prefilling(snapshot, i, address, remote)
        own = self.by_name.get(address, {})
        for name in names:
            snapshot.note_in_flight(i, name, own.get(name, 0) + (remote.by_name.get(name, 0) if remote is not None else 0))

    def start(self, address: str, served_name: str | None = None, prefilling: bool = True,
              prompt_tokens: int = 0) -> None:
        """A request (of ``served_name``; None: the base model) with a prompt of ``prompt_tokens`` was sent to
        ``address``; ``prefilling``: its response has not started yet."""
        self._add(address, served_name, 1)
        if prefilling:
            self._add_prefilling(address, 1, prompt_tokens)

    def first_token(self, address: str, prompt_tokens: int = 0) -> None:
        """The response of a request in flight at ``address`` (``start``'s ``prompt_tokens``) started."""
        self._add_prefilling(address, -1, -prompt_tokens)

    def finish(self, address: str, served_name: str | None = None, prefilling: bool = False,
               prompt_tokens: int = 0) -> None:
        """A request to ``address`` finished (response end, error or client abort); ``prefilling``: before its
        response started."""
        self._add(address, served_name, -1)
        if prefilling:
            self._add_prefilling(address, -1, -prompt_tokens)

    def _add_prefilling(self, address: str, delta: int, tokens: int) -> None:
        for counts, change in ((self.prefilling, delta), (self.prefill_tokens, tokens)):
            count = max(0, counts.get(address, 0) + change)
            if count:
                counts[address] = count
            else:
                counts.pop(address, None)
        snapshot = self._snapshot
        if snapshot is not None and (i := snapshot.index_by_address.get(address)) is not None:
            self._write_prefilling(snapshot, i, address, self.remote.get(address))

    def _write_prefilling(self, snapshot: PoolSnapshot, i: int, address: str, remote: EndpointInFlight | None) -> None:
        snapshot.prefilling[i] = self.prefilling.get(address, 0) + (remote.prefilling if remote is not None else 0)
        snapshot.prefill_tokens[i] = self.prefill_tokens.get(address, 0) + (remote.prefill_tokens if remote is not None else 0)

    def _add(self, address: str, served_name: str | None, delta: int) -> None:
        count = max(0, self.counts.get(address, 0) + delta)
        if count:
            self.counts[address] = count
        else:
            self.counts.pop(address, None)
        left = 0
        names: dict[str, int] = {}
        if served_name is not None:
            names = self.by_name.setdefault(address, names)
            left = max(0, names.get(served_name, 0) + delta)
            if left:
                names[served_name] = left
            else:
                names.pop(served_name, None)
                if not names:
                    del self.by_name[address]
        snapshot = self._snapshot
        if snapshot is not None and (i := snapshot.index_by_address.get(address)) is not None:
            remote = self.remote.get(address)
            snapshot.in_flight[i] = count + (remote.requests if remote is not None else 0)
            if served_name is not None:
                snapshot.note_in_flight(i, served_name, left + (remote.by_name.get(served_name, 0) if remote is not None else 0))
