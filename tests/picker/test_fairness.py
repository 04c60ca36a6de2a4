"""Per-tenant fairness under saturation (x-gateway-inference-fairness-id)."""

from __future__ import annotations

import time

import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from loraplane.picker.extproc import Exchange
from loraplane.picker.fairness import FairShare
from loraplane.picker.lifecycle import FairShareParameters, FairSharePlugin
from tests.picker.conftest import BUFFERED, REQUEST_HEADERS, body, header_map, headers, make_context, reports

COMPLETION = b'{"model": "claims", "prompt": "hi"}'


def test_fair_share_arithmetic() -> None:
    share = FairShare(1.5)
    for _ in range(5):
        assert not share.over_share("solo")  # a lone tenant may use everything
        share.start("solo")
    share.start("other")
    assert share.over_share("solo") and not share.over_share("other") and not share.over_share("new")
    for _ in range(5):
        share.finish("solo")
    share.finish("solo")  # never below zero
    assert share.counts == {"other": 1} and share.total == 1
    with pytest.raises(ValueError):
        FairShare(1.0)


def send(ctx, key: str):  # type: ignore[no-untyped-def]
    exchange = Exchange(ctx)
    exchange.handle(headers([*REQUEST_HEADERS, ("x-gateway-inference-fairness-id", key)], body_mode=BUFFERED))
    (encoded,) = exchange.handle(body(COMPLETION))
    return exchange, pb.ProcessingResponse.FromString(encoded)


def test_a_tenant_above_its_share_is_refused_only_while_the_pool_is_saturated() -> None:
    ctx, state = make_context()
    ctx.plugins.add(FairSharePlugin(FairShareParameters(factor=1.5)))
    held = [send(ctx, "big")[0] for _ in range(6)] + [send(ctx, "small")[0]]  # not saturated: all routed
    assert all(e.director.destination for e in held)
    for report in reports(time.time(), queue_depth=9):  # now every pod is saturated
        state.set_report(report)
    state.rebuild()
    _, response = send(ctx, "big")
    assert response.immediate_response.status.code == 429
    assert header_map(response.immediate_response.headers)["x-llm-d-request-dropped-reason"] == "rejected-fairness"
    assert send(ctx, "small")[1].WhichOneof("response") == "request_body"
    for exchange in held[:6]:
        exchange.close()
    assert send(ctx, "big")[1].WhichOneof("response") == "request_body"
