"""``loraplane sim``: run a scenario or a recorded trace through a pool under several policies."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import orjson
from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from loraplane.controller.config import load_config
from loraplane.helptext import HelpFormatter
from loraplane.sim.admission import FlowControlConfig
from loraplane.sim.azure import AzureOptions
from loraplane.sim.cluster import LORAPLANE_RUNTIMES, VLLM, SimConfig
from loraplane.sim.metrics import DEFAULT_SLO_TTFT_MS
from loraplane.sim.policies import POLICY_NAMES
from loraplane.sim.profile import LARGE_GPU, PROFILES, ProfileError, load_profile
from loraplane.sim.report import plot, print_table, without_curves
from loraplane.sim.runner import Job, run_all
from loraplane.sim.trace import (
    AZURE_SCENARIOS,
    DEFAULT_REQUESTS,
    SCENARIOS,
    Trace,
    TraceError,
    load_csv,
    scenario,
)

#: traces at least this long get a progress bar (on a terminal)
PROGRESS_MIN_REQUESTS = 20_000


def _policies(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in POLICY_NAMES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown policy {', '.join(unknown)}; choose from {', '.join(POLICY_NAMES)}")
    return list(dict.fromkeys(names))


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be >= 1")
    return value


def _above_zero(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a number > 0 (got {text})")
    return value


def _at_least_zero(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a number >= 0 (got {text})")
    return value


def _share(text: str) -> float:
    value = float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1] (got {text})")
    return value


#: the options of the Azure scenarios: flag -> (AzureOptions field, type, metavar, help)
AZURE_FLAGS: dict[str, tuple[str, Callable[[str], Any], str, str]] = {
    "--compress": ("compress", _above_zero, "X", "time compression: arrival times are divided by this (2: twice the request rate)"),
    "--adapters": ("adapters", _positive, "N", "adapters the requests are assigned to"),
    "--zipf": ("zipf", _at_least_zero, "S", "Zipf skew of each family's popularity ranking (0: uniform)"),
    "--locality": ("locality", _share, "P", "temporal locality: probability that a request reuses the adapter of one of "
                   "its service's last --locality-window requests (else a fresh Zipf draw)"),
    "--locality-window": ("locality_window", _positive, "K", "how many of its service's latest requests --locality "
                          "reuses from"),
    "--families": ("families", _positive, "F", "adapter families, each with its own popularity ranking (azure-merged: at "
                   "least 2; even families serve the conversation service, odd ones code) (default: one per service)"),
    "--tenants": ("tenants", _positive, "N", "tenants owning the adapters (adapter i: tenant i mod N) (default: one per 10 "
                  "adapters)"),
    "--gold-share": ("gold_share", _share, "SHARE", "share of the tenants that are gold (priority 1)"),
    "--sheddable-share": ("sheddable_share", _share, "SHARE", "share of the tenants that are sheddable (priority -1)"),
}  # fmt: skip


def _scale(text: str) -> float:
    value = float(text)
    if not 0 < value <= 16:
        raise argparse.ArgumentTypeError("must be in (0, 16]")
    return value


def add_trace_source(p: argparse.ArgumentParser, default_requests: int = DEFAULT_REQUESTS) -> None:
    """The flags that choose a trace (a scenario with its options, or a recorded CSV) and its seed; read them with
    ``trace_from_args``. Every command that runs a trace (``sim``, ``bench twin``, ``bench fidelity``) takes them."""
    source = p.add_mutually_exclusive_group()
    source.add_argument("--scenario", choices=list(SCENARIOS), default="hot-plus-burst", help="generated trace")
    source.add_argument("--trace", type=Path, help="a recorded trace (CSV: timestamp, adapter, tenant, "
                        "input_tokens, output_tokens[, tenant_class][, priority][, prefix_group, prefix_tokens, session]: "
                        "priority is the tenant's (an integer, the same on every row of a tenant; without the column "
                        "0); the optional prefix columns name a shared-prefix group with its prompt tokens and a "
                        "multi-turn session; with them the pods model prefix caches)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="seed of the generated trace and the policies")
    p.add_argument("--requests", type=_positive,
                   help=f"requests a scenario generates (default: {default_requests:,}; the azure-* scenarios: the "
                   "whole trace, and N takes its first N requests)")  # fmt: skip
    p.set_defaults(default_requests=default_requests)
    azure = p.add_argument_group(
        "real-arrival scenarios", f"{', '.join(AZURE_SCENARIOS)}: Azure's LLM inference trace 2023 (CC-BY 4.0; "
        'Patel et al., "Splitwise", ISCA 2024) with its real arrival times and token counts; adapters and tenants '
        "are assigned by a seeded model (docs/sim.md). These options apply to them only.",
    )  # fmt: skip
    defaults = AzureOptions()
    for flag, (field, kind, metavar, text) in AZURE_FLAGS.items():
        default = getattr(defaults, field)
        shown = "" if default is None or "default" in text else f" (default: {default:g})"
        azure.add_argument(flag, type=kind, metavar=metavar, help=text + shown)


def trace_from_args(p: argparse.ArgumentParser, args: argparse.Namespace, adapter_bytes: int) -> Trace:
    """The trace ``add_trace_source``'s flags name (TraceError when it cannot be made; exits 2 when Azure options
    come with another source)."""
    options = azure_options(p, args)
    if args.trace is not None:
        return load_csv(args.trace, adapter_bytes)
    requests = args.requests
    if requests is None and args.scenario not in AZURE_SCENARIOS:
        requests = args.default_requests
    return scenario(args.scenario, requests, args.seed, adapter_bytes, options)


def parser() -> argparse.ArgumentParser:
    """The command's arguments."""
    p = argparse.ArgumentParser(prog="loraplane sim", description=__doc__, formatter_class=HelpFormatter)
    add_trace_source(p)
    p.add_argument("--policies", type=_policies, default=POLICY_NAMES, help=f"comma-separated: {', '.join(POLICY_NAMES)}")
    p.add_argument("--pods", type=_positive, default=8, help="model-server pods in the pool")
    p.add_argument("--pods-scale", type=_scale, default=1.0,
                   help="multiply --pods by this (rounded, at least 1): 0.5 runs a scenario at half the pods")  # fmt: skip
    p.add_argument("--max-loras", type=_positive, default=4, help="GPU adapter slots per pod")
    p.add_argument("--max-cpu-loras", type=_positive, default=16, help="host-memory adapter slots per pod")
    p.add_argument("--scrape-interval", type=_at_least_zero, default=0.05, metavar="S",
                   help="seconds between the peers' scrapes of each pod's vLLM metrics (llm-d's default; 0: every "
                        "decision reads the pods as they are)")
    p.add_argument("--loraplane-runtime", choices=LORAPLANE_RUNTIMES, default=VLLM,
                   help="what loraplane's pods run. vllm (the default): vLLM behind loraplane's sidecar, as the "
                        "chart and the twin run it: a pod serves only what its sidecar registered (the controller's "
                        "targets; the picker waits for a holder), each registration a load into a GPU slot, vLLM's "
                        "LRU. on-demand: an idealised runtime whose pods load any revision on demand (engine "
                        "eviction)")
    p.add_argument("--profile", default=LARGE_GPU.name,
                   help=f"{', '.join(PROFILES)} or a JSON file (saved profile or bench output)")  # fmt: skip
    p.add_argument("--picker-config", type=Path, help="EndpointPickerConfig YAML for loraplane (default: packaged)")
    p.add_argument("--controller-config", type=Path,
                   help="the controller's config YAML; its placement settings plan loraplane's pool (default: packaged)")
    p.add_argument("--slo-ttft-ms", type=float, default=DEFAULT_SLO_TTFT_MS,
                   help="TTFT a served request must meet for slo_attainment")  # fmt: skip
    p.add_argument("--flow-control", nargs="?", const="sim", choices=["sim", "picker", "off"],
                   help="loraplane only: the queue holding requests whose endpoints are saturated or have no room "
                   "(bands, per-tenant fairness, deadline, then 429): the simulator's model (sim, the value "
                   "when given alone), the picker's plugin with the simulator's bounds (picker) or none (off); "
                   "default: the picker config's own flow-control plugin (the packaged config ships it on)")  # fmt: skip
    p.add_argument("--loraplane-pods", choices=["chart", "vllm-defaults"], default="chart",
                   help="loraplane's pods as the chart starts them (priority queues, 2,048-token steps) or with "
                        "vLLM's defaults, as the baselines' run")
    p.add_argument("--jobs", type=_positive, help="worker processes (default: one per CPU it may use)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--plot", type=Path, metavar="DIR", help="write ttft_cdf.png and cold_starts.png into DIR")
    p.add_argument("--save-trace", type=Path, metavar="CSV", help="also write the generated trace as CSV")
    return p


def azure_options(p: argparse.ArgumentParser, args: argparse.Namespace) -> AzureOptions | None:
    """The Azure options given on the command line (None: none given); exits 2 when they are given with another
    source."""
    given = {f: getattr(args, f) for f, *_ in AZURE_FLAGS.values() if getattr(args, f) is not None}
    if not given:
        return None
    if args.trace is not None or args.scenario not in AZURE_SCENARIOS:
        flags = [flag for flag, (field, *_) in AZURE_FLAGS.items() if field in given]
        source = f"--trace {args.trace}" if args.trace is not None else f"--scenario {args.scenario}"
        p.error(f"{', '.join(flags)} apply to the scenarios {', '.join(AZURE_SCENARIOS)} only, not to {source}")
    return AzureOptions(**given)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``loraplane sim``."""
    p = parser()
    args = p.parse_args(argv)
    err = Console(stderr=True)
    try:
        profile = load_profile(args.profile)
        pods = max(1, round(args.pods * args.pods_scale))
        placement = load_config(args.controller_config).placement_config()
        config = SimConfig(pods=pods, max_loras=args.max_loras, max_cpu_loras=args.max_cpu_loras, placement=placement,
                           scrape_interval_s=args.scrape_interval, loraplane_runtime=args.loraplane_runtime)
        trace = trace_from_args(p, args, profile.default_adapter_bytes)
    except (ProfileError, TraceError, ValueError) as exc:
        err.print(f"loraplane sim: {exc}", markup=False)
        return 2
    flow_control = FlowControlConfig(queue=args.flow_control) if args.flow_control else None
    chart_pods = args.loraplane_pods == "chart"
    if args.save_trace is not None:
        args.save_trace.write_text(trace.to_csv())
    if len(trace) >= PROGRESS_MIN_REQUESTS and err.is_terminal:
        with Progress(
            TextColumn("{task.description:<32}"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"),
            TimeElapsedColumn(), console=err, transient=True,
        ) as bar:  # fmt: skip
            tasks: list[TaskID] = []

            def show(work: list[Job], done: list[int], totals: list[int]) -> None:
                if not tasks:
                    for job, total in zip(work, totals, strict=True):
                        label = f"{job.policy}{' (no burst)' if job.no_burst else ''}"
                        tasks.append(bar.add_task(label, total=total))
                for task, count in zip(tasks, done, strict=True):
                    bar.update(task, completed=count)

            report = run_all(
                trace, config, profile, args.policies, args.seed, args.picker_config, args.jobs, show,
                args.slo_ttft_ms, flow_control, chart_pods,
            )  # fmt: skip
    else:
        report = run_all(
            trace, config, profile, args.policies, args.seed, args.picker_config, args.jobs, None,
            args.slo_ttft_ms, flow_control, chart_pods,
        )  # fmt: skip
    if args.plot is not None:
        for path in plot(report, args.plot):
            err.print(f"wrote {path}", markup=False)
    if args.json:
        sys.stdout.buffer.write(orjson.dumps(without_curves(report)) + b"\n")
    else:
        print_table(report)
    return 0
