"""The controller's work queue: dedup, one worker per key, delays on an injected clock, per-key backoff."""

from __future__ import annotations

import asyncio

import pytest

from loraplane.controller.queue import ShutDown, WorkQueue


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_key_queued_twice_is_processed_once() -> None:
    queue: WorkQueue[str] = WorkQueue(Clock())
    queue.add("a")
    queue.add("b")
    queue.add("a")
    assert [queue.pop_ready(), queue.pop_ready(), queue.pop_ready()] == ["a", "b", None]


def test_a_key_being_processed_is_not_handed_out_again_until_done() -> None:
    queue: WorkQueue[str] = WorkQueue(Clock())
    queue.add("a")
    assert queue.pop_ready() == "a"
    queue.add("a")  # a change while a worker reconciles it: not a second worker, but once more afterwards
    queue.add("a")
    assert queue.pop_ready() is None
    queue.done("a")
    assert queue.pop_ready() == "a"
    queue.done("a")
    assert queue.pop_ready() is None


def test_add_after_waits_for_the_clock_and_the_earliest_request_wins() -> None:
    clock = Clock()
    queue: WorkQueue[str] = WorkQueue(clock)
    queue.add_after("a", 5.0)
    queue.add_after("a", 2.0)
    queue.add_after("a", 9.0)
    assert queue.next_due() == pytest.approx(1002.0)
    clock.now += 1.999
    assert queue.pop_ready() is None
    clock.now += 0.001
    assert queue.pop_ready() == "a"
    queue.done("a")
    clock.now += 10
    assert queue.pop_ready() is None  # the later requests were folded into the earliest one
    queue.add_after("b", 1.0)
    queue.add("b")  # queued now: the delayed copy is dropped
    assert queue.pop_ready() == "b" and queue.next_due() is None


def test_a_change_or_a_due_gate_is_handed_out_before_background_resyncs() -> None:
    clock = Clock()
    queue: WorkQueue[str] = WorkQueue(clock)
    for key in ("r1", "r2", "r3"):
        queue.add_after(key, 1.0, background=True)
    queue.add_after("gate", 1.0)
    clock.now += 1.0
    queue.add("r3")  # a change of a pool waiting for its resync: now in front
    queue.add("event")
    assert [queue.pop_ready() for _ in range(6)] == ["r3", "event", "gate", "r1", "r2", None]


def test_backoff_grows_per_key_and_resets_on_forget() -> None:
    clock = Clock()
    queue: WorkQueue[str] = WorkQueue(clock, base_delay=0.1, max_delay=1.0)
    delays = [queue.add_rate_limited("bad") for _ in range(6)]
    assert delays == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.0, 1.0])
    assert queue.failures("bad") == 6 and queue.backoff("good") == pytest.approx(0.1)
    queue.forget("bad")
    assert queue.failures("bad") == 0 and queue.backoff("bad") == pytest.approx(0.1)


async def test_get_wakes_at_the_due_time_and_ends_on_shutdown() -> None:
    now = [0.0]
    queue: WorkQueue[str] = WorkQueue(clock=lambda: now[0])
    queue.add_after("a", 0.05)
    getter = asyncio.ensure_future(queue.get())
    await asyncio.sleep(0.3)  # several of its 0.05 s waits: the queue's clock has not moved, nothing is due
    assert not getter.done()
    now[0] = 0.05
    assert await asyncio.wait_for(getter, 5) == "a"
    waiter = asyncio.ensure_future(queue.get())
    await asyncio.sleep(0)
    queue.shut_down()
    with pytest.raises(ShutDown):
        await waiter
