"""The ``vllm`` driver: vLLM's (and vLLM-Ascend's) dynamic LoRA HTTP API, driven as vLLM really behaves.

What vLLM (0.32/0.33) does, and so what this driver assumes:
- ``POST /v1/load_lora_adapter`` loads the adapter *and activates it into a GPU slot* (the worker's LRU caches:
  ``max_cpu_loras`` host copies and ``max_loras`` GPU slots, both touched by every load and by every step that serves
  the adapter). A request for an adapter whose copy was pushed out reloads it from its path.
- A load vLLM cannot accept (rank above ``--max-lora-rank``, tensors of the wrong shape) answers **500**
  ``InternalServerError`` while the server stays healthy: that is a refusal (final ``Incompatible``), not an outage.
- ``POST /v1/unload_lora_adapter`` only forgets the name in the API server: the copy stays in both caches until LRU
  pushes it out (it still takes a slot), and reloading the name makes a second copy.
- No pin, no offload and no residency listing over HTTP. ``vllm:lora_requests_info`` keeps one series per label
  combination with the time it was last set: the newest says which adapters have requests now, and the newest series
  naming an adapter says when it was last served.

Residency is read exactly when vLLM's /metrics has the residency series (``vllm:lora_adapter_loaded`` ...:
loraplane's vLLM plugin exports them from the worker's caches, and a vLLM build with upstream's own series has
them too); the report's ``residency_source`` says which. Otherwise, and for planning in both cases, residency is
*replayed*: :class:`LoraCacheModel` applies the loads, unloads and served requests the sidecar sees to a copy of
vLLM's LRU order (aligned with the exact series when there are some). Before a load or a warm-up that would push a kept adapter out of its tier, the driver
touches (one-token completions) the kept adapters that would otherwise be the least recently used, so the copy that
goes is an unwanted or unloaded one.

A registered name whose copy LRU pushed out is still served (from its path): so a disk-tier target is *registered,
not kept resident* (``Capabilities.disk_registered``): the reconciler loads it when it is not registered (after the
GPU- and host-tier targets, one at a time), never unloads it for being disk-tier, and leaves it out of
``keep_resident``, so its copy is the one LRU pushes out.

``load_inplace`` is not used: in vLLM 0.32 the flag stays on the stored request and every later engine step that
serves the adapter reloads it from disk (and the prefix cache keeps blocks computed with the old weights).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from loraplane.api import PodLoad, ResidencySource, Tier, vllm_metrics
from loraplane.api.vllm_metrics import (
    LoadedAdapter,
    Samples,
    lora_last_served,
    lora_requests,
    parse_metrics,
    parse_series,
)
from loraplane.sidecar.drivers.base import (
    Capabilities,
    Observation,
    RuntimeAdapter,
    RuntimeDriver,
    RuntimeInfo,
    RuntimeRejected,
    RuntimeUnavailable,
)
from loraplane.vllm_server import refuse_lora_resolver

log = logging.getLogger(__name__)

#: re-exported: the parsing moved to the contract (``loraplane.api.vllm_metrics``)
__all__ = ["LoraCacheModel", "Samples", "VllmApiDriver", "VllmDriver", "lora_last_served", "lora_requests",
           "parse_metrics", "pod_load"]


def pod_load(samples: Samples, info: RuntimeInfo) -> PodLoad:
    """The GIE model-server protocol metrics as a PodLoad (queue and running summed over engines)."""
    return PodLoad(
        queue_depth=vllm_metrics.queue_depth(samples),
        running=vllm_metrics.running(samples),
        kv_utilization=vllm_metrics.kv_usage(samples),
        max_gpu_slots=info.max_loras or 0,
        max_cpu_slots=max(info.max_cpu_loras or 0, info.max_loras or 0),
    )


#: loraplane's vLLM plugin's admin routes (``loraplane.kernels.vllm_residency``; under /v1, so vLLM's --api-key
#: guards them): body ``{"lora_name": ...}``
PIN_PATH = "/v1/loraplane/pin_lora_adapter"
UNPIN_PATH = "/v1/loraplane/unpin_lora_adapter"
OFFLOAD_PATH = "/v1/loraplane/offload_lora_adapter"


@dataclass
class _Copy:
    """One adapter copy in vLLM's worker caches: its served name (None once unloaded) and when it was last touched."""

    name: str | None
    touched: float


@dataclass
class LoraCacheModel:
    """vLLM's worker LoRA caches, replayed from what the sidecar sees.

    Every load and every step serving an adapter touches its copy in both LRU caches at once, so the GPU slots hold
    the ``gpu_slots`` most recently touched copies and the host cache the ``host_slots`` most recent ones; a
    registered name without a copy is on disk. Unloaded copies (name None) stay until they fall out.
    """

    gpu_slots: int
    host_slots: int
    copies: list[_Copy] = field(default_factory=list)

    def clone(self) -> LoraCacheModel:
        """An independent copy (for planning)."""
        return LoraCacheModel(self.gpu_slots, self.host_slots, [dataclasses.replace(c) for c in self.copies])

    def ranked(self) -> list[_Copy]:
        """Copies, most recently touched first."""
        return sorted(self.copies, key=lambda c: c.touched, reverse=True)

    def _find(self, name: str) -> _Copy | None:
        return next((c for c in self.copies if c.name == name), None)

    def touch(self, name: str, at: float) -> None:
        """``name`` was loaded or served at ``at``: its copy becomes the most recent (a new one if it had none)."""
        copy = self._find(name)
        if copy is None:
            self.copies.append(_Copy(name, at))
        else:
            copy.touched = max(copy.touched, at)
        self.copies = self.ranked()[:self.host_slots]

    def load(self, name: str, at: float) -> None:
        """A fresh load of ``name`` (a new copy; an old copy of the name, if any, no longer has it)."""
        self.unload(name)
        self.touch(name, at)

    def unload(self, name: str) -> None:
        """vLLM forgot the name; its copy stays until LRU pushes it out."""
        copy = self._find(name)
        if copy is not None:
            copy.name = None

    def keep_only(self, registered: Collection[str]) -> None:
        """Names vLLM no longer serves lose their copies' names."""
        for copy in self.copies:
            if copy.name is not None and copy.name not in registered:
                copy.name = None

    def align(self, resident: Mapping[str, LoadedAdapter]) -> None:
        """Make the replayed caches agree with exact residency (``resident``: name -> in a GPU slot or only in host
        memory, as vLLM's own series say): named copies vLLM no longer holds go, copies the model lacks are added
        as the least recently used of their tier, and every GPU copy ranks above every host-only one (the order
        within a tier, which no series exports, stays the replayed one)."""
        self.copies = [c for c in self.copies if c.name is None or c.name in resident]
        known = {c.name for c in self.copies}
        floor = min((c.touched for c in self.copies), default=0.0)
        for name in sorted(n for n in resident if n not in known):
            floor -= 1.0
            self.copies.append(_Copy(name, floor))
        host = [c.touched for c in self.copies if c.name is not None and not resident[c.name].gpu]
        if host:
            top = max(host)
            low = sorted((c for c in self.copies if c.name is not None and resident[c.name].gpu
                          and c.touched <= top), key=lambda c: c.touched)
            for step, copy in enumerate(low, start=1):
                copy.touched = top + step * 1e-3
        self.copies = self.ranked()

    def tier(self, name: str) -> Tier:
        """GPU, CPU (host cache) or DISK (registered, reloaded on its next request)."""
        for rank, copy in enumerate(self.ranked()):
            if copy.name == name:
                return Tier.GPU if rank < self.gpu_slots else Tier.CPU
        return Tier.DISK

    def unloaded_copies(self) -> tuple[int, int]:
        """Copies of unloaded names still in (GPU slots, host cache)."""
        ranked = self.ranked()
        return (sum(c.name is None for c in ranked[:self.gpu_slots]), sum(c.name is None for c in ranked))

    def pushed_out(self, name: str, gpu_keep: Collection[str], host_keep: Collection[str],
                   fresh: bool = False) -> set[str]:
        """The kept names that touching (or with ``fresh`` loading) ``name`` now would push out of their tier."""
        after = self.clone()
        stamp = max((c.touched for c in self.copies), default=0.0) + 1.0
        after.load(name, stamp) if fresh else after.touch(name, stamp)
        lost = {n for n in gpu_keep if n != name and self.tier(n) is Tier.GPU and after.tier(n) is not Tier.GPU}
        return lost | {n for n in host_keep if n != name and self.tier(n) is not Tier.DISK
                       and after.tier(n) is Tier.DISK}

    def touches_before(self, name: str, gpu_keep: Collection[str], host_keep: Collection[str],
                       fresh: bool = False) -> list[str]:
        """Kept names to touch, in order, so that then touching (loading) ``name`` pushes none of them out.

        GPU-resident kept adapters are touched (no eviction: they already hold slots) so an unwanted copy is the
        least recently used GPU one; a kept host copy about to fall out is touched too (it takes a GPU slot, so the
        GPU-kept ones are touched again after it).
        """
        plan: list[str] = []
        sim = self.clone()
        stamp = max((c.touched for c in self.copies), default=0.0)
        for _ in range(len(host_keep) + 2):
            if not sim.pushed_out(name, gpu_keep, host_keep, fresh):
                return plan
            ranked = sim.ranked()
            gpu_kept = [c.name for c in reversed(ranked[:sim.gpu_slots]) if c.name in gpu_keep]
            oldest = ranked[-1] if len(ranked) >= sim.host_slots else None
            step = list(gpu_kept)
            if oldest is not None and oldest.name in host_keep and oldest.name not in gpu_kept:
                step += [oldest.name, *gpu_kept]
            if not step:
                break
            for touched in step:
                assert touched is not None
                stamp += 1.0
                sim.touch(touched, stamp)
            plan += [n for n in step if n is not None]
        return plan


@dataclass(frozen=True)
class RuntimeResponse:
    """A runtime's answer, read in full: status and body."""

    status_code: int
    content: bytes

    @property
    def text(self) -> str:
        """The body as text."""
        return self.content.decode(errors="replace")

    def json(self) -> Any:
        """The body as JSON (ValueError when it is not)."""
        return orjson.loads(self.content)


class VllmApiDriver(RuntimeDriver):
    """What every runtime speaking vLLM's dynamic LoRA API shares: the HTTP client, load, unload and /metrics.

    The HTTP client is aiohttp, one keep-alive session per driver (opened on the first call, on the running event
    loop): every load goes through it, and measured against the engine it took 0.2-1.1 ms of CPU per request where
    httpx took 1.7-4 ms on the same (shared, 2-core) machine, a fifth of a 38 MB adapter's raw read time.
    """

    kind = "vllm-api"
    capabilities = Capabilities(tier_control=False, pin=False, reports_residency=False, exports_residency_metrics=False)

    def __init__(
        self,
        base_url: str,
        limits: RuntimeInfo,
        token: str | None = None,
        timeout_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._base_url = base_url.rstrip("/")
        self._headers = {"authorization": f"Bearer {token}"} if token else {}
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._http: aiohttp.ClientSession | None = None
        self._limits = limits
        self._clock = clock

    async def _request(self, method: str, path: str, body: dict[str, Any] | None = None) -> RuntimeResponse:
        if self._http is None:
            self._http = aiohttp.ClientSession(headers=self._headers, timeout=self._timeout)
        data, headers = (None, None) if body is None else (orjson.dumps(body), {"content-type": "application/json"})
        try:
            async with self._http.request(method, self._base_url + path, data=data, headers=headers) as answer:
                return RuntimeResponse(answer.status, await answer.read())
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise RuntimeUnavailable(f"{method} {path}: {exc!r}") from exc

    async def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> RuntimeResponse:
        resp = await self._request(method, path, body)
        if resp.status_code >= 500:
            raise RuntimeUnavailable(f"{method} {path}: HTTP {resp.status_code}: {_error_message(resp)}")
        if resp.status_code >= 400:
            raise RuntimeRejected(resp.status_code, _error_message(resp))
        return resp

    async def scrape(self, names: tuple[str, ...] = vllm_metrics.SIDECAR_SERIES) -> Samples:
        """The samples of ``names`` in the runtime's /metrics (by default the series the drivers read): one
        regular-expression pass that leaves the rest unread (a full parse took a third of a sidecar's CPU)."""
        return parse_series((await self._call("GET", "/metrics")).text, names)

    def _instance(self, samples: Samples) -> str | None:
        start = samples.get(vllm_metrics.PROCESS_START)
        return f"{start[0][1]:.3f}" if start else None

    async def load(self, served_name: str, path: Path) -> None:
        """``POST /v1/load_lora_adapter``.

        A 500 from a server that is still healthy is vLLM refusing the adapter (its worker raised: rank above
        ``--max-lora-rank``, tensors of the wrong shape): RuntimeRejected with vLLM's message, not an outage.
        """
        body = {"lora_name": served_name, "lora_path": str(path)}
        resp = await self._request("POST", "/v1/load_lora_adapter", body)
        if resp.status_code >= 500 and not await self._healthy():
            raise RuntimeUnavailable(f"load {served_name}: HTTP {resp.status_code}: {_error_message(resp)}")
        if resp.status_code >= 400:
            raise RuntimeRejected(resp.status_code, _error_message(resp))

    async def _healthy(self) -> bool:
        try:
            return (await self._request("GET", "/health")).status_code == 200
        except RuntimeUnavailable:
            return False

    async def unload(self, served_name: str) -> None:
        """``POST /v1/unload_lora_adapter``; an unknown name (404) is already unloaded."""
        try:
            await self._call("POST", "/v1/unload_lora_adapter", {"lora_name": served_name})
        except RuntimeRejected as exc:
            if exc.status != 404:
                raise

    async def close(self) -> None:
        """Close the HTTP client."""
        if self._http is not None:
            await self._http.close()


class VllmDriver(VllmApiDriver):
    """Drives a vLLM (or vLLM-Ascend) server started with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=true``.

    ``limits`` are what the server was started with (``max_loras``, ``max_cpu_loras``, ``max_lora_rank``, base model
    digest): vLLM does not publish them, so the operator passes them to the sidecar. ``env`` (default: this process's
    environment, which the deployment shares with the runtime container) must not turn on a LoRA resolver: vLLM's
    answers do not show whether one is on, so the driver refuses to start (ValueError) when the settings are there.
    ``wall_clock`` must be the clock vLLM stamps its metrics with (``time.time`` on the same host).
    """

    kind = "vllm"
    capabilities = Capabilities(tier_control=False, pin=False, reports_residency=False,
                                exports_residency_metrics=False, load_activates=True, disk_registered=True)

    def __init__(
        self,
        base_url: str,
        limits: RuntimeInfo,
        token: str | None = None,
        timeout_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        env: Mapping[str, str] | None = None,
    ) -> None:
        refuse_lora_resolver(os.environ if env is None else env, "the vllm driver")
        super().__init__(base_url, limits, token=token, timeout_s=timeout_s, clock=clock)
        self._wall_clock = wall_clock
        self._instance_seen: str | None = None
        self._served_until = 0.0
        self._gpu_keep: frozenset[str] = frozenset()
        self._host_keep: frozenset[str] = frozenset()
        self._source = ResidencySource.LRU_MODEL
        self.cache = self._empty_cache()

    @property
    def residency_source(self) -> ResidencySource:
        """``loraplane-plugin`` or ``vllm-metrics`` while vLLM's /metrics had the residency series at the last
        ``observe``, else ``lru-model`` (the replayed caches)."""
        return self._source

    def _empty_cache(self) -> LoraCacheModel:
        gpu = self._limits.max_loras or 1
        return LoraCacheModel(gpu, max(self._limits.max_cpu_loras or gpu, gpu))

    def keep_resident(self, gpu: Collection[str], host: Collection[str]) -> None:
        """Loads and warm-ups first touch these so that LRU pushes out other copies."""
        self._gpu_keep, self._host_keep = frozenset(gpu), frozenset(host) | frozenset(gpu)

    async def observe(self) -> Observation:
        """``/v1/models`` for the adapters, ``/metrics`` for served requests, load and restarts; tiers replayed."""
        models = (await self._call("GET", "/v1/models")).json().get("data", [])
        samples = await self.scrape()
        instance = self._instance(samples)
        if self._instance_seen is not None and instance != self._instance_seen:  # a restarted vLLM holds nothing
            self.cache, self._served_until = self._empty_cache(), 0.0
        self._instance_seen = instance
        base = next((m["id"] for m in models if not m.get("parent")), "")
        info = dataclasses.replace(self._limits, base_model=base, instance=instance)
        names = [m["id"] for m in models if m.get("parent")]
        roots = {m["id"]: m.get("root") for m in models if m.get("parent")}
        self.cache.keep_only(names)
        self._replay_requests(samples, set(names))
        exact = vllm_metrics.loaded_adapters(samples)
        if exact is None:
            self._source = ResidencySource.LRU_MODEL
        else:
            self._source = (ResidencySource.PLUGIN if vllm_metrics.exported_by_plugin(samples)
                            else ResidencySource.VLLM_METRICS)
            self.cache.align({name: state for name, state in exact.items() if name in roots})
        # loraplane's plugin adds pin and unpin routes: pinned GPU-tier targets are pinned in vLLM's caches
        plugin = self._source is ResidencySource.PLUGIN
        self.capabilities = dataclasses.replace(type(self).capabilities, pin=plugin)
        running, waiting = lora_requests(samples)
        busy = running | waiting
        adapters = {name: RuntimeAdapter(served_name=name, tier=self._tier(name, exact), in_flight=int(name in busy),
                                         pinned=bool(exact and name in exact and exact[name].pinned),
                                         path=roots[name] if isinstance(roots[name], str) else None)
                    for name in names}
        return Observation(info, adapters, pod_load(samples, info))

    def _tier(self, name: str, exact: Mapping[str, LoadedAdapter] | None) -> Tier:
        """From vLLM's residency series when it exports them (a registered name without a series is on disk: vLLM
        reads it back from its path on the next request), else from the replayed caches."""
        if exact is None:
            return self.cache.tier(name)
        state = exact.get(name)
        return Tier.DISK if state is None else Tier.GPU if state.gpu else Tier.CPU

    def _replay_requests(self, samples: Samples, registered: set[str]) -> None:
        """Touch the copies of adapters vLLM served since the last look, in the order it served them."""
        served = sorted((stamp, name) for name, stamp in lora_last_served(samples).items()
                        if stamp > self._served_until and name in registered)
        for stamp, name in served:
            self.cache.touch(name, stamp)
        self._served_until = max([self._served_until, *(stamp for stamp, _ in served)])

    async def _keep_others(self, served_name: str, fresh: bool) -> None:
        for name in self.cache.touches_before(served_name, self._gpu_keep, self._host_keep, fresh=fresh):
            try:
                await self._warm_up(name)
            except RuntimeRejected as exc:  # gone from vLLM since the last look: nothing to keep, the load goes on
                if exc.status != 404:
                    raise
                log.info("not keeping %s before %s: vLLM no longer has it", name, served_name)
                self.cache.unload(name)
        lost = self.cache.pushed_out(served_name, self._gpu_keep, self._host_keep, fresh=fresh)
        if lost:
            log.warning("%s %s pushes %s out of their tier: vLLM has too few slots for the target",
                        "loading" if fresh else "serving", served_name, sorted(lost))

    async def _warm_up(self, served_name: str) -> None:
        await self._call(
            "POST", "/v1/completions", {"model": served_name, "prompt": "Hi", "max_tokens": 1, "temperature": 0}
        )
        self.cache.touch(served_name, self._wall_clock())

    async def load(self, served_name: str, path: Path) -> None:
        """Load (vLLM activates it into a GPU slot), after touching kept adapters LRU would otherwise push out."""
        await self._keep_others(served_name, fresh=True)
        await super().load(served_name, path)
        self.cache.load(served_name, self._wall_clock())

    async def activate(self, served_name: str) -> None:
        """A one-token greedy completion: vLLM puts the adapter in a GPU slot to serve it."""
        await self._keep_others(served_name, fresh=False)
        await self._warm_up(served_name)

    async def set_pinned(self, served_name: str, pinned: bool) -> None:
        """Pin (vLLM's own ``pin_lora``: in a GPU slot and the host cache, never evicted) or unpin, through the
        plugin's admin routes (only while ``capabilities.pin``: the plugin's series were seen)."""
        await self._call("POST", PIN_PATH if pinned else UNPIN_PATH, {"lora_name": served_name})

    async def unload(self, served_name: str) -> None:
        """Unload; the copy stays in vLLM's caches (and in the model) until LRU pushes it out."""
        await super().unload(served_name)
        self.cache.unload(served_name)


def _error_message(resp: RuntimeResponse) -> str:
    """vLLM's ``{"error": {"message": ...}}`` or the raw text."""
    try:
        body = resp.json()
    except ValueError:
        return resp.text[:500]
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict) and "message" in error:
        return str(error["message"])
    return resp.text[:500]
