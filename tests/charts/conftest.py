"""Render the Helm chart with real ``helm`` and index what it produced."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.fixtures.tools import REPO

CHART = REPO / "charts" / "loraplane"
RELEASE = "lp"
NAMESPACE = "serving"


@dataclass
class Rendered:
    """The objects one ``helm template`` produced."""

    objects: list[dict[str, Any]]

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        """Every object of ``kind``."""
        return [o for o in self.objects if o["kind"] == kind]

    def get(self, kind: str, name: str) -> dict[str, Any]:
        """The one object of ``kind`` named ``name``."""
        found = [o for o in self.of_kind(kind) if o["metadata"]["name"] == name]
        assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
        return found[0]

    def names(self, kind: str) -> set[str]:
        """Names of the objects of ``kind``."""
        return {o["metadata"]["name"] for o in self.of_kind(kind)}

    def workloads(self) -> Iterator[dict[str, Any]]:
        """Deployments and StatefulSets."""
        yield from (o for o in self.objects if o["kind"] in ("Deployment", "StatefulSet"))


def name_of(component: str) -> str:
    """The full name the chart gives a component's objects in the test release."""
    return f"{RELEASE}-loraplane-{component}"


def helm_template(helm: str, values: dict[str, Any], tmp_path: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    """Run ``helm template`` with ``values``; the completed process (it may have failed)."""
    values_file = tmp_path / "values.yaml"
    values_file.write_text(yaml.safe_dump(values))
    return subprocess.run(
        [helm, "template", RELEASE, str(CHART), "--namespace", NAMESPACE, "-f", str(values_file), *extra],
        capture_output=True, text=True, timeout=60, check=False,
    )


RenderFn = Callable[..., Rendered]


@pytest.fixture(scope="session")
def _render_cache() -> dict[str, str]:
    """helm's output per (values, arguments): tests that render the same values share one ``helm template``."""
    return {}


@pytest.fixture
def render(helm_bin: str, tmp_path: Path, _render_cache: dict[str, str]) -> RenderFn:
    """``render(values, *helm_args)`` -> the rendered objects; fails the test with helm's message on error."""

    def _render(values: dict[str, Any] | None = None, *extra: str) -> Rendered:
        key = json.dumps([values or {}, extra], sort_keys=True)
        if key not in _render_cache:
            result = helm_template(helm_bin, values or {}, tmp_path, *extra)
            assert result.returncode == 0, result.stderr
            _render_cache[key] = result.stdout
        return Rendered([o for o in yaml.safe_load_all(_render_cache[key]) if o])

    return _render
