"""``loraplane plan``: size a pool for a base model, a set of adapters and their traffic.

Adapter bytes come from the formula (sum over injected layers of (d_in + d_out) x rank x dtype bytes) and are checked
against the adapters' safetensors files when there are any. The recommendation: the smallest ``max_lora_rank``
vLLM accepts that holds every adapter; ``max_loras`` as large as fits in a tenth of GPU memory (LoRAX's default
reserve; vLLM preallocates every slot at ``max_lora_rank``); ``max_cpu_loras`` as many adapters as the host budget
holds; then the fewest pods whose simulated P99 TTFT (loraplane's policy, the calibration profile scaled to the
model) meets the SLO.
"""

from __future__ import annotations

import argparse
import json
import math
import struct
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import yaml
from rich.console import Console
from rich.table import Table

from loraplane.helptext import HelpFormatter
from loraplane.sim.cluster import SimConfig
from loraplane.sim.profile import DTYPE_BYTES, LARGE_GPU, Profile, ProfileError, load_profile
from loraplane.sim.runner import simulate
from loraplane.sim.trace import TraceError, rates_trace, zipf_weights

#: ranks vLLM accepts for ``max_lora_rank``
ALLOWED_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
SLOT_CHOICES = (1, 2, 4, 8, 16, 32, 64)
#: share of GPU memory LoRA slots may take (LoRAX reserves 10 % by default)
LORA_MEMORY_SHARE = 0.10
#: vLLM's default gpu_memory_utilization, and what activations and buffers take besides weights and KV
GPU_MEMORY_UTILIZATION = 0.9
ACTIVATION_BYTES = 4_000_000_000
#: parameters of the model LARGE_GPU was measured for (Llama-3.1-8B)
PROFILE_PARAMS = 8.03e9
MAX_PODS = 256
PLAN_SECONDS = 300.0
_SAFETENSORS_DTYPES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I8": 1, "U8": 1}
_ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class PlanError(ValueError):
    """Input ``loraplane plan`` cannot use."""


@dataclass(frozen=True)
class BaseModel:
    """The shapes of a Llama-style decoder, from its ``config.json``."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    dtype_bytes: int

    @classmethod
    def from_config(cls, path: Path) -> BaseModel:
        """Read a transformers ``config.json`` (or a directory holding one)."""
        path = path / "config.json" if path.is_dir() else path
        try:
            data = json.loads(path.read_text())
            hidden, heads = int(data["hidden_size"]), int(data["num_attention_heads"])
            return cls(
                hidden=hidden,
                intermediate=int(data["intermediate_size"]),
                layers=int(data["num_hidden_layers"]),
                heads=heads,
                kv_heads=int(data.get("num_key_value_heads") or heads),
                head_dim=int(data.get("head_dim") or hidden // heads),
                vocab=int(data.get("vocab_size", 32000)),
                dtype_bytes=DTYPE_BYTES.get(str(data.get("torch_dtype", "bfloat16")), 2),
            )
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise PlanError(f"cannot read base model config {path}: {exc}") from exc

    def linear_shape(self, module: str) -> tuple[int, int]:
        """(d_in, d_out) of one projection."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        shapes = {
            "q_proj": (self.hidden, q),
            "k_proj": (self.hidden, kv),
            "v_proj": (self.hidden, kv),
            "o_proj": (q, self.hidden),
            "gate_proj": (self.hidden, self.intermediate),
            "up_proj": (self.hidden, self.intermediate),
            "down_proj": (self.intermediate, self.hidden),
        }
        if module not in shapes:
            raise PlanError(f"unknown target module {module!r}; known: {', '.join(shapes)}")
        return shapes[module]

    @property
    def params(self) -> int:
        """Weight count (linear layers and embeddings)."""
        per_layer = sum(a * b for a, b in (self.linear_shape(m) for m in _ALL_LINEAR))
        return self.layers * per_layer + 2 * self.vocab * self.hidden

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token over all layers."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    def lora_bytes(self, targets: Sequence[str], rank: int, dtype_bytes: int) -> int:
        """Sum over injected layers of (d_in + d_out) x rank x bytes."""
        return self.layers * sum(sum(self.linear_shape(m)) for m in targets) * rank * dtype_bytes


@dataclass(frozen=True)
class AdapterSpec:
    """One adapter: its rank and targets, bytes by the formula and, when a file exists, in the file."""

    name: str
    rank: int
    targets: tuple[str, ...]
    nbytes: int
    file_bytes: int | None = None


def _targets(value: Any, where: str) -> tuple[str, ...]:
    if value == "all-linear":
        return _ALL_LINEAR
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return tuple(dict.fromkeys(v.rsplit(".", 1)[-1] for v in value))
    raise PlanError(f"{where}: target_modules must be a list of module names or 'all-linear'")


def safetensors_lora_bytes(path: Path) -> tuple[int, int]:
    """(bytes of the LoRA tensors, bytes per element) from a safetensors file's header, without reading tensors."""
    try:
        with path.open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            if size > 100_000_000:
                raise PlanError(f"{path}: implausible safetensors header size")
            header = json.loads(f.read(size))
    except (OSError, ValueError, struct.error) as exc:
        raise PlanError(f"cannot read {path}: {exc}") from exc
    total, width = 0, 0
    for name, info in header.items():
        if name == "__metadata__" or "lora_" not in name:
            continue
        begin, end = info["data_offsets"]
        total += end - begin
        width = _SAFETENSORS_DTYPES.get(info["dtype"], width)
    return total, width


def _from_peft_dir(directory: Path, base: BaseModel) -> AdapterSpec:
    config_path = directory / "adapter_config.json"
    try:
        config = json.loads(config_path.read_text())
        rank = int(config["r"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise PlanError(f"cannot read {config_path}: {exc}") from exc
    targets = _targets(config.get("target_modules"), str(config_path))
    weights = directory / "adapter_model.safetensors"
    file_bytes, width = safetensors_lora_bytes(weights) if weights.is_file() else (None, base.dtype_bytes)
    return AdapterSpec(directory.name, rank, targets, base.lora_bytes(targets, rank, width or 2), file_bytes)


def read_adapters(source: Path, base: BaseModel) -> list[AdapterSpec]:
    """Adapters from a PEFT directory, a directory of PEFT directories, or a manifest (JSON/YAML list of
    ``{name, rank, target_modules, dtype}``)."""
    if source.is_dir():
        if (source / "adapter_config.json").is_file():
            return [_from_peft_dir(source, base)]
        found = [_from_peft_dir(d, base) for d in sorted(source.iterdir()) if (d / "adapter_config.json").is_file()]
        if not found:
            raise PlanError(f"{source}: no PEFT adapter directories (adapter_config.json) in it")
        return found
    try:
        entries = yaml.safe_load(source.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise PlanError(f"cannot read manifest {source}: {exc}") from exc
    if not isinstance(entries, list) or not entries:
        raise PlanError(f"manifest {source} must be a non-empty list of adapters")
    specs = []
    for i, entry in enumerate(entries):
        where = f"{source} entry {i}"
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            raise PlanError(f"{where}: needs a name")
        try:
            rank = int(entry["rank"])
        except (KeyError, TypeError, ValueError) as exc:
            raise PlanError(f"{where}: needs an integer rank") from exc
        width = DTYPE_BYTES.get(str(entry.get("dtype", "bfloat16")))
        if width is None:
            raise PlanError(f"{where}: unknown dtype {entry.get('dtype')!r}")
        targets = _targets(entry.get("target_modules", "all-linear"), where)
        specs.append(AdapterSpec(entry["name"], rank, targets, base.lora_bytes(targets, rank, width)))
    return specs


def parse_traffic(spec: str, names: list[str]) -> dict[str, float]:
    """``60`` (total req/s, Zipf 1.0 over the adapters in order), ``a=3,b=0.5`` or a JSON/YAML file ``{name: rate}``."""
    path = Path(spec)
    if path.is_file():
        try:
            data = yaml.safe_load(path.read_text())
        except (OSError, yaml.YAMLError) as exc:
            raise PlanError(f"cannot read traffic file {spec}: {exc}") from exc
        if not isinstance(data, dict):
            raise PlanError(f"traffic file {spec} must map adapter names to requests/s")
        pairs = [(str(k), v) for k, v in data.items()]
    elif "=" in spec:
        pairs = [tuple(p.split("=", 1)) for p in spec.split(",") if p.strip()]  # type: ignore[misc]
    else:
        try:
            total = float(spec)
        except ValueError as exc:
            raise PlanError(f"--traffic {spec!r}: a total rate, name=rate pairs or a file") from exc
        if not total > 0:
            raise PlanError("the total rate must be positive")
        return dict(zip(names, (total * zipf_weights(len(names), 1.0)).tolist(), strict=True))
    rates: dict[str, float] = {}
    for name, value in pairs:
        name = name.strip()
        if name not in names:
            raise PlanError(f"traffic names unknown adapter {name!r}")
        try:
            rates[name] = float(value)
        except (TypeError, ValueError) as exc:
            raise PlanError(f"traffic for {name}: {value!r} is not a number") from exc
        if rates[name] < 0 or not math.isfinite(rates[name]):
            raise PlanError(f"traffic for {name} must be a finite rate >= 0")
    return rates


def scaled_profile(profile: Profile, base: BaseModel, kv_tokens: int, adapter_bytes: int) -> Profile:
    """``profile`` (measured for an 8B model) scaled to ``base``: compute by parameter count, KV reads by KV size."""
    scale = base.params / PROFILE_PARAMS
    return replace(
        profile,
        name=f"{profile.name} scaled x{scale:.3g}",
        decode_base_ms=profile.decode_base_ms * scale,
        prefill_per_token_ms=profile.prefill_per_token_ms * scale,
        decode_per_seq_ms=profile.decode_per_seq_ms * base.kv_bytes_per_token / 131072,
        kv_capacity_tokens=kv_tokens,
        default_adapter_bytes=adapter_bytes,
    )


def recommend(
    base: BaseModel,
    adapters: list[AdapterSpec],
    rates: dict[str, float],
    slo_p99_ms: float,
    profile: Profile,
    gpu_bytes: int,
    host_bytes: int,
    seed: int = 0,
) -> dict[str, Any]:
    """The sizing, with the simulated TTFT of the recommended pool."""
    max_rank = max(a.rank for a in adapters)
    lora_rank = next((r for r in ALLOWED_RANKS if r >= max_rank), None)
    if lora_rank is None:
        raise PlanError(f"rank {max_rank} exceeds vLLM's largest max_lora_rank {ALLOWED_RANKS[-1]}")
    targets = tuple(sorted({t for a in adapters for t in a.targets}))
    slot_bytes = base.lora_bytes(targets, lora_rank, base.dtype_bytes)
    affordable = [s for s in SLOT_CHOICES if s * slot_bytes <= LORA_MEMORY_SHARE * gpu_bytes]
    if not affordable:
        raise PlanError("one LoRA slot at max_lora_rank takes more than a tenth of GPU memory")
    active = [a for a in adapters if rates.get(a.name, 0) > 0]
    max_loras = max(s for s in affordable if s <= max(1, len(active))) if active else 1
    biggest = max(a.nbytes for a in adapters)
    max_cpu = max(max_loras, min(len(adapters), host_bytes // biggest))
    kv_budget = GPU_MEMORY_UTILIZATION * gpu_bytes - base.params * base.dtype_bytes - ACTIVATION_BYTES
    kv_tokens = int((kv_budget - max_loras * slot_bytes) // base.kv_bytes_per_token)
    if kv_tokens < 4096:
        raise PlanError("the base model, LoRA slots and activations leave no room for a KV cache on this GPU")
    sized = scaled_profile(profile, base, kv_tokens, biggest)
    total_rate = sum(rates.values())
    requests = int(min(20_000, max(2_000, total_rate * PLAN_SECONDS)))
    trace = rates_trace(rates, {a.name: a.nbytes for a in adapters}, requests, seed)

    def p99(pods: int) -> tuple[float, dict[str, float]]:
        config = SimConfig(pods=pods, max_loras=max_loras, max_cpu_loras=max_cpu)
        ttft = np.frombuffer(simulate(trace, config, sized, "loraplane", seed).ttft, dtype=np.float64) * 1e3
        got = {f"p{q}": round(float(v), 2) for q, v in zip((50, 95, 99), np.percentile(ttft, (50, 95, 99)), strict=True)}
        return got["p99"], got

    tried: dict[int, dict[str, float]] = {}
    low, high = 1, 1
    while True:  # double until the SLO holds
        value, tried[high] = p99(high)
        if value <= slo_p99_ms or high >= MAX_PODS:
            break
        low, high = high + 1, min(MAX_PODS, high * 2)
    while low < high:  # then the fewest pods that still meet it
        mid = (low + high) // 2
        value, tried[mid] = p99(mid)
        if value <= slo_p99_ms:
            high = mid
        else:
            low = mid + 1
    pods = high
    ttft = tried[pods]
    checked = [a for a in adapters if a.file_bytes is not None]
    return {
        "adapters": len(adapters),
        "adapter_bytes": {"max": biggest, "total": sum(a.nbytes for a in adapters)},
        "files_checked": len(checked),
        "file_mismatches": {a.name: {"formula": a.nbytes, "file": a.file_bytes} for a in checked if a.nbytes != a.file_bytes},
        "max_lora_rank": lora_rank,
        "lora_slot_bytes": slot_bytes,
        "max_loras": max_loras,
        "max_cpu_loras": max_cpu,
        "kv_capacity_tokens": kv_tokens,
        "pods": pods,
        "traffic_rps": round(total_rate, 3),
        "simulated_requests": len(trace),
        "ttft_ms": ttft,
        "slo_ttft_p99_ms": slo_p99_ms,
        "meets_slo": ttft["p99"] <= slo_p99_ms,
        "profile": sized.name,
    }


def _bytes(text: str) -> int:
    units = {"K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
    text = text.strip().upper().removesuffix("B")
    try:
        value = float(text[:-1]) * units[text[-1]] if text and text[-1] in units else float(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not a size: {text!r}") from exc
    if value <= 0:
        raise argparse.ArgumentTypeError("a size must be positive")
    return int(value)


#: the flags that choose ``loraplane plan``'s GPUs-at-SLO mode (``loraplane.sim.capacity``)
CAPACITY_FLAGS = ("--scenario", "--trace")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``loraplane plan``: sizing from adapters and traffic, or, with ``--scenario`` / ``--trace``,
    the fewest pods each routing policy needs to reach an SLO on that trace (``loraplane.sim.capacity``)."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    if any(a in CAPACITY_FLAGS or a.startswith(tuple(f + "=" for f in CAPACITY_FLAGS)) for a in args_list):
        from loraplane.sim.capacity import main as capacity_main

        return capacity_main(args_list)
    p = argparse.ArgumentParser(
        prog="loraplane plan", formatter_class=HelpFormatter,
        description=__doc__.split("\n\n")[0] + " With --scenario S or --trace CSV instead: the fewest pods each "
        "routing policy needs to reach a target slo_attainment on that trace (loraplane plan --scenario S --help).",
    )  # fmt: skip
    p.add_argument("--base-model", type=Path, required=True, help="transformers config.json (or its directory)")
    p.add_argument("--adapters", type=Path, required=True, help="PEFT adapter dir(s) or a JSON/YAML manifest")
    p.add_argument("--traffic", required=True, help="total req/s (Zipf over adapters), name=rate,... or a file")
    p.add_argument("--slo-ttft-p99", type=float, required=True, metavar="MS", help="P99 TTFT target in ms")
    p.add_argument("--gpu-memory", type=_bytes, default=80_000_000_000, help="per GPU (default 80G)")
    p.add_argument("--host-memory", type=_bytes, default=64_000_000_000, help="host memory for adapters (64G)")
    p.add_argument("--profile", default=LARGE_GPU.name, help="calibration profile (name or JSON file)")
    p.add_argument("--seed", type=int, default=0, help="seed of the simulated traffic")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(args_list)
    err = Console(stderr=True)
    try:
        if args.slo_ttft_p99 <= 0:
            raise PlanError("--slo-ttft-p99 must be positive")
        base = BaseModel.from_config(args.base_model)
        adapters = read_adapters(args.adapters, base)
        rates = parse_traffic(args.traffic, [a.name for a in adapters])
        result = recommend(
            base, adapters, rates, args.slo_ttft_p99, load_profile(args.profile), args.gpu_memory, args.host_memory,
            args.seed,
        )  # fmt: skip
    except (PlanError, ProfileError, TraceError) as exc:
        err.print(f"loraplane plan: {exc}", markup=False)
        return 2
    if args.json:
        sys.stdout.buffer.write(orjson.dumps(result) + b"\n")
        return 0
    table = Table(title="loraplane plan", show_header=False, title_justify="left")
    for key, value in result.items():
        table.add_row(key, json.dumps(value) if isinstance(value, dict) else str(value))
    Console().print(table)
    return 0
