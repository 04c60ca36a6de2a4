"""ext_proc protocol conformance at the gRPC level: ProcessingRequests in, ProcessingResponses out (both transports)."""

from __future__ import annotations

import asyncio
import time

import grpc
import orjson
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from grpc_health.v1 import health_pb2, health_pb2_grpc

from loraplane.picker.extproc import ERROR_CODES
from loraplane.picker.scheduler import EndpointPickerConfig, Scheduler
from loraplane.picker.wire import MAX_BODY_CHUNK
from tests.picker.conftest import (
    ADDRESSES,
    BUFFERED,
    FULL_DUPLEX,
    REQUEST_HEADERS,
    Picker,
    body,
    header_map,
    headers,
    reports,
    response_body,
    response_headers,
    route_table,
    serve_picker,
)

COMPLETION = orjson.dumps({"model": "claims", "prompt": "hello", "max_tokens": 4, "n": 12345678901234567890})


def routed_to(response: pb.ProcessingResponse) -> list[str]:
    phase = response.WhichOneof("response")
    common = getattr(response, phase).response
    assert common.clear_route_cache
    value = header_map(common.header_mutation)["x-gateway-destination-endpoint"]
    metadata = response.dynamic_metadata.fields["envoy.lb"].struct_value.fields["x-gateway-destination-endpoint"]
    assert metadata.string_value == value
    return value.split(",")


async def test_buffered_body_is_routed_to_the_warm_pod_and_rewritten(picker: Picker) -> None:
    first, second = await picker.exchange(headers(REQUEST_HEADERS, body_mode=BUFFERED), body(COMPLETION))
    assert first.WhichOneof("response") == "request_headers"
    assert not first.request_headers.response.HasField("header_mutation")  # plain CONTINUE
    assert second.WhichOneof("response") == "request_body"
    endpoints = routed_to(second)
    assert endpoints == [ADDRESSES[1], ADDRESSES[2]]  # GPU-warm first, then the CPU-warm fallback; pod 0 cannot serve
    new_body = second.request_body.response.body_mutation.body
    assert orjson.loads(new_body)["model"] == "claims@v1"
    assert new_body == COMPLETION.replace(b'"claims"', b'"claims@v1"')  # everything else byte-exact
    assert header_map(second.request_body.response.header_mutation)["content-length"] == str(len(new_body))


async def test_full_duplex_streamed_body_is_reassembled_and_sent_back_in_chunks(picker: Picker) -> None:
    big = orjson.dumps({"model": "claims", "prompt": "x" * 150_000})
    pieces = [big[i : i + 40_000] for i in range(0, len(big), 40_000)]
    messages = [headers(REQUEST_HEADERS, body_mode=FULL_DUPLEX)]
    messages += [body(p, end_of_stream=i == len(pieces) - 1) for i, p in enumerate(pieces)]
    responses = await picker.exchange(*messages)
    head, *chunks = responses
    assert head.WhichOneof("response") == "request_headers"
    assert routed_to(head)[0] == ADDRESSES[1]
    streamed = [c.request_body.response.body_mutation.streamed_response for c in chunks]
    assert all(len(s.body) <= MAX_BODY_CHUNK for s in streamed)
    assert [s.end_of_stream for s in streamed] == [False] * (len(streamed) - 1) + [True]
    rebuilt = b"".join(s.body for s in streamed)
    assert orjson.loads(rebuilt) == {"model": "claims@v1", "prompt": "x" * 150_000}
    assert header_map(head.request_headers.response.header_mutation)["content-length"] == str(len(rebuilt))


async def test_request_without_body_goes_to_any_endpoint(picker: Picker) -> None:
    (response,) = await picker.exchange(headers([(":method", "GET"), (":path", "/v1/responses")], end_of_stream=True))
    assert response.WhichOneof("response") == "request_headers"
    assert routed_to(response)[0] in ADDRESSES


@pytest.mark.parametrize("path", ["/v1/models", "/v1/models?limit=5"])
async def test_models_lists_the_route_tables_names_in_vllms_shape(picker: Picker, path: str) -> None:
    """A client (inference-perf checks every adapter of its ``lora_traffic_split`` here) gets the names it may send:
    the base model and the logical names, not the served names of whichever pod the request would reach."""
    before = time.time()
    (response,) = await picker.exchange(headers([(":method", "GET"), (":path", path)], end_of_stream=True))
    answer = response.immediate_response
    assert answer.status.code == 200
    assert header_map(answer.headers)["content-type"] == "application/json"
    listing = orjson.loads(answer.body)
    assert listing["object"] == "list"
    assert [(m["id"], m["root"], m["parent"]) for m in listing["data"]] == [
        ("base-llm", "base-llm", None), ("claims", "claims@v1", "base-llm")]
    for card in listing["data"]:  # vLLM's ModelCard keys
        assert set(card) == {"id", "object", "created", "owned_by", "root", "parent", "max_model_len", "permission"}
        assert card["object"] == "model" and before - 1 <= card["created"] <= time.time() + 1
        assert card["permission"][0]["object"] == "model_permission"


async def test_models_follows_the_route_table(picker: Picker) -> None:
    picker.state.set_routes(route_table(canary_weight=60).model_copy(update={"generation": 2}))
    picker.state.rebuild()
    (response,) = await picker.exchange(headers([(":method", "GET"), (":path", "/v1/models")], end_of_stream=True))
    cards = orjson.loads(response.immediate_response.body)["data"]
    assert [(m["id"], m["root"]) for m in cards] == [("base-llm", "base-llm"), ("claims", "claims@v2")]


async def test_subset_hint_is_honoured(picker: Picker) -> None:
    _, routed = await picker.exchange(headers(REQUEST_HEADERS, body_mode=BUFFERED, subset=["10.0.0.3:8000"]), body(COMPLETION))
    assert routed_to(routed) == ["10.0.0.3:8000"]
    _, refused = await picker.exchange(headers(REQUEST_HEADERS, body_mode=BUFFERED, subset=[]), body(COMPLETION))
    assert refused.immediate_response.status.code == 503


@pytest.mark.parametrize(
    ("payload", "status", "reason"),
    [
        (b'{"model": "unknown-model", "prompt": "p"}', 404, "model-not-found"),
        (b'{"model": "claims@v1", "prompt": "p"}', 404, "model-not-found"),
        (b'{"prompt": "no model"}', 400, "bad-request"),
        (b'{"model": 7}', 400, "bad-request"),
        (b"[1, 2]", 400, "bad-request"),
        (b"{not json", 400, "bad-request"),
        (b"", 400, "bad-request"),
        (b'{"model": "claims", "prompt": "' + b"x" * (2 << 20) + b'"}', 413, "body-too-large"),
    ],
)
async def test_client_errors_become_immediate_responses(picker: Picker, payload: bytes, status: int, reason: str) -> None:
    _, response = await picker.exchange(headers(REQUEST_HEADERS, body_mode=BUFFERED), body(payload))  # the call itself ends OK
    immediate = response.immediate_response
    assert immediate.status.code == status
    assert immediate.body.decode().startswith(f"inference error: {ERROR_CODES[status]} - ")
    assert header_map(immediate.headers)["x-llm-d-request-dropped-reason"] == reason
    assert not picker.ctx.tracker.counts  # nothing left in flight


@pytest.mark.parametrize("transport", ["h2", "grpcio"])
async def test_no_endpoint_is_503_and_saturated_sheddable_is_429_without_flow_control(transport: str) -> None:
    """The reference EPP without its flowControl gate (the queue's own refusals: tests/picker/test_conformance.py)."""
    off = Scheduler(EndpointPickerConfig.load().with_parameters("flow-control", enabled=False))
    async with serve_picker(transport, scheduler=off) as picker:
        await _refusals_without_a_queue(picker)


async def _refusals_without_a_queue(picker: Picker) -> None:
    picker.state.reports.clear()
    picker.state.rebuild()
    _, response = await picker.exchange(headers(REQUEST_HEADERS, body_mode=BUFFERED), body(COMPLETION))
    assert response.immediate_response.status.code == 503
    for report in reports(time.time(), queue_depth=9):  # every pod above the queue threshold
        picker.state.set_report(report)
    picker.state.rebuild()
    sheddable = [*REQUEST_HEADERS, ("x-gateway-inference-objective", "sheddable")]
    _, shed = await picker.exchange(headers(sheddable, body_mode=BUFFERED), body(COMPLETION))
    assert shed.immediate_response.status.code == 429
    assert header_map(shed.immediate_response.headers)["x-llm-d-request-dropped-reason"] == "rejected-saturated"
    _, kept = await picker.exchange(headers(REQUEST_HEADERS, body_mode=BUFFERED), body(COMPLETION))  # standard priority still goes
    assert routed_to(kept)


async def test_buffered_response_model_is_rewritten_back(picker: Picker) -> None:
    reply = b'{"id":"c1","model":"claims@v1","choices":[{"text":"hi"}]}'
    messages = [headers(REQUEST_HEADERS, body_mode=BUFFERED), body(COMPLETION), response_headers(200),
                response_body(reply, end_of_stream=True)]
    _, routed, head, tail = await picker.exchange(*messages)
    destination = routed_to(routed)[0]
    assert head.WhichOneof("response") == "response_headers"
    common = tail.response_body.response
    assert orjson.loads(common.body_mutation.body)["model"] == "claims"
    assert header_map(common.header_mutation)["content-length"] == str(len(common.body_mutation.body))
    assert destination not in picker.ctx.tracker.counts  # response end released the in-flight slot
    assert picker.ctx.stats.counters["claims@v1"].requests >= 1


async def test_streamed_sse_response_is_passed_through_chunk_by_chunk(picker: Picker) -> None:
    events = [b'data: {"model":"claims@v1","choices":[{"text":"a"}]}\n\n',
              b'data: {"model": "claims@v1","choices":[{"text":"b"}]}\n\n', b"data: [DONE]\n\n"]
    messages = [headers(REQUEST_HEADERS, body_mode=FULL_DUPLEX), body(COMPLETION),
                response_headers(200, "text/event-stream")]
    messages += [response_body(e, end_of_stream=i == len(events) - 1) for i, e in enumerate(events)]
    responses = await picker.exchange(*messages)
    head = next(r for r in responses if r.WhichOneof("response") == "response_headers")
    assert "content-length" in head.response_headers.response.header_mutation.remove_headers
    out = [r.response_body.response.body_mutation.streamed_response for r in responses
           if r.WhichOneof("response") == "response_body"]
    assert len(out) == len(events)
    assert out[0].body == events[0].replace(b"claims@v1", b"claims")
    assert out[1].body == events[1].replace(b"claims@v1", b"claims")
    assert out[2].body == events[2] and out[2].end_of_stream


async def test_model_server_errors_and_ttft_are_counted(picker: Picker) -> None:
    await picker.exchange(headers(REQUEST_HEADERS, body_mode=BUFFERED), body(COMPLETION), response_headers(503, end_of_stream=True))
    counters = picker.ctx.stats.counters["claims@v1"]
    assert counters.errors == 1 and counters.ttft_count == 1


async def test_an_abandoned_stream_releases_its_in_flight_slot(picker: Picker) -> None:
    call = picker.stub.Process()
    await call.write(headers(REQUEST_HEADERS, body_mode=BUFFERED))
    await call.read()
    await call.write(body(COMPLETION))
    routed = await call.read()
    destination = routed_to(routed)[0]
    assert picker.ctx.tracker.counts == {destination: 1}
    call.cancel()
    for _ in range(100):
        if not picker.ctx.tracker.counts:
            break
        await asyncio.sleep(0.01)
    assert not picker.ctx.tracker.counts


async def test_grpc_health_services(picker: Picker) -> None:
    stub = health_pb2_grpc.HealthStub(picker.channel)
    for service in ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
        reply = await stub.Check(health_pb2.HealthCheckRequest(service=service))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    await picker.health.set(False)
    assert (await stub.Check(health_pb2.HealthCheckRequest(service="readiness"))).status == health_pb2.HealthCheckResponse.NOT_SERVING
    assert (await stub.Check(health_pb2.HealthCheckRequest(service="liveness"))).status == health_pb2.HealthCheckResponse.SERVING
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Check(health_pb2.HealthCheckRequest(service="nope"))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
