"""Property: whatever bytes a client sends as the body, the picker answers with a route or a 4xx, never a crash."""

from __future__ import annotations

import itertools
import json

import orjson
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loraplane.picker.body import ClientError, parse_body, rewrite_request_model
from loraplane.picker.extproc import Exchange
from tests.picker.conftest import (
    BUFFERED,
    FULL_DUPLEX,
    REQUEST_HEADERS,
    STREAMED,
    body,
    headers,
    make_context,
)


def _dumps(value: object) -> bytes:
    return json.dumps(value).encode()  # the stdlib writes integers of any size, and lone surrogates as escapes


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)

hostile_bodies = st.one_of(
    st.binary(max_size=2048),
    st.binary(max_size=64).map(lambda b: b'{"model": "' + b + b'"}'),  # invalid UTF-8, stray quotes, escapes
    st.integers(min_value=1, max_value=5000).map(lambda depth: b'{"model": "claims", "x": ' + b"[" * depth + b"]" * depth + b"}"),
    st.integers(min_value=1, max_value=400).map(lambda digits: b'{"model": "claims", "n": 1' + b"9" * digits + b"}"),
    st.sampled_from([b'{"model": 1e999}', b'{"model": -1e400}', b'{"model": "claims", "t": 1e400}', b'{"model": "\\ud800"}']),
    json_values.map(lambda v: _dumps({"model": v})),
    json_values.map(_dumps),
    st.text().map(lambda t: _dumps({"model": "claims", "prompt": t})),
)


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(payload=hostile_bodies)
def test_parser_raises_only_client_errors(payload: bytes) -> None:
    try:
        parsed = parse_body(payload, limit=1 << 20)
    except ClientError as exc:
        assert 400 <= exc.status < 500
        return
    rewritten = rewrite_request_model(payload, parsed, "claims@v1")
    assert orjson.loads(rewritten)["model"] == "claims@v1"


def _sent_body(responses: list[pb.ProcessingResponse], original: bytes) -> bytes:
    """The request body Envoy forwards after these replies (per mode: streamed chunks, a replacement or the original)."""
    streamed = [r.request_body.response.body_mutation.streamed_response for r in responses
                if r.WhichOneof("response") == "request_body" and r.request_body.response.body_mutation.HasField("streamed_response")]
    if streamed:
        return b"".join(s.body for s in streamed)
    last = responses[-1].request_body.response
    return last.body_mutation.body if last.body_mutation.HasField("body") else original


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(payload=hostile_bodies, mode=st.sampled_from([BUFFERED, STREAMED, FULL_DUPLEX]),
       cuts=st.lists(st.integers(0, 2048), max_size=3))
def test_exchange_answers_every_body_with_a_route_or_a_4xx(payload: bytes, mode: int, cuts: list[int]) -> None:
    ctx, _ = make_context()
    exchange = Exchange(ctx)
    responses = [pb.ProcessingResponse.FromString(r) for r in exchange.handle(headers(REQUEST_HEADERS, body_mode=mode))]
    bounds = [0, *sorted(c for c in cuts if c < len(payload)), len(payload)]
    pieces = [payload[a:b] for a, b in itertools.pairwise(bounds)]
    for i, piece in enumerate(pieces):
        responses += [pb.ProcessingResponse.FromString(r) for r in exchange.handle(body(piece, i == len(pieces) - 1))]
    kinds = [r.WhichOneof("response") for r in responses]
    if "immediate_response" in kinds:
        assert kinds[-1] == "immediate_response"  # and nothing after it
        assert 400 <= responses[-1].immediate_response.status.code < 500
    else:
        routed = [r for r in responses if r.HasField("dynamic_metadata")]
        assert len(routed) == 1
        assert orjson.loads(_sent_body(responses, payload))["model"] == "claims@v1"
    exchange.close()
    assert not ctx.tracker.counts
