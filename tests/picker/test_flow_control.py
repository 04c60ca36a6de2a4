"""The flow-control queue: band order, per-key round-robin, deadlines, bounds, stop; and held ext_proc exchanges."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from h2.errors import ErrorCodes

from loraplane.picker.director import PickerContext, PickerSettings
from loraplane.picker.extproc import Exchange
from loraplane.picker.flowcontrol import (
    Band,
    FlowControl,
    FlowControlParameters,
    PickerStoppingError,
    QueueFullError,
)
from loraplane.picker.lifecycle import Lifecycle, ManualTimers, PluginRuntime
from loraplane.picker.plugins import SchedulingError
from loraplane.picker.scheduler import EndpointPickerConfig, Scheduler
from loraplane.picker.server import EXT_PROC_SERVICE
from loraplane.picker.snapshot import InFlightTracker
from tests.picker.conftest import (
    BUFFERED,
    REQUEST_HEADERS,
    Picker,
    body,
    eventually,
    header_map,
    headers,
    make_context,
    reports,
    serve_picker,
)
from tests.picker.test_transport_frames import Client, grpc_message

COMPLETION = b'{"model": "claims", "prompt": "hi"}'


class FakeLoop(ManualTimers):
    """The queue's clock, advanced by the test."""

    def advance(self, seconds: float = 0.0) -> None:
        self.run_due(self.now + seconds)


@dataclass(eq=False)
class Request:
    """A waiter that goes out while the shared ``room`` allows."""

    name: str
    room: list[int]
    log: list[str]
    refused: list[tuple[str, int, str]] = field(default_factory=list)

    def try_dispatch(self) -> bool:
        if self.room[0] <= 0:
            return False
        self.room[0] -= 1
        self.log.append(self.name)
        return True

    def refuse(self, error: SchedulingError) -> None:
        self.refused.append((self.name, error.status, error.reason))


def make_queue(pool_size: list[int] | None = None, **params: object) -> tuple[FlowControl, FakeLoop]:
    """A queue on a fake clock; ``pool_size``: the pool's endpoint count it reads (``[n]``, changed by the test)."""
    loop = FakeLoop()
    runtime = PluginRuntime(InFlightTracker(), loop.clock, loop.call_later,
                            pool_size=None if pool_size is None else lambda: pool_size[0])
    return FlowControl(FlowControlParameters.model_validate(params), runtime), loop


def refusals(queue: FlowControl) -> dict[tuple[str, str], float]:
    """``loraplane_picker_queue_refusals_total`` by (band, reason)."""
    return {(s.labels["band"], s.labels["reason"]): s.value for m in queue.refused.collect() for s in m.samples
            if s.name.endswith("_total")}


def test_bands_go_in_priority_order_and_keys_take_turns_inside_a_band() -> None:
    queue, loop = make_queue()
    room, log = [0], []
    arrivals = [("std-a1", 0, "a"), ("std-a2", 0, "a"), ("std-a3", 0, "a"), ("std-b1", 0, "b"), ("shed-c1", -1, "c"),
                ("gold-d1", 10, "d"), ("std-b2", 0, "b"), ("gold-e1", 5, "e"), ("gold-d2", 10, "d")]
    for name, priority, key in arrivals:
        queue.hold(Request(name, room, log), priority, key)
    loop.advance(0.01)
    assert log == [] and queue.size == 9  # no room: all wait, retried on the interval
    room[0] = 100
    loop.advance(0.05)
    assert log == ["gold-d1", "gold-e1", "gold-d2", "std-a1", "std-b1", "std-a2", "std-b2", "std-a3", "shed-c1"]
    assert queue.size == 0


def test_one_slot_at_a_time_goes_to_the_highest_band_then_the_next_key() -> None:
    queue, loop = make_queue()
    room, log = [0], []
    for name, priority, key in [("a1", 0, "a"), ("a2", 0, "a"), ("b1", 0, "b"), ("g1", 1, "g")]:
        queue.hold(Request(name, room, log), priority, key)
    for _ in range(4):
        room[0] = 1
        queue.response_complete(None)  # type: ignore[arg-type]  # a request finished: a round now
        loop.advance(0.0)
    assert log == ["g1", "a1", "b1", "a2"]


def test_a_request_that_outwaits_its_deadline_is_refused_429_ttl_expired_in_every_band() -> None:
    """llm-d-router v0.10: a queue TTL eviction is backpressure (429 ``rejected-ttl-expired``) whatever the priority,
    while the pool has endpoints (before, a non-sheddable request got 503)."""
    queue, loop = make_queue([3], deadlineSeconds={"gold": 1.2, "standard": 1.0, "sheddable": 0.5})
    room, log = [0], []
    gold, standard, sheddable = Request("g", room, log), Request("s", room, log), Request("x", room, log)
    queue.hold(gold, 5, "a")
    queue.hold(standard, 0, "a")
    queue.hold(sheddable, -1, "a")
    loop.advance(0.49)
    assert not sheddable.refused
    loop.advance(0.02)
    assert sheddable.refused == [("x", 429, "rejected-ttl-expired")] and queue.size == 2
    loop.advance(0.5)
    assert standard.refused == [("s", 429, "rejected-ttl-expired")] and queue.size == 1
    loop.advance(0.2)
    assert gold.refused == [("g", 429, "rejected-ttl-expired")] and queue.size == 0
    room[0] = 5
    loop.advance(1.0)
    assert log == []  # refused requests are never dispatched
    assert refusals(queue) == {(band, "rejected-ttl-expired"): 1.0 for band in ("gold", "standard", "sheddable")}


def test_a_deadline_that_passes_while_the_pool_has_no_endpoints_is_503_no_endpoints() -> None:
    """No serving capacity at all is unavailability, not backpressure: 503 ``rejected-no-endpoints``."""
    pool = [2]
    queue, loop = make_queue(pool, deadlineSeconds={"standard": 1.0, "sheddable": 0.5})
    room, log = [0], []
    standard, sheddable = Request("s", room, log), Request("x", room, log)
    queue.hold(standard, 0, "a")
    queue.hold(sheddable, -1, "a")
    pool[0] = 0
    loop.advance(1.0)
    assert standard.refused == [("s", 503, "rejected-no-endpoints")]
    assert sheddable.refused == [("x", 503, "rejected-no-endpoints")]
    assert refusals(queue) == {("standard", "rejected-no-endpoints"): 1.0, ("sheddable", "rejected-no-endpoints"): 1.0}


def test_each_band_is_bounded() -> None:
    queue, _ = make_queue(queueLimit={"standard": 2, "sheddable": 1})
    room, log = [0], []
    queue.hold(Request("s1", room, log), 0, "a")
    queue.hold(Request("s2", room, log), 0, "b")
    with pytest.raises(QueueFullError) as full:
        queue.hold(Request("s3", room, log), 0, "c")
    # llm-d-router v0.10: a queue at capacity refuses 429 rejected-saturated in every band (before: 503 queue-full)
    assert (full.value.status, full.value.reason) == (429, "rejected-saturated")
    queue.hold(Request("x1", room, log), -1, "a")
    with pytest.raises(QueueFullError) as shed:
        queue.hold(Request("x2", room, log), -1, "a")
    assert (shed.value.status, shed.value.reason) == (429, "rejected-saturated")
    queue.hold(Request("g1", room, log), 1, "a")  # gold has its own room
    assert queue.size == 4


def test_stopping_answers_every_waiting_request_and_takes_no_more() -> None:
    queue, loop = make_queue()
    room, log = [0], []
    waiting = [Request(f"r{i}", room, log) for i in range(3)]
    for i, request in enumerate(waiting):
        queue.hold(request, i - 1, "a")
    queue.stop()
    assert [r.refused for r in waiting] == [[(f"r{i}", 503, "rejected-shutting-down")] for i in range(3)]
    assert refusals(queue) == {(band, "rejected-shutting-down"): 1.0 for band in ("gold", "standard", "sheddable")}
    with pytest.raises(PickerStoppingError):
        queue.hold(Request("late", room, log), 0, "a")
    room[0] = 10
    loop.advance(5.0)
    assert log == []


def test_a_cancelled_request_leaves_the_queue() -> None:
    queue, loop = make_queue()
    room, log = [0], []
    gone, stays = Request("gone", room, log), Request("stays", room, log)
    queue.hold(gone, 0, "a")
    queue.hold(stays, 0, "a")
    queue.cancel(gone)
    room[0] = 5
    loop.advance(0.1)
    assert log == ["stays"] and not gone.refused
    assert refusals(queue) == {("standard", "rejected-context-cancelled"): 1.0}  # nobody left to answer


@dataclass(eq=False)
class Refused:
    """A waiter the scheduler refuses when tried: it answers and leaves the queue itself, as the ext_proc exchange
    does (``_refuse`` -> ``close`` -> ``cancel``), then tells the round it is gone."""

    queue: FlowControl
    log: list[str]

    def try_dispatch(self) -> bool:
        self.log.append("refused")
        self.queue.cancel(self)
        return True

    def refuse(self, error: SchedulingError) -> None:
        raise AssertionError("answered already")


def test_a_request_the_scheduler_refuses_at_dispatch_leaves_the_round_going() -> None:
    """Issue 31, item 4: the refused request left the queue inside ``try_dispatch`` and the round removed it again
    (``KeyError``), ending before the other requests were tried and before its next round was due."""
    queue, loop = make_queue()
    room, log = [1], []
    queue.hold(Refused(queue, log), 0, "a")
    queue.hold(Request("next-key", room, log), 0, "b")
    queue.hold(Request("waits", room, log), 0, "c")
    loop.advance(0.0)  # one round: the refusal, then the others in turn
    assert log == ["refused", "next-key"] and queue.size == 1
    room[0] = 1
    loop.advance(0.05)  # the round re-armed the next one
    assert log == ["refused", "next-key", "waits"] and queue.size == 0
    outcomes = {s.labels["outcome"]: s.value for m in queue.wait_seconds.collect() for s in m.samples
                if s.name.endswith("_count")}
    assert outcomes == {"refused": 1, "dispatched": 2}


# --- held ext_proc exchanges ------------------------------------------------------------------------------------

ONE_IN_FLIGHT = EndpointPickerConfig.load().model_dump(by_alias=True)
ONE_IN_FLIGHT["saturationDetector"]["inFlightThreshold"] = 1


def flow_context(**params: object) -> tuple[PickerContext, FakeLoop]:
    ctx, _ = make_context()
    ctx.scheduler = Scheduler(EndpointPickerConfig.model_validate(ONE_IN_FLIGHT))
    loop = FakeLoop()
    runtime = PluginRuntime(ctx.tracker, loop.clock, loop.call_later)
    ctx.lifecycle = Lifecycle.from_specs(runtime, [("flow-control", dict(params))])
    return ctx, loop


def send(ctx: PickerContext, *extra: tuple[str, str]) -> tuple[Exchange, list[pb.ProcessingResponse]]:
    exchange = Exchange(ctx)
    later: list[pb.ProcessingResponse] = []
    exchange.deliver = lambda wires: later.extend(pb.ProcessingResponse.FromString(w) for w in wires)
    exchange.handle(headers([*REQUEST_HEADERS, *extra], body_mode=BUFFERED))
    later.extend(pb.ProcessingResponse.FromString(w) for w in exchange.handle(body(COMPLETION)))
    return exchange, later


def test_a_saturated_request_waits_and_goes_out_when_an_in_flight_request_completes() -> None:
    ctx, loop = flow_context()
    busy = [send(ctx) for _ in range(2)]  # one in flight on each pod holding the revision: both are saturated
    assert all(replies and replies[0].WhichOneof("response") == "request_body" for _, replies in busy)
    waiting, replies = send(ctx)
    assert replies == [] and waiting.waiting
    loop.advance(0.2)
    assert replies == []  # still no room
    freed = busy[1][0].director.destination
    busy[1][0].close()  # ResponseComplete: a dispatch round
    loop.advance(0.0)
    assert [r.WhichOneof("response") for r in replies] == ["request_body"]
    assert waiting.director.destination == freed


def test_a_held_sheddable_request_is_refused_429_at_its_deadline() -> None:
    ctx, loop = flow_context(deadlineSeconds={"sheddable": 0.3})
    for _ in range(2):
        send(ctx)
    _, replies = send(ctx, ("x-gateway-inference-objective", "sheddable"))
    assert replies == []
    loop.advance(0.31)
    (refusal,) = replies
    assert refusal.immediate_response.status.code == 429
    assert header_map(refusal.immediate_response.headers)["x-llm-d-request-dropped-reason"] == "rejected-ttl-expired"


def test_without_a_transport_that_can_answer_later_or_with_the_switch_off_nothing_waits() -> None:
    ctx, _ = flow_context()
    for _ in range(2):
        send(ctx)
    exchange = Exchange(ctx)  # no deliver: it cannot answer later, so it is routed now
    exchange.handle(headers(REQUEST_HEADERS, body_mode=BUFFERED))
    (routed,) = exchange.handle(body(COMPLETION))
    assert pb.ProcessingResponse.FromString(routed).WhichOneof("response") == "request_body"
    ctx, _ = flow_context(enabled=False)
    for _ in range(2):
        send(ctx)
    assert send(ctx)[1][0].WhichOneof("response") == "request_body"  # the saturated pool still routes
    assert ctx.flow_control is None


def test_a_second_request_on_a_held_or_routed_stream_is_refused_400_and_changes_nothing() -> None:
    """A peer that sends a second whole body on one stream: 400 at once; a held request leaves the queue (it was
    queued twice, and the next dispatch round failed on the stale entry), a routed one is not routed again (the
    refusal ends its exchange: its one slot is released)."""
    ctx, loop = flow_context()
    busy = [send(ctx) for _ in range(3)]
    flow = ctx.flow_control
    assert flow is not None and flow.size == 1  # two routed, one held
    (again,) = busy[0][0].handle(body(COMPLETION))
    refusal = pb.ProcessingResponse.FromString(again).immediate_response
    assert refusal.status.code == 400 and sum(ctx.tracker.counts.values()) == 1 and flow.size == 1
    loop.advance(0.0)  # the freed slot goes to the request that waited
    assert [r.WhichOneof("response") for r in busy[2][1]] == ["request_body"] and flow.size == 0
    held, replies = send(ctx)
    _, other_replies = send(ctx)
    assert flow.size == 2
    (again,) = held.handle(body(COMPLETION))
    assert pb.ProcessingResponse.FromString(again).immediate_response.status.code == 400
    assert flow.size == 1 and flow.held_in(Band.STANDARD) == 1
    busy[1][0].close()  # room: a dispatch round
    loop.advance(0.0)
    assert replies == [] and [r.WhichOneof("response") for r in other_replies] == ["request_body"]
    assert flow.size == 0 and flow.held_in(Band.STANDARD) == 0


@pytest.mark.parametrize(("extra", "body_priority"), [((), 0), ((("x-gateway-inference-objective", "sheddable"),), 1)])
def test_runtime_priority_writes_vllms_priority_over_the_clients(extra: tuple[tuple[str, str], ...],
                                                                  body_priority: int) -> None:
    import json

    from loraplane.picker.director import PickerSettings

    ctx, _ = make_context(PickerSettings(runtime_priority=True))
    exchange = Exchange(ctx)
    exchange.handle(headers([*REQUEST_HEADERS, *extra], body_mode=BUFFERED))
    (encoded,) = exchange.handle(body(b'{"model": "claims", "prompt": "hi", "priority": -99}'))
    sent = json.loads(pb.ProcessingResponse.FromString(encoded).request_body.response.body_mutation.body)
    assert sent["priority"] == body_priority and sent["model"] == "claims@v1"


# --- held requests over the real transports (the picker's HTTP/2 server, h2-framed, and grpcio's) -------------------

TRANSPORTS = pytest.mark.parametrize("transport", ["h2", "h2lib", "grpcio"])
PROCESS = f"/{EXT_PROC_SERVICE}/Process"


def held_scheduler(deadline_s: float = 5.0) -> Scheduler:
    deadlines = dict.fromkeys(("gold", "standard", "sheddable"), deadline_s)
    return Scheduler(EndpointPickerConfig.load().with_parameters("flow-control", deadlineSeconds=deadlines))


def set_queue_depth(picker: Picker, depth: int) -> None:
    """Every pod's reported queue (9: all saturated, the request waits; 0: room)."""
    for report in reports(time.time(), queue_depth=depth):
        picker.state.set_report(report)
    picker.state.rebuild()


def queue_length(picker: Picker) -> float:
    """The ``loraplane_picker_queue_length`` gauge, all bands."""
    registry = picker.ctx.metrics.registry
    return sum(registry.get_sample_value("loraplane_picker_queue_length", {"band": band.label}) or 0.0
               for band in Band)


def flow_of(picker: Picker) -> FlowControl:
    flow = picker.ctx.flow_control
    assert flow is not None
    return flow


@TRANSPORTS
@pytest.mark.parametrize("fate", ["room-frees", "deadline", "picker-stops"])
async def test_a_held_request_whose_client_half_closed_still_gets_its_answer(transport: str, fate: str) -> None:
    """The client half-closes right after the body (no more messages, as grpcio's iterator ends): the held request
    is still routed when room frees, or refused with a reason at its deadline or when the picker stops, then the
    call ends OK. Nothing is left queued or in flight."""
    scheduler = held_scheduler(0.3 if fate == "deadline" else 5.0)
    async with serve_picker(transport, PickerSettings(body_mode=BUFFERED), scheduler) as picker:
        set_queue_depth(picker, 9)
        call = asyncio.ensure_future(picker.exchange(headers(REQUEST_HEADERS, body_mode=BUFFERED), body(COMPLETION)))
        await eventually(lambda: flow_of(picker).size == 1)
        if fate == "room-frees":
            set_queue_depth(picker, 0)  # the next dispatch round finds room
        elif fate == "picker-stops":
            flow_of(picker).stop()
        responses = await asyncio.wait_for(call, 5)
        assert responses[0].WhichOneof("response") == "request_headers"
        (answer,) = responses[1:]
        if fate == "room-frees":
            assert answer.WhichOneof("response") == "request_body"
            assert header_map(answer.request_body.response.header_mutation)["x-gateway-destination-endpoint"]
        else:
            status, reason = (429, "rejected-ttl-expired") if fate == "deadline" else (503, "rejected-shutting-down")
            assert answer.immediate_response.status.code == status
            assert header_map(answer.immediate_response.headers)["x-llm-d-request-dropped-reason"] == reason
        assert flow_of(picker).size == 0 and queue_length(picker) == 0
        assert not picker.ctx.tracker.counts


@TRANSPORTS
@pytest.mark.parametrize("half_closed", [False, True], ids=["open", "half-closed"])
@pytest.mark.parametrize("how", ["reset", "connection-closed"])
async def test_a_held_request_whose_client_goes_away_leaves_the_queue(transport: str, half_closed: bool,
                                                                      how: str) -> None:
    """RST_STREAM, or the connection closing, while the request waits: it leaves the queue (the gauge is back to 0)
    and is never dispatched, even when room frees."""
    async with serve_picker(transport, PickerSettings(body_mode=BUFFERED), held_scheduler()) as picker:
        set_queue_depth(picker, 9)
        client = await Client.open(picker.port)
        client.conn.send_headers(1, [(":method", "POST"), (":scheme", "http"), (":path", PROCESS),
                                     (":authority", "picker"), ("content-type", "application/grpc"), ("te", "trailers")])
        messages = headers(REQUEST_HEADERS, body_mode=BUFFERED), body(COMPLETION)
        client.conn.send_data(1, b"".join(grpc_message(m.SerializeToString()) for m in messages),
                              end_stream=half_closed)
        await client.flush()
        await eventually(lambda: flow_of(picker).size == 1)
        assert queue_length(picker) == 1
        if how == "reset":
            client.conn.reset_stream(1, ErrorCodes.CANCEL)
            await client.flush()
        else:
            client.close()
        await eventually(lambda: flow_of(picker).size == 0)
        assert queue_length(picker) == 0
        set_queue_depth(picker, 0)
        await asyncio.sleep(0.2)  # dispatch rounds run: nothing is routed for the request that went
        assert not picker.ctx.tracker.counts
        routed = picker.ctx.metrics.registry.get_sample_value("loraplane_picker_queue_wait_seconds_count",
                                                              {"band": "standard", "outcome": "dispatched"})
        assert not routed
        if how == "reset":
            client.close()


def test_held_requests_the_pool_can_no_longer_take_are_all_answered_in_one_round() -> None:
    """Every pod turns not ready while three requests wait: the next round answers all three 503 no-endpoints
    (before: the first refusal raised KeyError in the round, the others waited for another arrival or their
    deadline)."""
    ctx, state = make_context(scheduler=Scheduler(EndpointPickerConfig.model_validate(ONE_IN_FLIGHT)))
    loop = FakeLoop()
    ctx.lifecycle = Lifecycle.from_specs(PluginRuntime(ctx.tracker, loop.clock, loop.call_later),
                                         [("flow-control", {})])
    for _ in range(2):
        send(ctx)
    held = [send(ctx) for _ in range(3)]
    assert all(replies == [] for _, replies in held)
    for report in reports(time.time()):
        state.set_report(report.model_copy(update={"ready": False}))
    state.rebuild()
    loop.advance(0.05)
    answers = [[(r.immediate_response.status.code,
                 header_map(r.immediate_response.headers)["x-llm-d-request-dropped-reason"]) for r in replies]
               for _, replies in held]
    assert answers == [[(503, "rejected-no-endpoints")]] * 3
    assert ctx.flow_control is not None and ctx.flow_control.size == 0


def test_the_pickers_queue_reads_the_pools_endpoint_count() -> None:
    """What tells a queue deadline in a full pool (429) from one in an empty pool (503) in the picker process."""
    ctx, state = make_context()
    flow = ctx.flow_control
    assert flow is not None and flow.pool_size is not None and flow.pool_size() == 3
    state.reports.clear()
    state.rebuild()
    assert flow.pool_size() == 0


@pytest.mark.parametrize(("pairs", "key"), [
    ((), "acme"),  # no fairness id: the route's tenant
    ((("x-gateway-inference-fairness-id", "old"),), "old"),  # the deprecated name alone
    ((("x-gateway-inference-fairness-id", "old"), ("x-llm-d-inference-fairness-id", "new")), "new"),
    ((("X-LLM-D-Inference-Fairness-Id", "new"),), "new"),  # any case
    ((("x-llm-d-inference-fairness-id", ""), ("x-gateway-inference-fairness-id", "old")), "acme"),  # empty wins: unset
])
def test_the_fairness_key_reads_the_current_header_name_first(pairs: tuple[tuple[str, str], ...], key: str) -> None:
    """llm-d-router v0.10's ``x-llm-d-inference-fairness-id``, its deprecated alias after it (the current name wins
    when both come, even empty), names in any case."""
    ctx, _ = make_context()
    exchange = Exchange(ctx)
    exchange.handle(headers([*REQUEST_HEADERS, *pairs], body_mode=BUFFERED))
    exchange.handle(body(COMPLETION))
    assert exchange.director.inflight is not None and exchange.director.inflight.fairness_key == key


def test_a_held_request_is_decided_again_only_when_an_endpoint_it_could_use_changes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A fleet's queue retries its held heads after every completion anywhere: each retry was a whole decision.
    Now the retry is free until the load of a pod the request could use (a holder of its revision) changes."""
    ctx, loop = flow_context()
    busy = [send(ctx) for _ in range(2)]  # both holders of claims (pod-1, pod-2) saturated
    waiting, replies = send(ctx)
    assert replies == [] and waiting.director.wait_key is not None
    decisions: list[int] = []
    schedule = ctx.scheduler.schedule
    monkeypatch.setattr(ctx.scheduler, "schedule", lambda *args: decisions.append(1) or schedule(*args))
    loop.advance(0.2)  # four retry rounds with nothing changed
    ctx.tracker.start("10.0.0.1:8000", "other@v1")  # pod-0, which does not hold claims, gets busier, then idle again
    loop.advance(0.05)
    ctx.tracker.finish("10.0.0.1:8000", "other@v1")
    loop.advance(0.05)
    assert decisions == [] and replies == []
    busy[0][0].close()  # a holder's request completes: decided again, and sent there
    loop.advance(0.0)
    assert len(decisions) == 1 and [r.WhichOneof("response") for r in replies] == ["request_body"]
    assert waiting.director.destination == busy[0][0].director.destination
