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
    assert "every process stopped" in Path(log.name).read_text()
