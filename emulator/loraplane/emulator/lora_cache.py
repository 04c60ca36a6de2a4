"""vLLM's worker LoRA caches (``LRUCacheWorkerLoRAManager`` over ``LRUCacheLoRAModelManager``), with the load costs
of a simulator profile.

Two LRU caches keyed by the LoRA int id: ``max_cpu_loras`` host copies and ``max_loras`` GPU slots. Bringing an
adapter in (a ``/v1/load_lora_adapter`` call, or a step serving it) reads it from disk when it has no host copy
(the least recently used copy goes first, and leaves its slot with it), touches the host copy otherwise, then
activates it: into the first free slot, after pushing out the least recently used active adapter when every slot
is taken. Debug log lines are vLLM's ("Adding lora. Model id: N, int id: N" on a read from disk, "Activating
LoRA. int id: N, slot index: S" on activation).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

from loraplane.api import Tier
from loraplane.emulator.adapters import AdapterFiles
from loraplane.sim.profile import Profile

log = logging.getLogger("loraplane.emulator.worker")


@dataclass(eq=False)
class Lora:
    """An adapter as vLLM's requests carry it (its ``LoRARequest``): served name, int id, files and load size."""

    name: str
    int_id: int
    path: str
    files: AdapterFiles
    #: bytes a load moves (``--adapter-bytes`` x rank / 16): what the profile charges for it
    nbytes: int
    #: vLLM 0.32 keeps ``load_inplace`` on the stored request: every step serving it reads it from disk again
    load_inplace: bool = False


@dataclass(frozen=True)
class LoadCost:
    """One adapter brought into a GPU slot: the milliseconds it stalls the engine and the tier it came from."""

    ms: float
    tier: Tier


class WorkerLoraCache:
    """The host cache and the GPU slots of one worker."""

    def __init__(self, max_loras: int, max_cpu_loras: int, profile: Profile) -> None:
        self.max_loras = max_loras
        self.max_cpu_loras = max_cpu_loras
        self.profile = profile
        #: int id -> adapter, least recently used first
        self.host: OrderedDict[int, Lora] = OrderedDict()
        #: int id -> slot index, least recently used first
        self.active: OrderedDict[int, int] = OrderedDict()
        self.slots: list[int | None] = [None] * max_loras

    def bring_in(self, lora: Lora) -> LoadCost | None:
        """Make ``lora`` active (reading it from disk if it has no host copy) and most recently used in both
        caches; the load it took, None when it was active already."""
        tier = Tier.GPU
        if lora.int_id not in self.host or lora.load_inplace:
            log.debug("Adding lora. Model id: %d, int id: %d", lora.int_id, lora.int_id)
            self._drop(lora.int_id)
            if len(self.host) + 1 > self.max_cpu_loras:
                self._drop(next(iter(self.host)))
            self.host[lora.int_id] = lora
            tier = Tier.DISK
        else:
            self.host.move_to_end(lora.int_id)
        if lora.int_id in self.active:
            self.active.move_to_end(lora.int_id)
        else:
            if len(self.active) >= self.max_loras:
                self._deactivate(next(iter(self.active)))
            slot = self.slots.index(None)
            log.debug("Activating LoRA. int id: %d, slot index: %d", lora.int_id, slot)
            self.active[lora.int_id] = slot
            self.slots[slot] = lora.int_id
            tier = Tier.DISK if tier is Tier.DISK else Tier.CPU
        if tier is Tier.GPU:
            return None
        return LoadCost(self.profile.load_ms(tier, lora.nbytes), tier)

    def tier(self, int_id: int) -> Tier:
        """Where the copy of ``int_id`` is: a GPU slot, host memory, or neither (disk)."""
        return Tier.GPU if int_id in self.active else Tier.CPU if int_id in self.host else Tier.DISK

    def _deactivate(self, int_id: int) -> None:
        slot = self.active.pop(int_id, None)
        if slot is not None:
            self.slots[slot] = None

    def _drop(self, int_id: int) -> None:
        self._deactivate(int_id)
        self.host.pop(int_id, None)
