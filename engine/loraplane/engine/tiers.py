"""Adapter tiers: ``max_loras`` device slots (L0), a ``max_cpu_loras`` host cache (L1) and local disk (L2).

The same meanings as vLLM: an adapter in a slot is also in the host cache; dropping it from the host cache also
frees its slot; a registered adapter that is in neither is read from disk again when a request needs it.
Activation is a real copy of the host weights into every layer's slot tensors. Eviction picks victims with a
pluggable :class:`~loraplane.engine.policies.EvictionPolicy` and never touches an adapter that is pinned or has
requests in flight. Every method runs on the engine's event loop under its lock (no slot changes during a step).
"""

from __future__ import annotations

import ctypes
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from loraplane.api import AdapterResidency, Tier
from loraplane.engine.model import LlamaModel
from loraplane.engine.policies import EvictionPolicy
from loraplane.kernels.peft import PeftAdapter


def _load_libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL("libc.so.6")
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:  # not glibc
        return None


_LIBC = _load_libc() if sys.platform.startswith("linux") else None


def return_freed_memory() -> None:
    """Hand freed heap pages back to the OS (glibc ``malloc_trim``) so RSS falls after an unload.

    Adapter tensors are small enough to live on the malloc heap, which glibc otherwise keeps: measured, RSS did
    not fall at all after unloading 18 MiB of adapters, and fell back to the pre-load figure with the trim.
    """
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


@dataclass(eq=False)
class AdapterState:
    """One loaded adapter revision and its counters (identity = object, so a reload under the same name is new)."""

    name: str
    path: Path
    digest: str
    disk_bytes: int
    weights: PeftAdapter | None = None
    slot: int | None = None
    pinned: bool = False
    priority: int = 0
    in_flight: int = 0
    hits: int = 0
    loads: int = 0
    evictions: int = 0
    last_access: float | None = None
    tier_since: float = 0.0
    load_seconds: float = 0.0
    registered: bool = True
    nbytes: int = field(default=0)

    @property
    def tier(self) -> Tier:
        """Where the weights are now."""
        if self.slot is not None:
            return Tier.GPU
        return Tier.CPU if self.weights is not None else Tier.DISK

    @property
    def last_used(self) -> float:
        """Last request time, or the time it entered its tier when never requested."""
        return self.last_access if self.last_access is not None else self.tier_since

    def residency(self) -> AdapterResidency:
        """The contract's view of this adapter: ``adapter_digest`` is the content digest of the files it loaded
        (the artifact ``digest`` is known only to the sidecar)."""
        return AdapterResidency(
            served_name=self.name, tier=self.tier, adapter_digest=self.digest, priority=self.priority,
            bytes=self.nbytes if self.weights is not None else self.disk_bytes, pinned=self.pinned,
            in_flight=self.in_flight, hits=self.hits, loads=self.loads, evictions=self.evictions,
            last_access=self.last_access, registered=self.registered,
        )


EvictionHook = Callable[[AdapterState, Tier], None]


class AdapterTiers:
    """Places adapters in slots and the host cache; the single owner of slot contents."""

    def __init__(
        self,
        model: LlamaModel,
        max_loras: int,
        max_cpu_loras: int,
        max_lora_rank: int,
        policy: EvictionPolicy,
        clock: Callable[[], float] = time.time,
        on_evict: EvictionHook | None = None,
    ) -> None:
        if max_cpu_loras < max_loras:
            raise ValueError(f"max_cpu_loras ({max_cpu_loras}) must be >= max_loras ({max_loras})")
        self.model = model
        self.max_loras = max_loras
        self.max_cpu_loras = max_cpu_loras
        self.max_lora_rank = max_lora_rank
        self.policy = policy
        self.clock = clock
        self.on_evict = on_evict
        self.registered: dict[str, AdapterState] = {}
        self.slots: list[AdapterState | None] = [None] * max_loras
        self.host: list[AdapterState] = []

    # --- registration -------------------------------------------------------------------------------------------
    def register(self, adapter: AdapterState) -> AdapterState | None:
        """Register (or replace) ``adapter`` under its name; returns the replaced adapter, if any."""
        old = self.registered.get(adapter.name)
        if old is not None:
            self._retire(old)
        self.registered[adapter.name] = adapter
        return old

    def unregister(self, name: str) -> AdapterState:
        """Forget ``name``; its weights go when its last in-flight request ends. KeyError when unknown."""
        adapter = self.registered.pop(name)
        self._retire(adapter)
        return adapter

    def _retire(self, adapter: AdapterState) -> None:
        adapter.registered = False
        adapter.pinned = False
        if adapter.in_flight == 0:
            self._drop(adapter)

    # --- request accounting -------------------------------------------------------------------------------------
    def acquire(self, adapter: AdapterState) -> Tier:
        """A request for ``adapter`` arrived: count it and protect the adapter; returns its tier at arrival."""
        adapter.in_flight += 1
        adapter.hits += 1
        adapter.last_access = self.clock()
        return adapter.tier

    def release(self, adapter: AdapterState) -> None:
        """A request for ``adapter`` ended; a retired adapter is freed when its last request ends."""
        adapter.in_flight -= 1
        if adapter.in_flight == 0 and not adapter.registered:
            self._drop(adapter)
        self.trim()

    # --- host tier (L1) -----------------------------------------------------------------------------------------
    def insert_host(self, adapter: AdapterState, weights: PeftAdapter, load_seconds: float) -> None:
        """Put weights prepared for the host tier (:func:`~loraplane.engine.adapters.host_copy`) in the host cache,
        then evict down to capacity where possible.

        As in newer vLLM, the new adapter goes in first: capacity may be exceeded while everything else is busy.
        """
        if adapter.weights is not None:
            return
        adapter.weights = weights
        adapter.nbytes = adapter.weights.nbytes()
        adapter.loads += 1
        adapter.load_seconds = load_seconds
        adapter.tier_since = self.clock()
        self.host.append(adapter)
        self.trim(keep=adapter)

    def trim(self, keep: AdapterState | None = None) -> None:
        """Evict host-cache adapters while over capacity and something is evictable."""
        while len(self.host) > self.max_cpu_loras:
            candidates = [a for a in self._evictable(self.host) if a is not keep]
            if not candidates:
                return
            self.drop_host(self.policy.victim(candidates, self.clock()))

    def drop_host(self, adapter: AdapterState) -> None:
        """Evict host -> disk (also frees its slot); counted as an eviction."""
        if self.demote(adapter):
            adapter.evictions += 1
            if self.on_evict:
                self.on_evict(adapter, Tier.CPU)

    def demote(self, adapter: AdapterState) -> bool:
        """Host -> disk, keeping it registered (a request reads it back); False when it was on disk already."""
        if adapter.weights is None:
            return False
        self.offload(adapter)
        self.host.remove(adapter)
        adapter.weights = None
        adapter.tier_since = self.clock()
        return True

    # --- device tier (L0) ---------------------------------------------------------------------------------------
    def activate(self, adapter: AdapterState, busy: Iterable[AdapterState] = ()) -> bool:
        """Copy a host-resident adapter into a slot (evicting one by policy if needed).

        False when every slot holds an adapter that is pinned, in flight, or in ``busy``.
        """
        if adapter.slot is not None:
            return True
        if adapter.weights is None:
            raise RuntimeError(f"adapter {adapter.name!r} is not in host memory")
        slot = next((i for i, a in enumerate(self.slots) if a is None), None)
        if slot is None:
            exclude = set(map(id, busy))
            candidates = [a for a in self._evictable(a for a in self.slots if a is not None) if id(a) not in exclude]
            if not candidates:
                return False
            victim = self.policy.victim(candidates, self.clock())
            slot = victim.slot
            self.offload(victim)
            victim.evictions += 1
            if self.on_evict:
                self.on_evict(victim, Tier.GPU)
        assert slot is not None
        self.model.load_slot(slot, adapter.weights)
        self.slots[slot] = adapter
        adapter.slot = slot
        adapter.tier_since = self.clock()
        return True

    def offload(self, adapter: AdapterState) -> None:
        """Slot -> host (the slot is zeroed so a stale plan can never read the old weights)."""
        if adapter.slot is None:
            return
        self.model.clear_slot(adapter.slot)
        self.slots[adapter.slot] = None
        adapter.slot = None
        adapter.tier_since = self.clock()

    # --- pins ---------------------------------------------------------------------------------------------------
    def pin(self, adapter: AdapterState) -> None:
        """Pin in both tiers (the caller activates it first)."""
        adapter.pinned = True

    def unpin(self, adapter: AdapterState) -> None:
        """Make it evictable again."""
        adapter.pinned = False
        self.trim()

    # --- internals ----------------------------------------------------------------------------------------------
    @staticmethod
    def _evictable(adapters: Iterable[AdapterState]) -> list[AdapterState]:
        return [a for a in adapters if not a.pinned and a.in_flight == 0]

    def _drop(self, adapter: AdapterState) -> None:
        self.offload(adapter)
        if adapter.weights is not None:
            self.host.remove(adapter)
            adapter.weights = None
            return_freed_memory()

    def bytes_by_tier(self) -> dict[Tier, int]:
        """Adapter weight bytes held at each tier (a slot-resident adapter counts in GPU and CPU)."""
        registered = list(self.registered.values())
        return {
            Tier.GPU: sum(a.nbytes for a in self.slots if a is not None),
            Tier.CPU: sum(a.nbytes for a in self.host),
            Tier.DISK: sum(a.disk_bytes for a in registered if a.tier is Tier.DISK),
        }
