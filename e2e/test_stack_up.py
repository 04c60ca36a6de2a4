"""``loraplane up``: the stack comes up, kubectl sees its pool and pods, Envoy answers, Ctrl-C stops every child."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from e2e.test_demo import _gone

pytestmark = pytest.mark.slow


@contextlib.contextmanager
def _loraplane_up(workdir: Path, engines: int, **popen: Any) -> Iterator[subprocess.Popen[bytes]]:
    """``loraplane up`` as a child in its own session; killed with its group if the test leaves it running."""
    up = subprocess.Popen([sys.executable, "-m", "loraplane.cli", "up", "--engines", str(engines),
                           "--workdir", str(workdir)], start_new_session=True, **popen)
    try:
        yield up
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGKILL)
            up.wait()


def test_up_runs_until_ctrl_c_and_leaves_nothing_running(tmp_path: Path, kubectl_bin: str) -> None:
    workdir = tmp_path / "run"
    log = (tmp_path / "up.out").open("w+")
    with _loraplane_up(workdir, 2, stdout=log, stderr=subprocess.STDOUT) as up:
        deadline = time.monotonic() + 240
        while "Ctrl-C stops everything" not in (text := Path(log.name).read_text()):
            assert up.poll() is None, text
            assert time.monotonic() < deadline, text
            time.sleep(0.5)
        pids = json.loads(re.search(r"pids: (\{.*\})", text).group(1))  # type: ignore[union-attr]
        kubeconfig = re.search(r"kubeconfig: (\S+)", text).group(1)  # type: ignore[union-attr]
        gateway = re.search(r"gateway \(OpenAI API through Envoy\): (\S+)", text).group(1)  # type: ignore[union-attr]

        def kubectl(*args: str) -> str:
            done = subprocess.run([kubectl_bin, "--cache-dir", str(tmp_path / "kube-cache"), *args], capture_output=True,
                                  text=True, timeout=30, env={**os.environ, "KUBECONFIG": kubeconfig})
            assert done.returncode == 0, done.stderr
            return done.stdout

        assert sorted(kubectl("get", "pods,inferencepools,adapterrevisions", "-o", "name").split()) == [
            "inferencepool.inference.networking.k8s.io/local", "pod/engine-0", "pod/engine-1"]
        assert kubectl("get", "pods", "-o", "jsonpath={.items[*].status.phase}").split() == ["Running", "Running"]
        models = httpx.get(f"{gateway}/v1/models", timeout=30)
        assert models.status_code == 200 and models.headers["server"] == "envoy"
        assert len(pids) == 9 and all(not _gone(pid) for pid in pids.values())

        up.send_signal(signal.SIGINT)
        assert up.wait(60) == 0
    assert [name for name, pid in pids.items() if not _gone(pid)] == []
    assert _running_with(workdir) == []
    assert "every process stopped" in Path(log.name).read_text()


def _running_with(path: Path) -> list[str]:
    """Command lines of live processes that name ``path`` (every child of the stack names its work dir but the
    picker, which is started last)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (proc / "status").read_text()
        except OSError:
            continue
        if str(path) in cmdline and "\nState:\tZ" not in state:
            found.append(cmdline)
    return found


def test_ctrl_c_during_start_up_stops_what_was_started(tmp_path: Path) -> None:
    workdir = tmp_path / "run"
    with _loraplane_up(workdir, 1, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) as up:
        deadline = time.monotonic() + 120
        while not (workdir / "logs" / "engine-0.log").exists():
            assert up.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        assert any("loraplane.engine" in c for c in _running_with(workdir))
        up.send_signal(signal.SIGINT)
        assert up.wait(60) == 130
    assert _running_with(workdir) == []


def test_a_child_that_dies_is_restarted_and_the_stack_keeps_running(tmp_path: Path) -> None:
    workdir = tmp_path / "run"
    log = (tmp_path / "up.out").open("w+")
    with _loraplane_up(workdir, 1, stdout=log, stderr=subprocess.STDOUT) as up:
        deadline = time.monotonic() + 240
        while "Ctrl-C stops everything" not in (text := Path(log.name).read_text()):
            assert up.poll() is None and time.monotonic() < deadline, text
            time.sleep(0.5)
        pids = json.loads(re.search(r"pids: (\{.*\})", text).group(1))  # type: ignore[union-attr]
        gateway = re.search(r"gateway \(OpenAI API through Envoy\): (\S+)", text).group(1)  # type: ignore[union-attr]
        os.kill(pids["picker"], signal.SIGKILL)
        while "picker restarted" not in (text := Path(log.name).read_text()):
            assert up.poll() is None, text  # the stack did not stop
            assert time.monotonic() < deadline, text
            time.sleep(0.2)
        assert "picker exited with -9; restarting in 0.5 s" in text
        while (status := httpx.get(f"{gateway}/v1/models", timeout=30).status_code) != 200:
            assert time.monotonic() < deadline, status
            time.sleep(0.2)
        up.send_signal(signal.SIGINT)
        assert up.wait(60) == 0
    assert _running_with(workdir) == []
