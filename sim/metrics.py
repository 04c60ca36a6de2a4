"""Summaries of a run: TTFT percentiles (overall, warm vs cold, per tenant class), cold starts against the bound,
thrash, hits per tier, GPU slot use."""

from __future__ import annotations

from typing import Any

import numpy as np

from loraplane.sim.bound import belady_misses
from loraplane.sim.cluster import TIER_NAMES, SimConfig, SimResult
from loraplane.sim.trace import BURST, Trace

PERCENTILES = (50, 95, 99)


def _percentiles_ms(values: np.ndarray) -> dict[str, float | None]:
    if values.size == 0:
        return {f"p{q}": None for q in PERCENTILES}
    got = np.percentile(values, PERCENTILES) * 1e3
    return {f"p{q}": round(float(v), 2) for q, v in zip(PERCENTILES, got, strict=True)}


def _p99_ms(values: np.ndarray) -> float | None:
    return round(float(np.percentile(values, 99) * 1e3), 2) if values.size else None


def hot_mask(trace: Trace) -> np.ndarray:
    """Requests of hot (non-burst) tenants; inside the burst window when the trace has one."""
    burst_tenants = np.array([t.cls == BURST for t in trace.tenants])
    mask = ~burst_tenants[np.asarray(trace.tenant, dtype=int)]
    if trace.burst_window is not None:
        arrival = np.asarray(trace.arrival)
        mask &= (arrival >= trace.burst_window[0]) & (arrival < trace.burst_window[1])
    return np.asarray(mask)


def hot_ttft_p99_ms(result: SimResult) -> float | None:
    """P99 TTFT of hot tenants' requests (during the burst, when there is one)."""
    ttft = np.frombuffer(result.ttft, dtype=np.float64)
    return _p99_ms(ttft[hot_mask(result.trace)])


def summarize(result: SimResult, config: SimConfig, bound_cold_starts: int) -> dict[str, Any]:
    """The JSON-ready summary of one policy's run."""
    trace = result.trace
    n = len(trace)
    ttft = np.frombuffer(result.ttft, dtype=np.float64)
    tier = np.frombuffer(bytes(result.tier), dtype=np.uint8)
    warm = tier == 0
    classes = np.array([t.cls for t in trace.tenants])[np.asarray(trace.tenant, dtype=int)] if n else np.array([])
    by_class = {str(c): _percentiles_ms(ttft[classes == c]) for c in sorted(set(classes.tolist()))}
    capacity_s = config.pods * config.max_loras * result.sim_seconds
    return {
        "requests": n,
        "ttft_ms": _percentiles_ms(ttft),
        "warm_ttft_ms": _percentiles_ms(ttft[warm]),
        "cold_ttft_ms": _percentiles_ms(ttft[~warm]),
        "ttft_ms_by_class": by_class,
        "hot_ttft_p99_ms": hot_ttft_p99_ms(result),
        # every load into a GPU slot, on demand or ahead of it (placement): what Belady minimises
        "cold_starts": result.gpu_loads,
        "cold_start_rate": round(result.gpu_loads / n, 6) if n else 0.0,
        "cold_starts_over_bound": round(result.gpu_loads / bound_cold_starts, 3) if bound_cold_starts else None,
        "demand_loads": result.demand_loads,
        "bound_in_service_order": belady_misses(
            [trace.adapter[i] for i in result.admitted], config.pods * config.max_loras
        ),
        "evictions": result.gpu_evictions,
        "thrash_ratio": round(result.thrash_reloads / result.gpu_evictions, 4) if result.gpu_evictions else 0.0,
        "hit_ratio": {name: round(float(np.mean(tier == i)), 4) if n else 0.0 for i, name in enumerate(TIER_NAMES)},
        "gpu_slot_use": round(result.slot_busy_s / capacity_s, 4) if capacity_s else 0.0,
        "sim_seconds": round(result.sim_seconds, 1),
    }
