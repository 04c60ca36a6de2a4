"""Write real PEFT LoRA adapter directories for a model (``loraplane engine make-adapters``)."""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import save_file

from loraplane.api import ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE, adapter_digest
from loraplane.engine.model import LORA_MODULES, PRESETS, ModelConfig, module_path, read_checkpoint


def write_adapter(
    out_dir: Path,
    config: ModelConfig,
    rank: int,
    seed: int,
    targets: Sequence[str] = LORA_MODULES,
    alpha: float | None = None,
    strength: float = 0.5,
    base_model_name: str = "tiny",
) -> str:
    """Write one adapter (non-zero A and B, deterministic for ``seed``) into ``out_dir``; returns its digest.

    ``strength`` is the typical size of the LoRA delta relative to the base layer's output (the engine's seeded
    models keep activations near unit scale), large enough that different adapters change greedy outputs.
    """
    unknown = sorted(set(targets) - set(LORA_MODULES))
    if unknown:
        raise ValueError(f"unknown target modules {unknown}; choose from {', '.join(LORA_MODULES)}")
    alpha = float(rank if alpha is None else alpha)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for module in targets:
            d_in, d_out = config.module_shape(module)
            prefix = f"base_model.model.{module_path(layer, module)}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, d_in, generator=gen) / math.sqrt(d_in)
            b_std = strength * rank / alpha / math.sqrt(rank)
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(d_out, rank, generator=gen) * b_std
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / ADAPTER_WEIGHTS_FILE))
    peft_config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha, "lora_dropout": 0.0,
        "target_modules": list(targets), "bias": "none", "use_rslora": False, "use_dora": False,
        "fan_in_fan_out": False, "base_model_name_or_path": base_model_name, "modules_to_save": None,
    }
    (out_dir / ADAPTER_CONFIG_FILE).write_text(json.dumps(peft_config, indent=2) + "\n")
    return adapter_digest(out_dir)


def model_config(model: str) -> ModelConfig:
    """The config of a preset name or a checkpoint directory."""
    if model in PRESETS:
        return PRESETS[model]
    return read_checkpoint(Path(model))[0]


def main(argv: Sequence[str]) -> int:
    """``loraplane engine make-adapters``: prints one JSON line per adapter (name, path, rank, digest)."""
    parser = argparse.ArgumentParser(prog="loraplane engine make-adapters",
                                     description="write real PEFT LoRA adapters for a model (for tests and demos)")
    parser.add_argument("--model", default="tiny", help="preset name or checkpoint directory (default tiny)")
    parser.add_argument("--out", type=Path, required=True, help="directory to write <prefix>-NNN/ adapters into")
    parser.add_argument("--count", type=int, default=10)
    parser.add_argument("--ranks", default="8", help="comma-separated ranks, used in turn (e.g. 8,16,32)")
    parser.add_argument("--targets", default=",".join(LORA_MODULES), help="comma-separated target modules")
    parser.add_argument("--prefix", default="adapter")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--strength", type=float, default=0.5, help="relative size of the LoRA delta")
    args = parser.parse_args(list(argv))
    try:
        ranks = [int(r) for r in args.ranks.split(",")]
        config = model_config(args.model)
        for i in range(args.count):
            name = f"{args.prefix}-{i:03d}"
            rank = ranks[i % len(ranks)]
            digest = write_adapter(args.out / name, config, rank, seed=args.seed * 100_003 + i,
                                   targets=args.targets.split(","), strength=args.strength,
                                   base_model_name=args.model if args.model in PRESETS else Path(args.model).name)
            print(json.dumps({"name": name, "path": str(args.out / name), "rank": rank, "digest": digest}))
    except ValueError as exc:
        print(f"loraplane engine make-adapters: {exc}", file=sys.stderr)
        return 2
    return 0
