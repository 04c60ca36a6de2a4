"""Calibration profiles: what a load, a prefill token and a decode step cost on one kind of pod.

A profile is plain numbers in milliseconds, bytes and tokens. Two sources:

- ``LARGE_GPU``: Llama-3.1-8B (bf16) on one 80 GB GPU (A100-80GB SXM class). Every number is derived from a public
  figure; the derivation is in ``docs/sim.md`` and in the field comments below.
- ``from_bench``: the JSON printed by ``loraplane bench engine --json`` (and optionally ``bench sidecar --json``),
  i.e. what this project's own runtime measured on the machine at hand.
- measured from a real vLLM by ``loraplane bench profile --runtime vllm`` (``loraplane.emulator.calibrate``), saved
  with its provenance as ``{"profile": {...}, "measurement": {...}}``; the packaged ones (``sim/loraplane/sim/data/*.profile.json``,
  e.g. ``vllm-cpu-tiny-hd32``) load by name.
"""

from __future__ import annotations

import json
from dataclasses import MISSING, asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from loraplane.api import Tier

#: dtype name -> bytes per element.
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "fp32": 4, "fp16": 2, "bf16": 2}


@dataclass(frozen=True)
class Profile:
    """Costs of one pod type. Times in ms, sizes in bytes or tokens."""

    name: str
    #: fixed CPU cost of one engine step (scheduling, sampling, Python)
    step_overhead_ms: float
    #: one decode step with a batch of one sequence, base model only (weights read once per step)
    decode_base_ms: float
    #: added per sequence in the batch (its KV cache read)
    decode_per_seq_ms: float
    #: added once when any adapter is in the batch (LoRA kernels launched at all)
    lora_base_ms: float
    #: added per distinct adapter in the batch (SGMV segments)
    lora_per_adapter_ms: float
    #: prefill cost per prompt token
    prefill_per_token_ms: float
    #: host -> device copy of one adapter: fixed part and bandwidth
    h2d_fixed_ms: float
    h2d_ms_per_mb: float
    #: disk read + parse into host tensors: fixed part, read bandwidth, parse bandwidth
    disk_fixed_ms: float
    disk_read_ms_per_mb: float
    parse_ms_per_mb: float
    #: download from the registry + digest check (asynchronous: does not stall the batch)
    download_fixed_ms: float
    download_ms_per_mb: float
    #: continuous batching limits
    max_num_seqs: int
    max_batched_tokens: int
    kv_capacity_tokens: int
    #: default adapter size when a trace does not say (rank 16, all linear layers of the model)
    default_adapter_bytes: int
    #: vLLM's ``--long-prefill-token-threshold``: most prompt tokens one request prefills per step (0: no limit)
    long_prefill_token_threshold: int = 0
    #: fixed latency of a request outside the engine's steps: the API server (HTTP, validation, tokenizer) and the
    #: hand-off to the engine core and back. The emulator holds a request this long before its engine sees it; the
    #: simulator adds it to every TTFT. 0 in the derived profiles: a GPU step dwarfs it
    request_overhead_ms: float = 0.0

    def load_ms(self, tier: Tier, nbytes: int) -> float:
        """Synchronous (batch-stalling) cost of bringing an adapter of ``nbytes`` from ``tier`` into a GPU slot."""
        if tier is Tier.GPU:
            return 0.0
        mb = nbytes / 1e6
        cost = self.h2d_fixed_ms + mb * self.h2d_ms_per_mb
        if tier is not Tier.CPU:
            cost += self.disk_fixed_ms + mb * (self.disk_read_ms_per_mb + self.parse_ms_per_mb)
        return cost

    def download_ms(self, nbytes: int) -> float:
        """Asynchronous cost of fetching an absent adapter to local disk."""
        return self.download_fixed_ms + nbytes / 1e6 * self.download_ms_per_mb

    def decode_step_ms(self, batch: int, distinct_adapters: int) -> float:
        """One decode step for ``batch`` sequences using ``distinct_adapters`` adapters."""
        lora = self.lora_base_ms + self.lora_per_adapter_ms * distinct_adapters if distinct_adapters else 0.0
        return self.step_overhead_ms + self.decode_base_ms + self.decode_per_seq_ms * batch + lora

    def to_dict(self) -> dict[str, Any]:
        """The profile as a JSON-ready dict."""
        return asdict(self)


def lora_bytes(layer_shapes: list[tuple[int, int]], num_layers: int, rank: int, dtype_bytes: int) -> int:
    """Adapter weight bytes: sum over injected layers of (d_in + d_out) x rank x bytes, times the layer count."""
    return sum(d_in + d_out for d_in, d_out in layer_shapes) * rank * dtype_bytes * num_layers


#: Llama-3.1-8B linear layers per decoder block (d_in, d_out): q, k, v, o, gate, up, down.
LLAMA_8B_LINEARS = [(4096, 4096), (4096, 1024), (4096, 1024), (4096, 4096), (4096, 14336), (4096, 14336), (14336, 4096)]

LARGE_GPU = Profile(
    name="a100-80gb-llama-3.1-8b",
    # vLLM V1 keeps scheduling off the GPU's critical path; ~0.5 ms of Python per step remains.
    step_overhead_ms=0.5,
    # 16.1 GB of bf16 weights read once per step at ~75% of the 2,039 GB/s HBM2e peak (A100-80GB SXM datasheet).
    decode_base_ms=10.5,
    # KV per token: 32 layers x 8 KV heads x 128 dims x 2 (K, V) x 2 B = 128 KiB; ~1k tokens of context per
    # sequence read at the same bandwidth -> ~0.09 ms; we use 0.08.
    decode_per_seq_ms=0.08,
    # Punica reports ~2 ms per token of LoRA overhead at batch 32 with distinct adapters on a 7B model; split into a
    # launch cost and a per-segment cost.
    lora_base_ms=0.8,
    lora_per_adapter_ms=0.3,
    # 2 x 8.0e9 FLOP per token at ~50% of 312 TFLOPS bf16 dense (A100 datasheet) -> 0.1 ms/token.
    prefill_per_token_ms=0.1,
    # pinned-memory copy over PCIe Gen4 x16 (~25 GB/s effective of 32) plus ~450 per-tensor copies into slots.
    h2d_fixed_ms=2.0,
    h2d_ms_per_mb=0.05,
    # NVMe Gen4 data-centre drive ~3 GB/s sequential read; safetensors parse + tensor build + pin ~1 GB/s;
    # ~50 ms of per-module Python (PEFT config checks, name mapping) in vLLM's LoRAModel loader.
    disk_fixed_ms=50.0,
    disk_read_ms_per_mb=0.33,
    parse_ms_per_mb=1.0,
    # registry fetch: ~300 ms of auth + manifest + TLS round trips, then ~2 Gbit/s (250 MB/s) with sha256 inline.
    download_fixed_ms=300.0,
    download_ms_per_mb=4.0,
    # vLLM defaults: max_num_seqs 256, max_num_batched_tokens 8192 (chunked prefill).
    max_num_seqs=256,
    max_batched_tokens=8192,
    # 0.9 x 80 GB - 16.1 GB weights - ~4 GB activations/LoRA buffers ~= 52 GB / 128 KiB per token.
    kv_capacity_tokens=400_000,
    default_adapter_bytes=lora_bytes(LLAMA_8B_LINEARS, 32, 16, 2),
)

class ProfileError(ValueError):
    """A profile file or bench output that cannot be turned into a profile."""


def from_dict(data: dict[str, Any], where: str = "profile") -> Profile:
    """A profile from its ``to_dict()`` form; fields added since it was saved take their defaults."""
    known = {f.name for f in fields(Profile)}
    required = {f.name for f in fields(Profile) if f.default is MISSING}
    if not known >= set(data) >= required:
        raise ProfileError(f"{where}: expected keys {sorted(required)} (optional: {sorted(known - required)}), got "
                           f"{sorted(data)}")
    try:
        return Profile(**data)
    except TypeError as exc:
        raise ProfileError(f"{where}: {exc}") from exc


def _packaged() -> dict[str, Profile]:
    """The measured profiles shipped with the package (``sim/loraplane/sim/data/<name>.profile.json``), by name."""
    found = {}
    for path in sorted((Path(__file__).parent / "data").glob("*.profile.json")):
        profile = from_dict(json.loads(path.read_text())["profile"], str(path.name))
        found[profile.name] = profile
    return found


PROFILES = {LARGE_GPU.name: LARGE_GPU, "large-gpu": LARGE_GPU, **_packaged()}


def _number(obj: dict[str, Any], *path: str) -> float:
    cur: Any = obj
    for key in path:
        if not isinstance(cur, dict) or key not in cur:
            raise ProfileError(f"bench output lacks {'.'.join(path)}")
        cur = cur[key]
    if not isinstance(cur, int | float) or isinstance(cur, bool) or cur < 0:
        raise ProfileError(f"{'.'.join(path)} must be a non-negative number, got {cur!r}")
    return float(cur)


def from_bench(
    engine: dict[str, Any], sidecar: dict[str, Any] | None = None, base: Profile = LARGE_GPU, name: str = "bench"
) -> Profile:
    """A profile calibrated from ``loraplane bench engine --json`` (and ``bench sidecar --json``) output.

    From the engine bench: load costs are the TTFT differences ``ttft_ms.L1 - L0`` (host -> device) and
    ``L2 - L1`` (disk read + parse); a decode step of ``decode_batch`` sequences takes ``1000 * batch / tokens_per_s``
    for ``base``, ``1_adapter`` and ``<batch>_adapters``, which gives the base step and the LoRA costs; the prefill
    rate is what is left of ``ttft_ms.L0`` after one step, per ``prompt_tokens``. From the sidecar bench: the L3
    stages ``resolve + download + verify + unpack`` give the download cost, ``adapter_bytes`` the adapter size.
    Batch limits and KV capacity are not measured and come from ``base``.
    """
    l0 = _number(engine, "ttft_ms", "L0")
    l1 = _number(engine, "ttft_ms", "L1")
    l2 = _number(engine, "ttft_ms", "L2")
    if not l0 <= l1 <= l2:
        raise ProfileError(f"bench TTFTs must satisfy L0 <= L1 <= L2, got {l0}, {l1}, {l2}")
    batch = int(_number(engine, "decode_batch"))
    prompt = _number(engine, "prompt_tokens")
    rates = [_number(engine, "decode_tokens_per_s", key) for key in ("base", "1_adapter", f"{batch}_adapters")]
    if batch < 2 or prompt < 1 or min(rates) <= 0:
        raise ProfileError("need decode_batch >= 2, prompt_tokens >= 1 and positive decode rates")
    base_step, one, many = (1000.0 * batch / r for r in rates)
    per_adapter = max(0.0, (many - one) / (batch - 1))
    nbytes = base.default_adapter_bytes
    download_ms = base.download_ms(nbytes)
    if sidecar is not None:
        nbytes = int(_number(sidecar, "adapter_bytes"))
        l3 = sidecar.get("stages_ms", {}).get("L3") if isinstance(sidecar.get("stages_ms"), dict) else None
        if not isinstance(l3, dict) or "download" not in l3:
            raise ProfileError("sidecar bench output lacks stages_ms.L3.download")
        download_ms = sum(
            _number(l3, stage) for stage in ("resolve", "download", "verify", "unpack") if stage in l3
        )
    return replace(
        base,
        name=name,
        step_overhead_ms=0.0,
        decode_base_ms=base_step,
        decode_per_seq_ms=0.0,
        lora_base_ms=max(0.0, one - base_step - per_adapter),
        lora_per_adapter_ms=per_adapter,
        prefill_per_token_ms=max(0.0, l0 - base_step) / prompt,
        # the benches measured one adapter size: every load cost is a fixed cost
        h2d_fixed_ms=l1 - l0,
        h2d_ms_per_mb=0.0,
        disk_fixed_ms=l2 - l1,
        disk_read_ms_per_mb=0.0,
        parse_ms_per_mb=0.0,
        download_fixed_ms=download_ms,
        download_ms_per_mb=0.0,
        default_adapter_bytes=nbytes,
    )


def load_profile(spec: str) -> Profile:
    """A named built-in profile, or a JSON file: a saved profile (bare, or ``{"profile": {..}, ...}`` as ``loraplane
    bench profile --out`` writes it), or ``{"engine": {..}, "sidecar": {..}}`` bench output."""
    if spec in PROFILES:
        return PROFILES[spec]
    path = Path(spec)
    if not path.is_file():
        raise ProfileError(f"unknown profile {spec!r}: not one of {sorted(PROFILES)} and not a file")
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ProfileError(f"cannot read profile {spec}: {exc}") from exc
    if not isinstance(data, dict):
        raise ProfileError(f"profile {spec} must hold a JSON object")
    if "engine" in data:
        return from_bench(data["engine"], data.get("sidecar"), name=path.stem)
    if "ttft_ms" in data:
        return from_bench(data, name=path.stem)
    if isinstance(data.get("profile"), dict):
        data = data["profile"]
    return from_dict(data, f"profile {spec}")
