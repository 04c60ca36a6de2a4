"""The interface every runtime driver implements, and what it reports."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

from loraplane.api import PodLoad, ResidencySource, Tier


class RuntimeUnavailable(Exception):
    """The runtime did not answer (connection refused, timeout, 5xx): the pod is not ready."""


class RuntimeRejected(Exception):
    """The runtime answered and refused the operation (4xx with its message)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


@dataclass(frozen=True)
class Capabilities:
    """What a runtime can do beyond loading and unloading.

    ``tier_control``: explicit activate (CPU -> GPU) and offload (GPU -> CPU). ``pin``: pin/unpin.
    ``reports_residency``: the runtime says which tier each adapter is in (otherwise the driver infers it).
    ``exports_residency_metrics``: the runtime's /metrics already has ``vllm:lora_adapter_loaded``.
    ``priority``: the runtime's eviction policy takes each adapter's tenant priority (``set_priority``).
    ``load_activates``: a load (and a request for an adapter out of its GPU slot) puts the adapter into a GPU slot,
    evicting the least recently used active one (vLLM): the reconciler loads one at a time, host-tier targets first,
    and keeps one GPU slot free of GPU-tier targets for those loads.
    ``demote``: an adapter can leave GPU and host memory while staying registered (``demote``), and a request for
    it reads it back from local disk: a disk-tier target demotes it, and it stays servable (the engine).
    ``disk_registered``: a registered adapter whose copy left the runtime's host cache stays servable (the runtime
    reads it back from its path on the next request), but the runtime cannot be told to evict one (vLLM): a
    disk-tier target means *registered, not kept resident*. It is loaded (registered) when it is not, after every
    GPU- and host-tier target and one at a time, never unloaded for being disk-tier, and left out of
    ``keep_resident``, so the runtime's LRU ages its copy out (the demote is "stop keeping it").
    With neither, a disk-tier target drains and unloads a registered adapter and only keeps it in the disk cache.
    """

    tier_control: bool
    pin: bool
    reports_residency: bool
    exports_residency_metrics: bool
    priority: bool = False
    load_activates: bool = False
    demote: bool = False
    disk_registered: bool = False

    @property
    def serves_disk_tier(self) -> bool:
        """A disk-tier target stays (``demote``) or becomes (``disk_registered``) servable, registered on disk."""
        return self.demote or self.disk_registered


@dataclass(frozen=True)
class RuntimeInfo:
    """The runtime's identity and limits, used by compatibility checks and restart detection.

    ``instance`` changes whenever the runtime process restarts (None when the runtime does not say).
    ``None`` limits are unknown and not checked.
    """

    base_model: str
    instance: str | None = None
    base_model_digest: str | None = None
    max_lora_rank: int | None = None
    max_loras: int | None = None
    max_cpu_loras: int | None = None
    target_modules: frozenset[str] | None = None
    dtypes: frozenset[str] | None = None


@dataclass
class RuntimeAdapter:
    """One adapter as the runtime holds it.

    ``digest`` is the runtime's content digest (``loraplane.api.adapter_digest`` of the files it loaded), when it
    reports one; the sidecar maps it back to the verified artifact digest. ``priority`` is the tenant priority the
    runtime holds for it (None when the runtime has none).
    """

    served_name: str
    tier: Tier
    digest: str | None = None
    bytes: int = 0
    pinned: bool = False
    in_flight: int = 0
    hits: int = 0
    loads: int = 0
    evictions: int = 0
    last_access: float | None = None
    priority: int | None = None
    #: the directory the runtime loaded it from, when the runtime says (vLLM's ``/v1/models`` ``root``)
    path: str | None = None


@dataclass
class Observation:
    """One look at the runtime: identity, the adapters it holds, and its load."""

    info: RuntimeInfo
    adapters: dict[str, RuntimeAdapter]
    load: PodLoad


class RuntimeDriver(ABC):
    """Drives one model server. Every method raises RuntimeUnavailable or RuntimeRejected on failure."""

    kind: str
    capabilities: Capabilities

    @property
    def residency_source(self) -> ResidencySource:
        """Where the last ``observe`` took the tiers from: the runtime's own listing (``reports_residency``), else
        the driver's inference (a driver that reads exact residency some of the time overrides this)."""
        return ResidencySource.RUNTIME if self.capabilities.reports_residency else ResidencySource.LRU_MODEL

    @abstractmethod
    async def observe(self) -> Observation:
        """What the runtime is and holds now (adapters keyed by served name), and how loaded it is."""

    @abstractmethod
    async def load(self, served_name: str, path: Path) -> None:
        """Register the PEFT directory ``path`` under ``served_name`` (host memory tier where the runtime has one)."""

    @abstractmethod
    async def activate(self, served_name: str) -> None:
        """Bring a loaded adapter into a GPU slot."""

    async def offload(self, served_name: str) -> None:
        """Move an adapter from its GPU slot to host memory (only with ``tier_control``)."""
        raise NotImplementedError(f"the {self.kind} runtime has no offload")

    async def demote(self, served_name: str) -> None:
        """Move a registered adapter out of GPU and host memory, keeping it registered (only with ``demote``)."""
        raise NotImplementedError(f"the {self.kind} runtime has no demote")

    async def set_pinned(self, served_name: str, pinned: bool) -> None:
        """Pin or unpin an adapter (only with ``pin``)."""
        raise NotImplementedError(f"the {self.kind} runtime has no pin")

    async def set_priority(self, served_name: str, priority: int) -> None:
        """Tell the runtime's eviction policy the adapter's tenant priority (only with ``priority``)."""
        raise NotImplementedError(f"the {self.kind} runtime has no adapter priority")

    def keep_resident(self, gpu: Collection[str], host: Collection[str]) -> None:
        """The adapters the target wants in GPU slots (``gpu``) and in the runtime at all (``host``, a superset).

        A runtime whose loads evict by LRU keeps them where they are while it loads or activates others; the
        default does nothing (the runtime evicts by its own policy, or only when asked).
        """
        return None

    @abstractmethod
    async def unload(self, served_name: str) -> None:
        """Remove the adapter from the runtime; an adapter the runtime does not know is already unloaded."""

    @abstractmethod
    async def close(self) -> None:
        """Release connections."""
