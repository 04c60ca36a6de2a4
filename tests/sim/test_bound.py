"""Belady's bound against an exhaustive search of every eviction choice."""

from __future__ import annotations

from functools import cache

from hypothesis import given, settings
from hypothesis import strategies as st

from loraplane.sim.bound import belady_misses


def optimal_misses(sequence: tuple[int, ...], capacity: int) -> int:
    @cache
    def best(i: int, held: frozenset[int]) -> int:
        if i == len(sequence):
            return 0
        a = sequence[i]
        if a in held:
            return best(i + 1, held)
        if len(held) < capacity:
            return 1 + best(i + 1, held | {a})
        return 1 + min(best(i + 1, (held - {v}) | {a}) for v in held)

    return best(0, frozenset())


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 5), max_size=12), st.integers(1, 4))
def test_belady_is_the_optimum(sequence: list[int], capacity: int) -> None:
    assert belady_misses(sequence, capacity) == optimal_misses(tuple(sequence), capacity)


def test_compulsory_misses_only_when_everything_fits() -> None:
    assert belady_misses([1, 2, 3, 1, 2, 3, 1], 3) == 3
    assert belady_misses([1, 2, 3, 1, 2, 3, 1], 2) > 3
