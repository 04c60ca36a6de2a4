"""Reading adapter files: path confinement, one read per file, digests that follow every change, safetensors views."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors.torch import load as reference_load

from loraplane.api import ADAPTER_WEIGHTS_FILE, adapter_digest
from loraplane.engine.adapters import (
    READ_CHUNK_BYTES,
    AdapterFiles,
    AdapterNotFoundError,
    AdapterRejectedError,
    FileDigests,
    HostBuffers,
    ParsedAdapters,
    confine,
    parse_adapter,
    read_parallel,
    safetensors_views,
)
from loraplane.engine.app import EngineOptions
from loraplane.engine.make_adapters import write_adapter
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


@pytest.mark.parametrize("size", [READ_CHUNK_BYTES - 1, 3 * READ_CHUNK_BYTES + 4097])
def test_a_file_read_by_several_threads_is_the_file(tmp_path: Path, size: int) -> None:
    path = tmp_path / "weights"
    path.write_bytes(os.urandom(size))
    digests = FileDigests(read_threads=3)
    for buffers in (None, HostBuffers(capacity=2)):
        data, digest = digests.read(path, buffers)
        assert data.numpy().tobytes() == path.read_bytes()
        assert digest == hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_file_shorter_than_its_parts_is_reported_not_returned(tmp_path: Path) -> None:
    size = 3 * READ_CHUNK_BYTES
    path = tmp_path / "short"
    path.write_bytes(os.urandom(size - READ_CHUNK_BYTES // 2))  # the last part ends early
    view = memoryview(bytearray(size))
    with ThreadPoolExecutor(2) as readers, path.open("rb") as f:
        assert not read_parallel(f.fileno(), view, size, readers, 2)
        assert read_parallel(f.fileno(), view, size - READ_CHUNK_BYTES // 2, readers, 2)
    assert bytes(view[: size - READ_CHUNK_BYTES // 2]) == path.read_bytes()


def test_read_threads_must_be_positive() -> None:
    with pytest.raises(ValueError, match="read_threads"):
        FileDigests(read_threads=0)


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


def test_host_buffers_hand_out_only_memory_no_tensor_views_and_stay_bounded() -> None:
    buffers = HostBuffers(capacity=2)
    first = buffers.take(3 << 20).fill_(1)
    kept, first_ptr = first[100:200], first.data_ptr()
    del first
    second = buffers.take(3 << 20).fill_(2)  # ``kept`` still views the first buffer: new memory
    assert second.data_ptr() != first_ptr and bool((kept == 1).all())
    second_ptr = second.data_ptr()
    del second
    assert buffers.take(3 << 20).data_ptr() == second_ptr  # free again: reused, nothing new
    assert buffers.held_bytes == 2 * (4 << 20)  # two buffers, rounded up to whole 2 MiB pages
    in_use = [buffers.take(3 << 20) for _ in range(2)]  # beyond the capacity: handed out, not kept
    assert buffers.held_bytes == 2 * (4 << 20) and all(bool((t.fill_(3) == 3).all()) for t in in_use)
    del kept, in_use
    larger = buffers.take(5 << 20)  # no free buffer fits: the oldest free one makes room
    assert buffers.held_bytes == (4 << 20) + (6 << 20) and larger.numel() == 5 << 20
    assert buffers.take(1000).numel() == 1000  # small files: the ordinary allocator
    assert buffers.held_bytes == (4 << 20) + (6 << 20)


async def test_loads_reuse_the_memory_of_unloaded_adapters_and_never_memory_still_viewed(tmp_path: Path) -> None:
    config = PRESETS["small"]  # rank 64: 4.7 MB, pooled
    paths = {name: tmp_path / name for name in ("a", "b")}
    for seed, path in enumerate(paths.values()):
        write_adapter(path, config, 64, seed=seed)
    expected = {name: reference_load((path / ADAPTER_WEIGHTS_FILE).read_bytes()) for name, path in paths.items()}
    options = EngineOptions(model="small", max_lora_rank=64, max_loras=1, max_cpu_loras=2)
    async with inprocess(options) as (built, _http):
        engine = built.engine

        def matches(served: str, name: str) -> bool:
            weights = engine.tiers.registered[served].weights
            assert weights is not None
            return all(torch.equal(m.lora_a, expected[name][f"base_model.model.{module}.lora_A.weight"])
                       and torch.equal(m.lora_b, expected[name][f"base_model.model.{module}.lora_B.weight"])
                       for module, m in weights.modules.items())

        await engine.add_adapter("a@v1", paths["a"])
        await engine.add_adapter("b@v1", paths["b"])
        held = engine.host_buffers.held_bytes
        await engine.remove_adapter("a@v1")
        await engine.add_adapter("a@v2", paths["a"])
        assert engine.host_buffers.held_bytes == held  # a@v1's buffer, reused
        assert matches("a@v2", "a") and matches("b@v1", "b")

        module, weights = next(iter(engine.tiers.registered["a@v2"].weights.modules.items()))  # type: ignore[union-attr]
        still_viewed = weights.lora_a
        del weights
        await engine.remove_adapter("a@v2")
        await engine.add_adapter("b@v2", paths["b"])  # must not overwrite what ``still_viewed`` shows
        assert engine.host_buffers.held_bytes > held
        assert torch.equal(still_viewed, expected["a"][f"base_model.model.{module}.lora_A.weight"])
        assert matches("b@v2", "b") and matches("b@v1", "b")


def test_a_read_back_rebuilds_an_accepted_parse_as_views_of_the_new_bytes(tiny_adapters: list[GeneratedAdapter]) -> None:
    config, parsed, path = PRESETS["tiny"], ParsedAdapters(), tiny_adapters[1].path  # rank 16
    refused = AdapterFiles.read(path)
    with pytest.raises(AdapterRejectedError, match="max_lora_rank"):
        parse_adapter(refused, config, 8, parsed)
    assert parsed.get(refused) is None  # a refusal is not remembered: checked again on every read
    first = parse_adapter(refused, config, 16, parsed)
    again_files = AdapterFiles.read(path)
    again = parsed.get(again_files)
    assert again is not None and again.config == first.config and again.modules.keys() == first.modules.keys()
    storage = again_files.weights.untyped_storage().data_ptr()
    for name, module in again.modules.items():
        assert module.scale == first.modules[name].scale
        for mine, theirs in ((module.lora_a, first.modules[name].lora_a), (module.lora_b, first.modules[name].lora_b)):
            assert torch.equal(mine, theirs) and mine.untyped_storage().data_ptr() == storage  # views of the new read
    other = AdapterFiles.read(tiny_adapters[3].path)
    assert parsed.get(other) is None  # other bytes, other digest


def test_a_read_back_into_a_buffer_at_another_offset_is_rebuilt_there_or_parsed_afresh(
    tiny_adapters: list[GeneratedAdapter],
) -> None:
    config, parsed = PRESETS["tiny"], ParsedAdapters()
    files = AdapterFiles.read(tiny_adapters[0].path)
    first = parse_adapter(files, config, 16, parsed)
    size = files.weights.numel()
    for shift in (8, 1):
        memory = torch.zeros(size + shift, dtype=torch.uint8)
        memory[shift:] = files.weights
        moved = AdapterFiles(files.config, memory[shift:], files.digest)
        again = parsed.get(moved)
        if shift == 1:  # not aligned the way the remembered parse was: the caller parses afresh
            assert again is None
            continue
        assert again is not None
        for name, module in again.modules.items():
            assert torch.equal(module.lora_a, first.modules[name].lora_a)
            assert torch.equal(module.lora_b, first.modules[name].lora_b)
            assert module.lora_a.untyped_storage().data_ptr() == memory.untyped_storage().data_ptr()


@pytest.mark.parametrize("shape", ["absolute", "dot-dot", "link"])
def test_outside_paths_get_one_answer_whether_they_exist_or_not(tmp_path: Path, shape: str) -> None:
    """An outside path never reveals whether it exists: the same error and status for both."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    (outside / "real").mkdir(parents=True)
    (root / "link-real").symlink_to(outside / "real")
    (root / "link-missing").symlink_to(outside / "missing")
    requested = {
        "absolute": (str(outside / "real"), str(outside / "missing")),
        "dot-dot": ("../outside/real", "../outside/missing"),
        "link": ("link-real", "link-missing"),
    }[shape]
    answers = []
    for path in requested:
        with pytest.raises((AdapterRejectedError, AdapterNotFoundError)) as err:
            confine(root, path)
        answers.append((type(err.value), str(err.value).replace(path, "<path>")))
    assert answers[0] == answers[1] == (AdapterRejectedError, "lora_path '<path>' is outside the adapter root")
