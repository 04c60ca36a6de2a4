"""Target states by reference: a state written as refs plus catalogue entries reads back whole, all or nothing."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis

from e2e.fixtures.processes import RedisServer
from loraplane import api
from loraplane.api import AdapterTarget, MissingSpecs, TargetState, Tier, keys
from loraplane.api.catalogue import SpecCache
from tests.api.conftest import DIGEST_A, DIGEST_B

POOL = "pool-a"


def _target(adapter: str, tier: Tier = Tier.GPU, digest: str = DIGEST_A) -> AdapterTarget:
    return AdapterTarget(
        served_name=f"{adapter}@v1", adapter=adapter, revision="v1", tier=tier, hold=tier is Tier.GPU,
        artifact=api.Artifact(uri=f"oci://registry.local/{adapter}:v1", digest=digest, size_bytes=1024),
        lora=api.LoraSpec(rank=16, alpha=32, target_modules=["q_proj", "v_proj"]),
        base_model_digest=DIGEST_B, cache_key=api.cache_key(DIGEST_B, adapter, "v1", digest),
    )


def _state(*targets: AdapterTarget) -> TargetState:
    return TargetState(pool=POOL, pod="pod-0", generation=2, adapters=list(targets), updated_at=1.0)


def test_a_state_by_reference_resolves_to_itself_and_is_smaller() -> None:
    whole = _state(_target("claims"), _target("legal", Tier.CPU))
    compact, specs = whole.by_reference()
    assert compact.adapters == [] and [r.served_name for r in compact.refs] == ["claims@v1", "legal@v1"]
    assert len(compact.to_json()) < len(whole.to_json()) / 2
    read = TargetState.from_json(compact.to_json())
    assert read.tiers() == {"claims@v1": Tier.GPU, "legal@v1": Tier.CPU}
    assert read.resolve({s.served_name: s for s in specs}) == whole


def test_a_missing_spec_or_another_revisions_spec_resolves_nothing() -> None:
    compact, specs = _state(_target("claims"), _target("legal")).by_reference()
    with pytest.raises(MissingSpecs) as missing:
        compact.resolve({specs[0].served_name: specs[0]})
    assert missing.value.names == ["legal@v1"]
    # the same served name re-created with another artifact: its cache key differs, so the old spec is not it
    other = _target("legal", digest="sha256:" + "c" * 64).spec(POOL)
    with pytest.raises(MissingSpecs):
        compact.resolve({s.served_name: s for s in (specs[0], other)})


def test_a_ref_may_not_ask_for_the_absent_tier_nor_a_name_twice() -> None:
    compact, _ = _state(_target("claims")).by_reference()
    data = compact.to_dict()
    data["refs"][0]["tier"] = "absent"
    with pytest.raises(ValueError, match="target tier"):
        TargetState.model_validate(data)
    with pytest.raises(ValueError, match="twice"):
        TargetState(pool=POOL, pod="pod-0", generation=1, updated_at=1.0, adapters=[_target("claims")],
                    refs=compact.refs)


async def test_the_spec_cache_fetches_each_entry_once_and_refetches_a_changed_one(redis_srv: RedisServer) -> None:
    client = aioredis.Redis.from_url(redis_srv.url)
    try:
        whole = _state(_target("claims"), _target("legal", Tier.DISK))
        compact, specs = whole.by_reference()
        cache = SpecCache(POOL)
        with pytest.raises(MissingSpecs):
            await cache.resolve(client, compact)  # nothing in the catalogue yet
        for spec in specs:
            await client.set(keys.target_spec(POOL, spec.served_name), spec.to_json())
        assert await cache.resolve(client, compact) == whole
        assert await cache.resolve(client, compact) == whole
        assert cache.fetched == 2  # the second read fetched nothing
        # another pool's entry stored under this pool's key is not taken
        moved = _target("legal", Tier.DISK, digest="sha256:" + "d" * 64)
        foreign = moved.spec("pool-b")
        await client.set(keys.target_spec(POOL, foreign.served_name), foreign.to_json())
        changed = _state(_target("claims"), moved)
        with pytest.raises(MissingSpecs):
            await cache.resolve(client, changed.by_reference()[0])
        await client.set(keys.target_spec(POOL, foreign.served_name), moved.spec(POOL).to_json())
        assert await cache.resolve(client, changed.by_reference()[0]) == changed
        assert cache.fetched == 3
    finally:
        await client.aclose()
