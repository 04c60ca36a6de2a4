"""``InferenceObjective``: a named priority for requests.

llm-d-router serves it as ``llm-d.ai/v1alpha2`` (since v0.10, when the endpoint picker left the Gateway API Inference
Extension); GIE's ``inference.networking.x-k8s.io/v1alpha2`` is the deprecated group of the same schema. A request
names its objective in ``x-llm-d-inference-objective`` (or ``x-gateway-inference-objective``); the picker watches
these resources in both groups (like the ``InferencePool``; the new group wins for a name both hold) and schedules the
request with the objective's priority. Only the fields loraplane reads are modelled; the rest passes through.
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import ConfigDict, Field

from loraplane.api.adapterrevision import ObjectMeta
from loraplane.api.base import ApiModel

#: llm-d-router's group (preferred)
OBJECTIVE_GROUP = "llm-d.ai"
#: GIE's group before v1.6 (deprecated, still watched)
LEGACY_OBJECTIVE_GROUP = "inference.networking.x-k8s.io"
#: the groups watched, preferred first
OBJECTIVE_GROUPS = (OBJECTIVE_GROUP, LEGACY_OBJECTIVE_GROUP)
OBJECTIVE_VERSION = "v1alpha2"
OBJECTIVE_PLURAL = "inferenceobjectives"

Int32 = Annotated[int, Field(ge=-(2**31), le=2**31 - 1)]


class ObjectivePoolRef(ApiModel):
    """The InferencePool the objective applies to."""

    model_config = ConfigDict(extra="allow")

    name: str
    group: str = "inference.networking.k8s.io"
    kind: str = "InferencePool"


class InferenceObjectiveSpec(ApiModel):
    """Priority (higher is more important; negative is sheddable; unset is 0) and the pool it belongs to."""

    model_config = ConfigDict(extra="allow")

    priority: Int32 | None = None
    pool_ref: ObjectivePoolRef


class InferenceObjective(ApiModel):
    """One ``InferenceObjective`` as stored in the Kubernetes API."""

    model_config = ConfigDict(extra="allow")
    group: ClassVar[str] = OBJECTIVE_GROUP
    version: ClassVar[str] = OBJECTIVE_VERSION

    api_version: Literal["llm-d.ai/v1alpha2", "inference.networking.x-k8s.io/v1alpha2"] = "llm-d.ai/v1alpha2"
    kind: Literal["InferenceObjective"] = "InferenceObjective"
    metadata: ObjectMeta
    spec: InferenceObjectiveSpec

    @property
    def effective_priority(self) -> int:
        """The priority requests naming this objective get (unset: 0, GIE's default)."""
        return self.spec.priority if self.spec.priority is not None else 0
