"""Reading PEFT LoRA adapters (``adapter_config.json`` + ``adapter_model.safetensors``) into per-module weights."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from loraplane.kernels.slots import lora_scale

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
LEGACY_WEIGHTS_FILE = "adapter_model.bin"
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<which>[AB])(?:\.[^.]+)?\.weight$")


class AdapterFormatError(ValueError):
    """The files are not a LoRA adapter this library can serve (the message says why)."""


@dataclass(frozen=True)
class PeftLoraConfig:
    """The fields of ``adapter_config.json`` that change the math."""

    r: int = 8
    lora_alpha: float = 8
    use_rslora: bool = False
    fan_in_fan_out: bool = False
    target_modules: tuple[str, ...] = ()
    rank_pattern: Mapping[str, int] = field(default_factory=dict)
    alpha_pattern: Mapping[str, float] = field(default_factory=dict)
    base_model_name_or_path: str | None = None

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> PeftLoraConfig:
        """Validate a parsed ``adapter_config.json``; reject what the kernels cannot serve (DoRA, extra modules)."""
        if raw.get("peft_type", "LORA") != "LORA":
            raise AdapterFormatError(f"peft_type {raw.get('peft_type')!r} is not LORA")
        if raw.get("use_dora"):
            raise AdapterFormatError("DoRA adapters (use_dora) are not supported")
        if raw.get("modules_to_save"):
            raise AdapterFormatError("adapters with modules_to_save are not supported")
        targets = raw.get("target_modules") or ()
        try:
            return cls(
                r=int(raw.get("r", 8)),
                lora_alpha=float(raw.get("lora_alpha", 8)),
                use_rslora=bool(raw.get("use_rslora", False)),
                fan_in_fan_out=bool(raw.get("fan_in_fan_out", False)),
                target_modules=(targets,) if isinstance(targets, str) else tuple(targets),
                rank_pattern={str(k): int(v) for k, v in (raw.get("rank_pattern") or {}).items()},
                alpha_pattern={str(k): float(v) for k, v in (raw.get("alpha_pattern") or {}).items()},
                base_model_name_or_path=raw.get("base_model_name_or_path"),
            )
        except (TypeError, ValueError) as exc:
            raise AdapterFormatError(f"invalid adapter_config.json: {exc}") from exc

    def rank_for(self, module: str) -> int:
        """The module's rank: the first matching ``rank_pattern`` key, else ``r``."""
        key = _pattern_key(self.rank_pattern, module)
        return self.rank_pattern[key] if key is not None else self.r

    def alpha_for(self, module: str) -> float:
        """The module's alpha: the first matching ``alpha_pattern`` key, else ``lora_alpha``."""
        key = _pattern_key(self.alpha_pattern, module)
        return self.alpha_pattern[key] if key is not None else self.lora_alpha


@dataclass(frozen=True)
class LoraModuleWeights:
    """One module's LoRA: ``A [r, d_in]``, ``B [d_out, r]`` (unscaled, as stored) and its scale."""

    lora_a: torch.Tensor
    lora_b: torch.Tensor
    scale: float

    @property
    def rank(self) -> int:
        """The module's rank."""
        return int(self.lora_a.shape[0])


@dataclass(frozen=True)
class PeftAdapter:
    """A parsed adapter: its config and weights keyed by module path in the base model."""

    config: PeftLoraConfig
    modules: Mapping[str, LoraModuleWeights]

    @property
    def max_rank(self) -> int:
        """The largest rank of any module."""
        return max((m.rank for m in self.modules.values()), default=0)

    def nbytes(self) -> int:
        """Bytes of all A and B tensors."""
        return sum(m.lora_a.nbytes + m.lora_b.nbytes for m in self.modules.values())

    def for_slices(self, modules: Sequence[str]) -> tuple[list[torch.Tensor], list[torch.Tensor], list[float]]:
        """A, B and scale per packed output slice (empty tensors for modules this adapter does not touch)."""
        a_list, b_list, scales = [], [], []
        for name in modules:
            weights = self.modules.get(name)
            if weights is None:
                a_list.append(torch.empty(0))
                b_list.append(torch.empty(0))
                scales.append(1.0)
            else:
                a_list.append(weights.lora_a)
                b_list.append(weights.lora_b)
                scales.append(weights.scale)
        return a_list, b_list, scales


def adapter_from_state_dict(config: PeftLoraConfig, state: Mapping[str, torch.Tensor]) -> PeftAdapter:
    """Group ``...<module>.lora_A/B.weight`` tensors by module and attach each module's scale."""
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in state.items():
        match = _KEY.match(key)
        if match is None:
            raise AdapterFormatError(f"unsupported tensor {key!r} (only lora_A / lora_B weights are served)")
        halves.setdefault(match["module"], {})[match["which"]] = tensor
    modules = {}
    for module, pair in sorted(halves.items()):
        if set(pair) != {"A", "B"}:
            raise AdapterFormatError(f"module {module!r} lacks lora_A or lora_B")
        a, b = pair["A"], pair["B"]
        if a.dim() != 2 or b.dim() != 2 or b.shape[1] != a.shape[0]:
            raise AdapterFormatError(f"module {module!r}: A {tuple(a.shape)} and B {tuple(b.shape)} do not fit")
        rank = int(a.shape[0])
        if config.rank_pattern and config.rank_for(module) != rank:
            raise AdapterFormatError(f"module {module!r}: rank {rank} disagrees with rank_pattern")
        scale = lora_scale(config.alpha_for(module), rank, config.use_rslora)
        modules[module] = LoraModuleWeights(a, b, scale)
    return PeftAdapter(config, modules)


def load_peft_adapter(directory: str | Path) -> PeftAdapter:
    """Read a PEFT LoRA adapter directory (safetensors, or the legacy ``adapter_model.bin`` weights-only)."""
    root = Path(directory)
    config_path = root / CONFIG_FILE
    if not config_path.is_file():
        raise AdapterFormatError(f"{CONFIG_FILE} not found in the adapter directory")
    try:
        raw = json.loads(config_path.read_text())
    except json.JSONDecodeError as exc:
        raise AdapterFormatError(f"{CONFIG_FILE} is not valid JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise AdapterFormatError(f"{CONFIG_FILE} must hold a JSON object")
    config = PeftLoraConfig.from_dict(raw)
    if (root / WEIGHTS_FILE).is_file():
        from safetensors.torch import load_file

        state = load_file(str(root / WEIGHTS_FILE))
    elif (root / LEGACY_WEIGHTS_FILE).is_file():
        state = torch.load(root / LEGACY_WEIGHTS_FILE, map_location="cpu", weights_only=True)
    else:
        raise AdapterFormatError(f"neither {WEIGHTS_FILE} nor {LEGACY_WEIGHTS_FILE} found in the adapter directory")
    return adapter_from_state_dict(config, state)


def _pattern_key(patterns: Mapping[str, Any], module: str) -> str | None:
    """PEFT's rule: the first pattern that matches a dotted suffix of the module path."""
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", module):
            return key
    return None
