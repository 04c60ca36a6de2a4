"""``loraplane bench inference-perf``: the field's benchmark client, inference-perf, against the twin.

inference-perf (the Gateway API Inference Extension project's own tool, installed by
``scripts/setup-inference-perf.sh`` into ``.venv-iperf``: it needs Python >= 3.12) drives the twin -- the real
control plane on emulated vLLM pods (``loraplane bench twin``) -- through Envoy, as a GIE user benchmarks a pool: a
Poisson load sweep of streamed completions with a ``lora_traffic_split`` over the applied adapters. Each policy runs
on a fresh twin: loraplane with its adapters onboarded as AdapterRevisions through kubectl, a peer's packaged picker
config with every adapter registered on every pod at start-up. inference-perf's report (TTFT, TPOT, ITL and
request latency percentiles, achieved rate, per stage) is collected into one JSON object per policy.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from loraplane.processes import process_usage
from loraplane.sim.trace import Adapter, Tenant, Trace, zipf_weights
from loraplane.stack.twin import (
    ARTIFACTS,
    LORAPLANE,
    MODEL,
    Twin,
    TwinOptions,
    add_pool_options,
    pool_options,
    scrape_all,
    start_stack,
    total,
    twin_policies,
    usage_summary,
    write_adapters,
)

#: where ``scripts/setup-inference-perf.sh`` installs inference-perf (relative to the repository root)
IPERF_VENV = ".venv-iperf"
#: the environment variable naming an inference-perf executable (else ``IPERF_VENV``, else ``PATH``)
IPERF_ENV = "LORAPLANE_INFERENCE_PERF"
#: splits are whole multiples of 1 / SPLIT_UNIT: binary fractions, so their float sum is exactly 1.0 in any order
#: (inference-perf's validator tests ``sum(split) != 1.0``)
SPLIT_UNIT = 1024
#: the percentiles asked of inference-perf (its key for 50 is ``median``)
PERCENTILES = (50.0, 90.0, 99.0)
#: the latency figures read from its report, in its names
LATENCIES = ("time_to_first_token", "time_per_output_token", "inter_token_latency", "request_latency")


@dataclass(frozen=True)
class Lengths:
    """A length distribution in inference-perf's form (``data.input_distribution`` / ``output_distribution``)."""

    mean: float
    std_dev: float
    min: int
    max: int
    type: str = "normal"

    def config(self, total_count: int) -> dict[str, Any]:
        """inference-perf's ``Distribution``."""
        return {"min": self.min, "max": self.max, "mean": self.mean, "std_dev": self.std_dev, "type": self.type,
                "total_count": total_count}


#: prompt lengths in the client tokenizer's tokens: the tiny model's byte-level tokenizer, so bytes of
#: inference-perf's Shakespeare corpus; the emulator counts words (about one in 5.3 bytes): ~380 tokens on the pods.
#: Kept short because inference-perf makes every prompt with that tokenizer, ~24 us of its CPU a byte
#: (docs/inference-perf.md, "The lengths")
INPUT = Lengths(mean=2_000, std_dev=500, min=500, max=4_000)
#: output lengths: ``max_tokens``, which the emulator produces exactly (``ignore_eos``), so in the pods' tokens
OUTPUT = Lengths(mean=256, std_dev=64, min=64, max=512)


@dataclass(frozen=True)
class SweepOptions:
    """The load inference-perf sends."""

    #: requests/s of each Poisson stage
    rates: tuple[float, ...] = (4.0, 8.0, 16.0, 24.0)
    stage_seconds: int = 60
    #: seconds between stages (inference-perf's ``load.interval``)
    interval_s: float = 5.0
    adapters: int = 16
    #: the traffic split's Zipf exponent (rank r gets ~ 1 / r^s of the requests)
    zipf_s: float = 1.0
    input: Lengths = INPUT
    output: Lengths = OUTPUT
    seed: int = 0
    #: inference-perf's worker processes and each one's in-flight limit (high enough that the client never holds
    #: a request back: the sweep stays open loop past saturation)
    workers: int = 2
    worker_concurrency: int = 1000
    #: seconds a request may take before inference-perf counts it failed
    request_timeout_s: float = 300.0


def traffic_split(names: Sequence[str], s: float, unit: int = SPLIT_UNIT) -> list[dict[str, Any]]:
    """inference-perf's ``lora_traffic_split``: a Zipf(``s``) share per name in rank order, each a whole number of
    ``1 / unit`` (at least one; largest remainders get the rest), so the splits sum to exactly 1.0."""
    if not names or unit < len(names):
        raise ValueError(f"{len(names)} adapters cannot share {unit} units")
    ideal = [w * unit for w in zipf_weights(len(names), s).tolist()]
    units = [max(1, math.floor(x)) for x in ideal]
    order = sorted(range(len(names)), key=lambda i: (units[i] - ideal[i], i))  # furthest below its share first
    i = 0
    while sum(units) < unit:
        units[order[i % len(order)]] += 1
        i += 1
    while sum(units) > unit:  # floors of at least one overshot: take from the largest
        units[max(range(len(units)), key=lambda j: units[j])] -= 1
    split = [{"name": name, "split": u / unit} for name, u in zip(names, units, strict=True)]
    assert sum(item["split"] for item in split) == 1.0
    return split


def adapters_trace(count: int, adapter_bytes: int) -> Trace:
    """A trace of ``count`` adapters (``lora-00@v1`` ...), one tenant each at standard priority, and no requests:
    the twin writes and onboards its adapters; inference-perf sends the requests."""
    tenants = [Tenant(f"tenant-{i:02d}") for i in range(count)]
    adapters = [Adapter(f"lora-{i:02d}@v1", i, adapter_bytes) for i in range(count)]
    return Trace("inference-perf", tenants, adapters, [], [], [], [], [])


def iperf_config(base_url: str, tokenizer: Path, names: Sequence[str], sweep: SweepOptions,
                 report_dir: Path) -> dict[str, Any]:
    """inference-perf's config: streamed completions to the gateway, Shakespeare prompts, the Poisson sweep over a
    Zipf split of ``names``, the report in ``report_dir``."""
    requests = sum(math.ceil(rate * sweep.stage_seconds) for rate in sweep.rates)
    count = math.ceil(requests * 1.2) + 100
    return {
        "api": {"type": "completion", "streaming": True},
        "server": {"type": "vllm", "base_url": base_url, "model_name": MODEL, "ignore_eos": True},
        "tokenizer": {"pretrained_model_name_or_path": str(tokenizer)},
        "data": {"type": "synthetic", "input_distribution": sweep.input.config(count),
                 "output_distribution": sweep.output.config(count)},
        "load": {"type": "poisson", "interval": sweep.interval_s,
                 "stages": [{"rate": rate, "duration": sweep.stage_seconds} for rate in sweep.rates],
                 "num_workers": sweep.workers, "worker_max_concurrency": sweep.worker_concurrency,
                 "request_timeout": sweep.request_timeout_s, "base_seed": sweep.seed,
                 "lora_traffic_split": traffic_split(names, sweep.zipf_s)},
        "report": {"request_lifecycle": {"summary": True, "per_stage": True, "per_adapter": True,
                                         "percentiles": list(PERCENTILES), "use_server_output_tokens": True}},
        "storage": {"local_storage": {"path": str(report_dir)}},
    }


def find_inference_perf(explicit: str | None = None) -> str | None:
    """The inference-perf executable: ``explicit``, ``$LORAPLANE_INFERENCE_PERF``, the repository's ``.venv-iperf``,
    or ``inference-perf`` on PATH; None when there is none."""
    for candidate in (explicit, os.environ.get(IPERF_ENV)):
        if candidate:
            return candidate
    for root in (Path.cwd(), Path(__file__).resolve().parents[2]):
        venv = root / IPERF_VENV / "bin" / "inference-perf"
        if venv.is_file() and os.access(venv, os.X_OK):
            return str(venv)
    return shutil.which("inference-perf")


def run_inference_perf(executable: str, config: Path, log: Path, timeout_s: float) -> dict[str, Any]:
    """Run inference-perf on ``config`` offline (its tokenizer is a local folder); its exit code, wall and CPU
    seconds (its workers included). Raises RuntimeError with the log's tail when it fails."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "HF_HUB_DISABLE_TELEMETRY": "1", "TOKENIZERS_PARALLELISM": "false"}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.monotonic()
    with log.open("wb") as out:
        try:
            code = subprocess.run([executable, "-c", str(config)], stdout=out, stderr=subprocess.STDOUT, env=env,
                                  cwd=config.parent, timeout=timeout_s, check=False).returncode
        except subprocess.TimeoutExpired:
            code = None
    wall = time.monotonic() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if code != 0:
        tail = log.read_text(errors="replace")[-4000:]
        what = f"ran past {timeout_s:.0f} s" if code is None else f"exited {code}"
        raise RuntimeError(f"inference-perf {what} (log {log}):\n{tail}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall_s": round(wall, 1), "cpu_s": round(cpu, 1)}


def _ms(value: Any) -> float | None:
    return round(float(value) * 1e3, 2) if isinstance(value, int | float) else None


def latency_ms(latency: dict[str, Any]) -> dict[str, dict[str, float | None]]:
    """inference-perf's latency block (seconds, ``median`` for p50) as ms p50 / p90 / p99 / mean per figure."""
    out = {}
    for name in LATENCIES:
        figures = latency.get(name) or {}
        out[name] = {"p50": _ms(figures.get("median")), "p90": _ms(figures.get("p90")),
                     "p99": _ms(figures.get("p99")), "mean": _ms(figures.get("mean"))}
    return out


def report_summary(report: dict[str, Any]) -> dict[str, Any]:
    """One inference-perf lifecycle report (summary or stage) in this benchmark's shape."""
    load = report.get("load_summary") or {}
    successes = report.get("successes") or {}
    failures = report.get("failures") or {}
    throughput = successes.get("throughput") or {}
    prompt = successes.get("prompt_tokens") or {}
    output = successes.get("output_tokens") or successes.get("output_len") or {}
    return {
        "requested_rate": load.get("requested_rate"),
        "achieved_rate": load.get("achieved_rate"),
        "sent": load.get("count"),
        #: how late inference-perf sent its requests against its Poisson schedule (the client keeping up)
        "schedule_delay_p99_ms": _ms((load.get("schedule_delay") or {}).get("p99")),
        "successes": successes.get("count", 0),
        "errors": failures.get("count", 0),
        "error_kinds": {label: (entry.get("count") if isinstance(entry, dict) else entry)
                        for label, entry in (failures.get("by_label") or {}).items()},
        "latency_ms": latency_ms(successes.get("latency") or {}),
        "requests_per_s": throughput.get("requests_per_sec"),
        "output_tokens_per_s": throughput.get("output_tokens_per_sec"),
        "prompt_tokens_mean": prompt.get("mean"),
        "output_tokens_mean": output.get("mean"),
        "token_count_mismatches": successes.get("token_count_mismatches"),
    }


def read_reports(report_dir: Path, stages: int) -> dict[str, Any]:
    """inference-perf's summary, per-stage and per-adapter lifecycle reports below ``report_dir``."""
    def load(name: str) -> dict[str, Any] | None:
        found = sorted(report_dir.rglob(f"{name}.json"))
        return json.loads(found[0].read_text()) if found else None

    summary = load("summary_lifecycle_metrics")
    if summary is None:
        raise RuntimeError(f"inference-perf wrote no summary_lifecycle_metrics.json below {report_dir}")
    per_stage = []
    for i in range(stages):
        stage = load(f"stage_{i}_lifecycle_metrics")
        per_stage.append({"stage": i, **report_summary(stage)} if stage is not None else {"stage": i, "missing": True})
    adapters = {}
    for path in sorted(report_dir.rglob("adapter_*_lifecycle_metrics.json")):
        name = path.name.removeprefix("adapter_").removesuffix("_lifecycle_metrics.json")
        if "_stage_" not in name:
            figures = report_summary(json.loads(path.read_text()))
            adapters[name] = {key: figures[key] for key in ("successes", "errors")} | {
                "ttft_p50_ms": figures["latency_ms"]["time_to_first_token"]["p50"],
                "ttft_p99_ms": figures["latency_ms"]["time_to_first_token"]["p99"]}
    return {"summary": report_summary(summary), "stages": per_stage, "adapters": adapters}


def load_average() -> list[float]:
    """The machine's 1, 5 and 15 minute load averages."""
    return [round(x, 2) for x in os.getloadavg()]


def run_policy(policy: str, options: TwinOptions, sweep: SweepOptions, workdir: Path, executable: str,
               say: Callable[[str], None] = lambda _m: None) -> dict[str, Any]:
    """``policy`` on a fresh twin driven by inference-perf: its report, the pods' GPU loads and each process's CPU."""
    from loraplane.sim.profile import load_profile

    shutil.rmtree(workdir, ignore_errors=True)
    trace = adapters_trace(sweep.adapters, load_profile(options.profile).default_adapter_bytes)
    adapters = write_adapters(trace, workdir / ARTIFACTS, MODEL)
    peer = None if policy == LORAPLANE else policy
    loads = {"before": load_average()}
    stack = start_stack(workdir, options, peer, adapters)
    try:
        onboard_s = Twin(stack, trace, options, adapters, say).onboard() if peer is None else 0.0
        assert stack.model_dir is not None
        report_dir = workdir / "inference-perf" / "report"
        config = iperf_config(stack.gateway_url, stack.model_dir, [a.adapter for a in adapters], sweep, report_dir)
        path = workdir / "inference-perf" / "config.yml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        say(f"inference-perf: {policy}: {len(adapters)} adapters ready after {onboard_s:.1f} s; stages "
            f"{', '.join(f'{r:g}' for r in sweep.rates)} req/s x {sweep.stage_seconds} s")
        pids = {**stack.pids(), "client": os.getpid()}
        usage_before = {name: process_usage(pid) for name, pid in pids.items()}
        scrapes_before = asyncio.run(scrape_all(stack))
        timeout = (sum(sweep.stage_seconds + sweep.interval_s for _ in sweep.rates) + sweep.request_timeout_s
                   + 600)
        client = run_inference_perf(executable, path, path.parent / "inference-perf.log", timeout)
        scrapes_after = asyncio.run(scrape_all(stack))
        usage_after = {name: process_usage(pid) for name, pid in pids.items()}
        loads["after"] = load_average()
        gpu_loads = sum(total(scrapes_after.pods[p], "loraplane_emulator_lora_loads_total")
                        - total(scrapes_before.pods[p], "loraplane_emulator_lora_loads_total")
                        for p in scrapes_after.pods)
        dead = stack.dead()
    finally:
        stack.stop()
    report = read_reports(report_dir, len(sweep.rates))
    processes = usage_summary(usage_before, usage_after, client["wall_s"])
    processes["inference-perf"] = {"cpu_core_share": round(client["cpu_s"] / client["wall_s"], 3)
                                   if client["wall_s"] else None}
    return {"onboard_s": round(onboard_s, 1), **report, "gpu_loads": int(gpu_loads), "inference_perf": client,
            "load_average": loads, "processes": processes, "dead_processes": dead, "report_dir": str(report_dir)}


def _rates(text: str) -> tuple[float, ...]:
    try:
        rates = tuple(float(r) for r in text.split(",") if r.strip())
    except ValueError:
        rates = ()
    if not rates or min(rates) <= 0:
        raise argparse.ArgumentTypeError("comma-separated positive requests/s, e.g. 4,8,16,24")
    return rates


def parser() -> argparse.ArgumentParser:
    """The command's flags."""
    from loraplane.helptext import HelpFormatter

    p = argparse.ArgumentParser(prog="loraplane bench inference-perf", formatter_class=HelpFormatter,
                                description=__doc__.split("\n\n")[0] if __doc__ else None)
    add_pool_options(p, pods=16)
    p.set_defaults(workdir=Path(".run-iperf"))
    defaults = SweepOptions()
    p.add_argument("--policies", type=twin_policies, default=f"{LORAPLANE},gie-lora-affinity",
                   help="comma-separated, each on a fresh twin: loraplane and the peers' packaged configs")
    p.add_argument("--rates", type=_rates, default=",".join(f"{r:g}" for r in defaults.rates),
                   help="requests/s of each Poisson stage (comma-separated)")
    p.add_argument("--stage-seconds", type=int, default=defaults.stage_seconds, help="seconds of each stage")
    p.add_argument("--interval", type=float, default=defaults.interval_s, help="seconds between stages")
    p.add_argument("--adapters", type=int, default=defaults.adapters,
                   help="adapters applied and named in the lora_traffic_split")
    p.add_argument("--zipf", type=float, default=defaults.zipf_s, help="the split's Zipf exponent")
    p.add_argument("--input-mean", type=float, default=defaults.input.mean,
                   help="mean prompt length in client (byte) tokens; the pods see about one word in 5.3 bytes")
    p.add_argument("--output-mean", type=float, default=defaults.output.mean,
                   help="mean max_tokens (the emulated pods' tokens, produced exactly)")
    p.add_argument("--seed", type=int, default=defaults.seed, help="inference-perf's base_seed")
    p.add_argument("--workers", type=int, default=defaults.workers, help="inference-perf's worker processes")
    p.add_argument("--inference-perf", dest="executable",
                   help=f"the inference-perf executable (default: ${IPERF_ENV}, ./{IPERF_VENV}, PATH)")
    return p


def sweep_options(args: argparse.Namespace) -> SweepOptions:
    """The ``SweepOptions`` of the flags; the length distributions scale with their means."""
    def scaled(base: Lengths, mean: float) -> Lengths:
        k = mean / base.mean
        return Lengths(mean=mean, std_dev=round(base.std_dev * k, 1), min=max(1, round(base.min * k)),
                       max=max(2, round(base.max * k)), type=base.type)

    return SweepOptions(rates=args.rates, stage_seconds=args.stage_seconds, interval_s=args.interval,
                        adapters=args.adapters, zipf_s=args.zipf, input=scaled(INPUT, args.input_mean),
                        output=scaled(OUTPUT, args.output_mean), seed=args.seed, workers=args.workers)


def main(argv: Sequence[str]) -> int:
    """Entry point of ``loraplane bench inference-perf``."""
    p = parser()
    args = p.parse_args(list(argv))
    executable = find_inference_perf(args.executable)
    if executable is None:
        print("loraplane bench inference-perf: inference-perf is not installed; run scripts/setup-inference-perf.sh "
              f"(it needs Python >= 3.12) or name it with --inference-perf / ${IPERF_ENV}", file=sys.stderr)
        return 2
    if args.adapters < 1 or args.stage_seconds < 1 or args.workers < 1:
        p.error("--adapters, --stage-seconds and --workers must be positive")
    options = pool_options(args)
    sweep = sweep_options(args)

    def say(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    started = time.monotonic()
    policies = {}
    for policy in args.policies:
        policies[policy] = run_policy(policy, options, sweep, args.workdir.resolve() / policy, executable, say)
    report = {
        "benchmark": "inference-perf", "pods": options.pods, "profile": options.profile,
        "pool": {"pods": options.pods, "max_loras": options.max_loras, "max_cpu_loras": options.max_cpu_loras},
        "sweep": {"rates": list(sweep.rates), "stage_seconds": sweep.stage_seconds, "interval_s": sweep.interval_s,
                  "adapters": sweep.adapters, "zipf_s": sweep.zipf_s, "input": sweep.input.config(0),
                  "output": sweep.output.config(0), "seed": sweep.seed,
                  "split": traffic_split([f"lora-{i:02d}" for i in range(sweep.adapters)], sweep.zipf_s)},
        "policies": policies,
        "wall_s": round(time.monotonic() - started, 1),
    }
    print(json.dumps(report, indent=2))
    return 0
