"""The backends every parametrised kernel test runs on (CPU-runnable forms of each)."""

from __future__ import annotations

from loraplane.kernels import Backend, get_backend

BACKENDS = ["torch"]


def backend_instance(name: str) -> Backend:
    """The backend called ``name``, in the form that runs on this machine's CPU."""
    return get_backend(name)
