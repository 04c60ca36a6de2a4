"""CPU stand-ins for vLLM-Ascend's LoRA ops: the same schemas and semantics, registered in a test namespace.

Semantics (vLLM-Ascend): float16/bfloat16 inputs only; ``x`` 2-D; weights 3-D ``[L, r, d]`` or 4-D
``[L, 1, r, d]``; shrink needs hidden > rank and ADDS ``scale * x W^T`` into a float32 ``y``; expand reads a
float32 ``x``, supports ranks 8/16/32/64 only and ADDS into ``y[:, slice_offset : slice_offset + slice_size]``;
rows whose LoRA index is negative are skipped. SGMV's segments are consecutive runs of ``seq_len[i]`` rows.
Each op is computed row by row here, independently of the library's own code.
"""

from __future__ import annotations

from collections import Counter

import torch

from loraplane.kernels.ascend_backend import AscendBackend

NAMESPACE = "loraplane_test_ascend"
SCHEMAS = (
    "bgmv_shrink(Tensor! x, Tensor! weight, Tensor! indices, Tensor! y, float scale) -> ()",
    "bgmv_expand(Tensor! x, Tensor! weight, Tensor! indices, Tensor! y, int slice_offset, int slice_size) -> Tensor",
    "sgmv_shrink(Tensor! x, Tensor! weight, Tensor! lora_indices, Tensor! seq_len, Tensor! y, float scale) -> ()",
    "sgmv_expand(Tensor! x, Tensor! weight, Tensor! lora_indices, Tensor! seq_len, Tensor! y,"
    " int slice_offset, int slice_size) -> Tensor",
)
CALLS: Counter[str] = Counter()


def _weights(weight: torch.Tensor) -> torch.Tensor:
    if weight.dim() == 4:
        weight = weight.squeeze(1)
    if weight.dim() != 3:
        raise RuntimeError("weight must be 3-D or 4-D")
    return weight


def _check_x(x: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> None:
    if x.dim() != 2 or x.dtype not in allowed:
        raise RuntimeError(f"x must be 2-D {allowed}, got {x.dim()}-D {x.dtype}")


def _shrink_rows(x: torch.Tensor, weight: torch.Tensor, row_slots: list[int], y: torch.Tensor, scale: float) -> None:
    _check_x(x, (torch.float16, torch.bfloat16))
    weight = _weights(weight)
    if weight.dtype != x.dtype or y.dtype != torch.float32 or x.shape[1] <= weight.shape[1]:
        raise RuntimeError("shrink: weight dtype must match x, y must be float32, hidden must exceed rank")
    for row, slot in enumerate(row_slots):
        if slot >= 0:
            y[row] += scale * (weight[slot].float() @ x[row].float())


def _expand_rows(x: torch.Tensor, weight: torch.Tensor, row_slots: list[int], y: torch.Tensor, offset: int, size: int) -> torch.Tensor:
    _check_x(x, (torch.float32,))
    weight = _weights(weight)
    if weight.shape[2] not in (8, 16, 32, 64) or weight.shape[1] != size or y.dtype not in (torch.float16, torch.bfloat16):
        raise RuntimeError("expand: rank must be 8/16/32/64, weight rows must equal slice_size, y fp16/bf16")
    for row, slot in enumerate(row_slots):
        if slot >= 0:
            delta = weight[slot].float() @ x[row]
            y[row, offset : offset + size] = (y[row, offset : offset + size].float() + delta).to(y.dtype)
    return y


def _runs(lora_indices: torch.Tensor, seq_len: torch.Tensor, rows: int) -> list[int]:
    per_row = [slot for slot, n in zip(lora_indices.tolist(), seq_len.tolist(), strict=True) for _ in range(n)]
    if len(per_row) != rows:
        raise RuntimeError("sum(seq_len) must equal the number of rows")
    return per_row


def bgmv_shrink(x, weight, indices, y, scale):  # type: ignore[no-untyped-def]
    CALLS["bgmv_shrink"] += 1
    _shrink_rows(x, weight, indices.tolist(), y, scale)


def bgmv_expand(x, weight, indices, y, slice_offset, slice_size):  # type: ignore[no-untyped-def]
    CALLS["bgmv_expand"] += 1
    return _expand_rows(x, weight, indices.tolist(), y, slice_offset, slice_size)


def sgmv_shrink(x, weight, lora_indices, seq_len, y, scale):  # type: ignore[no-untyped-def]
    CALLS["sgmv_shrink"] += 1
    _shrink_rows(x, weight, _runs(lora_indices, seq_len, x.shape[0]), y, scale)


def sgmv_expand(x, weight, lora_indices, seq_len, y, slice_offset, slice_size):  # type: ignore[no-untyped-def]
    CALLS["sgmv_expand"] += 1
    return _expand_rows(x, weight, _runs(lora_indices, seq_len, x.shape[0]), y, slice_offset, slice_size)


_LIBRARY = torch.library.Library(NAMESPACE, "DEF")  # kept alive: the namespace dies with the handle
for _schema in SCHEMAS:
    _LIBRARY.define(_schema)
for _op in (bgmv_shrink, bgmv_expand, sgmv_shrink, sgmv_expand):
    _LIBRARY.impl(_op.__name__, _op, "CPU")


class AscendTestBackend(AscendBackend):
    """The Ascend backend wired to the test-registered ops."""

    def __init__(self) -> None:
        super().__init__(ops=getattr(torch.ops, NAMESPACE))
