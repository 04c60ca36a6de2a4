"""The PEFT files a runtime loads for an adapter, and the digest that names exactly those bytes.

The engine reports this digest for every loaded adapter and stamps it on every response; a sidecar or controller
that computes it over the same directory gets the same value, so "the bytes we verified" and "the bytes that
answered" can be compared.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

#: The adapter's configuration (``r``, ``lora_alpha``, ``target_modules`` ...).
ADAPTER_CONFIG_FILE = "adapter_config.json"
#: The adapter's weights (``...lora_A.weight`` / ``...lora_B.weight`` tensors).
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
#: Every file that determines the loaded weights, in digest order. Other files in the directory (README ...) do not count.
ADAPTER_FILES: tuple[str, ...] = (ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE)

_DIGEST_DOMAIN = b"loraplane-adapter-digest/1\n"


def adapter_digest_of(file_sha256: dict[str, str]) -> str:
    """The adapter digest from the hex sha256 of each file in :data:`ADAPTER_FILES`.

    ``sha256( "loraplane-adapter-digest/1\\n" + for each file in ADAPTER_FILES order: "<name>\\n<hex sha256>\\n" )``.
    """
    h = hashlib.sha256(_DIGEST_DOMAIN)
    for name in ADAPTER_FILES:
        h.update(f"{name}\n{file_sha256[name]}\n".encode())
    return "sha256:" + h.hexdigest()


def adapter_digest(adapter_dir: Path) -> str:
    """The adapter digest of a PEFT directory (reads both files)."""
    return adapter_digest_of({name: hashlib.sha256((adapter_dir / name).read_bytes()).hexdigest() for name in ADAPTER_FILES})
