"""The multi-LoRA ops and their one contract; the backend is picked by device unless overridden.

Contract (every backend):

* ``shrink(x, slots, plan) -> t``: ``t[T, n_slices * rank_pad]`` float32, ``t[i] = x[i] A_slot(i)^T`` (per slice,
  slice ``s`` in columns ``s*rank_pad ..``), zero for rows whose slot is -1.
* ``expand(y, t, slots, plan)``: ``y[i, slice s] += t[i, slice s ranks] B_s,slot(i)^T`` for rows with a slot,
  accumulated in float32 and added to ``y`` once in ``y``'s dtype; rows with slot -1 are untouched.
* ``apply_lora(y, x, slots, plan)``: ``expand(y, shrink(x))`` fused where the backend can (the intermediate never
  reaches global memory); ``lora_delta`` returns that delta alone.

The adapter scale is already folded into B (:meth:`LoraSlots.load`); no op takes a scale.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Protocol

import torch

from loraplane.kernels.plan import BatchPlan
from loraplane.kernels.slots import LoraSlots

#: Environment variable that overrides automatic backend choice (``cpu``, ``torch``, ``triton`` or ``ascend``).
BACKEND_ENV = "LORAPLANE_KERNELS_BACKEND"


class Backend(Protocol):
    """What every backend implements (see the module docstring for the contract)."""

    name: str

    def shrink(self, x: torch.Tensor, slots: LoraSlots, plan: BatchPlan) -> torch.Tensor: ...

    def expand(self, y: torch.Tensor, t: torch.Tensor, slots: LoraSlots, plan: BatchPlan) -> None: ...

    def apply(self, y: torch.Tensor, x: torch.Tensor, slots: LoraSlots, plan: BatchPlan) -> None: ...


def _torch_backend() -> Backend:
    from loraplane.kernels.torch_backend import TorchBackend

    return TorchBackend()


def _cpu_backend() -> Backend:
    from loraplane.kernels.cpu_backend import CpuBackend

    return CpuBackend()


def _triton_backend() -> Backend:
    from loraplane.kernels.triton_backend import TritonBackend

    return TritonBackend()


def _ascend_backend() -> Backend:
    from loraplane.kernels.ascend_backend import AscendBackend

    return AscendBackend()


#: Backend name -> factory. Factories import lazily so a missing triton / torch_npu only matters when chosen.
BACKENDS: dict[str, Callable[[], Backend]] = {
    "cpu": _cpu_backend,
    "torch": _torch_backend,
    "triton": _triton_backend,
    "ascend": _ascend_backend,
}
_instances: dict[str, Backend] = {}


def get_backend(name: str) -> Backend:
    """The shared instance of the backend called ``name``."""
    if name not in BACKENDS:
        raise ValueError(f"unknown kernels backend {name!r}; choose one of {sorted(BACKENDS)}")
    if name not in _instances:
        _instances[name] = BACKENDS[name]()
    return _instances[name]


def default_backend_name(device: torch.device | str) -> str:
    """``ascend`` on NPUs, ``triton`` on CUDA when triton imports, ``cpu`` on CPUs when its C library builds,
    ``torch`` otherwise."""
    kind = torch.device(device).type
    if kind == "npu":
        return "ascend"
    if kind == "cuda":
        try:
            import triton  # noqa: F401
        except ImportError:
            return "torch"
        return "triton"
    if kind == "cpu":
        from loraplane.kernels.cpu_backend import available

        return "cpu" if available() else "torch"
    return "torch"


def select_backend(device: torch.device | str, name: str | None = None) -> Backend:
    """The backend for ``device``: ``name`` if given, else ``$LORAPLANE_KERNELS_BACKEND``, else by device."""
    chosen = name or os.environ.get(BACKEND_ENV) or default_backend_name(device)
    return get_backend(chosen)


def _resolve(backend: Backend | str | None, device: torch.device) -> Backend:
    if backend is None or isinstance(backend, str):
        return select_backend(device, backend)
    return backend


def _check(x: torch.Tensor, slots: LoraSlots, plan: BatchPlan, width: int, what: str) -> None:
    if x.dim() != 2 or x.shape[0] != plan.num_tokens or x.shape[1] != width:
        raise ValueError(f"{what} must be [{plan.num_tokens}, {width}], got {tuple(x.shape)}")
    if x.device != slots.device:
        raise ValueError(f"{what} is on {x.device} but the LoRA slots are on {slots.device}")


def _check_io(y: torch.Tensor, x: torch.Tensor, slots: LoraSlots, plan: BatchPlan) -> None:
    _check(x, slots, plan, slots.d_in, "x")
    _check(y, slots, plan, slots.d_out, "y")
    if x.dtype != slots.dtype or y.dtype != slots.dtype:
        raise ValueError(f"x and y must be {slots.dtype}, got {x.dtype} and {y.dtype}")


def shrink(x: torch.Tensor, slots: LoraSlots, plan: BatchPlan, backend: Backend | str | None = None) -> torch.Tensor:
    """``x -> x A^T`` per row's slot, float32 ``[T, n_slices * rank_pad]``."""
    _check(x, slots, plan, slots.d_in, "x")
    return _resolve(backend, x.device).shrink(x, slots, plan)


def expand(
    y: torch.Tensor, t: torch.Tensor, slots: LoraSlots, plan: BatchPlan, backend: Backend | str | None = None
) -> None:
    """``y += t B^T`` per row's slot and output slice, in place."""
    _check(y, slots, plan, slots.d_out, "y")
    _check(t, slots, plan, slots.lora_a.shape[1], "t")
    if t.dtype != torch.float32:
        raise ValueError(f"t must be float32 (the shrink output), got {t.dtype}")
    _resolve(backend, y.device).expand(y, t, slots, plan)


def apply_lora(
    y: torch.Tensor, x: torch.Tensor, slots: LoraSlots, plan: BatchPlan, backend: Backend | str | None = None
) -> None:
    """``y[T, d_out] += LoRA delta`` in place; rows with slot -1 untouched."""
    _check_io(y, x, slots, plan)
    _resolve(backend, x.device).apply(y, x, slots, plan)


def lora_delta(
    x: torch.Tensor, slots: LoraSlots, plan: BatchPlan, backend: Backend | str | None = None
) -> torch.Tensor:
    """The LoRA delta alone, ``[T, d_out]`` in the slots' dtype (zero rows for slot -1)."""
    y = torch.zeros(plan.num_tokens, slots.d_out, dtype=slots.dtype, device=x.device)
    apply_lora(y, x, slots, plan, backend)
    return y
