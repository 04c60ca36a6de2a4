"""The ``AdapterRevision`` custom resource (group ``loraplane.io``, version ``v1alpha1``).

One object is one immutable revision of one logical adapter: the artifact it loads, the base model it fits, how
warm it should be kept and how it is rolled out. The CRD in ``crds/`` is generated from these models
(``loraplane gen-crds``); never edit the YAML by hand.
"""

from __future__ import annotations

import itertools
from datetime import datetime
from enum import StrEnum
from typing import Annotated, Any, ClassVar, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from loraplane.api import validation as v
from loraplane.api.base import ApiModel
from loraplane.api.identity import served_name

GROUP = "loraplane.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "AdapterRevision"
PLURAL = "adapterrevisions"
SINGULAR = "adapterrevision"
SHORT_NAMES = ("ar", "adrev")

DnsLabel = Annotated[str, Field(pattern=v.DNS1123_LABEL, max_length=v.DNS1123_LABEL_MAX)]
DnsSubdomain = Annotated[str, Field(pattern=v.DNS1123_SUBDOMAIN, max_length=v.DNS1123_SUBDOMAIN_MAX)]
Digest = Annotated[str, Field(pattern=v.DIGEST, description="sha256:<64 lowercase hex digits>")]
#: Marks a field that defines what is served: the CRD makes it immutable after create (a CEL ``self == oldSelf``
#: rule on its node, ``loraplane.api.crd``), so the object always describes what its pods serve.
IMMUTABLE_MARK = "x-loraplane-immutable"
_IMMUTABLE: dict[str, Any] = {IMMUTABLE_MARK: True}


class WarmPolicy(StrEnum):
    """How warm the controller keeps a revision when it is not being requested."""

    GPU_PREFERRED = "gpu-preferred"
    CPU = "cpu"
    ON_DEMAND = "on-demand"


class PriorityClass(StrEnum):
    """Tenant priority: gold keeps its warm pods, sheddable requests are refused (429) under saturation."""

    GOLD = "gold"
    STANDARD = "standard"
    SHEDDABLE = "sheddable"

    @property
    def priority(self) -> int:
        """The numeric priority in GIE's convention (negative = sheddable)."""
        return {"gold": 10, "standard": 0, "sheddable": -1}[self.value]


class Phase(StrEnum):
    """Where a revision is in its life (see ``docs/rollout.md``)."""

    PENDING = "Pending"
    VERIFYING = "Verifying"
    PREWARMING = "Prewarming"
    ACTIVATING = "Activating"
    PROBING = "Probing"
    CANARY = "Canary"
    STABLE = "Stable"
    RETIRING = "Retiring"
    RETIRED = "Retired"
    FAILED = "Failed"
    ROLLED_BACK = "RolledBack"


class PoolRef(ApiModel):
    """The GIE ``InferencePool`` (``inference.networking.k8s.io/v1``) whose pods serve this revision."""

    name: DnsSubdomain
    group: Literal["inference.networking.k8s.io"] = "inference.networking.k8s.io"
    kind: Literal["InferencePool"] = "InferencePool"


class BaseModelRef(ApiModel):
    """The base model the adapter was trained on; pods whose base digest differs never load it."""

    name: Annotated[str, Field(pattern=v.MODEL_NAME, max_length=256)]
    digest: Digest


class Artifact(ApiModel):
    """Where the PEFT adapter lives and what its bytes must hash to."""

    uri: Annotated[str, Field(max_length=2048, pattern=v.ARTIFACT_URI)] = Field(json_schema_extra=_IMMUTABLE)
    digest: Digest = Field(
        description="sha256 of the artifact exactly as fetched (the tar archive, or the bare safetensors file); "
        "the sidecar verifies it before anything is unpacked or loaded",
        json_schema_extra=_IMMUTABLE,
    )
    size_bytes: Annotated[int | None, Field(ge=1)] = None

    @field_validator("uri", mode="before")
    @classmethod
    def _explain_uri(cls, value: Any) -> Any:
        if isinstance(value, str) and (why := v.explain_uri(value)):
            raise ValueError(why)
        return value


class LoraSpec(ApiModel):
    """The adapter's LoRA shape, checked against the pool's runtime before loading."""

    rank: int = Field(
        description=f"LoRA rank r; one of {', '.join(map(str, v.ALLOWED_RANKS))} (vLLM's set)",
        json_schema_extra={"enum": list(v.ALLOWED_RANKS)},
    )
    alpha: float = Field(gt=0, description="lora_alpha; the scale is alpha/r (alpha/sqrt(r) with rsLoRA)")
    use_rslora: bool = False
    dtype: Literal["float16", "bfloat16", "float32"] = "bfloat16"
    target_modules: list[Annotated[str, Field(pattern=v.MODULE_NAME, max_length=128)]] = Field(
        min_length=1, max_length=64
    )

    @field_validator("rank")
    @classmethod
    def _rank_allowed(cls, value: int) -> int:
        if value not in v.ALLOWED_RANKS:
            raise ValueError(f"rank {value} is not one vLLM accepts; use one of {list(v.ALLOWED_RANKS)}")
        return value


class CanaryTarget(ApiModel):
    """Which pods prove a new revision first: a count or a fraction of the pool (at least one pod)."""

    pods: Annotated[int | None, Field(ge=1, le=1000)] = None
    fraction: Annotated[float | None, Field(gt=0, le=1)] = None

    @model_validator(mode="after")
    def _one_of(self) -> CanaryTarget:
        if self.pods is not None and self.fraction is not None:
            raise ValueError("canary: set either pods or fraction, not both")
        if self.pods is None and self.fraction is None:
            self.pods = 1
        return self


class TrafficStep(ApiModel):
    """One canary step: send ``weight`` percent of the adapter's traffic to the new revision, then wait."""

    weight: int = Field(ge=1, le=100)
    pause_seconds: int = Field(default=60, ge=0, le=7 * 24 * 3600)


class HealthProbe(ApiModel):
    """A real completion sent straight to each canary pod before it takes traffic."""

    prompt: str = Field(default="Hello", min_length=1, max_length=4096)
    max_tokens: int = Field(default=4, ge=1, le=256)
    ttft_bound_ms: float = Field(default=2000.0, gt=0)
    timeout_seconds: int = Field(default=30, ge=1, le=600)


class CanaryAnalysis(ApiModel):
    """Gates between canary steps, from the picker's per-revision counters (canary vs stable)."""

    max_error_rate_increase: float = Field(default=0.02, ge=0, le=1)
    max_ttft_ratio: float = Field(default=2.0, ge=1)
    min_requests: int = Field(default=20, ge=0)


class Rollout(ApiModel):
    """How a revision goes from verified to stable, and how long the previous one stays around."""

    canary: CanaryTarget = Field(default_factory=CanaryTarget)
    steps: list[TrafficStep] = Field(
        default_factory=lambda: [TrafficStep(weight=10, pause_seconds=60), TrafficStep(weight=50, pause_seconds=60)],
        max_length=20,
    )
    health_probe: HealthProbe = Field(default_factory=HealthProbe)
    analysis: CanaryAnalysis = Field(default_factory=CanaryAnalysis)
    rollback_window_seconds: int = Field(default=600, ge=0, le=30 * 24 * 3600)
    eviction_delay_seconds: int = Field(default=300, ge=0, le=30 * 24 * 3600)
    progress_deadline_seconds: int = Field(
        default=600, ge=1, le=7 * 24 * 3600,
        description="the most seconds a revision may stay in Verifying (its canary pods fetching and checking the "
        "artifact) before it fails with reason ProgressDeadlineExceeded; the later phases wait for shared capacity "
        "(GPU slots) and have no deadline",
    )

    @field_validator("steps")
    @classmethod
    def _increasing(cls, steps: list[TrafficStep]) -> list[TrafficStep]:
        weights = [s.weight for s in steps]
        if any(b <= a for a, b in itertools.pairwise(weights)):
            raise ValueError(f"rollout step weights must strictly increase, got {weights}")
        return steps


class AdapterRevisionSpec(ApiModel):
    """What the user asks for. The fields that define what is served (``adapter``, ``revision``, ``poolRef``,
    ``baseModel``, ``artifact.uri``, ``artifact.digest``, ``lora``) are immutable after create."""

    adapter: DnsLabel = Field(description="logical adapter name clients send as the request's model",
                              json_schema_extra=_IMMUTABLE)
    revision: DnsLabel = Field(json_schema_extra=_IMMUTABLE)
    pool_ref: PoolRef = Field(json_schema_extra=_IMMUTABLE)
    base_model: BaseModelRef = Field(json_schema_extra=_IMMUTABLE)
    artifact: Artifact
    lora: LoraSpec = Field(json_schema_extra=_IMMUTABLE)
    tenant: DnsLabel = "default"
    priority_class: PriorityClass = PriorityClass.STANDARD
    warm_policy: WarmPolicy = WarmPolicy.GPU_PREFERRED
    pinned: bool = Field(default=False, description="keep GPU-resident on its pods whatever the rates say")
    rollout: Rollout = Field(default_factory=Rollout)
    paused: bool = Field(default=False, description="hold the rollout at its current gate")
    rollback: bool = Field(default=False, description="abort: route all traffic back to the last stable revision")


class Condition(ApiModel):
    """A Kubernetes-style condition (``metav1.Condition``)."""

    type: Annotated[str, Field(pattern=r"^[A-Za-z][A-Za-z0-9]*$", max_length=316)]
    status: Literal["True", "False", "Unknown"]
    reason: Annotated[str, Field(pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$", max_length=1024)]
    message: str = Field(default="", max_length=32768)
    last_transition_time: datetime
    observed_generation: int | None = Field(default=None, ge=0)


class ResidencyCounts(ApiModel):
    """How many pods hold the revision at each tier, as their sidecars report it."""

    gpu: int = Field(default=0, ge=0)
    cpu: int = Field(default=0, ge=0)
    disk: int = Field(default=0, ge=0)


class AdapterRevisionStatus(ApiModel):
    """What the controller observed: always derived from observation, never from memory alone."""

    phase: Phase = Phase.PENDING
    canary_step: int | None = Field(default=None, ge=0)
    traffic_weight: int = Field(default=0, ge=0, le=100)
    observed_generation: int | None = Field(default=None, ge=0)
    conditions: list[Condition] = Field(default_factory=list)
    residency: ResidencyCounts = Field(default_factory=ResidencyCounts)
    served_name: str | None = None
    cache_key: str | None = None
    reason: str | None = Field(default=None, description="why the revision is in its phase (CamelCase)")
    message: str | None = Field(default=None, description="the same, for people")
    phase_since: datetime | None = None


class ObjectMeta(ApiModel):
    """The part of Kubernetes ``ObjectMeta`` loraplane reads; other fields pass through untouched."""

    model_config = ConfigDict(extra="allow")

    name: DnsSubdomain
    namespace: str | None = None
    uid: str | None = None
    resource_version: str | None = None
    generation: int | None = None
    creation_timestamp: datetime | None = None
    deletion_timestamp: datetime | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)
    finalizers: list[str] = Field(default_factory=list)


class AdapterRevision(ApiModel):
    """One revision of one logical LoRA adapter, as stored in the Kubernetes API."""

    model_config = ConfigDict(extra="allow")
    group: ClassVar[str] = GROUP
    version: ClassVar[str] = VERSION

    api_version: Literal["loraplane.io/v1alpha1"] = "loraplane.io/v1alpha1"
    kind: Literal["AdapterRevision"] = "AdapterRevision"
    metadata: ObjectMeta
    spec: AdapterRevisionSpec
    status: AdapterRevisionStatus = Field(default_factory=AdapterRevisionStatus)

    @property
    def served_name(self) -> str:
        """The name this revision is registered under in the runtimes (see ``loraplane.api.identity``)."""
        return served_name(self.spec.adapter, self.spec.revision)
