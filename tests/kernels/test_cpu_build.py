"""The native cpu backend's build cache, its fallback without a compiler, and which calls it runs natively."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import pytest
import torch

from e2e.fixtures.tools import missing_tool
from loraplane.kernels import (
    BatchPlanner,
    LoraSlots,
    apply_lora,
    cpu_backend,
    expand,
    lora_delta,
    ops,
    shrink,
)
from loraplane.kernels.cpu_backend import CpuBackend, NativeBuildError, build, load
from loraplane.kernels.torch_backend import TorchBackend


@pytest.fixture(autouse=True)
def _compiler() -> None:
    """Skipped without a C compiler, failed in CI (which installs one)."""
    if shutil.which(os.environ.get("CC") or "cc") is None:
        missing_tool("no C compiler: run make setup")


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty kernel cache for the test."""
    directory = tmp_path / "cache"
    monkeypatch.setenv(cpu_backend.CACHE_ENV, str(directory))
    return directory


def test_build_is_cached_under_a_content_key_and_reused(cache: Path, tmp_path: Path, monkeypatch) -> None:
    path = build()
    assert path.parent == cache and path.name.startswith("lora_cpu-") and path.suffix == ".so"
    assert [p.name for p in cache.iterdir()] == [
        path.name
    ]  # the temporary file was renamed, nothing left over
    stamp = path.stat().st_mtime_ns
    assert build() == path and path.stat().st_mtime_ns == stamp  # a second build reuses the cached library
    changed = tmp_path / "lora_cpu.c"
    changed.write_text(cpu_backend.SOURCE.read_text() + "\n/* changed */\n")
    monkeypatch.setattr(cpu_backend, "SOURCE", changed)
    assert build() != path  # another source is another key: a stale library is never picked up


def test_partial_and_corrupt_files_are_never_loaded(cache: Path) -> None:
    path = build()
    leftover = path.with_name(path.name + ".abc123.tmp")  # what a build killed before its rename leaves
    leftover.write_bytes(b"\x7fELF partial")
    path.write_bytes(b"not a shared library")  # damaged after the rename (disk, manual copy)
    library = load()  # the damaged file fails to load, is removed and rebuilt
    assert library.lp_max_width() > 0
    assert path.read_bytes()[:4] == b"\x7fELF" and leftover.read_bytes() == b"\x7fELF partial"


def test_missing_compiler_falls_back_to_torch_with_one_warning(
    cache: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("CC", str(cache / "no-such-cc"))
    with pytest.raises(NativeBuildError, match="not usable"):
        build()
    monkeypatch.setattr(cpu_backend, "_library", cpu_backend._Library())
    monkeypatch.setattr(ops, "_instances", {})
    with caplog.at_level(logging.WARNING, logger=cpu_backend.__name__):
        assert ops.default_backend_name("cpu") == "torch"
        assert not cpu_backend.available()
    assert len(caplog.records) == 1 and "unavailable" in caplog.records[0].getMessage()
    assert ops.select_backend("cpu").name == "torch"
    with pytest.raises(RuntimeError, match="cpu kernels backend is unavailable"):
        ops.get_backend("cpu")


def test_failing_compiler_is_a_build_error(cache: Path, tmp_path: Path) -> None:
    compiler = tmp_path / "broken-cc"
    compiler.write_text(
        "#!/bin/sh\n[ \"$1\" = --version ] && echo broken 1.0 && exit 0\necho 'error: no' >&2\nexit 1\n"
    )
    compiler.chmod(0o755)
    with pytest.raises(NativeBuildError, match="error: no"):
        build(str(compiler))
    assert list(cache.iterdir()) == []  # no temporary file left behind


class _Recording(TorchBackend):
    """The torch backend, counting the calls the cpu backend delegates to it."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def apply(self, *args) -> None:  # type: ignore[no-untyped-def, override]
        self.calls += 1
        super().apply(*args)

    def shrink(self, *args) -> torch.Tensor:  # type: ignore[no-untyped-def, override]
        self.calls += 1
        return super().shrink(*args)

    def expand(self, *args) -> None:  # type: ignore[no-untyped-def, override]
        self.calls += 1
        super().expand(*args)


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"]
)
def test_fp32_runs_natively_and_other_dtypes_delegate(dtype: torch.dtype) -> None:
    backend = CpuBackend()
    backend.torch = recording = _Recording()
    slots = LoraSlots(2, 8, 24, (16, 8), dtype=dtype)
    generator = torch.Generator().manual_seed(0)
    slots.load(1, [torch.randn(8, 24, generator=generator)] * 2, [torch.randn(16, 8), torch.randn(8, 8)], 0.5)
    plan = BatchPlanner(8, 2).plan([1, -1, 1])
    x = torch.randn(3, 24, generator=generator).to(dtype)
    y = torch.zeros(3, 24, dtype=dtype)
    apply_lora(y, x, slots, plan, backend)
    expand(y, shrink(x, slots, plan, backend), slots, plan, backend)
    assert recording.calls == (0 if dtype == torch.float32 else 3)
    reference = torch.zeros(3, 24, dtype=dtype)
    apply_lora(reference, x, slots, plan, TorchBackend())
    tolerance = 1e-5 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(y, 2 * reference, atol=tolerance, rtol=tolerance)
    assert not y[1].any()


def test_threads_share_segments_with_the_same_result() -> None:
    """With several torch threads, enough rows are shared out by segment (each thread writes only its rows)."""
    threads = torch.get_num_threads()
    generator = torch.Generator().manual_seed(1)
    slots = LoraSlots(4, 16, 40, (24, 16))
    for slot, rank in enumerate((16, 8, 12, 4)):
        slots.load(
            slot,
            [torch.randn(rank, 40, generator=generator)] * 2,
            [torch.randn(24, rank), torch.randn(16, rank)],
            1.0,
        )
    token_slots = [slot for slot in (2, 0, 3, 1, 0) for _ in range(70)] + [-1] * 5
    plan = BatchPlanner(400, 4).plan(token_slots)
    x = torch.randn(len(token_slots), 40, generator=generator)
    expected = torch.zeros(len(token_slots), 40)
    apply_lora(expected, x, slots, plan, TorchBackend())
    backend = CpuBackend()
    try:
        for count in (1, 3):
            torch.set_num_threads(count)
            y = torch.zeros(len(token_slots), 40)
            apply_lora(y, x, slots, plan, backend)
            torch.testing.assert_close(y, expected, atol=1e-4, rtol=1e-5)
            t = shrink(x, slots, plan, backend)
            y.zero_()
            expand(y, t, slots, plan, backend)
            torch.testing.assert_close(y, expected, atol=1e-4, rtol=1e-5)
    finally:
        torch.set_num_threads(threads)


def test_only_a_changed_slot_is_repacked() -> None:
    """Loading or clearing one slot repacks that slot alone, and the packed weights follow the store."""
    backend = CpuBackend()
    generator = torch.Generator().manual_seed(3)
    slots = LoraSlots(3, 8, 24, (16,))
    for slot in range(3):
        slots.load(slot, [torch.randn(8, 24, generator=generator)], [torch.randn(16, 8, generator=generator)], 1.0)
    plan = BatchPlanner(8, 3).plan([0, 1, 2])
    x = torch.randn(3, 24, generator=generator)
    lora_delta(x, slots, plan, backend)
    before = backend._layout(slots).packed
    slots.load(1, [torch.randn(4, 24, generator=generator)], [torch.randn(16, 4, generator=generator)], 2.0)
    slots.clear(2)
    delta = lora_delta(x, slots, plan, backend)
    after = backend._layout(slots).packed
    assert after[0] is before[0] and after[1] is not before[1] and after[2] is None
    torch.testing.assert_close(delta, lora_delta(x, slots, plan, TorchBackend()), atol=1e-5, rtol=1e-5)
    assert not delta[2].any()
