"""Today's peers as picker plugins: llm-d-router v0.10's LoRA scorers, the legacy GIE filter chain, least-request.

Each plugin is a pure function of (request, snapshot, cycle), like loraplane's own, reading what the peers read:
vLLM's metrics of each endpoint (``EndpointState.running_adapters`` / ``waiting_adapters`` from
``vllm:lora_requests_info``, ``gpu_slots`` from its ``max_lora``, ``loaded_adapters`` / ``gpu_loaded`` from the
residency gauges of vLLM PR #54830, ``queue_depth``, ``running``, ``kv_utilization``), filled by the picker's scrape
data source (``--data-source scrape``) or by the simulator's view of its pods. The packaged configs that combine them
are ``picker/loraplane/picker/peers/<name>.yaml`` (``--config peer:<name>``); docs/picker.md ("Peer plugins and configs") gives each
one's source.

| type | kind | source |
|---|---|---|
| ``lora-affinity-scorer`` | scorer | llm-d-router v0.10.0 ``scorer/loraaffinity``; capacity check of PR #2625 by default |
| ``lora-load-state-scorer`` | scorer | llm-d-router PR #2792 (open) ``scorer/loraloadstate`` |
| ``lora-affinity-filter`` | filter | GIE's legacy filter (removed in GIE #1305), as the simulator's old router ran it |
| ``low-queue-filter`` | filter | GIE's legacy ``low queueing filter`` (queue < 128) |
| ``least-queue-filter`` | filter | GIE's legacy ``least queuing filter`` |
| ``least-kv-cache-filter`` | filter | GIE's legacy ``least KV cache percent`` filter |
| ``least-request-scorer`` | scorer | fewest requests waiting + running (Envoy's least-request, from the metrics) |
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
from pydantic import Field

from loraplane.api import ApiModel
from loraplane.picker.plugins import (
    Cycle,
    Filter,
    FilterParameters,
    PluginKind,
    PluginType,
    SchedulingRequest,
    Scorer,
    _lower_is_better,
    _NoParameters,
    register,
)
from loraplane.picker.snapshot import BoolArray, EndpointState, FloatArray, PoolSnapshot

#: how a LoRA plugin decides an endpoint has room for one more adapter: ``distinct`` adapters across the running
#: and waiting lists below ``max_lora`` (llm-d-router PR #2625, the merged fix of #2605); ``listed``: the length of
#: the running list plus the waiting list (llm-d-router v0.10.0 and the legacy GIE filter; vLLM names every busy
#: adapter in both lists, so this counts each twice)
CapacityCheck = Literal["distinct", "listed"]


@dataclass(slots=True)
class LoraView:
    """The pool's vLLM LoRA metrics for the peers' plugins (one per snapshot version, ``lora_view``): per-endpoint
    figures as Python lists, and per-adapter results computed on first use and kept for the view's life. An
    adapter's first decision on a view costs a Python pass over the pool (~0.3 us an endpoint; at the pool sizes the
    peers run, a few endpoints to a few dozen, less than the numpy calls a vector version would make)."""

    pool: PoolSnapshot
    size: int
    #: per endpoint: len(running list) + len(waiting list), the distinct adapters across both, GPU adapter slots
    #: (``max_lora``; 0: not reported) and adapters in GPU slots
    listed: list[int]
    distinct: list[int]
    max_active: list[int]
    gpu_loaded: list[int]
    _memo: dict[Hashable, Any] = field(default_factory=dict)

    def memo(self, key: Hashable, compute: Callable[[], Any]) -> Any:
        """A value derived from this view (per-adapter masks and score vectors)."""
        value = self._memo.get(key)
        if value is None:
            value = self._memo[key] = compute()
        return value

    def vector(self, key: Hashable, values: Callable[[], list[Any]], dtype: type = np.float64) -> Any:
        """``values()`` as a numpy vector, kept."""
        return self.memo(key, lambda: np.asarray(values(), dtype=dtype))

    def running(self, name: str | None) -> list[bool]:
        """Per endpoint: its ``lora_requests_info`` lists ``name`` as running (never the base model)."""
        return self.memo(("running", name), lambda: [name in e.running_adapters for e in self.pool.endpoints]
                         if name is not None else [False] * self.size)

    def waiting(self, name: str | None) -> list[bool]:
        """Per endpoint: its ``lora_requests_info`` lists ``name`` as waiting."""
        return self.memo(("waiting", name), lambda: [name in e.waiting_adapters for e in self.pool.endpoints]
                         if name is not None else [False] * self.size)

    def levels(self, name: str) -> list[int]:
        """Per endpoint, where it reports ``name``: 0 in a GPU slot, 1 in the host cache only, 2 not resident."""
        def level(e: EndpointState) -> int:
            state = (e.loaded_adapters or _NONE).get(name)
            return 2 if state is None else 0 if state.gpu else 1

        return self.memo(("levels", name), lambda: [level(e) for e in self.pool.endpoints])

    def room(self, check: CapacityCheck) -> list[bool]:
        """Per endpoint: room for another adapter by ``check``."""
        def compute() -> list[bool]:
            used = self.distinct if check == "distinct" else self.listed
            return [u < m for u, m in zip(used, self.max_active, strict=True)]

        return self.memo(("room", check), compute)

    def free_slot(self) -> list[bool]:
        """Per endpoint: fewer adapters in GPU slots than slots."""
        return self.memo("free", lambda: [g < m for g, m in zip(self.gpu_loaded, self.max_active, strict=True)])

    def headroom(self) -> list[float]:
        """Per endpoint: its share of free GPU slots (0 where it reports no slots)."""
        return self.memo("headroom", lambda: [max(m - g, 0) / m if m > 0 else 0.0
                                              for g, m in zip(self.gpu_loaded, self.max_active, strict=True)])

    def idle_resident(self, index: int) -> bool:
        """Endpoint ``index`` holds an unpinned GPU-resident adapter no running list names (evicting it stalls
        nobody)."""
        def idle() -> bool:
            endpoint = self.pool.endpoints[index]
            busy = endpoint.running_adapters
            return any(state.gpu and not state.pinned and name not in busy
                       for name, state in (endpoint.loaded_adapters or _NONE).items())

        return bool(self.memo(("idle", index), lambda: [idle()])[0])


_NONE: dict[str, Any] = {}


def _distinct(e: EndpointState) -> int:
    busy, queued = e.running_adapters, e.waiting_adapters
    return len(busy) if busy is queued else len(busy | queued)


def _build_view(pool: PoolSnapshot) -> LoraView:
    endpoints = pool.endpoints
    return LoraView(
        pool, pool.size,
        listed=[len(e.running_adapters) + len(e.waiting_adapters) for e in endpoints],
        distinct=list(map(_distinct, endpoints)),
        max_active=[e.gpu_slots for e in endpoints],
        gpu_loaded=[e.gpu_loaded for e in endpoints],
    )


_VIEW = object()


def lora_view(pool: PoolSnapshot) -> LoraView:
    """The pool's ``LoraView`` (built on first use after each snapshot change)."""
    return pool.per_version(_VIEW, lambda: _build_view(pool))


# --- llm-d-router v0.10: lora-affinity-scorer ---------------------------------------------------------------------


class LoraAffinityParameters(ApiModel):
    """``lora-affinity-scorer``: llm-d-router v0.10's tiers; which capacity check."""

    #: ``distinct`` (default): PR #2625's fix, merged after v0.10.0; ``listed``: v0.10.0 as released
    capacity_check: CapacityCheck = "distinct"


def lora_affinity_scorer(params: LoraAffinityParameters) -> Scorer:
    """llm-d-router v0.10's LoRA affinity: 1.0 where the adapter is in the running list, else 0.8 where the
    endpoint has room for another adapter (``capacityCheck``), else 0.6 where it is in the waiting list, else 0.
    A base-model request (no adapter) is in no list: 0.8 where there is room."""
    check = params.capacity_check

    def run(request: SchedulingRequest, pool: PoolSnapshot, _cycle: Cycle) -> FloatArray | None:
        view = lora_view(pool)
        name = request.served_name

        def scores() -> list[float]:
            return [1.0 if active else 0.8 if room else 0.6 if queued else 0.0 for active, room, queued
                    in zip(view.running(name), view.room(check), view.waiting(name), strict=True)]

        return view.vector(("affinity", check, name), scores)

    return run


# --- llm-d-router PR #2792: lora-load-state-scorer ----------------------------------------------------------------


class LoraLoadStateParameters(ApiModel):
    """``lora-load-state-scorer``, with the parameter names and defaults of llm-d-router PR #2792."""

    gpu_resident_score: float = Field(default=1.0, ge=0, le=1)
    cpu_resident_score: float = Field(default=0.7, ge=0, le=1)
    free_slot_score: float = Field(default=0.6, ge=0, le=1)
    evictable_score: float = Field(default=0.3, ge=0, le=1)
    saturated_score: float = Field(default=0.0, ge=0, le=1)
    #: added on the endpoint a rendezvous (FNV-64a) hash of the adapter picks among the candidates, while the
    #: adapter is not in a GPU slot there (its first misses converge on one home)
    placement_bonus: float = Field(default=0.03, ge=0, le=1)
    #: times the endpoint's share of free GPU slots (ties within a tier go to the endpoint with the most room)
    headroom_bonus: float = Field(default=0.03, ge=0, le=1)
    #: prefixed to each endpoint's name in the rendezvous hash (llm-d hashes the endpoint's ``namespace/name``:
    #: ``"<namespace>/"`` picks the same home as llm-d for the same pods)
    endpoint_id_prefix: str = ""

    def valid(self) -> bool:
        """As the PR validates: tiers ordered GPU >= CPU >= free slot >= evictable >= saturated, the bonuses below
        1 together and under every non-zero gap between consecutive tiers (scaled), so a bonus never crosses a tier."""
        budget = self.placement_bonus + self.headroom_bonus
        if budget >= 1:
            return False
        tiers = [self.gpu_resident_score, self.cpu_resident_score, self.free_slot_score, self.evictable_score,
                 self.saturated_score]
        for high, low in itertools.pairwise(tiers):
            gap = high - low
            if gap < 0 or (gap > 0 and gap * (1 - budget) <= budget):
                return False
        return True


@functools.lru_cache(maxsize=65_536)
def rendezvous_hash(adapter: str, endpoint_id: str) -> int:
    """FNV-64a over the adapter name, a zero byte and the endpoint id (llm-d-router PR #2792's ``rendezvous``)."""
    h = 0xCBF29CE484222325
    for byte in adapter.encode() + b"\x00" + endpoint_id.encode():
        h = ((h ^ byte) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


def lora_load_state_scorer(params: LoraLoadStateParameters) -> Scorer:
    """llm-d-router PR #2792's residency tiers: the adapter in a GPU slot 1.0, in the host cache 0.7, else a free GPU
    slot 0.6, else an idle unpinned GPU resident to evict 0.3, else 0; each scaled by 1 - (placement + headroom
    bonuses), plus the placement bonus on the adapter's rendezvous home among the candidates (unless it is in a GPU
    slot there) and the headroom bonus x the endpoint's share of free GPU slots. Endpoints exporting no residency
    gauges fall to the capacity tiers. A base-model request scores each endpoint's share of GPU slots holding no
    adapter, scaled. Invalid parameters fall back to the defaults as a set, as the PR does."""
    if not params.valid():
        params = LoraLoadStateParameters(endpoint_id_prefix=params.endpoint_id_prefix)
    scale = 1.0 - (params.placement_bonus + params.headroom_bonus)
    prefix = params.endpoint_id_prefix

    tiers = (params.gpu_resident_score, params.cpu_resident_score)
    bonus = params.headroom_bonus

    def run(request: SchedulingRequest, pool: PoolSnapshot, cycle: Cycle) -> FloatArray | None:
        view = lora_view(pool)
        name = request.served_name
        if name is None:  # the base model: the share of GPU slots holding no adapter
            return view.vector("base-model", lambda: [(h if m > 0 else 1.0) * scale
                                                      for h, m in zip(view.headroom(), view.max_active, strict=True)])

        def base_scores() -> list[float]:
            free, headroom, scores = view.free_slot(), view.headroom(), []
            for i, level in enumerate(view.levels(name)):
                if level < 2:
                    tier = tiers[level]
                elif free[i]:
                    tier = params.free_slot_score
                else:
                    tier = params.evictable_score if view.idle_resident(i) else params.saturated_score
                scores.append(tier * scale + bonus * headroom[i])
            return scores

        scores = view.vector(("load-state", name), base_scores)
        if not params.placement_bonus:
            return scores
        home = _home(name, pool, cycle.candidates, prefix)
        if view.levels(name)[home] == 0:
            return scores
        with_bonus = scores.copy()
        with_bonus[home] += params.placement_bonus
        return with_bonus

    return run


def _home(adapter: str, pool: PoolSnapshot, candidates: BoolArray, prefix: str) -> int:
    """The candidate with the highest rendezvous hash for ``adapter``."""
    endpoints = pool.endpoints
    best, best_hash = -1, -1
    for i in candidates.nonzero()[0].tolist():
        h = rendezvous_hash(adapter, prefix + endpoints[i].name)
        if h > best_hash:
            best, best_hash = i, h
    return best


# --- GIE's legacy filter chain (removed in GIE #1305) ---------------------------------------------------------------


class LowQueueParameters(FilterParameters):
    """``low-queue-filter``: keep endpoints with fewer waiting requests than ``threshold``."""

    threshold: float = Field(default=128, gt=0)


def low_queue_filter(params: LowQueueParameters) -> Filter:
    """Endpoints whose queue is below the threshold (GIE's ``queueingThresholdLoRA``, 128); pair with ``failOpen``."""
    threshold = params.threshold
    return lambda _request, pool, _cycle: pool.queue_depth < threshold


class LoraAffinityFilterParameters(FilterParameters):
    """``lora-affinity-filter``: GIE's legacy LoRA filter."""

    #: probability of keeping the endpoints where the adapter is listed (running or waiting), GIE's
    #: ``loraAffinityThreshold``
    threshold: float = Field(default=0.999, ge=0, le=1)
    #: room for another adapter (the ``listed`` sum, as GIE's legacy filter)
    capacity_check: CapacityCheck = "listed"


def lora_affinity_filter(params: LoraAffinityFilterParameters) -> Filter:
    """GIE's legacy LoRA filter as the simulator's ``gie-lora-filter`` router ran it: with probability ``threshold``
    (one draw per request from the scheduler's generator) the candidates where the adapter is running or waiting;
    otherwise, or when there are none, the candidates with room for another adapter; none of either: all (pair with
    ``failOpen: true``)."""
    threshold, check = params.threshold, params.capacity_check

    def run(request: SchedulingRequest, pool: PoolSnapshot, cycle: Cycle) -> BoolArray | None:
        view = lora_view(pool)
        draw = cycle.rng.random() if cycle.rng is not None else 0.0
        if draw < threshold:
            name = request.served_name
            listed = view.vector(("listed", name), lambda: [r or w for r, w in zip(view.running(name),
                                                                                   view.waiting(name), strict=True)],
                                 np.bool_)
            affine = listed & cycle.candidates
            if np.count_nonzero(affine):
                return affine
        return view.vector(("room", check), lambda: view.room(check), np.bool_)

    return run


class LeastFilterParameters(FilterParameters):
    """``least-queue-filter`` / ``least-kv-cache-filter``: keep the least loaded candidates."""

    #: false: only those at the minimum (the simulator's old router); true: GIE's legacy range, those within
    #: ``min + (max - min) / candidates`` (integer division for queues, as GIE's Go code)
    gie_range: bool = False


def _least(field_name: str, integer: bool) -> Callable[[LeastFilterParameters], Filter]:
    def factory(params: LeastFilterParameters) -> Filter:
        spread = params.gie_range

        def run(_request: SchedulingRequest, pool: PoolSnapshot, cycle: Cycle) -> BoolArray | None:
            values = getattr(pool, field_name)
            among = values[cycle.candidates]
            if not len(among):
                return None
            low = among.min()
            limit = low
            if spread:
                span = among.max() - low
                limit = low + (span // len(among) if integer else span / len(among))
            return values <= limit

        return run

    factory.__doc__ = f"Keep the candidates with the least {field_name.replace('_', ' ')}."
    return factory


# --- least-request --------------------------------------------------------------------------------------------------


def least_request_scorer(_params: _NoParameters) -> Scorer:
    """Fewest requests waiting + running (the runtime's metrics; Envoy's least-request idea), min-max normalised."""
    return lambda _request, pool, _cycle: _lower_is_better(pool.queue_depth + pool.running)


register("lora-affinity-scorer", PluginType(PluginKind.SCORER, LoraAffinityParameters, lora_affinity_scorer))
register("lora-load-state-scorer", PluginType(PluginKind.SCORER, LoraLoadStateParameters, lora_load_state_scorer))
register("least-request-scorer", PluginType(PluginKind.SCORER, _NoParameters, least_request_scorer, snapshot_only=True))
register("low-queue-filter", PluginType(PluginKind.FILTER, LowQueueParameters, low_queue_filter))
register("lora-affinity-filter", PluginType(PluginKind.FILTER, LoraAffinityFilterParameters, lora_affinity_filter))
register("least-queue-filter", PluginType(PluginKind.FILTER, LeastFilterParameters, _least("queue_depth", True)))
register("least-kv-cache-filter", PluginType(PluginKind.FILTER, LeastFilterParameters,
                                             _least("kv_utilization", False)))
