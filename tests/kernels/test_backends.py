"""One suite, every backend: the op contract against a per-row reference built from the raw adapter tensors."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from loraplane.kernels import (
    BatchPlan,
    BatchPlanner,
    DecodeGroups,
    LoraSlots,
    apply_lora,
    expand,
    lora_delta,
    shrink,
    torch_backend,
)

from .backends import BACKENDS, backend_device, backend_instance

D_IN = 40
PACKED = (16, 24)  # two packed output slices, the second not a multiple of 16
SINGLE = (24,)
RANKS = {0: 8, 1: 4, 2: 16, 3: 12}  # mixed ranks; slot 4 stays empty
NUM_SLOTS = 5
TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-2}

#: name -> per-token slots: decode-like, prefill-like (long segments), unsorted (gather path), all -1.
BATCHES = {
    "decode_contiguous": [0, 0, 1, -1, 2, 3, 3],
    "decode_unsorted": [3, -1, 0, 2, 0, 1, 3, -1, 2],
    "decode_groups_popular": [-1, 0, 0] + [1] * 12 + [2, 3],  # DecodeGroups order: a decode plan, one long group
    "prefill": [2] * 11 + [-1] * 3 + [0] * 10,
    "prefill_unsorted": [1, 2] * 6 + [-1] + [0] * 9,
    "prefill_long": [0] * 40 + [-1] * 2 + [3] * 20,  # several row tiles per segment
    "empty_slot": [4, 0, 4],
    "no_lora": [-1, -1, -1],
}


def _adapters(slices: tuple[int, ...] = PACKED, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    adapters = {}
    for slot, rank in RANKS.items():
        a = [torch.randn(rank, D_IN, generator=generator) / D_IN**0.5 for _ in slices]
        b = [torch.randn(width, rank, generator=generator) for width in slices]
        adapters[slot] = (a, b, 0.5 + slot)
    return adapters


def _slots(dtype: torch.dtype, adapters, slices: tuple[int, ...] = PACKED, device: str = "cpu") -> LoraSlots:
    slots = LoraSlots(NUM_SLOTS, max_rank=16, d_in=D_IN, out_slices=slices, dtype=dtype, device=device)
    for slot, (a, b, scale) in adapters.items():
        slots.load(slot, [t.to(dtype) for t in a], [t.to(dtype) for t in b], scale)
    return slots


def _reference(x: torch.Tensor, token_slots: list[int], adapters, dtype: torch.dtype, width: int) -> torch.Tensor:
    """Row by row in float64 from the raw tensors (rounded to the slot dtype as the store holds them)."""
    out = torch.zeros(len(token_slots), width, dtype=torch.float64)
    for row, slot in enumerate(token_slots):
        if slot not in adapters:
            continue
        a_list, b_list, scale = adapters[slot]
        pieces = []
        for a, b in zip(a_list, b_list, strict=True):
            a64 = a.to(dtype).double()
            b64 = (b.double() * scale).to(dtype).double()
            pieces.append((x[row].double() @ a64.t()) @ b64.t())
        out[row] = torch.cat(pieces)
    return out


def _plan(planner: BatchPlanner, batch: str) -> BatchPlan:
    """The batch's plan: from ``DecodeGroups`` for ``decode_groups_*`` batches (as the engine's decode steps)."""
    token_slots = BATCHES[batch]
    if not batch.startswith("decode_groups"):
        return planner.plan(token_slots)
    groups = DecodeGroups()
    for seq, slot in enumerate(token_slots):
        groups.join(seq, slot)
    assert groups.token_slots() == token_slots
    plan = planner.plan_decode(groups)
    assert plan.mode == "decode" and plan.max_segment > 8
    return plan


def _inputs(num_tokens: int, dtype: torch.dtype, device: torch.device, seed: int = 2) -> torch.Tensor:
    return torch.randn(num_tokens, D_IN, generator=torch.Generator().manual_seed(seed)).to(device, dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("slices", [PACKED, SINGLE], ids=["packed", "single"])
def test_apply_matches_reference_and_leaves_other_rows_alone(
    backend: str, dtype: torch.dtype, batch: str, slices: tuple[int, ...]
) -> None:
    impl, device = backend_instance(backend), backend_device(backend)
    adapters = _adapters(slices)
    slots = _slots(dtype, adapters, slices, device)
    token_slots = BATCHES[batch]
    plan = _plan(BatchPlanner(max_tokens=64, num_slots=NUM_SLOTS), batch).to(device)
    x = _inputs(len(token_slots), dtype, device)
    y0 = torch.randn(len(token_slots), sum(slices), generator=torch.Generator().manual_seed(3)).to(device, dtype)
    y = y0.clone()
    apply_lora(y, x, slots, plan, backend=impl)
    expected = _reference(x.cpu(), token_slots, adapters, dtype, sum(slices))
    tolerance = dict(atol=TOLERANCE[dtype] * 4, rtol=TOLERANCE[dtype])
    torch.testing.assert_close(y.cpu().double() - y0.cpu().double(), expected, **tolerance)
    untouched = [row for row, slot in enumerate(token_slots) if slot not in adapters]
    assert torch.equal(y[untouched], y0[untouched])
    torch.testing.assert_close(lora_delta(x, slots, plan, backend=impl).cpu().double(), expected, **tolerance)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_shrink_then_expand_equals_fused(backend: str, dtype: torch.dtype) -> None:
    impl, device = backend_instance(backend), backend_device(backend)
    adapters = _adapters()
    slots = _slots(dtype, adapters, device=device)
    token_slots = BATCHES["decode_unsorted"]
    plan = BatchPlanner(max_tokens=64, num_slots=NUM_SLOTS).plan(token_slots).to(device)
    x = _inputs(len(token_slots), dtype, device)
    t = shrink(x, slots, plan, backend=impl)
    assert t.dtype == torch.float32 and t.shape == (len(token_slots), 2 * slots.rank_pad)
    assert not t[[1, 7]].any()
    for row, slot in enumerate(token_slots):
        if slot >= 0:
            a = adapters[slot][0][1].to(dtype).float()
            expected = x[row].cpu().float() @ a.t()
            torch.testing.assert_close(t[row, 16 : 16 + a.shape[0]].cpu(), expected, atol=1e-2, rtol=1e-2)
    y = torch.zeros(len(token_slots), sum(PACKED), dtype=dtype, device=device)
    expand(y, t, slots, plan, backend=impl)
    torch.testing.assert_close(y, lora_delta(x, slots, plan, backend=impl), atol=TOLERANCE[dtype], rtol=1e-2)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("batch", ["decode_unsorted", "prefill"])
def test_no_bleeding_between_slots(backend: str, batch: str) -> None:
    """Poisoning one slot (NaN weights) changes only its own rows; permuting rows permutes outputs."""
    impl, device = backend_instance(backend), backend_device(backend)
    dtype = torch.float16 if backend == "ascend" else torch.float32  # the NPU ops take half precision only
    adapters = _adapters(SINGLE)
    slots = _slots(dtype, adapters, SINGLE, device)
    token_slots = BATCHES[batch]
    planner = BatchPlanner(max_tokens=64, num_slots=NUM_SLOTS)
    x = _inputs(len(token_slots), dtype, device)
    before = lora_delta(x, slots, planner.plan(token_slots), backend=impl)
    a, b, _ = adapters[2]
    slots.load(2, [torch.full_like(t, float("nan")) for t in a], b, 1.0)
    assert slots.ranks[2] == RANKS[2]
    after = lora_delta(x, slots, planner.plan(token_slots), backend=impl)
    poisoned = [row for row, slot in enumerate(token_slots) if slot == 2]
    clean = [row for row, slot in enumerate(token_slots) if slot != 2]
    assert after[poisoned].isnan().all()
    assert torch.equal(after[clean], before[clean])
    slots.load(2, [t.to(dtype) for t in a], [t.to(dtype) for t in b], adapters[2][2])  # as _slots did
    permutation = torch.randperm(len(token_slots), generator=torch.Generator().manual_seed(5)).tolist()
    permuted = lora_delta(x[permutation], slots, planner.plan([token_slots[i] for i in permutation]), backend=impl)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-3
    torch.testing.assert_close(permuted, before[permutation], atol=tolerance, rtol=tolerance)


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    """One torch thread for the test (the torch backend's row blocks are used on one thread only)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("slices", [PACKED, SINGLE], ids=["packed", "single"])
def test_torch_long_segments_in_row_blocks_match_reference(
    monkeypatch: pytest.MonkeyPatch, slices: tuple[int, ...]
) -> None:
    """Long CPU segments add into ``y`` in row blocks (uneven last block included) with the same result."""
    monkeypatch.setattr(torch_backend, "Y_BLOCK_BYTES", 7 * 24 * 4)  # 4 or 7 rows per block, segments of 10-40
    adapters = _adapters(slices)
    slots = _slots(torch.float32, adapters, slices)
    token_slots = BATCHES["prefill_long"] + BATCHES["prefill"]
    plan = BatchPlanner(max_tokens=128, num_slots=NUM_SLOTS).plan(token_slots)
    assert plan.contiguous and plan.max_segment > 10
    x = _inputs(len(token_slots), torch.float32, torch.device("cpu"))
    expected = _reference(x, token_slots, adapters, torch.float32, sum(slices))
    backend = torch_backend.TorchBackend()
    tolerance = dict(atol=4e-4, rtol=1e-4)
    torch.testing.assert_close(lora_delta(x, slots, plan, backend=backend).double(), expected, **tolerance)
    y = torch.zeros(len(token_slots), sum(slices))
    expand(y, shrink(x, slots, plan, backend=backend), slots, plan, backend=backend)
    torch.testing.assert_close(y.double(), expected, **tolerance)


def test_bad_shapes_and_dtypes_are_rejected() -> None:
    slots = LoraSlots(2, 8, D_IN, (16,))
    plan = BatchPlanner(8, 2).plan([0, 1])
    with pytest.raises(ValueError, match="x must be"):
        apply_lora(torch.zeros(2, 16), torch.zeros(3, D_IN), slots, plan)
    with pytest.raises(ValueError, match=r"must be torch\.float32"):
        apply_lora(torch.zeros(2, 16, dtype=torch.float16), torch.zeros(2, D_IN, dtype=torch.float16), slots, plan)
    with pytest.raises(ValueError, match="rank 16 exceeds"):
        slots.load(0, [torch.zeros(16, D_IN)], [torch.zeros(16, 16)], 1.0)
    with pytest.raises(ValueError, match="B must be"):
        slots.load(0, [torch.zeros(4, D_IN)], [torch.zeros(15, 4)], 1.0)
    with pytest.raises(ValueError, match="unknown kernels backend"):
        apply_lora(torch.zeros(2, 16), torch.zeros(2, D_IN), slots, plan, backend="cuda-magic")
