"""Root conftest: registers the shared fixtures and skips gpu/npu tests without the device."""

from __future__ import annotations

import os

import pytest

# Triton picks interpreter or compiler when a kernel is decorated, so without CUDA the interpreter must be chosen
# before any test module imports loraplane.kernels (the engine, sidecar and sim tests import it too).
if not os.environ.get("TRITON_INTERPRET"):
    try:
        import torch

        if not torch.cuda.is_available():
            os.environ["TRITON_INTERPRET"] = "1"
    except ImportError:
        pass

pytest_plugins = ["e2e.fixtures.plugin"]


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def _has_npu() -> bool:
    try:
        import torch_npu  # type: ignore[import-not-found]  # noqa: F401
    except ImportError:
        return False
    return True


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip ``gpu`` / ``npu`` tests on machines without that accelerator."""
    have = {"gpu": None, "npu": None}
    for item in items:
        for marker in ("gpu", "npu"):
            if marker in item.keywords:
                if have[marker] is None:
                    have[marker] = _has_cuda() if marker == "gpu" else _has_npu()
                if not have[marker]:
                    item.add_marker(pytest.mark.skip(reason=f"needs a {marker.upper()}"))
