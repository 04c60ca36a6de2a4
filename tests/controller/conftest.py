"""Fixtures of the controller tests that run against the devcluster."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from loraplane.devcluster import Cluster, ServerThread, default_crds


@pytest.fixture
def server() -> Iterator[ServerThread]:
    """A devcluster API server (AdapterRevision and InferencePool CRDs installed) on a loopback port."""
    cluster = Cluster()
    for crd in default_crds():
        cluster.install_crd(crd)
    with ServerThread(cluster) as running:
        yield running
