"""Engine test fixtures: generated adapters and engine subprocesses stopped after each test."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

from loraplane.engine.make_adapters import write_adapter
from loraplane.engine.model import PRESETS
from tests.engine.helpers import EngineProcess, GeneratedAdapter


@pytest.fixture(scope="session")
def adapter_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory the engines may load adapters from."""
    return tmp_path_factory.mktemp("adapters")


@pytest.fixture(scope="session")
def tiny_adapters(adapter_root: Path) -> list[GeneratedAdapter]:
    """Twenty real PEFT adapters for the ``tiny`` preset (ranks 8 and 16, all seven projections)."""
    adapters = []
    for i in range(20):
        name = f"tenant-{i:02d}@v1"
        path = adapter_root / f"tenant-{i:02d}"
        adapters.append(GeneratedAdapter(name, path, write_adapter(path, PRESETS["tiny"], (8, 16)[i % 2], seed=i)))
    return adapters


@pytest.fixture
def start_engine(tmp_path: Path) -> Iterator[Callable[[Sequence[str]], EngineProcess]]:
    """Starts engine subprocesses with the given flags; every one is stopped after the test."""
    started: list[EngineProcess] = []

    def start(args: Sequence[str]) -> EngineProcess:
        proc = EngineProcess(args, tmp_path)
        started.append(proc)
        return proc.start()

    yield start
    for proc in started:
        proc.stop()
