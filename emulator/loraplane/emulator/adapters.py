"""Reading adapters as vLLM's worker does, without loading a tensor: their rank, their tensor shapes against the
base model's, and the errors vLLM answers with.

vLLM reads ``adapter_config.json`` (a missing file or directory is "No adapter found", HTTP 404), checks the rank
against ``--max-lora-rank`` and the tensor names against the modules it can apply LoRA to (both before the adapter
enters a cache), then copies every tensor into a GPU slot. That copy is where a tensor wider than the model's
layer fails ("The size of tensor a (64) must match the size of tensor b (256) ...", HTTP 500) -- after the copy
was added to the host cache and given a slot, where it stays. A narrower tensor is copied into the slot's corner
and accepted, as vLLM does.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loraplane.api import ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE, adapter_digest

#: The modules vLLM applies LoRA to in a Llama-style model, in the order it copies them into a slot.
LINEAR_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class AdapterNotFound(Exception):
    """vLLM's ``LoRAAdapterNotFoundError`` (HTTP 404)."""

    def __init__(self, name: str, path: str) -> None:
        super().__init__(f"Loading lora {name} failed: No adapter found for {path}")


class WorkerError(Exception):
    """An error vLLM's worker raises while loading (HTTP 500 ``InternalServerError``, the server stays healthy)."""

    def __init__(self, message: str) -> None:
        super().__init__(f"Call to add_lora method failed: Worker failed with error '{message}', please check the "
                         "stack trace above for the root cause")


@dataclass(frozen=True)
class ModelShapes:
    """(d_in, d_out) of each linear module of the base model, from its ``config.json``."""

    modules: dict[str, tuple[int, int]]

    @classmethod
    def from_dir(cls, model: Path) -> ModelShapes | None:
        """The shapes of a transformers checkpoint directory; None when ``model`` is not one (just a name)."""
        try:
            config = json.loads((model / "config.json").read_text())
            hidden, inter = int(config["hidden_size"]), int(config["intermediate_size"])
            heads = int(config["num_attention_heads"])
            kv_heads = int(config.get("num_key_value_heads") or heads)
            head_dim = int(config.get("head_dim") or hidden // heads)
        except (OSError, ValueError, KeyError, TypeError):
            return None
        q, kv = heads * head_dim, kv_heads * head_dim
        return cls({"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
                    "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)})


@dataclass(frozen=True)
class AdapterFiles:
    """What the emulator needs of an adapter directory."""

    rank: int
    #: content digest (``loraplane.api.adapter_digest``): the identity its answers are computed from
    digest: str
    #: the error vLLM raises copying it into a GPU slot (tensors wider than the model's layers), if any
    slot_error: str | None


def resolve(lora_path: str) -> Path:
    """vLLM's ``get_adapter_absolute_path`` without the Hub: ``~`` expanded, relative to the working directory."""
    return Path(os.path.abspath(os.path.expanduser(lora_path)))


def read_adapter(name: str, lora_path: str, max_lora_rank: int, shapes: ModelShapes | None) -> AdapterFiles:
    """Read and check an adapter as vLLM's worker does; AdapterNotFound or WorkerError as vLLM raises them."""
    path = resolve(lora_path)
    try:
        config = json.loads((path / ADAPTER_CONFIG_FILE).read_text())
    except FileNotFoundError:
        raise AdapterNotFound(name, lora_path) from None
    except (OSError, ValueError) as exc:
        raise WorkerError(str(exc)) from None
    rank = _max_rank(config)
    problems = []
    if rank > max_lora_rank:
        problems.append(f"LoRA rank {rank} is greater than max_lora_rank {max_lora_rank}.")
    if config.get("bias", "none") != "none":
        problems.append("Adapter bias is not supported.")
    if problems:
        raise WorkerError(" ".join(problems))
    weights = path / ADAPTER_WEIGHTS_FILE
    if not weights.is_file():
        raise WorkerError(f"{path} doesn't contain tensors")
    tensors = _safetensors_shapes(weights)
    unexpected = sorted({module for module in map(_module_of, tensors) if module.rsplit(".", 1)[-1]
                         not in LINEAR_MODULES})
    if unexpected:
        raise WorkerError(f"While loading {path}, expected target modules in {sorted(LINEAR_MODULES)} but received "
                          f"{unexpected}. Please verify that the loaded LoRA module is correct")
    return AdapterFiles(rank, adapter_digest(path), _slot_error(tensors, shapes))


def _max_rank(config: dict[str, Any]) -> int:
    pattern = config.get("rank_pattern") or {}
    try:
        return max([int(config.get("r", 8)), *map(int, pattern.values())])
    except (TypeError, ValueError) as exc:
        raise WorkerError(f"invalid rank in {ADAPTER_CONFIG_FILE}: {exc}") from None


def _safetensors_shapes(path: Path) -> dict[str, list[int]]:
    """Tensor name -> shape, from a safetensors file's header (no tensor is read)."""
    try:
        with path.open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
    except (OSError, ValueError, struct.error) as exc:
        raise WorkerError(f"Error while deserializing header: {exc}") from None
    return {name: list(meta["shape"]) for name, meta in header.items() if name != "__metadata__"}


def _module_of(tensor: str) -> str:
    """``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`` -> ``model.layers.0.self_attn.q_proj``."""
    name = tensor.removeprefix("base_model.model.")
    for marker in (".lora_A", ".lora_B", ".lora_embedding_A", ".lora_embedding_B"):
        if marker in name:
            return name[:name.index(marker)]
    return name.rsplit(".", 1)[0]


def _layer_order(tensor: str) -> tuple[int, int, int]:
    module = _module_of(tensor)
    parts = module.split(".")
    layer = next((int(p) for p in parts if p.isdigit()), 0)
    return layer, LINEAR_MODULES.index(parts[-1]), 0 if ".lora_A" in tensor else 1


def _slot_error(tensors: dict[str, list[int]], shapes: ModelShapes | None) -> str | None:
    """The first copy into a slot that fails, as torch words it: ``lora_A`` is (rank, d_in), ``lora_B`` (d_out,
    rank); a dimension wider than the model's does not fit the slot's slice."""
    if shapes is None:
        return None
    for tensor in sorted((t for t in tensors if ".lora_A" in t or ".lora_B" in t), key=_layer_order):
        d_in, d_out = shapes.modules[_module_of(tensor).rsplit(".", 1)[-1]]
        shape = tensors[tensor]
        if len(shape) != 2:
            return f"expected a 2-D tensor for {tensor}, got shape {shape}"
        dim, limit, got = (1, d_in, shape[1]) if ".lora_A" in tensor else (0, d_out, shape[0])
        if got > limit:
            return f"The size of tensor a ({limit}) must match the size of tensor b ({got}) at non-singleton dimension {dim}"
    return None
