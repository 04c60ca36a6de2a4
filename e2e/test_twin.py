"""The twin end to end: the real control plane on 8 emulated vLLM pods, a trace replayed through Envoy.

Every process is the production one (API server, Redis, sidecars, picker, Envoy, controller); only the model servers
are loraplane's vLLM emulator. The checks: every revision onboards through kubectl, every request is answered by the
revision it named (its tokens are that revision's), the client sees the first token before the end (Envoy streams
bodies through the picker), and residency-aware routing keeps GPU loads far below one per request.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from loraplane.sim.profile import LARGE_GPU
from loraplane.sim.trace import scenario
from loraplane.stack.twin import ARTIFACTS, MODEL, Twin, TwinOptions, start_stack, write_adapters

pytestmark = pytest.mark.slow

PODS = 8


def test_eight_emulated_pods_serve_a_trace_through_the_real_control_plane(tmp_path: Path) -> None:
    trace = scenario("gie-multilora", 400, 0, LARGE_GPU.default_adapter_bytes)
    options = TwinOptions(pods=PODS)
    adapters = write_adapters(trace, tmp_path / "twin" / ARTIFACTS, MODEL)
    stack = start_stack(tmp_path / "twin", options)
    try:
        twin = Twin(stack, trace, options, adapters)
        twin.onboard()
        report = twin.run("loraplane")
    finally:
        stack.stop()
    assert report["requests"] == len(trace)
    assert report["wrong_revision"] == 0, report
    assert report["no_answer"] == 0, report["refusal_reasons"]
    assert report["rejected"] == 0, report["refusal_reasons"]
    # streamed through Envoy and the picker: a long answer's first token arrives well before its last. The emulator
    # charges every decode step at least the profile's one-sequence step, so the rest of an answer of n tokens takes
    # at least (n - 1) steps after its first token; half of that is a floor no buffering path reaches
    step_s = LARGE_GPU.decode_step_ms(1, 1) / 1e3
    long = [(o.e2e_s - o.ttft_s, trace.output_tokens[i]) for i, o in enumerate(twin.outcomes)
            if trace.output_tokens[i] >= 32]
    assert long and np.median([gap / ((n - 1) * step_s) for gap, n in long]) > 0.5, long[:10]
    # the emulators counted the loads into GPU slots: residency-aware routing keeps them far below the requests
    assert 0 < report["cold_starts"] < len(trace) / 4, report
    assert set(report["processes"]) >= {"pod", "sidecar", "picker", "envoy", "controller"}
    assert report["processes"]["pod"]["processes"] == PODS
    assert np.isfinite(report["ttft_ms"]["p99"])
