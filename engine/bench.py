"""``loraplane bench engine --json``: TTFT by adapter tier, load-stage breakdown, decode throughput vs adapters.

Everything runs in one process on one engine per measurement (no HTTP), so the figures are the engine's own:
TTFT is submit -> first token with the request's adapter deliberately placed in a GPU slot (L0), in host memory
only (L1: the request pays the copy into the slots) or on disk only (L2: read + parse + copy). Tiers are
measured interleaved, median of ``--trials``.
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
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    for adapter in {id(a): a for a in adapters if a is not None}.values():
        await engine.activate(adapter)
    requests = [engine.submit(prompt, params, adapter) for adapter in adapters]
    await asyncio.gather(*[r.events.get() for r in requests])  # every sequence is past its prefill
    started = time.perf_counter()
    for request in requests:
        async for _ in engine.stream(request):
            pass
    elapsed = time.perf_counter() - started
    return round(sum(len(r.output_ids) - 1 for r in requests) / elapsed, 1)


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
                      max_num_seqs=max(16, options.batch), lora_modules=paths)
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
    }


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
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (default 1, as loraplane-engine's --torch-threads)")
    args = parser.parse_args(list(argv))
    if args.threads:
        torch.set_num_threads(args.threads)
    print(json.dumps(asyncio.run(run(args))))
    return 0
