"""Reading adapter files: one read per file, digests that follow every change, safetensors parsed as views."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load as reference_load

from loraplane.api import ADAPTER_WEIGHTS_FILE, adapter_digest
from loraplane.engine.adapters import AdapterFiles, FileDigests, safetensors_views
from loraplane.engine.app import EngineOptions
from loraplane.engine.model import PRESETS, LlamaModel, seeded_weights, single_intra_op_thread
from loraplane.kernels.peft import AdapterFormatError
from tests.engine.helpers import GeneratedAdapter, inprocess


def _rewrite_in_place(path: Path) -> None:
    """Change one byte of the file's last tensor, keeping its size and its modification time."""
    stat = path.stat()
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    with path.open("r+b") as f:
        f.write(data)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def test_digests_follow_the_bytes_even_when_size_and_mtime_are_restored(tmp_path: Path,
                                                                        tiny_adapters: list[GeneratedAdapter]) -> None:
    adapter = tmp_path / "a"
    shutil.copytree(tiny_adapters[0].path, adapter)
    digests = FileDigests()
    first = AdapterFiles.read(adapter, digests)
    assert first.digest == adapter_digest(adapter) == AdapterFiles.read(adapter, digests).digest
    _rewrite_in_place(adapter / ADAPTER_WEIGHTS_FILE)
    changed = AdapterFiles.read(adapter, digests)
    assert changed.digest == adapter_digest(adapter) != first.digest
    assert changed.weights.numpy().tobytes() == (adapter / ADAPTER_WEIGHTS_FILE).read_bytes()


async def test_an_adapter_changed_on_disk_is_not_read_back_after_eviction(
    tmp_path: Path, tiny_adapters: list[GeneratedAdapter],
) -> None:
    adapter_dir = tmp_path / "changing"
    shutil.copytree(tiny_adapters[1].path, adapter_dir)
    async with inprocess(EngineOptions(lora_modules={"changing@v1": adapter_dir})) as (built, _http):
        engine = built.engine
        adapter = engine.tiers.registered["changing@v1"]
        async with engine.lock:
            engine.tiers.drop_host(adapter)
        assert await engine.activate(adapter)  # unchanged: read back and activated
        async with engine.lock:
            engine.tiers.drop_host(adapter)
        _rewrite_in_place(adapter_dir / ADAPTER_WEIGHTS_FILE)
        assert not await engine.activate(adapter)
        assert adapter.weights is None and adapter.digest == tiny_adapters[1].digest


def test_safetensors_views_match_the_reference_reader(tiny_adapters: list[GeneratedAdapter]) -> None:
    raw = (tiny_adapters[0].path / ADAPTER_WEIGHTS_FILE).read_bytes()
    data = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    views = safetensors_views(data)
    expected = reference_load(raw)
    assert views.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(views[name], tensor)
        assert views[name].untyped_storage().data_ptr() == data.untyped_storage().data_ptr()  # a view, no copy


def _file(header: object, payload: bytes = b"", pad_to: int = 0) -> torch.Tensor:
    encoded = json.dumps(header).encode()
    encoded += b" " * ((pad_to - 8 - len(encoded)) % 8 if pad_to else 0)
    return torch.frombuffer(bytearray(struct.pack("<Q", len(encoded)) + encoded + payload), dtype=torch.uint8)


@pytest.mark.parametrize(("data", "reason"), [
    (torch.zeros(4, dtype=torch.uint8), "too short"),
    (torch.frombuffer(bytearray(struct.pack("<Q", 1 << 40)), dtype=torch.uint8), "exceeds the file"),
    (_file([]), "not a JSON object"),
    (_file({"t": {"dtype": "I32", "shape": [1], "data_offsets": [0, 4]}}, bytes(4)), "unsupported dtype"),
    (_file({"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, bytes(4)), "do not hold"),
    (_file({"t": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}), "do not hold"),
])
def test_malformed_safetensors_say_why(data: torch.Tensor, reason: str) -> None:
    with pytest.raises(AdapterFormatError, match=reason):
        safetensors_views(data)


def test_a_tensor_at_an_unaligned_offset_is_copied_out() -> None:
    header = {"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}
    data = _file(header, struct.pack("<2f", 1.5, -2.0), pad_to=8 * 9 + 1)  # data starts at an odd byte
    assert torch.equal(safetensors_views(data)["t"], torch.tensor([1.5, -2.0]))


def test_slot_copies_run_on_one_thread_and_restore_the_count() -> None:
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        config = PRESETS["tiny"]
        model = LlamaModel(config, seeded_weights(config, 0), max_loras=1, max_lora_rank=8)
        with single_intra_op_thread():
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == model.compute_threads == 2
    finally:
        torch.set_num_threads(before)
