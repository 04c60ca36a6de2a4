"""Host-side batch planning and the decode grouping cache."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from loraplane.kernels import BatchPlanner, DecodeGroups
from loraplane.kernels.plan import DECODE_MAX_SEGMENT


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(min_value=-1, max_value=5), max_size=40))
def test_plan_sorts_stably_and_counts(token_slots: list[int]) -> None:
    plan = BatchPlanner(max_tokens=64, num_slots=6).plan(token_slots)
    lora_rows = [i for i, s in enumerate(token_slots) if s >= 0]
    assert plan.no_lora == (not lora_rows)
    assert sorted(plan.sorted_tokens.tolist()) == lora_rows
    assert plan.token_slots.tolist() == token_slots
    slots_in_order = [token_slots[i] for i in plan.sorted_tokens.tolist()]
    assert slots_in_order == sorted(slots_in_order)
    for seg in plan.segments:
        rows = plan.sorted_tokens[seg.start : seg.end].tolist()
        assert rows == sorted(rows)  # stable within a slot
        assert {token_slots[r] for r in rows} == {seg.slot}
        assert seg.row == rows[0]
        if plan.contiguous:
            assert rows == list(range(seg.row, seg.row + seg.rows))
    active = sorted({s for s in token_slots if s >= 0})
    assert plan.active_slots.tolist() == active
    assert plan.counts.tolist() == [token_slots.count(s) for s in active]
    assert plan.starts.tolist() == [slots_in_order.index(s) for s in active]
    assert plan.segment_slots.tolist() == [seg.slot for seg in plan.segments]
    assert plan.segment_starts.tolist() == [seg.start for seg in plan.segments]
    assert plan.segment_rows.tolist() == [seg.rows for seg in plan.segments]
    if not plan.contiguous:
        assert len(plan.segments) == len(active)


def test_contiguous_runs_need_no_gather_and_mode_follows_segment_length() -> None:
    planner = BatchPlanner(max_tokens=64, num_slots=4)
    assert planner.plan([2, 2, -1, 0, 0, 0]).contiguous
    assert not planner.plan([2, 0, 2]).contiguous
    # long runs (prefill sequences) are used in place: one segment per run, a slot may have several
    long_runs = planner.plan([1] * 10 + [0] * 12 + [1] * 9)
    assert long_runs.contiguous
    assert [(s.slot, s.row, s.rows) for s in long_runs.segments] == [(0, 10, 12), (1, 0, 10), (1, 22, 9)]
    assert planner.plan([1] * DECODE_MAX_SEGMENT).mode == "decode"
    assert planner.plan([1] * (DECODE_MAX_SEGMENT + 1)).mode == "prefill"
    assert planner.plan(torch.tensor([-1, -1], dtype=torch.int32)).no_lora


def test_bad_input_is_rejected() -> None:
    planner = BatchPlanner(max_tokens=4, num_slots=2)
    with pytest.raises(ValueError, match="max_tokens"):
        planner.plan([0] * 5)
    with pytest.raises(ValueError, match="slot indices"):
        planner.plan([0, 2])
    with pytest.raises(ValueError, match="slot indices"):
        planner.plan([-2])
    groups = DecodeGroups()
    groups.join("a", 7)
    with pytest.raises(ValueError, match="slot indices"):
        planner.plan_decode(groups)


def test_decode_groups_update_incrementally_and_plan_without_sort() -> None:
    groups = DecodeGroups()
    for seq, slot in [("a", 1), ("b", -1), ("c", 0), ("d", 1), ("e", 0)]:
        groups.join(seq, slot)
    assert groups.order() == ["b", "c", "e", "a", "d"]
    first = groups.order()
    assert groups.order() is first  # cached until a change
    groups.leave("c")
    groups.join("f", 1)
    assert groups.order() == ["b", "e", "a", "d", "f"]
    with pytest.raises(KeyError):
        groups.join("a", 0)
    planner = BatchPlanner(max_tokens=16, num_slots=2)
    plan = planner.plan_decode(groups)
    reference = planner.plan(groups.token_slots())
    assert plan.contiguous and reference.contiguous
    assert plan.segments == reference.segments
    assert plan.sorted_tokens.tolist() == reference.sorted_tokens.tolist()
    for seq in range(DECODE_MAX_SEGMENT):  # a popular adapter: a long group of one-token rows stays a decode plan
        groups.join(("popular", seq), 0)
    assert planner.plan_decode(groups).mode == "decode"
    assert planner.plan(groups.token_slots()).mode == "prefill"
