"""Request plugins: one registry for every plugin kind, hooks around a request, plugins named in the config."""

from __future__ import annotations

import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from loraplane.picker.extproc import Exchange
from loraplane.picker.lifecycle import FairSharePlugin, InFlightRequest, RequestPlugin
from loraplane.picker.plugins import REGISTRY, PluginKind
from loraplane.picker.scheduler import EndpointPickerConfig, Scheduler
from tests.picker.conftest import BUFFERED, REQUEST_HEADERS, body, headers, make_context

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
    chosen = exchange.destination
    assert recorder.events == [("pre", chosen)]
    assert state.snapshot.in_flight[state.snapshot.index_by_address[chosen]] == 1  # in-flight accounting is a plugin
    exchange.close()
    exchange.close()
    assert recorder.events == [("pre", chosen), ("complete", chosen)]
    assert state.snapshot.in_flight.sum() == 0
