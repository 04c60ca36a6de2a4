"""The scrape data source: vLLM's metrics parsed, scraped over real HTTP (aiohttp servers serving a vLLM-shaped
/metrics), turned stale when a pod stops answering, and the picker run with ``--data-source scrape`` routing model
names as given through a real ext_proc stream."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator

import grpc
import orjson
import pytest
from aiohttp import web
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from e2e.fixtures.processes import free_port
from loraplane.api import vllm_metrics
from loraplane.api.vllm_metrics import LoadedAdapter, parse_metrics, parse_series, read_metrics
from loraplane.picker.cli import main as picker_main
from loraplane.picker.scrape import (
    MetricsScraper,
    PassthroughResolver,
    ScrapedPool,
    scrape_offset,
    scraping,
    until_offset,
)
from loraplane.picker.server import ServerOptions, serve
from loraplane.picker.snapshot import InFlightTracker, PoolSnapshot
from tests.picker.conftest import BUFFERED, REQUEST_HEADERS, body, eventually, header_map, headers
from tests.picker.vllm_text import exposition

# --- parsing ---------------------------------------------------------------------------------------------------------


def test_the_fast_parse_reads_what_prometheus_clients_parser_reads() -> None:
    text = exposition(model='base "llm"\\x', waiting=6, running=4, kv=0.4, engines=2,
                      lora_info=[(["a", "b"], ["a", "b"], 100.0), (["b"], ["b"], 300.0)],
                      loaded={"a": ("gpu", False), "b": ("cpu", True)}, max_gpu=4)
    fast, full = parse_series(text), parse_metrics(text)
    assert set(fast) == {n for n in vllm_metrics.PICKER_SERIES if n in full}
    for name, series in fast.items():
        assert series == full[name], name
    assert vllm_metrics.model_names(fast) == {'base "llm"\\x'}


def test_read_metrics_sums_engines_takes_the_newest_lora_series_and_residency() -> None:
    text = exposition(waiting=6, running=4, kv=0.4, engines=2,
                      lora_info=[(["a", "b"], ["a", "b"], 100.0), (["b"], ["b"], 300.0), ([], [], 200.0)],
                      loaded={"a": ("gpu", False), "b": ("cpu", True)})
    m = read_metrics(text)
    assert (m.waiting, m.running, m.kv_usage) == (6, 4, 0.4)
    assert m.running_adapters == m.waiting_adapters == {"b"} and m.has_lora_info
    assert m.running_adapters is m.waiting_adapters  # vLLM's identical lists share one set
    assert m.loaded == {"a": LoadedAdapter(gpu=True), "b": LoadedAdapter(gpu=False, pinned=True)}  # gpu wins
    assert (m.gpu_loaded, m.max_gpu_adapters, m.model_names) == (1, 4, {"base-llm"})


def test_absent_residency_gauges_are_unknown_and_zero_series_absent() -> None:
    bare = read_metrics(exposition(lora_info=None))
    assert bare.loaded is None and bare.gpu_loaded == 0 and not bare.has_lora_info and bare.max_gpu_adapters == 0
    text = exposition(loaded={}, gpu_loaded=0, max_gpu=8)  # gauges exported, nothing resident yet
    assert read_metrics(text).loaded == {} and read_metrics(text).max_gpu_adapters == 8
    gone = text + 'vllm:lora_adapter_loaded{adapter_name="z",level="gpu",pinned="false"} 0.0\n'
    assert read_metrics(gone).loaded == {}


# --- scraping over HTTP ------------------------------------------------------------------------------------------


class Pods:
    """vLLM-shaped /metrics servers on free ports: ``texts[i]`` is what pod i serves; ``down`` pods answer 500,
    ``hung`` pods never answer."""

    def __init__(self, count: int) -> None:
        self.texts = [exposition() for _ in range(count)]
        self.down: set[int] = set()
        self.hung: set[int] = set()
        self.requests = [0] * count
        self.runners: list[web.AppRunner] = []
        self.addresses: list[str] = []

    def endpoints(self) -> list[tuple[str, str]]:
        return [(f"pod-{i}", address) for i, address in enumerate(self.addresses)]

    async def start(self) -> None:
        for i in range(len(self.texts)):
            async def handle(request: web.Request, i: int = i) -> web.Response:
                self.requests[i] += 1
                if i in self.hung:
                    await asyncio.sleep(30)
                if i in self.down:
                    return web.Response(status=500, text="engine dead")
                return web.Response(text=self.texts[i], content_type="text/plain")

            app = web.Application()
            app.router.add_get("/metrics", handle)
            runner = web.AppRunner(app, shutdown_timeout=0.1)
            await runner.setup()
            port = free_port()
            await web.TCPSite(runner, "127.0.0.1", port).start()
            self.runners.append(runner)
            self.addresses.append(f"127.0.0.1:{port}")

    async def stop(self, index: int | None = None) -> None:
        for i, runner in enumerate(self.runners):
            if index is None or i == index:
                await runner.cleanup()


@contextlib.asynccontextmanager
async def pods(count: int) -> AsyncIterator[Pods]:
    served = Pods(count)
    await served.start()
    try:
        yield served
    finally:
        await served.stop()


async def test_scrapes_fill_the_snapshot_and_follow_changes() -> None:
    async with pods(2) as served:
        served.texts[1] = exposition(waiting=3, running=7, kv=0.5, lora_info=[(["a"], ["a"], 5.0)],
                                     loaded={"a": ("gpu", False)})
        pool = ScrapedPool(InFlightTracker(), time.monotonic, served.endpoints())
        assert pool.snapshot.stale.all() and not pool.synced  # nothing scraped yet
        async with scraping(pool, interval_s=0.05):
            await eventually(lambda: pool.synced and not pool.snapshot.stale.any())
            e = pool.snapshot.endpoints[1]
            assert (e.queue_depth, e.running, e.kv_utilization, e.gpu_slots) == (3, 7, 0.5, 4)
            assert e.running_adapters == e.waiting_adapters == {"a"} and e.loaded_adapters == {"a": LoadedAdapter(True)}
            assert all(0 < e.received_at <= time.monotonic() for e in pool.snapshot.endpoints)  # aged from the scrape
            before = pool.snapshot.version
            served.texts[0] = exposition(waiting=9, lora_info=[(["b", "c"], ["b", "c"], 9.0)])
            await eventually(lambda: pool.snapshot.endpoints[0].queue_depth == 9, within=2.0)
            assert pool.snapshot.endpoints[0].running_adapters == {"b", "c"}
            assert pool.snapshot.version > before  # updated in place, not rebuilt
            # without a lora_requests_info series the last adapter lists stay (llm-d-router #1467)
            served.texts[0] = exposition(waiting=1, lora_info=None)
            await eventually(lambda: pool.snapshot.endpoints[0].queue_depth == 1, within=2.0)
            assert pool.snapshot.endpoints[0].running_adapters == {"b", "c"}
            before_wait = served.requests[0]
            await asyncio.sleep(0.5)
            assert served.requests[0] - before_wait >= 5  # about one per 50 ms
        calls = served.requests[0]
        await asyncio.sleep(0.2)
        assert served.requests[0] == calls  # stopped with the block


async def test_a_pod_that_stops_answering_turns_stale_and_keeps_its_last_figures() -> None:
    async with pods(3) as served:
        served.texts[0] = exposition(waiting=4, lora_info=[(["a"], ["a"], 1.0)])
        now = [0.0]  # the pool's clock, which stamps and ages the scrapes: it moves only when the test says
        pool = ScrapedPool(InFlightTracker(), lambda: now[0], served.endpoints(), staleness_s=0.4)
        async with scraping(pool, interval_s=0.05, timeout_s=0.2) as scraper:
            await eventually(lambda: not pool.snapshot.stale.any())
            served.down.add(0)  # answers 500
            served.hung.add(1)  # never answers
            failed = scraper.counts["error"]
            await eventually(lambda: scraper.counts["error"] >= failed + 4)  # each failed twice, in no time
            assert not pool.snapshot.stale.any()  # not before the threshold
            now[0] = 0.5  # past it
            await eventually(lambda: bool(pool.snapshot.stale[0] and pool.snapshot.stale[1]
                                          and not pool.snapshot.stale[2]), within=3.0)
            last = pool.snapshot.endpoints[0]
            assert last.queue_depth == 4 and last.running_adapters == {"a"}  # llm-d keeps the last values
            assert scraper.counts["error"] >= 2
            served.down.clear()
            await eventually(lambda: not pool.snapshot.stale[0], within=2.0)  # fresh again once it answers
        await served.stop(2)  # a pod gone from the network entirely


async def test_membership_changes_keep_known_scrapes_and_a_dead_address_stays_stale() -> None:
    async with pods(2) as served:
        endpoints = served.endpoints()
        pool = ScrapedPool(InFlightTracker(), time.monotonic, endpoints[:1], staleness_s=0.5)
        async with scraping(pool, interval_s=0.05, timeout_s=0.2):
            await eventually(lambda: pool.synced and not pool.snapshot.stale.any())
            pool.set_endpoints([*endpoints, ("pod-9", f"127.0.0.1:{free_port()}")])  # nothing listens there
            assert not pool.snapshot.stale[0]  # its scrape is kept
            await eventually(lambda: not pool.snapshot.stale[1], within=2.0)
            await asyncio.sleep(0.3)
            assert pool.snapshot.stale[2] and pool.synced
            pool.set_endpoints(endpoints[1:])
            assert [e.name for e in pool.snapshot.endpoints] == ["pod-1"]


def test_passthrough_routes_names_as_given_and_the_base_model_as_base() -> None:
    resolver = PassthroughResolver(lambda: frozenset({"base-llm"}))
    rng = None
    adapter = resolver.resolve("tenant-a/sql", None, rng)  # type: ignore[arg-type]
    assert (adapter.served_name, adapter.digest, adapter.priority) == ("tenant-a/sql", None, 0)
    assert resolver.resolve("base-llm", None, rng).served_name is None  # type: ignore[arg-type]
    assert resolver.priorities() == {} and resolver.staging_pods() == frozenset()


def test_passthrough_sends_a_model_name_rewrite_headers_name_as_given() -> None:
    """A peer's pool has no routes, so the header always applies (llm-d-router: no rewrite rule for the body's
    model): the server gets the header's name, scheduled as that adapter, and the response says the client's."""
    from loraplane.picker.director import PickerSettings
    from loraplane.picker.extproc import Exchange
    from tests.picker.conftest import make_context

    ctx, state = make_context(PickerSettings(body_mode=BUFFERED))
    resolver = PassthroughResolver(lambda: frozenset({"base-llm"}))
    ctx.resolver = lambda: resolver
    # a scraped pool's pods serve any name (the scrape data source's endpoints load on demand)
    scraped = PoolSnapshot([dataclasses.replace(e, loads_on_demand=True) for e in state.snapshot.endpoints])
    ctx.snapshot = lambda: scraped
    for name, served in (("their-adapter", "their-adapter"), ("base-llm", None)):
        exchange = Exchange(ctx)
        exchange.handle(headers([*REQUEST_HEADERS, ("x-llm-d-model-name-rewrite", name)], body_mode=BUFFERED))
        (reply,) = exchange.handle(body(b'{"model": "alias", "prompt": "p"}'))
        sent = orjson.loads(pb.ProcessingResponse.FromString(reply).request_body.response.body_mutation.body)
        assert sent["model"] == name and exchange.response_names == (name, "alias")
        assert exchange.director.route is not None and exchange.director.route.served_name == served
        exchange.close()


def test_passthrough_has_no_model_list_so_a_pod_answers_v1_models() -> None:
    """A peer's pool has no route table: ``GET /v1/models`` goes to a pod (its registered adapters), as the reference
    picker sends it."""
    assert PassthroughResolver(lambda: frozenset({"base-llm"})).model_cards(0) is None


def test_scrape_mode_needs_endpoints() -> None:
    assert picker_main(["--pool", "p", "--data-source", "scrape"]) == 2


async def test_the_picker_in_scrape_mode_routes_by_the_scraped_lora_lists_without_redis() -> None:
    """loraplane-picker --data-source scrape --config peer:gie-lora-affinity, no Redis: a request for an adapter
    goes to the pod vLLM lists it running on; the base model and an unknown name are routed too, bodies untouched."""
    async with pods(3) as served:
        busy = [(["x", "y"], ["x", "y"], 1.0)]
        served.texts = [exposition(lora_info=busy, max_lora=2), exposition(lora_info=[(["sql"], ["sql"], 1.0)]),
                        exposition(lora_info=busy, max_lora=2)]
        port = free_port()
        options = ServerOptions(pool="pool", redis_url="redis://127.0.0.1:1/0", grpc_address=f"127.0.0.1:{port}",
                                health_address=None, metrics_address=None, config_path="peer:gie-lora-affinity",
                                endpoints=served.endpoints(), data_source="scrape", scrape_interval=0.05)
        stop = asyncio.Event()
        task = asyncio.create_task(serve(options, stop))
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                health = health_pb2_grpc.HealthStub(channel)

                async def ready() -> bool:
                    try:
                        reply = await health.Check(health_pb2.HealthCheckRequest(service="readiness"), timeout=1)
                    except grpc.RpcError:
                        return False
                    return reply.status == health_pb2.HealthCheckResponse.SERVING

                deadline = time.monotonic() + 10
                while not await ready():
                    assert time.monotonic() < deadline and not task.done()
                    await asyncio.sleep(0.05)
                stub = pb_grpc.ExternalProcessorStub(channel)

                async def route(model: str) -> tuple[str, bool]:
                    payload = orjson.dumps({"model": model, "prompt": "hi", "max_tokens": 1})
                    call = stub.Process(iter([headers(REQUEST_HEADERS, body_mode=BUFFERED), body(payload)]))
                    replies = [r async for r in call]
                    common = replies[-1].request_body.response
                    return header_map(common.header_mutation)["x-gateway-destination-endpoint"], common.HasField(
                        "body_mutation")

                for _ in range(5):
                    assert await route("sql") == (served.addresses[1], False)  # running there; the others are full
                destination, rewritten = await route("base-llm")  # the pods' model_name: a base-model request
                assert destination in served.addresses and not rewritten
                destination, rewritten = await route("never-registered")  # as given; vLLM would answer 404
                assert destination == served.addresses[1] and not rewritten  # the only pod with room
        finally:
            stop.set()
            await asyncio.wait_for(task, 10)


@pytest.mark.parametrize("value", ["0", "-1", "nan"])
def test_scrape_intervals_must_be_positive(value: str) -> None:
    with pytest.raises(SystemExit):
        picker_main(["--pool", "p", "--data-source", "scrape", "--endpoint", "pod-0=10.0.0.1:8000",
                     "--scrape-interval", value])


def test_each_endpoint_is_scraped_at_its_own_offset_in_the_interval() -> None:
    offsets = [scrape_offset(f"10.0.0.{i}:8000", 0.25) for i in range(1, 65)]
    assert offsets == [scrape_offset(f"10.0.0.{i}:8000", 0.25) for i in range(1, 65)]  # fixed per address
    assert all(0 <= o < 0.25 for o in offsets)
    assert all(sum(q * 0.0625 <= o < (q + 1) * 0.0625 for o in offsets) >= 8 for q in range(4))  # spread
    # the next scrape: the endpoint's offset in the current interval if still ahead, else in the next
    assert until_offset(10.0, 0.25, 0.1) == pytest.approx(0.1)
    assert until_offset(10.2, 0.25, 0.1) == pytest.approx(0.15)
    assert until_offset(10.1, 0.25, 0.1) == pytest.approx(0.25)


async def test_each_scrape_loop_waits_for_its_endpoints_offset() -> None:
    """After its first scrape an endpoint's loop sleeps until its own offset in the interval, every time, also after
    a scrape that took longer than the interval."""
    scraper = MetricsScraper(ScrapedPool(InFlightTracker(), time.monotonic), interval_s=0.25)
    now = [100.03]
    scraped: list[float] = []

    async def scrape_once(*_args: object) -> None:
        scraped.append(now[0])
        now[0] += 0.4 if len(scraped) == 2 else 0.01  # the second scrape is slow

    async def sleep(delay: float) -> None:
        assert 0 < delay <= 0.25
        now[0] += delay
        if len(scraped) == 4:
            raise asyncio.CancelledError

    scraper.scrape_once = scrape_once  # type: ignore[method-assign]
    scraper.clock, scraper.sleep = lambda: now[0], sleep
    with pytest.raises(asyncio.CancelledError):
        await scraper._follow(None, "pod-0", "10.0.0.1:8000")  # type: ignore[arg-type]
    offset = scrape_offset("10.0.0.1:8000", 0.25)
    assert scraped[0] == 100.03  # the first at once
    assert [t % 0.25 for t in scraped[1:]] == pytest.approx([offset] * 3, abs=1e-9)


def test_the_scraper_refuses_a_zero_interval() -> None:
    with pytest.raises(ValueError):
        MetricsScraper(ScrapedPool(InFlightTracker(), time.monotonic), interval_s=0)
