"""The discrete-event simulator of one InferencePool.

Each pod runs vLLM v1's continuous batching as the emulator (``loraplane.emulator.engine``, held to real vLLM)
reproduces it, and ``tests/emulator/test_against_simulator.py`` holds the two equal request by request: at every
step the running requests, in admission order, take their tokens of the step's budget (a decode one, a chunked
prefill its next chunk) and the KV blocks those tokens start -- a request finding none free preempts the most
recently admitted running request (under ``--scheduling-policy priority`` the lowest-priority one), which goes back
to the front of the waiting queue and is prefilled again -- then waiting requests are admitted in vLLM's queue order
(the order they reached the pod, or ``(priority, that order)``), the whole queue scanned, skipping one whose adapter
cannot get a GPU slot, while their prompt's blocks are free. Admitted requests' adapters load *inside* the step (a
load stalls the whole batch, as in vLLM). A request's first token comes at the end of the step that prefilled the
last of its prompt, so

    TTFT = queue wait + load stall (by tier) + prefill + decode of the co-scheduled batch + step overhead,

where prefill covers the prompt tokens the pod's prefix cache does not hold (traces with prefix structure only:
``loraplane.sim.prefix``).

Between two events that change a pod's batch (an arrival it could admit, a request finishing, a download finishing,
a step whose new KV blocks are not all free) every step costs the same, so the simulator jumps over the steps in
between in one event: the work is O(events), not O(tokens). Adapters absent from a pod are downloaded to its disk
asynchronously (the request waits; the batch does not).

Tiers per pod, with vLLM's meanings: ``gpu`` (``max_loras`` slots), ``cpu`` (the registered cache of
``max_cpu_loras`` adapters, a superset of ``gpu``), ``disk`` (unbounded), absent; both caches rank adapters by the
last step that ran them, as vLLM's worker touches the batch's adapters at every step. An adapter with running
requests is never evicted; pinned ones neither.
"""

from __future__ import annotations

import heapq
import math
from array import array
from bisect import bisect_left, bisect_right, insort
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import Protocol

from loraplane.api import Tier
from loraplane.controller.placement import PlacementConfig
from loraplane.sidecar.reconcile import DEFAULT_DRAIN_GRACE_S, BoundedWait
from loraplane.sim.prefix import BLOCK_TOKENS, PodPrefixCaches
from loraplane.sim.profile import Profile
from loraplane.sim.trace import Trace

#: tier codes recorded per request (index into TIER_NAMES)
L0, L1, L2, L3 = 0, 1, 2, 3
TIER_NAMES = ("L0", "L1", "L2", "L3")
_TIER_OF_CODE = (Tier.GPU, Tier.CPU, Tier.DISK, Tier.ABSENT)

#: window within which a reload after an eviction counts as thrash, and over which "recent evictions" are counted
THRASH_WINDOW_S = 60.0
#: idle pods with blocked waiting requests re-check this often (e.g. a minimum residency time ran out)
RETRY_S = 0.05

_STEP, _DOWNLOAD, _RETRY, _TICK, _DEADLINE, _GATE_RETRY, _UNREGISTER, _LOADED = 0, 1, 2, 3, 4, 5, 6, 7
#: while the admission gate holds requests it is also asked to dispatch this often (besides on every finish), so
#: held requests go out when something other than a finish makes room (a fetch done, an idle pod, fresher reports)
GATE_RETRY_S = 0.05
#: a waiting queue's key is ``priority << _PRIORITY_SHIFT`` plus the request's dispatch count (below 2**40)
_PRIORITY_SHIFT = 40
#: ``SimResult.refused`` code of a served request (otherwise the HTTP status the client got: 429 or 503)
SERVED = 0
#: ``SimConfig.loraplane_runtime``: pods that load any revision on demand, or vLLM behind loraplane's sidecar
ON_DEMAND, VLLM = "on-demand", "vllm"
LORAPLANE_RUNTIMES = (ON_DEMAND, VLLM)


class Refused(Exception):
    """A router's refusal of a request: the client gets ``status`` (429 saturated or queue-refused, 503 no endpoint)."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


class Router(Protocol):
    """Chooses a pod for each request (or raises ``Refused``). ``pods`` are read-only to it."""

    name: str

    def pick(self, now: float, rid: int, trace: Trace, pods: list[Pod]) -> int:
        """The index of the pod that serves request ``rid``."""
        ...


class Eviction(Protocol):
    """Chooses which adapter leaves a full tier of a pod; ``None`` refuses (the load waits)."""

    name: str

    def victim(self, now: float, pod: Pod, tier: Tier, candidates: list[int], incoming: int) -> int | None:
        """One of ``candidates`` (resident at ``tier``, not running, not pinned), or ``None``."""
        ...


class Admission(Protocol):
    """The gate between arrival and routing: a picker-side queue driven by the simulator's clock.

    On an arrival it sends the request to a pod now (``Simulator.dispatch``), refuses it (``Simulator.refuse``) or
    holds it. The simulator calls ``capacity_freed`` whenever requests finish on some pod and ``expire`` at
    ``next_deadline`` (and every ``GATE_RETRY_S`` while it holds requests); the gate may dispatch or refuse held
    requests from either."""

    name: str

    def arrive(self, now: float, rid: int, sim: Simulator) -> None:
        """Request ``rid`` arrived: dispatch, refuse or hold it."""
        ...

    def capacity_freed(self, now: float, sim: Simulator) -> None:
        """Requests finished somewhere: dispatch what may go now."""
        ...

    def expire(self, now: float, sim: Simulator) -> None:
        """Refuse held requests whose deadline is ``now`` or earlier."""
        ...

    @property
    def held(self) -> int:
        """Requests waiting in the gate."""
        ...

    def next_deadline(self) -> float:
        """The earliest deadline of a held request (``inf`` when none is held)."""
        ...


class Scraper(Protocol):
    """Reads each pod's metrics every ``period_s`` simulated seconds (the peers' metrics scrape), each pod at its
    own offset in the period (``ScrapeSchedule``): ``scrape`` is called with the pods whose tick ``first arrival +
    offset + k x period_s`` came after every event before it (so a trace shifted in time is scraped alike), with
    the pods as they are then. A pod's ticks with no event since its last one fold into one (nothing changed);
    ``period_s <= 0`` never ticks."""

    period_s: float

    def offset_s(self, index: int) -> float:
        """Where in each period pod ``index`` is scraped, in [0, period_s)."""
        ...

    def scrape(self, now: float, pods: list[Pod], due: Sequence[int]) -> None:
        """The state of the pods ``due`` (indices into ``pods``) at ``now``."""
        ...


class ScrapeSchedule:
    """When each pod's metrics are scraped: every ``period`` from ``start`` plus the pod's own offset. The picker
    scrapes each endpoint at its own offset in the interval (``loraplane.picker.scrape.scrape_offset``), so the
    pods' figures age apart and the least loaded pod takes requests only until its own next scrape; scraped all at
    once, it took every request for a whole period (least-request on zipf-many at 32 pods: TTFT p50 26 % above the
    twin's)."""

    def __init__(self, period: float, start: float, offsets: Sequence[float]) -> None:
        phases = sorted((offset, i) for i, offset in enumerate(offsets))
        self._offsets = [phase for phase, _ in phases]
        self._order = [i for _, i in phases]
        self._period, self._start = period, start
        self._cycle = self._at = 0
        #: when the next scrape falls due
        self.next_at = start + self._offsets[0]

    def due(self, until: float) -> list[int]:
        """The pods with a scrape due at or before ``until``, each once; the schedule moves past them."""
        if until < self.next_at:
            return []
        if until - self.next_at >= self._period:  # a whole period passed: every pod, then the first tick after
            cycle = math.floor((until - self._start) / self._period)
            at = bisect_right(self._offsets, until - self._start - cycle * self._period)
            self._cycle, self._at = (cycle + 1, 0) if at == len(self._offsets) else (cycle, at)
            self._set_next()
            return list(self._order)
        due = []
        while self.next_at <= until:
            due.append(self._order[self._at])
            self._at += 1
            if self._at == len(self._offsets):
                self._cycle, self._at = self._cycle + 1, 0
            self._set_next()
        return due

    def _set_next(self) -> None:
        self.next_at = self._start + self._cycle * self._period + self._offsets[self._at]


class Placement(Protocol):
    """Periodically moves adapters between tiers ahead of demand (the controller's job)."""

    period_s: float

    def apply(self, now: float, sim: Simulator) -> float | None:
        """Read the pool and request rates from ``sim``, change pods' targets via ``Pod.prefetch``/``Pod.pin``;
        returns the seconds until the next pass (None: ``period_s``)."""
        ...


class Pod:
    """One model server. Attributes are read by routers and eviction policies; only the simulator changes them."""

    def __init__(self, index: int, max_loras: int, max_cpu_loras: int, disk: set[int],
                 touched_pods: set[int] | None = None) -> None:
        self.index = index
        #: the pool's indices of the pods touched since a reader last emptied it (shared by every pod of a simulator)
        self.touched_pods: set[int] = set() if touched_pods is None else touched_pods
        self.max_loras = max_loras
        self.max_cpu_loras = max_cpu_loras
        self.gpu: set[int] = set()
        self.cpu: set[int] = set()
        self.disk: set[int] = set(disk)
        self.disk_used = 0
        #: the revisions the runtime has registered, the only ones it serves (``SimConfig.loraplane_runtime`` vllm);
        #: None: it serves any on its disk. ``registering``: fetched to disk first, registered when they land;
        #: ``registered_load``: registered, their load (vLLM's load activates) not made yet; ``cold_loads``: those of
        #: them the plan holds at disk tier (the sidecar's lowest priority: ``Simulator._placement_loads``)
        self.registered: set[int] | None = None
        self.registering: set[int] = set()
        self.registered_load: set[int] = set()
        self.cold_loads: set[int] = set()
        #: a disk-tier registration's load waiting for the waiting queue to empty, as the sidecar's
        self.cold_load_wait = BoundedWait()
        #: registered revisions no longer targeted, reported draining (the picker stops routing to them) until the
        #: sidecar's drain grace has passed and they are unregistered (``Simulator.drain``)
        self.draining: set[int] = set()
        #: what the last placement plans on this pod, at any tier (the sidecar's target state): its disk cache
        #: evicts other adapters first
        self.planned: set[int] = set()
        self.download_free_at = 0.0
        self.downloading: set[int] = set()
        #: bumped whenever an adapter changes tier here (lets readers cache what they derive from the tiers)
        self.residency_version = 0
        self.pinned: set[int] = set()
        self.last_use: dict[int, float] = {}
        self.uses: dict[int, int] = {}
        self.loaded_at: dict[int, float] = {}
        self.waiting: deque[int] = deque()
        self.running: list[tuple[int, int]] = []
        self.running_adapters: dict[int, int] = {}
        #: admitted requests whose prompt is still being prefilled in chunks (``[request, tokens left]``, in the
        #: order they were admitted): they hold their KV, a sequence slot and their adapter, and have no token yet
        self.prefilling: list[list[int]] = []
        #: adapter -> its waiting requests, in queue order (``waiting`` is in queue order too: ``Simulator._enqueue``)
        self.waiting_adapters: dict[int, deque[int]] = {}
        #: KV blocks the pod's requests hold (``BLOCK_TOKENS`` tokens each) and how many it has
        self.kv_blocks = 0
        self.kv_capacity_blocks = 0
        #: per step residue ``r``: running (decoding) requests that take a new KV block at every step ``t`` with
        #: ``(t - 1) % BLOCK_TOKENS == r`` (the step whose token starts a block)
        self.block_phase = [0] * BLOCK_TOKENS
        #: vLLM's free-block queue as positions: blocks ``[queue_head, queue_tail)`` are free, the head is handed out
        #: first, freed blocks join at the tail; ``queue_taken``: ranges inside it taken back by a prefix hit
        self.queue_head = 0
        self.queue_tail = 0
        self.queue_taken: list[tuple[int, int]] = []
        #: adapter -> its place in vLLM's LoRA LRU order (higher: used more recently): the worker touches every
        #: adapter of the batch at every step, in batch order, and a load puts an adapter last
        self.recency: dict[int, int] = {}
        self.recency_clock = 0
        #: adapters whose last request left the batch at the last boundary, the requests that left it then
        #: (finished or preempted: their admission order is their adapters' order in the last step's batch), and
        #: when that last step began
        self.departing: list[int] = []
        self.left_batch: list[int] = []
        self.departed_at = 0.0
        self.eviction_times: deque[float] = deque()
        self.evicted_at: dict[int, float] = {}
        #: adapters a placement asked to bring to the GPU at the next step (no request needs them yet)
        self.prefetch_queue: list[int] = []
        # the current run of identical steps
        self.busy = False
        self.steps = 0
        self.run_t0 = 0.0
        self.run_first_end = 0.0
        self.run_step_s = 0.0
        self.run_distinct = 0
        self.run_steps = 0
        #: requests whose prefill ends in the first step of the current run (first token at ``run_first_end``)
        self.run_admitted = 0
        #: their prompt tokens, and those of the waiting requests (what the picker counts until a first token:
        #: ``Simulator.counted_tokens``)
        self.run_admitted_tokens = 0
        self.waiting_tokens = 0
        self.event_time = math.inf
        self.version = 0
        self._touched = 0

    @property
    def touched(self) -> int:
        """Bumped before and after the simulator handles anything for this pod (an event of its own, a request sent
        to it, a placement), which also puts the pod in ``touched_pods``: a reader that caches what it derives from
        the pod's queues (the loraplane policy's in-flight counts) re-reads only the pods touched since it last
        looked, without a pass over the pool."""
        return self._touched

    @touched.setter
    def touched(self, value: int) -> None:
        self._touched = value
        self.touched_pods.add(self.index)

    @property
    def kv_reserved(self) -> int:
        """KV tokens the pod's requests hold, in whole blocks (``vllm:kv_cache_usage_perc`` x capacity)."""
        return self.kv_blocks * BLOCK_TOKENS

    def touch(self, adapter: int, now: float | None = None) -> None:
        """``adapter`` is now the most recently used here (vLLM's LRU caches); ``now``: a step that ran it began
        then (``last_use``)."""
        self.recency_clock += 1
        self.recency[adapter] = self.recency_clock
        if now is not None:
            self.last_use[adapter] = now

    @property
    def queue_depth(self) -> int:
        """Requests waiting for admission (``vllm:num_requests_waiting``)."""
        return len(self.waiting)

    def awaiting_first_token(self, now: float) -> int:
        """Requests sent here that have no first token yet at ``now``: waiting, part-way through a chunked prefill,
        or finishing their prefill in the step under way."""
        return len(self.waiting) + len(self.prefilling) + (self.run_admitted if now < self.run_first_end else 0)

    def awaiting_first_token_tokens(self, now: float, counted_tokens: Sequence[int]) -> int:
        """The prompt tokens of ``awaiting_first_token``'s requests (``counted_tokens``: the simulator's, per
        request)."""
        chunked = sum(counted_tokens[rid] for rid, _ in self.prefilling) if self.prefilling else 0
        return self.waiting_tokens + chunked + (self.run_admitted_tokens if now < self.run_first_end else 0)

    @property
    def num_running(self) -> int:
        """Requests in the running batch, chunked prefills included (``vllm:num_requests_running``)."""
        return len(self.running) + len(self.prefilling)

    def tier_of(self, adapter: int) -> Tier:
        """Where this pod holds ``adapter``."""
        if adapter in self.gpu:
            return Tier.GPU
        if adapter in self.cpu:
            return Tier.CPU
        if adapter in self.disk:
            return Tier.DISK
        return Tier.ABSENT

    def recent_evictions(self, now: float) -> int:
        """GPU evictions in the last ``THRASH_WINDOW_S`` seconds."""
        times = self.eviction_times
        while times and times[0] < now - THRASH_WINDOW_S:
            times.popleft()
        return len(times)

    def evictable(self, tier_set: set[int], keep: int) -> list[int]:
        """Adapters of ``tier_set`` that may leave it: not running, not pinned, not ``keep``; least recently used
        first (by ``last_use``, else since they came, then by vLLM's LRU order: a policy's first of equals is
        vLLM's choice)."""
        running, pinned = self.running_adapters, self.pinned
        last, since, rank = self.last_use.get, self.loaded_at.get, self.recency.get
        found = [a for a in tier_set if a not in running and a not in pinned and a != keep]
        if len(found) > 1:
            found.sort(key=lambda a: (last(a, since(a, 0.0)), rank(a, 0)))
        return found


@dataclass
class SimConfig:
    """The pool: pod count and vLLM's LoRA limits per pod."""

    pods: int = 8
    max_loras: int = 4
    max_cpu_loras: int = 16
    #: each pod's disk cache budget (the sidecar's default ``--cache-bytes 20G``)
    disk_bytes: int = 20_000_000_000
    #: the controller's placement settings loraplane's pool is planned with (``--controller-config``)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    #: how often the peers' pickers scrape each pod's vLLM metrics (llm-d-router's default 50 ms; 0: before every
    #: decision)
    scrape_interval_s: float = 0.05
    #: what loraplane's pods run (``LORAPLANE_RUNTIMES``). ``vllm`` (the default, what the real system runs):
    #: vLLM behind loraplane's sidecar, as the chart and the twin run it: a pod serves only the
    #: revisions its sidecar registered (every target of the controller's plan, at any tier; vLLM answers 404 for
    #: the rest, so the picker waits for a holder), each registration is a load that activates into a GPU slot, a
    #: GPU- or host-tier target is warmed once per target entry and then left to vLLM's LRU, and an adapter leaving
    #: the plan is unregistered. ``on-demand`` (an idealised runtime): the serving model's pods serve any revision
    #: on their disk (loading it on demand) and evict by the engine's keep score; the picker spills to them. The
    #: peers' pods serve every name either way (their adapters registered everywhere)
    loraplane_runtime: str = VLLM

    def __post_init__(self) -> None:
        if self.pods < 1 or self.max_loras < 1 or self.max_cpu_loras < self.max_loras:
            raise ValueError("need pods >= 1, max_loras >= 1 and max_cpu_loras >= max_loras (as vLLM requires)")
        if self.loraplane_runtime not in LORAPLANE_RUNTIMES:
            raise ValueError(f"loraplane_runtime must be one of {', '.join(LORAPLANE_RUNTIMES)}")
        if not self.scrape_interval_s >= 0:
            raise ValueError("the scrape interval must be >= 0 seconds")


@dataclass
class SimResult:
    """Per-request outcomes and pool counters of one run."""

    policy: str
    trace: Trace
    ttft: array  # seconds
    tier: bytearray  # L0..L3: the coldest tier the request's adapter came from
    pod: array
    #: per request: ``SERVED`` or the HTTP status of its refusal (429 / 503); refused requests have no TTFT (NaN)
    refused: array = field(default_factory=lambda: array("H"))
    #: per request: seconds it waited in the admission gate before it was dispatched or refused
    held_s: array = field(default_factory=lambda: array("d"))
    #: request ids in the order pods admitted them (the order adapters were really needed in)
    admitted: array = field(default_factory=lambda: array("i"))
    #: per request: prompt tokens served from its pod's prefix cache (all 0 on traces without prefix structure)
    cached_tokens: array = field(default_factory=lambda: array("i"))
    #: loads into GPU slots once requests came; ``setup_loads``: the placement's before the first one, which set
    #: the pool up (as the twin's sidecars do before its replay, which counts from its start)
    gpu_loads: int = 0
    setup_loads: int = 0
    demand_loads: int = 0
    #: of ``gpu_loads``, those a registration made (``Simulator.register``)
    registration_loads: int = 0
    #: loraplane's controller: its pool plans by how they were come by (``PlanOutcome.kind``)
    controller_plans: dict[str, int] = field(default_factory=dict)
    load_times: list[float] = field(default_factory=list)
    gpu_evictions: int = 0
    #: of ``gpu_evictions``, those of a running adapter's copy (a load between steps on vLLM, and the next step's
    #: reloads: ``Simulator._reactivate``; the emulator's ``running_lora_evictions_total``)
    running_evictions: int = 0
    thrash_reloads: int = 0
    #: running requests preempted for KV blocks (recomputed later, as vLLM does)
    preemptions: int = 0
    slot_busy_s: float = 0.0
    sim_seconds: float = 0.0
    events: int = 0


class Simulator:
    """Runs one trace through one pool under one router, eviction policy and (optional) placement."""

    def __init__(
        self,
        trace: Trace,
        config: SimConfig,
        profile: Profile,
        router: Router,
        eviction: Eviction,
        placement: Placement | None = None,
        progress: Callable[[int], None] | None = None,
        admission: Admission | None = None,
        priority: Sequence[int] | None = None,
        scraper: Scraper | None = None,
        counted_tokens: Sequence[int] | None = None,
    ) -> None:
        """``counted_tokens``: per request, the prompt tokens the router counts in its pod's prefill queue until the
        first token (``Pod.awaiting_first_token_tokens``; the router may write them as it routes); None: the trace's
        prompt lengths."""
        self.trace = trace
        self.counted_tokens = trace.input_tokens if counted_tokens is None else counted_tokens
        self.admission = admission
        #: reads the pods' metrics on its own clock (the peers' routers: ``loraplane.sim.peers``); a router that is
        #: a ``Scraper`` itself is one unless another is given
        self.scraper = scraper if scraper is not None else _as_scraper(router)
        #: per request, its vLLM ``priority`` (lower is served first) when the pods run vLLM's ``priority``
        #: scheduling policy; ``None``: ``fcfs``, waiting requests in the order they reached the pod
        self.priority = priority
        self._deadline_at = math.inf
        self._gate_retry_at = math.inf
        self.config = config
        self.profile = profile
        self.router = router
        self.eviction = eviction
        self.placement = placement
        self.progress = progress
        on_disk: set[int] = set()
        used = 0
        for i, a in enumerate(trace.adapters):
            if a.on_disk and used + a.nbytes <= config.disk_bytes:
                on_disk.add(i)
                used += a.nbytes
        touched: set[int] = set()
        self.pods = [Pod(i, config.max_loras, config.max_cpu_loras, on_disk, touched) for i in range(config.pods)]
        for pod in self.pods:
            pod.disk_used = used
        n = len(trace)
        self.result = SimResult(
            policy=router.name,
            trace=trace,
            ttft=array("d", bytes(8 * n)),
            tier=bytearray(n),
            pod=array("i", bytes(4 * n)),
            refused=array("H", bytes(2 * n)),
            held_s=array("d", bytes(8 * n)),
            cached_tokens=array("i", bytes(4 * n)),
        )
        #: per request, its place in its pod's waiting queue (``_queue_key``): lower is looked at first
        self._queue_key = array("q", bytes(8 * n))
        self._dispatched = 0
        #: the pods' prefix caches, on traces with prefix structure
        self.prefix = PodPrefixCaches(trace, profile, config.pods) if trace.has_prefixes else None
        self._heap: list[tuple[float, int, int, int, int]] = []
        self._seq = 0
        self.now = 0.0
        #: requests that have arrived so far
        self.arrived = 0
        # costs in seconds, precomputed
        p = profile
        self._overhead = p.step_overhead_ms / 1e3
        self._decode_base = p.decode_base_ms / 1e3
        self._per_seq = p.decode_per_seq_ms / 1e3
        self._lora_base = p.lora_base_ms / 1e3
        self._lora_per = p.lora_per_adapter_ms / 1e3
        self._prefill = p.prefill_per_token_ms / 1e3
        #: the profile's fixed per-request latency outside the steps (API server, hand-off): added to every TTFT
        self._request_overhead = p.request_overhead_ms / 1e3
        self._load_s = [
            [p.load_ms(tier, a.nbytes) / 1e3 for tier in (Tier.GPU, Tier.CPU, Tier.DISK)] for a in trace.adapters
        ]
        self._download_s = [p.download_ms(a.nbytes) / 1e3 for a in trace.adapters]
        #: per request: when its pod last admitted it (a count over all pods: its place in vLLM's running list),
        #: its computed tokens less its pod's step count while it decodes, the output tokens it had when last
        #: admitted (a preempted request is prefilled again with them) and, once preempted, the free-queue position
        #: just past its first block and how many of its blocks were full (vLLM finds those again until reused)
        self._admitted_at = array("q", bytes(8 * n))
        self._offset = array("q", bytes(8 * n))
        self._output_done = array("i", bytes(4 * n))
        self._freed_end = array("q", [-1]) * n
        self._freed_full = array("i", bytes(4 * n))
        self._admissions = 0
        #: per request, the blocks it holds when it finishes (its prompt and every output token but the last)
        self._final_blocks = array("i", [-(-(i + o - 1) // BLOCK_TOKENS) for i, o in
                                         zip(trace.input_tokens, trace.output_tokens, strict=True)])
        #: fcfs: a preempted request goes back to the front of its pod's queue (a key below every one handed out)
        self._front_key = 0
        blocks = p.kv_capacity_tokens // BLOCK_TOKENS
        for pod in self.pods:
            pod.kv_capacity_blocks = pod.queue_tail = blocks

    # -- events ---------------------------------------------------------------------------------------------
    def _push(self, when: float, kind: int, pod: int, arg: int) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (when, self._seq, kind, pod, arg))

    def run(self) -> SimResult:
        """Simulate the whole trace; returns the per-request outcomes."""
        tr = self.trace
        arrivals, n = tr.arrival, len(tr)
        heap = self._heap
        pods = self.pods
        pick = self.router.pick
        gate = self.admission
        if self.placement is not None:
            self._push(0.0, _TICK, 0, 0)
        i = 0
        events = 0
        report_every = max(1, n // 100)
        scraper = self.scraper
        scrapes = (ScrapeSchedule(scraper.period_s, arrivals[0] if n else 0.0, [scraper.offset_s(p.index) for p in pods])
                   if scraper is not None and scraper.period_s > 0 else None)  # the grid starts with the trace
        next_scrape = scrapes.next_at if scrapes is not None else math.inf
        while i < n or heap:
            next_arrival = arrivals[i] if i < n else math.inf
            if (upcoming := min(heap[0][0], next_arrival) if heap else next_arrival) >= next_scrape:
                # each pod's last tick up to what comes next sees it as it is now (a tick at an event's time is
                # taken before it)
                assert scraper is not None and scrapes is not None
                scraper.scrape(upcoming, pods, scrapes.due(upcoming))
                next_scrape = scrapes.next_at
            if heap and heap[0][0] <= next_arrival:
                when, _, kind, pod_index, arg = heapq.heappop(heap)
                self.now = when
                events += 1
                pod = pods[pod_index]
                pod.touched += 1
                if kind == _STEP:
                    if arg == pod.version:
                        self._boundary(pod, when)
                elif kind == _DOWNLOAD:
                    self._downloaded(pod, arg)
                    if pod.waiting_adapters.get(arg):
                        self._wake(pod, when)
                elif kind == _RETRY:
                    if not pod.busy and arg == pod.version:
                        self._begin(pod, when)
                elif kind == _LOADED:
                    if arg == pod.version:
                        self.loads_done(pod, when)
                elif kind == _UNREGISTER:
                    if arg in pod.draining:
                        self.unregister(pod, arg)
                elif kind == _DEADLINE:
                    if gate is not None:
                        self._deadline_at = math.inf
                        gate.expire(when, self)
                        self._arm_gate()
                elif kind == _GATE_RETRY:
                    if gate is not None:
                        self._gate_retry_at = math.inf
                        if gate.held:
                            gate.capacity_freed(when, self)
                        self._arm_gate()
                elif self.placement is not None and (i < n or any(p.busy or p.waiting for p in pods)):
                    for p in pods:
                        p.touched += 1
                    after = self.placement.apply(when, self)
                    for p in pods:
                        p.touched += 1
                    self._push(when + (self.placement.period_s if after is None else after), _TICK, 0, 0)
                pod.touched += 1
                continue
            # an arrival
            self.now = next_arrival
            events += 1
            rid = i
            i += 1
            self.arrived = i
            if gate is not None:
                gate.arrive(next_arrival, rid, self)
                self._arm_gate()
            else:
                try:
                    self.dispatch(rid, pick(next_arrival, rid, tr, pods))
                except Refused as refusal:
                    self.refuse(rid, refusal.status)
            if self.progress is not None and i % report_every == 0:
                self.progress(i)
        res = self.result
        res.events = events
        res.sim_seconds = self.now
        return res

    def dispatch(self, rid: int, pod_index: int) -> None:
        """Send request ``rid`` (arrived, not yet sent) to pod ``pod_index``'s waiting queue now."""
        pod = self.pods[pod_index]
        pod.touched += 1
        res, now = self.result, self.now
        a = self.trace.adapter[rid]
        res.pod[rid] = pod_index
        res.held_s[rid] = now - self.trace.arrival[rid]
        res.tier[rid] = L0 if a in pod.gpu else L1 if a in pod.cpu else L2 if a in pod.disk else L3
        self._enqueue(pod, rid, a)
        if a not in pod.disk:
            self._download(pod, a)
        self._wake(pod, now, a)
        pod.touched += 1

    def _enqueue(self, pod: Pod, rid: int, a: int) -> None:
        """Put ``rid`` in ``pod``'s waiting queue as vLLM's request queue orders it: by the time it reached the pod
        (``fcfs``), or by ``(priority, that time)`` (``priority``: vLLM's ``PriorityRequestQueue``)."""
        key = self._dispatched
        self._dispatched += 1
        if self.priority is not None:
            key += self.priority[rid] << _PRIORITY_SHIFT
        order = self._queue_key
        order[rid] = key
        _insert(pod.waiting, rid, key, order)
        pod.waiting_tokens += self.counted_tokens[rid]
        queued = pod.waiting_adapters.get(a)
        if queued is None:
            pod.waiting_adapters[a] = deque((rid,))
        else:
            _insert(queued, rid, key, order)

    def refuse(self, rid: int, status: int) -> None:
        """Refuse request ``rid`` (never sent to a pod) with HTTP ``status``: it has no TTFT."""
        res = self.result
        res.refused[rid] = status
        res.pod[rid] = -1
        res.ttft[rid] = math.nan
        res.held_s[rid] = self.now - self.trace.arrival[rid]

    def _arm_gate(self) -> None:
        """Make sure a deadline event comes at the gate's earliest deadline and, while it holds requests, a retry."""
        gate = self.admission
        if gate is None or not gate.held:
            return
        when = gate.next_deadline()
        if when < self._deadline_at:
            self._deadline_at = when
            self._push(when, _DEADLINE, 0, 0)
        if self._gate_retry_at == math.inf:
            self._gate_retry_at = self.now + GATE_RETRY_S
            self._push(self._gate_retry_at, _GATE_RETRY, 0, 0)

    def _wake(self, pod: Pod, now: float, adapter: int = -1) -> None:
        """Something ``pod`` may admit appeared: start it, or end its current run of steps at the next boundary."""
        if not pod.busy:
            self._begin(pod, now)
            return
        if adapter >= 0 and not self._could_admit(pod, adapter):
            return
        if now < pod.run_first_end:
            boundary, count = pod.run_first_end, 1
        else:
            k = math.ceil((now - pod.run_first_end) / pod.run_step_s) if pod.run_step_s > 0 else 0
            boundary, count = pod.run_first_end + k * pod.run_step_s, 1 + k
        if boundary < pod.event_time:
            self._schedule(pod, boundary, count)

    def _could_admit(self, pod: Pod, adapter: int) -> bool:
        if pod.num_running >= self.profile.max_num_seqs or adapter in pod.downloading:
            return False
        return adapter in pod.running_adapters or len(pod.running_adapters) < pod.max_loras

    def _schedule(self, pod: Pod, when: float, steps_in_run: int) -> None:
        pod.version += 1
        pod.event_time = when
        pod.run_steps = steps_in_run
        self._push(when, _STEP, pod.index, pod.version)

    # -- the pod's engine loop ------------------------------------------------------------------------------
    def _boundary(self, pod: Pod, now: float) -> None:
        """End of a run of steps: account it, retire finished requests, start the next step."""
        res = self.result
        res.slot_busy_s += pod.run_distinct * (now - pod.run_t0)
        steps = pod.run_steps
        if steps > 1:  # the decodes of the run's later steps took their new blocks
            grown = _blocks_taken(pod.block_phase, pod.steps + 1, steps - 1)
            if grown:
                pod.kv_blocks += grown
                _take(pod, grown)
        pod.steps += steps
        #: the last step of the run (vLLM's worker touched its adapters then)
        pod.departed_at = now - pod.run_step_s if steps > 1 else pod.run_t0
        running, adapters = pod.running, self.trace.adapter
        step_now = pod.steps
        finished = bool(running) and running[0][0] <= step_now
        left_batch = pod.left_batch
        left_batch.clear()
        if finished:
            phase, offset, final_blocks = pod.block_phase, self._offset, self._final_blocks
            running_adapters, departing, prefix = pod.running_adapters, pod.departing, self.prefix
            freed = 0
            while running and running[0][0] <= step_now:
                rid = heapq.heappop(running)[1]
                left_batch.append(rid)
                a = adapters[rid]
                left = running_adapters[a] - 1
                if left:
                    running_adapters[a] = left
                else:
                    del running_adapters[a]
                    departing.append(a)
                blocks = final_blocks[rid]
                freed += blocks
                phase[-offset[rid] % BLOCK_TOKENS] -= 1
                if prefix is not None:
                    prefix.finished(pod.index, rid, (pod.kv_blocks - freed) * BLOCK_TOKENS)
            pod.kv_blocks -= freed
            pod.queue_tail += freed
        pod.busy = False
        pod.event_time = math.inf
        self._begin(pod, now)
        gate = self.admission
        if finished and gate is not None and gate.held:
            gate.capacity_freed(now, self)
            self._arm_gate()

    def loads_done(self, pod: Pod, now: float) -> None:
        """``pod``'s engine made the loads it started with nothing to run (``_begin``): its next step."""
        pod.busy = False
        pod.event_time = math.inf
        self._begin(pod, now)

    def _begin(self, pod: Pod, now: float) -> None:
        """Schedule a step (vLLM's ``Scheduler.schedule``), then the end of the run of identical steps that follows:
        until the next finish, or the last step before one whose new KV blocks are not all free."""
        stall, prefill_tokens, first_tokens, single, batch, distinct = self._admit(pod, now)
        running = pod.running
        if not batch and stall > 0 and self.arrived:
            # loads with nothing to run: vLLM's engine makes them before its next step (the set-up's are made before
            # the trace starts, as the twin onboards its revisions before its replay)
            pod.busy = True
            pod.run_first_end, pod.run_step_s = now + stall, 0.0  # what ``_wake`` reads of a busy pod
            pod.version += 1
            pod.event_time = now + stall
            self._push(now + stall, _LOADED, pod.index, pod.version)
            return
        if not batch:
            pod.busy = False
            if ((pod.waiting and any(a not in pod.downloading for a in pod.waiting_adapters)) or running
                    or (stall and pod.prefetch_queue)):  # the sidecar's next registration
                pod.version += 1
                self._push(now + RETRY_S, _RETRY, pod.index, pod.version)
            return
        lora = self._lora_base + self._lora_per * distinct if distinct else 0.0
        step = self._overhead + self._decode_base + self._per_seq * batch + lora
        first = step + stall + self._prefill * prefill_tokens
        first_end = now + first
        res, arrivals, counted = self.result, self.trace.arrival, self.counted_tokens
        admitted_tokens = 0
        for rid in first_tokens:
            res.ttft[rid] = first_end - arrivals[rid] + self._request_overhead
            admitted_tokens += counted[rid]
        pod.busy = True
        pod.run_t0 = now
        pod.run_first_end = first_end
        pod.run_admitted = len(first_tokens)
        pod.run_admitted_tokens = admitted_tokens
        pod.run_step_s = step
        pod.run_distinct = distinct
        if single or pod.prefilling:
            self._schedule(pod, first_end, 1)
            return
        k = running[0][0] - pod.steps  # steps until the next finish (>= 1)
        n = len(running)
        # a request alone may use every block (vLLM would preempt it for good); each takes one block per cycle
        if k > 1 and n > 1 and (k + BLOCK_TOKENS - 2) // BLOCK_TOKENS * n > pod.kv_capacity_blocks - pod.kv_blocks:
            k = min(k, _steps_with_blocks(pod))
        self._schedule(pod, first_end + (k - 1) * step, k)

    def _admit(self, pod: Pod, now: float) -> tuple[float, int, list[int], bool, int, int]:
        """One step of vLLM's scheduler with LoRA and chunked prefill (``vllm.v1.core.sched.scheduler``; the
        emulator's ``Engine._schedule``, which real vLLM is held to). The running requests, in the order they were
        admitted, take their tokens of the step's budget first -- one for each decode, the next chunk of each
        prefill under way (at most ``long_prefill_token_threshold`` when set and more than one request is
        eligible) -- and the KV blocks those tokens start; a request that finds no free block preempts the most
        recently admitted running request (``priority``: the lowest priority, then the latest), which goes back to
        the front of the waiting queue and is prefilled again later. Then, unless something was preempted, waiting
        requests are admitted in queue order, skipping those whose adapter cannot get a slot this step, until
        ``max_num_seqs`` run, the budget is spent or a prompt's blocks do not all fit the free ones; each prefills
        as much of its prompt as the budget left allows. A waiting request of an adapter not in a GPU slot loads it
        inside the step.

        Returns the load stall, the tokens prefilled, the requests whose first token ends this step, whether the
        next step may differ (the budget ran out with requests waiting, a running request got nothing, or one was
        preempted), the requests scheduled and their distinct adapters.

        The waiting queue is scanned whole, as vLLM does; runs of requests it would skip (``_next_admissible``) are
        passed over in one move."""
        prof = self.profile
        waiting, running, prefilling = pod.waiting, pod.running, pod.prefilling
        budget = prof.max_batched_tokens
        # vLLM applies the threshold only when more than one request is eligible (running or waiting)
        threshold = prof.long_prefill_token_threshold if len(running) + len(prefilling) + len(waiting) > 1 else 0
        first_tokens: list[int] = []
        prefill_tokens = 0
        # the running requests' tokens and new blocks, if they all fit
        demand = batch = len(running)
        grow = pod.block_phase[pod.steps % BLOCK_TOKENS] if running else 0
        if prefilling:
            in_tokens, done = self.trace.input_tokens, self._output_done
            for rid, left in prefilling:
                chunk = min(left, threshold or left)
                computed = in_tokens[rid] + done[rid] - left
                demand += chunk
                grow += -(-(computed + chunk) // BLOCK_TOKENS) - -(-computed // BLOCK_TOKENS)
            batch += len(prefilling)
        preempted = single = False
        distinct = -1
        if demand <= budget and (grow <= pod.kv_capacity_blocks - pod.kv_blocks or batch == 1):
            budget -= demand
            if grow:
                pod.kv_blocks += grow
                if pod.queue_taken:
                    _take(pod, grow)
                else:
                    pod.queue_head += grow
            if prefilling:
                for entry in prefilling:
                    chunk = min(entry[1], threshold or entry[1])
                    prefill_tokens += chunk
                    entry[1] -= chunk
                    if not entry[1]:
                        self._decoding(pod, entry[0], first_tokens)
                prefilling[:] = [entry for entry in prefilling if entry[1]]
        elif batch:
            budget, batch, prefill_tokens, distinct, preempted, every = self._scarce(pod, budget, threshold,
                                                                                     first_tokens)
            single = preempted or not every
        running_adapters = pod.running_adapters
        if distinct < 0:
            distinct = len(running_adapters)
        if pod.departing:
            self._departed(pod)
        stall = self._placement_loads(pod, now) if pod.prefetch_queue else 0.0
        if preempted or budget <= 0 or not waiting:
            return stall, prefill_tokens, first_tokens, single or bool(waiting), batch, distinct
        tr, res = self.trace, self.result
        adapters, in_tokens, done, waiting_adapters = tr.adapter, tr.input_tokens, self._output_done, pod.waiting_adapters
        prefix = self.prefix
        tiers, admitted_log = res.tier, res.admitted
        gpu, downloading, max_loras, pinned = pod.gpu, pod.downloading, pod.max_loras, pod.pinned
        max_seqs = prof.max_num_seqs
        freed_end, freed_full, order = self._freed_end, self._freed_full, self._queue_key
        out_tokens, offsets, phase, stamps = tr.output_tokens, self._offset, pod.block_phase, self._admitted_at
        counted = self.counted_tokens
        step_next = pod.steps + 1
        free = pod.kv_capacity_blocks - pod.kv_blocks
        admitted = False
        pos = 0  # waiting[:pos] were looked at in this step and skipped
        while budget > 0 and pos < len(waiting) and len(running) + len(prefilling) < max_seqs:
            if downloading or len(running_adapters) + len(pinned) >= min(max_loras, len(gpu)):
                jump = _next_admissible(pod, pos, len(waiting), order)  # a run of requests may be skipped
                if jump > pos:
                    pos = jump
                    continue
            rid = waiting[pos]
            a = adapters[rid]
            if a not in gpu and ((a not in running_adapters and len(running_adapters) >= max_loras) or a in downloading):
                pos += 1
                continue
            total = in_tokens[rid] + done[rid]  # a preempted request computes its output so far again
            if -(-total // BLOCK_TOKENS) > free and (admitted or running or prefilling):
                break  # the whole prompt's blocks must be free (a lone request is let in)
            if a not in gpu:
                tier = L1 if a in pod.cpu else L2
                cost = self._load(pod, a, now, demand=True)
                if cost < 0:
                    pos += 1
                    continue
                stall += cost
                if tiers[rid] < tier:
                    tiers[rid] = tier
            # admit
            del waiting[pos]
            pod.waiting_tokens -= counted[rid]
            queued = waiting_adapters[a]
            queued.popleft()  # its oldest: an adapter's earlier requests were admitted or it would be skipped too
            if not queued:
                del waiting_adapters[a]
            fresh = freed_end[rid] < 0
            own = 0  # blocks of its own found again (a preempted request: those not handed out since)
            if fresh:
                cached = prefix.match(pod.index, rid) if prefix is not None else 0
            else:
                end = freed_end[rid]
                own = max(0, min(freed_full[rid], (total - 1) // BLOCK_TOKENS, end - pod.queue_head))
                if own:
                    insort(pod.queue_taken, (end - own, end))
                cached = own * BLOCK_TOKENS
            n_new = total - cached  # tokens to prefill
            chunk = min(n_new, budget, threshold or budget)
            budget -= chunk
            prefill_tokens += chunk
            blocks = -(-(cached + chunk) // BLOCK_TOKENS)
            pod.kv_blocks += blocks
            free -= blocks
            if pod.queue_taken:
                _take(pod, blocks - own)
            else:
                pod.queue_head += blocks - own
            self._admissions += 1
            stamps[rid] = self._admissions
            if fresh:
                if prefix is not None:
                    res.cached_tokens[rid] = cached
                    prefix.admitted(pod.index, rid, pod.kv_reserved)
                admitted_log.append(rid)
                pod.uses[a] = pod.uses.get(a, 0) + 1
            admitted = True
            batch += 1
            running_adapters[a] = running_adapters.get(a, 0) + 1
            if chunk < n_new:
                prefilling.append([rid, n_new - chunk])
                continue
            # decoding from the next step (``_decoding``)
            if fresh:
                offset = total - step_next
                heapq.heappush(running, (step_next - 1 + out_tokens[rid], rid))
                first_tokens.append(rid)
            else:
                offset = total - step_next
                heapq.heappush(running, (step_next - 1 + out_tokens[rid] - done[rid], rid))
                if not done[rid]:
                    first_tokens.append(rid)
            offsets[rid] = offset
            phase[-offset % BLOCK_TOKENS] += 1
        if admitted:
            distinct = len(running_adapters)
        return stall, prefill_tokens, first_tokens, single or (budget <= 0 and pos < len(waiting)), batch, distinct

    def _placement_loads(self, pod: Pod, now: float) -> float:
        """Make the loads a placement asked of ``pod`` (``prefetch_queue``) that are due at this step; returns their
        stall. Disk-tier registrations (``Pod.cold_loads``) load one at a time, one a step, and wait while requests
        wait in the pod's queue, ``SLOTS_BUSY_WAIT_S`` at most, as the sidecar holds them (``Reconciler.step``): on
        vLLM each activation stalls the batch ~0.17 s, and no request needs them yet."""
        cold_waits = pod.cold_load_wait.holds(
            bool(pod.waiting) and any(a in pod.cold_loads for a in pod.prefetch_queue), now)
        stall = 0.0
        waiting_loads = []
        cold_loaded = False
        for a in pod.prefetch_queue:
            cold = a in pod.cold_loads
            if cold and (cold_waits or cold_loaded):
                waiting_loads.append(a)
                continue
            cold_loaded = cold_loaded or cold
            load_s = self._load(pod, a, now, demand=False, by_touch=pod.registered is not None)
            if load_s < 0 and a in pod.registered_load:
                waiting_loads.append(a)  # the sidecar's load waits while every slot runs (SLOTS_BUSY_WAIT_S)
            stall += max(0.0, load_s)
        pod.prefetch_queue = waiting_loads
        if any(a not in pod.gpu for a in pod.running_adapters):
            stall += self._reactivate(pod, now)
        return stall

    def _batch_order(self, rids: Iterable[int]) -> dict[int, int]:
        """The adapters of ``rids`` with the earliest admission among them: their order in a step's batch (the
        running list's, by admission), the order vLLM's worker activates them in."""
        stamp, adapters = self._admitted_at, self.trace.adapter
        first: dict[int, int] = {}
        for rid in rids:
            a, at = adapters[rid], stamp[rid]
            if at < first.get(a, at + 1):
                first[a] = at
        return first

    def _touch_order(self, pod: Pod, now: float, copies: set[int]) -> list[int]:
        """``copies`` (``pod``'s GPU slots or host cache) in vLLM's LRU order between two steps, least recently
        touched first: those the last step did not run (by recency), then the last step's batch in its order (its
        requests still running or just left: vLLM's worker touched every adapter of the batch in both caches), then
        those loaded since that step began (by recency)."""
        batch = self._batch_order(chain((rid for _, rid in pod.running), (entry[0] for entry in pod.prefilling),
                                        pod.left_batch))
        rank, loaded, last_step = pod.recency.get, pod.loaded_at.get, pod.departed_at

        def key(a: int) -> tuple[int, int]:
            since = loaded(a, -math.inf) > last_step or loaded(a) == now
            if a in batch and not since:
                return 1, batch[a]
            return (2 if since else 0), rank(a, 0)
        return sorted(copies, key=key)

    def _reactivate(self, pod: Pod, now: float) -> float:
        """The step after a load pushed out a running adapter: vLLM's worker activates the batch's adapters in its
        order, each brought back (from host memory, else disk) evicting the least recently touched copy -- often
        the batch's next one, which its own turn brings back (up to ``max_loras`` loads). Returns their stall."""
        gpu_lru, host_lru = self._touch_order(pod, now, pod.gpu), self._touch_order(pod, now, pod.cpu)
        batch = self._batch_order(chain((rid for _, rid in pod.running), (entry[0] for entry in pod.prefilling)))
        stall = 0.0
        for a in sorted(batch, key=batch.__getitem__):
            from_cpu = a in pod.cpu
            if from_cpu:
                host_lru.remove(a)
            elif len(pod.cpu) >= pod.max_cpu_loras:  # its host copy went too: read again, making room
                gone = host_lru.pop(0)
                pod.cpu.discard(gone)
                if gone in pod.gpu:
                    gpu_lru.remove(gone)
                    self._evict_gpu(pod, gone, now)
            host_lru.append(a)
            if a in pod.gpu:
                gpu_lru.remove(a)
            else:
                if len(pod.gpu) >= pod.max_loras:
                    self._evict_gpu(pod, gpu_lru.pop(0), now)
                pod.cpu.add(a)
                pod.gpu.add(a)
                self._loaded(pod, a, now, demand=False)
                stall += self._load_s[a][1 if from_cpu else 2]
            gpu_lru.append(a)
        return stall

    def _departed(self, pod: Pod) -> None:
        """Adapters whose last request left the batch at this boundary: the last step ran them, so they are the most
        recently used now, in that step's batch order (the running list's: by admission)."""
        departing = pod.departing
        if len(departing) > 1:
            adapters, stamp = self.trace.adapter, self._admitted_at
            first: dict[int, int] = {}
            for rid in pod.left_batch:
                a = adapters[rid]
                if a not in first or stamp[rid] < first[a]:
                    first[a] = stamp[rid]
            departing.sort(key=first.__getitem__)
        for a in departing:
            pod.touch(a, pod.departed_at)
        departing.clear()

    def _decoding(self, pod: Pod, rid: int, first_tokens: list[int]) -> None:
        """``rid``'s prefill ends in the step now scheduled: it decodes from the next step until its last token."""
        done = self._output_done[rid]
        offset = self.trace.input_tokens[rid] + done - pod.steps - 1  # computed tokens less the step count
        self._offset[rid] = offset
        pod.block_phase[-offset % BLOCK_TOKENS] += 1
        heapq.heappush(pod.running, (pod.steps + self.trace.output_tokens[rid] - done, rid))
        if not done:
            first_tokens.append(rid)

    def _scarce(self, pod: Pod, budget: int, threshold: int,
                first_tokens: list[int]) -> tuple[int, int, int, int, bool, bool]:
        """The running requests' pass when their tokens exceed the step's budget or their new blocks the free ones,
        request by request in admission order as vLLM's scheduler goes (requests the budget does not reach get
        nothing this step; a decode that gets nothing makes no token). Returns the budget left, the requests
        scheduled, their prefill tokens and distinct adapters, whether one was preempted and whether every running
        request got its tokens."""
        in_tokens, adapters = self.trace.input_tokens, self.trace.adapter
        done, offset, stamp = self._output_done, self._offset, self._admitted_at
        steps = pod.steps
        chunked = {entry[0]: entry for entry in pod.prefilling}
        order = sorted([rid for _, rid in pod.running] + list(chunked), key=stamp.__getitem__)
        free = pod.kv_capacity_blocks - pod.kv_blocks
        scheduled: dict[int, int] = {}
        grown: dict[int, int] = {}
        preempted: set[int] = set()
        key = self._queue_key
        index = 0
        stopped = False
        while index < len(order) and budget > 0:
            rid = order[index]
            entry = chunked.get(rid)
            if entry is None:
                computed, n = offset[rid] + steps, 1
            else:
                computed = in_tokens[rid] + done[rid] - entry[1]
                n = min(entry[1], threshold or entry[1], budget)
            need = -(-(computed + n) // BLOCK_TOKENS) - -(-computed // BLOCK_TOKENS)
            while need > free and len(order) > 1:
                victim = max(order, key=key.__getitem__) if self.priority is not None else order[-1]
                where = order.index(victim)
                del order[where]
                if where < index:
                    index -= 1
                n_victim = scheduled.pop(victim, 0)
                budget += n_victim
                free += self._preempt(pod, victim, chunked.pop(victim, None), n_victim, grown.pop(victim, 0))
                preempted.add(victim)
                if victim == rid:
                    stopped = True
                    break
            if stopped:
                break
            free -= need
            if need:
                pod.kv_blocks += need
                _take(pod, need)
                grown[rid] = need
            scheduled[rid] = n
            budget -= n
            index += 1
        # decodes the budget did not reach make no token this step: their finish and next blocks come a step later.
        # A step that schedules nothing (the first request preempted itself: ``priority``) does not run and the step
        # count does not move, so the others' computed tokens (offset + steps) stay as they are: shifting them
        # would count one token too few, take each block a step late and free one too few at the finish
        phase = pod.block_phase
        if preempted or len(scheduled) < len(order):
            kept = []
            for finish, rid in pod.running:
                if rid in preempted:
                    continue
                if scheduled and rid not in scheduled:
                    phase[-offset[rid] % BLOCK_TOKENS] -= 1
                    offset[rid] -= 1
                    phase[-offset[rid] % BLOCK_TOKENS] += 1
                    finish += 1
                kept.append((finish, rid))
            heapq.heapify(kept)
            pod.running[:] = kept
        prefill_tokens = 0
        for rid, entry in chunked.items():
            n = scheduled.get(rid, 0)
            prefill_tokens += n
            entry[1] -= n
            if not entry[1]:
                self._decoding(pod, rid, first_tokens)
        pod.prefilling[:] = [entry for entry in pod.prefilling if entry[1]]
        distinct = len({adapters[rid] for rid in scheduled})
        return budget, len(scheduled), prefill_tokens, distinct, bool(preempted), not preempted and index == len(order)

    def _preempt(self, pod: Pod, rid: int, entry: list[int] | None, scheduled: int, grown: int) -> int:
        """Recompute preemption of running request ``rid`` (``entry``: its chunked prefill, if under way): its
        blocks go back to the free queue, tail first, and it waits at the front of the queue (``priority``: at its
        place) to be prefilled again with the output it has. Returns the blocks freed."""
        in_tokens, a = self.trace.input_tokens[rid], self.trace.adapter[rid]
        if entry is None:
            computed = self._offset[rid] + pod.steps
            pod.block_phase[-self._offset[rid] % BLOCK_TOKENS] -= 1
            tokens = computed + 1
            self._output_done[rid] = tokens - in_tokens
        else:
            tokens = in_tokens + self._output_done[rid]
            computed = tokens - entry[1]
            pod.prefilling.remove(entry)
        blocks = -(-computed // BLOCK_TOKENS) + grown
        pod.kv_blocks -= blocks
        pod.queue_tail += blocks
        self._freed_end[rid] = pod.queue_tail
        self._freed_full[rid] = min(computed + scheduled, tokens) // BLOCK_TOKENS  # full blocks it had hashed
        left = pod.running_adapters[a] - 1
        if left:
            pod.running_adapters[a] = left
        else:
            del pod.running_adapters[a]
            pod.departing.append(a)
        pod.left_batch.append(rid)
        order = self._queue_key
        if self.priority is None:
            self._front_key -= 1
            order[rid] = self._front_key
        _insert(pod.waiting, rid, order[rid], order)
        pod.waiting_tokens += self.counted_tokens[rid]
        queued = pod.waiting_adapters.get(a)
        if queued is None:
            pod.waiting_adapters[a] = deque((rid,))
        else:
            _insert(queued, rid, order[rid], order)
        self.result.preemptions += 1
        return blocks

    def _load(self, pod: Pod, a: int, now: float, demand: bool, by_touch: bool = False) -> float:
        """Bring ``a`` into a GPU slot of ``pod`` as vLLM's worker does: a read from disk first makes room in the
        host cache (its victim leaves its GPU slot too), then the activation takes a free slot or evicts. Returns
        the stall in seconds, or -1 when the eviction policy refuses (nothing changes then). ``by_touch``: a load
        between steps (vLLM's ``load_lora_adapter``), whose activation evicts the least recently touched copy,
        running or not (``_touch_order``), once some copy is not running (else the sidecar waits)."""
        if a in pod.gpu:
            return 0.0
        from_cpu = a in pod.cpu
        if not from_cpu and a not in pod.disk:
            return -1.0
        gpu_victim = cpu_victim = -1
        if not from_cpu and len(pod.cpu) >= pod.max_cpu_loras:
            v = self._victim(pod, now, Tier.CPU, pod.evictable(pod.cpu, a), a, by_touch)
            if v is None:
                return -1.0
            cpu_victim = v
        if len(pod.gpu) - (cpu_victim in pod.gpu) >= pod.max_loras:
            candidates = [c for c in pod.evictable(pod.gpu, a) if c != cpu_victim]
            v = self._victim(pod, now, Tier.GPU, candidates, a, by_touch, cpu_victim)
            if v is None:
                return -1.0
            gpu_victim = v
        if cpu_victim >= 0:
            pod.cpu.discard(cpu_victim)
            if cpu_victim in pod.gpu:
                self._evict_gpu(pod, cpu_victim, now)
        if gpu_victim >= 0:
            self._evict_gpu(pod, gpu_victim, now)
        pod.cpu.add(a)
        pod.gpu.add(a)
        self._loaded(pod, a, now, demand)
        return self._load_s[a][1 if from_cpu else 2]

    def _victim(self, pod: Pod, now: float, tier: Tier, candidates: list[int], a: int, by_touch: bool,
                spared: int = -1) -> int | None:
        """The copy of ``tier`` that makes room for ``a``: the eviction policy's pick among ``candidates`` (None:
        nothing may go); ``by_touch``, once some candidate could go (else the sidecar waits), vLLM's least recently
        touched copy, running or not, other than ``spared``."""
        if not by_touch:
            return self.eviction.victim(now, pod, tier, candidates, a)
        if not candidates:
            return None
        copies = pod.gpu if tier is Tier.GPU else pod.cpu
        return next(c for c in self._touch_order(pod, now, copies) if c != spared and c not in pod.pinned)

    def _loaded(self, pod: Pod, a: int, now: float, demand: bool) -> None:
        """Account a load of ``a`` into one of ``pod``'s GPU slots."""
        res = self.result
        pod.touch(a)
        pod.loaded_at[a] = now
        pod.residency_version += 1
        if self.arrived:
            res.gpu_loads += 1
            res.registration_loads += a in pod.registered_load
        else:
            res.setup_loads += 1
        pod.registered_load.discard(a)
        pod.cold_loads.discard(a)
        if demand:
            res.demand_loads += 1
            res.load_times.append(now)
        evicted = pod.evicted_at.get(a)
        if evicted is not None and now - evicted <= THRASH_WINDOW_S:
            res.thrash_reloads += 1

    def _download(self, pod: Pod, a: int) -> None:
        """Fetch ``a`` to ``pod``'s disk unless already under way; a pod fetches one artifact at a time."""
        if a in pod.downloading:
            return
        pod.downloading.add(a)
        pod.download_free_at = max(self.now, pod.download_free_at) + self._download_s[a]
        self._push(pod.download_free_at, _DOWNLOAD, pod.index, a)

    def _downloaded(self, pod: Pod, a: int) -> None:
        """``a`` is on ``pod``'s disk; older disk-only adapters leave while the cache is over its budget, those the
        placement no longer plans here first (as the sidecar keeps its target state's adapters)."""
        pod.downloading.discard(a)
        pod.disk.add(a)
        if a in pod.registering:
            pod.registering.discard(a)
            self.register(pod, a, cold=a in pod.cold_loads)
        pod.disk_used += self.trace.adapters[a].nbytes
        pod.residency_version += 1
        cpu, waiting, last_use = pod.cpu, pod.waiting_adapters, pod.last_use.get
        while pod.disk_used > self.config.disk_bytes:
            spare = [d for d in pod.disk if d not in cpu and d != a and d not in waiting]
            if not spare:
                break
            planned = pod.planned
            used = [(d in planned, last_use(d, -1.0)) for d in spare]
            victim = spare[used.index(min(used))]  # the least recently used; the first of equals, as min() picks
            pod.disk.discard(victim)
            pod.disk_used -= self.trace.adapters[victim].nbytes

    def _evict_gpu(self, pod: Pod, a: int, now: float) -> None:
        pod.gpu.discard(a)
        pod.residency_version += 1
        pod.evicted_at[a] = now
        pod.eviction_times.append(now)
        self.result.gpu_evictions += 1
        self.result.running_evictions += a in pod.running_adapters

    # -- used by placements -----------------------------------------------------------------------------------
    def prefetch(self, pod: Pod, adapter: int) -> None:
        """Ask ``pod`` to bring ``adapter`` to a GPU slot at its next step (downloading it first if absent)."""
        pod.cold_loads.discard(adapter)
        if adapter in pod.gpu or adapter in pod.prefetch_queue:
            return
        if adapter not in pod.disk:
            self._download(pod, adapter)
            return
        pod.prefetch_queue.append(adapter)
        self._wake(pod, self.now)

    def stage_cpu(self, pod: Pod, adapter: int) -> None:
        """Ask ``pod`` to hold ``adapter`` in host memory (read and parsed off the batch's critical path)."""
        if adapter in pod.cpu:
            return
        if adapter not in pod.disk:
            self.prefetch(pod, adapter)  # starts the download; the next placement round stages it
            return
        if len(pod.cpu) >= pod.max_cpu_loras:
            victim = self.eviction.victim(self.now, pod, Tier.CPU, pod.evictable(pod.cpu - pod.gpu, adapter), adapter)
            if victim is None:
                return
            pod.cpu.discard(victim)
        pod.cpu.add(adapter)
        pod.touch(adapter)
        pod.loaded_at.setdefault(adapter, self.now)
        pod.residency_version += 1

    def stage_disk(self, pod: Pod, adapter: int) -> None:
        """Ask ``pod`` to have ``adapter`` on local disk (fetched in the background)."""
        if adapter not in pod.disk:
            self._download(pod, adapter)

    def register(self, pod: Pod, adapter: int, cold: bool = False) -> None:
        """Register ``adapter`` with ``pod``'s vLLM (``Pod.registered``), fetching it to disk first (at once before the
        first request: the pool is set up, as the twin onboards its revisions before it replays): vLLM's load
        activates it, so it takes a GPU slot at the next step; ``cold``: a disk-tier target, whose load waits for
        the pod's queue to empty (``_placement_loads``)."""
        assert pod.registered is not None
        if adapter in pod.registered:
            if adapter in pod.draining:  # targeted again before it left: reported as held again
                pod.draining.discard(adapter)
                pod.residency_version += 1
            return
        if adapter not in pod.disk and not self.arrived:  # set-up: the twin onboards every revision before its replay
            pod.disk.add(adapter)
            pod.disk_used += self.trace.adapters[adapter].nbytes
        if adapter not in pod.disk:
            pod.registering.add(adapter)
            if cold:
                pod.cold_loads.add(adapter)
            self._download(pod, adapter)
            return
        if (adapter in pod.cpu and adapter not in pod.running_adapters
                and not pod.waiting_adapters.get(adapter)):  # a copy left by an unload: vLLM loads a second one
            pod.cpu.discard(adapter)
            pod.gpu.discard(adapter)
        pod.registered.add(adapter)
        pod.residency_version += 1
        if adapter not in pod.gpu:
            pod.registered_load.add(adapter)
        self.prefetch(pod, adapter)
        if cold and adapter in pod.prefetch_queue:
            pod.cold_loads.add(adapter)

    def drain(self, pod: Pod, adapter: int) -> None:
        """``pod``'s sidecar no longer targets ``adapter``: it reports it draining at once (the picker stops routing
        there) and unregisters it after its drain grace (``DEFAULT_DRAIN_GRACE_S``), as the real sidecar does, so no
        request the picker routed on the report before reaches a runtime that forgot the name."""
        assert pod.registered is not None
        pod.registering.discard(adapter)
        if adapter not in pod.registered or adapter in pod.draining:
            return
        pod.draining.add(adapter)
        pod.residency_version += 1
        self._push(self.now + DEFAULT_DRAIN_GRACE_S, _UNREGISTER, pod.index, adapter)

    def unregister(self, pod: Pod, adapter: int) -> None:
        """``pod``'s vLLM forgets ``adapter``'s name, and only its name: the copy keeps its place in both LRU caches
        (a GPU slot too) until LRU pushes it out, as vLLM's ``unload_lora_adapter`` leaves it (docs/vllm.md)."""
        assert pod.registered is not None
        pod.registering.discard(adapter)
        pod.registered_load.discard(adapter)
        pod.cold_loads.discard(adapter)
        pod.draining.discard(adapter)
        if adapter not in pod.registered:
            return
        pod.registered.discard(adapter)
        pod.residency_version += 1
        if adapter in pod.prefetch_queue:
            pod.prefetch_queue.remove(adapter)


def _as_scraper(router: Router) -> Scraper | None:
    """``router`` when it scrapes the pods on its own clock (it has ``period_s`` and ``scrape``), else None."""
    return router if callable(getattr(router, "scrape", None)) and hasattr(router, "period_s") else None  # type: ignore[return-value]


def _insert(queue: deque[int], rid: int, key: int, order: array) -> None:
    """Insert ``rid`` into ``queue`` (sorted by ``order``) after every request of a key not above ``key``."""
    if not queue or order[queue[-1]] <= key:
        queue.append(rid)
    else:
        queue.insert(bisect_right(queue, key, key=order.__getitem__), rid)


def _next_admissible(pod: Pod, start: int, stop: int, order: array) -> int:
    """The position of the first of ``pod.waiting[start:stop]`` that the scan could admit (``stop`` if none); those
    before it would all be skipped. When no GPU slot can be had -- the batch runs ``max_loras`` adapters, or every
    slot holds a running or pinned adapter -- only the requests of adapters in a slot can join; otherwise requests
    of adapters still downloading are skipped (found by counting them: the waiting keys are sorted)."""
    waiting = pod.waiting_adapters
    running, gpu = pod.running_adapters, pod.gpu
    if len(running) >= pod.max_loras or (
        len(gpu) >= pod.max_loras
        and len(running) + len(pod.pinned) >= len(gpu)
        and all(a in running or a in pod.pinned for a in gpu)
    ):
        heads = [order[queued[0]] for a in gpu if (queued := waiting.get(a))]
        return bisect_left(pod.waiting, min(heads), start, stop, key=order.__getitem__) if heads else stop
    if not pod.downloading:
        return start
    queues = [queued for a in pod.downloading if (queued := waiting.get(a))]
    if not queues:
        return start
    queue, key = pod.waiting, order.__getitem__
    first = order[queue[start]]
    before = [bisect_left(q, first, key=key) for q in queues]

    def skipped_through(i: int) -> bool:  # queue[start..i] are all requests of downloading adapters
        last = order[queue[i]]
        return sum(bisect_right(q, last, key=key) for q in queues) - sum(before) == i - start + 1

    if not skipped_through(start):
        return start
    low, high = start, stop - 1
    while low < high:
        mid = (low + high + 1) // 2
        if skipped_through(mid):
            low = mid
        else:
            high = mid - 1
    return low + 1


def _blocks_taken(phase: list[int], start: int, count: int) -> int:
    """New KV blocks the decodes take over ``count`` steps whose residues (step - 1) run from ``start``."""
    cycles, rest = divmod(count, BLOCK_TOKENS)
    taken = cycles * sum(phase) if cycles else 0
    if rest:
        first = start % BLOCK_TOKENS
        end = first + rest
        taken += sum(phase[first:end]) if end <= BLOCK_TOKENS else sum(phase[first:]) + sum(phase[:end - BLOCK_TOKENS])
    return taken


def _steps_with_blocks(pod: Pod) -> int:
    """The most steps (the one scheduled now included) the decoding batch runs before a step whose new blocks are
    not all free (that step preempts)."""
    free = pod.kv_capacity_blocks - pod.kv_blocks
    if free < 0:
        return 1
    phase, start = pod.block_phase, pod.steps + 1
    cycles, rest = divmod(free, len(pod.running))  # every request takes one block per cycle of BLOCK_TOKENS steps
    r = 0
    while r < BLOCK_TOKENS - 1:
        taken = phase[(start + r) % BLOCK_TOKENS]
        if taken > rest:
            break
        rest -= taken
        r += 1
    return cycles * BLOCK_TOKENS + r + 1


def _take(pod: Pod, count: int) -> None:
    """``count`` blocks are handed out from the head of ``pod``'s free queue (skipping ranges a prefix hit took)."""
    head, taken = pod.queue_head, pod.queue_taken
    while count > 0:
        if taken and taken[0][0] <= head:
            head = max(head, taken[0][1])
            del taken[0]
            continue
        step = min(count, taken[0][0] - head) if taken else count
        head += step
        count -= step
    pod.queue_head = head
