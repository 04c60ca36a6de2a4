"""``loraplane up``: the stack comes up, kubectl sees its pool and pods, Envoy answers, Ctrl-C stops every child."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from e2e.test_demo import _gone

pytestmark = pytest.mark.slow


def test_up_runs_until_ctrl_c_and_leaves_nothing_running(tmp_path: Path) -> None:
    workdir = tmp_path / "run"
    log = (tmp_path / "up.out").open("w+")
    up = subprocess.Popen([sys.executable, "-m", "loraplane.cli", "up", "--engines", "2", "--workdir", str(workdir)],
                          stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while "Ctrl-C stops everything" not in (text := Path(log.name).read_text()):
            assert up.poll() is None, text
            assert time.monotonic() < deadline, text
            time.sleep(0.5)
        pids = json.loads(re.search(r"pids: (\{.*\})", text).group(1))  # type: ignore[union-attr]
        kubeconfig = re.search(r"kubeconfig: (\S+)", text).group(1)  # type: ignore[union-attr]
        gateway = re.search(r"gateway \(OpenAI API through Envoy\): (\S+)", text).group(1)  # type: ignore[union-attr]

        listed = subprocess.run(["kubectl", "--kubeconfig", kubeconfig, "--cache-dir", str(tmp_path / "kube-cache"),
                                 "get", "pods,inferencepools,adapterrevisions", "-o", "name"],
                                capture_output=True, text=True, timeout=30, env={**os.environ, "KUBECONFIG": kubeconfig})
        assert listed.returncode == 0, listed.stderr
        assert sorted(listed.stdout.split()) == [
            "inferencepool.inference.networking.k8s.io/local", "pod/engine-0", "pod/engine-1"]
        phases = subprocess.run(["kubectl", "--kubeconfig", kubeconfig, "--cache-dir", str(tmp_path / "kube-cache"),
                                 "get", "pods", "-o", "jsonpath={.items[*].status.phase}"],
                                capture_output=True, text=True, timeout=30)
        assert phases.stdout.split() == ["Running", "Running"], phases.stderr
        models = httpx.get(f"{gateway}/v1/models", timeout=30)
        assert models.status_code == 200 and models.headers["server"] == "envoy"
        assert len(pids) == 9 and all(not _gone(pid) for pid in pids.values())

        up.send_signal(signal.SIGINT)
        assert up.wait(60) == 0
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGKILL)
            up.wait()
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
    up = subprocess.Popen([sys.executable, "-m", "loraplane.cli", "up", "--engines", "1", "--workdir", str(workdir)],
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not (workdir / "logs" / "engine-0.log").exists():
            assert up.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        assert any("loraplane.engine" in c for c in _running_with(workdir))
        up.send_signal(signal.SIGINT)
        assert up.wait(60) == 130
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGKILL)
            up.wait()
    assert _running_with(workdir) == []
