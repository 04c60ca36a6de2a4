"""Reading PEFT LoRA adapters: path confinement, disk read, parse, and checks against the base model."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load as load_safetensors

from loraplane.api import ADAPTER_CONFIG_FILE, ADAPTER_FILES, ADAPTER_WEIGHTS_FILE
from loraplane.api.adapterfiles import adapter_digest_of
from loraplane.engine.model import LORA_MODULES, ModelConfig, module_path
from loraplane.kernels.peft import (
    AdapterFormatError,
    LoraModuleWeights,
    PeftAdapter,
    PeftLoraConfig,
    adapter_from_state_dict,
)


class AdapterNotFoundError(LookupError):
    """The adapter directory or one of its files does not exist (vLLM answers 404)."""


class AdapterRejectedError(ValueError):
    """The adapter exists but cannot be loaded: outside the root, malformed, or incompatible with the base model."""


def confine(root: Path | None, requested: str) -> Path:
    """The adapter directory ``requested`` names, guaranteed to lie inside ``root`` after resolving symlinks.

    A relative path is taken relative to ``root``. Refused: no root configured, ``..`` escapes, absolute paths
    elsewhere, and symlinks (of the directory or of its files) that point outside ``root``.
    """
    if root is None:
        raise AdapterRejectedError("dynamic loading is confined to --adapter-root, and none is configured")
    if "\x00" in requested:
        raise AdapterRejectedError("lora_path contains a NUL byte")
    real_root = root.resolve(strict=True)
    candidate = Path(requested) if os.path.isabs(requested) else real_root / requested
    try:
        resolved = candidate.resolve(strict=True)
    except (FileNotFoundError, NotADirectoryError):
        raise AdapterNotFoundError(f"No adapter found for {requested}") from None
    except (OSError, RuntimeError) as exc:
        raise AdapterRejectedError(f"lora_path {requested!r} cannot be resolved: {exc}") from None
    if not resolved.is_relative_to(real_root):
        raise AdapterRejectedError(f"lora_path {requested!r} is outside the adapter root")
    if not resolved.is_dir():
        raise AdapterNotFoundError(f"No adapter found for {requested}: not a directory")
    for name in ADAPTER_FILES:
        file = resolved / name
        if not file.exists():
            raise AdapterNotFoundError(f"No adapter found for {requested}: {name} is missing")
        if not file.resolve().is_relative_to(real_root):
            raise AdapterRejectedError(f"{name} in {requested!r} links outside the adapter root")
    return resolved


@dataclass(frozen=True)
class AdapterFiles:
    """The raw bytes of an adapter as read from disk, and their digest."""

    config: bytes
    weights: bytes
    digest: str

    @classmethod
    def read(cls, adapter_dir: Path) -> AdapterFiles:
        """Read both files (the disk-read stage)."""
        config = (adapter_dir / ADAPTER_CONFIG_FILE).read_bytes()
        weights = (adapter_dir / ADAPTER_WEIGHTS_FILE).read_bytes()
        digest = adapter_digest_of(
            {ADAPTER_CONFIG_FILE: hashlib.sha256(config).hexdigest(), ADAPTER_WEIGHTS_FILE: hashlib.sha256(weights).hexdigest()}
        )
        return cls(config, weights, digest)


def host_copy(adapter: PeftAdapter, dtype: torch.dtype, pin: bool) -> PeftAdapter:
    """The adapter's tensors in the serving dtype, contiguous, page-locked when ``pin`` (fast copies to CUDA)."""

    def prepare(t: torch.Tensor) -> torch.Tensor:
        t = t.to(dtype).contiguous()
        return t.pin_memory() if pin else t

    modules = {name: LoraModuleWeights(prepare(m.lora_a), prepare(m.lora_b), m.scale) for name, m in adapter.modules.items()}
    return PeftAdapter(adapter.config, modules)


def _read_peft(files: AdapterFiles) -> PeftAdapter:
    """The PEFT adapter in the raw bytes; :class:`AdapterFormatError` (with the reason) when they are not one."""
    try:
        raw = json.loads(files.config)
    except ValueError as exc:
        raise AdapterFormatError(f"{ADAPTER_CONFIG_FILE} is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise AdapterFormatError(f"{ADAPTER_CONFIG_FILE} must hold a JSON object")
    config = PeftLoraConfig.from_dict(raw)
    try:
        state = load_safetensors(files.weights)
    except Exception as exc:  # safetensors raises its own error types for malformed files
        raise AdapterFormatError(f"{ADAPTER_WEIGHTS_FILE} is not a valid safetensors file: {exc}") from None
    return adapter_from_state_dict(config, state)


def parse_adapter(files: AdapterFiles, base: ModelConfig, max_lora_rank: int) -> PeftAdapter:
    """Parse and check an adapter against the base model (the parse stage). Raises :class:`AdapterRejectedError`."""
    try:
        adapter = _read_peft(files)
    except AdapterFormatError as exc:
        raise AdapterRejectedError(str(exc)) from None
    if not adapter.modules:
        raise AdapterRejectedError(f"{ADAPTER_WEIGHTS_FILE} holds no LoRA tensors")
    shapes = {module_path(layer, module): base.module_shape(module)
              for layer in range(base.num_hidden_layers) for module in LORA_MODULES}
    for name, weights in adapter.modules.items():
        if name not in shapes:
            raise AdapterRejectedError(f"target module {name!r} does not exist in the base model (or cannot take LoRA)")
        d_in, d_out = shapes[name]
        a, b = weights.lora_a, weights.lora_b
        if a.shape[1] != d_in or b.shape[0] != d_out:
            raise AdapterRejectedError(
                f"{name}: A {tuple(a.shape)} / B {tuple(b.shape)} do not fit the base layer [r, {d_in}] / [{d_out}, r]"
            )
        if weights.rank > max_lora_rank:
            raise AdapterRejectedError(f"LoRA rank {weights.rank} is greater than max_lora_rank {max_lora_rank}")
    return adapter
