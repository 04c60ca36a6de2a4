"""Build real PEFT LoRA artifacts (safetensors + adapter_config.json) and the targets that name them."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from loraplane.api import AdapterTarget, Artifact, LoraSpec, Tier, cache_key, served_name

BASE_DIGEST = "sha256:" + "b" * 64
MODULES = ("q_proj", "v_proj")


def write_weights(path: Path, rank: int = 8, hidden: int = 32, layers: int = 2, seed: int = 0,
                  dtype: str = "float16", modules: tuple[str, ...] = MODULES) -> Path:
    """A PEFT ``adapter_model.safetensors`` with lora_A/lora_B for ``modules`` in ``layers`` layers."""
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(layers):
        for module in modules:
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = rng.standard_normal((rank, hidden)).astype(dtype)
            tensors[f"{prefix}.lora_B.weight"] = rng.standard_normal((hidden, rank)).astype(dtype)
    save_file(tensors, str(path))
    return path


def write_peft_dir(directory: Path, rank: int = 8, seed: int = 0, dtype: str = "float16",
                   modules: tuple[str, ...] = MODULES, hidden: int = 32) -> Path:
    """A complete PEFT adapter directory."""
    directory.mkdir(parents=True, exist_ok=True)
    write_weights(directory / "adapter_model.safetensors", rank=rank, seed=seed, dtype=dtype, modules=modules,
                  hidden=hidden)
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(modules)}
    (directory / "adapter_config.json").write_text(json.dumps(config))
    return directory


def tar_dir(directory: Path, archive: Path, arcname: str = "adapter") -> Path:
    """A tar.gz of ``directory`` under ``arcname/``."""
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(directory, arcname=arcname)
    return archive


def tar_with_member(archive: Path, name: str, data: bytes = b"x", symlink_to: str | None = None) -> Path:
    """A tar holding one crafted member (for refusal tests)."""
    with tarfile.open(archive, "w") as tar:
        info = tarfile.TarInfo(name)
        if symlink_to is not None:
            info.type, info.linkname = tarfile.SYMTYPE, symlink_to
            tar.addfile(info)
        else:
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return archive


def sha256_of(path: Path) -> str:
    """``sha256:<hex>`` of a file."""
    return "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()


def target_for(uri: str, digest: str, adapter: str = "support", revision: str = "v1", tier: Tier = Tier.GPU,
               rank: int = 8, dtype: str = "float16", pinned: bool = False, size: int | None = None,
               tenant: str = "default", modules: tuple[str, ...] = MODULES) -> AdapterTarget:
    """The AdapterTarget a controller would write for this artifact."""
    return AdapterTarget(
        served_name=served_name(adapter, revision),
        adapter=adapter,
        revision=revision,
        tier=tier,
        pinned=pinned,
        artifact=Artifact(uri=uri, digest=digest, size_bytes=size),
        lora=LoraSpec(rank=rank, alpha=2 * rank, dtype=dtype, target_modules=list(modules)),
        base_model_digest=BASE_DIGEST,
        cache_key=cache_key(BASE_DIGEST, adapter, revision, digest),
        tenant=tenant,
    )


class _Zeros(io.RawIOBase):
    """``size`` zero bytes, read without holding them."""

    def __init__(self, size: int) -> None:
        self.left = size

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:  # type: ignore[no-untyped-def]
        n = min(len(buffer), self.left)
        buffer[:n] = bytes(n)
        self.left -= n
        return n


def zero_bomb(archive: Path, total_bytes: int, members: int = 1) -> Path:
    """A gzip tar of ``members`` files of zeros, ``total_bytes`` in all (about 1 MiB per GiB packed)."""
    with tarfile.open(archive, "w:gz", compresslevel=9) as tar:
        for i in range(members):
            info = tarfile.TarInfo(f"adapter/zeros-{i}.bin")
            info.size = total_bytes // members
            tar.addfile(info, io.BufferedReader(_Zeros(info.size), 1 << 20))
    return archive
