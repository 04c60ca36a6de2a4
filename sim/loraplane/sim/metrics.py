"""Summaries of a run: SLO attainment and refusals, TTFT percentiles of served requests (overall, warm vs cold, per
tenant class), cold starts against the bound, thrash, hits per tier, GPU slot use, prefix-cache hit rate."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from loraplane.sim.bound import belady_misses
from loraplane.sim.cluster import SERVED, TIER_NAMES, SimConfig, SimResult
from loraplane.sim.trace import BURST, Trace

PERCENTILES = (50, 95, 99)
#: the TTFT a request must meet to count as served within its SLO (``--slo-ttft-ms``)
DEFAULT_SLO_TTFT_MS = 2000.0


def percentiles_ms(values: np.ndarray) -> dict[str, float | None]:
    """p50 / p95 / p99 in ms of ``values`` (seconds); None each when there are none."""
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


def served_mask(result: SimResult) -> np.ndarray:
    """Requests that were served (not refused)."""
    return np.asarray(np.frombuffer(result.refused, dtype=np.uint16) == SERVED)


def served_ttft(result: SimResult) -> np.ndarray:
    """TTFTs (seconds) of the served requests."""
    return np.asarray(np.frombuffer(result.ttft, dtype=np.float64)[served_mask(result)])


def every_request_p50_ms(result: SimResult) -> float | None:
    """The median TTFT in ms over every request, a refused one counted as never answered (None when more than half
    were refused). Unlike the p50 of served requests it does not move with which requests a pool refuses: at an
    overloaded point the served set differs between two runs by the slow requests one of them refused."""
    every = np.where(served_mask(result), np.frombuffer(result.ttft, dtype=np.float64), np.inf)
    if every.size == 0:
        return None
    value = float(np.quantile(every, 0.5, method="inverted_cdf"))
    return round(value * 1e3, 2) if math.isfinite(value) else None


def slo_figures(result: SimResult, slo_ttft_ms: float) -> dict[str, Any]:
    """``slo_attainment`` (served within the SLO over all requests: a refused request is a miss), ``rejected``
    (by status too), ``p99_served_ttft_ms`` and how many requests waited in the picker and for how long."""
    n = len(result.trace)
    served = served_mask(result)
    ttft = np.frombuffer(result.ttft, dtype=np.float64)
    refused = np.frombuffer(result.refused, dtype=np.uint16)
    held = np.frombuffer(result.held_s, dtype=np.float64)
    met = int(np.count_nonzero(served & (ttft * 1e3 <= slo_ttft_ms)))
    statuses = refused[~served]
    return {
        "slo_ttft_ms": slo_ttft_ms,
        "slo_attainment": round(met / n, 4) if n else 0.0,
        "rejected": int(statuses.size),
        "rejected_by_status": {str(s): int(c) for s, c in zip(*np.unique(statuses, return_counts=True), strict=True)},
        "p99_served_ttft_ms": _p99_ms(ttft[served]),
        "held": int(np.count_nonzero(held > 0)),
        "held_p99_ms": _p99_ms(held[held > 0]),
    }


def prefix_hit_rate(result: SimResult) -> float:
    """Prompt tokens served from a prefix cache over all prompt tokens, of served requests (0 without prefixes)."""
    served = served_mask(result)
    cached = np.frombuffer(result.cached_tokens, dtype=np.int32)
    if cached.size != served.size:
        return 0.0
    prompt = int(np.asarray(result.trace.input_tokens, dtype=np.int64)[served].sum())
    return round(int(cached[served].sum()) / prompt, 4) if prompt else 0.0


def hot_ttft_p99_ms(result: SimResult) -> float | None:
    """P99 TTFT of hot tenants' served requests (during the burst, when there is one)."""
    ttft = np.frombuffer(result.ttft, dtype=np.float64)
    return _p99_ms(ttft[hot_mask(result.trace) & served_mask(result)])


def summarize(
    result: SimResult, config: SimConfig, bound_cold_starts: int, slo_ttft_ms: float = DEFAULT_SLO_TTFT_MS
) -> dict[str, Any]:
    """The JSON-ready summary of one policy's run; TTFT figures are of served requests."""
    trace = result.trace
    n = len(trace)
    served = served_mask(result)
    ttft = np.frombuffer(result.ttft, dtype=np.float64)
    tier = np.frombuffer(bytes(result.tier), dtype=np.uint8)
    warm = tier == 0
    classes = np.array([t.cls for t in trace.tenants])[np.asarray(trace.tenant, dtype=int)] if n else np.array([])
    by_class = {str(c): percentiles_ms(ttft[served & (classes == c)]) for c in sorted(set(classes.tolist()))}
    capacity_s = config.pods * config.max_loras * result.sim_seconds
    return {
        "requests": n,
        **slo_figures(result, slo_ttft_ms),
        "ttft_ms": percentiles_ms(ttft[served]),
        "ttft_p50_every_request_ms": every_request_p50_ms(result),
        "warm_ttft_ms": percentiles_ms(ttft[served & warm]),
        "cold_ttft_ms": percentiles_ms(ttft[served & ~warm]),
        "ttft_ms_by_class": by_class,
        "hot_ttft_p99_ms": hot_ttft_p99_ms(result),
        # every load into a GPU slot, on demand or ahead of it (placement): what Belady minimises
        "cold_starts": result.gpu_loads,
        "cold_start_rate": round(result.gpu_loads / n, 6) if n else 0.0,
        "cold_starts_over_bound": round(result.gpu_loads / bound_cold_starts, 3) if bound_cold_starts else None,
        "demand_loads": result.demand_loads,
        # of the cold starts, those a registration made (``--loraplane-runtime vllm``: vLLM's load activates)
        "registration_loads": result.registration_loads,
        **({"controller_plans": dict(result.controller_plans)} if result.controller_plans else {}),
        "bound_in_service_order": belady_misses(
            [trace.adapter[i] for i in result.admitted], config.pods * config.max_loras
        ),
        "evictions": result.gpu_evictions,
        "running_evictions": result.running_evictions,
        "preemptions": result.preemptions,
        "thrash_ratio": round(result.thrash_reloads / result.gpu_evictions, 4) if result.gpu_evictions else 0.0,
        "hit_ratio": {
            name: round(float(np.mean(tier[served] == i)), 4) if served.any() else 0.0
            for i, name in enumerate(TIER_NAMES)
        },
        "gpu_slot_use": round(result.slot_busy_s / capacity_s, 4) if capacity_s else 0.0,
        "prefix_hit_rate": prefix_hit_rate(result),
        "sim_seconds": round(result.sim_seconds, 1),
    }
