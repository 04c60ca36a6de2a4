"""Scheduling plugins: filters and scorers as small pure functions of (request, pool snapshot, cycle).

Both work on whole-pool numpy vectors so one cycle costs a few dozen vector operations whatever the pool size:
a filter returns a boolean mask of the endpoints it keeps (None: it keeps all), a scorer returns one score in
[0, 1] per endpoint (None: zero everywhere). The scheduler combines masks, adds weighted scores and picks among the
remaining candidates. They see only in-memory data, so the simulator runs exactly this code. Each plugin type has
a factory taking its YAML ``parameters``; ``REGISTRY`` maps every type name (filters, scorers, the picker and the
request plugins of ``loraplane.picker.lifecycle``) to its kind, parameters model and factory.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np
from pydantic import Field, model_validator

from loraplane.api import ApiModel
from loraplane.picker.snapshot import BoolArray, FloatArray, PoolSnapshot

if TYPE_CHECKING:
    from loraplane.picker.lifecycle import PluginRuntime, RequestPlugin
    from loraplane.picker.prefix import PrefixRequest


@dataclass(frozen=True, slots=True)
class SchedulingRequest:
    """What the scheduler needs to know about one request."""

    #: the chosen revision's served name; None for a base-model request (every pod serves it).
    served_name: str | None = None
    #: the artifact digest a pod must report for the revision to count as warm there.
    digest: str | None = None
    #: GIE convention: > 0 protected (gold), < 0 sheddable.
    priority: int = 0
    tenant: str = "default"
    #: the gateway's subset hint, entries ``ip:port`` or ``ip`` (see ``subset_hint_filter``); None: no hint.
    subset: frozenset[str] | None = None
    #: the prompt's prefix blocks, hashed once per request by the prefix scorer's ``read_body``; None: no prefix signal
    prefix: PrefixRequest | None = None
    #: the prompt's estimated length in tokens (``ParsedBody.prompt_tokens``; 0: unknown): its pod's prefill queue
    #: counts it until the first token
    prompt_tokens: int = 0


@dataclass(slots=True)
class Cycle:
    """Per-request scratch state shared by the plugins of one scheduling cycle."""

    #: endpoints still in the running (whole-pool mask)
    candidates: BoolArray
    #: per endpoint (whole pool): max(queue/queue_threshold, kv/kv_threshold, in_flight/in_flight_threshold);
    #: stale endpoints count as fully used (1.0). At or above 1.0 an endpoint is saturated.
    utilisation: FloatArray
    #: utilisation < 1.0
    unsaturated: BoolArray
    #: per endpoint (whole pool): the share of the request's prefix blocks it holds, set once per cycle in the
    #: prepare-data stage by the profile's ``prefix-cache-scorer`` (``PrefixCacheScorer.prepare``); None: no prefix
    #: signal
    prefix_hit: FloatArray | None = None
    #: the request's hashed prompt length in tokens (what a full prefix hit saves in prefill)
    prefix_tokens: float = 0.0
    #: the scheduler's seeded generator, for plugins that draw (the legacy ``lora-affinity-filter``); None outside
    #: a decision
    rng: np.random.Generator | None = None


class SchedulingError(Exception):
    """The request cannot be scheduled (now); ``status`` is the HTTP status the client gets, ``reason`` the
    ``x-llm-d-request-dropped-reason`` header. Every refusal the picker makes is one of these or a ``ClientError``."""

    status = 500
    reason = "internal"


class NoEndpointError(SchedulingError):
    """No candidate endpoint is left (empty pool, subset hint matching nothing, nothing ready)."""

    status = 503
    reason = "rejected-no-endpoints"


class RevisionNotServedError(NoEndpointError):
    """No candidate holds the request's revision and none would load it on demand: every one would answer 404. With
    flow control on the request waits (a holder may come: a sidecar loading it, a stale one heard again)."""


class PoolSaturatedError(SchedulingError):
    """A sheddable request while the pool is saturated (flow control off: the pool's mean utilisation reached 1.0;
    on: every candidate is saturated, and the request waits instead)."""

    status = 429
    reason = "rejected-saturated"


#: the scheduler's refusals a request waits out in flow control instead (a pod may get room, or the revision)
WAITED_OUT: tuple[type[SchedulingError], ...] = (PoolSaturatedError, RevisionNotServedError)


Filter = Callable[[SchedulingRequest, PoolSnapshot, Cycle], BoolArray | None]
Scorer = Callable[[SchedulingRequest, PoolSnapshot, Cycle], FloatArray | None]


class SaturationThresholds(ApiModel):
    """When an endpoint counts as saturated (GIE's detector, plus the picker's own in-flight count)."""

    queue_threshold: float = Field(default=5.0, gt=0)
    kv_threshold: float = Field(default=0.8, gt=0, le=1)
    in_flight_threshold: float = Field(default=16.0, gt=0)


def reported_utilisation(pool: PoolSnapshot, thresholds: SaturationThresholds) -> FloatArray:
    """The part of utilisation that comes from the sidecars' reports (fixed for a snapshot's lifetime)."""
    util = np.maximum(pool.queue_depth / thresholds.queue_threshold, pool.kv_utilization / thresholds.kv_threshold)
    if pool.any_unknown:  # stale without a report kept: unknown load counts as saturated (last-heard: as heard)
        util[pool.unknown] = np.maximum(util[pool.unknown], 1.0)
    return util


class _NoParameters(ApiModel):
    pass


class FilterParameters(ApiModel):
    """Parameters every filter takes: ``failOpen`` keeps all candidates when the filter would drop every one."""

    fail_open: bool = False


# --- filters ----------------------------------------------------------------------------------------------------


def subset_hint_filter(_params: FilterParameters) -> Filter:
    """Keep only endpoints the gateway's subset hint names (no hint: keep all).

    A hint entry is an address (``ip:port``, matched exactly) or a bare IP (every endpoint on that IP); entries
    naming no endpoint of the pool are ignored. The scheduler always runs this filter first and never fails it
    open: the protocol forbids picking outside the subset.
    """
    token = object()

    def run(request: SchedulingRequest, pool: PoolSnapshot, _cycle: Cycle) -> BoolArray | None:
        subset = request.subset
        if subset is None:
            return None

        def members() -> BoolArray:
            mask = np.zeros(pool.size, dtype=np.bool_)
            for entry in subset:
                index = pool.index_by_address.get(entry)
                for i in (index,) if index is not None else pool.indices_by_ip.get(entry, ()):
                    mask[i] = True
            return mask

        return pool.memo((token, subset), members)

    return run


def ready_filter(_params: FilterParameters) -> Filter:
    """Keep endpoints that report ready."""
    return lambda _request, pool, _cycle: None if pool.all_ready else pool.ready


def staleness_filter(_params: FilterParameters) -> Filter:
    """Drop endpoints whose report is older than its TTL plus the grace (pair with ``failOpen: true``), except
    those whose last report held the request's revision when no fresh endpoint holds it: a pod whose sidecar went
    silent (stalled, or unable to write to Redis) still serves what it held, where a fresh pod without the revision
    would answer 404."""
    token = object()

    def run(request: SchedulingRequest, pool: PoolSnapshot, _cycle: Cycle) -> BoolArray | None:
        if not pool.any_stale:
            return None
        heard = pool.last_heard_holders(request.served_name, request.digest)
        if heard is None or pool.lookup(request.served_name, request.digest) is not None:
            return pool.fresh

        def fresh_or_heard() -> BoolArray:
            mask = pool.fresh.copy()
            mask[heard] = True
            return mask

        return pool.memo((token, request.served_name, request.digest), fresh_or_heard)

    return run


class ResidencyFilterParameters(FilterParameters):
    """The residency filter's parameters."""

    #: when no holder of the revision has room for it (``PoolSnapshot.has_room``: every holder's GPU slots are taken
    #: by other revisions in flight, or it fetches another), also keep the pods that have room and load it on
    #: demand (``PoolSnapshot.on_demand``), as for a revision no pod holds; while the pool has staging pods (a sweep
    #: of new revisions) only with ``spill_while_staging``: otherwise its traffic waits for the staging pods rather
    #: than load next to the gold replicas
    spill_without_room: bool = False
    #: with ``spill_without_room``, spill while the pool has staging pods too: to the staging pods with room, else to
    #: the pods with room that hold the fewest gold (priority > 0) revisions on their GPU (``protected_warm``), so a
    #: sweep's request goes to a pod that can batch it instead of waiting in flow control for its holders (to its
    #: deadline, then 429, while the staging pods run their GPU slots' worth of other sweep revisions)
    spill_while_staging: bool = False


def residency_filter(params: ResidencyFilterParameters) -> Filter:
    """Keep endpoints holding the exact revision at some tier (GPU, CPU or disk): the ones that can serve it.

    Runtimes serve only adapters they have registered, so a pod where the revision is absent would answer 404.
    Where no candidate's fresh report holds it, the stale candidates whose last report did (``last_heard``: their
    sidecars went silent) are kept. Pods draining the revision (their sidecar is about to unload it) are kept only
    when no remaining candidate holds it otherwise: they still serve it for a moment, which beats a pod that does
    not have it at all. A revision no candidate holds at all goes to the pods that load on demand
    (``EndpointState.loads_on_demand``: simulated pods), the pool's staging pods among them where the controller
    names some (``RouteTable.staging_pods``: the pods it keeps a sweep of new revisions on, away from the gold
    replicas); where none loads on demand it raises ``RevisionNotServedError`` (the request waits in flow control,
    or gets a 503) instead of sending it to a pod that would answer 404, so ``failOpen`` never applies.
    Base-model requests keep all endpoints. ``spillWithoutRoom`` widens the holders to the pods with room that load
    on demand when none of the holders has any (see its parameter).
    """

    holding, holding_or_draining, last_heard, staging_on_demand = object(), object(), object(), object()

    def run(request: SchedulingRequest, pool: PoolSnapshot, cycle: Cycle) -> BoolArray | None:
        if request.served_name is None:
            return None

        def holders() -> BoolArray:
            mask = np.zeros(pool.size, dtype=np.bool_)
            entry = pool.lookup(request.served_name, request.digest)
            if entry is not None:
                mask[entry.indices] = True
            return mask

        mask = pool.memo((holding, request.served_name, request.digest), holders)
        heard = pool.last_heard_holders(request.served_name, request.digest)
        if heard is not None and not np.count_nonzero(mask & cycle.candidates):

            def heard_mask() -> BoolArray:
                found = np.zeros(pool.size, dtype=np.bool_)
                found[heard] = True
                return found

            fallback = pool.memo((last_heard, request.served_name, request.digest), heard_mask)
            if np.count_nonzero(fallback & cycle.candidates):
                return fallback
        staging = pool.staging
        if np.count_nonzero(mask & cycle.candidates):
            if (params.spill_without_room and pool.any_on_demand
                    and (staging is None or params.spill_while_staging)):
                return spill(request, pool, cycle, mask, staging)
            return mask
        draining = pool.draining_holders(request.served_name, request.digest)
        if draining is not None:

            def holders_or_draining() -> BoolArray:
                wider = mask.copy()
                wider[draining] = True
                return wider

            wider = pool.memo((holding_or_draining, request.served_name, request.digest), holders_or_draining)
            if np.count_nonzero(wider & cycle.candidates):
                return wider
        if not pool.any_on_demand or not np.count_nonzero(pool.on_demand & cycle.candidates):
            raise RevisionNotServedError(
                f"no candidate endpoint holds {request.served_name} (revision {request.digest}), and a pod that has "
                "not registered it would answer 404")
        if staging is not None:
            staged = pool.per_version(staging_on_demand, lambda: staging & pool.on_demand)
            if np.count_nonzero(staged & cycle.candidates):
                return staged
        return pool.on_demand

    def spill(request: SchedulingRequest, pool: PoolSnapshot, cycle: Cycle, mask: BoolArray,
              staging: BoolArray | None) -> BoolArray:
        room = pool.has_room(request.served_name, request.digest)
        if room is None or np.count_nonzero(mask & cycle.candidates & room):
            return mask
        room = room & pool.on_demand & cycle.candidates
        if staging is not None:
            if np.count_nonzero(room & staging):
                room = room & staging
            elif np.count_nonzero(room):
                gold = pool.protected_warm
                room = room & (gold == gold[room].min())
        return mask | room

    return run


class SaturationFilterParameters(FilterParameters):
    """Keep endpoints with utilisation <= 1 + headroom."""

    headroom: float = Field(default=0.2, ge=0)


def saturation_filter(params: SaturationFilterParameters) -> Filter:
    """Drop endpoints saturated beyond the headroom margin (pair with ``failOpen: true``)."""
    limit = 1.0 + params.headroom
    return lambda _request, _pool, cycle: cycle.utilisation <= limit


def adapter_room_filter(_params: FilterParameters) -> Filter:
    """Keep endpoints with room for the request's revision (``PoolSnapshot.has_room``, from the picker's own
    in-flight count per served name): a GPU slot against the pod's reported ``maxGpuSlots`` (a pod whose in-flight
    requests already use ``max_loras`` other adapters would hold this one in its queue until one drains), and no
    other fetch in flight where the pod lacks the revision. Pair with
    ``failOpen: true``; when no candidate has room the decision says so (``Decision.room``) and flow control holds
    the request."""
    return lambda request, pool, _cycle: pool.has_room(request.served_name, request.digest)


# --- scorers ----------------------------------------------------------------------------------------------------


class AffinityParameters(ApiModel):
    """Score of a warm endpoint by the tier the exact revision (digest match) sits at."""

    gpu: float = Field(default=1.0, ge=0, le=1)
    cpu: float = Field(default=0.6, ge=0, le=1)
    disk: float = Field(default=0.2, ge=0, le=1)


def residency_affinity_scorer(params: AffinityParameters) -> Scorer:
    """Tier affinity (GPU > CPU > disk > absent) that counts only on endpoints below saturation."""
    by_level = np.asarray([params.gpu, params.cpu, params.disk, 0.0], dtype=np.float64)
    token = object()

    def run(request: SchedulingRequest, pool: PoolSnapshot, cycle: Cycle) -> FloatArray | None:
        entry = pool.lookup(request.served_name, request.digest)
        if entry is None:
            return None

        def tier_scores() -> FloatArray:
            scores = np.zeros(pool.size)
            scores[entry.indices] = by_level[entry.levels]
            return scores

        return pool.memo((token, request.served_name, request.digest), tier_scores) * cycle.unsaturated

    return run


#: Pools of up to this many endpoints are summed and ranked in plain Python: there numpy's cost per call (~2 us,
#: a reduction ~4 us) is more than the work
SMALL_POOL = 32


def _lower_is_better(values: FloatArray) -> FloatArray | None:
    """GIE's normalisation: (max - v) / (max - min) over the pool; all equal -> no preference (None)."""
    if not len(values):
        return None
    if len(values) <= SMALL_POOL:
        listed = values.tolist()
        low, high = min(listed), max(listed)
    else:  # the ufuncs (no Python wrapper per call), and Python floats: numpy scalar arithmetic costs ~0.5 us
        low, high = float(np.minimum.reduce(values)), float(np.maximum.reduce(values))
    if high == low:
        return None
    return (high - values) * (1.0 / (high - low))


def _load_scorer(field_name: str) -> Callable[[_NoParameters], Scorer]:
    def factory(_params: _NoParameters) -> Scorer:
        return lambda _request, pool, _cycle: _lower_is_better(getattr(pool, field_name))

    factory.__doc__ = f"Prefer endpoints with a lower {field_name.replace('_', ' ')} (min-max normalised)."
    return factory


class PrefillQueueParameters(ApiModel):
    """The prefill-queue-scorer's shape: relative (min-max over the pool, the default) or absolute, and where."""

    #: None: min-max normalised over the candidates (GIE's way: one request more than the least loaded pod can
    #: already cost a pod its whole score); a number: ``max(0, 1 - prefilling / capacity)``, so pods with few
    #: requests awaiting their first token score alike and the score falls only as the queue grows
    capacity: float | None = Field(default=None, gt=0)
    #: score only endpoints where the request's revision is GPU- or host-memory-warm and that are below saturation
    #: (0 elsewhere, as tier affinity): a short first-token queue on a pod that would have to load the revision
    #: from disk is no reason to go there
    warm_only: bool = False
    #: score every endpoint below saturation, counting on one that would have to load the revision its load time as
    #: that many more requests awaiting their first token (``request_seconds`` each): a cold pod with a short queue
    #: beats a warm one whose queue is longer than the load takes (needs ``capacity``)
    load_cost: bool = False
    #: the prefill wait one request awaiting its first token stands for (a ~1,000-token prompt at 0.1 ms a token)
    request_seconds: float = Field(default=0.1, gt=0)
    #: count the queue by its prompts instead (needs ``capacity``): the estimated prompt tokens of the requests
    #: awaiting their first token (``PoolSnapshot.prefill_tokens``) at this many seconds a token, in requests of
    #: ``request_seconds``; on prompts of a few thousand tokens one request is not one request's wait
    prefill_seconds_per_token: float | None = Field(default=None, gt=0)
    #: load time of the revision from each tier where the pod reports no measurement (``PodLoad.load_seconds``);
    #: the same defaults as the ``predicted-ttft-scorer``'s
    cpu_load_seconds: float = Field(default=0.02, ge=0)
    disk_load_seconds: float = Field(default=0.25, ge=0)
    fetch_load_seconds: float = Field(default=3.0, ge=0)

    @model_validator(mode="after")
    def _one_mode(self) -> PrefillQueueParameters:
        if self.load_cost and (self.warm_only or self.capacity is None):
            raise ValueError("loadCost needs a capacity and excludes warmOnly")
        if self.prefill_seconds_per_token is not None and self.capacity is None:
            raise ValueError("prefillSecondsPerToken needs a capacity")
        return self

    def queued(self, pool: PoolSnapshot) -> FloatArray:
        """Per endpoint, its first-token queue in requests (of ``request_seconds`` each when counted by tokens)."""
        if self.prefill_seconds_per_token is None:
            return pool.prefilling
        return pool.prefill_tokens * (self.prefill_seconds_per_token / self.request_seconds)


def prefill_queue_scorer(params: PrefillQueueParameters) -> Scorer:
    """Prefer endpoints with fewer of the picker's requests awaiting their first token (``PoolSnapshot.prefilling``)."""
    if params.capacity is None and not params.warm_only:
        return _load_scorer("prefilling")(_NoParameters())
    per_request = 1.0 / params.capacity if params.capacity is not None else 0.0
    token = object()
    if params.load_cost:
        return _load_cost_scorer(params, per_request)

    def run(request: SchedulingRequest, pool: PoolSnapshot, cycle: Cycle) -> FloatArray | None:
        if params.capacity is None:
            scores = _lower_is_better(pool.prefilling)
            if scores is None:
                return None
        else:
            scores = np.maximum(0.0, 1.0 - params.queued(pool) * per_request)
        if not params.warm_only:
            return scores
        entry = pool.lookup(request.served_name, request.digest)
        if entry is None:
            return None  # warm nowhere: no preference

        def warm_mask() -> FloatArray:
            warm = np.zeros(pool.size)
            warm[entry.indices[entry.levels <= 1]] = 1.0
            return warm

        return scores * pool.memo((token, request.served_name, request.digest), warm_mask) * cycle.unsaturated

    return run


def _load_cost_scorer(params: PrefillQueueParameters, per_request: float) -> Scorer:
    """``max(0, 1 - (queued + load seconds / request_seconds) / capacity)`` on every endpoint below saturation:
    the first-token queue in requests, a pod that lacks the revision in a GPU slot charged its load as requests."""
    defaults = np.asarray([0.0, params.cpu_load_seconds, params.disk_load_seconds, params.fetch_load_seconds])
    in_requests = 1.0 / params.request_seconds
    token = object()

    def run(request: SchedulingRequest, pool: PoolSnapshot, cycle: Cycle) -> FloatArray | None:
        if request.served_name is None:
            charge: FloatArray | float = 0.0
        else:

            def load_charge() -> FloatArray:
                levels = np.full(pool.size, 3, dtype=np.intp)
                entry = pool.lookup(request.served_name, request.digest)
                if entry is not None:
                    levels[entry.indices] = entry.levels
                costs = np.where(np.isnan(pool.load_seconds), defaults, pool.load_seconds)
                return np.asarray(costs[pool.all_indices, levels] * in_requests)

            charge = pool.per_version((token, request.served_name, request.digest), load_charge)
        return np.maximum(0.0, 1.0 - (params.queued(pool) + charge) * per_request) * cycle.unsaturated

    return run


def kv_usage_scorer(_params: _NoParameters) -> Scorer:
    """1 - KV-cache utilisation."""
    return lambda _request, pool, _cycle: 1.0 - pool.kv_utilization


def tenant_priority_scorer(_params: _NoParameters) -> Scorer:
    """Steer non-gold requests away from pods keeping gold revisions warm, unless their own revision is warm there.

    A gold (priority > 0) request has no preference; otherwise an endpoint scores 0 when it holds GPU-resident
    gold revisions and the request's revision is not GPU-resident on it (loading it could evict gold), else 1.
    """

    def run(request: SchedulingRequest, pool: PoolSnapshot, _cycle: Cycle) -> FloatArray | None:
        if request.priority > 0 or not pool.has_protected:
            return None
        free = pool.unprotected
        entry = pool.lookup(request.served_name, request.digest)
        if entry is not None:
            free = free.copy()
            free[entry.indices[entry.levels == 0]] = 1.0
        return free

    return run


class PredictedTtftParameters(ApiModel):
    """The cost model: seconds until a request's first token on each endpoint (defaults where pods measure nothing)."""

    #: requests a pod runs in one batch before new ones queue
    batch_slots: float = Field(default=16.0, gt=0)
    #: mean seconds one request holds a batch slot (a queued request waits this per batch ahead of it)
    service_seconds: float = Field(default=0.5, gt=0)
    #: load cost of the revision at each tier when the pod reports no measurement (GPU costs nothing)
    cpu_load_seconds: float = Field(default=0.02, ge=0)
    disk_load_seconds: float = Field(default=0.25, ge=0)
    fetch_load_seconds: float = Field(default=3.0, ge=0)
    #: how much of a load's time counts against each request already running there (the batch stalls meanwhile)
    stall_weight: float = Field(default=0.25, ge=0)
    #: prefill seconds per prompt token not found in the pod's prefix cache (``prefix-cache-scorer`` in the profile,
    #: at any weight, supplies the hit); 0 ignores prefix hits
    prefill_seconds_per_token: float = Field(default=1e-4, ge=0)


def predicted_ttft(params: PredictedTtftParameters, request: SchedulingRequest, pool: PoolSnapshot) -> FloatArray:
    """Predicted seconds to first token per endpoint (the part that differs between endpoints).

    queue wait: the batches ahead, from the larger of the reported (running + waiting) and the picker's in-flight
    count; plus the revision's load cost at the tier it holds there (0 on GPU; measured CPU / disk / fetch costs
    from the pod's report, else the defaults); plus ``stall_weight`` x that cost for each request already running
    there (a load stalls the batch). A warm pod wins until its queue wait outgrows a colder pod's load cost.
    """
    load = np.maximum(pool.running + pool.queue_depth, pool.in_flight)
    wait = np.maximum(load + 1.0 - params.batch_slots, 0.0) * (params.service_seconds / params.batch_slots)
    if request.served_name is None:
        return wait
    defaults = np.asarray([0.0, params.cpu_load_seconds, params.disk_load_seconds, params.fetch_load_seconds])
    costs = np.where(np.isnan(pool.load_seconds), defaults, pool.load_seconds)
    levels = np.full(pool.size, 3, dtype=np.intp)
    entry = pool.lookup(request.served_name, request.digest)
    if entry is not None:
        levels[entry.indices] = entry.levels
    load_cost = costs[pool.all_indices, levels]
    return wait + load_cost * (1.0 + params.stall_weight * pool.running)


def prefill_seconds(params: PredictedTtftParameters, cycle: Cycle) -> FloatArray | float:
    """Prefill of the prompt tokens each endpoint does not hold in its prefix cache (0 without a prefix signal)."""
    if cycle.prefix_hit is None:
        return 0.0
    return (params.prefill_seconds_per_token * cycle.prefix_tokens) * (1.0 - cycle.prefix_hit)


def predicted_ttft_scorer(params: PredictedTtftParameters) -> Scorer:
    """``1 / (1 + predicted TTFT in seconds)``: the fastest predicted first token scores highest; with a prefix
    signal, the prefill of the uncached part of the prompt counts too (saved prefill tokens)."""
    return lambda request, pool, cycle: 1.0 / (1.0 + predicted_ttft(params, request, pool)
                                                + prefill_seconds(params, cycle))


@runtime_checkable
class DataPreparer(Protocol):
    """A plugin's prepare-data hook (llm-d-router's PrepareData): run once per scheduling cycle, before the filters,
    to put on the ``Cycle`` what several plugins read (the prefix match: the prefix scorer's score, the
    ``predicted-ttft-scorer``'s saved prefill, the decision's prefill estimate)."""

    def prepare(self, request: SchedulingRequest, pool: PoolSnapshot, cycle: Cycle) -> None:
        """Fill the cycle's shared data for ``request``."""


@runtime_checkable
class BodyReader(Protocol):
    """A plugin that reads what it needs from the request's parsed body once, in the director's prepare-data stage
    (the prefix scorer hashes the prompt's blocks), not at every cycle of a request the queue holds."""

    def read_body(self, request: SchedulingRequest, document: Mapping[str, Any]) -> SchedulingRequest:
        """``request`` with what the plugin read from ``document`` (the parsed JSON body)."""


@runtime_checkable
class RequestHooks(Protocol):
    """A plugin that also acts around the requests it scored (pre-request, response): its ``RequestPlugin``, made
    once per process for the process's runtime."""

    def request_hooks(self, runtime: PluginRuntime) -> RequestPlugin:
        """The hooks, for ``loraplane.picker.lifecycle.Lifecycle``."""


class PluginKind(StrEnum):
    """What a plugin type is: where in a request's life it runs."""

    #: narrows the candidates of a scheduling cycle (``Filter``)
    FILTER = "filter"
    #: adds a weighted score per endpoint (``Scorer``)
    SCORER = "scorer"
    #: picks the endpoints from the scores (``Picker``)
    PICKER = "picker"
    #: lifecycle hooks around a request: admission, before it is sent, when its response completes
    #: (``loraplane.picker.lifecycle.RequestPlugin``)
    REQUEST = "request"


@dataclass(frozen=True, slots=True)
class PluginType:
    """A plugin type: its kind, its parameters model and its factory.

    The kind says where the config's plugin runs first; an instance may serve more hook points besides (as in
    llm-d-router, one plugin several extension points): a ``DataPreparer`` is run in the cycle's prepare-data stage,
    a ``RequestHooks`` plugin adds its hooks to the request's lifecycle, whatever its weight.

    Filter, scorer and picker factories take the validated parameters; request-plugin factories take the parameters
    and the process's ``PluginRuntime`` (clock, wake-ups, in-flight tracker, metrics). A ``snapshot_only`` scorer
    ignores the request and the picker's in-flight counts: the scheduler evaluates it once per snapshot over the
    whole pool (normalising across the pool, not the candidates) and caches the result.
    """

    kind: PluginKind
    parameters: type[ApiModel]
    factory: Callable[..., Any]
    snapshot_only: bool = False
    #: a filter's: given its parameters and the pool, is its answer a function of the request and the sidecars'
    #: reports alone (not of the picker's in-flight counts)? None: it may read them. A request that must wait can go
    #: only once the load of an endpoint such filters kept changes (``Scheduler.still_waits``)
    load_blind: Callable[[Any, PoolSnapshot], bool] | None = None


#: every plugin type a config may name, by type name
REGISTRY: dict[str, PluginType] = {}


def register(name: str, plugin_type: PluginType) -> None:
    """Make ``name`` usable in configs (a name is registered once)."""
    if name in REGISTRY:
        raise ValueError(f"plugin type {name!r} is already registered")
    REGISTRY[name] = plugin_type


def plugin_type(name: str) -> PluginType:
    """The registered type ``name`` (a ValueError lists the known ones)."""
    found = REGISTRY.get(name)
    if found is None:
        raise ValueError(f"unknown plugin type {name!r}; known: {', '.join(sorted(REGISTRY))}")
    return found


def _always(_params: object, _pool: PoolSnapshot) -> bool:
    return True


def _residency_load_blind(params: ResidencyFilterParameters, pool: PoolSnapshot) -> bool:
    """The residency filter reads the in-flight counts only to spill to on-demand pods with room."""
    return not (params.spill_without_room and pool.any_on_demand)


_BUILT_IN_FILTERS: list[tuple[str, type[FilterParameters], Callable[..., Filter],
                              Callable[[Any, PoolSnapshot], bool] | None]] = [
    ("subset-hint-filter", FilterParameters, subset_hint_filter, _always),
    ("ready-filter", FilterParameters, ready_filter, _always),
    ("staleness-filter", FilterParameters, staleness_filter, _always),
    ("residency-filter", ResidencyFilterParameters, residency_filter, _residency_load_blind),
    ("saturation-filter", SaturationFilterParameters, saturation_filter, None),
    ("adapter-room-filter", FilterParameters, adapter_room_filter, None),
]
_BUILT_IN_SCORERS: list[tuple[str, type[ApiModel], Callable[..., Scorer], bool]] = [
    ("residency-affinity-scorer", AffinityParameters, residency_affinity_scorer, False),
    ("tenant-priority-scorer", _NoParameters, tenant_priority_scorer, False),
    ("in-flight-scorer", _NoParameters, _load_scorer("in_flight"), False),
    ("prefill-queue-scorer", PrefillQueueParameters, prefill_queue_scorer, False),
    ("queue-scorer", _NoParameters, _load_scorer("queue_depth"), True),
    ("active-tokens-scorer", _NoParameters, _load_scorer("active_tokens"), True),
    ("evictions-scorer", _NoParameters, _load_scorer("recent_evictions"), True),
    ("kv-usage-scorer", _NoParameters, kv_usage_scorer, True),
    ("predicted-ttft-scorer", PredictedTtftParameters, predicted_ttft_scorer, False),
]
for _name, _parameters, _factory, _load_blind in _BUILT_IN_FILTERS:
    register(_name, PluginType(PluginKind.FILTER, _parameters, _factory, load_blind=_load_blind))
for _scorer in _BUILT_IN_SCORERS:
    register(_scorer[0], PluginType(PluginKind.SCORER, *_scorer[1:]))
