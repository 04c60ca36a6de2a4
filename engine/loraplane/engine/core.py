"""The engine: continuous batching over a KV cache, adapter loading through the tiers, sampling.

One background task runs steps. A step admits waiting requests whose adapter is in a slot (or can be activated
into one), prefills them, and decodes one token for every running request, all in one flat forward pass with one
LoRA plan. A request whose adapter is on disk waits while a loader reads and parses it off the event loop; the
scheduler skips it (and any request whose adapter cannot get a slot) and admits later ones, so a step never holds
more distinct adapters than slots.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import random
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Hashable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import cast

import torch

from loraplane.api import Tier
from loraplane.engine.adapters import (
    AdapterFiles,
    FileDigests,
    HostBuffers,
    ParsedAdapters,
    confine,
    host_copy,
    parse_adapter,
)
from loraplane.engine.merging import MergeConfig, MergePolicy, available_memory
from loraplane.engine.metrics import EngineMetrics
from loraplane.engine.model import KVCache, LlamaModel, SequenceChunk
from loraplane.engine.tiers import AdapterState, AdapterTiers
from loraplane.engine.tokenizer import Tokenizer
from loraplane.kernels import BatchPlan, BatchPlanner, DecodeGroups
from loraplane.kernels.peft import PeftAdapter

log = logging.getLogger(__name__)


class RequestError(ValueError):
    """A request the engine refuses (the HTTP layer answers 400)."""


class AdapterBusyError(RuntimeError):
    """A tier change refused because the adapter is pinned or serving requests (the HTTP layer answers 409)."""


@dataclass(frozen=True)
class SamplingParams:
    """OpenAI/vLLM sampling fields the engine implements."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    #: vLLM's request priority: with the ``priority`` scheduling policy a waiting request of a lower value is
    #: admitted first (ties: arrival order); must be 0 under ``fcfs``
    priority: int = 0


@dataclass(frozen=True)
class TokenEvent:
    """One generated token (``token_id`` None on the final event), the new text, and why it ended."""

    token_id: int | None
    text: str
    finish_reason: str | None = None


@dataclass(eq=False)
class Request:
    """One generation in the engine."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    adapter: AdapterState | None
    arrival: float
    arrival_tier: Tier | None
    generator: torch.Generator | None
    events: asyncio.Queue[TokenEvent] = field(default_factory=asyncio.Queue)
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    kv_row: int | None = None
    finished: bool = False

    @property
    def context_len(self) -> int:
        """Tokens in the KV cache once this step's token is written."""
        return len(self.prompt_ids) + len(self.output_ids)


@dataclass
class EngineLimits:
    """Scheduler limits."""

    max_num_seqs: int = 16
    max_model_len: int = 512
    max_num_batched_tokens: int = 2048
    #: "fcfs" (arrival order) or "priority" (vLLM's ``--scheduling-policy``: lower ``priority`` values first)
    scheduling_policy: str = "fcfs"


def _rank_of(adapter: Hashable) -> int:
    """An adapter's rank for the merge policy's verdicts (0 when unknown)."""
    weights = adapter.weights if isinstance(adapter, AdapterState) else None
    return weights.max_rank if weights is not None else 0


def _slot_of(request: Request) -> int:
    """The device slot a scheduled request's rows use (-1: no adapter)."""
    if request.adapter is None:
        return -1
    assert request.adapter.slot is not None, "scheduled request without a slot"
    return request.adapter.slot


class Engine:
    """Owns the model, the adapter tiers, the KV cache and the request queues."""

    def __init__(
        self,
        model: LlamaModel,
        tiers: AdapterTiers,
        tokenizer: Tokenizer,
        metrics: EngineMetrics,
        limits: EngineLimits | None = None,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
        load_read_threads: int = 1,
        merge: MergeConfig | None = None,
    ) -> None:
        self.model = model
        self.tiers = tiers
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.limits = limits or EngineLimits()
        self.clock = clock
        self.rng = rng or random.Random()
        self.kv = KVCache(model.config, self.limits.max_num_seqs, self.limits.max_model_len, model.dtype, model.device)
        self.planner = BatchPlanner(max_tokens=self.limits.max_num_batched_tokens, num_slots=tiers.max_loras)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._loading: dict[int, asyncio.Task[None]] = {}
        self._ids = itertools.count()
        self._eos = set(model.config.eos_token_ids)
        self._task: asyncio.Task[None] | None = None
        self.file_digests = FileDigests(read_threads=load_read_threads)
        self.parsed_adapters = ParsedAdapters()
        self.host_buffers = HostBuffers(tiers.max_cpu_loras + 1, pinned=model.device.type == "cuda")
        self.merge_policy = MergePolicy(merge or MergeConfig(), rank_of=_rank_of)
        #: bytes that may still be allocated on the model's device (a function, so tests can pretend)
        self.available_memory: Callable[[torch.device], int] = available_memory
        model.on_merge = metrics.merge_event

    # --- lifecycle ----------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the step loop on the running event loop."""
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="engine-steps")

    async def stop(self) -> None:
        """Stop the step loop and any loaders."""
        for task in [self._task, *self._loading.values()]:
            if task is not None:
                task.cancel()
        for task in [self._task, *self._loading.values()]:
            if task is not None:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task

    # --- adapters -----------------------------------------------------------------------------------------------
    async def read_adapter(self, name: str, path: Path | str, root: Path | None = None) -> tuple[AdapterState, PeftAdapter]:
        """Read, parse and prepare an adapter for the host tier (off the event loop) as a new, unregistered state.

        With ``root``, ``path`` is as a client sent it and is first confined to ``root`` (:func:`confine`), in the
        same worker thread: no filesystem work on the event loop, and one hop for all of it. The disk-read stage
        reads each file once, the weights into a warm :class:`HostBuffers` buffer (page-locked on CUDA), hashing it
        unless :class:`FileDigests` knows it unchanged; the parse stage views the tensors in those bytes and checks
        them, converting only what is not in the serving dtype, so inserting into the host tier copies nothing. Both
        run under ``torch.inference_mode``: the weights are inference tensors.
        """
        resolved, files, weights, read_seconds, parse_seconds = await asyncio.to_thread(self._read_for_host, path, root)
        self.metrics.load_stage("disk_read", read_seconds)
        self.metrics.load_stage("parse", parse_seconds)
        adapter = AdapterState(name=name, path=resolved, digest=files.digest, disk_bytes=files.nbytes)
        adapter.load_seconds = read_seconds + parse_seconds
        return adapter, weights

    def _read_for_host(self, path: Path | str, root: Path | None) -> tuple[Path, AdapterFiles, PeftAdapter, float, float]:
        """Confinement and both stages in one worker thread: the directory, the files, the host-ready weights, and
        each stage's seconds."""
        resolved = confine(root, str(path)) if root is not None else Path(path)
        with torch.inference_mode():
            started = time.perf_counter()
            files = AdapterFiles.read(resolved, self.file_digests, self.host_buffers)
            read_done = time.perf_counter()
            weights = parse_adapter(files, self.model.config, self.tiers.max_lora_rank, self.parsed_adapters)
            weights = host_copy(weights, self.model.dtype, pin=self.host_buffers.pinned)
        return resolved, files, weights, read_done - started, time.perf_counter() - read_done

    async def add_adapter(self, name: str, path: Path | str, root: Path | None = None) -> AdapterState:
        """Load an adapter into the host tier and register it (replacing one of the same name); with ``root``, the
        path is confined to it first (:meth:`read_adapter`)."""
        adapter, weights = await self.read_adapter(name, path, root)
        async with self.lock:
            self.tiers.register(adapter)
            self.tiers.insert_host(adapter, weights, adapter.load_seconds)
            if self.waiting:  # requests may wait for the adapter this one replaces; else the step loop has nothing to do
                self._wake.set()
        return adapter

    async def remove_adapter(self, name: str) -> AdapterState:
        """Unregister ``name`` (KeyError when unknown); its memory is freed once its requests finish."""
        async with self.lock:
            adapter = self.tiers.unregister(name)
        self._wake.set()
        return adapter

    async def activate(self, adapter: AdapterState) -> bool:
        """Bring an adapter to a device slot (reading it from disk first if needed)."""
        if adapter.weights is None:
            await self._reload(adapter)
        async with self.lock:
            return adapter.weights is not None and self._activate(adapter)

    async def offload(self, adapter: AdapterState) -> None:
        """Move an adapter out of its slot into host memory; :class:`AdapterBusyError` if pinned or in flight."""
        async with self.lock:
            self._check_removable(adapter)
            self.tiers.offload(adapter)

    @staticmethod
    def _check_removable(adapter: AdapterState) -> None:
        if adapter.pinned:
            raise AdapterBusyError(f"adapter {adapter.name!r} is pinned: unpin it first")
        if adapter.in_flight:
            raise AdapterBusyError(f"adapter {adapter.name!r} has {adapter.in_flight} requests in flight")

    async def demote(self, adapter: AdapterState) -> None:
        """Drop an adapter's weights from memory, keeping it registered (read back from disk when a request needs
        it); :class:`AdapterBusyError` if pinned or in flight."""
        async with self.lock:
            self._check_removable(adapter)
            self.tiers.demote(adapter)

    def _activate(self, adapter: AdapterState) -> bool:
        started = time.perf_counter()
        was_active = adapter.slot is not None
        ok = self.tiers.activate(adapter)
        if ok and not was_active:
            self.metrics.load_stage("host_to_device", time.perf_counter() - started)
        return ok

    async def _reload(self, adapter: AdapterState) -> None:
        """Read a registered adapter back from disk into the host tier (digest must be unchanged)."""
        try:
            fresh, weights = await self.read_adapter(adapter.name, adapter.path)
            if fresh.digest != adapter.digest:
                raise RequestError(f"adapter {adapter.name!r} changed on disk (digest {fresh.digest}, loaded {adapter.digest})")
        except Exception as exc:  # the waiting requests learn why; the engine keeps running
            async with self.lock:
                self._fail_waiting(adapter, f"reloading adapter {adapter.name!r} failed: {exc}")
            return
        async with self.lock:
            if adapter.registered or adapter.in_flight:
                self.tiers.insert_host(adapter, weights, fresh.load_seconds)
        self._wake.set()

    def _fail_waiting(self, adapter: AdapterState, message: str) -> None:
        for request in [r for r in self.waiting if r.adapter is adapter]:
            self.waiting.remove(request)
            self._finish(request, "error", message)

    def _start_reload(self, adapter: AdapterState) -> None:
        key = id(adapter)
        if key not in self._loading:
            task = asyncio.get_running_loop().create_task(self._reload(adapter))
            self._loading[key] = task
            task.add_done_callback(lambda _t: self._loading.pop(key, None))

    # --- requests -----------------------------------------------------------------------------------------------
    def submit(self, prompt_ids: list[int], params: SamplingParams, adapter: AdapterState | None) -> Request:
        """Queue a request; raises :class:`RequestError` for one the engine cannot serve."""
        vocab = self.model.config.vocab_size
        if not prompt_ids:
            raise RequestError("the prompt is empty")
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise RequestError(f"prompt token ids must be in [0, {vocab})")
        if params.max_tokens < 1:
            raise RequestError("max_tokens must be at least 1")
        if len(prompt_ids) > self.limits.max_num_batched_tokens:
            raise RequestError(f"the prompt has {len(prompt_ids)} tokens; this engine prefills at most "
                               f"{self.limits.max_num_batched_tokens} (--max-num-batched-tokens)")
        limit = self.limits.max_model_len
        if len(prompt_ids) + params.max_tokens > limit:
            raise RequestError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{len(prompt_ids) + params.max_tokens} tokens ({len(prompt_ids)} in the messages, "
                f"{params.max_tokens} in the completion). Please reduce the length of the messages or completion."
            )
        if params.temperature < 0 or not 0 < params.top_p <= 1:
            raise RequestError("temperature must be >= 0 and top_p in (0, 1]")
        if params.priority and self.limits.scheduling_policy != "priority":
            raise RequestError(f"Got priority {params.priority} but Priority scheduling is not enabled.")
        generator = None
        if params.temperature > 0:
            generator = torch.Generator().manual_seed(params.seed if params.seed is not None else self.rng.getrandbits(63))
        tier = self.tiers.acquire(adapter) if adapter is not None else None
        request = Request(f"cmpl-{next(self._ids)}", list(prompt_ids), params, adapter, self.clock(), tier, generator)
        self.waiting.append(request)
        self._wake.set()
        return request

    async def stream(self, request: Request) -> AsyncIterator[TokenEvent]:
        """The request's events until it finishes; cancelling the consumer aborts the request."""
        try:
            while True:
                event = await request.events.get()
                yield event
                if event.finish_reason is not None:
                    return
        finally:
            if not request.finished:
                async with self.lock:
                    self.abort(request)

    def abort(self, request: Request) -> None:
        """Drop a request (client went away)."""
        if request in self.waiting:
            self.waiting.remove(request)
        if request in self.running:
            self.running.remove(request)
        self._finish(request, "abort", "")

    def lora_temp_buffer_bytes(self) -> int:
        """Upper bound of per-step LoRA scratch: the planner's index buffers plus one float32 shrink output."""
        tokens = self.limits.max_num_batched_tokens
        rank_pad = next(self.model.lora_linears()).slots.rank_pad
        return tokens * (4 + 8) + self.tiers.max_loras * 12 + tokens * rank_pad * 4

    # --- dynamic merge ------------------------------------------------------------------------------------------
    @property
    def merge_config(self) -> MergeConfig:
        """The merge switch and policy settings in force."""
        return self.merge_policy.config

    def set_merge_mode(self, mode: str) -> None:
        """Switch ``auto`` / ``off`` / ``force`` on a running engine (``off`` unmerges at the next step)."""
        self.merge_policy.config = replace(self.merge_policy.config, mode=mode)

    def merged_adapters(self) -> list[AdapterState]:
        """Adapters served from merged weights now, by slot."""
        return [a for slot in sorted(self.model.merged_slots) if (a := self.tiers.slots[slot]) is not None]

    def _merge_room(self, merged: int) -> int:
        """How many more adapters may be merged: ``max_merged`` less those merged, and what memory takes."""
        room = self.merge_config.max_merged - merged
        if room <= 0 or self.merge_config.mode == "off":
            return 0
        copy_bytes = max(1, self.model.merge_nbytes())
        fits = int(self.available_memory(self.model.device) * self.merge_config.memory_fraction // copy_bytes)
        return max(0, min(room, fits))

    def _merge_decision(self, rows: dict[Hashable | None, int], decode: bool) -> tuple[list[int], list[int], bool]:
        """Slots to unmerge and to merge before this step, and whether it uses the copies (the policy works on
        adapters)."""
        held = frozenset(self.merged_adapters())
        decision = self.merge_policy.decide(rows, held, lambda: self._merge_room(len(held)), decode)
        unmerge = [a.slot for a in decision.unmerge if isinstance(a, AdapterState) and a.slot is not None]
        merge = [a.slot for a in decision.merge if isinstance(a, AdapterState) and a.slot is not None]
        return unmerge, merge, decision.use

    def _run_step(self, unmerge: list[int], merge: list[int], use: bool, token_ids: torch.Tensor,
                  positions: torch.Tensor, chunks: list[SequenceChunk], plan: BatchPlan) -> tuple[torch.Tensor, float]:
        """In the step thread: apply the merge decision, then the forward pass; logits and the forward's seconds."""
        clock = self._step_clock()
        for slot in unmerge:
            self.model.unmerge_slot(slot)
        for slot in merge:
            started = clock()
            self.model.merge_slot(slot)
            self.merge_policy.switched(clock() - started)  # the clock the savings it must repay are measured in
        self.model.use_merged(use)
        started = clock()
        logits = self.model.forward(token_ids, positions, chunks, plan, self.kv)
        if self.model.device.type == "cuda":
            torch.cuda.synchronize(self.model.device)
        return logits, clock() - started

    def _step_clock(self) -> Callable[[], float]:
        """What the merge policy times a step with: on a CPU the work itself, the step thread's CPU time (with one
        intra-op thread; the process's with more), which other processes on shared cores do not inflate as they
        do wall time; on an accelerator wall time after a synchronize."""
        if self.model.device.type != "cpu":
            return time.perf_counter
        return time.thread_time if self.model.compute_threads == 1 else time.process_time

    # --- the step loop ------------------------------------------------------------------------------------------
    async def _loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while True:
                async with self.lock:
                    batch = self._schedule()
                    if not batch:
                        break
                    token_ids, positions, chunks, plan = self._prepare(batch)
                    rows: dict[Hashable | None, int] = {}
                    for request, prefill in batch:
                        rows[request.adapter] = rows.get(request.adapter, 0) + (len(request.prompt_ids) if prefill else 1)
                    decode = not any(prefill for _, prefill in batch)
                    try:
                        unmerge, merge, use = self._merge_decision(rows, decode)
                        logits, seconds = await asyncio.to_thread(self._run_step, unmerge, merge, use, token_ids,
                                                                  positions, chunks, plan)
                    except Exception as exc:  # a failed step fails its requests, never the engine
                        log.exception("engine step failed")
                        for request, _ in batch:
                            self.running.remove(request)
                            self._finish(request, "error", f"engine step failed: {exc}")
                        continue
                    held = frozenset(self.merged_adapters())
                    merged_rows = sum(n for key, n in rows.items() if key in held) if use else 0
                    self.metrics.merged_step(merged_rows, plan.num_tokens - merged_rows)
                    for adapter in self.merge_policy.record(rows, held, use, seconds, decode).unmerge:
                        if isinstance(adapter, AdapterState) and adapter.slot is not None:
                            self.model.unmerge_slot(adapter.slot)
                    self._emit(batch, logits)
                await asyncio.sleep(0)  # let handlers enqueue between steps

    def _schedule(self) -> list[tuple[Request, bool]]:
        """This step's requests, each with True when it is prefilled now."""
        batch: list[tuple[Request, bool]] = [(r, False) for r in self.running]
        tokens = len(batch)
        waiting = list(self.waiting)
        if self.limits.scheduling_policy == "priority":
            waiting.sort(key=lambda r: r.params.priority)  # stable: arrival order within a priority
        for request in waiting:
            if len(batch) >= self.limits.max_num_seqs:
                break
            adapter = request.adapter
            if adapter is not None:
                if adapter.weights is None:
                    self._start_reload(adapter)
                    continue
                if not self._activate(adapter):
                    continue
            if tokens + len(request.prompt_ids) > self.limits.max_num_batched_tokens:
                break
            row = self.kv.allocate(len(request.prompt_ids) + request.params.max_tokens)
            if row is None:
                break
            request.kv_row = row
            self.waiting.remove(request)
            self.running.append(request)
            batch.append((request, True))
            tokens += len(request.prompt_ids)
        return batch

    def _prepare(self, batch: list[tuple[Request, bool]]) -> tuple[torch.Tensor, torch.Tensor, list[SequenceChunk], BatchPlan]:
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        chunks = []
        # Rows of one adapter next to each other: the plan is then contiguous and the ops need no gather. An
        # all-decode step (one token per sequence) takes DecodeGroups' order and gets the decode plan, no sort.
        decode: DecodeGroups | None = None
        if not any(prefill for _, prefill in batch):
            decode = DecodeGroups()
            for index, (request, _) in enumerate(batch):
                decode.join(index, _slot_of(request))
            batch[:] = [batch[cast(int, index)] for index in decode.order()]
        else:
            batch.sort(key=lambda item: _slot_of(item[0]))
        for request, prefill in batch:
            assert request.kv_row is not None
            new = request.prompt_ids if prefill else request.output_ids[-1:]
            context = 0 if prefill else request.context_len - 1
            chunks.append(SequenceChunk(request.kv_row, len(ids), len(new), context))
            ids.extend(new)
            positions.extend(range(context, context + len(new)))
            slots.extend([_slot_of(request)] * len(new))
        plan = self.planner.plan(slots) if decode is None else self.planner.plan_decode(decode)
        device = self.model.device
        return torch.tensor(ids, device=device), torch.tensor(positions, device=device), chunks, plan

    def _emit(self, batch: list[tuple[Request, bool]], logits: torch.Tensor) -> None:
        now = self.clock()
        next_ids = self._sample([r for r, _ in batch], logits)
        for (request, prefill), token in zip(batch, next_ids, strict=True):
            if request.finished:
                continue
            if prefill:
                self.metrics.first_token(request.arrival_tier, now - request.arrival)
            request.output_ids.append(token)
            self._advance(request, token)

    def _sample(self, requests: list[Request], logits: torch.Tensor) -> list[int]:
        greedy = logits.argmax(dim=-1).tolist()
        out = []
        for i, request in enumerate(requests):
            p = request.params
            if p.temperature == 0 or request.generator is None:
                out.append(int(greedy[i]))
                continue
            row = logits[i].cpu() / p.temperature
            if p.top_k > 0:
                kth = torch.topk(row, min(p.top_k, row.numel())).values[-1]
                row = row.masked_fill(row < kth, float("-inf"))
            probs = torch.softmax(row, dim=-1)
            if p.top_p < 1:
                sorted_probs, order = probs.sort(descending=True)
                drop = sorted_probs.cumsum(0) - sorted_probs > p.top_p
                probs[order[drop]] = 0
            out.append(int(torch.multinomial(probs, 1, generator=request.generator)))
        return out

    def _advance(self, request: Request, token: int) -> None:
        p = request.params
        text = self.tokenizer.decode(request.output_ids)
        finish = None
        if (token in self._eos and not p.ignore_eos) or token in p.stop_token_ids:
            finish = "stop"
        stop_at = min((i for i in (text.find(s) for s in p.stop) if i >= 0), default=-1)
        if stop_at >= 0:
            text, finish = text[:stop_at], "stop"
        if finish is None and len(request.output_ids) >= p.max_tokens:
            finish = "length"
        held_back = finish is None and text.endswith("\ufffd")  # an incomplete UTF-8 sequence: wait for the rest
        delta = "" if held_back else text[len(request.text):]
        if not held_back:
            request.text = text
        if finish is None:
            request.events.put_nowait(TokenEvent(token, delta))
            return
        request.events.put_nowait(TokenEvent(token, delta))
        self.running.remove(request)
        self._finish(request, finish, "")

    def _finish(self, request: Request, reason: str, message: str) -> None:
        if request.finished:
            return
        request.finished = True
        if request.kv_row is not None:
            self.kv.release(request.kv_row)
            request.kv_row = None
        if request.adapter is not None:
            self.tiers.release(request.adapter)
        request.events.put_nowait(TokenEvent(None, message, reason))
        self._wake.set()
