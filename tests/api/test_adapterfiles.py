"""The adapter digest names exactly the files a runtime loads."""

from __future__ import annotations

import hashlib
from pathlib import Path

from loraplane.api import ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE, adapter_digest


def _write(d: Path, config: bytes, weights: bytes) -> Path:
    d.mkdir()
    (d / ADAPTER_CONFIG_FILE).write_bytes(config)
    (d / ADAPTER_WEIGHTS_FILE).write_bytes(weights)
    return d


def test_digest_follows_the_documented_formula(tmp_path: Path) -> None:
    config = b'{"r": 8}'
    d = _write(tmp_path / "a", config, b"weights")
    material = (
        b"loraplane-adapter-digest/1\n"
        + f"{ADAPTER_CONFIG_FILE}\n{hashlib.sha256(config).hexdigest()}\n".encode()
        + f"{ADAPTER_WEIGHTS_FILE}\n{hashlib.sha256(b'weights').hexdigest()}\n".encode()
    )
    assert adapter_digest(d) == "sha256:" + hashlib.sha256(material).hexdigest()


def test_digest_changes_with_either_file_and_ignores_others(tmp_path: Path) -> None:
    base = adapter_digest(_write(tmp_path / "a", b"{}", b"w"))
    assert adapter_digest(_write(tmp_path / "b", b"{ }", b"w")) != base
    assert adapter_digest(_write(tmp_path / "c", b"{}", b"w2")) != base
    extra = _write(tmp_path / "d", b"{}", b"w")
    (extra / "README.md").write_text("notes")
    assert adapter_digest(extra) == base
