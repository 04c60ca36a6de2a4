"""Subset hints (protocol section "Endpoint Subset"): parsing, and the property that nothing outside the hint is chosen."""

from __future__ import annotations

import numpy as np
import pytest
from google.protobuf import struct_pb2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loraplane.picker.extproc import subset_hint
from loraplane.picker.plugins import SchedulingRequest
from loraplane.picker.scheduler import NoEndpointError, Scheduler
from loraplane.picker.snapshot import EndpointState, PoolSnapshot

IPS = ["10.0.0.1", "10.0.0.2", "10.0.0.3", "fd00::7"]
PORTS = [8000, 8001]


def address(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def as_list(*entries: object) -> struct_pb2.Value:
    value = struct_pb2.Value()
    value.list_value.SetInParent()
    for entry in entries:
        item = value.list_value.values.add()
        if isinstance(entry, str):
            item.string_value = entry
        else:
            item.number_value = float(entry)  # type: ignore[arg-type]
    return value


def as_string(text: str) -> struct_pb2.Value:
    return struct_pb2.Value(string_value=text)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (as_list("10.0.0.1:8000", "10.0.0.2:8000"), {"10.0.0.1:8000", "10.0.0.2:8000"}),
        (as_string("10.0.0.1:8000, 10.0.0.2"), {"10.0.0.1:8000", "10.0.0.2"}),  # one comma-separated string
        (as_list("10.0.0.1:8000,10.0.0.3:8000"), {"10.0.0.1:8000", "10.0.0.3:8000"}),
        (as_list("[fd00::7]:8000", "[fd00::8]", "fd00::9"), {"[fd00::7]:8000", "fd00::8", "fd00::9"}),
        (as_list("10.0.0.1:8000", 12345, "", "10.0.0.2:http", "[]:1"), {"10.0.0.1:8000"}),  # unusable entries dropped
        (as_list(), set()),
        (as_string(""), set()),
    ],
)
def test_hint_forms(value: struct_pb2.Value, expected: set[str]) -> None:
    assert subset_hint(value) == expected


POOL = [EndpointState(name=f"pod-{i}", address=a) for i, a in enumerate(["10.0.0.1:8000", "10.0.0.1:8001", "10.0.0.2:8000"])]


@pytest.mark.parametrize(
    ("hint", "allowed"),
    [
        ({"10.0.0.1:8001"}, {"10.0.0.1:8001"}),  # port-exact when a port is given
        ({"10.0.0.1"}, {"10.0.0.1:8000", "10.0.0.1:8001"}),  # a bare IP allows every port on it
        ({"10.0.0.2:8000", "9.9.9.9:8000"}, {"10.0.0.2:8000"}),  # unknown entries are ignored, not "everything"
        ({"10.0.0.2:9999"}, set()),  # the IP is in the pool, the port is not
        ({"9.9.9.9:8000"}, set()),
        (set(), set()),
    ],
)
def test_scheduler_picks_only_inside_the_hint(hint: set[str], allowed: set[str]) -> None:
    scheduler = Scheduler.default()
    request = SchedulingRequest(subset=frozenset(hint))
    if not allowed:
        with pytest.raises(NoEndpointError):
            scheduler.schedule(request, PoolSnapshot(POOL), np.random.default_rng(0))
        return
    decision = scheduler.schedule(request, PoolSnapshot(POOL), np.random.default_rng(0))
    assert set(decision.endpoints) == allowed  # every allowed endpoint, as primary or fallback, and nothing else


FAIL_OPEN_CONFIG = """
plugins:
- {type: subset-hint-filter, parameters: {failOpen: true}}
- {type: queue-scorer}
- {type: max-score-picker, parameters: {maxEndpoints: 16}}
schedulingProfiles:
- plugins: [{pluginRef: subset-hint-filter}, {pluginRef: queue-scorer}, {pluginRef: max-score-picker}]
"""
NO_SUBSET_CONFIG = """
plugins:
- {type: queue-scorer}
- {type: max-score-picker, parameters: {maxEndpoints: 16}}
schedulingProfiles:
- plugins: [{pluginRef: queue-scorer}, {pluginRef: max-score-picker}]
"""

endpoints = st.lists(
    st.builds(lambda ip, port, queue, ready, stale: (address(ip, port), queue, ready, stale),
              st.sampled_from(IPS), st.sampled_from(PORTS), st.integers(0, 9), st.booleans(), st.booleans()),
    max_size=8, unique_by=lambda e: e[0],
)
entries = st.one_of(
    st.builds(address, st.sampled_from([*IPS, "9.9.9.9"]), st.sampled_from([*PORTS, 9999])),
    st.sampled_from([*IPS, "9.9.9.9"]),
    st.text(max_size=12),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(endpoints, st.lists(entries, max_size=6), st.booleans(),
       st.sampled_from([None, FAIL_OPEN_CONFIG, NO_SUBSET_CONFIG]), st.integers(0, 2**32 - 1))
def test_any_pool_any_hint_routes_only_inside_the_hint(
    pool_spec: list[tuple[str, int, bool, bool]], hint_entries: list[str], one_string: bool, config: str | None,
    seed: int,
) -> None:
    pool = PoolSnapshot([EndpointState(name=f"pod-{i}", address=a, queue_depth=q, ready=r, stale=s)
                         for i, (a, q, r, s) in enumerate(pool_spec)])
    value = as_string(",".join(hint_entries)) if one_string else as_list(*hint_entries)
    hint = subset_hint(value)
    # the reference answer, computed without the picker's indices: exact address, or same IP for a bare entry
    allowed = {e.address for e in pool.endpoints if e.address in hint or e.ip in hint}
    scheduler = Scheduler.default() if config is None else Scheduler.from_yaml(config)
    try:
        decision = scheduler.schedule(SchedulingRequest(subset=hint), pool, np.random.default_rng(seed))
    except NoEndpointError:
        assert not allowed or not any(pool.ready[pool.index_by_address[a]] for a in allowed)
        return
    assert decision.endpoints and set(decision.endpoints) <= allowed
