"""Reading PEFT LoRA adapters: path confinement, disk read, parse, and checks against the base model."""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import math
import mmap
import os
import stat
import sys
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Executor, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

import orjson
import torch

from loraplane.api import ADAPTER_CONFIG_FILE, ADAPTER_FILES, ADAPTER_WEIGHTS_FILE
from loraplane.api.adapterfiles import adapter_digest_of
from loraplane.engine.model import LORA_MODULES, ModelConfig, module_path, single_intra_op_thread
from loraplane.kernels.peft import (
    AdapterFormatError,
    LoraModuleWeights,
    PeftAdapter,
    PeftLoraConfig,
    adapter_from_state_dict,
)


class AdapterNotFoundError(LookupError):
    """The adapter directory or one of its files does not exist (vLLM answers 404)."""


class AdapterRejectedError(ValueError):
    """The adapter exists but cannot be loaded: outside the root, malformed, or incompatible with the base model."""


def confine(root: Path, requested: str) -> Path:
    """The adapter directory ``requested`` names, guaranteed to lie inside ``root`` after resolving symlinks.

    A relative path is taken relative to ``root``. Refused: ``..`` escapes, absolute paths elsewhere, and symlinks
    (of the directory or of its files) that point outside ``root``. Plain ``os.path`` and ``os.lstat`` calls
    (pathlib's ``resolve`` costs several times more); the engine runs it in the loader thread.
    """
    if "\x00" in requested:
        raise AdapterRejectedError("lora_path contains a NUL byte")
    real_root = os.path.realpath(root, strict=True)
    inside = real_root if real_root.endswith(os.sep) else real_root + os.sep

    def within(path: str) -> bool:
        return path == real_root or path.startswith(inside)

    joined = os.path.join(real_root, requested)  # an absolute one replaces the root
    # outside paths get one answer whether they exist or not: the lax resolve (links followed as far as they exist)
    # decides, before anything is looked up strictly
    if not within(os.path.realpath(joined)):
        raise AdapterRejectedError(f"lora_path {requested!r} is outside the adapter root")
    try:
        resolved = os.path.realpath(joined, strict=True)
    except (FileNotFoundError, NotADirectoryError):
        raise AdapterNotFoundError(f"No adapter found for {requested}") from None
    except OSError as exc:
        raise AdapterRejectedError(f"lora_path {requested!r} cannot be resolved: {exc}") from None
    if not within(resolved):
        raise AdapterRejectedError(f"lora_path {requested!r} is outside the adapter root")
    if not os.path.isdir(resolved):
        raise AdapterNotFoundError(f"No adapter found for {requested}: not a directory")
    for name in ADAPTER_FILES:  # inside a resolved directory, only a file that is itself a link can lead elsewhere
        file = os.path.join(resolved, name)
        try:
            if stat.S_ISLNK(os.lstat(file).st_mode) and not within(os.path.realpath(file, strict=True)):
                raise AdapterRejectedError(f"{name} in {requested!r} links outside the adapter root")
        except (FileNotFoundError, NotADirectoryError):
            raise AdapterNotFoundError(f"No adapter found for {requested}: {name} is missing") from None
        except OSError as exc:
            raise AdapterRejectedError(f"{name} in {requested!r} cannot be resolved: {exc}") from None
    return Path(resolved)


FileIdentity = tuple[int, int, int, int, int]


def _identity(status: os.stat_result) -> FileIdentity:
    """What changes whenever a file's bytes can have changed: device, inode, size, mtime and ctime (ns).

    ctime cannot be set back by an ordinary process, so an in-place rewrite that restores size and mtime is
    still noticed.
    """
    return status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns, status.st_ctime_ns


#: A large file is read in chunks of this many bytes, taken in turn by the threads that read it at once
#: (measured: docs/engine.md "Load path").
READ_CHUNK_BYTES = 4 << 20


def default_read_threads() -> int:
    """Threads that read one large file at once unless told otherwise: this process's CPUs, at most 4."""
    return min(4, len(os.sched_getaffinity(0)))


#: Buffers from this size on are anonymous memory advised into huge pages, and pooled.
_HUGE_PAGE = 2 << 20


def _fresh_buffer(size: int) -> mmap.mmap:
    """Anonymous memory of ``size`` bytes rounded up to whole huge pages, advised into huge pages where possible."""
    memory = mmap.mmap(-1, -(-size // _HUGE_PAGE) * _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        memory.madvise(mmap.MADV_HUGEPAGE)
    return memory


class HostBuffers:
    """Host memory that adapter weights are read into, kept warm and reused once no tensor views it any more.

    Reading a file into fresh memory costs a page fault and the kernel zeroing every page before the read can copy
    into it: 38 MB into fresh huge pages took 1.5x a read of the same page-cached bytes into memory already faulted
    in (4 KiB pages: 2-4x). So the buffers of adapters that left host memory are kept and the next file that fits goes
    into one, and a load then costs one copy out of the page cache, like a plain read. Parsed tensors view the
    buffer; every tensor's storage holds a reference to it, so a buffer counts as free only when the pool's own
    reference is the last one, and one still viewed (by an adapter in host memory, or by a request) is never reused.

    Bounded: at most ``capacity`` buffers are kept, in use and free together (the engine passes its host tier's
    adapter count plus one), so the pool never holds more than the host tier itself may hold; beyond that, buffers
    are freed with their last tensor. Files under 2 MiB use the ordinary allocator. With ``pinned`` (CUDA) buffers
    are page-locked by torch's caching host allocator, which reuses freed blocks the same way.
    """

    def __init__(self, capacity: int, pinned: bool = False) -> None:
        self.capacity = capacity
        self.pinned = pinned
        self._buffers: list[mmap.mmap] = []
        self._lock = threading.Lock()

    def take(self, size: int) -> torch.Tensor:
        """A writable uint8 tensor of ``size`` bytes (contents undefined) that tensors parsed from it may view."""
        if self.pinned:
            return torch.empty(size, dtype=torch.uint8, pin_memory=True)
        if size < _HUGE_PAGE:
            return torch.empty(size, dtype=torch.uint8)
        with self._lock:
            buffers = self._buffers
            # Free: referenced only by the list (and getrefcount's own argument); every viewing storage adds one.
            free = [i for i in range(len(buffers)) if sys.getrefcount(buffers[i]) == 2]
            fitting = [i for i in free if len(buffers[i]) >= size]
            if fitting:
                buffer = buffers[min(fitting, key=lambda i: len(buffers[i]))]
            else:
                buffer = _fresh_buffer(size)
                if len(buffers) >= self.capacity and free:
                    del buffers[free[0]]  # none of the free ones fits: the oldest makes room
                if len(buffers) < self.capacity:
                    buffers.append(buffer)
            return torch.frombuffer(buffer, dtype=torch.uint8, count=size)

    @property
    def held_bytes(self) -> int:
        """Bytes of all kept buffers, in use or free."""
        with self._lock:
            return sum(len(b) for b in self._buffers)


#: Fresh memory for every read (nothing kept).
_UNPOOLED = HostBuffers(capacity=0)


class FileDigests:
    """sha256 of files already hashed, keyed by path and valid only while the file's identity is unchanged.

    Hashing 38 MB costs about as much as reading it, so a file read back after eviction (or loaded again under
    another name) is not hashed again when nothing about it changed; any change of :func:`_identity` means a new
    hash of the bytes actually read. Bounded: the least recently used paths are forgotten first. Loader threads
    share one instance. With ``read_threads`` > 1 a large file is read by that many threads at once
    (:func:`read_parallel`): one core's copy out of the page cache is the limit of a single read.
    """

    def __init__(self, capacity: int = 1024, read_threads: int = 1) -> None:
        if read_threads < 1:
            raise ValueError("read_threads must be at least 1")
        self.capacity = capacity
        self.read_threads = read_threads
        self._known: OrderedDict[str, tuple[FileIdentity, str]] = OrderedDict()
        self._lock = threading.Lock()
        self._readers = ThreadPoolExecutor(max(1, read_threads - 1), "adapter-read")  # helpers of the calling thread

    def read(self, path: Path, buffers: HostBuffers | None = None) -> tuple[torch.Tensor, str]:
        """The file's bytes (one read, into a uint8 tensor from ``buffers`` that parsed tensors can view) and their
        hex sha256. Without ``buffers`` the memory is fresh."""
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            before = _identity(os.fstat(fd))
            size = before[2]
            data = (buffers or _UNPOOLED).take(size)
            view = data.numpy().data
            if not read_parallel(fd, view, size, self._readers, self.read_threads - 1) or os.pread(fd, 1, size):
                raise OSError(f"{path.name} changed size while being read")
            unchanged = _identity(os.fstat(fd)) == before
        finally:
            os.close(fd)
        key = str(path)
        with self._lock:
            known = self._known.get(key)
            if unchanged and known is not None and known[0] == before:
                self._known.move_to_end(key)
                return data, known[1]
        digest = hashlib.sha256(view).hexdigest()
        if unchanged:
            with self._lock:
                self._known[key] = (before, digest)
                self._known.move_to_end(key)
                while len(self._known) > self.capacity:
                    self._known.popitem(last=False)
        return data, digest


def read_parallel(fd: int, view: memoryview, size: int, readers: Executor, helpers: int) -> bool:
    """Fill ``view[:size]`` from ``fd``; False when the file ended early.

    A file of several ``READ_CHUNK_BYTES`` chunks is read by the calling thread and up to ``helpers``
    threads of ``readers`` at once, each taking the next unread chunk whenever it is free (a thread that gets less
    CPU simply reads fewer chunks).
    """
    chunks = [(first, min(size, first + READ_CHUNK_BYTES)) for first in range(0, size, READ_CHUNK_BYTES)]
    if helpers < 1 or len(chunks) < 2:
        return read_range(fd, view, 0, size)
    taken = itertools.count()  # next() on a count is atomic under the GIL: every chunk is read exactly once

    def drain() -> bool:
        complete = True
        while (index := next(taken)) < len(chunks):
            complete = read_range(fd, view, *chunks[index]) and complete
        return complete

    others = [readers.submit(drain) for _ in range(min(helpers, len(chunks) - 1))]
    try:
        complete = drain()
    finally:
        wait(others)  # none may still write into the buffer, or read the descriptor, once this returns
    return all([other.result() for other in others]) and complete


def read_range(fd: int, view: memoryview, first: int, end: int) -> bool:
    """Fill ``view[first:end]`` with the file's bytes at the same offsets; False when the file ended early."""
    while first < end:
        n = os.preadv(fd, [view[first:end]], first)
        if n == 0:
            return False
        first += n
    return True


@dataclass(frozen=True)
class AdapterFiles:
    """The raw bytes of an adapter as read from disk (the weights as a uint8 tensor), and their digest."""

    config: bytes
    weights: torch.Tensor
    digest: str

    @property
    def nbytes(self) -> int:
        """Bytes of both files."""
        return len(self.config) + self.weights.numel()

    @classmethod
    def read(cls, adapter_dir: Path, digests: FileDigests | None = None,
             buffers: HostBuffers | None = None) -> AdapterFiles:
        """Read both files once each (the disk-read stage), the weights into ``buffers``, hashing only bytes
        ``digests`` has not seen."""
        digests = digests or FileDigests()
        config, config_sha = digests.read(adapter_dir / ADAPTER_CONFIG_FILE)
        weights, weights_sha = digests.read(adapter_dir / ADAPTER_WEIGHTS_FILE, buffers)
        digest = adapter_digest_of({ADAPTER_CONFIG_FILE: config_sha, ADAPTER_WEIGHTS_FILE: weights_sha})
        return cls(config.numpy().tobytes(), weights, digest)


def host_copy(adapter: PeftAdapter, dtype: torch.dtype, pin: bool) -> PeftAdapter:
    """The adapter's tensors in the serving dtype, contiguous, page-locked when ``pin`` (fast copies to CUDA).

    An adapter whose tensors are all in that form already (views of a file read into :class:`HostBuffers`) is
    returned as it is: no copy, and not one torch call per tensor.
    """
    tensors = [t for m in adapter.modules.values() for t in (m.lora_a, m.lora_b)]
    if all(t.dtype == dtype and t.is_contiguous() for t in tensors) and (not pin or all(t.is_pinned() for t in tensors)):
        return adapter

    def prepare(t: torch.Tensor) -> torch.Tensor:
        t = t.to(dtype).contiguous()
        return t.pin_memory() if pin else t

    with single_intra_op_thread():
        modules = {name: LoraModuleWeights(prepare(m.lora_a), prepare(m.lora_b), m.scale)
                   for name, m in adapter.modules.items()}
    return PeftAdapter(adapter.config, modules)


#: safetensors dtype names the engine serves.
_SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}


class _StorageViews:
    """Tensors of any dtype viewed at byte offsets of one uint8 tensor's storage, one ``as_strided`` each."""

    def __init__(self, data: torch.Tensor) -> None:
        self.storage = data.untyped_storage()
        self.first = data.storage_offset()  # the uint8 tensor's first byte in its storage
        self._typed: dict[torch.dtype, torch.Tensor] = {}

    def view(self, dtype: torch.dtype, shape: Sequence[int], stride: Sequence[int], offset: int) -> torch.Tensor | None:
        """The tensor at byte ``offset`` of the data; None when that is not aligned to the element size."""
        position, itemsize = self.first + offset, dtype.itemsize
        if position % itemsize:
            return None
        return self.typed(dtype).as_strided(shape, stride, position // itemsize)

    def typed(self, dtype: torch.dtype) -> torch.Tensor:
        """The whole storage as one flat tensor of ``dtype``."""
        typed = self._typed.get(dtype)
        if typed is None:
            typed = torch.empty(0, dtype=dtype).set_(self.storage, 0, (self.storage.nbytes() // dtype.itemsize,), (1,))
            self._typed[dtype] = typed
        return typed


def safetensors_views(data: torch.Tensor) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file held in the uint8 tensor ``data``, as views of it (no copy).

    The layout is checked (header length, JSON, dtype, shape against byte range, ranges inside the data);
    :class:`AdapterFormatError` says what is wrong. Each tensor is one ``as_strided`` of a typed view of the whole
    storage (one torch call, not three); one whose offset is not aligned to its element size is copied out instead.
    Called under ``torch.inference_mode`` on an inference tensor, the views skip autograd's bookkeeping (4x faster).
    """
    size = data.numel()
    if size < 8:
        raise AdapterFormatError("too short for a safetensors header")
    raw_bytes = data.numpy().data
    header_len = int.from_bytes(raw_bytes[:8], "little")
    if header_len > size - 8:
        raise AdapterFormatError(f"header length {header_len} exceeds the file ({size} bytes)")
    try:
        header = orjson.loads(raw_bytes[8 : 8 + header_len])
    except orjson.JSONDecodeError as exc:
        raise AdapterFormatError(f"the header is not valid JSON: {exc}") from None
    if not isinstance(header, dict):
        raise AdapterFormatError("the header is not a JSON object")
    start = 8 + header_len
    views = _StorageViews(data)
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = _SAFETENSORS_DTYPES[info["dtype"]]
            shape = [int(d) for d in info["shape"]]
            begin, end = info["data_offsets"]
            begin, end = int(begin), int(end)
        except (KeyError, TypeError, ValueError):
            raise AdapterFormatError(f"tensor {name!r}: missing or unsupported dtype, shape or data_offsets") from None
        if min(shape, default=0) < 0 or not 0 <= begin <= end <= size - start or end - begin != math.prod(shape) * dtype.itemsize:
            raise AdapterFormatError(f"tensor {name!r}: data_offsets {[begin, end]} do not hold {shape} {info['dtype']}")
        strides = [1] * len(shape)
        for i in range(len(shape) - 2, -1, -1):
            strides[i] = strides[i + 1] * shape[i + 1]
        view = views.view(dtype, shape, strides, start + begin)
        if view is None:
            view = data.narrow(0, start + begin, end - begin).clone().view(dtype).view(shape)
        tensors[name] = view
    return tensors


#: One tensor viewed in a read buffer: dtype, shape, stride and storage offset (in elements) where it was parsed.
_TensorLayout = tuple[torch.dtype, tuple[int, ...], tuple[int, ...], int]


@dataclass(frozen=True)
class _KnownParse:
    """An accepted adapter's config and its tensors' layouts, for a buffer whose file starts at storage byte
    ``first``."""

    config: PeftLoraConfig
    first: int
    modules: list[tuple[str, _TensorLayout, _TensorLayout, float]]
    dtypes: frozenset[torch.dtype]


class ParsedAdapters:
    """How adapters already parsed and accepted lie in their weights file, by content digest, so reading one back
    (after an eviction or an unload) rebuilds the same views without the JSON header, the checks or the matching of
    tensor names: one ``as_strided`` per tensor, with no per-tensor alignment arithmetic.

    The digest names the exact bytes of both files (:class:`FileDigests` re-hashes any file that changed), so an
    equal digest means an equal parse and an equal verdict; one instance serves one engine (one base model and rank
    limit). Adapters with a tensor that had to be copied out (unaligned) are not remembered. Bounded (least recently
    used first out); loader threads share one instance.
    """

    def __init__(self, capacity: int = 256) -> None:
        self.capacity = capacity
        self._known: OrderedDict[str, _KnownParse] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, files: AdapterFiles) -> PeftAdapter | None:
        """The adapter in ``files`` if these bytes were parsed and accepted before (views of ``files.weights``)."""
        with self._lock:
            known = self._known.get(files.digest)
            if known is None:
                return None
            self._known.move_to_end(files.digest)
        shift = int(files.weights.storage_offset()) - known.first  # bytes; 0 for every buffer HostBuffers hands out
        if shift % 8:  # this buffer starts at another alignment (8: the largest element size): parse afresh
            return None
        views = _StorageViews(files.weights)
        typed = {dtype: views.typed(dtype) for dtype in known.dtypes}
        modules = {
            module: LoraModuleWeights(typed[a[0]].as_strided(a[1], a[2], a[3] + shift // a[0].itemsize),
                                      typed[b[0]].as_strided(b[1], b[2], b[3] + shift // b[0].itemsize), scale)
            for module, a, b, scale in known.modules
        }
        return PeftAdapter(known.config, modules)

    def remember(self, files: AdapterFiles, adapter: PeftAdapter) -> None:
        """Keep where ``adapter``'s tensors lie in ``files.weights`` (only if every one is a view of it)."""
        storage = files.weights.untyped_storage().data_ptr()

        def layout(t: torch.Tensor) -> _TensorLayout | None:
            if t.untyped_storage().data_ptr() != storage:
                return None
            return t.dtype, tuple(t.shape), t.stride(), int(t.storage_offset())

        layouts = []
        for module, weights in adapter.modules.items():
            a, b = layout(weights.lora_a), layout(weights.lora_b)
            if a is None or b is None:
                return
            layouts.append((module, a, b, weights.scale))
        dtypes = frozenset(t[0] for _, a, b, _ in layouts for t in (a, b))
        known = _KnownParse(adapter.config, int(files.weights.storage_offset()), layouts, dtypes)
        with self._lock:
            self._known[files.digest] = known
            self._known.move_to_end(files.digest)
            while len(self._known) > self.capacity:
                self._known.popitem(last=False)


def _read_peft(files: AdapterFiles) -> PeftAdapter:
    """The PEFT adapter in the raw bytes; :class:`AdapterFormatError` (with the reason) when they are not one."""
    try:
        raw = json.loads(files.config)
    except ValueError as exc:
        raise AdapterFormatError(f"{ADAPTER_CONFIG_FILE} is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise AdapterFormatError(f"{ADAPTER_CONFIG_FILE} must hold a JSON object")
    config = PeftLoraConfig.from_dict(raw)
    try:
        state = safetensors_views(files.weights)
    except AdapterFormatError as exc:
        raise AdapterFormatError(f"{ADAPTER_WEIGHTS_FILE} is not a valid safetensors file: {exc}") from None
    return adapter_from_state_dict(config, state)


@functools.cache
def _lora_shapes(base: ModelConfig) -> dict[str, tuple[int, int]]:
    """(d_in, d_out) of every projection that can take LoRA, by module path."""
    return {module_path(layer, module): base.module_shape(module)
            for layer in range(base.num_hidden_layers) for module in LORA_MODULES}


def parse_adapter(files: AdapterFiles, base: ModelConfig, max_lora_rank: int,
                  parsed: ParsedAdapters | None = None) -> PeftAdapter:
    """Parse and check an adapter against the base model (the parse stage), or rebuild it from ``parsed`` when these
    bytes were accepted before. Raises :class:`AdapterRejectedError`."""
    if parsed is not None and (known := parsed.get(files)) is not None:
        return known
    try:
        adapter = _read_peft(files)
    except AdapterFormatError as exc:
        raise AdapterRejectedError(str(exc)) from None
    if not adapter.modules:
        raise AdapterRejectedError(f"{ADAPTER_WEIGHTS_FILE} holds no LoRA tensors")
    shapes = _lora_shapes(base)
    for name, weights in adapter.modules.items():
        if name not in shapes:
            raise AdapterRejectedError(f"target module {name!r} does not exist in the base model (or cannot take LoRA)")
        d_in, d_out = shapes[name]
        a, b = weights.lora_a, weights.lora_b
        if a.shape[1] != d_in or b.shape[0] != d_out:
            raise AdapterRejectedError(
                f"{name}: A {tuple(a.shape)} / B {tuple(b.shape)} do not fit the base layer [r, {d_in}] / [{d_out}, r]"
            )
        if weights.rank > max_lora_rank:
            raise AdapterRejectedError(f"LoRA rank {weights.rank} is greater than max_lora_rank {max_lora_rank}")
    if parsed is not None:
        parsed.remember(files, adapter)
    return adapter
