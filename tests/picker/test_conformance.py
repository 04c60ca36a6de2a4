"""Endpoint-picker protocol conformance, by section of GIE's proposal 004 and the reference EPP's behaviour.

Each case is an ext_proc message sequence sent on one real gRPC stream and the exact list of ``ProcessingResponse``s
that must come back (protobuf equality, nothing more, nothing less), run on both transports (the picker's own HTTP/2
server and grpcio's). The pool (tests/picker/conftest.py): 10.0.0.1 holds nothing, 10.0.0.2 holds ``claims@v1`` on
GPU, 10.0.0.3 on CPU; ``claims`` resolves to ``claims@v1``; ``base-llm`` is the base model.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
import pytest
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as pm
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3 import http_status_pb2

from loraplane.picker.director import PickerSettings
from loraplane.picker.scheduler import EndpointPickerConfig, Scheduler
from tests.picker.conftest import (
    BUFFERED,
    FULL_DUPLEX,
    REQUEST_HEADERS,
    STREAMED,
    Picker,
    body,
    headers,
    reports,
    response_body,
    response_headers,
    routed_response,
    serve_picker,
    set_headers,
)

GPU, CPU, EMPTY = "10.0.0.2:8000", "10.0.0.3:8000", "10.0.0.1:8000"
BOTH = f"{GPU},{CPU}"  # the warm pods, GPU first: the destination with fallbacks
COMPLETION = b'{"model":"claims","prompt":"hello","max_tokens":4}'
REWRITTEN = COMPLETION.replace(b'"claims"', b'"claims@v1"')


def with_subset(request: pb.ProcessingRequest, hint: list[object] | str) -> pb.ProcessingRequest:
    """The gateway's subset hint in ``metadata_context`` (a list, or one comma-separated string)."""
    fields = request.metadata_context.filter_metadata["envoy.lb.subset_hint"]
    if isinstance(hint, str):
        fields["x-gateway-destination-endpoint-subset"] = hint
    else:
        fields.get_or_create_list("x-gateway-destination-endpoint-subset").extend(hint)
    return request


def with_served(request: pb.ProcessingRequest, served: str) -> pb.ProcessingRequest:
    """Envoy's report of the endpoint that served, on a response message."""
    request.metadata_context.filter_metadata["envoy.lb"]["x-gateway-destination-endpoint-served"] = served
    return request


def request_headers(mode: int | None, *extra: tuple[str, str], path: str = "/v1/completions") -> pb.ProcessingRequest:
    pairs = [(k, path if k == ":path" else v) for k, v in REQUEST_HEADERS]
    return headers([*pairs, *extra], body_mode=mode)


def sized(data: bytes) -> tuple[int, bytes]:
    return len(data), data


def continue_headers() -> pb.ProcessingResponse:
    return pb.ProcessingResponse(request_headers=pb.HeadersResponse())


def clear_chunk(phase: str) -> pb.ProcessingResponse:
    response = pb.ProcessingResponse()
    getattr(response, phase).response.body_mutation.clear_body = True
    return response


def streamed(phase: str, data: bytes, end: bool) -> pb.ProcessingResponse:
    response = pb.ProcessingResponse()
    getattr(response, phase).response.body_mutation.streamed_response.body = data
    getattr(response, phase).response.body_mutation.streamed_response.end_of_stream = end
    return response


def replaced_response_body(data: bytes, content_length: bool) -> pb.ProcessingResponse:
    common = pb.CommonResponse(body_mutation=pb.BodyMutation(body=data))
    if content_length:
        common.header_mutation.CopyFrom(set_headers([("content-length", str(len(data)))]))
    return pb.ProcessingResponse(response_body=pb.BodyResponse(response=common))


def refused(status: int, code: str, message: str, reason: str) -> pb.ProcessingResponse:
    return pb.ProcessingResponse(immediate_response=pb.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=status),
        headers=set_headers([("content-type", "text/plain"), ("x-llm-d-request-dropped-reason", reason)]),
        body=f"inference error: {code} - {message}".encode(), details=reason))


def no_endpoint(detail: str = "no endpoint left after subset-hint-filter") -> pb.ProcessingResponse:
    return refused(503, "ServiceUnavailable", detail, "rejected-no-endpoints")


REMOVE_LENGTH = pb.ProcessingResponse(response_headers=pb.HeadersResponse(
    response=pb.CommonResponse(header_mutation=pb.HeaderMutation(remove_headers=["content-length"]))))
CONTINUE_RESPONSE_HEADERS = pb.ProcessingResponse(response_headers=pb.HeadersResponse())


def saturate(picker: Picker) -> None:
    for report in reports(time.time(), queue_depth=9):
        picker.state.set_report(report)
    picker.state.rebuild()


def empty_pool(picker: Picker) -> None:
    picker.state.reports.clear()
    picker.state.rebuild()


def saturated_with_objectives(picker: Picker) -> None:
    picker.ctx.objectives = lambda: {"batch-jobs": -3}  # as the InferenceObjective watch provides them
    saturate(picker)


def queues(empty: int, gpu: int, cpu: int) -> Callable[[Picker], None]:
    """Each pod's reported queue (the saturation detector's queue threshold is 5: a queue of 5 is utilisation 1.0)."""

    def setup(picker: Picker) -> None:
        now = time.time()
        for report, depth in zip(reports(now), (empty, gpu, cpu), strict=True):
            picker.state.set_report(report.model_copy(update={"load": report.load.model_copy(
                update={"queue_depth": depth})}))
        picker.state.rebuild()

    return setup


@dataclass
class Case:
    messages: list[pb.ProcessingRequest]
    expected: list[pb.ProcessingResponse]
    settings: PickerSettings = field(default_factory=PickerSettings)
    setup: Callable[[Picker], None] | None = None
    #: the packaged config's flow control (on), or off: the reference EPP without its flowControl feature gate
    flow_control: bool = True
    #: flow control holds the request: the stream stays open until its answer comes, as Envoy keeps it
    held: bool = False


#: deadlines of the flow-control cases (the packaged ones, 1-2 s, would only make the test slower)
DEADLINE_S = 0.2


def scheduler_for(case: Case) -> Scheduler:
    """The packaged config with the case's flow control, its queue's deadlines ``DEADLINE_S``."""
    deadlines = {"gold": DEADLINE_S, "standard": DEADLINE_S, "sheddable": DEADLINE_S}
    return Scheduler(EndpointPickerConfig.load().with_parameters(
        "flow-control", enabled=case.flow_control, deadlineSeconds=deadlines))


def queue_deadline(band: str) -> pb.ProcessingResponse:
    """Every band's deadline is 429 ``rejected-ttl-expired`` while the pool has endpoints (llm-d-router v0.10)."""
    return refused(429, "ResourceExhausted", f"no endpoint had room within the {band} deadline of {DEADLINE_S} s",
                   "rejected-ttl-expired")


SHED = refused(429, "ResourceExhausted", "the pool is saturated and the request is sheddable", "rejected-saturated")


def chat(data: bytes) -> list[pb.ProcessingRequest]:
    return [request_headers(BUFFERED, path="/v1/chat/completions"), body(data)]


def bad_request(message: str) -> list[pb.ProcessingResponse]:
    return [continue_headers(), refused(400, "BadRequest", message, "bad-request")]


JSON_REPLY = b'{"id":"c1","object":"text_completion","model":"claims@v1","choices":[{"text":"hi"}]}'
JSON_BACK = JSON_REPLY.replace(b"claims@v1", b"claims")
SPLIT_REPLY = [JSON_REPLY[:40], JSON_REPLY[40:52], JSON_REPLY[52:]]  # the model field is cut in two
assert all(b'"model":"claims@v1"' not in chunk for chunk in SPLIT_REPLY)

CASES: dict[str, Case] = {
    # --- Endpoint Subset ----------------------------------------------------------------------------------------
    "subset/list-with-unknown-entries-picks-only-the-known-member": Case(
        [with_subset(request_headers(BUFFERED), [CPU, "9.9.9.9:8000", 7]), body(COMPLETION)],
        [continue_headers(), routed_response("request_body", CPU, len(REWRITTEN), REWRITTEN)]),
    "subset/list-entries-holding-comma-separated-addresses": Case(  # GIE v1.6's lightweight picker splits them too
        [with_subset(request_headers(BUFFERED), [f"9.9.9.9:8000, {CPU}"]), body(COMPLETION)],
        [continue_headers(), routed_response("request_body", CPU, len(REWRITTEN), REWRITTEN)]),
    "subset/comma-separated-string": Case(
        [with_subset(request_headers(BUFFERED), f"{CPU}, {GPU}"), body(COMPLETION)],
        [continue_headers(), routed_response("request_body", BOTH, len(REWRITTEN), REWRITTEN)]),
    "subset/bare-ip-matches-any-port": Case(
        [with_subset(request_headers(BUFFERED), ["10.0.0.3"]), body(COMPLETION)],
        [continue_headers(), routed_response("request_body", CPU, len(REWRITTEN), REWRITTEN)]),
    "subset/port-is-exact": Case(
        [with_subset(request_headers(BUFFERED), ["10.0.0.2:9999"]), body(COMPLETION)],
        [continue_headers(), no_endpoint()]),
    "subset/only-unknown-addresses-is-503": Case(
        [with_subset(request_headers(BUFFERED), ["9.9.9.9:8000", "9.9.9.8:8000"]), body(COMPLETION)],
        [continue_headers(), no_endpoint()]),
    "subset/empty-list-is-503": Case(
        [with_subset(request_headers(BUFFERED), []), body(COMPLETION)], [continue_headers(), no_endpoint()]),
    "subset/request-without-body": Case(  # (GET /v1/models the picker answers itself: test_extproc_protocol.py)
        [with_subset(headers([(":method", "GET"), (":path", "/v1/responses")], end_of_stream=True), [EMPTY])],
        [routed_response("request_headers", EMPTY)]),
    # --- Destination Endpoint -----------------------------------------------------------------------------------
    "destination/ordered-fallbacks-in-header-and-metadata": Case(
        [request_headers(BUFFERED), body(COMPLETION)],
        [continue_headers(), routed_response("request_body", BOTH, len(REWRITTEN), REWRITTEN)]),
    "destination/one-endpoint-in-header-and-metadata-without-fallbacks": Case(
        [request_headers(BUFFERED), body(COMPLETION)],
        [continue_headers(), routed_response("request_body", GPU, len(REWRITTEN), REWRITTEN)],
        PickerSettings(destination_fallbacks=False)),
    "destination/one-endpoint-full-duplex-without-fallbacks": Case(
        [request_headers(FULL_DUPLEX), body(COMPLETION)],
        [routed_response("request_headers", GPU, len(REWRITTEN)), streamed("request_body", REWRITTEN, True)],
        PickerSettings(destination_fallbacks=False)),
    # --- Processing modes -----------------------------------------------------------------------------------------
    "modes/buffered": Case(
        [request_headers(BUFFERED), body(COMPLETION)],
        [continue_headers(), routed_response("request_body", BOTH, len(REWRITTEN), REWRITTEN)]),
    "modes/buffered-split-body-is-reassembled": Case(
        [request_headers(BUFFERED), body(COMPLETION[:10], False), body(COMPLETION[10:30], False), body(COMPLETION[30:])],
        [continue_headers(), clear_chunk("request_body"), clear_chunk("request_body"),
         routed_response("request_body", BOTH, len(REWRITTEN), REWRITTEN)]),
    "modes/streamed-asks-for-a-buffered-body": Case(
        [request_headers(STREAMED), body(COMPLETION)],
        [pb.ProcessingResponse(request_headers=pb.HeadersResponse(), mode_override=pm.ProcessingMode(
            request_body_mode=BUFFERED, response_body_mode=STREAMED)),
         routed_response("request_body", BOTH, len(REWRITTEN), REWRITTEN)]),
    "modes/streamed-chunks-when-the-override-is-not-applied": Case(
        [request_headers(STREAMED), body(COMPLETION[:20], False), body(COMPLETION[20:])],
        [pb.ProcessingResponse(request_headers=pb.HeadersResponse(), mode_override=pm.ProcessingMode(
            request_body_mode=BUFFERED, response_body_mode=STREAMED)),
         clear_chunk("request_body"), routed_response("request_body", BOTH, len(REWRITTEN), REWRITTEN)]),
    "modes/full-duplex": Case(
        [request_headers(FULL_DUPLEX), body(COMPLETION[:20], False), body(COMPLETION[20:])],
        [routed_response("request_headers", BOTH, len(REWRITTEN)), streamed("request_body", REWRITTEN, True)]),
    "modes/no-protocol-config-means-full-duplex-by-default": Case(
        [request_headers(None), body(COMPLETION[:20], False), body(COMPLETION[20:])],
        [routed_response("request_headers", BOTH, len(REWRITTEN)), streamed("request_body", REWRITTEN, True)]),
    "modes/no-protocol-config-uses-the-configured-mode": Case(
        [request_headers(None), body(COMPLETION)],
        [continue_headers(), routed_response("request_body", BOTH, len(REWRITTEN), REWRITTEN)],
        PickerSettings(body_mode=BUFFERED)),
    "modes/immediate-response-ends-the-exchange": Case(
        [request_headers(BUFFERED), body(b'{"prompt":"p"}'), response_headers(200), response_body(b"{}", True)],
        [continue_headers(), refused(400, "BadRequest", "request body has no string field 'model'", "bad-request")]),
    "modes/immediate-response-ends-a-full-duplex-exchange": Case(
        [request_headers(FULL_DUPLEX), body(b'{"model":"unknown","prompt":"p"}'), response_headers(200)],
        [refused(404, "NotFound", "model 'unknown' is not served by this pool", "model-not-found")]),
    # --- Errors ---------------------------------------------------------------------------------------------------
    "errors/unknown-model-is-404": Case(
        [request_headers(BUFFERED), body(b'{"model":"claims@v1","prompt":"p"}')],
        [continue_headers(), refused(404, "NotFound", "model 'claims@v1' is not served by this pool", "model-not-found")]),
    "errors/too-large-is-413": Case(
        [request_headers(FULL_DUPLEX), body(b"x" * 600, False), body(b"x" * 600)],
        [refused(413, "PayloadTooLarge", "request body exceeds the limit of 1000 bytes", "body-too-large")],
        PickerSettings(max_body_bytes=1000)),
    "errors/no-endpoint-is-503": Case(
        [request_headers(BUFFERED), body(COMPLETION)],
        [continue_headers(), refused(503, "ServiceUnavailable", "the pool has no endpoints", "rejected-no-endpoints")],
        setup=empty_pool),
    "errors/sheddable-under-saturation-is-429": Case(
        [request_headers(BUFFERED, ("x-gateway-inference-objective", "sheddable")), body(COMPLETION)],
        [continue_headers(), SHED], setup=saturate, flow_control=False),
    # flow control off (llm-d-router's admission without its flowControl gate): a sheddable request is shed when the
    # mean utilisation of the pool, or of the gateway's subset, reaches 1.0, whatever its own candidates are
    "errors/sheddable-is-shed-when-the-pool-mean-reaches-1-though-its-warm-pod-has-room": Case(
        [request_headers(BUFFERED, ("x-llm-d-inference-objective", "sheddable")), body(COMPLETION)],
        [continue_headers(), SHED], setup=queues(empty=9, gpu=0, cpu=9), flow_control=False),
    "errors/sheddable-is-routed-while-the-pool-mean-is-below-1-though-its-candidates-are-saturated": Case(
        [request_headers(BUFFERED, ("x-llm-d-inference-objective", "sheddable")), body(COMPLETION)],
        [continue_headers(), routed_response("request_body", BOTH, len(REWRITTEN), REWRITTEN)],
        setup=queues(empty=0, gpu=5, cpu=6), flow_control=False),
    "errors/sheddable-saturation-is-the-mean-over-the-subset": Case(
        [with_subset(request_headers(BUFFERED, ("x-llm-d-inference-objective", "sheddable")), [GPU]), body(COMPLETION)],
        [continue_headers(), routed_response("request_body", GPU, len(REWRITTEN), REWRITTEN)],
        setup=queues(empty=9, gpu=0, cpu=9), flow_control=False),
    "errors/standard-is-never-shed-when-the-pool-mean-reaches-1": Case(
        [with_subset(request_headers(BUFFERED), [GPU]), body(COMPLETION)],
        [continue_headers(), routed_response("request_body", GPU, len(REWRITTEN), REWRITTEN)],
        setup=saturate, flow_control=False),
    "flow-control/sheddable-under-saturation-waits-its-deadline-then-429": Case(
        [request_headers(BUFFERED, ("x-gateway-inference-objective", "sheddable")), body(COMPLETION)],
        [continue_headers(), queue_deadline("sheddable")], setup=saturate, held=True),
    "flow-control/standard-under-saturation-waits-its-deadline-then-429-while-the-pool-has-endpoints": Case(
        [with_subset(request_headers(BUFFERED), [GPU]), body(COMPLETION)],
        [continue_headers(), queue_deadline("standard")], setup=saturate, held=True),
    # --- Request features -------------------------------------------------------------------------------------------
    # --- model-name rewrite (llm-d-router v0.10): the header names the model the server gets, never resolved; a
    # route for the body's model beats it; the response's model is rewritten back to the client's name
    "rewrite/header-names-the-served-revision-the-body-model-has-no-route": Case(
        [request_headers(BUFFERED, ("x-llm-d-model-name-rewrite", "claims@v1")), body(b'{"model":"alias","prompt":"p"}'),
         response_headers(200), response_body(b'{"model":"claims@v1"}', True)],
        [continue_headers(), routed_response("request_body", BOTH, *sized(b'{"model":"claims@v1","prompt":"p"}')),
         CONTINUE_RESPONSE_HEADERS, replaced_response_body(b'{"model":"alias"}', True)]),
    "rewrite/deprecated-header-name-alone": Case(
        [request_headers(BUFFERED, ("x-gateway-model-name-rewrite", "claims@v1")), body(b'{"model":"alias","prompt":"p"}')],
        [continue_headers(), routed_response("request_body", BOTH, *sized(b'{"model":"claims@v1","prompt":"p"}'))]),
    "rewrite/header-names-in-any-case": Case(
        [request_headers(BUFFERED, ("X-LLM-D-Model-Name-Rewrite", "claims@v1")), body(b'{"model":"alias","prompt":"p"}')],
        [continue_headers(), routed_response("request_body", BOTH, *sized(b'{"model":"claims@v1","prompt":"p"}'))]),
    "rewrite/deprecated-header-name-in-any-case": Case(
        [request_headers(BUFFERED, ("X-Gateway-Model-Name-Rewrite", "claims@v1")), body(b'{"model":"alias","prompt":"p"}')],
        [continue_headers(), routed_response("request_body", BOTH, *sized(b'{"model":"claims@v1","prompt":"p"}'))]),
    "rewrite/the-current-header-name-wins-over-the-deprecated-one": Case(
        [request_headers(BUFFERED, ("x-gateway-model-name-rewrite", "nothing-served"),
                         ("x-llm-d-model-name-rewrite", "claims@v1")), body(b'{"model":"alias","prompt":"p"}')],
        [continue_headers(), routed_response("request_body", BOTH, *sized(b'{"model":"claims@v1","prompt":"p"}'))]),
    "rewrite/the-current-header-name-wins-even-empty": Case(
        [request_headers(BUFFERED, ("x-llm-d-model-name-rewrite", ""), ("x-gateway-model-name-rewrite", "claims@v1")),
         body(b'{"model":"alias","prompt":"p"}')],
        [continue_headers(), refused(404, "NotFound", "model 'alias' is not served by this pool", "model-not-found")]),
    "rewrite/a-route-for-the-body-model-beats-the-header": Case(
        [request_headers(BUFFERED, ("x-llm-d-model-name-rewrite", "base-llm")), body(COMPLETION)],
        [continue_headers(), routed_response("request_body", BOTH, len(REWRITTEN), REWRITTEN)]),
    "rewrite/the-header-is-never-resolved-as-a-logical-name": Case(
        [request_headers(BUFFERED, ("x-llm-d-model-name-rewrite", "claims")), body(b'{"model":"alias","prompt":"p"}')],
        [continue_headers(), refused(404, "NotFound", "model 'claims' (the model-name rewrite header's) is not served "
                                     "by this pool", "model-not-found")]),
    "rewrite/header-names-the-base-model": Case(
        [with_subset(request_headers(BUFFERED, ("x-llm-d-model-name-rewrite", "base-llm")), [EMPTY]),
         body(b'{"model":"alias","prompt":"p"}'), response_headers(200), response_body(b'{"model":"base-llm"}', True)],
        [continue_headers(), routed_response("request_body", EMPTY, *sized(b'{"model":"base-llm","prompt":"p"}')),
         CONTINUE_RESPONSE_HEADERS, replaced_response_body(b'{"model":"alias"}', True)]),
    "rewrite/header-with-a-body-without-model": Case(
        [request_headers(BUFFERED, ("x-llm-d-model-name-rewrite", "claims@v1")), body(b'{"prompt":"p"}'),
         response_headers(200), response_body(b'{"model":"claims@v1"}', True)],
        [continue_headers(), routed_response("request_body", BOTH, *sized(b'{"prompt":"p","model":"claims@v1"}')),
         CONTINUE_RESPONSE_HEADERS, pb.ProcessingResponse(response_body=pb.BodyResponse())]),  # nothing to rewrite back
    "rewrite/header-naming-nothing-served-passes-with-unknown-models-to-base": Case(
        [with_subset(request_headers(BUFFERED, ("x-llm-d-model-name-rewrite", "their-name")), [EMPTY]),
         body(b'{"model":"alias","prompt":"p"}')],
        [continue_headers(), routed_response("request_body", EMPTY, *sized(b'{"model":"their-name","prompt":"p"}'))],
        PickerSettings(unknown_models_to_base=True)),
    # --- objective and fairness headers by their current names, in any case ----------------------------------------
    "request/inference-objective-current-header-name": Case(
        [request_headers(BUFFERED, ("X-LLM-D-Inference-Objective", "batch-jobs")), body(COMPLETION)],
        [continue_headers(), SHED], setup=saturated_with_objectives, flow_control=False),
    "request/inference-objective-the-current-header-name-wins": Case(
        [with_subset(request_headers(BUFFERED, ("x-gateway-inference-objective", "sheddable"),
                                     ("x-llm-d-inference-objective", "standard")), [GPU]), body(COMPLETION)],
        [continue_headers(), routed_response("request_body", GPU, len(REWRITTEN), REWRITTEN)], setup=saturate,
        flow_control=False),
    # --- body checks (llm-d-router v0.10's OpenAI parser) ------------------------------------------------------------
    "body/chat-message-role-not-a-string-is-400": Case(
        chat(b'{"model":"claims","messages":[{"role":123,"content":"hi"}]}'),
        bad_request("invalid chat completions request: messages[0] role must be a string")),
    "body/chat-message-content-not-text-or-parts-is-400": Case(
        chat(b'{"model":"claims","messages":[{"role":"user","content":7}]}'),
        bad_request("invalid chat completions request: messages[0] content must be a string or an array of "
                    "content parts")),
    "body/chat-message-not-an-object-is-400": Case(
        chat(b'{"model":"claims","messages":["hi"]}'),
        bad_request("invalid chat completions request: messages[0] must be an object")),
    "body/chat-tools-not-an-array-is-400": Case(
        chat(b'{"model":"claims","messages":[{"role":"user","content":"hi"}],"tools":"all"}'),
        bad_request("invalid chat completions request: tools must be an array")),
    "body/chat-template-kwargs-not-an-object-is-400": Case(
        chat(b'{"model":"claims","messages":[{"role":"user","content":"hi"}],"chat_template_kwargs":[1]}'),
        bad_request("invalid chat completions request: chat_template_kwargs must be an object")),
    "body/chat-with-content-parts-and-a-tool-call-message-is-routed": Case(
        chat(b'{"model":"claims","messages":[{"role":"user","content":[{"type":"text","text":"hi"},'
             b'{"type":"image_url","image_url":{"url":"u"}}]},{"role":"assistant","content":null,"tool_calls":[]}]}'),
        [continue_headers(), routed_response("request_body", BOTH, *sized(
            b'{"model":"claims@v1","messages":[{"role":"user","content":[{"type":"text","text":"hi"},'
            b'{"type":"image_url","image_url":{"url":"u"}}]},{"role":"assistant","content":null,"tool_calls":[]}]}'))]),
    "body/completion-prompt-of-mixed-types-is-400": Case(
        [request_headers(BUFFERED), body(b'{"model":"claims","prompt":["a",1]}')],
        bad_request("invalid completions request: prompt must hold strings only or token ids only")),
    "body/cache-salt-not-a-string-is-400": Case(
        [request_headers(BUFFERED), body(b'{"model":"claims","prompt":"p","cache_salt":5}')],
        bad_request("invalid completions request: cache_salt must be a string")),
    "body/images-generations-without-prompt-is-400": Case(
        [request_headers(BUFFERED, path="/v1/images/generations"), body(b'{"model":"claims","n":1}')],
        bad_request("invalid images generations request: must have a non-empty 'prompt' field")),
    "body/images-generations-with-an-empty-prompt-is-400": Case(
        [request_headers(BUFFERED, path="/openai/v1/images/generations"), body(b'{"model":"claims","prompt":""}')],
        bad_request("invalid images generations request: prompt must be a non-empty string")),
    "body/images-generations-with-a-prompt-is-routed": Case(
        [request_headers(BUFFERED, path="/v1/images/generations"), body(b'{"model":"claims","prompt":"a cat"}')],
        [continue_headers(), routed_response("request_body", BOTH, *sized(b'{"model":"claims@v1","prompt":"a cat"}'))]),
    "body/chat-render-sub-path-is-checked-as-chat": Case(
        [request_headers(BUFFERED, path="/v1/chat/completions/render"), body(b'{"model":"claims","prompt":"p"}')],
        bad_request("invalid chat completions request: must have a non-empty 'messages' field")),
    "body/api-type-from-x-original-path-without-path": Case(
        [headers([(":method", "POST"), ("x-original-path", "/v1/chat/completions")], body_mode=BUFFERED),
         body(b'{"model":"claims","prompt":"p"}')],
        bad_request("invalid chat completions request: must have a non-empty 'messages' field")),
    "body/api-type-from-x-forwarded-path-without-the-others": Case(
        [headers([(":method", "POST"), ("x-forwarded-path", "/v1/embeddings?x=1")], body_mode=BUFFERED),
         body(b'{"model":"claims","prompt":"p"}')],
        bad_request("invalid embeddings request: must have a non-empty 'input' field")),
    "body/path-wins-over-x-original-path": Case(
        [request_headers(BUFFERED, ("x-original-path", "/v1/chat/completions")), body(COMPLETION)],
        [continue_headers(), routed_response("request_body", BOTH, len(REWRITTEN), REWRITTEN)]),
    "request/completion-without-prompt-is-400": Case(
        [request_headers(BUFFERED), body(b'{"model":"claims"}')],
        [continue_headers(), refused(400, "BadRequest", "invalid completions request: must have a non-empty 'prompt' field",
                                     "bad-request")]),
    "request/chat-without-messages-is-400": Case(
        [request_headers(BUFFERED, path="/v1/chat/completions"), body(b'{"model":"claims"}')],
        [continue_headers(), refused(400, "BadRequest",
                                     "invalid chat completions request: must have a non-empty 'messages' field",
                                     "bad-request")]),
    "request/chat-with-empty-messages-is-400": Case(
        [request_headers(BUFFERED, path="/v1/chat/completions"), body(b'{"model":"claims","messages":[]}')],
        [continue_headers(), refused(400, "BadRequest",
                                     "invalid chat completions request: messages must be a non-empty array",
                                     "bad-request")]),
    "request/embeddings-without-input-is-400": Case(
        [request_headers(BUFFERED, path="/v1/embeddings"), body(b'{"model":"claims"}')],
        [continue_headers(), refused(400, "BadRequest", "invalid embeddings request: must have a non-empty 'input' field",
                                     "bad-request")]),
    "request/responses-without-input-is-400": Case(
        [request_headers(BUFFERED, path="/v1/responses"), body(b'{"model":"claims"}')],
        [continue_headers(), refused(400, "BadRequest", "invalid responses request: must have a non-empty 'input' field",
                                     "bad-request")]),
    "request/chat-with-messages-is-routed": Case(
        [request_headers(BUFFERED, path="/v1/chat/completions"), body(b'{"model":"claims","messages":[{"role":"user"}]}')],
        [continue_headers(), routed_response("request_body", BOTH, *sized(b'{"model":"claims@v1","messages":[{"role":"user"}]}'))]),
    "request/passthrough-parser-forwards-any-body-untouched": Case(
        [with_subset(request_headers(BUFFERED), [EMPTY]), body(b"\x00 not json at all")],
        [continue_headers(), routed_response("request_body", EMPTY)], PickerSettings(passthrough_parser=True)),
    "request/unknown-models-to-base-when-configured": Case(
        [with_subset(request_headers(BUFFERED), [EMPTY]), body(b'{"model":"mystery","prompt":"p"}')],
        [continue_headers(), routed_response("request_body", EMPTY)], PickerSettings(unknown_models_to_base=True)),
    "request/inference-objective-by-name": Case(
        [request_headers(BUFFERED, ("x-gateway-inference-objective", "batch-jobs")), body(COMPLETION)],
        [continue_headers(), SHED], setup=saturated_with_objectives, flow_control=False),
    "request/inference-objective-by-name-with-flow-control": Case(
        [request_headers(BUFFERED, ("x-gateway-inference-objective", "batch-jobs")), body(COMPLETION)],
        [continue_headers(), queue_deadline("sheddable")], setup=saturated_with_objectives, held=True),
    "request/inference-objective-unknown-name-keeps-the-route-priority": Case(
        [with_subset(request_headers(BUFFERED, ("x-gateway-inference-objective", "no-such-objective")), [GPU]),
         body(COMPLETION)],
        [continue_headers(), routed_response("request_body", GPU, len(REWRITTEN), REWRITTEN)], setup=saturate,
        flow_control=False),
    "request/inference-objective-unknown-name-keeps-the-route-priority-with-flow-control": Case(
        [with_subset(request_headers(BUFFERED, ("x-gateway-inference-objective", "no-such-objective")), [GPU]),
         body(COMPLETION)],
        [continue_headers(), queue_deadline("standard")], setup=saturate, held=True),
    # --- Response -------------------------------------------------------------------------------------------------
    "response/buffered-json-rewritten-back": Case(
        [request_headers(BUFFERED), body(COMPLETION), response_headers(200), response_body(JSON_REPLY, True)],
        [continue_headers(), routed_response("request_body", BOTH, len(REWRITTEN), REWRITTEN),
         CONTINUE_RESPONSE_HEADERS, replaced_response_body(JSON_BACK, True)]),
    "response/full-duplex-json-split-over-chunks-rewritten-whole": Case(
        [request_headers(FULL_DUPLEX), body(COMPLETION), response_headers(200),
         *(response_body(c, i == 2) for i, c in enumerate(SPLIT_REPLY))],
        [routed_response("request_headers", BOTH, len(REWRITTEN)), streamed("request_body", REWRITTEN, True),
         REMOVE_LENGTH, streamed("response_body", JSON_BACK, True)]),
    "response/streamed-json-split-over-chunks-rewritten-whole": Case(
        [request_headers(BUFFERED), body(COMPLETION), response_headers(200),
         *(response_body(c, i == 2) for i, c in enumerate(SPLIT_REPLY))],
        [continue_headers(), routed_response("request_body", BOTH, len(REWRITTEN), REWRITTEN), REMOVE_LENGTH,
         clear_chunk("response_body"), clear_chunk("response_body"), replaced_response_body(JSON_BACK, False)],
        setup=None),
    "response/full-duplex-json-then-an-empty-end-chunk": Case(
        [request_headers(FULL_DUPLEX), body(COMPLETION), response_headers(200), response_body(JSON_REPLY, False),
         response_body(b"", True)],
        [routed_response("request_headers", BOTH, len(REWRITTEN)), streamed("request_body", REWRITTEN, True),
         REMOVE_LENGTH, streamed("response_body", JSON_BACK, True)]),
    "response/not-json-passes-through-unchanged": Case(
        [request_headers(FULL_DUPLEX), body(COMPLETION), response_headers(502, "text/plain"),
         response_body(b"no healthy upstream", True)],
        [routed_response("request_headers", BOTH, len(REWRITTEN)), streamed("request_body", REWRITTEN, True),
         REMOVE_LENGTH, streamed("response_body", b"no healthy upstream", True)]),
    "response/response-phases-only-pass-through": Case(
        [response_headers(200), response_body(b'{"model":"claims@v1"}', True)],
        [CONTINUE_RESPONSE_HEADERS, streamed("response_body", b'{"model":"claims@v1"}', True)]),
    "modes/full-duplex-headers-without-end-get-no-reply-yet": Case(
        [request_headers(FULL_DUPLEX)], []),
    "response/full-duplex-sse-chunk-by-chunk": Case(
        [request_headers(FULL_DUPLEX), body(COMPLETION), response_headers(200, "text/event-stream"),
         response_body(b'data: {"model":"claims@v1"}\n\n', False), response_body(b"data: [DONE]\n\n", True)],
        [routed_response("request_headers", BOTH, len(REWRITTEN)), streamed("request_body", REWRITTEN, True),
         REMOVE_LENGTH, streamed("response_body", b'data: {"model":"claims"}\n\n', False),
         streamed("response_body", b"data: [DONE]\n\n", True)]),
}
# the streamed-response case: request BUFFERED, response STREAMED (protocol_config carries both modes)
CASES["response/streamed-json-split-over-chunks-rewritten-whole"].messages[0].protocol_config.response_body_mode = STREAMED


async def exchange_held(picker: Picker, messages: list[pb.ProcessingRequest], count: int) -> list[object]:
    """Send ``messages``, read ``count`` responses, then half-close; anything after that counts too."""
    call = picker.stub.Process()
    for message in messages:
        await call.write(message)
    responses = [await call.read() for _ in range(count)]
    await call.done_writing()
    while (more := await call.read()) is not grpc.aio.EOF:
        responses.append(more)
    return responses


@pytest.mark.parametrize("transport", ["h2", "grpcio"])
@pytest.mark.parametrize("name", list(CASES))
async def test_case(name: str, transport: str) -> None:
    case = CASES[name]
    async with serve_picker(transport, case.settings, scheduler_for(case)) as picker:
        if case.setup is not None:
            case.setup(picker)
        if case.held:
            responses = await exchange_held(picker, case.messages, len(case.expected))
        else:
            responses = await picker.exchange(*case.messages)
        assert responses == case.expected
        assert not picker.ctx.tracker.counts  # the stream ended: nothing left in flight


@pytest.mark.parametrize("transport", ["h2", "grpcio"])
async def test_served_endpoint_moves_the_in_flight_count(transport: str) -> None:
    """Section "Destination Endpoint Served": Envoy used the fallback; the in-flight count follows it."""
    async with serve_picker(transport) as picker:
        call = picker.stub.Process()
        await call.write(request_headers(FULL_DUPLEX))
        await call.write(body(COMPLETION))
        assert (await call.read()) == routed_response("request_headers", BOTH, len(REWRITTEN))
        await call.read()
        assert picker.ctx.tracker.counts == {GPU: 1}
        await call.write(with_served(response_headers(200), CPU))
        assert (await call.read()) == REMOVE_LENGTH
        assert picker.ctx.tracker.counts == {CPU: 1}
        assert picker.ctx.metrics.destination_overrides._value.get() == 1
        await call.write(response_body(b"{}", True))
        await call.read()
        await call.done_writing()
        assert picker.ctx.tracker.counts == {}


@pytest.mark.parametrize("transport", ["h2", "grpcio"])
async def test_model_name_rewrites_are_counted(transport: str) -> None:
    async with serve_picker(transport, PickerSettings(body_mode=BUFFERED)) as picker:
        await picker.exchange(request_headers(None, ("x-llm-d-model-name-rewrite", "claims@v1")),
                              body(b'{"model":"alias","prompt":"p"}'))
        await picker.exchange(request_headers(None, ("x-gateway-model-name-rewrite", "claims@v1")), body(COMPLETION))
        await picker.exchange(request_headers(None, ("x-gateway-model-name-rewrite", "claims@v1")),
                              body(b'{"model":"claims@v1","prompt":"p"}'))
        # the second's body model has a route (it beats the header), the third names the header's model already
        assert picker.ctx.metrics.model_rewrites._value.get() == 1


@pytest.mark.parametrize("transport", ["h2", "grpcio"])
async def test_after_an_immediate_response_nothing_more_is_answered(transport: str) -> None:
    async with serve_picker(transport) as picker:
        call = picker.stub.Process()
        await call.write(request_headers(FULL_DUPLEX))
        await call.write(body(b"{broken"))
        assert (await call.read()).HasField("immediate_response")
        await call.write(response_headers(200))
        await call.write(response_body(b"{}", True))
        await call.done_writing()
        assert await asyncio.wait_for(call.read(), 5) is grpc.aio.EOF
        assert await call.code() == grpc.StatusCode.OK
