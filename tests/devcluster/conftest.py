"""A devcluster per test (served from a background thread), an HTTP client for it, and valid custom resources
built from the ``loraplane.api`` models."""

from __future__ import annotations

import ssl
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest

from loraplane.api import (
    AdapterRevision,
    AdapterRevisionSpec,
    Artifact,
    BaseModelRef,
    LoraSpec,
    ObjectMeta,
    PoolRef,
)
from loraplane.devcluster import Cluster, ServerConfig, ServerThread, default_crds

DIGEST_A = "sha256:" + "a" * 64
DIGEST_B = "sha256:" + "b" * 64
AR_PATH = "/apis/loraplane.io/v1alpha1/namespaces/default/adapterrevisions"
POOL_PATH = "/apis/inference.networking.k8s.io/v1/namespaces/default/inferencepools"
# One TLS context for every client (building one costs a fifth of a second; the devcluster itself is plain HTTP).
TLS = ssl.create_default_context()


class FixedClock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.current = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)

    def now(self) -> datetime:
        return self.current

    def advance(self, seconds: float) -> None:
        self.current += timedelta(seconds=seconds)


def adapter_revision(name: str, *, adapter: str = "claims", revision: str = "v1", rank: int = 16,
                     digest: str = DIGEST_A) -> dict[str, Any]:
    """A valid AdapterRevision as a user writes it: only the fields without defaults."""
    model = AdapterRevision(
        metadata=ObjectMeta(name=name),
        spec=AdapterRevisionSpec(
            adapter=adapter,
            revision=revision,
            pool_ref=PoolRef(name="llama3-8b"),
            base_model=BaseModelRef(name="meta-llama/Llama-3.1-8B-Instruct", digest=DIGEST_B),
            artifact=Artifact(uri=f"oci://registry.local/adapters/{adapter}:{revision}", digest=digest),
            lora=LoraSpec(rank=rank, alpha=32, target_modules=["q_proj", "v_proj"]),
        ),
    )
    body = model.model_dump(mode="json", by_alias=True, exclude_none=True, exclude_defaults=True)
    body.pop("status", None)
    return {"apiVersion": model.api_version, "kind": model.kind, **body}


def inference_pool(name: str = "llama3-8b") -> dict[str, Any]:
    """A valid GIE InferencePool."""
    return {
        "apiVersion": "inference.networking.k8s.io/v1",
        "kind": "InferencePool",
        "metadata": {"name": name},
        "spec": {"selector": {"matchLabels": {"pool": name}}, "targetPorts": [{"number": 8000}],
                 "endpointPickerRef": {"name": "picker", "port": {"number": 9002}}},
    }


@pytest.fixture
def clock() -> FixedClock:
    return FixedClock()


@pytest.fixture(scope="session")
def crds() -> list[dict[str, Any]]:
    return default_crds()


@pytest.fixture
def server(clock: FixedClock, crds: list[dict[str, Any]]) -> Iterator[ServerThread]:
    """A devcluster with the default CRDs, a hand-moved clock and bookmarks every 0.2 s."""
    cluster = Cluster(clock=clock)
    for crd in crds:
        cluster.install_crd(crd)
    with ServerThread(cluster, ServerConfig(bookmark_interval=0.2)) as running:
        yield running


@pytest.fixture
def http(server: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=10, verify=TLS) as client:
        yield client
