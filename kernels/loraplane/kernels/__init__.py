"""Multi-LoRA ops (shrink/expand, SGMV/BGMV, fused delta), host-side batch planning and backends.

See docs/kernels.md for the contract and the API the engine uses.
"""

from loraplane.kernels.ops import (
    BACKEND_ENV,
    Backend,
    apply_lora,
    expand,
    get_backend,
    lora_delta,
    select_backend,
    shrink,
)
from loraplane.kernels.plan import BatchPlan, BatchPlanner, DecodeGroups, Segment
from loraplane.kernels.slots import LoraSlots, lora_scale

__all__ = [
    "BACKEND_ENV",
    "Backend",
    "BatchPlan",
    "BatchPlanner",
    "DecodeGroups",
    "LoraSlots",
    "Segment",
    "apply_lora",
    "expand",
    "get_backend",
    "lora_delta",
    "lora_scale",
    "select_backend",
    "shrink",
]
