"""What the controller asks of each pod (``TargetState``) and what each pod's sidecar reports (``ResidencyReport``)."""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from typing import Annotated, ClassVar

from pydantic import Field, field_validator, model_validator

from loraplane.api.adapterrevision import Artifact, Digest, LoraSpec
from loraplane.api.base import PayloadModel

#: Bumped on any incompatible change of the payloads in this module; readers refuse other versions.
SCHEMA_VERSION = 1
#: ``TargetState``'s own version: 2 lists its entries by reference (``refs``) into the pool's catalogue of
#: ``TargetSpec`` keys. A reader of version 1 alone refuses it and keeps its last good target (it would read the
#: empty ``adapters`` as "unload everything"); this reader reads both.
TARGET_SCHEMA_VERSION = 2


class Tier(StrEnum):
    """Where an adapter's weights are: GPU slot (L0), host memory (L1), local disk (L2) or nowhere (L3)."""

    GPU = "gpu"
    CPU = "cpu"
    DISK = "disk"
    ABSENT = "absent"

    @property
    def level(self) -> int:
        """0 for GPU ... 3 for absent: lower is warmer."""
        return _LEVELS[self]

    def warmer_than(self, other: Tier) -> bool:
        """True when this tier serves faster than ``other``."""
        return self.level < other.level


_LEVELS = {Tier.GPU: 0, Tier.CPU: 1, Tier.DISK: 2, Tier.ABSENT: 3}


class ResidencySource(StrEnum):
    """Where a sidecar took its adapters' tiers from (``ResidencyReport.residency_source``)."""

    #: the runtime's own API lists each adapter's tier (loraplane's engine)
    RUNTIME = "runtime"
    #: vLLM's own residency series (``vllm:lora_adapter_loaded`` ..., vLLM PR #54830) on its /metrics
    VLLM_METRICS = "vllm-metrics"
    #: the same series exported from vLLM's worker caches by loraplane's vLLM plugin (``loraplane_kernels``)
    PLUGIN = "loraplane-plugin"
    #: neither: the sidecar replays vLLM's LRU caches from what it loaded and saw served (inferred)
    LRU_MODEL = "lru-model"

TargetTier = Annotated[Tier, Field(description="gpu, cpu or disk; adapters not listed should be absent")]


class _RevisionFields(PayloadModel):
    """What a sidecar needs to fetch, check and name one revision."""

    served_name: str = Field(min_length=3, max_length=128)
    adapter: str
    revision: str
    artifact: Artifact
    lora: LoraSpec
    base_model_digest: Digest
    cache_key: str
    tenant: str = "default"
    priority: int = 0


class TargetSpec(_RevisionFields):
    """One served revision's catalogue entry: the same on every pod that holds it. The controller writes it once per
    pool (``keys.target_spec``); a pod's ``TargetState`` names it by ``TargetRef``."""

    schema_version: int = SCHEMA_VERSION
    pool: str


class _PodFields(PayloadModel):
    """What one pod should do with a revision it holds."""

    tier: TargetTier
    pinned: bool = False
    hold: bool = Field(
        default=False,
        description="keep it at its tier: the controller's rollout gates read its tier on this pod (a canary pod "
        "while the revision rolls out). A runtime whose LRU moves copies down (vLLM) has it warmed again whenever it "
        "drifts; other targets are warmed once per entry and then left to that LRU",
    )

    @field_validator("tier")
    @classmethod
    def _not_absent(cls, tier: Tier) -> Tier:
        if tier is Tier.ABSENT:
            raise ValueError("a target tier is gpu, cpu or disk; leave the adapter out to make it absent")
        return tier


class TargetRef(_PodFields):
    """One entry of a pod's target by reference: the served name, which spec (``cache_key``: a catalogue key that
    holds another revision under the name is not it) and what this pod should do with it."""

    served_name: str = Field(min_length=3, max_length=128)
    cache_key: str


class AdapterTarget(_RevisionFields, _PodFields):
    """One served revision a pod should hold, and everything the sidecar needs to fetch and check it."""

    def spec(self, pool: str) -> TargetSpec:
        """The part every pod holding it shares (its catalogue entry in ``pool``)."""
        return TargetSpec.model_construct(pool=pool, schema_version=SCHEMA_VERSION,
                                          **{name: getattr(self, name) for name in _RevisionFields.model_fields})

    def ref(self) -> TargetRef:
        """This pod's entry by reference."""
        return TargetRef.model_construct(served_name=self.served_name, cache_key=self.cache_key,
                                         **{name: getattr(self, name) for name in _PodFields.model_fields})

    @classmethod
    def of(cls, spec: TargetSpec, ref: TargetRef) -> AdapterTarget:
        """The entry ``ref`` names, with its ``spec``."""
        return cls.model_construct(**{name: getattr(spec, name) for name in _RevisionFields.model_fields},
                                   **{name: getattr(ref, name) for name in _PodFields.model_fields})


class MissingSpecs(ValueError):
    """A target names specs its reader does not have (not in the catalogue, or another revision's under the name)."""

    def __init__(self, names: list[str]) -> None:
        super().__init__(f"no catalogue spec for {', '.join(names[:5])}{' ...' if len(names) > 5 else ''}")
        self.names = names


class TargetState(PayloadModel):
    """The controller's wish for one pod. Written only by the controller; ``generation`` increases on change.

    Its entries are ``adapters`` (whole) and ``refs`` (by reference into the pool's catalogue: the controller writes
    these, kilobytes per pod however large the specs); a reader resolves the refs (``resolve``) before acting."""

    READ_VERSIONS: ClassVar[tuple[int, ...]] = (SCHEMA_VERSION, TARGET_SCHEMA_VERSION)

    schema_version: int = TARGET_SCHEMA_VERSION
    pool: str
    pod: str
    generation: int = Field(ge=0)
    adapters: list[AdapterTarget] = Field(default_factory=list)
    refs: list[TargetRef] = Field(
        default_factory=list,
        description="entries whose spec is the pool's catalogue key of their served name (``keys.target_spec``)",
    )
    updated_at: float = Field(description="unix seconds when the controller wrote it")
    writer: str | None = Field(
        default=None,
        description="the controller incarnation that wrote it (identity@start): a reader refuses a lower generation "
        "from the same writer (a replayed or stale copy); None from writers before this field",
    )
    retired: list[str] = Field(
        default_factory=list,
        description="served names of the pool's revisions being deleted: the sidecar deletes their disk cache "
        "entries once its runtime no longer holds them",
    )

    @model_validator(mode="after")
    def _unique(self) -> TargetState:
        names = [a.served_name for a in self.adapters] + [r.served_name for r in self.refs]
        if len(names) != len(set(names)):
            raise ValueError("target state lists a served name twice")
        return self

    def by_name(self) -> dict[str, AdapterTarget]:
        """The targets keyed by served name (of a resolved state: ``resolve``)."""
        return {a.served_name: a for a in self.adapters}

    def tiers(self) -> dict[str, Tier]:
        """Served name -> the tier asked for, of every entry (whole or by reference)."""
        return {**{a.served_name: a.tier for a in self.adapters}, **{r.served_name: r.tier for r in self.refs}}

    def resolve(self, specs: Mapping[str, TargetSpec]) -> TargetState:
        """This state with every ref made a whole entry from ``specs`` (served name -> spec); ``MissingSpecs`` when
        one is not there or is another revision's (a different ``cache_key``)."""
        if not self.refs:
            return self
        missing = [r.served_name for r in self.refs
                   if (spec := specs.get(r.served_name)) is None or spec.cache_key != r.cache_key]
        if missing:
            raise MissingSpecs(missing)
        resolved = [AdapterTarget.of(specs[r.served_name], r) for r in self.refs]
        return self.model_copy(update={"adapters": sorted([*self.adapters, *resolved], key=lambda a: a.served_name),
                                       "refs": []})

    def by_reference(self) -> tuple[TargetState, list[TargetSpec]]:
        """This state with every entry by reference (what the controller writes), and the specs its refs name."""
        return (self.model_copy(update={"adapters": [], "refs": [*self.refs, *(a.ref() for a in self.adapters)]}),
                [a.spec(self.pool) for a in self.adapters])


#: ``AdapterResidency.error_reason`` values that end a rollout: the artifact's bytes do not hash to the declared digest.
ERROR_DIGEST_MISMATCH = "DigestMismatch"
#: ... or the adapter does not fit the runtime (base model digest, rank, target modules, dtype).
ERROR_INCOMPATIBLE = "Incompatible"
#: ... or the sidecar refuses the artifact by policy: scheme, host or address not allowed, file outside the allowed
#: roots, an archive past the unpacked-size, file-count or compression-ratio limits.
ERROR_REFUSED = "ArtifactRefused"
#: The error reasons that fail a revision's rollout (any other reason is retried).
FINAL_ERROR_REASONS = frozenset({ERROR_DIGEST_MISMATCH, ERROR_INCOMPATIBLE, ERROR_REFUSED})


class AdapterResidency(PayloadModel):
    """One served revision as the runtime holds it."""

    served_name: str
    tier: Tier
    digest: str | None = Field(
        default=None,
        description="the AdapterRevision's artifact digest (spec.artifact.digest) of what the runtime holds; the "
        "sidecar reports it only after checking that the runtime's own content digest "
        "(loraplane.api.adapter_digest, also on every response header) equals that of the verified cache entry",
    )
    adapter_digest: str | None = Field(
        default=None,
        description="that content digest (loraplane.api.adapter_digest of the loaded PEFT files), as the runtime "
        "stamps it on responses (x-loraplane-adapter-digest); lets the controller's health probe and tests check "
        "that a response came from the verified revision",
    )
    bytes: int = Field(default=0, ge=0, description="adapter weight bytes at its tier")
    pinned: bool = False
    in_flight: int = Field(default=0, ge=0)
    hits: int = Field(default=0, ge=0)
    loads: int = Field(default=0, ge=0)
    evictions: int = Field(default=0, ge=0)
    last_access: float | None = Field(default=None, description="unix seconds of the last request")
    priority: int | None = Field(
        default=None,
        description="the tenant priority the runtime's eviction policy weighs (AdapterTarget.priority once the "
        "sidecar has set it); None when the runtime keeps none",
    )
    registered: bool | None = Field(
        default=None,
        description="the runtime has this revision registered under served_name, so a request for it is served now "
        "(a `disk` row: after the runtime reads it back from its local disk); false for a row only in the sidecar's "
        "disk cache (or absent): the runtime would answer 404 until the sidecar loads it; None from reporters that "
        "do not say (sidecars before this field)",
    )
    draining: bool = Field(
        default=False,
        description="leaving this pod: the sidecar will unload it (or demote it to disk) once routers had time to "
        "see this row and its requests in flight finished; route new requests elsewhere",
    )
    error: str | None = Field(default=None, description="why the adapter is not at its target tier")
    error_reason: str | None = Field(
        default=None,
        pattern=r"^[A-Z][A-Za-z0-9]*$",
        description="the same as one CamelCase word the controller acts on: DigestMismatch, Incompatible and "
        "ArtifactRefused are final for this revision (it fails its rollout); anything else (FetchFailed, LoadFailed ...) is retried",
    )


class LoadCosts(PayloadModel):
    """Seconds a pod takes to make an adapter servable from each tier, as its sidecar measured them (mean of its
    recent load stages); None where it has no measurement (the picker's cost model then uses its defaults)."""

    cpu: float | None = Field(default=None, ge=0, description="host -> GPU activation")
    disk: float | None = Field(default=None, ge=0, description="local disk -> GPU (read, parse, activate)")
    fetch: float | None = Field(default=None, ge=0, description="not on the pod: resolve, download, verify, load")


class PodLoad(PayloadModel):
    """Load of one model server, scraped from its metrics (GIE model-server protocol names)."""

    queue_depth: int = Field(default=0, ge=0)
    running: int = Field(default=0, ge=0)
    active_tokens: int = Field(default=0, ge=0)
    kv_utilization: float = Field(default=0.0, ge=0, le=1)
    max_gpu_slots: int = Field(default=1, ge=0)
    max_cpu_slots: int = Field(default=1, ge=0)
    max_gpu_bytes: int | None = Field(default=None, ge=0, description="adapter bytes the GPU slots hold; None: slots only")
    max_cpu_bytes: int | None = Field(default=None, ge=0, description="adapter bytes the host cache holds; None: slots only")
    max_disk_bytes: int | None = Field(
        default=None, ge=0, description="adapter bytes the sidecar's local disk cache holds (its byte budget); None: unbounded"
    )
    recent_evictions: int = Field(default=0, ge=0, description="evictions in the last minute")
    load_seconds: LoadCosts | None = Field(
        default=None, description="measured load cost per tier (the picker's predicted-TTFT scorer reads it)"
    )


#: The longest TTL a reader counts a report with (the picker's ``--max-report-ttl-seconds``, the controller): a
#: sidecar asking for more (a typo, or one that wants to look alive for long) is aged as if it had asked for this.
MAX_REPORT_TTL_S = 60.0


class ResidencyReport(PayloadModel):
    """A pod's heartbeat: what is warm where, and how loaded it is. Written only by that pod's sidecar."""

    schema_version: int = SCHEMA_VERSION
    pool: str
    pod: str
    address: str = Field(description="ip:port of the model server, as the picker routes to it")
    ready: bool = True
    runtime: str = Field(default="engine", description="engine | vllm | vllm-ascend")
    residency_inferred: bool = Field(
        default=False,
        description="True when the sidecar inferred the tiers (residency_source lru-model: a vLLM that exports no "
        "residency series)",
    )
    residency_source: ResidencySource | None = Field(
        default=None,
        description="where the tiers came from: runtime (the engine lists them), vllm-metrics (vLLM's own "
        "vllm:lora_adapter_loaded series), loraplane-plugin (the same series from loraplane's vLLM plugin, read "
        "from vLLM's worker caches) or lru-model (replayed, inferred); None from sidecars before this field",
    )
    demotes_to_disk: bool = Field(
        default=False,
        description="a `disk` target for a revision this runtime has registered demotes it (out of GPU and host "
        "memory, still registered: a request reads it back from local disk) instead of unloading it, so it stays "
        "servable (the engine); false: a disk target drains and unloads it (vLLM, and sidecars before this field)",
    )
    loads_activate: bool = Field(
        default=False,
        description="a load puts the adapter into a GPU slot (vLLM: activation into its LRU slots): while the pod has "
        "host-tier targets its sidecar keeps one GPU slot free of GPU-tier targets for those loads (the landing "
        "slot), so at most max_gpu_slots - 1 GPU-tier targets stay at GPU; false: the engine, and sidecars before "
        "this field",
    )
    base_model_digest: str | None = None
    max_lora_rank: int | None = None
    target_generation: int | None = Field(default=None, description="the TargetState generation last applied")
    heartbeat_at: float = Field(description="unix seconds")
    ttl_seconds: float = Field(default=5.0, gt=0)
    adapters: list[AdapterResidency] = Field(default_factory=list)
    load: PodLoad = Field(default_factory=PodLoad)

    def is_stale(self, now: float, max_ttl_s: float = MAX_REPORT_TTL_S) -> bool:
        """True when the report is older than its TTL (up to ``max_ttl_s``): treat the pod as unknown, not as truth.
        ``now`` and ``heartbeat_at`` must be one clock's: readers age a report by when they received it."""
        return now - self.heartbeat_at > min(self.ttl_seconds, max_ttl_s)

    def by_name(self) -> dict[str, AdapterResidency]:
        """The adapters keyed by served name."""
        return {a.served_name: a for a in self.adapters}
