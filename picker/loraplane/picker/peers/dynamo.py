"""NVIDIA Dynamo's LoRA allocation and LoRA-filter routing, as a picker filter (``dynamo-lora-filter``).

Dynamo places adapters by routing: its frontend's allocation controller (``lib/llm/src/lora/controller.rs``) keeps a
routing table of the workers each adapter may go to, and a worker loads an adapter when a request for it arrives
(vLLM's dynamic LoRA loading, its GPU slots evicted by LRU). The controller issues no loads of its own (the diff its
solver computes only feeds gauges). So the whole policy runs in the router and this plugin is all of it, a twin can
run it as any peer config; ``DynamoAllocator`` is the controller, ``dynamo_lora_filter`` its ``LoraFilter``
(``lib/llm/src/lora/filter.rs``) and the stage-2 pick of ``LoraFilteredRouter`` (``filtered_router.rs``).

Facts taken from ai-dynamo/dynamo (``lib/llm/src/lora/``), each mirrored here:

- **demand** (``load_estimator.rs``): per adapter, arrivals in a sliding window of ``rateWindowSeconds`` (1 s buckets;
  the controller's timestep x ``rate_window_multiplier`` 30 = 90 s), smoothed by an EMA (``estimate = alpha x count +
  (1 - alpha) x previous``, the first observation taken as is) at each tick, rounded; an adapter with a rounded load
  above 0 is active;
- **replicas** (``controller.rs``, ``compute_active_replica_counts``): active adapters ranked by load (then name)
  and cut to the pool's GPU slots; each gets ``ceil(load / total x slots)``, at least 1, at most the worker count;
  when they sum past the slots they are scaled down (largest remainder, at least 1 each). An inactive adapter
  (known: loaded on some worker, no load) gets 1 replica;
- **hysteresis** (``apply_hysteresis``): a scale-down waits ``scaleDownCooldownTicks`` (3) ticks from the first tick
  that asked for it, and re-arms at each one it applies; a scale-up applies at once;
- **allocation**: ``hrw`` (``routing/hrw.rs``, Dynamo's default): workers ranked by a rendezvous hash of (adapter,
  worker); sticky: the prior hosts that are not full first, then the ranking, skipping full workers (all full: the
  plain ranking). ``mcf`` (``routing/mcf_allocator.rs``): one min-cost flow over every adapter's replicas, edge cost
  ``alphaPref x HRW rank + gammaLoad x weight`` for a new host, ``alphaPref x rank - betaKeep x weight`` for a prior
  host (1 / 1,000 / 250, weight 1), candidates the HRW top ``candidateM`` (16) plus the prior hosts, an overflow node
  for what fits nowhere; adapters whose replica count did not change keep their prior hosts (delta freezing);
  overflowed adapters stay on workers where they are still loaded, else a slot-aware HRW pin;
- **filter** (``filter.rs``): an active adapter goes to its replica set's workers where it is loaded, else to the
  whole replica set (a lazy load); an inactive one to its pin; one the table does not know to the workers where it is
  loaded, else anywhere; then (``filtered_router.rs``) among those the ones not marked busy (all of them when none
  is free), one in turn (``round-robin``, the frontend's default router mode) or at random. A worker is busy only
  with the frontend's ``busy_threshold`` set (KV use at or above it; unset, Dynamo's default, detection is off):
  ``busyThreshold`` here, off by default.

``algorithm``: Dynamo's default is ``hrw`` (``LoraAllocationConfig``); the packaged config runs ``mcf``, the
min-cost-flow allocator, which the controller builds when ``DYN_LORA_ALLOCATION_ALGORITHM=mcf``.

The clock is ``time.monotonic`` unless the caller sets ``DynamoLoraFilter.clock`` (the simulator sets its own). Worker
capacities are the endpoints' GPU slots (``max_lora``), ``loaded`` what their residency gauges list (GPU or host
cache, vLLM's registered adapters), else the adapters ``lora_requests_info`` names.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
from pydantic import Field

from loraplane.picker.plugins import (
    Cycle,
    FilterParameters,
    PluginKind,
    PluginType,
    SchedulingRequest,
    register,
)
from loraplane.picker.snapshot import BoolArray, PoolSnapshot

Algorithm = Literal["hrw", "mcf"]
Select = Literal["round-robin", "random"]


class DynamoLoraParameters(FilterParameters):
    """``dynamo-lora-filter``: Dynamo's ``LoraAllocationConfig`` and ``McfSolveParams`` defaults."""

    algorithm: Algorithm = "mcf"
    timestep_seconds: float = Field(default=3.0, gt=0)
    rate_window_seconds: float = Field(default=90.0, ge=5)
    ema_alpha: float = Field(default=0.3, ge=0, le=1)
    scale_down_cooldown_ticks: int = Field(default=3, ge=0)
    candidate_m: int = Field(default=16, ge=1)
    alpha_pref: int = Field(default=1, ge=0)
    gamma_load: int = Field(default=1000, ge=0)
    beta_keep: int = Field(default=250, ge=0)
    churn_weight: int = Field(default=1, ge=0)
    #: stage 2 among the filtered workers (the frontend's ``--router-mode``)
    select: Select = "round-robin"
    #: the frontend's busy threshold (KV use): stage 2 prefers the filtered workers below it; None: off (Dynamo's
    #: default)
    busy_threshold: float | None = Field(default=None, gt=0, le=1)


def hrw_score(adapter: str, worker: str) -> int:
    """The rendezvous score of (adapter, worker): Dynamo hashes with blake3; any uniform 64-bit hash ranks alike."""
    return int.from_bytes(hashlib.blake2b(f"{adapter}\x00{worker}".encode(), digest_size=8).digest(), "big")


def hrw_rank(adapter: str, workers: Iterable[str]) -> list[str]:
    """Workers by descending rendezvous score for ``adapter`` (ties by name)."""
    return sorted(workers, key=lambda w: (-hrw_score(adapter, w), w))


def active_replica_counts(loads: dict[str, int], total_slots: int, workers: int) -> dict[str, int]:
    """``compute_active_replica_counts``: replicas in proportion to each active adapter's share of the load."""
    ranked = sorted(((n, v) for n, v in loads.items() if v > 0), key=lambda x: (-x[1], x[0]))
    if not ranked or total_slots <= 0:
        return {}
    ranked = ranked[:total_slots]
    total = sum(v for _, v in ranked)
    raw = [(n, min(float(workers), max(1.0, math.ceil(v / total * total_slots)))) for n, v in ranked]
    if sum(c for _, c in raw) <= total_slots:
        return {n: max(1, min(workers, int(c))) for n, c in raw}
    scale = total_slots / sum(c for _, c in raw)
    scaled = [(n, max(1.0, c * scale)) for n, c in raw]
    counts = {n: max(1, math.floor(c)) for n, c in scaled}
    remainders = {n: c - counts[n] for n, c in scaled}
    leftover = max(0, total_slots - sum(counts.values()))
    for n in sorted(counts, key=lambda n: (-remainders[n], n)):  # largest remainder first, then by name
        if leftover == 0:
            break
        if counts[n] < workers:
            counts[n] += 1
            leftover -= 1
    return {n: max(1, min(workers, c)) for n, c in counts.items()}


def min_cost_flow(supply: dict[str, int], edges: dict[str, list[tuple[str, int]]], capacity: dict[str, int],
                  overflow_cost: int) -> tuple[dict[str, set[str]], int]:
    """Assign each adapter ``supply[a]`` distinct workers from ``edges[a]`` ((worker, cost), capacity 1 each) within
    the workers' ``capacity``, at least total cost, anything that does not fit going to an overflow node at
    ``overflow_cost`` a unit: successive shortest paths, one unit each (Bellman-Ford / SPFA on the residual graph,
    which has negative costs). Returns the assignment and the overflowed units."""
    ids: dict[str, int] = {}

    def node(key: str) -> int:
        return ids.setdefault(key, len(ids))

    source, sink, spill = node("\x00s"), node("\x00t"), node("\x00o")
    head: list[int] = []  # edge -> target; edge ^ 1 is its reverse
    cap: list[int] = []
    cost: list[int] = []
    adjacency: dict[int, list[int]] = {}

    def add(u: int, v: int, capacity_: int, cost_: int) -> int:
        e = len(head)
        head.extend((v, u))
        cap.extend((capacity_, 0))
        cost.extend((cost_, -cost_))
        adjacency.setdefault(u, []).append(e)
        adjacency.setdefault(v, []).append(e + 1)
        return e

    worker_edges: list[tuple[str, str, int]] = []
    spill_edges: list[int] = []
    for adapter, units in supply.items():
        if units <= 0:
            continue
        a = node("a" + adapter)
        add(source, a, units, 0)
        for worker, c in edges.get(adapter, ()):
            worker_edges.append((adapter, worker, add(a, node("w" + worker), 1, c)))
        spill_edges.append(add(a, spill, units, overflow_cost))
    for worker, room in capacity.items():
        if room > 0:
            add(node("w" + worker), sink, room, 0)
    add(spill, sink, sum(supply.values()), 0)
    count = len(ids)
    while True:
        dist = [math.inf] * count
        via = [-1] * count
        dist[source] = 0
        queue, queued = deque([source]), [False] * count
        queued[source] = True
        while queue:
            u = queue.popleft()
            queued[u] = False
            du = dist[u]
            for e in adjacency.get(u, ()):
                if cap[e] > 0:
                    v = head[e]
                    if du + cost[e] < dist[v]:
                        dist[v] = du + cost[e]
                        via[v] = e
                        if not queued[v]:
                            queued[v] = True
                            queue.append(v)
        if dist[sink] == math.inf:
            break
        v = sink
        while v != source:  # one unit: every adapter -> worker edge carries at most one
            e = via[v]
            cap[e] -= 1
            cap[e ^ 1] += 1
            v = head[e ^ 1]
    assignment: dict[str, set[str]] = {}
    for adapter, worker, e in worker_edges:
        if cap[e ^ 1] > 0:
            assignment.setdefault(adapter, set()).add(worker)
    return assignment, sum(cap[e ^ 1] for e in spill_edges)


@dataclass
class _Entry:
    """One routing-table row: the adapter's workers, whether it is active."""

    workers: list[str]
    active: bool


@dataclass
class DynamoAllocator:
    """Dynamo's LoRA allocation controller: demand, replica counts, hysteresis and HRW / MCF placement."""

    params: DynamoLoraParameters
    #: adapter -> its routing-table row
    table: dict[str, _Entry] = field(default_factory=dict)
    tick: int = 0
    next_tick: float = -math.inf
    #: adapter -> arrivals per 1 s bucket (second, count), the sliding window
    arrivals: dict[str, deque[list[float]]] = field(default_factory=dict)
    ema: dict[str, float] = field(default_factory=dict)
    cooldown: dict[str, int] = field(default_factory=dict)
    prev_assignment: dict[str, set[str]] = field(default_factory=dict)
    prev_replicas: dict[str, int] = field(default_factory=dict)

    def arrive(self, adapter: str, now: float) -> None:
        """Record an arrival (``increment_load``)."""
        second = math.floor(now)
        window = self.arrivals.setdefault(adapter, deque())
        if window and window[-1][0] == second:
            window[-1][1] += 1
        else:
            window.append([second, 1])

    def loads(self, now: float) -> dict[str, int]:
        """``get_current_load``: each adapter's EMA of its windowed arrivals, rounded; only those above 0."""
        horizon = math.floor(now) - self.params.rate_window_seconds
        out: dict[str, int] = {}
        for adapter, window in list(self.arrivals.items()):
            while window and window[0][0] <= horizon:
                window.popleft()
            count = sum(c for _, c in window)
            previous = self.ema.get(adapter)
            alpha = self.params.ema_alpha
            estimate = count if previous is None else alpha * count + (1 - alpha) * previous
            self.ema[adapter] = estimate
            if not window and estimate < 0.5:
                del self.arrivals[adapter]
                self.ema.pop(adapter, None)
            load = round(estimate)
            if load > 0:
                out[adapter] = load
        return out

    def hysteresis(self, adapter: str, desired: int, current: int) -> int:
        """``apply_hysteresis``: scale-downs wait out the cooldown; scale-ups apply at once."""
        if desired < current:
            since = self.cooldown.get(adapter)
            if since is None:
                self.cooldown[adapter] = self.tick
                return current
            if self.tick - since < self.params.scale_down_cooldown_ticks:
                return current
            self.cooldown[adapter] = self.tick
            return desired
        self.cooldown.pop(adapter, None)
        return desired

    def maybe_recompute(self, now: float, workers: dict[str, int], loaded: dict[str, set[str]]) -> None:
        """Run a controller tick when one is due (``workers``: name -> GPU slots; ``loaded``: adapter -> workers)."""
        if now < self.next_tick:
            return
        self.next_tick = now + self.params.timestep_seconds if self.next_tick == -math.inf else max(
            self.next_tick + self.params.timestep_seconds, now)
        self.recompute(now, workers, loaded)

    def recompute(self, now: float, workers: dict[str, int], loaded: dict[str, set[str]]) -> None:
        """One tick of ``recompute_allocations``."""
        self.tick += 1
        names = sorted(workers)
        slots = sum(workers.values())
        loads = self.loads(now)
        known = sorted(set(loaded) | set(loads))
        if not names or slots <= 0:
            self.table = {a: _Entry(sorted(w for w in loaded.get(a, ()) if w in workers), True) for a in known
                          if loaded.get(a)}
            return
        counts = active_replica_counts(loads, slots, len(names))
        inactive = [a for a in known if a not in loads]
        if self.params.algorithm == "mcf":
            self._mcf(names, workers, counts, inactive, loaded)
        else:
            self._hrw(names, workers, counts, inactive, loaded)
        for adapter in [a for a in loads if a not in counts]:  # active but cut by the slot budget
            warm = [w for w in (self.table.get(adapter, _Entry([], True)).workers) if w in loaded.get(adapter, ())]
            self.table[adapter] = _Entry(warm or self._slot_pin(adapter, names, workers), True)
        for adapter in [a for a in self.table if a not in known]:
            del self.table[adapter]
            self.cooldown.pop(adapter, None)

    def _usage(self, workers: dict[str, int], exclude: Iterable[str] = ()) -> dict[str, int]:
        skip = set(exclude)
        used = dict.fromkeys(workers, 0)
        for adapter, entry in self.table.items():
            if adapter in skip:
                continue
            for w in entry.workers:
                if w in used:
                    used[w] += 1
        return used

    def _slot_pin(self, adapter: str, names: list[str], workers: dict[str, int]) -> list[str]:
        """``compute_replica_set_with_slots`` for one replica: the best-ranked worker with a free slot in the table
        as it stands, else the best-ranked."""
        used = self._usage(workers, (adapter,))
        ranked = hrw_rank(adapter, names)
        free = [w for w in ranked if used[w] < workers[w]]
        return [(free or ranked)[0]]

    def _hrw(self, names: list[str], workers: dict[str, int], counts: dict[str, int], inactive: list[str],
             loaded: dict[str, set[str]]) -> None:
        """``recompute_per_lora``: sticky, slot-aware HRW for the active adapters (by name), a pin for the others."""
        residual = {w: len([a for a, ws in loaded.items() if w in ws]) for w in names}
        for adapter in sorted(counts):
            entry = self.table.get(adapter)
            current = len(entry.workers) if entry is not None else 0
            replicas = self.hysteresis(adapter, counts[adapter], current)
            own = loaded.get(adapter, set())
            usage = {w: residual[w] - (1 if w in own else 0) for w in names}
            prior = set(entry.workers) if entry is not None else set()
            ranked = hrw_rank(adapter, names)
            chosen = [w for w in ranked if w in prior and usage[w] < workers[w]][:replicas]
            chosen += [w for w in ranked if w not in chosen and usage[w] < workers[w]][:replicas - len(chosen)]
            if not chosen:
                chosen = ranked[:replicas]
            for w in chosen:
                if w not in own:
                    residual[w] += 1
            self.table[adapter] = _Entry(chosen, True)
        for adapter in inactive:
            self.table[adapter] = _Entry(hrw_rank(adapter, names)[:1], False)
            self.cooldown.pop(adapter, None)

    def _mcf(self, names: list[str], workers: dict[str, int], counts: dict[str, int], inactive: list[str],
             loaded: dict[str, set[str]]) -> None:
        """``recompute_mcf``: one min-cost flow over every adapter's replicas, unchanged adapters frozen."""
        p = self.params
        replicas: dict[str, int] = {}
        for adapter, desired in counts.items():
            entry = self.table.get(adapter)
            replicas[adapter] = self.hysteresis(adapter, desired, len(entry.workers) if entry is not None else 0)
        for adapter in inactive:
            replicas[adapter] = 1
            self.cooldown.pop(adapter, None)
        live = set(names)
        changed = {a for a in replicas if a not in self.prev_assignment or replicas[a] != self.prev_replicas.get(a)}
        frozen: dict[str, set[str]] = {}
        used = dict.fromkeys(names, 0)
        for adapter, count in replicas.items():
            if adapter in changed:
                continue
            keep = sorted(w for w in self.prev_assignment.get(adapter, ()) if w in live)[:count]
            frozen[adapter] = set(keep)
            for w in keep:
                used[w] += 1
        capacity = {w: max(0, workers[w] - used[w]) for w in names}
        supply: dict[str, int] = {}
        edges: dict[str, list[tuple[str, int]]] = {}
        weight = p.churn_weight
        for adapter, count in replicas.items():
            rem = count - len(frozen.get(adapter, ()))
            if rem <= 0:
                continue
            ranked = hrw_rank(adapter, names)
            prior = self.prev_assignment.get(adapter, set())
            top = set(ranked[:max(p.candidate_m, rem)]) | (prior & live)
            supply[adapter] = rem
            edges[adapter] = [(w, p.alpha_pref * r + (-p.beta_keep * weight if w in prior else p.gamma_load * weight))
                              for r, w in enumerate(ranked) if w in top and w not in frozen.get(adapter, ())]
        overflow_cost = 1_000_000_000
        solved, overflow = min_cost_flow(supply, edges, capacity, overflow_cost) if supply else ({}, 0)
        if overflow and any(capacity[w] > sum(1 for s in solved.values() if w in s) for w in names):
            for adapter in supply:  # dense retry: every worker a candidate
                ranked = hrw_rank(adapter, names)
                prior = self.prev_assignment.get(adapter, set())
                edges[adapter] = [(w, p.alpha_pref * r + (-p.beta_keep * weight if w in prior
                                                          else p.gamma_load * weight))
                                  for r, w in enumerate(ranked) if w not in frozen.get(adapter, ())]
            solved, overflow = min_cost_flow(supply, edges, capacity, overflow_cost)
        assignment = {a: set(frozen.get(a, set())) | solved.get(a, set()) for a in replicas}
        assignment = {a: ws for a, ws in assignment.items() if ws}
        for adapter, hosts in assignment.items():
            self.table[adapter] = _Entry(sorted(hosts), adapter in counts)
        for adapter in [a for a in replicas if a not in assignment]:  # overflowed entirely
            entry = self.table.get(adapter)
            warm = [w for w in (entry.workers if entry else []) if w in loaded.get(adapter, ()) and w in live]
            self.table[adapter] = _Entry(warm or self._slot_pin(adapter, names, workers), adapter in counts)
        self.prev_assignment = assignment
        self.prev_replicas = dict(replicas)

    def route(self, adapter: str, available: list[str], loaded: dict[str, set[str]]) -> list[str]:
        """``LoraFilter.filter_worker_ids_for_lora`` over the available workers."""
        here = loaded.get(adapter, set())
        entry = self.table.get(adapter)
        if entry is None:
            warm = [w for w in available if w in here]
            return warm or list(available)
        replica = [w for w in available if w in entry.workers]
        if entry.active:
            warm = [w for w in replica if w in here]
            return warm or replica or self._fallback(adapter, available, here)
        if entry.workers and entry.workers[0] in available:
            return [entry.workers[0]]
        return self._fallback(adapter, available, here)

    @staticmethod
    def _fallback(adapter: str, available: list[str], here: set[str]) -> list[str]:
        """``bounded_fallback``: the available workers where it is loaded, else one HRW pin."""
        warm = [w for w in available if w in here]
        if warm:
            return warm
        return hrw_rank(adapter, available)[:1] if available else []


class DynamoLoraFilter:
    """The ``dynamo-lora-filter`` plugin: the allocator ticking on ``clock`` and the filter + stage-2 pick."""

    def __init__(self, params: DynamoLoraParameters) -> None:
        self.params = params
        self.allocator = DynamoAllocator(params)
        self.clock: Callable[[], float] = time.monotonic
        self._turn = 0

    def __call__(self, request: SchedulingRequest, pool: PoolSnapshot, cycle: Cycle) -> BoolArray | None:
        name = request.served_name
        if name is None:
            return None
        now = self.clock()
        endpoints = pool.endpoints
        workers = {e.name: e.gpu_slots for e in endpoints}
        loaded = pool.per_version(_LOADED, lambda: _loaded(pool))
        self.allocator.arrive(name, now)
        self.allocator.maybe_recompute(now, workers, loaded)
        index = {e.name: i for i, e in enumerate(endpoints)}
        available = [e.name for i, e in enumerate(endpoints) if cycle.candidates[i]]
        chosen = self.allocator.route(name, available, loaded)
        if not chosen:
            return None
        if self.params.busy_threshold is not None:
            kv = pool.kv_utilization
            free = [w for w in chosen if kv[index[w]] < self.params.busy_threshold]
            chosen = free or chosen
        if self.params.select == "random" and cycle.rng is not None:
            pick = chosen[int(cycle.rng.integers(len(chosen)))]
        else:
            pick = chosen[self._turn % len(chosen)]
            self._turn += 1
        keep = np.zeros(pool.size, dtype=np.bool_)
        keep[index[pick]] = True
        return keep


_LOADED = object()


def _loaded(pool: PoolSnapshot) -> dict[str, set[str]]:
    """Adapter -> the endpoints that have it loaded (residency gauges, else the ``lora_requests_info`` lists)."""
    out: dict[str, set[str]] = {}
    for e in pool.endpoints:
        names = e.loaded_adapters.keys() if e.loaded_adapters is not None else e.running_adapters | e.waiting_adapters
        for adapter in names:
            out.setdefault(adapter, set()).add(e.name)
    return out


def dynamo_lora_filter(params: DynamoLoraParameters) -> DynamoLoraFilter:
    """Dynamo's LoRA allocation + filter + stage-2 pick (module docstring)."""
    return DynamoLoraFilter(params)


register("dynamo-lora-filter", PluginType(PluginKind.FILTER, DynamoLoraParameters, dynamo_lora_filter))
