"""Builders of valid api objects shared by the api tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
DIGEST_A = "sha256:" + "a" * 64
DIGEST_B = "sha256:" + "b" * 64


def load_yaml(path: Path) -> dict[str, Any]:
    """One YAML document as a dict."""
    data = yaml.safe_load(path.read_text())
    assert isinstance(data, dict)
    return data


@pytest.fixture
def example_cr() -> dict[str, Any]:
    """The full example AdapterRevision as a dict."""
    return load_yaml(REPO / "examples" / "claims-assistant-v18.yaml")
