"""The emulated engine core: vLLM v1's scheduler, KV blocks and LoRA caches, with time charged from a profile.

Each step follows ``vllm.v1.core.sched.scheduler.Scheduler.schedule``: running requests take their tokens of the
step's budget first (``max_num_batched_tokens``; a decode takes one, a chunked prefill its next chunk, at most
``long_prefill_token_threshold`` when more than one request is eligible), a running request that cannot get a KV
block preempts (recompute) the most recently admitted running request -- under ``priority`` the one with the
highest (priority, arrival) -- until it fits or has preempted itself; then, unless something was preempted,
waiting requests are admitted in queue order, skipping one whose adapter would make more than ``max_loras``
distinct adapters, until ``max_num_seqs`` requests run, the budget is spent or a prompt does not fit the free KV
blocks. The step then brings every adapter of the batch into a GPU slot (``lora_cache``).

Step time (ms) = ``profile.decode_step_ms(batch, distinct adapters)`` + ``prefill_per_token_ms`` x prefill tokens
+ the adapter loads of the step + the ``/v1/load_lora_adapter`` loads since the last step. A request's first token
comes at the end of the step that computed the last of its prompt; then one per step. A request reaches the
scheduler ``profile.request_overhead_ms`` after it is added (vLLM's API server and the hand-off to its engine core).

The engine never runs step by step: after a step, the steps that follow are identical until something changes the
batch (a finish, an arrival, a load, an abort, a block boundary with no free block), so it plans a *run* of them
and commits their effects when asked (``advance``): the work is per event, not per token. It keeps no clock of its
own; callers pass ``now`` (``loop.EngineLoop`` does, from an injected clock).
"""

from __future__ import annotations

import math
from bisect import insort
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

from loraplane.api import Tier
from loraplane.emulator.kv import Block, BlockPool, chain_hashes
from loraplane.emulator.lora_cache import LoadCost, Lora, WorkerLoraCache
from loraplane.emulator.metrics import EngineStats
from loraplane.emulator.tokens import OutputTokens
from loraplane.sim.profile import Profile


class Status(Enum):
    """Where a request is."""

    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass(frozen=True)
class EngineConfig:
    """vLLM's scheduler and cache settings."""

    max_loras: int = 1
    max_cpu_loras: int = 1
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 8192
    block_size: int = 16
    prefix_caching: bool = True
    #: ``--scheduling-policy priority`` (else ``fcfs``)
    priority_policy: bool = False
    long_prefill_token_threshold: int = 0
    #: seconds between the coalesced token deliveries of streaming requests (0: every step)
    stream_interval: float = 0.25


@dataclass(eq=False)
class Request:
    """One generation request: its prompt ids, output length and adapter; the engine keeps its progress here."""

    request_id: str
    prompt: list[int]
    max_tokens: int
    lora: Lora | None
    #: what the output ids are computed from (the adapter's digest or the base model's served name)
    identity: str
    priority: int = 0
    stream: bool = False
    #: called when ``delivered`` grows (streaming) or the request ends
    on_update: Callable[[], None] | None = None
    #: when the scheduler got it (``received`` + the profile's ``request_overhead_ms``)
    arrival: float = 0.0
    #: when ``add_request`` was called (the API server received it)
    received: float = 0.0
    seq: int = 0
    status: Status = Status.WAITING
    output: int = 0
    computed: int = 0
    blocks: list[Block] = field(default_factory=list)
    #: hashes of the request's full blocks, as far as computed (prefix caching)
    hashes: list[int] = field(default_factory=list)
    #: full blocks already entered into the prefix cache
    cached_blocks: int = 0
    #: prompt tokens its first admission found in the prefix cache
    cached_tokens: int = 0
    preemptions: int = 0
    #: admitted and not yet sampled since (its scheduled tokens are prefill tokens)
    in_prefill: bool = False
    first_token_at: float | None = None
    last_token_at: float = 0.0
    finished_at: float | None = None
    finish_reason: str | None = None
    #: output tokens the server may send
    delivered: int = 0

    def __post_init__(self) -> None:
        self.outputs = OutputTokens(self.identity, self.prompt)

    @property
    def num_tokens(self) -> int:
        """Prompt plus sampled tokens."""
        return len(self.prompt) + self.output

    @property
    def finished(self) -> bool:
        """Done (finished or aborted)."""
        return self.status is Status.FINISHED

    def tokens(self, stop: int) -> list[int]:
        """The first ``stop`` ids of prompt + output."""
        prompt = self.prompt
        return prompt[:stop] if stop <= len(prompt) else prompt + self.outputs.first(stop - len(prompt))

    def _notify(self) -> None:
        if self.on_update is not None:
            self.on_update()


@dataclass(eq=False)
class LoadTicket:
    """A ``/v1/load_lora_adapter`` call the engine serves between steps; ``slot_error``: vLLM's copy into the slot
    fails after the load (the copy stays in both caches)."""

    lora: Lora
    slot_error: str | None = None
    on_done: Callable[[], None] | None = None
    #: engine time the load ends (its reply goes out then)
    done_at: float | None = None
    replied: bool = False


@dataclass(eq=False)
class _Run:
    """A first step (which may admit, prefill and load) followed by ``steps - 1`` identical decode steps."""

    first_end: float
    step_s: float
    steps: int
    batch: list[tuple[Request, int]]
    tickets: list[LoadTicket]
    #: adapters read from disk again on every step (``load_inplace``)
    reloads: list[Lora]
    committed: int = 0
    last_flush: float = 0.0

    @property
    def end(self) -> float:
        return self.first_end + (self.steps - 1) * self.step_s

    def step_end(self, step: int) -> float:
        """When step ``step`` (1-based) ends."""
        return self.first_end + (step - 1) * self.step_s

    def steps_done_by(self, now: float) -> int:
        """Steps ended at ``now``."""
        if now >= self.end:
            return self.steps
        if now < self.first_end:
            return 0
        return min(self.steps, 1 + int((now - self.first_end) / self.step_s + 1e-9)) if self.step_s > 0 else 1

    @property
    def streams(self) -> bool:
        return any(req.stream for req, _ in self.batch)


@dataclass
class _Plan:
    batch: list[tuple[Request, int]]
    #: the steps after this one repeat it while nothing else changes
    repeatable: bool


class Engine:
    """One engine core: call ``add_request``, ``abort``, ``load`` and ``advance`` with the current time."""

    def __init__(self, config: EngineConfig, profile: Profile) -> None:
        self.config = config
        self.profile = profile
        self.cache = WorkerLoraCache(config.max_loras, config.max_cpu_loras, profile)
        self.pool = BlockPool(profile.kv_capacity_tokens // config.block_size, config.prefix_caching)
        self.stats = EngineStats()
        #: adapters the API server serves, by name (vLLM's ``OpenAIServingModels.lora_requests``)
        self.registered: dict[str, Lora] = {}
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self._run: _Run | None = None
        self._loads: list[LoadTicket] = []
        self._aborts: list[Request] = []
        #: requests added but not yet at the scheduler (``request_overhead_ms``), by the time they reach it
        self._incoming: deque[tuple[float, Request]] = deque()
        self._overhead_s = profile.request_overhead_ms / 1e3
        self._arrivals = 0
        #: unfinished requests per adapter name, in the order the names got their first one (vLLM's
        #: ``LoRARequestStates``), and the ``vllm:lora_requests_info`` series: label value -> engine time last set
        self._lora_counts: dict[str, int] = {}
        self._lora_series: dict[str, float] = {}
        self._combo_since = 0.0
        #: the end of the last step committed, and of the one before it
        self._last_step_end = self._previous_step_end = -math.inf

    # --- inputs ---------------------------------------------------------------------------------------------------
    def add_request(self, req: Request, now: float) -> None:
        """``req`` is received at ``now``; it reaches the scheduler ``request_overhead_ms`` later and waits there for
        the next step boundary."""
        self.advance(now)
        req.received = now
        if self._overhead_s > 0:
            self._incoming.append((now + self._overhead_s, req))
            return
        self._accept(req, now)

    def _accept(self, req: Request, now: float) -> None:
        """``req`` reaches the scheduler at ``now``."""
        req.arrival = req.last_token_at = now
        req.seq = self._arrivals
        self._arrivals += 1
        self._enqueue(req)
        if req.lora is not None:
            self._count_lora(req.lora.name, +1, now)
        self._wake(now)

    def abort(self, req: Request, now: float) -> None:
        """The client went away: a waiting request leaves now, a running one at the next step boundary."""
        self.advance(now)
        if req.finished:
            return
        incoming = next((item for item in self._incoming if item[1] is req), None)
        if incoming is not None:  # never reached the scheduler: nothing of it is counted there
            self._incoming.remove(incoming)
            req.status, req.finish_reason, req.finished_at = Status.FINISHED, "abort", now
            self.stats.finished["abort"] += 1
            req._notify()
        elif req in self.waiting:
            self.waiting.remove(req)
            self._end(req, "abort", now)
        elif req not in self._aborts:
            self._aborts.append(req)
            self._wake(now)

    def load(self, ticket: LoadTicket, now: float) -> None:
        """A ``/v1/load_lora_adapter`` call: served between steps, stalling the engine for its load."""
        self.advance(now)
        self._loads.append(ticket)
        self._wake(now)

    # --- time -----------------------------------------------------------------------------------------------------
    def next_due(self) -> float:
        """When ``advance`` has something to do next (inf when idle): the end of the current run, a load's reply,
        or tokens streaming requests are waiting for."""
        run = self._run
        arriving = self._incoming[0][0] if self._incoming else math.inf
        if run is None:
            return arriving
        due = min(run.end, arriving)
        for ticket in run.tickets:
            if not ticket.replied and ticket.done_at is not None:
                due = min(due, ticket.done_at)
        if run.streams and run.committed < run.steps:
            if run.committed == 0:
                due = min(due, run.first_end)
            else:
                interval = self.config.stream_interval
                due = min(due, max(run.last_flush + interval, run.step_end(run.committed + 1)))
        return due

    def advance(self, now: float) -> None:
        """Commit everything that happened by ``now``: steps ended, loads done, requests finished, requests that
        reached the scheduler."""
        while self._incoming and self._incoming[0][0] <= now:
            at, req = self._incoming.popleft()
            self._catch_up(at)
            self._accept(req, at)
        self._catch_up(now)

    def _catch_up(self, now: float) -> None:
        while self._run is not None:
            run = self._run
            self._commit(run, now)
            if now < run.end:
                return
            self._finish_run(run)
            self._run = None
            self._begin(run.end)

    def _wake(self, now: float) -> None:
        """Something the engine must look at arrived: start now when idle, else end the run at its next step."""
        run = self._run
        if run is None:
            self._begin(now)
            return
        if now < run.first_end:
            run.steps = 1
        elif run.step_s > 0:
            run.steps = min(run.steps, max(run.committed, 1 + math.ceil((now - run.first_end) / run.step_s - 1e-9)))
        self.advance(now)

    # --- steps ----------------------------------------------------------------------------------------------------
    def _begin(self, now: float) -> None:
        """A step boundary: drop aborted requests, serve the loads asked for, schedule the next run."""
        for req in self._aborts:
            if req in self.running:
                self.running.remove(req)
                self._release(req)
            elif req in self.waiting:
                self.waiting.remove(req)
            if not req.finished:
                self._end(req, "abort", now)
        self._aborts.clear()
        tickets, self._loads = self._loads, []
        api_ms = 0.0
        for ticket in tickets:
            api_ms += self._bring_in(ticket.lora, api=True)
            ticket.done_at = now + api_ms / 1e3
        plan = self._schedule(now)
        if not plan.batch and not tickets:
            return
        batch = plan.batch
        loras = list(dict.fromkeys(req.lora for req, _ in batch if req.lora is not None))
        load_ms = sum(self._bring_in(lora) for lora in loras)
        reloads = [lora for lora in loras if lora.load_inplace]
        decode_ms = self.profile.decode_step_ms(len(batch), len(loras)) if batch else 0.0
        prefill = sum(n for req, n in batch if req.in_prefill)
        first_ms = api_ms + decode_ms + self.profile.prefill_per_token_ms * prefill + load_ms
        repeat_ms = decode_ms + sum(self.profile.load_ms(Tier.DISK, lora.nbytes) for lora in reloads)
        run = _Run(first_end=now + first_ms / 1e3, step_s=repeat_ms / 1e3, steps=1, batch=batch,
                   tickets=tickets, reloads=reloads)
        if plan.repeatable and batch:
            run.steps = self._repeatable_steps(batch)
        self._run = run

    def _schedule(self, now: float) -> _Plan:
        """vLLM's ``Scheduler.schedule`` for one step (allocations, preemptions and admissions happen here)."""
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        threshold = cfg.long_prefill_token_threshold if len(self.running) + len(self.waiting) > 1 else 0
        running = self.running
        scheduled: dict[Request, int] = {}
        preempted = False
        index = 0
        while index < len(running) and budget > 0:
            req = running[index]
            n = req.num_tokens - req.computed
            if 0 < threshold < n:
                n = threshold
            n = min(n, budget)
            while not self._grow(req, n):
                victim = max(running, key=_priority_key) if cfg.priority_policy else running[-1]
                where = running.index(victim)
                del running[where]
                if where < index:
                    index -= 1
                budget += scheduled.pop(victim, 0)
                self._preempt(victim, now)
                preempted = True
                if victim is req:
                    break
            else:
                scheduled[req] = n
                budget -= n
                index += 1
                continue
            break
        repeatable = not preempted and index == len(running)
        if not preempted:
            loras = {req.lora.int_id for req in scheduled if req.lora is not None}
            admitted: list[Request] = []
            for req in self.waiting:
                if budget <= 0:
                    repeatable = False
                    break
                if len(running) >= cfg.max_num_seqs:
                    break
                if req.lora is not None and len(loras) == cfg.max_loras and req.lora.int_id not in loras:
                    continue
                hit = self._prefix_hit(req)
                n = req.num_tokens - len(hit) * cfg.block_size
                if 0 < threshold < n:
                    n = threshold
                n = min(n, budget)
                if not self._admit_blocks(req, hit, n):
                    break
                if cfg.prefix_caching:
                    self.stats.prefix_queries += req.num_tokens
                    self.stats.prefix_hits += len(hit) * cfg.block_size
                if req.status is Status.WAITING:
                    req.cached_tokens = len(hit) * cfg.block_size
                    self.stats.queue.observe(now - req.arrival)
                req.status = Status.RUNNING
                req.in_prefill = True
                running.append(req)
                admitted.append(req)
                if req.lora is not None:
                    loras.add(req.lora.int_id)
                scheduled[req] = n
                budget -= n
            if admitted:
                taken = set(admitted)
                self.waiting = [req for req in self.waiting if req not in taken]
        return _Plan(list(scheduled.items()), repeatable)

    def _repeatable_steps(self, batch: list[tuple[Request, int]]) -> int:
        """How many steps (this one included) run before the batch changes: the first finish, or the step before
        one whose new KV blocks are not all free."""
        bs = self.config.block_size
        after: list[int] = []
        steps = math.inf
        for req, n in batch:
            computed = req.computed + n
            if computed < req.num_tokens:
                return 1  # a chunked prefill goes on
            left = req.max_tokens - req.output - 1
            if left <= 0:
                return 1
            steps = min(steps, 1 + left)
            after.append(computed)
        if len(batch) > self.config.max_num_batched_tokens:
            return 1
        limit = int(steps)
        free = self.pool.num_free

        def blocks_needed(step: int) -> int:  # new blocks the decodes of steps 2..step take
            return sum((c + step - 2) // bs - (c - 1) // bs for c in after) if step >= 2 else 0

        low, high = 1, limit
        while low < high:  # the last step whose blocks fit
            mid = (low + high + 1) // 2
            if blocks_needed(mid) <= free:
                low = mid
            else:
                high = mid - 1
        return low

    # --- committing -----------------------------------------------------------------------------------------------
    def _commit(self, run: _Run, now: float) -> None:
        for ticket in run.tickets:
            if not ticket.replied and ticket.done_at is not None and ticket.done_at <= now:
                ticket.replied = True
                if ticket.on_done is not None:
                    ticket.on_done()
        done = run.steps_done_by(now)
        if done == 0 or done <= run.committed:
            return
        if run.committed == 0:
            self._commit_first(run)
            run.committed = 1
        if done > run.committed:
            self._commit_repeats(run, done - run.committed, run.step_end(done))
            run.committed = done
        run.last_flush = now
        self._previous_step_end = run.step_end(done - 1) if done > 1 else self._last_step_end
        self._last_step_end = run.step_end(done)

    def _commit_first(self, run: _Run) -> None:
        at = run.first_end
        for req, n in run.batch:
            req.computed += n
            if req.computed < req.num_tokens:
                continue
            req.output += 1
            req.in_prefill = False
            self.stats.generation_tokens += 1
            if req.first_token_at is None:
                req.first_token_at = at
                self.stats.ttft.observe(at - req.arrival)
                self.stats.prompt_tokens += len(req.prompt)
            else:
                self.stats.itl.observe(at - req.last_token_at)
            req.last_token_at = at
            if req.stream:
                req.delivered = req.output
                req._notify()

    def _commit_repeats(self, run: _Run, steps: int, at: float) -> None:
        bs = self.config.block_size
        growth: list[tuple[int, int, Request]] = []
        for order, (req, _) in enumerate(run.batch):
            first = (-req.computed) % bs  # offset of the first step starting a new block
            growth += [(offset, order, req) for offset in range(first, steps, bs)]
        growth.sort(key=lambda g: (g[0], g[1]))
        for _, _, req in growth:
            req.blocks += self.pool.allocate(1)
        for req, _ in run.batch:
            req.computed += steps
            req.output += steps
            self._cache_blocks(req, req.computed)
            self.stats.itl.observe(run.step_s, steps)
            req.last_token_at = at
            if req.stream:
                req.delivered = req.output
                req._notify()
        self.stats.generation_tokens += steps * len(run.batch)
        for lora in run.reloads:
            self.stats.lora_loads["disk"] += steps
            self.stats.lora_load.observe(self.profile.load_ms(Tier.DISK, lora.nbytes) / 1e3, steps)

    def _finish_run(self, run: _Run) -> None:
        for req, _ in run.batch:
            if req.status is Status.RUNNING and req.output >= req.max_tokens:
                self.running.remove(req)
                self._release(req)
                self._end(req, "length", run.end)

    def _end(self, req: Request, reason: str, now: float) -> None:
        req.status = Status.FINISHED
        req.finish_reason = reason
        req.finished_at = now
        req.delivered = req.output
        self.stats.finished[reason] += 1
        if reason != "abort":
            self.stats.e2e.observe(now - req.arrival)
        if req.lora is not None:
            self._count_lora(req.lora.name, -1, now)
        req._notify()

    # --- KV blocks ------------------------------------------------------------------------------------------------
    def _grow(self, req: Request, n: int) -> bool:
        """Blocks for ``req``'s next ``n`` tokens (False when too few are free)."""
        need = -(-(req.computed + n) // self.config.block_size) - len(req.blocks)
        if need > self.pool.num_free:
            return False
        if need > 0:
            req.blocks += self.pool.allocate(need)
        self._cache_blocks(req, req.computed + n)
        return True

    def _prefix_hit(self, req: Request) -> list[Block]:
        """The cached blocks of the longest prefix of ``req`` (at most its tokens but the last)."""
        if not self.config.prefix_caching:
            return []
        return self.pool.longest_hit(self._hashes(req, (req.num_tokens - 1) // self.config.block_size))

    def _admit_blocks(self, req: Request, hit: list[Block], n: int) -> bool:
        """vLLM's admission: the whole prompt must fit (``scheduler_reserve_full_isl``); then the prefix hit is
        taken and blocks for the first ``n`` new tokens allocated."""
        bs = self.config.block_size
        total = -(-min(req.num_tokens, self.config.max_model_len) // bs)
        if total - len(hit) + self.pool.evictable(hit) > self.pool.num_free:
            return False
        self.pool.touch(hit)
        req.blocks = list(hit)
        req.cached_blocks = len(hit)
        req.computed = len(hit) * bs
        return self._grow(req, n)

    def _hashes(self, req: Request, count: int) -> list[int]:
        have = len(req.hashes)
        if count > have:
            bs = self.config.block_size
            parent = req.hashes[-1] if req.hashes else None
            name = req.lora.name if req.lora is not None else None
            req.hashes += chain_hashes(parent, req.tokens(count * bs), bs, name, have, count)
        return req.hashes[:count]

    def _cache_blocks(self, req: Request, tokens: int) -> None:
        """Enter ``req``'s blocks that ``tokens`` computed tokens fill into the prefix cache."""
        if not self.config.prefix_caching:
            return
        full = min(tokens, req.num_tokens) // self.config.block_size
        if full > req.cached_blocks:
            for block, block_hash in zip(req.blocks[req.cached_blocks:full],
                                         self._hashes(req, full)[req.cached_blocks:], strict=True):
                self.pool.cache(block, block_hash)
            req.cached_blocks = full

    def _release(self, req: Request) -> None:
        self.pool.free(req.blocks)
        req.blocks = []
        req.cached_blocks = 0

    def _preempt(self, req: Request, now: float) -> None:
        """Recompute preemption: its blocks go, it waits at the front of the queue and prefills again."""
        self._release(req)
        req.status = Status.PREEMPTED
        req.computed = 0
        req.preemptions += 1
        self.stats.preemptions += 1
        if self.config.priority_policy:
            insort(self.waiting, req, key=_priority_key)
        else:
            self.waiting.insert(0, req)

    def _enqueue(self, req: Request) -> None:
        if self.config.priority_policy:
            insort(self.waiting, req, key=_priority_key)
        else:
            self.waiting.append(req)

    # --- adapters -------------------------------------------------------------------------------------------------
    def _bring_in(self, lora: Lora, api: bool = False) -> float:
        """Load and activate ``lora`` as the worker does (``api``: for ``/v1/load_lora_adapter``, not a request);
        the milliseconds it stalls the step."""
        cache = self.cache
        before = None if lora.int_id in cache.active else list(cache.active)
        cost: LoadCost | None = cache.bring_in(lora)
        if cost is None:
            return 0.0
        gone = [int_id for int_id in before or () if int_id not in cache.active]
        if gone:  # vLLM's LRU pushes out the least recently touched copy, its requests running or not
            running = {req.lora.int_id for req in self.running if req.lora is not None}
            self.stats.running_evictions += sum(int_id in running for int_id in gone)
        self.stats.lora_loads["disk" if cost.tier is Tier.DISK else "cpu"] += 1
        self.stats.lora_api_loads += api
        self.stats.lora_load.observe(cost.ms / 1e3)
        return cost.ms

    def _count_lora(self, name: str, delta: int, now: float) -> None:
        before = ",".join(self._lora_counts)
        count = self._lora_counts.get(name, 0) + delta
        if count:
            self._lora_counts[name] = count
        else:
            self._lora_counts.pop(name, None)
        if ",".join(self._lora_counts) != before:
            # the old list was last recorded by the last step that ended before now
            stamp = self._last_step_end if self._last_step_end < now else self._previous_step_end
            if stamp >= self._combo_since:
                self._lora_series[before] = stamp
            self._combo_since = now

    def lora_requests_series(self) -> dict[str, float]:
        """``vllm:lora_requests_info``: each adapter-list label value seen, and the engine time of the last step
        that recorded it (vLLM records the current list at every step)."""
        series = dict(self._lora_series)
        if self._last_step_end >= self._combo_since:
            series[",".join(self._lora_counts)] = self._last_step_end
        return series


def _priority_key(req: Request) -> tuple[int, float, int]:
    return req.priority, req.arrival, req.seq
