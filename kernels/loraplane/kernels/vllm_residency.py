"""Exact LoRA residency from inside vLLM, on vLLM's own ``/metrics`` (part of the ``loraplane_kernels`` plugin).

vLLM V1 splits a server into processes: the API server (HTTP, ``/metrics``, adapter names) and the engine core,
whose worker(s) hold the LoRA caches (``LRUCacheWorkerLoRAManager``: ``max_cpu_loras`` host copies, ``max_loras``
GPU slots). The plugin runs in all of them (vLLM loads general plugins in each):

- **worker side** (:func:`_hook_worker`): after every call that can change the caches (a load, a step's
  ``set_active_adapters``, a pin, a removal) the worker compares the set of copies (id, name, rank, in a GPU slot,
  pinned) with the last one and, only when it changed, writes it as JSON to ``<dir>/engine-<dp rank>-<pid>.json``
  (written to a temporary name, then renamed: a reader sees a whole snapshot). The same file carries an eviction
  count per level (a copy leaving a GPU slot or the host cache while vLLM loads or activates another, not an
  explicit removal) and a histogram of the worker's adapter reads (``_load_adapter``: files -> tensors).
- **API server side** (:class:`ResidencyCollector`): a Prometheus collector registered in the registry vLLM's
  ``/metrics`` serves, which reads those files at each scrape and emits the series in the shape of vLLM's open PR
  #54830. A copy is named by the API server's current registration (``OpenAIServingModels.lora_requests``: name ->
  int id), so a copy of a name that was unloaded (vLLM 0.32's unload only forgets the name, the copy stays in both
  caches) is not reported as that name: it counts in ``loraplane_vllm_unregistered_lora_copies``.

The directory is ``$LORAPLANE_VLLM_RESIDENCY_DIR``; unset, the first process to load the plugin (the API server,
which loads plugins while it parses its arguments, before it starts the engine core) makes a temporary directory,
removed when it exits, and sets the variable, which the engine core and workers inherit.
Switch: ``LORAPLANE_VLLM_RESIDENCY`` (on unless ``0``/``false``/``no``/``off``). Any vLLM internals this relies on
that are missing turn the feature off with a warning; serving is never affected.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

log = logging.getLogger(__name__)

ENABLE_ENV = "LORAPLANE_VLLM_RESIDENCY"
DIR_ENV = "LORAPLANE_VLLM_RESIDENCY_DIR"
_OFF = {"0", "false", "no", "off"}

LOADED = "vllm:lora_adapter_loaded"
NUM_GPU = "vllm:num_gpu_loaded_lora_adapters"
NUM_CPU = "vllm:num_cpu_loaded_lora_adapters"
MAX_GPU = "vllm:max_gpu_lora_adapters"
LOAD_SECONDS = "vllm:lora_adapter_load_seconds"
EVICTIONS = "vllm:lora_adapter_evictions"
UNREGISTERED = "loraplane_vllm_unregistered_lora_copies"
#: upper bounds of the load-time histogram's buckets (seconds); +Inf follows
LOAD_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

_tempdir: tempfile.TemporaryDirectory[str] | None = None
_installed = False
_serving_models: weakref.ref[Any] | None = None


def enabled() -> bool:
    """True unless ``$LORAPLANE_VLLM_RESIDENCY`` turns it off."""
    return os.environ.get(ENABLE_ENV, "1").strip().lower() not in _OFF


def residency_dir() -> str:
    """The directory the workers write to and the API server reads (made and exported to children when unset)."""
    global _tempdir
    path = os.environ.get(DIR_ENV)
    if not path:
        _tempdir = tempfile.TemporaryDirectory(prefix="loraplane-residency-")
        path = os.environ[DIR_ENV] = _tempdir.name
    return path


def install() -> None:
    """Hook vLLM's worker LoRA manager and register the collector (idempotent; every vLLM process)."""
    global _installed
    if _installed or not enabled():
        return
    _installed = True
    directory = residency_dir()
    try:
        _hook_worker(directory)
        _hook_worker_rpc()
        _hook_serving_models()
        _hook_admin_routes()
        _register_collector(directory)
    except (ImportError, AttributeError) as exc:  # another vLLM's internals: no residency series, serving unaffected
        log.warning("loraplane residency metrics off: %r", exc)


# --- worker side ------------------------------------------------------------------------------------------------------


class WorkerState:
    """What one worker's LoRA manager holds, as last written, plus its counters."""

    def __init__(self, directory: str, engine: str) -> None:
        self.path = os.path.join(directory, f"engine-{engine}-{os.getpid()}.json")
        self.engine = engine
        self.names: dict[int, str] = {}
        self.copies: dict[int, dict[str, Any]] = {}
        self.evictions = {"gpu": 0, "cpu": 0}
        self.buckets = [0] * (len(LOAD_BUCKETS) + 1)
        self.load_sum = 0.0
        self.max_loras = 0
        self.max_cpu_loras = 0
        self.lock = threading.Lock()

    def observe_load(self, seconds: float) -> None:
        """One adapter read (files -> tensors) took ``seconds``."""
        index = next((i for i, bound in enumerate(LOAD_BUCKETS) if seconds <= bound), len(LOAD_BUCKETS))
        self.buckets[index] += 1
        self.load_sum += seconds

    def sync(self, manager: Any, evicting: bool, force: bool = False) -> None:
        """Read ``manager``'s caches (an ``LRUCacheLoRAModelManager``); write the file when they changed."""
        registered = manager._registered_adapters
        active = manager._active_adapters
        pinned = set(getattr(registered, "pinned_items", ())) | set(getattr(active, "pinned_items", ()))
        copies = {}
        for lora_id, model in list(registered.cache.items()):
            name = self.names.get(lora_id)
            if name is None:  # a dummy adapter (warm-up, profiling): not a served adapter
                continue
            copies[lora_id] = {"id": lora_id, "name": name, "rank": int(getattr(model, "rank", 0) or 0),
                               "gpu": lora_id in active.cache, "pinned": lora_id in pinned}
        self.max_loras = int(manager.lora_slots)
        self.max_cpu_loras = int(manager.capacity)
        if copies == self.copies and not force:
            return
        if evicting:
            for lora_id, before in self.copies.items():
                after = copies.get(lora_id)
                if after is None:
                    self.evictions["cpu"] += 1
                if before["gpu"] and (after is None or not after["gpu"]):
                    self.evictions["gpu"] += 1
        self.copies = copies
        self.write()

    def write(self) -> None:
        """Write the snapshot (temporary file, then rename)."""
        body = {"engine": self.engine, "pid": os.getpid(), "written_at": time.time(),
                "max_loras": self.max_loras, "max_cpu_loras": self.max_cpu_loras,
                "copies": sorted(self.copies.values(), key=lambda c: c["id"]), "evictions": self.evictions,
                "load_seconds": {"buckets": list(LOAD_BUCKETS), "counts": self.buckets, "sum": self.load_sum}}
        tmp = f"{self.path}.{threading.get_ident()}.tmp"
        with open(tmp, "w") as f:
            json.dump(body, f)
        os.replace(tmp, self.path)


def _engine_label(vllm_config: Any) -> str:
    parallel = getattr(vllm_config, "parallel_config", None)
    return str(getattr(parallel, "data_parallel_rank", 0) or 0)


def _hook_worker(directory: str) -> None:
    """Wrap ``LRUCacheWorkerLoRAManager``'s methods that can change its caches."""
    from vllm.lora.worker_manager import LRUCacheWorkerLoRAManager as Manager

    if getattr(Manager, "_loraplane_residency", False):
        return
    Manager._loraplane_residency = True

    def state_of(self: Any) -> WorkerState | None:
        return getattr(self, "_loraplane_state", None)

    create = Manager.create_lora_manager

    def create_lora_manager(self: Any, model: Any, vllm_config: Any = None, *args: Any, **kwargs: Any) -> Any:
        result = create(self, model, vllm_config, *args, **kwargs)
        self._loraplane_state = WorkerState(directory, _engine_label(vllm_config))
        with self._loraplane_state.lock:
            self._loraplane_state.sync(self._adapter_manager, evicting=False, force=True)
        return result

    load_adapter = Manager._load_adapter

    def _load_adapter(self: Any, lora_request: Any) -> Any:
        start = time.perf_counter()
        lora = load_adapter(self, lora_request)
        state = state_of(self)
        if state is not None:
            state.observe_load(time.perf_counter() - start)
            state.names[lora_request.lora_int_id] = lora_request.lora_name
        return lora

    def after(name: str, evicting: bool) -> Callable[..., Any]:
        original = getattr(Manager, name)

        def method(self: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return original(self, *args, **kwargs)
            finally:
                state = state_of(self)
                if state is not None:
                    with state.lock:
                        try:
                            state.sync(self._adapter_manager, evicting)
                        except Exception:  # never let the metrics break a step
                            log.exception("loraplane residency snapshot failed")

        method.__name__ = name
        return method

    Manager.create_lora_manager = create_lora_manager
    Manager._load_adapter = _load_adapter
    for name, evicting in (("add_adapter", True), ("set_active_adapters", True), ("pin_adapter", True),
                           ("remove_adapter", False), ("remove_all_adapters", False)):
        setattr(Manager, name, after(name, evicting))


def _sync(manager: Any) -> None:
    state = getattr(manager, "_loraplane_state", None)
    if state is not None:
        with state.lock:
            state.sync(manager._adapter_manager, evicting=False)


def pin(manager: Any, lora_id: int) -> str:
    """Pin a registered copy with vLLM's own ``pin_adapter`` (activates it, pins it in both caches): ``pinned``,
    ``not-loaded`` (no copy: load it first) or ``full`` (refused: it would leave no unpinned GPU slot or host copy,
    and vLLM's next activation of another adapter would fail with every item pinned)."""
    adapters = manager._adapter_manager
    registered, active = adapters._registered_adapters, adapters._active_adapters
    if lora_id not in registered.cache:
        return "not-loaded"
    if lora_id in registered.pinned_items and lora_id in active.pinned_items:
        return "pinned"
    others_gpu = len(set(active.pinned_items) - {lora_id})
    others_host = len(set(registered.pinned_items) - {lora_id})
    if others_gpu + 1 >= adapters.lora_slots or others_host + 1 >= adapters.capacity:
        return "full"
    manager.pin_adapter(lora_id)
    _sync(manager)
    return "pinned"


def unpin(manager: Any, lora_id: int) -> bool:
    """Unpin a copy in both of ``manager``'s caches (an ``LRUCacheWorkerLoRAManager``); True when it was pinned."""
    caches = (manager._adapter_manager._registered_adapters, manager._adapter_manager._active_adapters)
    was = False
    for cache in caches:
        if lora_id in cache.pinned_items:
            cache._unpin(lora_id)
            was = True
    _sync(manager)
    return was


def offload(manager: Any, lora_id: int) -> str:
    """Free the copy's GPU slot, keeping its host copy: ``offloaded``, ``pinned`` (refused: unpin it first) or
    ``not-on-gpu``."""
    adapters = manager._adapter_manager
    if lora_id not in adapters._active_adapters.cache:
        return "not-on-gpu"
    if lora_id in adapters._active_adapters.pinned_items:
        return "pinned"
    adapters.deactivate_adapter(lora_id)
    _sync(manager)
    return "offloaded"


def _hook_worker_rpc() -> None:
    """Worker methods the admin routes reach through the engine's ``collective_rpc`` (by name)."""
    from vllm.v1.worker.worker_base import WorkerBase

    def manager_of(worker: Any) -> Any:
        manager = getattr(getattr(worker, "model_runner", None), "lora_manager", None)
        if manager is None:
            raise RuntimeError("LoRA is not enabled on this worker")
        return manager

    WorkerBase.loraplane_pin_lora = lambda self, lora_id: pin(manager_of(self), lora_id)
    WorkerBase.loraplane_unpin_lora = lambda self, lora_id: unpin(manager_of(self), lora_id)
    WorkerBase.loraplane_offload_lora = lambda self, lora_id: offload(manager_of(self), lora_id)


# --- API server side --------------------------------------------------------------------------------------------------


def _hook_serving_models() -> None:
    """Remember the API server's ``OpenAIServingModels`` (name -> LoRARequest), to name copies by registration."""
    try:
        from vllm.entrypoints.openai.models.serving import OpenAIServingModels
    except ImportError:  # another layout: copies are named by the worker's request name
        return
    if getattr(OpenAIServingModels, "_loraplane_residency", False):
        return
    OpenAIServingModels._loraplane_residency = True
    init = OpenAIServingModels.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        global _serving_models
        init(self, *args, **kwargs)
        _serving_models = weakref.ref(self)

    OpenAIServingModels.__init__ = __init__


#: the admin routes (under /v1: vLLM's --api-key guards them; not among the paths a gateway forwards)
PIN_PATH = "/v1/loraplane/pin_lora_adapter"
UNPIN_PATH = "/v1/loraplane/unpin_lora_adapter"
OFFLOAD_PATH = "/v1/loraplane/offload_lora_adapter"


def _hook_admin_routes() -> None:
    """Add pin, unpin and offload next to vLLM's load/unload routes (only where those exist: runtime updating on)."""
    import vllm.entrypoints.serve as serve

    if getattr(serve, "_loraplane_admin", False):
        return
    serve._loraplane_admin = True
    original = serve.register_vllm_serve_api_routers

    def register_vllm_serve_api_routers(app: Any) -> None:
        original(app)
        from vllm import envs

        if envs.VLLM_ALLOW_RUNTIME_LORA_UPDATING:
            attach_admin_routes(app)
        app.add_middleware(ServedAdapterHeaders)

    serve.register_vllm_serve_api_routers = register_vllm_serve_api_routers


#: the headers loraplane's engine sends too (``loraplane.api.headers``)
SERVED_ADAPTER_HEADER = "x-loraplane-served-adapter"
ADAPTER_DIGEST_HEADER = "x-loraplane-adapter-digest"
#: the inference routes whose body names the model
_INFERENCE_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/embeddings"})
#: a body larger than this is not kept for its ``model`` (no headers then)
_MAX_BODY = 16 << 20
_ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
#: (path, each file's (mtime, size)) -> adapter digest of those files
_digests: dict[tuple[str, tuple[tuple[int, int], ...]], str] = {}


def adapter_digest(directory: str) -> str | None:
    """``loraplane.api.adapter_digest`` of a PEFT directory (the same definition, without importing loraplane.api
    into vLLM's process); None when a file is missing (a Hub id, not a directory)."""
    domain = hashlib.sha256(b"loraplane-adapter-digest/1\n")
    try:
        for name in _ADAPTER_FILES:
            with open(os.path.join(directory, name), "rb") as f:
                domain.update(f"{name}\n{hashlib.file_digest(f, 'sha256').hexdigest()}\n".encode())
    except OSError:
        return None
    return "sha256:" + domain.hexdigest()


def served_headers(body: bytes) -> list[tuple[bytes, bytes]]:
    """The served-adapter and digest headers of the request ``body`` names: the adapter vLLM resolves its ``model``
    to (the API server's registration) and the digest of the files it read; the base model's name alone for a base
    request; none for a model vLLM does not know."""
    models = _serving_models() if _serving_models is not None else None
    try:
        model = json.loads(body).get("model") if body else None
    except (ValueError, AttributeError):
        return []
    if models is None or not isinstance(model, str):
        return []
    lora = models.lora_requests.get(model)
    if lora is None:
        return [(SERVED_ADAPTER_HEADER.encode(), model.encode())] if models.is_base_model(model) else []
    path = str(lora.lora_path)
    try:  # files rewritten in place (a load_inplace from the same path) get their digest computed again
        stamps = tuple((st.st_mtime_ns, st.st_size) for st in (os.stat(os.path.join(path, n)) for n in _ADAPTER_FILES))
    except OSError:
        return [(SERVED_ADAPTER_HEADER.encode(), model.encode())]
    key = (path, stamps)
    if key not in _digests:
        digest = adapter_digest(path)
        if digest is None:
            return [(SERVED_ADAPTER_HEADER.encode(), model.encode())]
        _digests[key] = digest
    return [(SERVED_ADAPTER_HEADER.encode(), model.encode()), (ADAPTER_DIGEST_HEADER.encode(), _digests[key].encode())]


class ServedAdapterHeaders:
    """ASGI middleware: the inference responses of vLLM's API server carry the served adapter and its digest, as
    loraplane's engine's do. The request body is kept as the app reads it (nothing is read ahead)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope.get("type") != "http" or scope.get("method") != "POST" or scope.get("path") not in _INFERENCE_PATHS:
            await self.app(scope, receive, send)
            return
        body = bytearray()

        async def receive_body() -> Any:
            message = await receive()
            if message.get("type") == "http.request" and len(body) <= _MAX_BODY:
                body.extend(message.get("body", b""))
            return message

        async def send_headers(message: Any) -> None:
            if message.get("type") == "http.response.start" and message.get("status", 500) < 400 and (
                    len(body) <= _MAX_BODY):
                message = {**message, "headers": [*message.get("headers", ()), *served_headers(bytes(body))]}
            await send(message)

        await self.app(scope, receive_body, send_headers)


def _error(status: int, message: str, kind: str) -> Any:
    from fastapi.responses import JSONResponse

    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


def attach_admin_routes(app: Any) -> None:
    """``POST {PIN,UNPIN,OFFLOAD}_PATH`` with ``{"lora_name": ...}``: vLLM's own pin (the adapter read back first
    when its copy fell out), unpin and offload, run in the worker (``collective_rpc``, :func:`pin`, :func:`unpin`,
    :func:`offload`). 404 for an unknown name; 409 to offload a pinned adapter or to pin the last unpinned GPU slot
    or host copy; 200 with ``{"lora_name", "pinned" | "offloaded"}``."""
    from starlette.responses import JSONResponse

    async def target(request: Any) -> tuple[Any, Any] | Any:
        try:
            body = await request.json()
        except ValueError:
            body = None
        name = body.get("lora_name") if isinstance(body, dict) else None
        if not isinstance(name, str) or not name:
            return _error(400, "'lora_name' must be provided", "InvalidUserInput")
        lora = request.app.state.openai_serving_models.lora_requests.get(name)
        if lora is None:
            return _error(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError")
        return lora, request.app.state.engine_client

    async def pin_route(request: Any) -> Any:
        found = await target(request)
        if not isinstance(found, tuple):
            return found
        lora, engine = found
        await engine.add_lora(lora)  # a copy LRU pushed out is read back (and activated) first
        results = set(await engine.collective_rpc("loraplane_pin_lora", args=(lora.lora_int_id,)))
        if results != {"pinned"}:
            return _error(409, f"The lora adapter '{lora.lora_name}' cannot be pinned ({', '.join(sorted(results))}): "
                          "vLLM needs one unpinned GPU slot and host copy for other adapters.", "Conflict")
        return JSONResponse({"lora_name": lora.lora_name, "pinned": True})

    async def unpin_route(request: Any) -> Any:
        found = await target(request)
        if not isinstance(found, tuple):
            return found
        lora, engine = found
        was = await engine.collective_rpc("loraplane_unpin_lora", args=(lora.lora_int_id,))
        return JSONResponse({"lora_name": lora.lora_name, "pinned": False, "was_pinned": any(was)})

    async def offload_route(request: Any) -> Any:
        found = await target(request)
        if not isinstance(found, tuple):
            return found
        lora, engine = found
        results = set(await engine.collective_rpc("loraplane_offload_lora", args=(lora.lora_int_id,)))
        if "pinned" in results:
            return _error(409, f"The lora adapter '{lora.lora_name}' is pinned: unpin it first.", "Conflict")
        return JSONResponse({"lora_name": lora.lora_name, "offloaded": "offloaded" in results})

    # Starlette routes (the endpoint takes the request as is): vLLM's middleware (--api-key) still applies
    app.add_route(PIN_PATH, pin_route, methods=["POST"])
    app.add_route(UNPIN_PATH, unpin_route, methods=["POST"])
    app.add_route(OFFLOAD_PATH, offload_route, methods=["POST"])


def registered_ids() -> dict[int, str] | None:
    """The API server's current registrations (int id -> name); None outside an API server."""
    models = _serving_models() if _serving_models is not None else None
    if models is None:
        return None
    return {request.lora_int_id: name for name, request in list(models.lora_requests.items())}


def read_snapshots(directory: str) -> list[dict[str, Any]]:
    """Every worker's snapshot in ``directory`` (unreadable or half-written files skipped)."""
    found = []
    try:
        entries = sorted(os.listdir(directory))
    except OSError:
        return []
    for entry in entries:
        if not entry.endswith(".json"):
            continue
        try:
            with open(os.path.join(directory, entry)) as f:
                found.append(json.load(f))
        except (OSError, ValueError):
            continue
    return found


class ResidencyCollector:
    """Reads the workers' snapshots at each scrape and yields the residency series."""

    def __init__(self, directory: str, names: Callable[[], dict[int, str] | None] = registered_ids) -> None:
        self.directory = directory
        self.names = names

    def describe(self) -> list[Any]:
        """Nothing up front (the series depend on what the workers hold)."""
        return []

    def collect(self) -> Iterator[Any]:
        """The families, one sample set per engine (data-parallel rank; tensor-parallel workers agree: one kept)."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        per_engine: dict[str, dict[str, Any]] = {}
        for snap in read_snapshots(self.directory):
            per_engine.setdefault(str(snap.get("engine", "0")), snap)
        if not per_engine:
            return
        current = self.names()
        loaded = GaugeMetricFamily(LOADED, "LoRA adapters resident in this server: level gpu (in a GPU slot) or cpu "
                                   "(only in the host cache); the series goes when the copy is evicted",
                                   labels=["engine", "adapter_name", "level", "pinned", "rank"])
        num_gpu = GaugeMetricFamily(NUM_GPU, "LoRA adapter copies in GPU slots", labels=["engine"])
        num_cpu = GaugeMetricFamily(NUM_CPU, "LoRA adapter copies in the host cache (including those also in a GPU "
                                    "slot)", labels=["engine"])
        max_gpu = GaugeMetricFamily(MAX_GPU, "GPU LoRA slots (--max-loras)", labels=["engine"])
        unregistered = GaugeMetricFamily(UNREGISTERED, "copies of unloaded adapter names still held by vLLM's caches",
                                         labels=["engine", "level"])
        evictions = CounterMetricFamily(EVICTIONS, "LoRA adapter copies pushed out of a GPU slot (level gpu) or the "
                                        "host cache (level cpu) by vLLM's LRU", labels=["engine", "level"])
        seconds = HistogramMetricFamily(LOAD_SECONDS, "Seconds the worker took to read a LoRA adapter into a host "
                                        "copy (files to tensors)", labels=["engine"])
        for engine, snap in sorted(per_engine.items()):
            copies = snap.get("copies", [])
            stale = {"gpu": 0, "cpu": 0}
            for copy in copies:
                name = copy["name"] if current is None else current.get(copy["id"])
                if name is None:
                    stale["gpu" if copy["gpu"] else "cpu"] += 1
                    continue
                loaded.add_metric([engine, name, "gpu" if copy["gpu"] else "cpu",
                                   "true" if copy["pinned"] else "false", str(copy["rank"])], 1.0)
            num_gpu.add_metric([engine], float(sum(1 for c in copies if c["gpu"])))
            num_cpu.add_metric([engine], float(len(copies)))
            max_gpu.add_metric([engine], float(snap.get("max_loras", 0)))
            for level in ("gpu", "cpu"):
                unregistered.add_metric([engine, level], float(stale[level]))
                evictions.add_metric([engine, level], float(snap.get("evictions", {}).get(level, 0)))
            hist = snap.get("load_seconds", {})
            bounds, counts = hist.get("buckets", []), hist.get("counts", [])
            cumulative, buckets = 0, []
            for bound, count in zip([*(str(float(b)) for b in bounds), "+Inf"], counts, strict=False):
                cumulative += count
                buckets.append((bound, float(cumulative)))
            seconds.add_metric([engine], buckets, float(hist.get("sum", 0.0)))
        yield from (loaded, num_gpu, num_cpu, max_gpu, unregistered, evictions, seconds)


def _register_collector(directory: str) -> None:
    """Register in the registry vLLM's ``/metrics`` serves: prometheus_client's global one (one API server), and
    the one ``get_prometheus_registry`` builds in multiprocess mode (several API servers)."""
    from prometheus_client import REGISTRY

    collector = ResidencyCollector(directory)
    REGISTRY.register(collector)
    try:
        import vllm.v1.metrics.prometheus as prom
    except ImportError:
        return
    original = prom.get_prometheus_registry

    def get_prometheus_registry() -> Any:
        registry = original()
        if registry is not REGISTRY:
            registry.register(collector)
        return registry

    prom.get_prometheus_registry = get_prometheus_registry
    served = sys.modules.get("vllm.entrypoints.serve.instrumentator.metrics")  # imported it by name already
    if served is not None:
        served.get_prometheus_registry = get_prometheus_registry  # type: ignore[attr-defined]
