"""Served names, cache keys and Redis key names."""

from __future__ import annotations

import pytest

from loraplane import api
from loraplane.api import keys
from tests.api.conftest import DIGEST_A, DIGEST_B


def test_served_name_round_trip() -> None:
    name = api.served_name("claims-assistant", "v18")
    assert name == "claims-assistant@v18"
    assert api.parse_served_name(name) == ("claims-assistant", "v18")


@pytest.mark.parametrize("bad", ["base-model", "a@B", "a@v1@v2", "../x@v1", "a@", "@v1"])
def test_parse_served_name_refuses_other_strings(bad: str) -> None:
    with pytest.raises(ValueError):
        api.parse_served_name(bad)


def test_served_name_refuses_bad_parts() -> None:
    with pytest.raises(ValueError, match="not a DNS-1123 label"):
        api.served_name("a/b", "v1")


def test_cache_key_changes_with_every_input() -> None:
    base = ("sha256:" + "1" * 64, "claims", "v1", DIGEST_A, "1")
    key = api.cache_key(*base)
    assert key.startswith("sha256:") and len(key) == 71
    assert api.cache_key(*base) == key
    for i, other in enumerate((DIGEST_B, "claims2", "v2", DIGEST_B, "2")):
        changed = list(base)
        changed[i] = other
        assert api.cache_key(*changed) != key, f"input {i} does not change the key"


def test_cache_key_is_not_ambiguous_under_concatenation() -> None:
    assert api.cache_key(DIGEST_A, "ab", "c", DIGEST_B) != api.cache_key(DIGEST_A, "a", "bc", DIGEST_B)


def test_cache_key_refuses_bad_digests() -> None:
    with pytest.raises(ValueError, match="not a sha256"):
        api.cache_key("sha256:xyz", "a", "v1", DIGEST_A)


def test_keys_share_the_pool_hash_tag() -> None:
    names = [
        keys.target_state("pool-a", "pod-1"),
        keys.residency_report("pool-a", "pod-1"),
        keys.residency_index("pool-a"),
        keys.route_table("pool-a"),
        keys.request_rates("pool-a", "picker-0"),
        keys.picker_counters("pool-a", "picker-0"),
        keys.target_changed_channel("pool-a"),
        keys.residency_changed_channel("pool-a"),
        keys.routes_changed_channel("pool-a"),
        keys.kv_blocks("pool-a", "pod-1"),
        keys.kv_blocks_changed_channel("pool-a"),
    ]
    assert all(n.startswith("loraplane:{pool-a}:") for n in names)
    assert len(set(names)) == len(names)
    assert keys.target_state_pattern("pool-a").rstrip("*") in keys.target_state("pool-a", "x")
    assert keys.picker_counters_pattern("pool-a").rstrip("*") in keys.picker_counters("pool-a", "replica-1")


@pytest.mark.parametrize("bad", ["Pool", "a b", "a:b", "x/../y", ""])
def test_keys_refuse_names_that_could_collide(bad: str) -> None:
    with pytest.raises(ValueError):
        keys.route_table(bad)
    with pytest.raises(ValueError):
        keys.target_state("pool", bad)
