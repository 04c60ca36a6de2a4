"""The backends every parametrised kernel test runs on, in the form that runs on this machine."""

from __future__ import annotations

import torch

from e2e.fixtures.tools import missing_tool
from loraplane.kernels import Backend, cpu_backend, get_backend

from .ascend_ops import AscendTestBackend

BACKENDS = ["cpu", "torch", "triton", "ascend"]


def backend_device(name: str) -> torch.device:
    """Where the backend's tensors live here: Triton on CUDA when present, else interpreted on CPU."""
    if name == "triton" and torch.cuda.is_available():
        return torch.device("cuda")
    return torch.device("cpu")


def backend_instance(name: str) -> Backend:
    """The backend called ``name``; ``ascend`` calls the test-registered ops with vLLM-Ascend's schemas.

    On CPU, Triton runs with 16-wide K/N blocks so the tiny test shapes still loop over K, N tiles and N splits.
    ``cpu`` is skipped where no C compiler builds it, and fails in CI (which installs one).
    """
    if name == "cpu" and not cpu_backend.available():
        missing_tool("the native cpu backend is unavailable here (no C compiler): run make setup")
    if name == "ascend":
        return AscendTestBackend()
    if name == "triton" and not torch.cuda.is_available():
        from loraplane.kernels.triton_backend import TritonBackend

        return TritonBackend(block_k=16, block_n=16, target_programs=8)
    return get_backend(name)
