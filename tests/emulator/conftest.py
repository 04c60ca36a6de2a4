"""Adapters, models and engines the emulator tests share: PEFT directories written by hand (a safetensors header
and zero weights), a model's config.json, and an emulator app on a virtual clock."""

from __future__ import annotations

import asyncio
import json
import struct
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import httpx
import pytest

from loraplane.api import adapter_digest
from loraplane.emulator.adapters import AdapterFiles, ModelShapes
from loraplane.emulator.engine import Engine, EngineConfig
from loraplane.emulator.loop import EngineLoop
from loraplane.emulator.lora_cache import Lora
from loraplane.emulator.server import ApiConfig, EmulatorApi, build_app
from loraplane.sim.profile import LARGE_GPU, Profile

#: a tiny Llama: hidden 64, intermediate 128, two 32-wide heads, one KV head (the e2e tests' ``tiny-hd32``)
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1,
        "head_dim": 32, "num_hidden_layers": 2, "max_position_embeddings": 2048}
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_model(path: Path, config: dict[str, int] = TINY) -> Path:
    """A model directory with only its config.json (all the emulator reads)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    return path


def write_adapter(path: Path, rank: int = 8, config: dict[str, int] = TINY, seed: int = 0) -> Path:
    """A PEFT adapter directory for a model of ``config``: every linear module of every layer, float32 zeros
    (``seed`` changes the config, so the content digest)."""
    shapes = ModelShapes.from_dir(write_model(path.parent / f".model-{path.name}", config))
    assert shapes is not None
    header: dict[str, object] = {}
    offset = 0
    for layer in range(config["num_hidden_layers"]):
        for module in MODULES:
            d_in, d_out = shapes.modules[module]
            part = "self_attn" if module in MODULES[:4] else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{part}.{module}"
            for name, shape in ((f"{prefix}.lora_A.weight", [rank, d_in]), (f"{prefix}.lora_B.weight", [d_out, rank])):
                size = 4 * shape[0] * shape[1]
                header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + size]}
                offset += size
    raw = json.dumps(header).encode()
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(offset))
    (path / "adapter_config.json").write_text(json.dumps({"r": rank, "lora_alpha": rank, "seed": seed,
                                                          "target_modules": list(MODULES), "bias": "none"}))
    return path


def lora(name: str, int_id: int, nbytes: int = LARGE_GPU.default_adapter_bytes) -> Lora:
    """An adapter for engine-level tests (no files)."""
    return Lora(name, int_id, name, AdapterFiles(16, f"digest-{name}", None), nbytes)


def small_profile(**changes: float | int) -> Profile:
    """The large-GPU profile with ``changes``."""
    return replace(LARGE_GPU, **changes)  # type: ignore[arg-type]


class VirtualClock:
    """Time that passes only when the engine loop sleeps."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.now += seconds
        await asyncio.sleep(0)


@dataclass
class Emulator:
    """An in-process emulator: its API object, engine, clock and an HTTP client."""

    api: EmulatorApi
    engine: Engine
    clock: VirtualClock
    http: httpx.AsyncClient


@asynccontextmanager
async def emulator(tmp_path: Path, engine_config: EngineConfig = EngineConfig(max_loras=2, max_cpu_loras=3),
                   profile: Profile = LARGE_GPU, **api: object) -> AsyncIterator[Emulator]:
    """An emulator app on a virtual clock (runtime LoRA updating on unless ``api`` says otherwise)."""
    clock = VirtualClock()
    engine = Engine(engine_config, profile)
    model = write_model(tmp_path / "model")
    settings: dict[str, object] = {"served_names": ("base",), "model": str(model), "max_model_len": 2048,
                                   "max_lora_rank": 16, "adapter_bytes": profile.default_adapter_bytes,
                                   "runtime_lora_updating": True, "shapes": ModelShapes.from_dir(model), **api}
    emulator_api = EmulatorApi(engine, EngineLoop(engine, clock, clock.sleep), ApiConfig(**settings))  # type: ignore[arg-type]
    runner = asyncio.ensure_future(emulator_api.loop.run())
    transport = httpx.ASGITransport(app=build_app(emulator_api))
    async with httpx.AsyncClient(transport=transport, base_url="http://emulator") as http:
        try:
            yield Emulator(emulator_api, engine, clock, http)
        finally:
            runner.cancel()


@pytest.fixture
def adapters(tmp_path: Path) -> Iterator[dict[str, Path]]:
    """Rank-8 adapters a..f for the tiny model, one of rank 32 and one of a wider model's shapes."""
    dirs = {name: write_adapter(tmp_path / "adapters" / name, 8, seed=i) for i, name in enumerate("abcdef")}
    dirs["rank32"] = write_adapter(tmp_path / "adapters" / "rank32", 32)
    dirs["wide"] = write_adapter(tmp_path / "adapters" / "wide", 8, {**TINY, "hidden_size": 256})
    yield dirs


def digest(path: Path) -> str:
    """The identity an adapter's answers are computed from."""
    return adapter_digest(path)
