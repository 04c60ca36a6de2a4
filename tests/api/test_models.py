"""Round trips of every api model and each validation rule."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from pydantic import ValidationError

from loraplane import api
from loraplane.api import (
    AdapterResidency,
    AdapterRevision,
    AdapterTarget,
    PickerCounters,
    PodLoad,
    RequestRates,
    ResidencyReport,
    RevisionCounters,
    RouteEntry,
    RouteTable,
    TargetState,
    Tier,
    WeightedRevision,
)
from tests.api.conftest import DIGEST_A, DIGEST_B, EXAMPLES, load_yaml


def _target(name: str = "claims@v1", tier: Tier = Tier.GPU) -> AdapterTarget:
    return AdapterTarget(
        served_name=name,
        adapter="claims",
        revision="v1",
        tier=tier,
        pinned=True,
        artifact=api.Artifact(uri="oci://reg.local/adapters/claims:v1", digest=DIGEST_A, size_bytes=1024),
        lora=api.LoraSpec(rank=16, alpha=32, target_modules=["q_proj", "v_proj"]),
        base_model_digest=DIGEST_B,
        cache_key=api.cache_key(DIGEST_B, "claims", "v1", DIGEST_A),
        tenant="claims",
        priority=10,
    )


def _all_models() -> list[api.ApiModel]:
    return [
        AdapterRevision.model_validate(load_yaml(EXAMPLES[0])),
        TargetState(pool="pool-a", pod="pod-1", generation=3, adapters=[_target()], updated_at=1700000000.5),
        ResidencyReport(
            pool="pool-a",
            pod="pod-1",
            address="10.0.0.7:8000",
            heartbeat_at=1700000001.25,
            adapters=[
                AdapterResidency(served_name="claims@v1", tier=Tier.GPU, digest=DIGEST_A, adapter_digest=DIGEST_B,
                                 bytes=4096, pinned=True,
                                 in_flight=2, hits=10, loads=1, evictions=0, last_access=1700000000.0, priority=5),
                AdapterResidency(served_name="claims@v2", tier=Tier.DISK, error="sha256 mismatch",
                                 error_reason=api.ERROR_DIGEST_MISMATCH),
                AdapterResidency(served_name="claims@v0", tier=Tier.CPU, digest=DIGEST_B, draining=True),
            ],
            load=PodLoad(queue_depth=3, running=4, active_tokens=900, kv_utilization=0.4, max_gpu_slots=4,
                         max_cpu_slots=16, max_gpu_bytes=1 << 30, max_cpu_bytes=8 << 30, recent_evictions=1),
        ),
        RouteTable(
            pool="pool-a",
            generation=7,
            models={
                "claims": RouteEntry(
                    tenant="claims",
                    priority=10,
                    revisions=[
                        WeightedRevision(revision="v1", served_name="claims@v1", digest=DIGEST_A, weight=90),
                        WeightedRevision(revision="v2", served_name="claims@v2", digest=DIGEST_B, weight=10,
                                         role=api.RevisionRole.CANARY),
                    ],
                )
            },
            updated_at=1700000002.0,
        ),
        RequestRates(pool="pool-a", published_at=1.0, windows={"5m": {"claims@v1": 2.5}, "1h": {"claims@v1": 1.0}}),
        PickerCounters(pool="pool-a", replica="picker-0", published_at=2.0,
                       revisions={"claims@v1": RevisionCounters(requests=10, errors=1, ttft_seconds_sum=0.5, ttft_count=9)}),
    ]


@pytest.mark.parametrize("model", _all_models(), ids=lambda m: type(m).__name__)
def test_json_round_trip(model: api.ApiModel) -> None:
    text = model.to_json()
    again = type(model).from_json(text)
    assert again == model
    assert again.to_json() == text


def test_camel_case_on_the_wire_and_snake_case_accepted() -> None:
    report = _all_models()[2]
    wire = report.to_dict()
    assert "heartbeatAt" in wire and "heartbeat_at" not in wire
    assert wire["load"]["kvUtilization"] == 0.4
    snake = ResidencyReport.model_validate(report.model_dump())
    assert snake == report


def test_draining_is_optional_on_the_wire() -> None:
    """Reports from sidecars that predate ``draining`` parse as not draining; a draining row says so on the wire."""
    row = AdapterResidency.from_json('{"servedName": "claims@v1", "tier": "gpu"}')
    assert row.draining is False
    assert AdapterResidency(served_name="claims@v1", tier=Tier.GPU, draining=True).to_dict()["draining"] is True


def test_registered_is_optional_on_the_wire() -> None:
    """Rows from sidecars that predate ``registered`` say nothing (None); a cache-only disk row says false."""
    assert AdapterResidency.from_json('{"servedName": "claims@v1", "tier": "disk"}').registered is None
    wire = AdapterResidency(served_name="claims@v1", tier=Tier.DISK, registered=False).to_dict()
    assert wire["registered"] is False and AdapterResidency.model_validate(wire).registered is False


def test_example_manifests_parse() -> None:
    for path in EXAMPLES:
        rev = AdapterRevision.model_validate(load_yaml(path))
        assert rev.served_name == f"{rev.spec.adapter}@{rev.spec.revision}"


def test_defaults_fill_the_minimal_example() -> None:
    rev = AdapterRevision.model_validate(load_yaml(EXAMPLES[1]))
    assert rev.spec.tenant == "default"
    assert rev.spec.warm_policy is api.WarmPolicy.GPU_PREFERRED
    assert rev.spec.rollout.canary.pods == 1
    assert [s.weight for s in rev.spec.rollout.steps] == [10, 50]
    assert rev.status.phase is api.Phase.PENDING


def _spec_error(cr: dict[str, Any], path: list[str], value: Any) -> str:
    bad = copy.deepcopy(cr)
    node = bad["spec"]
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    with pytest.raises(ValidationError) as info:
        AdapterRevision.model_validate(bad)
    return str(info.value)


@pytest.mark.parametrize(
    ("path", "value", "expect"),
    [
        (["lora", "rank"], 7, "rank 7 is not one vLLM accepts"),
        (["lora", "rank"], 0, "rank 0 is not one vLLM accepts"),
        (["artifact", "digest"], "sha256:nothex", "String should match pattern '^sha256:[a-f0-9]{64}$'"),
        (["artifact", "digest"], "md5:" + "a" * 32, "sha256"),
        (["baseModel", "digest"], "sha256:" + "A" * 64, "sha256"),
        (["artifact", "uri"], "file://../etc", "contains a '.' or '..' path segment"),
        (["artifact", "uri"], "https://host/a/../../etc/passwd", "'..' path segment"),
        (["artifact", "uri"], "ftp://host/adapter.tar", "scheme 'ftp' is not allowed"),
        (["artifact", "uri"], "/local/path", "has no scheme"),
        (["artifact", "uri"], "https://host/a\x07b", "control character"),
        (["artifact", "uri"], "https://host/a b", "space"),
        (["adapter"], "Claims_Assistant", "String should match pattern"),
        (["adapter"], "a" * 64, "at most 63 characters"),
        (["revision"], "v1/../x", "String should match pattern"),
        (["tenant"], "bad\nname", "String should match pattern"),
        (["poolRef", "name"], "Pool..x", "String should match pattern"),
        (["baseModel", "name"], "../models/llama", "String should match pattern"),
        (["lora", "targetModules"], ["q_proj", "../x"], "String should match pattern"),
        (["lora", "targetModules"], [], "at least 1 item"),
        (["lora", "alpha"], 0, "greater than 0"),
        (["rollout", "steps"], [{"weight": 50}, {"weight": 10}], "must strictly increase"),
        (["rollout", "steps"], [{"weight": 101}], "less than or equal to 100"),
        (["rollout", "canary"], {"pods": 2, "fraction": 0.5}, "either pods or fraction"),
        (["warmPolicy"], "always", "gpu-preferred"),
        (["unknownField"], 1, "Extra inputs are not permitted"),
    ],
)
def test_spec_validation_messages(example_cr: dict[str, Any], path: list[str], value: Any, expect: str) -> None:
    assert expect in _spec_error(example_cr, path, value)


def test_every_allowed_rank_is_accepted(example_cr: dict[str, Any]) -> None:
    for rank in api.validation.ALLOWED_RANKS:
        example_cr["spec"]["lora"]["rank"] = rank
        assert AdapterRevision.model_validate(example_cr).spec.lora.rank == rank


@pytest.mark.parametrize(
    "uri",
    ["oci://reg.local:5000/adapters/x:v1", "https://h/a/b.tar?sig=1", "s3://bucket/key/model", "file:///srv/adapters/x",
     "file:///srv/adapters/x.v1..tar", "https://h/...hidden"],
)
def test_good_uris(uri: str) -> None:
    assert api.Artifact(uri=uri, digest=DIGEST_A).uri == uri


def test_route_weights_must_sum_to_100() -> None:
    with pytest.raises(ValidationError, match="must sum to 100, got 90"):
        RouteEntry(revisions=[WeightedRevision(revision="v1", served_name="a@v1", digest=DIGEST_A, weight=90)])


def test_route_revision_listed_once() -> None:
    rev = WeightedRevision(revision="v1", served_name="a@v1", digest=DIGEST_A, weight=50)
    with pytest.raises(ValidationError, match="lists a revision twice"):
        RouteEntry(revisions=[rev, rev])


def test_target_state_refuses_absent_tier_and_duplicates() -> None:
    with pytest.raises(ValidationError, match="leave the adapter out"):
        _target(tier=Tier.ABSENT)
    with pytest.raises(ValidationError, match="served name twice"):
        TargetState(pool="p", pod="q", generation=1, adapters=[_target(), _target()], updated_at=0)


def test_rates_must_be_non_negative() -> None:
    with pytest.raises(ValidationError, match="negative rate"):
        RequestRates(pool="p", published_at=0, windows={"5m": {"a@v1": -1.0}})


def test_report_staleness() -> None:
    report = ResidencyReport(pool="p", pod="q", address="1.2.3.4:80", heartbeat_at=100.0, ttl_seconds=5)
    assert not report.is_stale(104.9)
    assert report.is_stale(105.1)


def test_tier_order() -> None:
    assert [t.level for t in (Tier.GPU, Tier.CPU, Tier.DISK, Tier.ABSENT)] == [0, 1, 2, 3]
    assert Tier.GPU.warmer_than(Tier.CPU) and not Tier.DISK.warmer_than(Tier.CPU)


def test_priority_classes() -> None:
    assert api.PriorityClass.GOLD.priority > api.PriorityClass.STANDARD.priority > api.PriorityClass.SHEDDABLE.priority
    assert api.PriorityClass.SHEDDABLE.priority < 0


def test_error_reason_is_one_camel_case_word() -> None:
    with pytest.raises(ValidationError):
        AdapterResidency(served_name="claims@v2", tier=Tier.DISK, error_reason="digest mismatch")


def test_payloads_ignore_fields_a_newer_writer_added_but_specs_refuse_them() -> None:
    report = _all_models()[2].to_dict()
    report["futureField"] = 1
    report["adapters"][0]["futureRowField"] = "x"
    report["load"]["futureLoad"] = 2.0
    assert ResidencyReport.model_validate(report) == _all_models()[2]
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        api.LoraSpec.model_validate({"rank": 8, "alpha": 8, "targetModules": ["q_proj"], "futureField": 1})
