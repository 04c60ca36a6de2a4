"""``loraplane plan --scenario S | --trace CSV``: GPUs needed at an SLO, per routing policy.

For each policy, the fewest pods (one GPU each, ``--max-loras`` / ``--max-cpu-loras`` slots) with which its
``slo_attainment`` (requests served within ``--slo-ttft-ms`` over all requests, a refused request a miss) reaches
``--target-attainment`` on the trace. The search assumes attainment does not fall as pods are added: from
``--pods`` it halves while the target holds (or doubles until it holds, at most ``--max-pods``), then bisects
between the largest count that missed and the smallest that met it, so the answer's neighbour one pod below was
simulated and missed (unless it is 1). Every count simulated is reported with its attainment (``tried``).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import orjson
from rich.console import Console
from rich.table import Table

from loraplane.controller.config import load_config
from loraplane.helptext import HelpFormatter
from loraplane.sim.admission import FlowControlConfig
from loraplane.sim.bound import belady_misses
from loraplane.sim.cli import AZURE_FLAGS, azure_options
from loraplane.sim.cluster import LORAPLANE_RUNTIMES, VLLM, SimConfig
from loraplane.sim.metrics import DEFAULT_SLO_TTFT_MS, slo_figures
from loraplane.sim.policies import LORAPLANE, POLICY_NAMES
from loraplane.sim.profile import LARGE_GPU, Profile, ProfileError, load_profile
from loraplane.sim.runner import simulate, usable_cpus
from loraplane.sim.trace import SCENARIOS, Trace, TraceError, load_csv, scenario

#: the search never goes beyond this many pods unless ``--max-pods`` says so
DEFAULT_MAX_PODS = 128
SEARCH = ("from --pods, halve while the target holds (or double until it holds, at most --max-pods), then bisect "
          "between the largest pod count that missed and the smallest that met it (attainment assumed not to fall "
          "as pods are added)")  # fmt: skip


def fewest_pods(attainment: Callable[[int], float], target: float, start: int, max_pods: int
                ) -> tuple[int | None, dict[int, float]]:  # fmt: skip
    """The fewest pods whose ``attainment(pods)`` reaches ``target`` (None: not even ``max_pods``), and every count
    evaluated with its attainment. Galloping from ``start`` (halving or doubling), then bisection."""
    tried: dict[int, float] = {}

    def meets(pods: int) -> bool:
        if pods not in tried:
            tried[pods] = attainment(pods)
        return tried[pods] >= target

    start = max(1, min(start, max_pods))
    if meets(start):
        high, low = start, start // 2  # ``low``: 0 or a count that missed
        while low >= 1 and meets(low):
            high, low = low, low // 2
    else:
        low, high = start, min(max_pods, start * 2)
        while not meets(high):
            if high >= max_pods:
                return None, tried
            low, high = high, min(max_pods, high * 2)
    while high - low > 1:
        mid = (low + high) // 2
        if meets(mid):
            high = mid
        else:
            low = mid
    return high, tried


@dataclass(frozen=True)
class Search:
    """What one policy's search runs on (everything but the pod count)."""

    trace: Trace
    config: SimConfig
    profile: Profile
    seed: int
    slo_ttft_ms: float
    target: float
    start: int
    max_pods: int
    picker_config: Path | None = None
    flow_control: FlowControlConfig | None = None
    chart_pods: bool = True


def search_policy(search: Search, policy: str) -> dict[str, Any]:
    """One policy's fewest pods at the target, with its figures there and every count tried."""
    figures: dict[int, dict[str, Any]] = {}

    def attainment(pods: int) -> float:
        config = replace(search.config, pods=pods)
        result = simulate(
            search.trace, config, search.profile, policy, search.seed, search.picker_config, None,
            search.flow_control, search.chart_pods,
        )  # fmt: skip
        got = slo_figures(result, search.slo_ttft_ms)
        got["cold_starts"] = result.gpu_loads
        figures[pods] = got
        return float(got["slo_attainment"])

    started = time.process_time()
    pods, tried = fewest_pods(attainment, search.target, search.start, search.max_pods)
    at = figures[pods] if pods is not None else {}
    out: dict[str, Any] = {"pods": pods}
    for key in ("slo_attainment", "p99_served_ttft_ms", "rejected", "cold_starts"):
        out[key] = at.get(key)
    if pods is not None:
        out["bound_cold_starts"] = belady_misses(search.trace.adapter, pods * search.config.max_loras)
    out["tried"] = {str(n): tried[n] for n in sorted(tried)}
    out["cpu_s"] = round(time.process_time() - started, 1)
    return out


_search: dict[str, Search] = {}


def _init(search: Search) -> None:
    _search["search"] = search


def _run(policy: str) -> tuple[str, dict[str, Any]]:
    return policy, search_policy(_search["search"], policy)


def plan_pods(search: Search, policies: Sequence[str], jobs: int | None = None) -> dict[str, Any]:
    """Every policy's search (one worker process per policy, ``jobs`` at a time); the report dict."""
    started = time.monotonic()
    workers = max(1, min(jobs or usable_cpus(), len(policies)))
    found: dict[str, dict[str, Any]] = {}
    if workers == 1:
        for policy in policies:
            found[policy] = search_policy(search, policy)
    else:
        ctx = mp.get_context("fork") if "fork" in mp.get_all_start_methods() else mp.get_context()
        with ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init, initargs=(search,)) as pool:
            order = sorted(policies, key=lambda p: p != LORAPLANE)  # loraplane's runs cost the most: first
            for policy, out in pool.map(_run, order):
                found[policy] = out
    report: dict[str, Any] = {
        "scenario": search.trace.name,
        "requests": len(search.trace),
        "seed": search.seed,
        "profile": search.profile.name,
        "pool": {"max_loras": search.config.max_loras, "max_cpu_loras": search.config.max_cpu_loras},
        "loraplane_runtime": search.config.loraplane_runtime,
        "slo_ttft_ms": search.slo_ttft_ms,
        "target_attainment": search.target,
        "search": SEARCH,
        "policies": {p: found[p] for p in policies},
    }
    baselines = {p: v["pods"] for p, v in found.items() if p != LORAPLANE and v["pods"] is not None}
    if baselines:
        best = min(baselines, key=lambda p: (baselines[p], p))
        report["best_baseline"] = {"policy": best, "pods": baselines[best]}
        mine = found.get(LORAPLANE, {}).get("pods")
        if mine is not None:
            report["loraplane_pods_over_best_baseline"] = round(mine / baselines[best], 4)
    if search.trace.meta:
        report["trace_options"] = dict(search.trace.meta)
    report["wall_s"] = round(time.monotonic() - started, 1)
    return report


def _policies(text: str) -> list[str]:
    names = list(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    unknown = [n for n in names if n not in POLICY_NAMES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown policy {', '.join(unknown)}; choose from {', '.join(POLICY_NAMES)}")
    return names


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be >= 1")
    return value


def _attainment(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1] (got {text})")
    return value


def _ms(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 (got {text})")
    return value


def parser() -> argparse.ArgumentParser:
    """The arguments of ``loraplane plan``'s GPUs-at-SLO mode."""
    p = argparse.ArgumentParser(prog="loraplane plan", description=__doc__, formatter_class=HelpFormatter)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--scenario", choices=list(SCENARIOS), help="a generated trace (as loraplane sim)")
    source.add_argument("--trace", type=Path, help="a recorded trace (loraplane sim's CSV format)")
    p.add_argument("--policies", type=_policies, default=POLICY_NAMES, help=f"comma-separated: {', '.join(POLICY_NAMES)}")
    p.add_argument("--slo-ttft-ms", type=_ms, default=DEFAULT_SLO_TTFT_MS, help="the TTFT a served request must meet")
    p.add_argument("--target-attainment", type=_attainment, default=0.99,
                   help="the slo_attainment each policy must reach")  # fmt: skip
    p.add_argument("--pods", type=_positive, default=8, help="where the search starts")
    p.add_argument("--max-pods", type=_positive, default=DEFAULT_MAX_PODS, help="the most pods the search tries")
    p.add_argument("--max-loras", type=_positive, default=4, help="GPU adapter slots per pod")
    p.add_argument("--max-cpu-loras", type=_positive, default=16, help="host-memory adapter slots per pod")
    p.add_argument("--requests", type=_positive,
                   help="requests a scenario generates (loraplane sim's default; azure-*: the first N of the trace)")
    p.add_argument("--seed", type=int, default=0, help="seed of the generated trace and the policies")
    p.add_argument("--profile", default=LARGE_GPU.name, help="calibration profile (name or JSON file)")
    p.add_argument("--picker-config", type=Path, help="EndpointPickerConfig YAML for loraplane (default: packaged)")
    p.add_argument("--controller-config", type=Path, help="the controller's config YAML (placement settings)")
    p.add_argument("--flow-control", choices=["sim", "picker", "off"],
                   help="loraplane's queue (as loraplane sim; default: the picker config's own)")  # fmt: skip
    p.add_argument("--loraplane-pods", choices=["chart", "vllm-defaults"], default="chart",
                   help="loraplane's pods as the chart starts them or with vLLM's defaults (as loraplane sim)")
    p.add_argument("--loraplane-runtime", choices=LORAPLANE_RUNTIMES, default=VLLM,
                   help="what loraplane's pods run (as loraplane sim): vLLM behind loraplane's sidecar (the default) "
                        "or pods that load any revision on demand")  # fmt: skip
    p.add_argument("--jobs", type=_positive, help="worker processes, one policy each (default: one per CPU)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    azure = p.add_argument_group("real-arrival scenarios", "the options of loraplane sim's azure-* scenarios")
    for flag, (field, kind, metavar, text) in AZURE_FLAGS.items():
        azure.add_argument(flag, dest=field, type=kind, metavar=metavar, help=text)
    return p


def print_report(report: dict[str, Any], console: Console | None = None) -> None:
    """One row per policy: the fewest pods, its figures there, and the counts tried."""
    title = (f"{report['scenario']}: {report['requests']:,} requests; fewest pods (x {report['pool']['max_loras']} "
             f"GPU slots) reaching slo_attainment {report['target_attainment']} at TTFT {report['slo_ttft_ms']:.0f} ms")
    table = Table(title=title, title_justify="left")
    for column in ("policy", "pods", "slo_attainment", "p99 served ms", "rejected", "cold starts", "tried"):
        table.add_column(column, justify="left" if column in ("policy", "tried") else "right")
    for name, p in report["policies"].items():
        tried = ", ".join(f"{n}: {v:.4f}" for n, v in p["tried"].items())
        table.add_row(name, "-" if p["pods"] is None else str(p["pods"]),
                      "-" if p["slo_attainment"] is None else f"{p['slo_attainment']:.4f}",
                      "-" if p["p99_served_ttft_ms"] is None else f"{p['p99_served_ttft_ms']:,.0f}",
                      "-" if p["rejected"] is None else f"{p['rejected']:,}",
                      "-" if p["cold_starts"] is None else f"{p['cold_starts']:,}", tried)  # fmt: skip
    (console or Console()).print(table)
    if "loraplane_pods_over_best_baseline" in report:
        best = report["best_baseline"]
        (console or Console()).print(f"loraplane needs {report['loraplane_pods_over_best_baseline']:.2f}x the pods of "
                                     f"the best baseline ({best['policy']}, {best['pods']})", markup=False)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``loraplane plan --scenario S | --trace CSV``."""
    p = parser()
    args = p.parse_args(argv)
    err = Console(stderr=True)
    try:
        options = azure_options(p, args)
        profile = load_profile(args.profile)
        placement = load_config(args.controller_config).placement_config()
        config = SimConfig(pods=args.pods, max_loras=args.max_loras, max_cpu_loras=args.max_cpu_loras,
                           placement=placement, loraplane_runtime=args.loraplane_runtime)  # fmt: skip
        if args.trace is not None:
            trace = load_csv(args.trace, profile.default_adapter_bytes)
        else:
            trace = scenario(args.scenario, args.requests, args.seed, profile.default_adapter_bytes, options)
    except (ProfileError, TraceError, ValueError) as exc:
        err.print(f"loraplane plan: {exc}", markup=False)
        return 2
    search = Search(
        trace, config, profile, args.seed, args.slo_ttft_ms, args.target_attainment, args.pods,
        max(args.pods, args.max_pods), args.picker_config,
        FlowControlConfig(queue=args.flow_control) if args.flow_control else None, args.loraplane_pods == "chart",
    )  # fmt: skip
    report = plan_pods(search, args.policies, args.jobs)
    if args.json:
        sys.stdout.buffer.write(orjson.dumps(report) + b"\n")
    else:
        print_report(report)
    return 0
