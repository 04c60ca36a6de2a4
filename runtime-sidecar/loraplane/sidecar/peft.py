"""Read what a PEFT LoRA directory holds (config and tensor headers) without loading any weights."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

from loraplane.api import ADAPTER_CONFIG_FILE as CONFIG_FILE
from loraplane.api import ADAPTER_WEIGHTS_FILE as WEIGHTS_FILE

#: safetensors dtype names -> the names ``LoraSpec.dtype`` uses.
SAFETENSORS_DTYPES = {"F16": "float16", "BF16": "bfloat16", "F32": "float32"}

_MAX_HEADER_BYTES = 100 << 20


class InvalidAdapter(ValueError):
    """The files are not a readable PEFT LoRA adapter."""


@dataclass(frozen=True)
class PeftInfo:
    """What the adapter's own files say about it."""

    rank: int
    alpha: float
    target_modules: frozenset[str]
    dtypes: frozenset[str]
    tensor_count: int
    max_tensor_rank: int


def safetensors_header(path: Path) -> dict[str, dict[str, object]]:
    """The tensor table of a safetensors file (``__metadata__`` left out); InvalidAdapter when malformed."""
    with path.open("rb") as f:
        raw_len = f.read(8)
        if len(raw_len) != 8:
            raise InvalidAdapter(f"{path.name} is too short to be a safetensors file")
        (length,) = struct.unpack("<Q", raw_len)
        if not 2 <= length <= _MAX_HEADER_BYTES:
            raise InvalidAdapter(f"{path.name} has an implausible safetensors header length {length}")
        raw = f.read(length)
    try:
        header = json.loads(raw)
    except ValueError as exc:
        raise InvalidAdapter(f"{path.name}: safetensors header is not JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise InvalidAdapter(f"{path.name}: safetensors header is not an object")
    header.pop("__metadata__", None)
    return header


def looks_like_safetensors(path: Path) -> bool:
    """True when the file starts like a safetensors file (length prefix, then a JSON object)."""
    with path.open("rb") as f:
        head = f.read(9)
    if len(head) < 9:
        return False
    (length,) = struct.unpack("<Q", head[:8])
    return 2 <= length <= _MAX_HEADER_BYTES and head[8:9] == b"{"


def _config_modules(value: object) -> frozenset[str]:
    if isinstance(value, str):
        return frozenset({value})
    if isinstance(value, list) and all(isinstance(m, str) for m in value):
        return frozenset(value)
    raise InvalidAdapter(f"{CONFIG_FILE}: target_modules must be a list of names")


def inspect(directory: Path) -> PeftInfo:
    """Read ``adapter_config.json`` and the safetensors header of a PEFT directory."""
    config_path, weights_path = directory / CONFIG_FILE, directory / WEIGHTS_FILE
    if not config_path.is_file() or not weights_path.is_file():
        raise InvalidAdapter(f"a PEFT adapter needs {CONFIG_FILE} and {WEIGHTS_FILE}")
    try:
        config = json.loads(config_path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidAdapter(f"{CONFIG_FILE} is not JSON: {exc}") from exc
    if not isinstance(config, dict) or config.get("peft_type", "LORA") != "LORA":
        raise InvalidAdapter(f"{CONFIG_FILE} does not describe a LoRA adapter")
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, int | float):
        raise InvalidAdapter(f"{CONFIG_FILE}: r must be a positive integer and lora_alpha a number")
    tensors = safetensors_header(weights_path)
    dtypes, max_rank = set(), 0
    for name, meta in tensors.items():
        dtype, shape = meta.get("dtype"), meta.get("shape")
        if not isinstance(shape, list) or len(shape) != 2:
            raise InvalidAdapter(f"{WEIGHTS_FILE}: tensor {name!r} is not a matrix")
        dtypes.add(SAFETENSORS_DTYPES.get(str(dtype), str(dtype)))
        if "lora_A" in name:
            max_rank = max(max_rank, int(shape[0]))
    if not tensors:
        raise InvalidAdapter(f"{WEIGHTS_FILE} holds no tensors")
    return PeftInfo(
        rank=rank,
        alpha=float(alpha),
        target_modules=_config_modules(config.get("target_modules")),
        dtypes=frozenset(dtypes),
        tensor_count=len(tensors),
        max_tensor_rank=max_rank,
    )
