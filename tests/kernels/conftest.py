"""Kernel tests run the Triton kernels through the interpreter on machines without CUDA.

Triton chooses interpreter or compiler when a kernel is decorated, so this must be set before
``loraplane.kernels.triton_backend`` is first imported.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
