"""``loraplane up`` restarts a child that died, with backoff, instead of stopping the stack (real processes)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from loraplane.processes import ManagedProcess
from loraplane.stack.services import RESTART_BASE_S, RESTART_RESET_S, DevCluster, LocalStack, StackOptions


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _kill(process: ManagedProcess) -> None:
    os.kill(process.pid, signal.SIGKILL)
    assert process.proc is not None
    process.proc.wait(10)


def test_a_dead_child_is_restarted_after_a_growing_backoff(tmp_path: Path) -> None:
    stack = LocalStack(StackOptions(workdir=tmp_path))
    stack.picker = ManagedProcess(["sleep", "60"], tmp_path / "logs" / "picker.log").start()
    said: list[str] = []
    clock = Clock()
    try:
        first_pid = stack.picker.pid
        assert stack.restart_dead(said.append, clock) == []  # alive: nothing to do
        _kill(stack.picker)
        assert stack.restart_dead(said.append, clock) == []  # noticed: waits its backoff
        assert "picker exited with -9; restarting in 0.5 s" in said[-1]
        clock.now += RESTART_BASE_S
        assert stack.restart_dead(said.append, clock) == ["picker"]
        assert stack.picker.alive() and stack.picker.pid != first_pid and stack.restarts == {"picker": 1}
        assert "picker restarted" in said[-1]
        _kill(stack.picker)  # dies again at once: the next delay doubles
        stack.restart_dead(said.append, clock)
        assert "restarting in 1.0 s" in said[-1]
        clock.now += RESTART_BASE_S
        assert stack.restart_dead(said.append, clock) == []
        clock.now += RESTART_BASE_S
        assert stack.restart_dead(said.append, clock) == ["picker"]
        clock.now += RESTART_RESET_S  # ran long enough: back to the first delay
        _kill(stack.picker)
        stack.restart_dead(said.append, clock)
        assert "restarting in 0.5 s" in said[-1]
    finally:
        stack.stop()


def test_the_api_servers_death_stops_the_stack(tmp_path: Path) -> None:
    process = ManagedProcess(["sleep", "60"], tmp_path / "devcluster.log").start()
    stack = LocalStack(StackOptions(workdir=tmp_path), cluster=DevCluster("http://x", tmp_path / "kc", process, tmp_path))
    _kill(process)
    with pytest.raises(RuntimeError, match="API server exited"):
        stack.restart_dead(lambda _: None)
