"""The peers' routing in the simulator: their packaged picker configs run by the picker's ``Scheduler`` over what
they see, vLLM's metrics of each simulated pod, scraped every ``SimConfig.scrape_interval_s``.

A peer's endpoint picker (llm-d-router's ``metrics-data-source``, the picker's ``--data-source scrape``) knows a pod
only through its ``/metrics``: ``vllm:num_requests_waiting``, ``vllm:num_requests_running``,
``vllm:kv_cache_usage_perc``, the newest ``vllm:lora_requests_info`` (its running and waiting adapter lists, which
vLLM fills from one dict: both name every adapter with a request waiting or running there; ``max_lora``) and the
residency gauges of vLLM PR #54830 (adapters in GPU slots and in the host cache). ``VllmView`` turns a simulated pod
into that ``EndpointState``; ``PeerRouter`` keeps the latest scrape (``Scraper``: the simulator calls it at every
tick) and schedules each request on it with the peer config's ``Scheduler``, exactly the code the picker runs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Literal

import numpy as np

from loraplane.api import Tier
from loraplane.api.vllm_metrics import LoadedAdapter
from loraplane.picker.peers import PEER_PREFIX, peer_configs
from loraplane.picker.peers.dynamo import DynamoLoraFilter
from loraplane.picker.peers.latency import PredictedLatencyFilter
from loraplane.picker.plugins import SchedulingRequest
from loraplane.picker.prefix import PrefixCacheScorer
from loraplane.picker.scheduler import Decision, EndpointPickerConfig, Scheduler, SchedulingError
from loraplane.picker.scrape import scrape_offset
from loraplane.picker.snapshot import EndpointState, PoolSnapshot
from loraplane.sim.cluster import Pod, Refused
from loraplane.sim.prefix import PickerPrefixSignal
from loraplane.sim.profile import Profile
from loraplane.sim.trace import Trace

#: llm-d-router's ``--refresh-metrics-interval`` default: how often a peer's picker scrapes each pod's /metrics
SCRAPE_INTERVAL_S = 0.05
#: the baselines that are packaged peer configs (``picker/loraplane/picker/peers/<name>.yaml``), by policy name, in report order
PEER_POLICIES = tuple(n for n in ("least-request", "gie-default", "gie-lora-affinity", "gie-lora-filter",
                                  "llmd-load-state", "llmd-prefix", "llmd-predicted-latency", "dynamo-lora")
                      if n in peer_configs())
#: waiting requests whose prompts the TTFT oracle sums one by one; beyond them it counts the trace's mean prompt
ORACLE_EXACT_QUEUE = 256
#: the oracle's wait, in steps, for a GPU slot on a pod whose running adapters all have requests waiting
SLOT_STARVED_STEPS = 1000.0

#: how ``lora_requests_info``'s two lists are filled: ``vllm`` as vLLM does (both name every adapter with a request
#: waiting or running on the pod); ``split``: running adapters in one, waiting ones in the other (what the
#: simulator's hand-written routers read; kept to show the configs reproduce them)
LoraLists = Literal["vllm", "split"]

_GPU, _GPU_PINNED = LoadedAdapter(True), LoadedAdapter(True, True)
_CPU, _CPU_PINNED = LoadedAdapter(False), LoadedAdapter(False, True)


#: what a scrape keeps of one pod, to build its ``EndpointState`` when a decision reads it (``VllmView.state``):
#: (pod index, waiting, running, KV tokens reserved, adapters running, adapters waiting, residency version, loaded
#: adapters, adapters in GPU slots, GPU slots)
Scraped = tuple[int, int, int, int, tuple[int, ...], tuple[int, ...], int, dict[str, LoadedAdapter], int, int]


class VllmView:
    """A simulated pod as its vLLM /metrics describe it (``EndpointState`` with the peers' fields)."""

    def __init__(self, trace: Trace, profile: Profile, lora_lists: LoraLists = "vllm") -> None:
        self._names = [a.name for a in trace.adapters]
        self._kv = profile.kv_capacity_tokens
        self._split = lora_lists == "split"
        #: pod index -> (residency version, loaded adapters)
        self._loaded: dict[int, tuple[int, dict[str, LoadedAdapter]]] = {}
        #: pod index -> its last adapter lists (ids running, ids waiting, names running, names waiting)
        self._lists: dict[int, tuple[tuple[int, ...], tuple[int, ...], frozenset[str], frozenset[str]]] = {}

    def loaded(self, pod: Pod) -> dict[str, LoadedAdapter]:
        """``vllm:lora_adapter_loaded``: the pod's GPU slots and host cache (a superset of its GPU slots)."""
        cached = self._loaded.get(pod.index)
        if cached is not None and cached[0] == pod.residency_version:
            return cached[1]
        names, pinned = self._names, pod.pinned
        loaded = {names[a]: _CPU_PINNED if a in pinned else _CPU for a in pod.cpu}
        loaded.update({names[a]: _GPU_PINNED if a in pinned else _GPU for a in pod.gpu})
        self._loaded[pod.index] = (pod.residency_version, loaded)
        return loaded

    def scrape(self, pod: Pod) -> Scraped:
        """What a scrape of ``pod``'s /metrics reads now, kept cheaply (no names resolved yet)."""
        return (pod.index, len(pod.waiting), pod.num_running, pod.kv_reserved, tuple(pod.running_adapters),
                tuple(pod.waiting_adapters), pod.residency_version, self.loaded(pod), len(pod.gpu), pod.max_loras)

    def state(self, scraped: Scraped) -> EndpointState:
        """The ``EndpointState`` of a scrape."""
        index, waiting, running, kv, busy_ids, queued_ids, _version, loaded, gpu_loaded, slots = scraped
        lists = self._lists.get(index)
        if lists is None or lists[0] != busy_ids or lists[1] != queued_ids:
            names = self._names.__getitem__
            busy, queued = frozenset(map(names, busy_ids)), frozenset(map(names, queued_ids))
            if not self._split:
                busy = queued = busy | queued
            lists = self._lists[index] = (busy_ids, queued_ids, busy, queued)
        busy, queued = lists[2], lists[3]
        return EndpointState(
            name=f"pod-{index}",
            address=_address(index),
            queue_depth=waiting,
            running=running,
            kv_utilization=kv / self._kv,
            gpu_slots=slots,
            running_adapters=busy,
            waiting_adapters=queued,
            loaded_adapters=loaded,
            gpu_loaded=gpu_loaded,
        )

    def endpoint(self, pod: Pod) -> EndpointState:
        """What a scrape of ``pod``'s /metrics reads now."""
        return self.state(self.scrape(pod))


def _address(index: int) -> str:
    return f"10.0.0.{index + 1}:8000"


class TtftOracle:
    """The simulator's own TTFT model of request ``rid`` on each pod as it is now: the prompt tokens ahead of it (the
    whole waiting queue, ``fcfs``, and what chunked prefills have left) and its own, in steps of the pod's token
    budget less one token per decoding request, each step costing the batch's decode step and LoRA launch, plus the
    prefill itself and the load of its adapter from where the pod holds it (host copy, disk read, or a fetch then a
    disk read). What the peer's predictor gets in the simulator: it knows each pod's exact queue and the adapter's
    tier, which a learned predictor on scraped metrics does not."""

    def __init__(self, trace: Trace, profile: Profile) -> None:
        self._input = trace.input_tokens
        self._adapter = trace.adapter
        self._mean = sum(trace.input_tokens) / len(trace) if len(trace) else 0.0
        p = profile
        self._budget = p.max_batched_tokens
        self._prefill = p.prefill_per_token_ms / 1e3
        self._step = (p.step_overhead_ms + p.decode_base_ms) / 1e3
        self._per_seq = p.decode_per_seq_ms / 1e3
        self._lora = (p.lora_base_ms, p.lora_per_adapter_ms)
        self._loads = {tier: [p.load_ms(tier, a.nbytes) / 1e3 for a in trace.adapters] for tier in (Tier.CPU, Tier.DISK)}
        self._fetch = [p.download_ms(a.nbytes) / 1e3 for a in trace.adapters]

    def predict(self, rid: int, pods: list[Pod]) -> np.ndarray:
        """Seconds to the first token of ``rid`` on each pod."""
        adapter, own = self._adapter[rid], self._input[rid]
        inputs = self._input
        out = np.empty(len(pods))
        for i, pod in enumerate(pods):
            waiting = pod.waiting
            ahead: float
            if len(waiting) <= ORACLE_EXACT_QUEUE:
                ahead = sum(inputs[r] for r in waiting)
            else:
                ahead = sum(inputs[waiting[j]] for j in range(ORACLE_EXACT_QUEUE))
                ahead += (len(waiting) - ORACLE_EXACT_QUEUE) * self._mean
            ahead += sum(left for _, left in pod.prefilling)
            tokens = ahead + own
            decoding = len(pod.running)
            steps = math.ceil(tokens / max(1, self._budget - decoding))
            distinct = len(pod.running_adapters) + (adapter not in pod.running_adapters)
            step = self._step + self._per_seq * (decoding + len(pod.prefilling) + 1) + (
                self._lora[0] + self._lora[1] * distinct) / 1e3
            tier = pod.tier_of(adapter)
            load = 0.0 if tier is Tier.GPU else self._loads[Tier.CPU][adapter] if tier is Tier.CPU else (
                self._loads[Tier.DISK][adapter] + (self._fetch[adapter] if tier is not Tier.DISK else 0.0))
            out[i] = steps * step + tokens * self._prefill + load + self._slot_wait(pod, adapter) * step
        return out

    def _slot_wait(self, pod: Pod, adapter: int) -> float:
        """Steps until a GPU slot frees for ``adapter`` where the batch already runs ``max_loras`` other adapters
        (vLLM's scheduler skips its requests until then): the soonest a running adapter with nothing waiting
        drains; ``SLOT_STARVED_STEPS`` where every one of them has requests waiting (it may never drain)."""
        running = pod.running_adapters
        if adapter in running or len(running) < pod.max_loras:
            return 0.0
        last: dict[int, int] = {}
        adapters = self._adapter
        for finish, rid in pod.running:
            a = adapters[rid]
            if finish > last.get(a, 0):
                last[a] = finish
        drains = [f for a, f in last.items() if a not in pod.waiting_adapters]
        return float(min(drains) - pod.steps) if drains else SLOT_STARVED_STEPS


class PeerRouter:
    """A peer's picker config, run by the picker's ``Scheduler`` over the pods' scraped vLLM metrics.

    Requests carry their adapter's name only (priority 0, no digest: the peers route model names as given and refuse
    nothing with their flow control off). With ``period_s`` 0 every decision reads the pods as they are (a scrape per
    request). A scrape keeps each pod's figures; the first decision after it updates the snapshot's endpoints whose
    figures changed (``PoolSnapshot.update_endpoint``)."""

    def __init__(self, name: str, seed: int, trace: Trace, profile: Profile, scheduler: Scheduler,
                 scrape_interval_s: float = SCRAPE_INTERVAL_S, lora_lists: LoraLists = "vllm") -> None:
        self.name = name
        self.scheduler = scheduler
        self.period_s = scrape_interval_s
        self.view = VllmView(trace, profile, lora_lists)
        self._rng = np.random.default_rng(seed)
        self._requests = [SchedulingRequest(served_name=a.name) for a in trace.adapters]
        #: the plugins that ask the simulator: Dynamo's allocator reads its clock, predicted-latency routing its TTFT
        #: model (and the tenant's priority, which its admitter reads)
        self._rid = 0
        self._pods: list[Pod] = []
        self._by_priority: dict[tuple[int, int], SchedulingRequest] | None = None
        self._priority = [trace.tenants[t].priority for t in trace.tenant] if len(trace) else []
        for step in scheduler.filters:
            if isinstance(step.run, DynamoLoraFilter):
                step.run.clock = lambda: self._now
            elif isinstance(step.run, PredictedLatencyFilter):
                step.run.predictor = self._oracle_predictor(TtftOracle(trace, profile))
                self._by_priority = {}
        self._scraped: list[Scraped] | None = None
        #: what the snapshot shows of each pod, and the pods scraped since it was last brought up to date
        self._applied: list[Scraped] = []
        self._dirty: set[int] = set()
        self._snapshot: PoolSnapshot | None = None
        self._now = 0.0
        scorer = scheduler.preparer(PrefixCacheScorer)
        self._prefix = (PickerPrefixSignal(scorer, trace, lambda: self._now)
                        if scorer is not None and trace.has_prefixes else None)  # fmt: skip
        self._last: SchedulingRequest | None = None
        #: scrapes taken (for the report and the tests)
        self.scrapes = 0

    def _oracle_predictor(self, oracle: TtftOracle) -> Callable[[SchedulingRequest, PoolSnapshot], np.ndarray]:
        """``oracle``'s TTFTs of the request being decided on the live pods."""
        return lambda _request, _pool: oracle.predict(self._rid, self._pods)

    def offset_s(self, index: int) -> float:
        """Where in each scrape interval pod ``index`` is scraped: the picker's offset for its address."""
        return scrape_offset(_address(index), self.period_s)

    def scrape(self, now: float, pods: list[Pod], due: Sequence[int] | None = None) -> None:
        """Read the metrics of the pods ``due`` (None: every pod); the simulator calls this at each pod's scrape
        tick."""
        scrape = self.view.scrape
        if due is None or self._scraped is None or len(self._scraped) != len(pods):
            self._scraped = [scrape(p) for p in pods]
            self._dirty.update(range(len(pods)))
        else:
            scraped = self._scraped
            for index in due:
                scraped[index] = scrape(pods[index])
            self._dirty.update(due)
        self.scrapes += 1

    def snapshot(self) -> PoolSnapshot:
        """The pool as each pod's latest scrape shows it: the endpoints scraped since the last call and changed are
        updated in place (O(their number), not O(pods))."""
        scraped, snapshot, state = self._scraped, self._snapshot, self.view.state
        assert scraped is not None
        if snapshot is None or snapshot.size != len(scraped):
            snapshot = self._snapshot = PoolSnapshot([state(s) for s in scraped])
            self._applied = list(scraped)
        elif self._dirty:
            applied = self._applied
            changed = [(i, state(scraped[i])) for i in self._dirty if scraped[i] != applied[i]]
            for i in self._dirty:
                applied[i] = scraped[i]
            if changed:
                snapshot.update_endpoints(changed)
        self._dirty.clear()
        return snapshot

    def decide(self, now: float, rid: int, trace: Trace, pods: list[Pod]) -> Decision:
        """The config's decision for request ``rid`` on the latest scrape; the picker's ``SchedulingError``s."""
        if self.period_s <= 0 or self._scraped is None:
            self.scrape(now, pods)
        snapshot = self.snapshot()
        request = self._requests[trace.adapter[rid]]
        self._now, self._rid, self._pods = now, rid, pods
        if self._by_priority is not None and self._priority[rid]:
            key = (trace.adapter[rid], self._priority[rid])
            request = self._by_priority.get(key) or self._by_priority.setdefault(
                key, replace(request, priority=self._priority[rid]))
        if self._prefix is not None:
            request = replace(request, prefix=self._prefix.request(rid))
        self._last = request
        return self.scheduler.schedule(request, snapshot, self._rng)

    def routed(self, index: int) -> None:
        """The last decided request went to pod ``index`` (the approximate prefix index learns it)."""
        prefix = self._last.prefix if self._last is not None else None
        if self._prefix is not None and prefix is not None:
            self._prefix.routed(prefix, _address(index))

    def pick(self, now: float, rid: int, trace: Trace, pods: list[Pod]) -> int:
        """The config's primary endpoint for request ``rid``; refusals as ``Refused``."""
        try:
            chosen = self.decide(now, rid, trace, pods).indices[0]
        except SchedulingError as exc:
            raise Refused(exc.status, exc.reason) from exc
        self.routed(chosen)
        return chosen


def peer_router(name: str, seed: int, trace: Trace, profile: Profile, scrape_interval_s: float = SCRAPE_INTERVAL_S,
                config: EndpointPickerConfig | None = None, lora_lists: LoraLists = "vllm") -> PeerRouter:
    """The peer policy ``name`` (a packaged peer config, or ``config``) as a simulator router."""
    chosen = config if config is not None else EndpointPickerConfig.load(PEER_PREFIX + name)
    return PeerRouter(name, seed, trace, profile, Scheduler(chosen), scrape_interval_s, lora_lists)
