"""Onboarding hundreds of first revisions in one ``kubectl apply`` on ``loraplane up``'s real processes: every one
must end ``Stable`` (issue 31, item 3).

Three reference engines with two GPU slots and sixteen host slots each, so many revisions are prewarmed at once
and the canaries' GPU slots are scarce: the revisions wait for one in line (``WaitingForGpuSlot``) and none is
evicted between its activation and its probe.
The revisions share one artifact (as the issue's 500 did), each under its own adapter name. The count is
``LORAPLANE_ONBOARDING_REVISIONS`` (default 500). Prints its figures (an ``ONBOARDING {...}`` line).
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from loraplane.stack.demo import manifest, write_artifacts
from loraplane.stack.services import LocalStack, StackOptions

pytestmark = pytest.mark.slow

REVISIONS = int(os.environ.get("LORAPLANE_ONBOARDING_REVISIONS", "500"))
#: each engine's ``--max-loras`` and ``--max-cpu-loras``
GPU_SLOTS, HOST_SLOTS = 2, 16
GROUP_PATH = "/apis/loraplane.io/v1alpha1/namespaces/default/adapterrevisions"
TERMINAL = ("Stable", "Failed", "RolledBack")


def _statuses(url: str) -> dict[str, dict[str, Any]]:
    listing = httpx.get(f"{url}{GROUP_PATH}", timeout=30).json()
    return {o["metadata"]["name"]: o.get("status") or {} for o in listing["items"]}


def test_hundreds_of_first_revisions_in_one_apply_all_end_stable(tmp_path: Path) -> None:
    stack = LocalStack(StackOptions(workdir=tmp_path / "stack", engines=3, max_loras=GPU_SLOTS,
                                    max_cpu_loras=HOST_SLOTS))
    try:
        stack.start()
        assert stack.cluster is not None
        artifact = write_artifacts(stack.artifacts, [("shared", "v1")], stack.options.model)["shared@v1"]
        engine = stack.engines[0]
        base = httpx.get(f"http://{engine.address}/admin/adapters", headers=stack.admin_headers(engine.pod)).json()
        manifests = []
        for i in range(REVISIONS):
            # names in another order than creation (as real names are): the pool's adapters are decided by name
            name = f"a{(i * 337) % REVISIONS:03d}" if REVISIONS % 337 else f"a{i:03d}"
            body = manifest(artifact, stack.options.model, base["base_model_digest"], "gpu-preferred")
            body["metadata"]["name"] = f"{name}-v1"
            body["spec"]["adapter"] = name
            manifests.append(body)
        path = stack.options.workdir / "manifests" / "onboarding.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump_all(manifests))
        applied = time.monotonic()
        stack.cluster.kubectl("apply", "-f", str(path), timeout=600)
        apply_s = time.monotonic() - applied
        waiting_peak, reasons_seen = 0, Counter[str]()
        deadline = applied + 3600
        while True:
            statuses = _statuses(stack.cluster.url)
            phases = Counter(s.get("phase", "Pending") for s in statuses.values())
            waiting = sum(s.get("reason") == "WaitingForGpuSlot" for s in statuses.values())
            waiting_peak = max(waiting_peak, waiting)
            reasons_seen.update({s.get("reason") or "" for s in statuses.values()})
            if len(statuses) == REVISIONS and sum(phases[p] for p in TERMINAL) == REVISIONS:
                break
            assert time.monotonic() < deadline, phases
            time.sleep(2)
        wall_s = time.monotonic() - applied
        stranded = {n: f"{s['phase']} {s.get('reason')}: {s.get('message', '')[:120]}"
                    for n, s in statuses.items() if s.get("phase") != "Stable"}
        print("ONBOARDING " + json.dumps({
            "revisions": REVISIONS, "engines": 3, "gpu_slots_per_engine": GPU_SLOTS, "host_cache_per_engine": HOST_SLOTS,
            "apply_s": round(apply_s, 1), "all_terminal_after_s": round(wall_s, 1),
            "phases": dict(phases), "waiting_for_gpu_slot_peak": waiting_peak,
            "stranded": dict(list(stranded.items())[:10]), "restarts": stack.restarts}), flush=True)
        assert stranded == {}
        assert waiting_peak > 0  # the queue was there, and visible
    finally:
        stack.stop()
