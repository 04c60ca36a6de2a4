"""Run several policies over one trace (in parallel processes) and collect their summaries."""

from __future__ import annotations

import bisect
import multiprocessing as mp
import os
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from loraplane.sim.admission import FlowControlConfig
from loraplane.sim.bound import belady_misses
from loraplane.sim.cluster import SimConfig, SimResult, Simulator
from loraplane.sim.metrics import DEFAULT_SLO_TTFT_MS, hot_ttft_p99_ms, served_ttft, summarize
from loraplane.sim.policies import build_policy, loraplane_pod_profile, loraplane_queue
from loraplane.sim.profile import Profile
from loraplane.sim.trace import BURST, Trace

#: the no-burst run covers the burst window plus a warm-up before it (pods, caches and placement rates settle)
#: and a tail after it (requests still queued at the window's end finish under the same conditions)
NO_BURST_WARMUP_S = 300.0
NO_BURST_TAIL_S = 60.0
#: points of the TTFT CDF kept for plots
CDF_POINTS = 200
#: width of the cold-starts-over-time bins, seconds
TIMELINE_BIN_S = 60.0


@dataclass(frozen=True)
class Job:
    """One simulation: a policy over a trace, ``no_burst`` for the companion run without the burst tenant."""

    policy: str
    no_burst: bool = False


def without_burst(trace: Trace) -> Trace:
    """The trace minus the burst tenant, cut to the burst window with a warm-up and a tail (all the comparison
    reads: hot requests inside the window)."""
    cut = trace.without_class(BURST)
    if trace.burst_window is None:
        return cut
    start, end = trace.burst_window[0] - NO_BURST_WARMUP_S, trace.burst_window[1] + NO_BURST_TAIL_S
    first = bisect.bisect_left(cut.arrival, start)
    last = bisect.bisect_left(cut.arrival, end)
    columns: list[list[float] | list[int]] = [cut.arrival, cut.adapter, cut.tenant, cut.input_tokens, cut.output_tokens]
    columns.extend(cut.prefix_columns())
    for column in columns:
        del column[last:]
        del column[:first]
    return cut


def usable_cpus() -> int:
    """CPUs this process may run on: its affinity mask where the OS has one (a container's cpuset), else all."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def simulate(
    trace: Trace,
    config: SimConfig,
    profile: Profile,
    policy: str,
    seed: int,
    picker_config: Path | None = None,
    progress: Callable[[int], None] | None = None,
    flow_control: FlowControlConfig | None = None,
    chart_pods: bool = True,
) -> SimResult:
    """One policy over one trace (``flow_control``: loraplane's picker queue, ignored by the baselines;
    ``chart_pods``: loraplane's pods as the chart starts them, else vLLM's defaults)."""
    built = build_policy(policy, seed, trace, profile, config, picker_config, flow_control, chart_pods)
    sim = Simulator(
        trace, config, built.pod_profile or profile, built.router, built.eviction, built.placement, progress=progress,
        admission=built.admission, priority=built.priority, scraper=built.scraper, counted_tokens=built.counted_tokens,
    )  # fmt: skip
    return sim.run()


def pod_settings(profile: Profile, chart_pods: bool = True) -> dict[str, dict[str, Any]]:
    """What the pods of loraplane and of the baselines run (vLLM's ``--scheduling-policy`` and step budget)."""
    defaults = {"scheduling_policy": "fcfs", "max_num_batched_tokens": profile.max_batched_tokens}
    own = {"scheduling_policy": "priority", "max_num_batched_tokens": loraplane_pod_profile(profile).max_batched_tokens}
    return {"loraplane": own if chart_pods else defaults, "baselines": defaults}


def curves(result: SimResult) -> dict[str, list[float]]:
    """Plot data: the TTFT CDF (ms at evenly spaced quantiles) and cold starts per time bin."""
    ttft = served_ttft(result)
    quantiles = np.linspace(0, 100, CDF_POINTS)
    bins = int(result.sim_seconds // TIMELINE_BIN_S) + 1
    timeline = np.bincount((np.asarray(result.load_times) // TIMELINE_BIN_S).astype(int), minlength=bins)
    return {
        "cdf_ms": (np.percentile(ttft, quantiles) * 1e3).round(3).tolist() if ttft.size else [],
        "cold_starts_per_bin": timeline.tolist(),
    }


# -- worker side --------------------------------------------------------------------------------------------------
_shared: dict[str, Any] = {}


def _init(trace: Trace, config: SimConfig, profile: Profile, seed: int, picker_config: Path | None, counters: Any) -> None:
    _shared.update(trace=trace, config=config, profile=profile, seed=seed, picker=picker_config, counters=counters)
    _shared.setdefault("flow_control", None)
    _shared.setdefault("chart_pods", True)
    _shared.setdefault("slo_ttft_ms", DEFAULT_SLO_TTFT_MS)
    _shared["no_burst"] = without_burst(trace) if trace.has_class(BURST) else None


def _run_job(index: int, job: Job) -> tuple[int, dict[str, Any]]:
    trace: Trace = _shared["no_burst"] if job.no_burst else _shared["trace"]
    counters = _shared["counters"]

    def progress(done: int) -> None:
        counters[index] = done

    start = time.process_time()
    result = simulate(
        trace, _shared["config"], _shared["profile"], job.policy, _shared["seed"], _shared["picker"], progress,
        _shared["flow_control"], _shared["chart_pods"],
    )  # fmt: skip
    counters[index] = len(trace)
    out: dict[str, Any] = {"cpu_s": round(time.process_time() - start, 2), "events": result.events}
    if job.no_burst:
        out["hot_ttft_p99_ms"] = hot_ttft_p99_ms(result)
    else:
        out["summary"] = summarize(result, _shared["config"], _shared["bound"], _shared["slo_ttft_ms"])
        out["curves"] = curves(result)
    return index, out


def run_all(
    trace: Trace,
    config: SimConfig,
    profile: Profile,
    policies: list[str],
    seed: int,
    picker_config: Path | None = None,
    jobs: int | None = None,
    on_progress: Callable[[list[Job], list[int], list[int]], None] | None = None,
    slo_ttft_ms: float = DEFAULT_SLO_TTFT_MS,
    flow_control: FlowControlConfig | None = None,
    chart_pods: bool = True,
) -> dict[str, Any]:
    """Run every policy (and, when the trace has a burst tenant, each again without it); the report dict.
    ``flow_control`` puts the in-simulator picker queue in front of loraplane only."""
    started = time.monotonic()
    bound = belady_misses(trace.adapter, config.pods * config.max_loras)
    work = [Job(p) for p in policies]
    no_burst = without_burst(trace) if trace.has_class(BURST) else None
    if no_burst is not None:
        work += [Job(p, no_burst=True) for p in policies]
    totals = [len(no_burst) if j.no_burst and no_burst is not None else len(trace) for j in work]
    workers = max(1, min(jobs or usable_cpus(), len(work)))
    ctx = mp.get_context("fork") if "fork" in mp.get_all_start_methods() else mp.get_context()
    counters = ctx.Array("q", len(work), lock=False)
    _shared.update(bound=bound, slo_ttft_ms=slo_ttft_ms, flow_control=flow_control, chart_pods=chart_pods)
    results: dict[int, dict[str, Any]] = {}
    if workers == 1:
        _init(trace, config, profile, seed, picker_config, counters)
        for i, job in enumerate(work):
            results[i] = _run_job(i, job)[1]
            if on_progress:
                on_progress(work, list(counters), totals)
    else:
        with ProcessPoolExecutor(
            workers, mp_context=ctx, initializer=_init, initargs=(trace, config, profile, seed, picker_config, counters)
        ) as pool:
            # longest first: loraplane's runs cost the most
            order = sorted(range(len(work)), key=lambda i: (work[i].policy != "loraplane", work[i].no_burst))
            futures = [pool.submit(_run_job, i, work[i]) for i in order]
            while not all(f.done() for f in futures):
                if on_progress:
                    on_progress(work, list(counters), totals)
                time.sleep(0.2)
            for f in futures:
                i, out = f.result()
                results[i] = out
    report_policies: dict[str, Any] = {}
    for i, job in enumerate(work):
        if not job.no_burst:
            entry = dict(results[i]["summary"])
            entry["hot_ttft_p99_no_burst_ms"] = entry["hot_ttft_p99_ms"]
            entry["cpu_s"] = results[i]["cpu_s"]
            entry["curves"] = results[i]["curves"]
            report_policies[job.policy] = entry
    for i, job in enumerate(work):
        if job.no_burst:
            report_policies[job.policy]["hot_ttft_p99_no_burst_ms"] = results[i]["hot_ttft_p99_ms"]
            report_policies[job.policy]["cpu_s"] += results[i]["cpu_s"]
    report: dict[str, Any] = {
        "scenario": trace.name,
        "requests": len(trace),
        "seed": seed,
        "pool": {"pods": config.pods, "max_loras": config.max_loras, "max_cpu_loras": config.max_cpu_loras},
        "peers_scrape_interval_s": config.scrape_interval_s,
        "loraplane_runtime": config.loraplane_runtime,
        "profile": profile.name,
        "slo_ttft_ms": slo_ttft_ms,
        "flow_control": loraplane_queue(profile, picker_config, flow_control),
        "pods": pod_settings(profile, chart_pods),
        "placement": asdict(config.placement),
        "trace_seconds": round(trace.duration, 1),
        "bound": {
            "cold_starts": bound,
            "cold_start_rate": round(bound / len(trace), 6) if len(trace) else 0.0,
            "slots": config.pods * config.max_loras,
        },
        "policies": report_policies,
        "wall_s": round(time.monotonic() - started, 1),
    }
    if trace.meta:  # how the trace was made (the Azure scenarios' options, clipping and source)
        report["trace_options"] = dict(trace.meta)
    return report
