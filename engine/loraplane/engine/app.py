"""Assembling an engine from options: model, tiers, policy, metrics, HTTP app."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from starlette.applications import Starlette

from loraplane.engine.adapters import default_read_threads
from loraplane.engine.core import Engine, EngineLimits
from loraplane.engine.merging import MergeConfig
from loraplane.engine.metrics import EngineMetrics
from loraplane.engine.model import (
    PRESETS,
    LlamaModel,
    checkpoint_digest,
    preset_digest,
    read_checkpoint,
    seeded_weights,
)
from loraplane.engine.policies import POLICIES
from loraplane.engine.server import EngineApi, ServerConfig, build_app
from loraplane.engine.tiers import AdapterTiers
from loraplane.engine.tokenizer import load_tokenizer

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class EngineOptions:
    """Everything ``loraplane-engine`` can be told (the CLI flags, one to one)."""

    model: str = "tiny"
    seed: int = 0
    served_model_name: str | None = None
    dtype: str = "float32"
    device: str = "cpu"
    max_loras: int = 1
    max_cpu_loras: int | None = None
    max_lora_rank: int = 16
    max_num_seqs: int = 16
    max_model_len: int = 512
    max_num_batched_tokens: int = 2048
    scheduling_policy: str = "fcfs"
    eviction_policy: str = "lru"
    lora_modules: dict[str, Path] = field(default_factory=dict)
    adapter_root: Path | None = None
    allow_runtime_lora_updating: bool = False
    admin_token: str | None = None
    lora_backend: str | None = None
    load_read_threads: int = field(default_factory=default_read_threads)
    #: dynamic merge: auto (the policy), off, force (tests and benchmarks)
    lora_merge: str = "auto"
    max_merged_loras: int = 2


@dataclass
class BuiltEngine:
    """An engine and the HTTP app serving it."""

    engine: Engine
    api: EngineApi
    app: Starlette


def build(options: EngineOptions, clock: Callable[[], float] = time.monotonic,
          wall_clock: Callable[[], float] = time.time, rng: random.Random | None = None) -> BuiltEngine:
    """Load the model (a preset name or a checkpoint directory) and wire everything; ValueError on bad options."""
    if options.dtype not in _DTYPES:
        raise ValueError(f"--dtype must be one of {sorted(_DTYPES)}")
    if options.eviction_policy not in POLICIES:
        raise ValueError(f"--eviction-policy must be one of {sorted(POLICIES)}")
    if options.load_read_threads < 1:
        raise ValueError("--load-read-threads must be at least 1")
    merge = MergeConfig(mode=options.lora_merge, max_merged=options.max_merged_loras)
    model_dir: Path | None = None
    if options.model in PRESETS:
        config, weights = PRESETS[options.model], seeded_weights(PRESETS[options.model], options.seed)
        digest = preset_digest(options.model, options.seed)
        default_name = options.model
    else:
        model_dir = Path(options.model)
        if not model_dir.is_dir():
            raise ValueError(f"--model {options.model!r} is neither a preset ({', '.join(PRESETS)}) nor a directory")
        config, weights = read_checkpoint(model_dir)
        digest = checkpoint_digest(model_dir)
        default_name = model_dir.name
    model = LlamaModel(config, weights, max_loras=options.max_loras, max_lora_rank=options.max_lora_rank,
                       dtype=_DTYPES[options.dtype], device=options.device, lora_backend=options.lora_backend)
    name = options.served_model_name or default_name
    metrics = EngineMetrics(name)
    tiers = AdapterTiers(model, options.max_loras, options.max_cpu_loras or options.max_loras, options.max_lora_rank,
                         POLICIES[options.eviction_policy](), clock=wall_clock,
                         on_evict=lambda _adapter, tier: metrics.evicted(tier))
    limits = EngineLimits(options.max_num_seqs, options.max_model_len, options.max_num_batched_tokens,
                          options.scheduling_policy)
    engine = Engine(model, tiers, load_tokenizer(model_dir, config.bos_token_id), metrics, limits, clock=clock, rng=rng,
                    load_read_threads=options.load_read_threads, merge=merge)
    metrics.bind(engine, wall_clock)
    server_config = ServerConfig(name, digest, options.adapter_root, options.allow_runtime_lora_updating,
                                 options.admin_token, options.max_model_len)
    api = EngineApi(engine, server_config, wall_clock)

    async def preload() -> None:
        for lora_name, path in options.lora_modules.items():
            await engine.add_adapter(lora_name, path)

    return BuiltEngine(engine, api, build_app(api, preload))
