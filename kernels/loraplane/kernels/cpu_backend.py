"""The native CPU backend: float32 hot loops in C (``csrc/lora_cpu.c``), compiled on first use, called via ctypes.

Why native: on CPU the torch backend spends a decode step on ~24 small BLAS calls (20-60 us each) plus row
copies; one C call per layer walks the plan's segments, reads each adapter's A/B once and addresses rows through
``sorted_tokens`` (no gather/scatter). Anything the C code does not cover (other dtypes, non-CPU tensors, rows
whose inner dimension is strided) is computed by the torch backend.

The library is built with the system C compiler (``$CC``, default ``cc``) into a per-user cache directory
(``$LORAPLANE_CACHE_DIR``, else ``$XDG_CACHE_HOME/loraplane``, else ``~/.cache/loraplane``) under a name keyed by
a hash of the source, the compiler's version, the flags and the machine; it is compiled to a temporary name and
renamed atomically, so a concurrent or interrupted build never leaves a file that is loaded half-written.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from loraplane.kernels.plan import BatchPlan
from loraplane.kernels.slots import LoraSlots
from loraplane.kernels.torch_backend import TorchBackend

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "lora_cpu.c"
#: ``-fopenmp``: the library's ``libgomp.so.1`` resolves to the one torch has already loaded, so a call shares its
#: segments out to torch's own intra-op threads (as many as ``torch.get_num_threads()``). A private thread pool
#: (pthreads) competed with torch's threads still spinning after the previous op: 15.1 vs 11.2 ms on prefill
#: 2048x8 with two threads (docs/kernels.md).
FLAGS = ("-O3", "-march=native", "-shared", "-fPIC", "-std=gnu11", "-fopenmp")
COMPILE_TIMEOUT_S = 60
CACHE_ENV = "LORAPLANE_CACHE_DIR"


class NativeBuildError(RuntimeError):
    """The C library could not be compiled or loaded."""


class _Layer(ctypes.Structure):
    """``lp_layer`` of ``csrc/lora_cpu.c``: one layer's slots and the step's plan, as raw pointers."""

    _fields_ = [
        ("n_segments", ctypes.c_int32),
        ("segment_slots", ctypes.c_void_p),
        ("segment_starts", ctypes.c_void_p),
        ("segment_rows", ctypes.c_void_p),
        ("sorted_tokens", ctypes.c_void_p),
        ("slot_ranks", ctypes.c_void_p),
        ("n_slices", ctypes.c_int32),
        ("rank_pad", ctypes.c_int32),
        ("d_in", ctypes.c_int32),
        ("slice_offsets", ctypes.c_void_p),
        ("slice_widths", ctypes.c_void_p),
        ("a_slots", ctypes.c_void_p),
        ("b_slots", ctypes.c_void_p),
    ]


def cache_dir() -> Path:
    """Where compiled libraries are kept (see the module docstring)."""
    explicit = os.environ.get(CACHE_ENV)
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "loraplane"


def _compiler() -> str:
    return os.environ.get("CC") or "cc"


def _machine() -> str:
    """The target machine for ``-march=native``: architecture plus the CPU's feature flags where Linux lists them."""
    flags = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            flags = next((line for line in cpuinfo if line.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    return f"{platform.machine()} {flags.strip()}"


def library_path(compiler: str, directory: Path) -> Path:
    """The cached library's path for this source, compiler, flags and machine (raises if the compiler fails)."""
    try:
        version = subprocess.run(
            [compiler, "--version"], capture_output=True, check=True, timeout=COMPILE_TIMEOUT_S
        ).stdout
    except (OSError, subprocess.SubprocessError) as error:
        raise NativeBuildError(f"C compiler {compiler!r} is not usable: {error}") from error
    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), version, " ".join(FLAGS).encode(), _machine().encode()):
        key.update(hashlib.sha256(part).digest())
    return directory / f"lora_cpu-{key.hexdigest()[:24]}.so"


def build(compiler: str | None = None, directory: Path | None = None) -> Path:
    """Compile the library unless the cache holds it; returns its path. Raises :class:`NativeBuildError`."""
    compiler = compiler or _compiler()
    directory = directory or cache_dir()
    target = library_path(compiler, directory)
    if target.exists():
        return target
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, temporary = tempfile.mkstemp(prefix=target.name + ".", suffix=".tmp", dir=directory)
        os.close(fd)
    except OSError as error:
        raise NativeBuildError(f"cannot write the kernel cache {directory}: {error}") from error
    try:
        result = subprocess.run(
            [compiler, *FLAGS, "-o", temporary, str(SOURCE)], capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S
        )
        if result.returncode != 0:
            raise NativeBuildError(f"{compiler} failed: {result.stderr.strip()[-2000:]}")
        os.replace(temporary, target)  # atomic: only a complete library ever has the final name
    except (OSError, subprocess.SubprocessError) as error:
        raise NativeBuildError(f"compiling {SOURCE.name} with {compiler!r} failed: {error}") from error
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)
    return target


def load(compiler: str | None = None, directory: Path | None = None) -> ctypes.CDLL:
    """Build if needed and load the library; a cached file that does not load is rebuilt once."""
    path = build(compiler, directory)
    try:
        return _bind(ctypes.CDLL(str(path)))
    except OSError:
        path.unlink(missing_ok=True)  # damaged outside our atomic rename (disk, manual copy): build it again
    try:
        return _bind(ctypes.CDLL(str(build(compiler, directory))))
    except OSError as error:
        raise NativeBuildError(f"cannot load {path}: {error}") from error


def _bind(library: ctypes.CDLL) -> ctypes.CDLL:
    layer, pointer, stride = ctypes.POINTER(_Layer), ctypes.c_void_p, ctypes.c_int64
    for name in ("lp_apply_f32", "lp_shrink_f32", "lp_expand_f32"):
        function = getattr(library, name)
        function.argtypes = [layer, pointer, stride, pointer, stride, ctypes.c_int]
        function.restype = None
    library.lp_max_width.argtypes = []
    library.lp_max_width.restype = ctypes.c_int
    return library


@dataclass
class _Library:
    """The process-wide library, or why there is none (built at most once per process)."""

    handle: ctypes.CDLL | None = None
    error: str | None = None
    tried: bool = False


_library = _Library()
_library_lock = threading.Lock()


def shared_library() -> ctypes.CDLL | None:
    """The loaded library, building it on first use; None (one warning logged) when it cannot be built."""
    with _library_lock:
        if not _library.tried:
            _library.tried = True
            try:
                _library.handle = load()
            except NativeBuildError as error:
                _library.error = str(error)
                log.warning("native cpu kernels unavailable, using the torch backend: %s", error)
        return _library.handle


def available() -> bool:
    """True when the native library is built and loaded (builds it on first call)."""
    return shared_library() is not None


#: Packed A^T columns per slot are padded to this many floats, packed B blocks are this many columns wide
#: (``csrc/lora_cpu.c``).
A_COLUMNS_MULTIPLE = 8
B_BLOCK_COLUMNS = 32


#: One slot packed: A^T and, per output slice, its B blocks.
PackedSlot = tuple[torch.Tensor, tuple[torch.Tensor, ...]]


@dataclass
class _SlotsLayout:
    """The weights packed for the C kernels, per slot, and the static part of the layer struct pointing at them."""

    version: int
    slot_versions: list[int]
    packed: list[PackedSlot | None]
    layer: _Layer
    max_width: int
    keep: tuple[torch.Tensor, ...]


def packed_width(slots: LoraSlots, rank: int) -> int:
    """Columns of a slot's packed A^T: its slices' ranks side by side, rounded up to ``A_COLUMNS_MULTIPLE``."""
    return -(-slots.n_slices * rank // A_COLUMNS_MULTIPLE) * A_COLUMNS_MULTIPLE


def pack_slot(slots: LoraSlots, slot: int) -> PackedSlot | None:
    """The slot's A^T ``[d_in, packed_width]`` and per slice its B in 32-column blocks ``[blocks, rank, 32]``.

    Only the slot's own rank is packed, so the copy is about the size of the loaded adapter (None when empty).
    """
    rank = slots.ranks[slot]
    if rank == 0:
        return None
    rows = [slots.lora_a[slot, s * slots.rank_pad : s * slots.rank_pad + rank, : slots.d_in] for s in range(slots.n_slices)]
    a_t = torch.zeros(slots.d_in, packed_width(slots, rank))
    a_t[:, : slots.n_slices * rank] = torch.cat(rows).t()
    b_blocks = []
    for index in range(slots.n_slices):
        b = slots.slice_b(slot, index, rank)
        blocks = -(-b.shape[1] // B_BLOCK_COLUMNS)
        padded = torch.zeros(rank, blocks * B_BLOCK_COLUMNS)
        padded[:, : b.shape[1]] = b
        b_blocks.append(padded.view(rank, blocks, B_BLOCK_COLUMNS).transpose(0, 1).contiguous())
    return a_t, tuple(b_blocks)


class CpuBackend:
    """Shrink / expand / fused apply in C for float32 CPU tensors; everything else via :class:`TorchBackend`.

    The C kernels read weights packed per slot (:func:`pack_slot`), repacked lazily at the first call after that
    slot changed (``LoraSlots.slot_versions``): loading an adapter repacks its own slot of each layer, once.
    """

    name = "cpu"

    def __init__(self, library: ctypes.CDLL | None = None) -> None:
        library = library or shared_library()
        if library is None:
            raise RuntimeError(f"the cpu kernels backend is unavailable: {_library.error}")
        self._lib = library
        self._max_width = library.lp_max_width()
        self.torch = TorchBackend()
        self._layouts: weakref.WeakKeyDictionary[LoraSlots, _SlotsLayout] = weakref.WeakKeyDictionary()

    def shrink(self, x: torch.Tensor, slots: LoraSlots, plan: BatchPlan) -> torch.Tensor:
        """``t = x A^T`` per row's slot (float32, zero rows without LoRA)."""
        layout = self._native(slots, plan, x)
        if layout is None:
            return self.torch.shrink(x, slots, plan)
        t = torch.zeros(plan.num_tokens, slots.lora_a.shape[1], dtype=torch.float32)
        self._call(self._lib.lp_shrink_f32, layout, plan, x, t)
        return t

    def expand(self, y: torch.Tensor, t: torch.Tensor, slots: LoraSlots, plan: BatchPlan) -> None:
        """``y += t B^T`` per row's slot and output slice."""
        layout = self._native(slots, plan, y, t)
        if layout is None:
            self.torch.expand(y, t, slots, plan)
        else:
            self._call(self._lib.lp_expand_f32, layout, plan, t, y)

    def apply(self, y: torch.Tensor, x: torch.Tensor, slots: LoraSlots, plan: BatchPlan) -> None:
        """Fused ``y += x A^T B^T``; the per-chunk intermediate stays on the C stack."""
        layout = self._native(slots, plan, y, x)
        if layout is None:
            self.torch.apply(y, x, slots, plan)
        else:
            self._call(self._lib.lp_apply_f32, layout, plan, x, y)

    def _native(self, slots: LoraSlots, plan: BatchPlan, *tensors: torch.Tensor) -> _SlotsLayout | None:
        """The packed layout when the C kernels cover this call (float32 CPU operands with unit inner stride, plan
        on the host, every rank within the stack intermediate), else None."""
        if slots.dtype != torch.float32 or not slots.lora_a.is_cpu or plan.no_lora:
            return None
        if not all(t.is_cpu and t.dtype == torch.float32 and t.stride(1) == 1 for t in tensors):
            return None
        if not (plan.sorted_tokens.is_cpu and plan.segment_slots.is_cpu):
            return None
        layout = self._layout(slots)
        return layout if layout.max_width <= self._max_width else None

    @staticmethod
    def _call(function: Callable[..., None], layout: _SlotsLayout, plan: BatchPlan, src: torch.Tensor, dst: torch.Tensor) -> None:
        layer = _Layer.from_buffer_copy(layout.layer)  # per call: concurrent calls never share plan pointers
        layer.n_segments = len(plan.segments)
        layer.segment_slots = plan.segment_slots.data_ptr()
        layer.segment_starts = plan.segment_starts.data_ptr()
        layer.segment_rows = plan.segment_rows.data_ptr()
        layer.sorted_tokens = plan.sorted_tokens.data_ptr()
        threads = torch.get_num_threads()
        function(ctypes.byref(layer), src.data_ptr(), src.stride(0), dst.data_ptr(), dst.stride(0), threads)

    def _layout(self, slots: LoraSlots) -> _SlotsLayout:
        """The packed layout of ``slots``, repacking only the slots that changed since the last call."""
        layout = self._layouts.get(slots)
        if layout is not None and layout.version == slots.version:
            return layout
        packed: list[PackedSlot | None] = list(layout.packed) if layout is not None else [None] * slots.num_slots
        for slot, version in enumerate(slots.slot_versions):
            if layout is None or layout.slot_versions[slot] != version:
                packed[slot] = pack_slot(slots, slot)
        a_pointers: list[int] = []
        b_pointers: list[int] = []
        for entry in packed:
            a_pointers.append(entry[0].data_ptr() if entry else 0)
            b_pointers.extend([b.data_ptr() for b in entry[1]] if entry else [0] * slots.n_slices)
        a_slots = torch.tensor(a_pointers, dtype=torch.int64)
        b_slots = torch.tensor(b_pointers, dtype=torch.int64)
        tables = (
            torch.tensor(slots.ranks, dtype=torch.int32),
            torch.tensor(slots.slice_offsets, dtype=torch.int64),
            torch.tensor(slots.out_slices, dtype=torch.int64),
            a_slots,
            b_slots,
        )
        ranks, slice_offsets, slice_widths = tables[:3]
        layer = _Layer(
            slot_ranks=ranks.data_ptr(),
            n_slices=slots.n_slices,
            rank_pad=slots.rank_pad,
            d_in=slots.d_in,
            slice_offsets=slice_offsets.data_ptr(),
            slice_widths=slice_widths.data_ptr(),
            a_slots=a_slots.data_ptr(),
            b_slots=b_slots.data_ptr(),
        )
        layout = _SlotsLayout(
            slots.version, list(slots.slot_versions), packed, layer, packed_width(slots, max(slots.ranks)), tables
        )
        self._layouts[slots] = layout
        return layout
