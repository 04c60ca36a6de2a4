"""The controller's YAML config file (``loraplane-controller --config``, ``loraplane sim --controller-config``):
placement settings and tenant budgets, validated strictly (an unknown key is refused with the reason)."""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from loraplane.controller.placement import PlacementConfig, TenantBudget


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class PlacementSettings(_Strict):
    """``placement:`` in the config file (see docs/controller.md for the meaning of each)."""

    replica_rate: float = Field(default=PlacementConfig.replica_rate, gt=0, alias="replicaRate")
    stickiness: float = Field(default=PlacementConfig.stickiness, ge=0)
    burst_ratio: float = Field(default=PlacementConfig.burst_ratio, gt=1, alias="burstRatio")
    burst_min_rate: float = Field(default=PlacementConfig.burst_min_rate, ge=0, alias="burstMinRate")
    burst_slots_per_pod: int = Field(default=PlacementConfig.burst_slots_per_pod, ge=0, alias="burstSlotsPerPod")
    gold_weight: float = Field(default=PlacementConfig.gold_weight, gt=0, alias="goldWeight")
    sheddable_weight: float = Field(default=PlacementConfig.sheddable_weight, gt=0, alias="sheddableWeight")
    gpu_min_rate: float = Field(default=PlacementConfig.gpu_min_rate, ge=0, alias="gpuMinRate")
    gold_min_replicas: int = Field(default=PlacementConfig.gold_min_replicas, ge=1, alias="goldMinReplicas")
    balance_ratio: float = Field(default=PlacementConfig.balance_ratio, ge=1, alias="balanceRatio")
    host_copies: int = Field(default=PlacementConfig.host_copies, ge=0, alias="hostCopies")
    staging_share: float = Field(default=PlacementConfig.staging_share, ge=0, le=1, alias="stagingShare")
    traffic_holders: int = Field(default=PlacementConfig.traffic_holders, ge=1, alias="trafficHolders")
    holder_spread: float = Field(default=PlacementConfig.holder_spread, ge=0, alias="holderSpread")
    max_spread_holders: int = Field(default=PlacementConfig.max_spread_holders, ge=1, alias="maxSpreadHolders")


class BudgetSettings(_Strict):
    gpu_bytes: int | None = Field(default=None, ge=0, alias="gpuBytes")
    cpu_bytes: int | None = Field(default=None, ge=0, alias="cpuBytes")


class FileConfig(_Strict):
    """The controller's YAML config file."""

    placement: PlacementSettings = Field(default_factory=PlacementSettings)
    tenant_budgets: dict[str, BudgetSettings] = Field(default_factory=dict, alias="tenantBudgets")

    def placement_config(self) -> PlacementConfig:
        return PlacementConfig(**self.placement.model_dump())

    def budgets(self) -> dict[str, TenantBudget]:
        return {t: TenantBudget(b.gpu_bytes, b.cpu_bytes) for t, b in self.tenant_budgets.items()}


def load_config(path: Path | None) -> FileConfig:
    """Parse the config file (an empty config without one); ValueError with the reason when it is invalid."""
    if path is None:
        return FileConfig()
    try:
        data = yaml.safe_load(path.read_text()) or {}
        return FileConfig.model_validate(data)
    except (OSError, yaml.YAMLError, ValidationError) as exc:
        raise ValueError(f"config file {path}: {exc}") from exc
