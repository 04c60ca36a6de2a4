"""The simulator's shortcuts change nothing: the same report for any number of worker processes, and the admission
scan's jumps over requests it would skip give exactly what looking at every waiting request gives."""

from __future__ import annotations

import os
from array import array

import numpy as np
import pytest

from loraplane.sim import cluster
from loraplane.sim.cluster import SimConfig
from loraplane.sim.profile import LARGE_GPU
from loraplane.sim.runner import run_all, simulate, usable_cpus
from loraplane.sim.trace import scenario
from tests.sim.conftest import ADAPTER_BYTES, NO_QUEUE

#: a pool small enough that the trace overloads it: long queues, blocked adapters, out-of-order admission
OVERLOADED = SimConfig(pods=2, max_loras=2, max_cpu_loras=4)


def _without_timings(report: dict) -> dict:
    report = {k: v for k, v in report.items() if k != "wall_s"}
    report["policies"] = {
        name: {k: v for k, v in entry.items() if k != "cpu_s"} for name, entry in report["policies"].items()
    }
    return report


def test_the_report_is_the_same_for_any_number_of_worker_processes() -> None:
    trace = scenario("hot-plus-burst", 1500, seed=3, adapter_bytes=ADAPTER_BYTES)
    policies = ["loraplane", "gie-lora-affinity", "round-robin"]
    reports = [run_all(trace, OVERLOADED, LARGE_GPU, policies, seed=3, jobs=jobs) for jobs in (1, 2, 3)]
    assert reports[0]["policies"]["loraplane"]["cold_starts"] > 0
    for other in reports[1:]:
        assert _without_timings(other) == _without_timings(reports[0])


def test_workers_default_to_the_cpus_the_process_may_use(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert usable_cpus() == 2
    monkeypatch.delattr(os, "sched_getaffinity")
    assert usable_cpus() == 64


@pytest.mark.parametrize(
    ("policy", "name"),
    [("gie-default", "long-tail-1k"), ("gie-lora-affinity", "long-tail-1k"), ("loraplane", "gie-multilora")],
)
def test_passing_over_skipped_requests_changes_nothing(policy: str, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The admission scan jumps over requests it would skip; looking at every one in turn gives the same run (no
    flow-control queue in front of loraplane: the pods' own queues build up)."""
    trace = scenario(name, 3000, seed=6, adapter_bytes=ADAPTER_BYTES)
    fast = simulate(trace, OVERLOADED, LARGE_GPU, policy, seed=6, flow_control=NO_QUEUE)
    jumped = 0
    real = cluster._next_admissible

    def counted(pod: cluster.Pod, start: int, stop: int, order: array) -> int:
        nonlocal jumped
        position = real(pod, start, stop, order)
        jumped += position - start
        return position

    monkeypatch.setattr(cluster, "_next_admissible", counted)
    counted_run = simulate(trace, OVERLOADED, LARGE_GPU, policy, seed=6, flow_control=NO_QUEUE)
    monkeypatch.setattr(cluster, "_next_admissible", lambda pod, start, stop, order: start)
    full = simulate(trace, OVERLOADED, LARGE_GPU, policy, seed=6, flow_control=NO_QUEUE)
    assert jumped > 1000  # the shortcut is taken, often
    assert max(np.frombuffer(full.ttft)) > 10.0  # queues build up: the scan has skipping to do
    for run in (fast, counted_run):
        assert run.ttft == full.ttft
        assert run.pod == full.pod and run.tier == full.tier and run.admitted == full.admitted
        assert (run.gpu_loads, run.gpu_evictions, run.events) == (full.gpu_loads, full.gpu_evictions, full.events)
