"""Host-side batch planning: one plan per engine step, shared by every LoRA layer of that step."""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

import torch

#: Segments at most this long use the decode (row-vector) path; longer ones the grouped-GEMM prefill path.
DECODE_MAX_SEGMENT = 8
#: Runs of consecutive same-slot rows at least this long on average are used as segments in place (one slot may
#: then have several segments) instead of gathering all rows of a slot together: re-reading an adapter's A/B per
#: run costs less than gathering and scattering the rows (measured: docs/kernels.md).
RUN_MIN_ROWS = 8


@dataclass(frozen=True)
class Segment:
    """Positions ``start .. end`` of ``BatchPlan.sorted_tokens`` that all use ``slot``.

    ``row`` is the input row of the segment's first token; in a ``contiguous`` plan the segment covers input rows
    ``row .. row + rows`` directly.
    """

    slot: int
    start: int
    end: int
    row: int

    @property
    def rows(self) -> int:
        """Number of rows in the segment."""
        return self.end - self.start


@dataclass(frozen=True)
class BatchPlan:
    """Metadata of one batch, read by every backend.

    * ``token_slots``: per-token slot index (int32, -1 = no LoRA), ``[num_tokens]``.
    * ``sorted_tokens``: token indices of LoRA rows, sorted stably by slot (int64, ``[num_lora_tokens]``).
    * ``segments``: ranges over ``sorted_tokens``, ordered by slot; one per active slot, or (``contiguous`` plans
      of long runs, e.g. prefill sequences) one per run of consecutive rows, so a slot may have several.
    * ``contiguous``: every segment's rows are consecutive input rows (``Segment.row ..``): no gather/scatter.
    * ``active_slots``, ``counts``, ``starts``: per distinct slot, its rows and first position in ``sorted_tokens``.
    * ``segment_slots``, ``segment_starts``, ``segment_rows``: the segments as int32 tensors for device kernels.
    * ``no_lora``: nothing to do; ops return at once.
    * ``mode``: ``"decode"`` for a plan of one-token rows (:meth:`BatchPlanner.plan_decode`, whatever the
      segment lengths) or when every segment is at most ``DECODE_MAX_SEGMENT`` rows, else ``"prefill"``.
    """

    num_tokens: int
    token_slots: torch.Tensor
    sorted_tokens: torch.Tensor
    segments: tuple[Segment, ...]
    active_slots: torch.Tensor
    counts: torch.Tensor
    starts: torch.Tensor
    segment_slots: torch.Tensor
    segment_starts: torch.Tensor
    segment_rows: torch.Tensor
    contiguous: bool
    mode: str

    @property
    def no_lora(self) -> bool:
        """True when no row uses an adapter."""
        return not self.segments

    @property
    def num_lora_tokens(self) -> int:
        """Rows that use an adapter."""
        return int(self.sorted_tokens.numel())

    @property
    def max_segment(self) -> int:
        """Length of the longest segment (0 without LoRA rows)."""
        return max((seg.rows for seg in self.segments), default=0)

    def to(self, device: torch.device | str) -> BatchPlan:
        """The same plan with its tensors on ``device`` (done once per step, not per layer)."""
        moved = {name: getattr(self, name).to(device, non_blocking=True) for name in _TENSOR_FIELDS}
        return dataclasses.replace(self, **moved)


_TENSOR_FIELDS = (
    "token_slots",
    "sorted_tokens",
    "active_slots",
    "counts",
    "starts",
    "segment_slots",
    "segment_starts",
    "segment_rows",
)


class BatchPlanner:
    """Builds :class:`BatchPlan` objects into preallocated host buffers.

    A plan's tensors are views of the planner's buffers: they stay valid until the next ``plan`` call (one step).
    """

    def __init__(self, max_tokens: int, num_slots: int) -> None:
        if max_tokens <= 0 or num_slots <= 0:
            raise ValueError("max_tokens and num_slots must be positive")
        self.max_tokens = max_tokens
        self.num_slots = num_slots
        self._slots = torch.empty(max_tokens, dtype=torch.int32)
        self._sorted = torch.empty(max_tokens, dtype=torch.int64)
        # rows: active_slots, counts, starts (per slot); segment_slots, segment_starts, segment_rows (per segment)
        self._meta = torch.empty(6, max_tokens, dtype=torch.int32)

    def plan(self, token_slots: Sequence[int] | torch.Tensor, decode: bool = False) -> BatchPlan:
        """Plan a batch from each token's slot index (-1 = no LoRA); ``decode``: the rows are one token per
        sequence (mode ``decode`` whatever the segment lengths, as :meth:`plan_decode`)."""
        slots_list = token_slots.tolist() if isinstance(token_slots, torch.Tensor) else list(token_slots)
        self._validate(slots_list)
        runs = [run for run in _runs(slots_list) if run.slot >= 0]
        lora_rows = sum(run.rows for run in runs)
        distinct = {run.slot for run in runs}
        contiguous = len(distinct) == len(runs) or lora_rows >= RUN_MIN_ROWS * len(runs)
        if contiguous:  # use the runs in place, ordered by slot: sort the runs, not the tokens
            runs.sort(key=lambda run: run.slot)
            order = [i for run in runs for i in range(run.row, run.row + run.rows)]
            segments, position = [], 0
            for run in runs:
                segments.append(Segment(run.slot, position, position + run.rows, run.row))
                position += run.rows
        else:
            order = sorted((i for i, s in enumerate(slots_list) if s >= 0), key=slots_list.__getitem__)
            segments = _segments(order, slots_list)
        return self._fill(slots_list, order, segments, contiguous, decode=decode)

    def plan_decode(self, groups: DecodeGroups) -> BatchPlan:
        """Plan a decode step whose rows are laid out in ``groups.order()`` (no sort: the groups are kept).

        Every row is one sequence's single token, so the plan's mode is ``decode`` even when a popular adapter
        has more than ``DECODE_MAX_SEGMENT`` rows.
        """
        slots_list = groups.token_slots()
        self._validate(slots_list)
        order = [i for i, s in enumerate(slots_list) if s >= 0]
        return self._fill(slots_list, order, list(groups.segments()), True, decode=True)

    def _validate(self, slots_list: list[int]) -> None:
        if len(slots_list) > self.max_tokens:
            raise ValueError(f"{len(slots_list)} tokens exceed the planner's max_tokens {self.max_tokens}")
        bad = [s for s in slots_list if not -1 <= s < self.num_slots]
        if bad:
            raise ValueError(f"slot indices must be -1 or in [0, {self.num_slots}), got {bad[:5]}")

    def _fill(
        self, slots_list: list[int], order: list[int], segments: list[Segment], contiguous: bool, decode: bool
    ) -> BatchPlan:
        num_tokens = len(slots_list)
        token_slots = self._slots[:num_tokens]
        token_slots.copy_(torch.tensor(slots_list, dtype=torch.int32))
        sorted_tokens = self._sorted[: len(order)]
        if order:
            sorted_tokens.copy_(torch.tensor(order, dtype=torch.int64))
        per_slot: dict[int, list[int]] = {}  # slot -> [rows, first position]
        for seg in segments:
            per_slot.setdefault(seg.slot, [0, seg.start])[0] += seg.rows
        meta = [
            list(per_slot),
            [rows for rows, _ in per_slot.values()],
            [first for _, first in per_slot.values()],
            [seg.slot for seg in segments],
            [seg.start for seg in segments],
            [seg.rows for seg in segments],
        ]
        views = []
        for row, values in enumerate(meta):
            view = self._meta[row, : len(values)]
            if values:
                view.copy_(torch.tensor(values, dtype=torch.int32))
            views.append(view)
        longest = max((seg.rows for seg in segments), default=0)
        return BatchPlan(
            num_tokens=num_tokens,
            token_slots=token_slots,
            sorted_tokens=sorted_tokens,
            segments=tuple(segments),
            active_slots=views[0],
            counts=views[1],
            starts=views[2],
            segment_slots=views[3],
            segment_starts=views[4],
            segment_rows=views[5],
            contiguous=contiguous,
            mode="decode" if decode or longest <= DECODE_MAX_SEGMENT else "prefill",
        )


class DecodeGroups:
    """Stable grouping of running decode sequences by slot, updated when sequences join or leave.

    The engine lays out its decode rows in :meth:`order`, so each slot's rows are consecutive and the plan needs
    neither a sort nor a gather. Join and leave are O(1); the flattened order is rebuilt only after a change.
    """

    def __init__(self) -> None:
        self._slot_of: dict[Hashable, int] = {}
        self._groups: dict[int, dict[Hashable, None]] = {}
        self._order: list[Hashable] | None = None
        self._slots: list[int] = []

    def __len__(self) -> int:
        return len(self._slot_of)

    def join(self, seq_id: Hashable, slot: int) -> None:
        """Add a running sequence that uses ``slot`` (-1 = no LoRA)."""
        if seq_id in self._slot_of:
            raise KeyError(f"sequence {seq_id!r} already joined")
        self._slot_of[seq_id] = slot
        self._groups.setdefault(slot, {})[seq_id] = None
        self._order = None

    def leave(self, seq_id: Hashable) -> None:
        """Remove a finished or preempted sequence."""
        slot = self._slot_of.pop(seq_id)
        group = self._groups[slot]
        del group[seq_id]
        if not group:
            del self._groups[slot]
        self._order = None

    def order(self) -> list[Hashable]:
        """Sequence ids grouped by slot (slots ascending, no-LoRA first; join order within a slot)."""
        if self._order is None:
            self._order = [seq for slot in sorted(self._groups) for seq in self._groups[slot]]
            self._slots = [self._slot_of[seq] for seq in self._order]
        return self._order

    def token_slots(self) -> list[int]:
        """Slot per row, in :meth:`order`."""
        self.order()
        return self._slots

    def segments(self) -> Iterable[Segment]:
        """Segments of the rows in :meth:`order` (no-LoRA rows, which come first, excluded)."""
        self.order()
        row = 0
        position = 0
        for slot in sorted(self._groups):
            rows = len(self._groups[slot])
            if slot >= 0:
                yield Segment(slot, position, position + rows, row)
                position += rows
            row += rows


def _runs(slots: list[int]) -> list[Segment]:
    """Maximal runs of consecutive rows with the same slot (``start``/``end``/``row`` are row indices)."""
    runs: list[Segment] = []
    start = 0
    for i in range(1, len(slots) + 1):
        if i == len(slots) or slots[i] != slots[start]:
            runs.append(Segment(slots[start], start, i, start))
            start = i
    return runs


def _segments(order: list[int], slots: list[int]) -> list[Segment]:
    """Segments over ``order`` (token indices sorted by slot)."""
    segments: list[Segment] = []
    start = 0
    for position in range(1, len(order) + 1):
        if position == len(order) or slots[order[position]] != slots[order[start]]:
            segments.append(Segment(slots[order[start]], start, position, order[start]))
            start = position
    return segments
