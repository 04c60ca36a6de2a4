"""Small pools and traces shared by the simulator tests."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from loraplane.sim.admission import OFF, FlowControlConfig
from loraplane.sim.profile import LARGE_GPU, Profile
from loraplane.sim.trace import Adapter, Tenant, Trace

ADAPTER_BYTES = LARGE_GPU.default_adapter_bytes
#: loraplane without the flow-control queue its picker config ships (tests of the pods' own queues and admission)
NO_QUEUE = FlowControlConfig(queue=OFF)


def free_loads(profile: Profile = LARGE_GPU) -> Profile:
    """``profile`` with every adapter load and download costing nothing."""
    return replace(
        profile,
        h2d_fixed_ms=0.0,
        h2d_ms_per_mb=0.0,
        disk_fixed_ms=0.0,
        disk_read_ms_per_mb=0.0,
        parse_ms_per_mb=0.0,
        download_fixed_ms=0.0,
        download_ms_per_mb=0.0,
    )


def sparse_trace(requests: int, adapters: int, gap_s: float, seed: int) -> Trace:
    """Requests ``gap_s`` apart (every pod idle when one arrives), random adapters, a third of them not on disk."""
    rng = np.random.default_rng(seed)
    tenants = [Tenant("gold", priority=1), Tenant("batch", cls="burst")]
    table = [Adapter(f"a{i}@v1", i % 2, ADAPTER_BYTES, on_disk=i % 3 != 0) for i in range(adapters)]
    chosen = rng.integers(0, adapters, requests).tolist()
    return Trace(
        name="sparse",
        tenants=tenants,
        adapters=table,
        arrival=[i * gap_s for i in range(requests)],
        adapter=chosen,
        tenant=[table[a].tenant for a in chosen],
        input_tokens=rng.integers(16, 512, requests).tolist(),
        output_tokens=rng.integers(1, 32, requests).tolist(),
    )


@pytest.fixture
def sparse() -> Trace:
    """A sparse trace over 12 adapters."""
    return sparse_trace(240, 12, 2.0, seed=7)
