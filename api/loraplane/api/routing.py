"""What the controller tells the picker (``RouteTable``) and what the picker tells the controller (rates, counters)."""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum
from typing import Literal, Protocol

from pydantic import Field, field_validator, model_validator

from loraplane.api.adapterrevision import AdapterRevisionStatus, DnsLabel
from loraplane.api.base import PayloadModel
from loraplane.api.runtime import SCHEMA_VERSION


class RevisionRole(StrEnum):
    """Why a revision is in a route: it is the stable one, or a canary taking a share."""

    STABLE = "stable"
    CANARY = "canary"


class WeightedRevision(PayloadModel):
    """One revision a logical name routes to, with its share of the traffic in percent."""

    revision: DnsLabel
    served_name: str
    digest: str = Field(description="artifact digest; a pod is warm for it only when it reports the same")
    weight: int = Field(ge=0, le=100)
    role: RevisionRole = RevisionRole.STABLE


class RouteEntry(PayloadModel):
    """How one logical model name is served."""

    tenant: str = "default"
    priority: int = 0
    revisions: list[WeightedRevision] = Field(min_length=1, max_length=8)

    @field_validator("revisions")
    @classmethod
    def _weights_sum_to_100(cls, revisions: list[WeightedRevision]) -> list[WeightedRevision]:
        total = sum(r.weight for r in revisions)
        if total != 100:
            raise ValueError(f"revision weights must sum to 100, got {total}")
        names = [r.served_name for r in revisions]
        if len(set(names)) != len(names):
            raise ValueError("a route lists a revision twice")
        return revisions


class RouteTable(PayloadModel):
    """Logical model name -> weighted revisions. Only names in this table are routable."""

    schema_version: int = SCHEMA_VERSION
    pool: str
    generation: int = Field(ge=0)
    base_model: str | None = Field(default=None, description="the base model name, routable without an adapter")
    models: dict[str, RouteEntry] = Field(default_factory=dict)
    staging_pods: list[str] = Field(
        default_factory=list,
        description="the pods that take a revision no pod holds yet (the placement's staging pods, so a sweep of new "
        "revisions loads there and not next to the gold replicas); empty: any pod",
    )
    updated_at: float
    writer: str | None = Field(
        default=None,
        description="the controller incarnation that wrote it (identity@start): a reader refuses a lower generation "
        "from the same writer (a replayed or stale copy); None from writers before this field",
    )


class Generational(Protocol):
    """A payload one controller incarnation writes with increasing generations (``RouteTable``, ``TargetState``)."""

    generation: int
    writer: str | None


def supersedes(new: Generational, current: Generational | None) -> bool:
    """False only for a copy older than ``current`` from the same writer (a replayed or stale payload); a new
    writer (a restarted or newly elected controller) starts its own sequence."""
    if current is None or new.writer is None or new.writer != current.writer:
        return True
    return new.generation >= current.generation


RateWindow = Literal["5m", "1h", "24h"]


class RequestRates(PayloadModel):
    """Per-served-revision request rates (requests/s) over rolling windows, published by each picker replica for the
    requests it routed (``keys.request_rates(pool, replica)``); the pool's rates are their sum (``combine``)."""

    schema_version: int = SCHEMA_VERSION
    pool: str
    replica: str | None = Field(default=None, description="the picker replica that counted them; None: a sum")
    published_at: float
    windows: dict[RateWindow, dict[str, float]] = Field(default_factory=dict)

    @classmethod
    def combine(cls, pool: str, parts: Sequence[RequestRates]) -> RequestRates | None:
        """The pool's rates: every replica's summed per window and served name (None when there is none). Replicas
        split the traffic between them (Envoy balances streams over them), so each sees its share."""
        if not parts:
            return None
        if len(parts) == 1:  # one replica: its rates are the pool's (shared, not copied: 10,000 names, 3 windows)
            return parts[0].model_copy(update={"replica": None})
        windows: dict[RateWindow, dict[str, float]] = {}
        for part in parts:
            for window, rates in part.windows.items():
                total = windows.setdefault(window, {})
                for name, rate in rates.items():
                    total[name] = total.get(name, 0.0) + rate
        return cls(pool=pool, published_at=max(p.published_at for p in parts), windows=windows)

    @model_validator(mode="after")
    def _non_negative(self) -> RequestRates:
        for window, rates in self.windows.items():
            if any(r < 0 for r in rates.values()):
                raise ValueError(f"negative rate in window {window}")
        return self


class RevisionCounters(PayloadModel):
    """Cumulative per-revision outcome counters the picker publishes for canary analysis."""

    requests: int = Field(default=0, ge=0)
    errors: int = Field(default=0, ge=0)
    ttft_seconds_sum: float = Field(default=0.0, ge=0)
    ttft_count: int = Field(default=0, ge=0)


class PickerCounters(PayloadModel):
    """All revisions' counters from one picker replica."""

    schema_version: int = SCHEMA_VERSION
    pool: str
    replica: str
    published_at: float
    revisions: dict[str, RevisionCounters] = Field(default_factory=dict)


class EndpointInFlight(PayloadModel):
    """One replica's requests in flight at one endpoint: sent and not finished."""

    requests: int = Field(default=0, ge=0)
    prefilling: int = Field(default=0, ge=0, description="of which no response byte has come back yet")
    prefill_tokens: int = Field(default=0, ge=0, description="the prompt tokens of those prefilling, as the picker "
                                "estimates them from their bodies' size, less the prefix it expects the endpoint to "
                                "hold")
    by_name: dict[str, int] = Field(default_factory=dict, description="per served name (the base model is left out)")

    @field_validator("by_name")
    @classmethod
    def _positive(cls, value: dict[str, int]) -> dict[str, int]:
        if any(n <= 0 for n in value.values()):
            raise ValueError("by_name counts must be positive")
        return value


class PickerInFlight(PayloadModel):
    """One picker replica's requests in flight per endpoint address, published every share period
    (``keys.picker_in_flight``): each replica routes on its own exact counts plus the others' last published ones,
    so replicas behind one Envoy judge load, saturation and GPU-slot room on the whole pool's traffic."""

    schema_version: int = SCHEMA_VERSION
    pool: str
    replica: str
    published_at: float
    endpoints: dict[str, EndpointInFlight] = Field(default_factory=dict, description="by endpoint address")


class StatusRecord(PayloadModel):
    """The status the controller last wrote to one AdapterRevision (``keys.revision_status``), written just before
    the status itself. Only the controller writes it (Redis ACL), while a status subresource may be patched by anyone
    with RBAC on it: a replica that becomes leader acts on this record, not on an object's status someone else
    patched (a forged ``phase: Stable`` during a canary)."""

    schema_version: int = SCHEMA_VERSION
    pool: str
    namespace: str
    name: str
    uid: str = Field(description="the object's metadata.uid: a record of an object deleted and made again is not its")
    status: AdapterRevisionStatus
