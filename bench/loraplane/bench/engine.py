"""``loraplane bench engine --json``: TTFT by adapter tier, load-stage breakdown, decode throughput vs adapters,
and dynamic merge: merged vs unmerged decode for one dominant adapter.

Everything runs in one process on one engine per measurement (no HTTP), so the figures are the engine's own:
TTFT is submit -> first token with the request's adapter deliberately placed in a GPU slot (L0), in host memory
only (L1: the request pays the copy into the slots) or on disk only (L2: read + parse + copy). Tiers are
measured interleaved, median of ``--trials``. The decode figures are unmerged (``--lora-merge off``), as a
simulator profile reads them; the ``merge`` section compares merged and unmerged per backend, dtype and rank.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from loraplane.api import Tier
from loraplane.engine.app import BuiltEngine, EngineOptions, build
from loraplane.engine.core import Engine, SamplingParams
from loraplane.engine.make_adapters import write_adapter
from loraplane.engine.model import PRESETS
from loraplane.engine.tiers import AdapterState
from loraplane.helptext import HelpFormatter
from loraplane.kernels.ops import default_backend_name

_STAGES = ("disk_read", "parse", "host_to_device")


async def _time_to_first_token(engine: Engine, prompt: list[int], adapter: AdapterState | None) -> float:
    started = time.perf_counter()
    request = engine.submit(prompt, SamplingParams(max_tokens=1, temperature=0), adapter)
    await request.events.get()
    first = time.perf_counter() - started
    async for _ in engine.stream(request):
        pass
    return first


async def _place(engine: Engine, adapter: AdapterState, tier: Tier) -> None:
    """Put ``adapter`` exactly at ``tier`` (reading it back from disk first when it must be warmer)."""
    if adapter.weights is None and tier is not Tier.DISK:
        await engine.activate(adapter)
    async with engine.lock:
        if tier is Tier.DISK:
            engine.tiers.drop_host(adapter)
        elif tier is Tier.CPU:
            engine.tiers.offload(adapter)
    if tier is Tier.GPU:
        await engine.activate(adapter)
    assert adapter.tier is tier, (adapter.tier, tier)


async def _ttft_by_tier(built: BuiltEngine, adapters: list[AdapterState], prompt: list[int], trials: int) -> dict[str, float]:
    engine = built.engine
    samples: dict[Tier, list[float]] = {Tier.GPU: [], Tier.CPU: [], Tier.DISK: []}
    for trial in range(trials + 1):  # the first round warms up the code paths and is discarded
        for i, tier in enumerate(samples):
            adapter = adapters[(trial * len(samples) + i) % len(adapters)]
            await _place(engine, adapter, tier)
            seconds = await _time_to_first_token(engine, prompt, adapter)
            if trial:
                samples[tier].append(seconds)
    labels = {Tier.GPU: "L0", Tier.CPU: "L1", Tier.DISK: "L2"}
    return {labels[t]: round(statistics.median(v) * 1000, 3) for t, v in samples.items()}


def _load_stages_ms(built: BuiltEngine) -> dict[str, float]:
    registry = built.engine.metrics.registry
    out = {}
    for stage in _STAGES:
        total = registry.get_sample_value("loraplane_engine_adapter_load_seconds_sum", {"stage": stage}) or 0.0
        count = registry.get_sample_value("loraplane_engine_adapter_load_seconds_count", {"stage": stage}) or 1.0
        out[stage] = round(total / count * 1000, 3)
    return out


async def _decode_tokens_per_s(engine: Engine, prompt: list[int], adapters: Sequence[AdapterState | None], tokens: int) -> float:
    return (await _decode_rates(engine, prompt, adapters, tokens))[0]


async def _decode_rates(engine: Engine, prompt: list[int], adapters: Sequence[AdapterState | None],
                        tokens: int) -> tuple[float, float]:
    """Tokens decoded (after every sequence's prefill) per second of wall time, and per second of this process's
    CPU time (steadier where other jobs share the cores)."""
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    for adapter in {id(a): a for a in adapters if a is not None}.values():
        await engine.activate(adapter)
    requests = [engine.submit(prompt, params, adapter) for adapter in adapters]
    await asyncio.gather(*[r.events.get() for r in requests])  # every sequence is past its prefill
    started, cpu_started = time.perf_counter(), time.process_time()
    for request in requests:
        async for _ in engine.stream(request):
            pass
    elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    generated = sum(len(r.output_ids) - 1 for r in requests)
    return round(generated / elapsed, 1), round(generated / cpu, 1) if cpu > 0 else 0.0


def merge_backends(device: str) -> list[str]:
    """The LoRA backends a device has: the default one, and the torch reference when that is another."""
    default = default_backend_name(device)
    return [default] if default == "torch" else [default, "torch"]


async def _merge_case(options: argparse.Namespace, tmp: Path, prompt: list[int], backend: str, dtype: str,
                      rank: int) -> dict[str, object]:
    """One adapter on every row of a decode batch (``pure``), and on all rows but one base row (``mixed``):
    tokens/s with merge off and forced, interleaved over ``--merge-repeats`` rounds (medians); then the cost of a
    switch, and what the ``auto`` policy does with the pure, then the mixed batch on its own measurements."""
    config = PRESETS[options.model]
    path = tmp / f"merge-r{rank}"
    if not path.exists():
        write_adapter(path, config, rank, seed=rank)
    built = build(EngineOptions(model=options.model, dtype=dtype, device=options.device, max_lora_rank=rank,
                                max_num_seqs=max(16, options.batch), max_loras=1, lora_backend=backend,
                                lora_merge="off", lora_modules={"dominant@v1": path}))
    batch, tokens = options.batch, options.decode_tokens
    async with built.app.router.lifespan_context(built.app):
        engine = built.engine
        adapter = engine.tiers.registered["dominant@v1"]
        shapes: dict[str, list[AdapterState | None]] = {"pure": [adapter] * batch,
                                                        "mixed": [adapter] * (batch - 1) + [None]}
        rates: dict[tuple[str, str], list[tuple[float, float]]] = {}
        for _ in range(options.merge_repeats):
            for mode in ("off", "force"):
                engine.set_merge_mode(mode)
                for shape, adapters in shapes.items():
                    rates.setdefault((shape, mode), []).append(await _decode_rates(engine, prompt, adapters, tokens))
        engine.set_merge_mode("off")
        await _decode_tokens_per_s(engine, prompt, [None], 2)  # a step that unmerges
        switch = await _switch_cost(engine, adapter, options.merge_repeats)
        engine.set_merge_mode("auto")
        auto: dict[str, object] = {}
        for shape, adapters in shapes.items():  # pure first: the mixed batch alone is under the entry share
            auto[f"{shape}_tokens_per_s"] = [await _decode_tokens_per_s(engine, prompt, adapters, tokens)
                                             for _ in range(options.auto_runs)]
            auto[f"{shape}_held_at_end"] = adapter in engine.merged_adapters()
        auto["verdicts"] = engine.merge_policy.verdicts_json()
    result: dict[str, object] = {"backend": backend, "dtype": dtype, "rank": rank}
    for shape in shapes:
        figures: dict[str, float] = {}
        for clock, index in (("s", 0), ("cpu_s", 1)):
            off = statistics.median(r[index] for r in rates[(shape, "off")])
            merged = statistics.median(r[index] for r in rates[(shape, "force")])
            suffix = "" if clock == "s" else "_cpu"
            figures[f"unmerged_tokens_per_{clock}"] = round(off, 1)
            figures[f"merged_tokens_per_{clock}"] = round(merged, 1)
            figures[f"merged_over_unmerged{suffix}"] = round(merged / off, 3) if off else 0.0
        result[shape] = figures
    result.update(switch)
    result["auto"] = auto
    return result


async def _switch_cost(engine: Engine, adapter: AdapterState, repeats: int) -> dict[str, float]:
    """Median time to merge the adapter (build every merged copy) and to unmerge it, and the copies' size."""
    merge_s: list[float] = []
    unmerge_s: list[float] = []
    nbytes = 0
    assert adapter.slot is not None
    async with engine.lock:
        for _ in range(max(3, repeats)):
            started = time.perf_counter()
            nbytes = await asyncio.to_thread(engine.model.merge_slot, adapter.slot)
            merge_s.append(time.perf_counter() - started)
            started = time.perf_counter()
            engine.model.unmerge_slot(adapter.slot)
            unmerge_s.append(time.perf_counter() - started)
    return {"merge_ms": round(statistics.median(merge_s) * 1000, 3),
            "unmerge_ms": round(statistics.median(unmerge_s) * 1000, 4), "merged_mib": round(nbytes / (1 << 20), 1)}


async def _merge_section(options: argparse.Namespace, tmp: Path, prompt: list[int]) -> dict[str, object]:
    cases = []
    for backend in options.merge_backends or merge_backends(options.device):
        for dtype in options.merge_dtypes:
            for rank in options.merge_ranks:
                cases.append(await _merge_case(options, tmp, prompt, backend, dtype, rank))
    return {"model": options.model, "batch": options.batch, "decode_tokens": options.decode_tokens,
            "repeats": options.merge_repeats, "cases": cases}


def _rss_bytes() -> int:
    """Resident set size of this process (Linux ``/proc``; 0 elsewhere)."""
    statm = Path("/proc/self/statm")
    return int(statm.read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") if statm.exists() else 0


async def _rss_across_unload(common: dict[str, object], paths: dict[str, Path]) -> dict[str, float]:
    """Host RSS before loading, with every adapter in host memory, and after unloading them all."""
    built = build(EngineOptions(max_loras=1, max_cpu_loras=len(paths), **{**common, "lora_modules": {}}))  # type: ignore[arg-type]
    async with built.app.router.lifespan_context(built.app):
        gc.collect()
        before = _rss_bytes()
        for name, path in paths.items():
            await built.engine.add_adapter(name, path)
        loaded = _rss_bytes()
        weights = sum(a.nbytes for a in built.engine.tiers.registered.values())
        for name in list(paths):
            await built.engine.remove_adapter(name)
        gc.collect()
        after = _rss_bytes()
    mib = 1 << 20
    return {"before_load": round(before / mib, 1), "all_loaded": round(loaded / mib, 1),
            "after_unload": round(after / mib, 1), "adapter_weights": round(weights / mib, 1)}


async def run(options: argparse.Namespace) -> dict[str, object]:
    """Run every measurement; the JSON-ready result."""
    config = PRESETS[options.model]
    with tempfile.TemporaryDirectory(prefix="loraplane-bench-") as tmp:
        paths = {}
        for i in range(max(options.adapters, options.batch)):
            paths[f"bench-{i:02d}@v1"] = Path(tmp) / f"bench-{i:02d}"
            write_adapter(paths[f"bench-{i:02d}@v1"], config, options.rank, seed=i)
        common = dict(model=options.model, dtype=options.dtype, device=options.device, max_lora_rank=options.rank,
                      max_num_seqs=max(16, options.batch), lora_modules=paths, lora_merge="off")
        text = b"The quick brown fox jumps over the lazy dog. " * (1 + options.prompt_tokens // 45)
        prompt = [256, *text[: options.prompt_tokens - 1]]

        rss = await _rss_across_unload(common, paths)  # first: no earlier engine's freed memory to reuse
        tier_engine = build(EngineOptions(max_loras=2, max_cpu_loras=4, **common))
        async with tier_engine.app.router.lifespan_context(tier_engine.app):
            adapters = list(tier_engine.engine.tiers.registered.values())
            ttft = await _ttft_by_tier(tier_engine, adapters, prompt, options.trials)
            stages = _load_stages_ms(tier_engine)

        decode_engine = build(EngineOptions(max_loras=options.batch, max_cpu_loras=len(paths), **common))
        async with decode_engine.app.router.lifespan_context(decode_engine.app):
            engine = decode_engine.engine
            adapters = list(engine.tiers.registered.values())
            batch = options.batch
            decode = {
                "base": await _decode_tokens_per_s(engine, prompt, [None] * batch, options.decode_tokens),
                "1_adapter": await _decode_tokens_per_s(engine, prompt, [adapters[0]] * batch, options.decode_tokens),
                f"{batch}_adapters": await _decode_tokens_per_s(engine, prompt, adapters[:batch], options.decode_tokens),
            }
        merge = await _merge_section(options, Path(tmp), prompt) if options.merge_ranks else None
    return {
        "benchmark": "engine",
        "model": options.model,
        "device": options.device if options.device != "cpu" else f"cpu ({platform.machine()}, {torch.get_num_threads()} threads)",
        "dtype": options.dtype,
        "adapter_rank": options.rank,
        "prompt_tokens": len(prompt),
        "trials": options.trials,
        "ttft_ms": ttft,
        "load_stages_ms": stages,
        "decode_batch": options.batch,
        "decode_tokens_per_s": decode,
        "host_rss_mib": rss,
        "merge": merge,
    }


def _ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


def _names(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def main(argv: Sequence[str]) -> int:
    """Print one JSON object."""
    parser = argparse.ArgumentParser(prog="loraplane bench engine", description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--json", action="store_true", help="print one JSON object (the only output format)")
    parser.add_argument("--model", default="small", choices=sorted(PRESETS), help="engine preset")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="weights dtype")
    parser.add_argument("--prompt-tokens", type=int, default=16, help="prompt length (short: TTFT is mostly the adapter's tier)")
    parser.add_argument("--rank", type=int, default=16, help="rank of the adapters written")
    parser.add_argument("--trials", type=int, default=31, help="timed requests per tier (medians of these)")
    parser.add_argument("--batch", type=int, default=8, help="sequences (and distinct adapters) in the decode runs")
    parser.add_argument("--adapters", type=int, default=16, help="adapters written and loaded (tiers, RSS)")
    parser.add_argument("--decode-tokens", type=int, default=32, help="tokens each decode run generates")
    parser.add_argument("--merge-ranks", type=_ints, default=[16, 64],
                        help="adapter ranks of the merge cases (comma-separated; empty: no merge section)")
    parser.add_argument("--merge-dtypes", type=_names, default=["float32", "bfloat16"], help="dtypes of the merge cases")
    parser.add_argument("--merge-backends", type=_names, default=None,
                        help="LoRA backends of the merge cases (default: the device's, and torch)")
    parser.add_argument("--merge-repeats", type=int, default=5, help="interleaved rounds per merge case (medians)")
    parser.add_argument("--auto-runs", type=int, default=3,
                        help="decode runs of the pure, then the mixed batch under --lora-merge auto")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (default 1, as loraplane-engine's --torch-threads)")
    args = parser.parse_args(list(argv))
    if args.threads:
        torch.set_num_threads(args.threads)
    print(json.dumps(asyncio.run(run(args))))
    return 0
