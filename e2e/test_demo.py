"""``loraplane up --demo`` end to end: the real command, every process real, and the demo's own JSON summary checked.

Asserts behaviour, not just that it ran: requests for a revision some pod holds on GPU land on such a pod, some
requests find their tail adapter on disk and the engines read it back first (their own per-tier TTFT counts), the
picker's decisions account for every request, the canary rollout passes every phase in order and ends Stable,
no response came from a revision the route table did not name (served-name and digest headers), the new revision
serves all traffic afterwards, and every child process is gone once the command exits.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from loraplane.stack.demo import is_unload_race

pytestmark = pytest.mark.slow

ROLLOUT_ORDER = ["Verifying", "Prewarming", "Activating", "Probing", "Canary(1)", "Canary(2)", "Stable"]


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    status = Path(f"/proc/{pid}/status")
    return status.exists() and "\nState:\tZ" in status.read_text()  # exited, waiting to be reaped by init


def test_demo_scenario(tmp_path: Path) -> None:
    workdir = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "loraplane.cli", "up", "--demo", "--json", "--workdir", str(workdir)],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout)

    # failures: at most the documented rare 404 of a revision unloaded just after it was routed (docs/controller.md)
    assert result["ok"], (result["errors"][:5], result["rollout_final_phase"])
    assert all(is_unload_race(error) for error in result["errors"]), result["errors"][:5]
    assert len(result["errors"]) <= 0.02 * result["requests"], result["errors"][:5]
    assert result["wrong_revision"] == [], result["wrong_revision"][:5]
    assert 300 <= result["requests"] <= 900

    # warm requests land on warm pods
    assert result["warm_available"] >= 200
    assert result["warm_landed"] >= 0.95 * result["warm_available"], (result["warm_landed"], result["warm_available"])
    assert result["ttft_by_tier"]["gpu"]["count"] >= 200
    # tail adapters kept on disk (registered: the engine demoted them) are served after a real read from disk
    assert result["ttft_by_tier"]["cold"]["count"] > 0, result["ttft_by_tier"]
    assert result["engine_requests_by_tier"].get("L2", 0) > 0, result["engine_requests_by_tier"]
    # every served request is counted (and the controller's health probes of the new revision)
    assert sum(result["engine_requests_by_tier"].values()) >= result["requests"] - len(result["errors"])
    decisions = result["decisions"]
    assert sum(decisions.values()) == result["requests"], decisions  # the picker routed every request
    assert decisions.get("warm-gpu", 0) >= 0.8 * result["requests"], decisions

    # the rollout passed every phase in order, traffic weights rising, and ended Stable
    phases = [step["phase"] for step in result["rollout"]]
    assert [p for p in phases if p in ROLLOUT_ORDER] == ROLLOUT_ORDER, phases
    weights = {step["phase"]: step["weight"] for step in result["rollout"]}
    assert weights["Canary(1)"] == 20 and weights["Canary(2)"] == 50 and weights["Stable"] == 100, weights
    assert result["rollout_final_phase"] == "Stable"
    assert result["previous_revision_phase"] in ("Retiring", "Retired")
    assert set(result["served_after_rollout"]) == {"claims@v2"}, result["served_after_rollout"]

    # the HTML report: written in the workdir, its path printed, its three charts drawn from every timed request
    report = Path(result["report"])
    assert report.parent == workdir.resolve() and f"report: {report}" in done.stderr
    page = report.read_text()
    assert all(f'<h2 id="{section}">' in page for section in ("ttft", "rollout", "decisions"))
    assert page.count('r="2.2"') >= result["requests"] - len(result["errors"])
    assert all(f">{step['phase']}</text>" in page for step in result["rollout"])

    # the manifests went through the real kubectl, and nothing is left running
    assert (workdir / "manifests" / "v2.yaml").exists()
    assert "adapterrevision.loraplane.io/claims-v2 created" in done.stderr
    assert len(result["pids"]) == 11  # API server, redis, 3 engines, 3 sidecars, picker, Envoy, controller
    assert [name for name, pid in result["pids"].items() if not _gone(pid)] == []
