"""The scheduler: filters, weighted scorers and a max-score picker, built from a YAML config.

The config follows the spirit of GIE's ``EndpointPickerConfig``: named plugin instances with parameters, and a
scheduling profile listing which plugins run and with what weight::

    apiVersion: loraplane.io/v1alpha1
    kind: EndpointPickerConfig
    saturationDetector: {queueThreshold: 5, kvThreshold: 0.8, inFlightThreshold: 16}
    plugins:
    - {name: affinity, type: residency-affinity-scorer, parameters: {gpu: 1.0, cpu: 0.6, disk: 0.2}}
    - {type: saturation-filter, parameters: {headroom: 0.2, failOpen: true}}
    - {type: max-score-picker, parameters: {maxEndpoints: 3}}
    schedulingProfiles:
    - name: default
      plugins: [{pluginRef: saturation-filter}, {pluginRef: affinity, weight: 100}, {pluginRef: max-score-picker}]

``Scheduler.schedule(request, pool, rng)`` is pure apart from the injected numpy ``Generator`` used to break ties.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from importlib import resources
from pathlib import Path
from typing import Any, Literal, TypeVar

import numpy as np
import yaml
from pydantic import Field, model_validator

from loraplane.api import ApiModel, Tier
from loraplane.picker import flowcontrol, lifecycle, peers  # importing them registers their plugins
from loraplane.picker import prefix as _prefix  # noqa: F401 (registers the prefix-cache-scorer)
from loraplane.picker.plugins import (
    REGISTRY,
    SMALL_POOL,
    BodyReader,
    Cycle,
    DataPreparer,
    Filter,
    FilterParameters,
    FloatArray,
    NoEndpointError,
    PluginKind,
    PluginType,
    PoolSaturatedError,
    RequestHooks,
    SaturationThresholds,
    SchedulingError,
    SchedulingRequest,
    Scorer,
    plugin_type,
    register,
    reported_utilisation,
)
from loraplane.picker.snapshot import BoolArray, IntArray, PoolSnapshot

P = TypeVar("P")

PICKER_TYPE = "max-score-picker"
#: the endpoint-picker protocol's subset restriction: always the first filter, never failed open
SUBSET_FILTER_TYPE = "subset-hint-filter"


class PluginSpec(ApiModel):
    """One plugin instance: its type, an optional name (defaults to the type) and its parameters."""

    type: str
    name: str | None = None
    parameters: dict[str, object] = Field(default_factory=dict)

    @property
    def ref(self) -> str:
        """The name profiles refer to it by."""
        return self.name or self.type


class PluginRef(ApiModel):
    """A plugin used by a profile; ``weight`` matters for scorers only."""

    plugin_ref: str
    weight: float = Field(default=1.0, ge=0)


class SchedulingProfile(ApiModel):
    """The ordered plugins of one profile."""

    name: str = "default"
    plugins: list[PluginRef] = Field(min_length=1)


class PickerParameters(ApiModel):
    """The max-score picker: how many endpoints to return (the first, then Envoy's retry fallbacks)."""

    max_endpoints: int = Field(default=3, ge=1, le=16)


register(PICKER_TYPE, PluginType(PluginKind.PICKER, PickerParameters, lambda params: params.max_endpoints))


class EndpointPickerConfig(ApiModel):
    """The picker's scheduling configuration file."""

    api_version: Literal["loraplane.io/v1alpha1"] = "loraplane.io/v1alpha1"
    kind: Literal["EndpointPickerConfig"] = "EndpointPickerConfig"
    saturation_detector: SaturationThresholds = Field(default_factory=SaturationThresholds)
    plugins: list[PluginSpec] = Field(min_length=1)
    scheduling_profiles: list[SchedulingProfile] = Field(min_length=1)

    @model_validator(mode="after")
    def _refs_resolve(self) -> EndpointPickerConfig:
        known = {p.ref: p for p in self.plugins}
        if len(known) != len(self.plugins):
            raise ValueError("two plugins share a name")
        for spec in self.plugins:
            plugin_type(spec.type).parameters.model_validate(spec.parameters)
        for profile in self.scheduling_profiles:
            for ref in profile.plugins:
                if ref.plugin_ref not in known:
                    raise ValueError(f"profile {profile.name!r} refers to undefined plugin {ref.plugin_ref!r}")
        return self

    @classmethod
    def load(cls, path: str | Path | None = None) -> EndpointPickerConfig:
        """Read a YAML config file; ``"peer:<name>"``: a packaged peer config (``loraplane.picker.peers``); without
        a path, the packaged default (``default-config.yaml``)."""
        if path is None:
            text = resources.files("loraplane.picker").joinpath("default-config.yaml").read_text()
        elif isinstance(path, str) and path.startswith(peers.PEER_PREFIX):
            text = peers.peer_config_text(path.removeprefix(peers.PEER_PREFIX))
        else:
            text = Path(path).read_text()
        return cls.from_yaml(text)

    def with_parameters(self, plugin: str, **parameters: object) -> EndpointPickerConfig:
        """A copy with ``parameters`` merged into those of the plugin named ``plugin`` (e.g. flow control on)."""
        data = self.model_dump(by_alias=True)
        spec = next((p for p in data["plugins"] if (p.get("name") or p["type"]) == plugin), None)
        if spec is None:
            raise ValueError(f"the config has no plugin named {plugin!r}")
        spec["parameters"] = {**spec["parameters"], **parameters}
        return type(self).model_validate(data)

    def to_yaml(self) -> str:
        """The config as YAML (what ``load`` reads)."""
        return yaml.safe_dump(self.model_dump(by_alias=True, exclude_none=True), sort_keys=False)

    @classmethod
    def from_yaml(cls, text: str) -> EndpointPickerConfig:
        """Parse YAML text (a ValueError names what is wrong)."""
        data = yaml.safe_load(text)
        if not isinstance(data, dict):
            raise ValueError("the picker config must be a YAML mapping")
        return cls.model_validate(data)


class Outcome(StrEnum):
    """How a decision went, for metrics (``loraplane_picker_decisions_total{outcome}``)."""

    WARM_GPU = "warm-gpu"
    WARM_CPU = "warm-cpu"
    COLD = "cold"
    SPILLED_SATURATED = "spilled-saturated"
    BASE = "base"
    REJECTED = "rejected"


@dataclass(slots=True)
class Decision:
    """The scheduler's answer: ordered endpoint addresses (first = primary, then fallbacks).

    Not frozen: a frozen dataclass's ``__init__`` costs several microseconds per decision; treat it as read-only.
    """

    endpoints: tuple[str, ...]
    indices: tuple[int, ...]
    outcome: Outcome
    tier: Tier
    #: every candidate was saturated (the saturation filter failed open): the pool is under pressure
    saturated: bool = False
    #: the primary endpoint has room for the revision: a GPU slot, no other fetch ahead (``PoolSnapshot.room_at``)
    room: bool = True
    #: the prompt tokens the primary endpoint has to prefill: the request's estimate less the prefix the picker
    #: expects it to hold (``Cycle.prefix_hit``); its prefill queue counts these until the first token
    prefill_tokens: int = 0
    #: set when the request should wait: what it saw (``Scheduler.still_waits``)
    wait_key: WaitKey | None = None

    @property
    def should_wait(self) -> bool:
        """With flow control on, the request waits instead: every candidate is saturated, or the chosen one has no
        room for its revision (so no candidate has, when the profile runs ``adapter-room-filter``)."""
        return self.saturated or not self.room


__all__ = ["NoEndpointError", "PoolSaturatedError", "SchedulingError"]  # defined in plugins, raised from here


@dataclass(frozen=True, slots=True)
class _FilterStep:
    name: str
    run: Filter
    fail_open: bool
    #: ``PluginType.load_blind``, bound to the step's parameters (None: the step may read the in-flight counts)
    load_blind: Callable[[PoolSnapshot], bool] | None


@dataclass(frozen=True, slots=True)
class WaitKey:
    """What a decision that must wait saw of the endpoints whose load could let it go (``Scheduler.still_waits``):
    the candidates the load-blind filters kept, and their in-flight counts then."""

    pool: PoolSnapshot
    version: int
    indices: IntArray
    #: their in-flight requests, distinct revisions in flight and revisions being fetched (as bytes: compared, not
    #: read)
    load: tuple[bytes, bytes, bytes]
    #: the endpoints with requests of the revision in flight (room there whatever the slots)
    serving: frozenset[int]

    @classmethod
    def of(cls, request: SchedulingRequest, pool: PoolSnapshot, steady: BoolArray) -> WaitKey:
        """The key of a decision over ``pool`` whose load-blind filters kept ``steady``."""
        indices = steady.nonzero()[0]
        name = request.served_name
        return cls(pool, pool.version, indices, _load(pool, indices),
                   frozenset(pool.in_flight_by_name.get(name, ())) if name else frozenset())

    def unchanged(self, request: SchedulingRequest, pool: PoolSnapshot) -> bool:
        """Is ``pool`` as the key saw it: the same reports, and the same load on each of the key's endpoints?"""
        name = request.served_name
        return (self.pool is pool and self.version == pool.version and _load(pool, self.indices) == self.load
                and (not name or pool.in_flight_by_name.get(name, {}).keys() == self.serving))


def _load(pool: PoolSnapshot, indices: IntArray) -> tuple[bytes, bytes, bytes]:
    return (pool.in_flight[indices].tobytes(), pool.adapters_in_flight[indices].tobytes(),
            pool.fetching[indices].tobytes())


@dataclass(frozen=True, slots=True)
class _SnapshotCache:
    """What depends only on one snapshot's reports: computed on its first request, reused until it changes.

    Also the per-decision scratch vectors (overwritten by every decision, never handed out), so a decision allocates
    no whole-pool arrays of its own for utilisation and the weighted sum.
    """

    pool: PoolSnapshot
    version: int
    reported_utilisation: FloatArray
    #: all-True candidate mask (never mutated)
    everyone: BoolArray
    #: weighted sum of the snapshot-only scorers over the whole pool (and as Python floats, for small pools)
    scores: FloatArray
    score_list: list[float]
    utilisation: FloatArray
    unsaturated: BoolArray
    total: FloatArray
    term: FloatArray


class Scheduler:
    """Runs one scheduling profile over a ``PoolSnapshot``."""

    def __init__(self, config: EndpointPickerConfig, profile: str | None = None) -> None:
        """Instantiate the plugins of ``profile`` (the first profile by default)."""
        self.config = config
        chosen = next((p for p in config.scheduling_profiles if profile in (None, p.name)), None)
        if chosen is None:
            raise ValueError(f"no scheduling profile named {profile!r}")
        specs = {p.ref: p for p in config.plugins}
        self.thresholds = config.saturation_detector
        self.filters: list[_FilterStep] = []
        self.scorers: list[tuple[str, Scorer, float]] = []
        self.snapshot_scorers: list[tuple[str, Scorer, float]] = []
        self.max_endpoints = 1
        #: (type, parameters) of the profile's request plugins, in order (``loraplane.picker.lifecycle``)
        self.request_plugins: list[tuple[str, dict[str, object]]] = []
        self._cache: _SnapshotCache | None = None
        #: the profile's plugins with a prepare-data stage and with request hooks (at any weight: a prefix scorer at
        #: weight 0 still feeds the cost model), in profile order
        self.preparers: list[DataPreparer] = []
        self.hooked: list[RequestHooks] = []
        self._in_flight_scale = 1.0 / self.thresholds.in_flight_threshold
        #: flow control off: a sheddable request is refused when the mean utilisation of the pool (or of the gateway's
        #: subset) reaches 1.0, as llm-d-router's admission without its flowControl feature gate; on: it waits in
        #: the queue while every candidate is saturated, like any other request
        self.sheds_on_pool_mean = True
        self.filters.append(_filter_step(SUBSET_FILTER_TYPE, REGISTRY[SUBSET_FILTER_TYPE], FilterParameters()))
        for ref in chosen.plugins:
            spec = specs[ref.plugin_ref]
            kind = REGISTRY[spec.type]
            params = kind.parameters.model_validate(spec.parameters)
            if spec.type == SUBSET_FILTER_TYPE:
                continue  # already first, whatever the profile says
            if kind.kind is PluginKind.FILTER:
                assert isinstance(params, FilterParameters)
                self.filters.append(_filter_step(spec.ref, kind, params))
            elif kind.kind is PluginKind.SCORER:
                scorer = kind.factory(params)
                if isinstance(scorer, DataPreparer):
                    self.preparers.append(scorer)
                if isinstance(scorer, RequestHooks):
                    self.hooked.append(scorer)
                if ref.weight > 0:
                    scorers = self.snapshot_scorers if kind.snapshot_only else self.scorers
                    scorers.append((spec.ref, scorer, ref.weight))
            elif kind.kind is PluginKind.PICKER:
                self.max_endpoints = kind.factory(params)
            else:  # request plugins run around the cycle: see loraplane.picker.lifecycle
                self.request_plugins.append((spec.type, spec.parameters))
                if spec.type == "flow-control" and flowcontrol.FlowControlParameters.model_validate(spec.parameters).enabled:
                    self.sheds_on_pool_mean = False
        #: the profile's plugins that read the parsed body in the director's prepare stage (``BodyReader``)
        self.body_readers = [p for p in self.preparers if isinstance(p, BodyReader)]

    def read_body(self, request: SchedulingRequest, document: Mapping[str, Any]) -> SchedulingRequest:
        """``request`` with what the profile's body readers take from the parsed body (the prefix scorer's blocks),
        once per request."""
        for reader in self.body_readers:
            request = reader.read_body(request, document)
        return request

    def preparer(self, kind: type[P]) -> P | None:
        """The profile's first prepare-stage plugin of ``kind`` (e.g. the prefix scorer, whose index the picker's
        state sync feeds and the simulator teaches), or None."""
        return next((p for p in self.preparers if isinstance(p, kind)), None)

    def lifecycle(self, runtime: lifecycle.PluginRuntime) -> lifecycle.Lifecycle:
        """The profile's request plugins (in-flight accounting first), then the hooks of its other plugins."""
        plugins = lifecycle.Lifecycle.from_specs(runtime, self.request_plugins)
        for plugin in self.hooked:
            plugins.add(plugin.request_hooks(runtime))
        return plugins

    @classmethod
    def from_yaml(cls, text: str, profile: str | None = None) -> Scheduler:
        """Build from YAML text."""
        return cls(EndpointPickerConfig.from_yaml(text), profile)

    @classmethod
    def default(cls) -> Scheduler:
        """The packaged default configuration."""
        return cls(EndpointPickerConfig.load())

    def schedule(self, request: SchedulingRequest, pool: PoolSnapshot, rng: np.random.Generator) -> Decision:
        """Pick endpoints for ``request``; raises ``NoEndpointError`` / ``PoolSaturatedError``."""
        if not pool.size:
            raise NoEndpointError("the pool has no endpoints")
        cache = self._cache
        if cache is None or cache.pool is not pool or cache.version != pool.version:
            cache = self._fill_cache(pool)
        util, unsaturated = cache.utilisation, cache.unsaturated
        np.multiply(pool.in_flight, self._in_flight_scale, out=util)
        np.maximum(util, cache.reported_utilisation, out=util)
        np.less(util, 1.0, out=unsaturated)
        cycle = Cycle(cache.everyone, util, unsaturated, rng=rng)
        for preparer in self.preparers:
            preparer.prepare(request, pool, cycle)
        region = cache.everyone  # the endpoints the gateway allows (its subset hint), for the pool's saturation
        subset_step = self.filters[0]
        steady: BoolArray | None = None  # the candidates before the first filter that reads the in-flight counts
        for step in self.filters:
            if steady is None and (step.load_blind is None or not step.load_blind(pool)):
                steady = cycle.candidates
            keep = step.run(request, pool, cycle)
            if keep is not None:
                narrowed = keep if cycle.candidates is cache.everyone else cycle.candidates & keep
                if np.count_nonzero(narrowed):
                    cycle.candidates = narrowed
                elif not step.fail_open:
                    raise NoEndpointError(f"no endpoint left after {step.name}")
            if step is subset_step:
                region = cycle.candidates
        saturated = not np.count_nonzero(unsaturated & cycle.candidates)
        if request.priority < 0:
            if not self.sheds_on_pool_mean:
                if saturated:
                    raise PoolSaturatedError("every candidate endpoint is saturated and the request is sheddable")
            elif pool_saturation(pool, util, region) >= 1.0:
                raise PoolSaturatedError("the pool is saturated and the request is sheddable")
        scored = [(score, weight) for _name, scorer, weight in self.scorers
                  if (score := scorer(request, pool, cycle)) is not None]
        if pool.size <= SMALL_POOL:  # a small pool: the weighted sum in Python floats (the same operations)
            totals = cache.score_list
            for score, weight in scored:
                totals = [total + value * weight for total, value in zip(totals, score.tolist(), strict=True)]
            indices = rank_top(totals, cycle.candidates.tolist(), self.max_endpoints, rng)
        else:
            scores = cache.scores
            if scored:
                scores = cache.total
                np.copyto(scores, cache.scores)
                for score, weight in scored:
                    np.add(scores, np.multiply(score, weight, out=cache.term), out=scores)
            indices = pick_top(scores, cycle.candidates, self.max_endpoints, rng)
        decision = self._decide(request, pool, cycle, indices, saturated)
        if decision.should_wait:
            decision.wait_key = WaitKey.of(request, pool, cycle.candidates if steady is None else steady)
        return decision

    def still_waits(self, request: SchedulingRequest, pool: PoolSnapshot, key: WaitKey) -> bool:
        """Would ``request``, whose decision said wait and gave ``key``, still wait? True only when it must: the
        reports are the same and no endpoint the load-blind filters kept has changed its in-flight counts (the
        filters after them, saturation and room, read nothing else), so a held request is not scheduled again
        after every completion anywhere in the pool (a fleet's dispatch rounds: most of a decision's cost)."""
        return key.unchanged(request, pool)

    def _fill_cache(self, pool: PoolSnapshot) -> _SnapshotCache:
        n = pool.size
        reported = reported_utilisation(pool, self.thresholds)
        previous = self._cache
        if previous is not None and previous.pool is pool and len(previous.everyone) == n:
            # the same snapshot updated in place (a new version): its scratch vectors are reused
            everyone, scratch = previous.everyone, (previous.utilisation, previous.unsaturated, previous.total,
                                                    previous.term)
        else:
            everyone = np.ones(n, dtype=np.bool_)
            scratch = (np.empty(n), np.empty(n, dtype=np.bool_), np.empty(n), np.empty(n))
        whole = Cycle(everyone, reported, reported < 1.0)
        scores = np.zeros(n)
        for _name, scorer, weight in self.snapshot_scorers:
            score = scorer(_NO_REQUEST, pool, whole)
            if score is not None:
                scores += weight * score
        self._cache = _SnapshotCache(pool, pool.version, reported, everyone, scores, scores.tolist(), *scratch)
        return self._cache

    def _decide(
        self, request: SchedulingRequest, pool: PoolSnapshot, cycle: Cycle, indices: tuple[int, ...],
        saturated: bool,
    ) -> Decision:
        addresses = pool.addresses
        endpoints = tuple([addresses[i] for i in indices])
        prefill = request.prompt_tokens
        if prefill and cycle.prefix_hit is not None:
            prefill = max(0, prefill - int(cycle.prefix_hit[indices[0]] * cycle.prefix_tokens))
        if request.served_name is None:
            return Decision(endpoints, indices, Outcome.BASE, Tier.GPU, saturated, prefill_tokens=prefill)
        entry = pool.lookup(request.served_name, request.digest)
        level = entry.level_of.get(indices[0], 3) if entry is not None else 3
        tier = _TIER_OF_LEVEL[level]
        room = pool.room_at(indices[0], request.served_name, request.digest)
        if level > 0 and entry is not None and np.count_nonzero((entry.levels < level)
                                                                & ~cycle.unsaturated[entry.indices]):
            outcome = Outcome.SPILLED_SATURATED  # a warmer pod was saturated
        else:
            outcome = Outcome.WARM_GPU if level == 0 else Outcome.WARM_CPU if level == 1 else Outcome.COLD
        return Decision(endpoints, indices, outcome, tier, saturated, room, prefill)


def _filter_step(name: str, kind: PluginType, params: FilterParameters) -> _FilterStep:
    blind = kind.load_blind
    return _FilterStep(name, kind.factory(params), params.fail_open,
                       None if blind is None else lambda pool: blind(params, pool))


_TIER_OF_LEVEL = {t.level: t for t in Tier}
#: what the snapshot-only scorers are called with (they ignore the request)
_NO_REQUEST = SchedulingRequest()


def pool_saturation(pool: PoolSnapshot, utilisation: FloatArray, region: BoolArray) -> float:
    """The mean utilisation of the ready endpoints in ``region`` (1.0 when there are none): llm-d-router's
    utilization detector (its ``Saturation``: the mean over the candidates of max(queue / queueThreshold,
    kv / kvThreshold), stale endpoints counting 1.0), on loraplane's utilisation, which adds the picker's own
    in-flight count / ``inFlightThreshold`` and counts unknown endpoints as at least 1.0."""
    members = region & pool.ready if not pool.all_ready else region
    count = int(np.count_nonzero(members))
    return float(utilisation[members].sum()) / count if count else 1.0


def pick_top(scores: FloatArray, candidates: BoolArray, k: int, rng: np.random.Generator) -> tuple[int, ...]:
    """The ``k`` best candidates by score, best first; equal scores are ordered by ``rng``."""
    if len(scores) <= SMALL_POOL:
        return rank_top(scores.tolist(), candidates.tolist(), k, rng)
    indices = candidates.nonzero()[0]
    values = scores[indices]
    if len(indices) > SMALL_POOL and len(indices) > k:  # first narrowed to the top k and whatever ties the k-th
        kth = np.partition(values, len(values) - k)[len(values) - k]
        keep = (values >= kth).nonzero()[0]
        indices, values = indices[keep], values[keep]
        if len(values) > SMALL_POOL:  # many equal scores (e.g. an idle, uniform pool)
            return tuple(indices[np.lexsort((rng.random(len(values)), -values))[:k]].tolist())
    return _best_first(list(zip(values.tolist(), indices.tolist(), strict=True)), k, rng)


def rank_top(scores: list[float], candidates: list[bool], k: int, rng: np.random.Generator) -> tuple[int, ...]:
    """``pick_top`` over plain lists (a small pool, where numpy's cost per call is more than the work)."""
    return _best_first([(score, i) for i, (score, keep) in enumerate(zip(scores, candidates, strict=True)) if keep],
                       k, rng)


def _best_first(ranked: list[tuple[float, int]], k: int, rng: np.random.Generator) -> tuple[int, ...]:
    """The indices of the ``k`` best (score, index) pairs; a random draw only when scores tie."""
    if len(ranked) <= 1:
        return tuple([i for _, i in ranked])
    if len({score for score, _ in ranked}) == len(ranked):  # no ties: no random draw needed
        ranked.sort(reverse=True)
        return tuple([i for _, i in ranked[:k]])
    draws = rng.random(len(ranked)).tolist()
    order = sorted(zip([-score for score, _ in ranked], draws, [i for _, i in ranked], strict=True))
    return tuple([i for _, _, i in order[:k]])
