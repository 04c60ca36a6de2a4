"""Model resolution: registered names only, sticky weighted canary split."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from loraplane.api import RevisionRole, RouteEntry, RouteTable, WeightedRevision
from loraplane.picker.routes import RouteResolver, UnknownModelError

STABLE = WeightedRevision(revision="v1", served_name="claims@v1", digest="sha256:" + "1" * 64, weight=90)
CANARY = WeightedRevision(revision="v2", served_name="claims@v2", digest="sha256:" + "2" * 64, weight=10, role=RevisionRole.CANARY)


def table() -> RouteTable:
    return RouteTable(
        pool="pool", generation=3, base_model="base-llm", updated_at=0.0,
        models={"claims": RouteEntry(tenant="acme", priority=10, revisions=[STABLE, CANARY])},
    )


def test_unknown_names_are_refused_and_the_base_model_is_routable() -> None:
    resolver = RouteResolver(table())
    rng = np.random.default_rng(0)
    with pytest.raises(UnknownModelError):
        resolver.resolve("claims@v1", None, rng)  # served names are not client-routable
    with pytest.raises(UnknownModelError):
        RouteResolver(None).resolve("claims", None, rng)
    base = resolver.resolve("base-llm", None, rng)
    assert base.served_name is None and base.digest is None


def test_split_is_sticky_per_session_and_matches_the_weights() -> None:
    resolver = RouteResolver(table())
    rng = np.random.default_rng(0)
    picks = {f"user-{i}": resolver.resolve("claims", f"user-{i}", rng).served_name for i in range(4000)}
    share = Counter(picks.values())["claims@v2"] / len(picks)
    assert 0.08 <= share <= 0.12
    for key in list(picks)[:200]:
        assert resolver.resolve("claims", key, rng).served_name == picks[key]
    resolved = resolver.resolve("claims", "user-1", rng)
    assert (resolved.tenant, resolved.priority) == ("acme", 10)
    assert resolver.priorities() == {"claims@v1": 10, "claims@v2": 10}


def test_without_a_session_key_the_split_uses_the_rng() -> None:
    resolver = RouteResolver(table())
    rng = np.random.default_rng(1)
    share = Counter(resolver.resolve("claims", None, rng).served_name for _ in range(3000))["claims@v2"] / 3000
    assert 0.08 <= share <= 0.12
