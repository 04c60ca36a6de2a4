"""A benchmark stopped with SIGTERM stops the processes it started (before, they were left running)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def _children(pid: int) -> set[int]:
    found = set()
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            fields = dict(line.split(":\t", 1) for line in status.read_text().splitlines() if ":\t" in line)
        except OSError:
            continue
        if fields.get("PPid", "").strip() == str(pid):
            found.add(int(status.parent.name))
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def test_sigterm_stops_the_picker_benchmarks_processes() -> None:
    bench = subprocess.Popen([sys.executable, "-m", "loraplane.cli", "bench", "picker", "--quick"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    started: set[int] = set()
    try:
        deadline = time.monotonic() + 60
        while len(started) < 2 and time.monotonic() < deadline:  # Redis and nginx come first
            assert bench.poll() is None, "the benchmark ended before it started its processes"
            started |= _children(bench.pid)
            time.sleep(0.1)
        assert len(started) >= 2, started
        os.kill(bench.pid, signal.SIGTERM)
        assert bench.wait(timeout=60) == 128 + signal.SIGTERM
        deadline = time.monotonic() + 10
        while any(map(_alive, started)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [pid for pid in started if _alive(pid)], "processes left running after SIGTERM"
    finally:
        if bench.poll() is None:
            bench.kill()
        for pid in started:  # what a failing run leaves behind
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
