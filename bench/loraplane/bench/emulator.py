"""``loraplane bench emulator --json``: what one emulator process costs -- its RSS and CPU while idle, and its CPU
per request under an open-loop load of streamed completions (the way the twin's clients send them).

One emulator is started as the tests and the stack start it (``start_vllm`` with ``VllmOptions.emulated``), with
two adapters registered; the load alternates between them and the base model.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import aiohttp

from loraplane.helptext import HelpFormatter
from loraplane.processes import process_usage
from loraplane.sim.profile import LARGE_GPU
from loraplane.vllm_server import VllmOptions, VllmServer, start_vllm


def write_adapter(path: Path, rank: int = 16) -> Path:
    """A PEFT adapter the emulator accepts: its config and a safetensors file holding no tensor."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text(json.dumps({"r": rank, "lora_alpha": rank, "path": str(path)}))
    header = b"{}"
    (path / "adapter_model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    return path


async def drive(url: str, models: list[str], rate: float, duration_s: float, prompt_words: int,
                max_tokens: int) -> dict[str, float]:
    """Streamed completions at ``rate`` per second for ``duration_s`` (open loop); their count and errors."""
    prompt = " ".join(f"word{i}" for i in range(prompt_words))
    done = failed = 0

    async def one(http: aiohttp.ClientSession, model: str) -> None:
        nonlocal done, failed
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
                "stream_options": {"include_usage": True}}
        try:
            async with http.post(url + "/v1/completions", json=body) as answer:
                async for _ in answer.content:
                    pass
                done += answer.status == 200
                failed += answer.status != 200
        except aiohttp.ClientError:
            failed += 1

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as http:
        tasks = []
        started = time.monotonic()
        for i in range(int(rate * duration_s)):
            await asyncio.sleep(max(0.0, started + i / rate - time.monotonic()))
            tasks.append(asyncio.ensure_future(one(http, models[i % len(models)])))
        await asyncio.gather(*tasks)
    return {"requests": done, "failed": failed}


def run(options: argparse.Namespace, workdir: Path) -> dict[str, object]:
    adapters = [write_adapter(workdir / name) for name in ("a", "b")]
    extra = ["--lora-modules", *(f"{p.name}={p}" for p in adapters), "--profile", options.profile]
    server: VllmServer = start_vllm(VllmOptions(model=Path("bench-model"), served_model_name="base", max_loras=2,
                                                max_cpu_loras=2, max_model_len=4096, emulated=True,
                                                extra_args=tuple(extra)), workdir / "emulator.log")
    try:
        server.wait_ready(timeout=60)
        time.sleep(1.0)
        pid = server.process.pid
        cpu0, _ = process_usage(pid)[:2]
        time.sleep(options.idle_s)
        cpu1, idle_rss = process_usage(pid)[:2]
        load = asyncio.run(drive(server.url, ["base", "a", "b"], options.rate, options.duration_s,
                                 options.prompt_words, options.max_tokens))
        cpu2, busy_rss = process_usage(pid)[:2]
    finally:
        server.stop()
    drive_s = options.duration_s
    return {
        "server": "starlette+uvicorn (uvloop, httptools)",
        "profile": options.profile,
        "idle": {"seconds": options.idle_s, "rss_mib": round(idle_rss / 2**20, 1),
                 "cpu_share_of_core": round((cpu1 - cpu0) / options.idle_s, 5)},
        "load": {"rate_per_s": options.rate, "seconds": drive_s, "prompt_words": options.prompt_words,
                 "max_tokens": options.max_tokens, **load, "rss_mib": round(busy_rss / 2**20, 1),
                 "cpu_ms_per_request": round(1000 * (cpu2 - cpu1) / max(1, load["requests"]), 2),
                 "cpu_share_of_core": round((cpu2 - cpu1) / drive_s, 4)},
    }


def main(argv: Sequence[str]) -> int:
    """Print one JSON object."""
    p = argparse.ArgumentParser(prog="loraplane bench emulator", formatter_class=HelpFormatter,
                                description=__doc__)
    p.add_argument("--json", action="store_true", help="print one JSON object (the only output format)")
    p.add_argument("--profile", default=LARGE_GPU.name, help="the emulator's profile")
    p.add_argument("--idle-s", type=float, default=20.0, help="seconds of idleness measured")
    p.add_argument("--rate", type=float, default=10.0, help="requests per second of the load")
    p.add_argument("--duration-s", type=float, default=30.0, help="seconds of load")
    p.add_argument("--prompt-words", type=int, default=200, help="prompt length in tokens (words)")
    p.add_argument("--max-tokens", type=int, default=100, help="tokens each request generates")
    options = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="loraplane-bench-emulator-") as tmp:
        print(json.dumps(run(options, Path(tmp)), indent=2))
    return 0
