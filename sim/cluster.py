"""The discrete-event simulator of one InferencePool.

Each pod runs vLLM-style continuous batching: at every step boundary it admits waiting requests in the order of
vLLM's request queue -- the order they reached the pod (``fcfs``), or ``(priority, that order)`` for pods run with
``--scheduling-policy priority`` -- skipping one whose adapter cannot get a GPU slot, as vLLM's scheduler does;
it loads admitted requests' adapters *inside* that step (a load stalls the whole batch, as in vLLM), runs the prefill
of new requests and one decode token for every running one. A running request is never preempted: its KV is
reserved at admission, so the KV shortage that makes vLLM preempt (under ``priority``, its lowest-priority running
request) never arises here. A request's first token comes at the end of the step that admitted it, so

    TTFT = queue wait + load stall (by tier) + prefill + decode of the co-scheduled batch + step overhead,

where prefill covers the prompt tokens the pod's prefix cache does not hold (traces with prefix structure only:
``loraplane.sim.prefix``).

Between two events that change a pod's batch (an arrival it could admit, a request finishing, a download finishing)
every step costs the same, so the simulator jumps over the steps in between in one event: the work is O(events),
not O(tokens). Adapters absent from a pod are downloaded to its disk asynchronously (the request waits; the batch
does not).

Tiers per pod, with vLLM's meanings: ``gpu`` (``max_loras`` slots), ``cpu`` (the registered cache of
``max_cpu_loras`` adapters, a superset of ``gpu``), ``disk`` (unbounded), absent. An adapter with running requests
is never evicted; pinned ones neither.
"""

from __future__ import annotations

import heapq
import math
from array import array
from bisect import bisect_left, bisect_right
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import islice
from typing import Protocol

from loraplane.api import Tier
from loraplane.controller.placement import PlacementConfig
from loraplane.sim.prefix import PodPrefixCaches
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
#: how many waiting requests a step boundary looks at (bounds the cost of a long queue)
SCAN_LIMIT = 128

_STEP, _DOWNLOAD, _RETRY, _TICK, _DEADLINE, _GATE_RETRY = 0, 1, 2, 3, 4, 5
#: while the admission gate holds requests it is also asked to dispatch this often (besides on every finish), so
#: held requests go out when something other than a finish makes room (a fetch done, an idle pod, fresher reports)
GATE_RETRY_S = 0.05
#: a waiting queue's key is ``priority << _PRIORITY_SHIFT`` plus the request's dispatch count (below 2**40)
_PRIORITY_SHIFT = 40
#: ``SimResult.refused`` code of a served request (otherwise the HTTP status the client got: 429 or 503)
SERVED = 0


class Refused(Exception):
    """A router's refusal of a request: the client gets ``status`` (429 sheddable, 503 otherwise)."""

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
    """Reads the pods' metrics every ``period_s`` simulated seconds (the peers' metrics scrape): ``scrape`` is called
    at each tick ``first arrival + k x period_s`` after every event before it (so a trace shifted in time is
    scraped alike), with the pods as they are then. Ticks with no event
    since the last one are folded into one call (nothing changed); ``period_s <= 0`` never ticks."""

    period_s: float

    def scrape(self, now: float, pods: list[Pod]) -> None:
        """The pods' state at tick ``now``."""
        ...


class Placement(Protocol):
    """Periodically moves adapters between tiers ahead of demand (the controller's job)."""

    period_s: float

    def apply(self, now: float, sim: Simulator) -> None:
        """Read the pool and request rates from ``sim``, change pods' targets via ``Pod.prefetch``/``Pod.pin``."""
        ...


class Pod:
    """One model server. Attributes are read by routers and eviction policies; only the simulator changes them."""

    def __init__(self, index: int, max_loras: int, max_cpu_loras: int, disk: set[int]) -> None:
        self.index = index
        self.max_loras = max_loras
        self.max_cpu_loras = max_cpu_loras
        self.gpu: set[int] = set()
        self.cpu: set[int] = set()
        self.disk: set[int] = set(disk)
        self.disk_used = 0
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
        self.kv_reserved = 0
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
        self.event_time = math.inf
        self.version = 0

    @property
    def queue_depth(self) -> int:
        """Requests waiting for admission (``vllm:num_requests_waiting``)."""
        return len(self.waiting)

    def awaiting_first_token(self, now: float) -> int:
        """Requests sent here that have no first token yet at ``now``: waiting, part-way through a chunked prefill,
        or finishing their prefill in the step under way."""
        return len(self.waiting) + len(self.prefilling) + (self.run_admitted if now < self.run_first_end else 0)

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
        """Adapters of ``tier_set`` that may leave it: not running, not pinned, not ``keep``."""
        running, pinned = self.running_adapters, self.pinned
        return [a for a in tier_set if a not in running and a not in pinned and a != keep]


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

    def __post_init__(self) -> None:
        if self.pods < 1 or self.max_loras < 1 or self.max_cpu_loras < self.max_loras:
            raise ValueError("need pods >= 1, max_loras >= 1 and max_cpu_loras >= max_loras (as vLLM requires)")
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
    gpu_loads: int = 0
    demand_loads: int = 0
    load_times: list[float] = field(default_factory=list)
    gpu_evictions: int = 0
    thrash_reloads: int = 0
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
    ) -> None:
        self.trace = trace
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
        self.pods = [Pod(i, config.max_loras, config.max_cpu_loras, on_disk) for i in range(config.pods)]
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
        #: the largest KV reservation of any request (a bound for skipping a scan's checks)
        self._max_kv = max(map(sum, zip(trace.input_tokens, trace.output_tokens, strict=True)), default=0)

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
        period = scraper.period_s if scraper is not None and scraper.period_s > 0 else 0.0
        next_scrape = (arrivals[0] if n else 0.0) if period else math.inf  # the grid starts with the trace
        while i < n or heap:
            next_arrival = arrivals[i] if i < n else math.inf
            if period and (upcoming := min(heap[0][0], next_arrival) if heap else next_arrival) >= next_scrape:
                # the last tick up to what comes next sees the pods as they are now (a tick at an event's time is
                # taken before it)
                assert scraper is not None
                tick = next_scrape + math.floor((upcoming - next_scrape) / period) * period
                scraper.scrape(tick, pods)
                next_scrape = tick + period
            if heap and heap[0][0] <= next_arrival:
                when, _, kind, pod_index, arg = heapq.heappop(heap)
                self.now = when
                events += 1
                pod = pods[pod_index]
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
                    self.placement.apply(when, self)
                    self._push(when + self.placement.period_s, _TICK, 0, 0)
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
        res, now = self.result, self.now
        a = self.trace.adapter[rid]
        res.pod[rid] = pod_index
        res.held_s[rid] = now - self.trace.arrival[rid]
        res.tier[rid] = L0 if a in pod.gpu else L1 if a in pod.cpu else L2 if a in pod.disk else L3
        self._enqueue(pod, rid, a)
        if a not in pod.disk:
            self._download(pod, a)
        self._wake(pod, now, a)

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
        pod.steps += pod.run_steps
        running, out_tokens, in_tokens = pod.running, self.trace.output_tokens, self.trace.input_tokens
        adapters = self.trace.adapter
        finished = bool(running) and running[0][0] <= pod.steps
        while running and running[0][0] <= pod.steps:
            _, rid = heapq.heappop(running)
            a = adapters[rid]
            left = pod.running_adapters[a] - 1
            if left:
                pod.running_adapters[a] = left
            else:
                del pod.running_adapters[a]
            pod.kv_reserved -= in_tokens[rid] + out_tokens[rid]
            if self.prefix is not None:
                self.prefix.finished(pod.index, rid, pod.kv_reserved)
        pod.busy = False
        pod.event_time = math.inf
        self._begin(pod, now)
        gate = self.admission
        if finished and gate is not None and gate.held:
            gate.capacity_freed(now, self)
            self._arm_gate()

    def _begin(self, pod: Pod, now: float) -> None:
        """Admit what fits, then schedule the end of the run of steps that follows."""
        stall, prefill_tokens, first_tokens, budget_hit = self._admit(pod, now)
        running = pod.running
        if not running and not pod.prefilling:
            pod.busy = False
            if pod.waiting and any(a not in pod.downloading for a in pod.waiting_adapters):
                pod.version += 1
                self._push(now + RETRY_S, _RETRY, pod.index, pod.version)
            return
        distinct = len(pod.running_adapters)
        batch = pod.num_running
        lora = self._lora_base + self._lora_per * distinct if distinct else 0.0
        step = self._overhead + self._decode_base + self._per_seq * batch + lora
        first = step + stall + self._prefill * prefill_tokens
        first_end = now + first
        res, arrivals = self.result, self.trace.arrival
        for rid in first_tokens:
            res.ttft[rid] = first_end - arrivals[rid] + self._request_overhead
        pod.busy = True
        pod.run_t0 = now
        pod.run_first_end = first_end
        pod.run_admitted = len(first_tokens)
        pod.run_step_s = step
        pod.run_distinct = distinct
        if budget_hit or pod.prefilling:
            self._schedule(pod, first_end, 1)
        else:
            k = running[0][0] - pod.steps  # steps until the next finish (>= 1)
            self._schedule(pod, first_end + (k - 1) * step, k)

    def _admit(self, pod: Pod, now: float) -> tuple[float, int, list[int], bool]:
        """vLLM's scheduler with LoRA and chunked prefill: the chunked prefills under way take their next chunks of
        the step's token budget first (in admission order), then waiting requests are admitted in queue order,
        skipping those whose adapter cannot get a slot this step, each prefilling as much of its prompt as the
        budget left allows (at most ``long_prefill_token_threshold`` tokens per step, when set and more than one
        request is eligible). Returns the load stall, the tokens prefilled, the requests whose prefill ends in this
        step (their first token comes at its end) and whether the budget ran out with requests still waiting.

        The scan looks at up to ``SCAN_LIMIT`` waiting requests in order. Runs of requests that would be skipped
        (``_next_admissible``) are passed over in one move, after checking that none of them ends the scan on the
        free KV capacity, as looking at each in turn would."""
        prof = self.profile
        tr = self.trace
        adapters, in_tokens, out_tokens = tr.adapter, tr.input_tokens, tr.output_tokens
        res = self.result
        tiers, admitted_log = res.tier, res.admitted
        waiting, running = pod.waiting, pod.running
        running_adapters, waiting_adapters = pod.running_adapters, pod.waiting_adapters
        gpu, downloading, max_loras = pod.gpu, pod.downloading, pod.max_loras
        stall = 0.0
        for a in pod.prefetch_queue:
            stall += self._load(pod, a, now, demand=False)
        pod.prefetch_queue.clear()
        budget = prof.max_batched_tokens
        kv_free = prof.kv_capacity_tokens - pod.kv_reserved
        max_seqs = prof.max_num_seqs
        prefilling = pod.prefilling
        # vLLM applies the threshold only when more than one request is eligible (running or waiting)
        threshold = prof.long_prefill_token_threshold if len(running) + len(prefilling) + len(waiting) > 1 else 0
        first_tokens: list[int] = []
        prefill_tokens = 0
        for entry in prefilling:
            if budget <= 0:
                break
            chunk = min(entry[1], budget, threshold or budget)
            budget -= chunk
            prefill_tokens += chunk
            entry[1] -= chunk
            if not entry[1]:
                heapq.heappush(running, (pod.steps + out_tokens[entry[0]], entry[0]))
                first_tokens.append(entry[0])
        if first_tokens:
            prefilling[:] = [entry for entry in prefilling if entry[1]]
        admitted = False
        prefix = self.prefix
        pos = 0  # waiting[:pos] were looked at in this step and skipped
        left = SCAN_LIMIT  # how many more the scan may look at
        while budget > 0 and pos < len(waiting) and left and len(running) + len(prefilling) < max_seqs:
            stop = min(len(waiting), pos + left)
            jump = _next_admissible(pod, pos, stop, self._queue_key)
            if jump > pos:
                if self._scan_ends_on_kv(pod, pos, jump, kv_free, admitted or bool(running) or bool(prefilling)):
                    break
                left -= jump - pos
                pos = jump
                continue
            rid = waiting[pos]
            n_in = in_tokens[rid]
            need_kv = n_in + out_tokens[rid]
            cached = prefix.match(pod.index, rid) if prefix is not None else 0
            n_new = n_in - cached  # tokens to prefill
            if need_kv > kv_free and (admitted or running or prefilling):
                break
            left -= 1
            a = adapters[rid]
            if a not in gpu:
                if (a not in running_adapters and len(running_adapters) >= max_loras) or a in downloading:
                    pos += 1
                    continue
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
            queued = waiting_adapters[a]
            queued.popleft()  # its oldest: an adapter's earlier requests were admitted or it would be skipped too
            if not queued:
                del waiting_adapters[a]
            chunk = min(n_new, budget, threshold or budget)
            budget -= chunk
            kv_free -= need_kv
            pod.kv_reserved += need_kv
            prefill_tokens += chunk
            if prefix is not None:
                res.cached_tokens[rid] = cached
                prefix.admitted(pod.index, rid, pod.kv_reserved)
            admitted = True
            admitted_log.append(rid)
            running_adapters[a] = running_adapters.get(a, 0) + 1
            pod.last_use[a] = now
            pod.uses[a] = pod.uses.get(a, 0) + 1
            if chunk < n_new:
                prefilling.append([rid, n_new - chunk])
            else:
                heapq.heappush(running, (pod.steps + out_tokens[rid], rid))
                first_tokens.append(rid)
        return stall, prefill_tokens, first_tokens, budget <= 0 and pos < len(waiting)

    def _scan_ends_on_kv(self, pod: Pod, start: int, stop: int, kv_free: int, kv_binds: bool) -> bool:
        """Whether one of ``pod.waiting[start:stop]``, looked at in order, ends the scan on the free KV capacity
        (only when ``kv_binds``: something runs or was admitted)."""
        if not kv_binds or self._max_kv <= kv_free:
            return False
        in_tokens, out_tokens = self.trace.input_tokens, self.trace.output_tokens
        return any(in_tokens[rid] + out_tokens[rid] > kv_free for rid in islice(pod.waiting, start, stop))

    def _load(self, pod: Pod, a: int, now: float, demand: bool) -> float:
        """Bring ``a`` into a GPU slot of ``pod``, evicting if needed. Returns the stall in seconds, or -1 when the
        eviction policy refuses (nothing changes then)."""
        if a in pod.gpu:
            return 0.0
        from_cpu = a in pod.cpu
        if not from_cpu and a not in pod.disk:
            return -1.0
        gpu_victim = cpu_victim = -1
        if len(pod.gpu) >= pod.max_loras:
            v = self.eviction.victim(now, pod, Tier.GPU, pod.evictable(pod.gpu, a), a)
            if v is None:
                return -1.0
            gpu_victim = v
        if not from_cpu and len(pod.cpu) >= pod.max_cpu_loras:
            v = self.eviction.victim(now, pod, Tier.CPU, pod.evictable(pod.cpu, a), a)
            if v is None:
                return -1.0
            cpu_victim = v
        res = self.result
        if cpu_victim >= 0:
            pod.cpu.discard(cpu_victim)
            if cpu_victim in pod.gpu and cpu_victim != gpu_victim:
                self._evict_gpu(pod, cpu_victim, now)
        if gpu_victim >= 0:
            self._evict_gpu(pod, gpu_victim, now)
        pod.cpu.add(a)
        pod.gpu.add(a)
        pod.loaded_at[a] = now
        pod.residency_version += 1
        res.gpu_loads += 1
        if demand:
            res.demand_loads += 1
            res.load_times.append(now)
        evicted = pod.evicted_at.get(a)
        if evicted is not None and now - evicted <= THRASH_WINDOW_S:
            res.thrash_reloads += 1
        return self._load_s[a][1 if from_cpu else 2]

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

    # -- used by placements -----------------------------------------------------------------------------------
    def prefetch(self, pod: Pod, adapter: int) -> None:
        """Ask ``pod`` to bring ``adapter`` to a GPU slot at its next step (downloading it first if absent)."""
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
        pod.loaded_at.setdefault(adapter, self.now)
        pod.residency_version += 1

    def stage_disk(self, pod: Pod, adapter: int) -> None:
        """Ask ``pod`` to have ``adapter`` on local disk (fetched in the background)."""
        if adapter not in pod.disk:
            self._download(pod, adapter)


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
    before it would all be skipped. When the batch runs ``max_loras`` adapters (then they fill every GPU slot) only
    their requests can join; otherwise only requests of adapters still downloading are sure to be skipped."""
    waiting = pod.waiting_adapters
    if len(pod.running_adapters) >= pod.max_loras:
        heads = [order[queued[0]] for a in pod.gpu if (queued := waiting.get(a))]
        return bisect_left(pod.waiting, min(heads), start, stop, key=order.__getitem__) if heads else stop
    downloading = pod.downloading
    if len(waiting) <= len(downloading) and all(a in downloading for a in waiting):
        return stop
    return start
