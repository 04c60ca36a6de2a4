"""Request plugins: one registry for every plugin kind, hooks around a request, plugins named in the config."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from loraplane.api import ApiModel
from loraplane.picker.extproc import NONE, Exchange
from loraplane.picker.lifecycle import (
    FairSharePlugin,
    InFlightRequest,
    Lifecycle,
    PluginRuntime,
    RequestPlugin,
)
from loraplane.picker.plugins import REGISTRY, Cycle, PluginKind, PluginType, SchedulingRequest, register
from loraplane.picker.scheduler import EndpointPickerConfig, Scheduler
from loraplane.picker.snapshot import EndpointState, InFlightTracker, PoolSnapshot
from tests.picker.conftest import (
    ADDRESSES,
    BUFFERED,
    REQUEST_HEADERS,
    STREAMED,
    body,
    headers,
    make_context,
    response_body,
    response_headers,
)

COMPLETION = b'{"model": "claims", "prompt": "hi"}'
CONFIG = """
plugins:
- {type: residency-affinity-scorer}
- {name: share, type: fair-share, parameters: {factor: 1.5}}
- type: max-score-picker
schedulingProfiles:
- plugins: [{pluginRef: residency-affinity-scorer, weight: 100}, {pluginRef: share}, {pluginRef: max-score-picker}]
"""


class Recorder(RequestPlugin):
    def __init__(self) -> None:
        self.events: list[tuple[str, str | None]] = []

    def pre_request(self, request: InFlightRequest) -> None:
        self.events.append(("pre", request.endpoint))

    def response_complete(self, request: InFlightRequest) -> None:
        self.events.append(("complete", request.endpoint))


def test_one_registry_holds_every_kind() -> None:
    kinds = {t.kind for t in REGISTRY.values()}
    assert kinds == set(PluginKind)
    assert REGISTRY["max-score-picker"].kind is PluginKind.PICKER
    assert REGISTRY["fair-share"].kind is PluginKind.REQUEST


def test_bad_parameters_and_unknown_types_are_config_errors() -> None:
    with pytest.raises(ValueError, match="factor"):
        EndpointPickerConfig.from_yaml(CONFIG.replace("factor: 1.5", "factor: 0.5"))
    with pytest.raises(ValueError, match="unknown plugin type 'no-such'"):
        EndpointPickerConfig.from_yaml(CONFIG.replace("type: fair-share", "type: no-such"))


def test_request_plugins_come_from_the_config_profile() -> None:
    ctx, _ = make_context()
    ctx.scheduler = Scheduler.from_yaml(CONFIG)
    ctx.lifecycle = None
    ctx.__post_init__()
    assert [type(p).__name__ for p in ctx.plugins.plugins] == ["InFlightAccounting", "FairSharePlugin"]
    assert isinstance(ctx.plugins.find(FairSharePlugin), FairSharePlugin)


def test_hooks_run_once_before_sending_and_once_at_the_end() -> None:
    ctx, state = make_context()
    recorder = Recorder()
    ctx.plugins.add(recorder)
    exchange = Exchange(ctx)
    exchange.handle(headers(REQUEST_HEADERS, body_mode=BUFFERED))
    (encoded,) = exchange.handle(body(COMPLETION))
    assert pb.ProcessingResponse.FromString(encoded).WhichOneof("response") == "request_body"
    chosen = exchange.director.destination
    assert recorder.events == [("pre", chosen)]
    assert state.snapshot.in_flight[state.snapshot.index_by_address[chosen]] == 1  # in-flight accounting is a plugin
    exchange.close()
    exchange.close()
    assert recorder.events == [("pre", chosen), ("complete", chosen)]
    assert state.snapshot.in_flight.sum() == 0


class _WatchingScorer:
    """One plugin at three hook points: a scorer (with no opinion), a prepare-data stage, request hooks."""

    def __init__(self, _parameters: ApiModel) -> None:
        self.prepared: list[int] = []
        self.hooks = Recorder()

    def prepare(self, _request: SchedulingRequest, pool: PoolSnapshot, cycle: Cycle) -> None:
        self.prepared.append(int(cycle.candidates.sum()))  # before the filters: every endpoint is in

    def __call__(self, _request: SchedulingRequest, _pool: PoolSnapshot, _cycle: Cycle) -> None:
        return None

    def request_hooks(self, _runtime: PluginRuntime) -> RequestPlugin:
        return self.hooks


class _NoParameters(ApiModel):
    pass


@pytest.fixture
def watching_scorer() -> Iterator[None]:
    """``test-watching-scorer`` registered for the test only."""
    register("test-watching-scorer", PluginType(PluginKind.SCORER, _NoParameters, _WatchingScorer))
    yield
    del REGISTRY["test-watching-scorer"]


@pytest.mark.usefixtures("watching_scorer")
def test_one_plugin_serves_several_hook_points_at_any_weight() -> None:
    """A scorer that also prepares data and hooks requests gets each called (as the prefix scorer does: match once
    per cycle, learn where the request went), from the config alone: the scheduler knows no plugin by name."""
    ctx, _ = make_context()
    ctx.scheduler = Scheduler.from_yaml(CONFIG.replace(
        "- type: max-score-picker\n", "- type: max-score-picker\n- {type: test-watching-scorer}\n").replace(
        "{pluginRef: max-score-picker}]", "{pluginRef: max-score-picker}, {pluginRef: test-watching-scorer, weight: 0}]"))
    ctx.lifecycle = None
    ctx.__post_init__()
    (watcher,) = [p for p in ctx.scheduler.preparers if isinstance(p, _WatchingScorer)]
    exchange = Exchange(ctx)
    exchange.handle(headers(REQUEST_HEADERS, body_mode=BUFFERED))
    exchange.handle(body(COMPLETION))
    chosen = exchange.director.destination
    exchange.close()
    assert watcher.prepared == [len(ADDRESSES)]  # once for the one cycle
    assert watcher.hooks.events == [("pre", chosen), ("complete", chosen)]


class StartRecorder(Recorder):
    def response_started(self, request: InFlightRequest) -> None:
        self.events.append(("started", request.endpoint))


def _sent(body_mode: int = BUFFERED) -> tuple[Exchange, StartRecorder, PoolSnapshot, int]:
    ctx, state = make_context()
    recorder = StartRecorder()
    ctx.plugins.add(recorder)
    exchange = Exchange(ctx)
    exchange.handle(headers(REQUEST_HEADERS, body_mode=body_mode))
    exchange.handle(body(COMPLETION))
    assert exchange.director.destination is not None
    snapshot = state.snapshot
    return exchange, recorder, snapshot, snapshot.index_by_address[exchange.director.destination]


def test_the_first_response_body_chunk_starts_the_response_once() -> None:
    exchange, recorder, snapshot, chosen = _sent(STREAMED)
    assert snapshot.prefilling[chosen] == 1 and snapshot.in_flight[chosen] == 1
    assert snapshot.prefill_tokens[chosen] == len(COMPLETION) // 4  # the prompt estimated from the body's size
    exchange.handle(response_headers(200, "text/event-stream"))
    assert snapshot.prefilling[chosen] == 1  # headers come before the first token (vLLM streams them at once)
    exchange.handle(response_body(b'data: {"choices": [{"text": "a"}]}\n\n', end_of_stream=False))
    exchange.handle(response_body(b'data: {"choices": [{"text": "b"}]}\n\n', end_of_stream=False))
    assert snapshot.prefilling[chosen] == 0 and snapshot.in_flight[chosen] == 1 and snapshot.prefill_tokens.sum() == 0
    exchange.handle(response_body(b"data: [DONE]\n\n", end_of_stream=True))
    address = snapshot.addresses[chosen]
    assert recorder.events == [("pre", address), ("started", address), ("complete", address)]
    assert snapshot.prefilling.sum() == 0 and snapshot.in_flight.sum() == 0


def test_response_headers_start_the_response_when_envoy_sends_no_response_body() -> None:
    exchange, recorder, snapshot, chosen = _sent()
    exchange.response_body_mode = NONE  # what the stream's protocol_config says for response_body_mode: NONE
    exchange.handle(response_headers(200))
    assert snapshot.prefilling[chosen] == 0 and snapshot.in_flight[chosen] == 1
    exchange.close()
    assert [event for event, _ in recorder.events] == ["pre", "started", "complete"]
    assert snapshot.in_flight.sum() == 0


def test_a_response_that_never_reaches_the_picker_leaves_the_prefill_count_at_completion() -> None:
    exchange, recorder, snapshot, chosen = _sent()
    assert snapshot.prefilling[chosen] == 1
    exchange.close()  # response messages skipped by Envoy, or the client went away
    assert [event for event, _ in recorder.events] == ["pre", "complete"]
    assert snapshot.prefilling.sum() == 0 and snapshot.in_flight.sum() == 0


def test_moving_to_the_endpoint_envoy_reports_moves_the_prefill_count_only_before_the_first_token() -> None:
    tracker = InFlightTracker()
    snapshot = PoolSnapshot([EndpointState(name=f"p{i}", address=a) for i, a in enumerate(ADDRESSES)])
    tracker.attach(snapshot)
    plugins = Lifecycle(PluginRuntime(tracker, lambda: 0.0))
    # the chosen endpoint was expected to hold 200 of its 500 tokens; the one Envoy reports holds none of them
    first = InFlightRequest(SchedulingRequest("claims@v1", prompt_tokens=500), "acme", ADDRESSES[0],
                            prefill_tokens=300)
    plugins.pre_request(first)
    assert snapshot.prefill_tokens.tolist() == [300, 0, 0]
    plugins.moved(first, ADDRESSES[1])  # before its response started: the prefill count moves with it
    assert snapshot.prefilling.tolist() == [0, 1, 0] and snapshot.in_flight.tolist() == [0, 1, 0]
    assert snapshot.prefill_tokens.tolist() == [0, 500, 0]
    assert tracker.own()[ADDRESSES[1]].prefill_tokens == 500  # what this replica publishes to the others
    plugins.response_started(first)
    plugins.response_started(first)  # once only
    assert snapshot.prefilling.tolist() == [0, 0, 0] and snapshot.prefill_tokens.tolist() == [0, 0, 0]
    plugins.moved(first, ADDRESSES[2])  # after: only the in-flight count moves
    assert snapshot.prefilling.tolist() == [0, 0, 0] and snapshot.in_flight.tolist() == [0, 0, 1]
    plugins.response_complete(first)
    assert snapshot.in_flight.sum() == 0 and snapshot.prefilling.sum() == 0 and not tracker.prefilling
