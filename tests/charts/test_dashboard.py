"""The Grafana dashboard queries metrics the components really export, under their exposition names."""

from __future__ import annotations

import json
import re
from typing import Any

from prometheus_client import CollectorRegistry

from loraplane.controller.metrics import ControllerMetrics
from loraplane.engine.metrics import EngineMetrics
from loraplane.picker.telemetry import PickerMetrics
from loraplane.sidecar.metrics import SidecarMetrics
from tests.charts.conftest import CHART, RenderFn, name_of

DASHBOARD = CHART / "dashboards" / "loraplane.json"
METRIC = re.compile(r"\b((?:adapter_|sidecar_|loraplane_|vllm:)[a-zA-Z0-9_:]*)")
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def _exported() -> dict[str, str]:
    """Exposition-level metric family name -> type, from the components' real metric registries."""
    registries: list[CollectorRegistry] = [
        SidecarMetrics(reexport_residency=True).registry,
        PickerMetrics().registry,
        EngineMetrics("tiny").registry,
        ControllerMetrics().registry,
    ]
    return {family.name: family.type for registry in registries for family in registry.collect()}


def _queried(dashboard: dict[str, Any]) -> set[str]:
    return {name for panel in dashboard["panels"] for target in panel.get("targets", [])
            for name in METRIC.findall(target["expr"])}


def test_every_queried_metric_is_exported_under_that_name() -> None:
    exported = _exported()
    queried = _queried(json.loads(DASHBOARD.read_text()))
    assert queried
    for name in queried:
        matches = [(family, kind) for family, kind in exported.items()
                   for suffix in SUFFIXES.get(kind, ("",)) if name == family + suffix]
        assert matches, f"the dashboard queries {name}, which no component exports (as {sorted(exported)})"


def test_dashboard_covers_residency_loads_evictions_latency_and_decisions() -> None:
    queried = _queried(json.loads(DASHBOARD.read_text()))
    for needed in ("adapter_resident_count", "adapter_cache_hits_total", "adapter_cache_misses_total",
                   "adapter_disk_load_seconds_bucket", "adapter_h2d_seconds_bucket", "adapter_evictions_total",
                   "adapter_thrash_ratio", "loraplane_engine_time_to_first_token_seconds_bucket",
                   "loraplane_picker_decisions_total", "loraplane_controller_leader"):
        assert needed in queried, f"no panel shows {needed}"


def test_enabled_dashboard_is_a_configmap_for_the_grafana_sidecar(render: RenderFn) -> None:
    rendered = render({"grafanaDashboard": {"enabled": True}})
    config_map = rendered.get("ConfigMap", name_of("dashboard"))
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(config_map["data"]["loraplane.json"]) == json.loads(DASHBOARD.read_text())
    assert name_of("dashboard") not in render().names("ConfigMap")
