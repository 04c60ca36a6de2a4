"""Runtime drivers behind one interface (``RuntimeDriver``) with declared capabilities."""

from __future__ import annotations

from loraplane.sidecar.drivers.base import RuntimeDriver, RuntimeInfo
from loraplane.sidecar.drivers.engine import EngineDriver
from loraplane.sidecar.drivers.vllm import VllmApiDriver, VllmDriver

DRIVERS: dict[str, type[VllmApiDriver]] = {"engine": EngineDriver, "vllm": VllmDriver, "vllm-ascend": VllmDriver}


def make_driver(kind: str, base_url: str, limits: RuntimeInfo, token: str | None = None) -> RuntimeDriver:
    """The driver for ``kind`` (engine, vllm, vllm-ascend) talking to ``base_url``."""
    try:
        cls = DRIVERS[kind]
    except KeyError:
        raise ValueError(f"unknown runtime {kind!r}; use one of {', '.join(DRIVERS)}") from None
    return cls(base_url, limits, token=token)
