"""Write servable model checkpoints and real PEFT LoRA adapters for them (``loraplane engine make-model``,
``loraplane engine make-adapters``): directories that both the reference engine and vLLM serve."""

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
from loraplane.engine.model import (
    LORA_MODULES,
    PRESETS,
    ModelConfig,
    checkpoint_digest,
    module_path,
    read_checkpoint,
    seeded_weights,
)
from loraplane.engine.tokenizer import write_byte_tokenizer
from loraplane.helptext import HelpFormatter

#: The weights file of a checkpoint written by :func:`write_model`.
MODEL_WEIGHTS_FILE = "model.safetensors"


def write_model(out_dir: Path, preset: str = "tiny", seed: int = 0) -> str:
    """Write a seeded preset as a ``transformers`` Llama checkpoint into ``out_dir``; returns its digest.

    ``config.json``, ``model.safetensors`` (the weights the engine's ``--model <preset> --seed <seed>`` computes) and a
    byte tokenizer (``tokenizer.json``, ``tokenizer_config.json``; ids as the engine's byte tokenizer): vLLM,
    ``transformers`` and the engine all load the directory and compute the same model.
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
    config = PRESETS[preset]
    out_dir.mkdir(parents=True, exist_ok=True)
    weights = {name: t.contiguous() for name, t in seeded_weights(config, seed).items()}
    save_file(weights, str(out_dir / MODEL_WEIGHTS_FILE), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config.to_hf(), indent=2) + "\n")
    generation = {"bos_token_id": config.bos_token_id, "eos_token_id": config.to_hf()["eos_token_id"]}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    write_byte_tokenizer(out_dir, config.vocab_size, config.bos_token_id, config.eos_token_ids)
    return checkpoint_digest(out_dir)


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


def model_main(argv: Sequence[str]) -> int:
    """``loraplane engine make-model``: writes a checkpoint directory, prints one JSON line (path, digest)."""
    parser = argparse.ArgumentParser(prog="loraplane engine make-model", formatter_class=HelpFormatter,
                                     description="write a seeded preset as a Llama checkpoint vLLM and the engine serve")
    parser.add_argument("--preset", default="tiny", choices=sorted(PRESETS), help="model preset")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights")
    parser.add_argument("--out", type=Path, required=True, help="directory to write the checkpoint into")
    args = parser.parse_args(list(argv))
    digest = write_model(args.out, args.preset, args.seed)
    print(json.dumps({"path": str(args.out), "preset": args.preset, "seed": args.seed, "digest": digest}))
    return 0


def main(argv: Sequence[str]) -> int:
    """``loraplane engine make-adapters``: prints one JSON line per adapter (name, path, rank, digest)."""
    parser = argparse.ArgumentParser(prog="loraplane engine make-adapters", formatter_class=HelpFormatter,
                                     description="write real PEFT LoRA adapters for a model (for tests and demos)")
    parser.add_argument("--model", default="tiny", help="preset name or checkpoint directory (default tiny)")
    parser.add_argument("--out", type=Path, required=True, help="directory to write <prefix>-NNN/ adapters into")
    parser.add_argument("--count", type=int, default=10, help="adapters to write")
    parser.add_argument("--ranks", default="8", help="comma-separated ranks, used in turn (e.g. 8,16,32)")
    parser.add_argument("--targets", default=",".join(LORA_MODULES), help="comma-separated target modules")
    parser.add_argument("--prefix", default="adapter", help="adapter directory names: <prefix>-NNN")
    parser.add_argument("--seed", type=int, default=0, help="seed of the adapters' weights")
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
