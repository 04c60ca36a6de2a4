"""The sidecar end to end: real redis-server, a real engine, a real OCI registry and HTTPS server, the real CLI.

Each test writes a TargetState to Redis as the controller would and checks the engine's own admin listing and the
ResidencyReport the sidecar publishes.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import tarfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import redis
import redis.asyncio as aioredis

from e2e.fixtures.processes import (
    LOOPBACK,
    ManagedProcess,
    RedisServer,
    free_port,
    start_redis,
    wait_for_port,
)
from e2e.fixtures.registry import LOOPBACK_ALLOW_ARGS
from e2e.fixtures.waiting import wait_until
from loraplane.api import (
    ERROR_DIGEST_MISMATCH,
    ERROR_INCOMPATIBLE,
    AdapterResidency,
    AdapterTarget,
    Artifact,
    LoraSpec,
    ResidencyReport,
    TargetState,
    Tier,
    adapter_digest,
    cache_key,
    keys,
    served_name,
)
from loraplane.picker.plugins import SchedulingRequest
from loraplane.picker.scheduler import Scheduler
from loraplane.picker.snapshot import InFlightTracker
from loraplane.picker.state import PoolState, RedisSync
from loraplane.picker.telemetry import RequestStats
from tests.sidecar.adapters import write_peft_dir

pytestmark = pytest.mark.slow

POOL = "pool-a"
MODULES = ["q_proj", "v_proj"]


@dataclass
class Engine:
    """A running ``loraplane-engine`` (tiny model, 2 GPU slots, 4 host slots)."""

    port: int
    adapter_root: Path
    process: ManagedProcess

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def listing(self) -> dict[str, Any]:
        return httpx.get(f"{self.url}/admin/adapters", timeout=10).json()

    def held(self) -> dict[str, dict[str, Any]]:
        return {a["served_name"]: a for a in self.listing()["adapters"]}

    def start(self) -> None:
        self.process.start()
        wait_for_port(self.port, proc=self.process.proc, timeout=90)
        wait_until(lambda: httpx.get(f"{self.url}/health", timeout=5).status_code == 200, 60, "engine health")

    def restart(self) -> None:
        self.process.stop()
        self.start()




@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    root = tmp_path_factory.mktemp("engine-root")
    port = free_port()
    args = [sys.executable, "-m", "loraplane.engine", "--model", "tiny", "--port", str(port), "--max-loras", "2",
            "--max-cpu-loras", "4", "--adapter-root", str(root), "--enable-lora-runtime-updating",
            "--max-model-len", "128"]
    engine = Engine(port, root, ManagedProcess(args, root.parent / f"engine-{port}.log"))
    engine.start()
    try:
        yield engine
    finally:
        engine.process.stop()


@dataclass
class Adapter:
    """One revision's artifact, published somewhere, and the target entry that names it."""

    name: str
    uri: str
    artifact_digest: str
    adapter_digest: str

    def target(self, tier: Tier, base_digest: str, pinned: bool = False, digest: str | None = None) -> AdapterTarget:
        adapter, revision = self.name.split("@")
        digest = digest or self.artifact_digest
        return AdapterTarget(
            served_name=self.name, adapter=adapter, revision=revision, tier=tier, pinned=pinned,
            artifact=Artifact(uri=self.uri, digest=digest),
            lora=LoraSpec(rank=8, alpha=8, dtype="float32", target_modules=MODULES),
            base_model_digest=base_digest, cache_key=cache_key(base_digest, adapter, revision, digest),
        )


def _sha256(path: Path) -> str:
    import hashlib

    return "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory, oci_registry, https_files) -> dict[str, Adapter]:
    """Four adapters for the tiny model: over OCI (bare safetensors), HTTPS (tar.gz) and file:// (tar)."""
    from loraplane.engine.make_adapters import model_config, write_adapter

    base = tmp_path_factory.mktemp("artifacts")
    made = {}
    for i, (name, kind) in enumerate([("alpha@v1", "oci"), ("beta@v1", "https"), ("gamma@v1", "file"),
                                      ("delta@v1", "https")]):
        directory = base / name.replace("@", "-")
        write_adapter(directory, model_config("tiny"), 8, seed=i, targets=MODULES)
        artifact = base / f"{directory.name}.tar{'' if kind == 'file' else '.gz'}"
        with tarfile.open(artifact, "w" if kind == "file" else "w:gz") as tar:
            tar.add(directory, arcname=directory.name)
        if kind == "oci":
            uri = oci_registry.push(f"adapters/{name.split('@')[0]}", "v1", artifact, "application/vnd.oci.image.layer.v1.tar+gzip")
        else:
            uri = https_files.publish(artifact) if kind == "https" else f"file://{artifact}"
        made[name] = Adapter(name, uri, _sha256(artifact), adapter_digest(directory))
    return made


@dataclass
class SidecarProc:
    """The real ``loraplane-sidecar`` as a child process."""

    process: ManagedProcess
    metrics_port: int
    cache_dir: Path

    def metrics(self) -> str:
        return httpx.get(f"http://{LOOPBACK}:{self.metrics_port}/metrics", timeout=5).text


@pytest.fixture
def sidecar_factory(tmp_path: Path, engine: Engine, oci_registry, https_files,
                    adapters) -> Iterator[Callable[..., SidecarProc]]:
    started: list[SidecarProc] = []

    def start(pod: str, redis_server: RedisServer, *runtime: str) -> SidecarProc:
        cache_dir = engine.adapter_root / pod
        metrics_port = free_port()
        args = [sys.executable, "-m", "loraplane.sidecar", "--pool", POOL, "--pod", pod, *(runtime or ("--runtime", "engine")),
                "--runtime-url", engine.url, "--redis-url", redis_server.url, "--cache-dir", str(cache_dir),
                "--heartbeat", "0.3", "--report-ttl", "3", "--backoff-base", "0.2", "--backoff-cap", "2",
                "--metrics-port", str(metrics_port), "--file-root", str(Path(adapters["gamma@v1"].uri[7:]).parent),
                "--oci-plain-http", oci_registry.host, "--https-ca-file", str(https_files.ca_file),
                *LOOPBACK_ALLOW_ARGS]
        proc = SidecarProc(ManagedProcess(args, tmp_path / f"sidecar-{pod}.log").start(), metrics_port, cache_dir)
        started.append(proc)
        wait_for_port(metrics_port, proc=proc.process.proc, timeout=30)
        return proc

    yield start
    for proc in started:
        proc.process.stop()


def write_target(client: redis.Redis, pod: str, generation: int, targets: list[AdapterTarget]) -> None:
    state = TargetState(pool=POOL, pod=pod, generation=generation, adapters=targets, updated_at=time.time())
    client.set(keys.target_state(POOL, pod), state.to_json())
    client.publish(keys.target_changed_channel(POOL), pod)


def read_report(client: redis.Redis, pod: str) -> ResidencyReport | None:
    raw = client.get(keys.residency_report(POOL, pod))
    return ResidencyReport.from_json(raw) if raw else None


def holds(engine: Engine, want: dict[str, tuple[str, bool]]) -> bool:
    """The engine holds exactly ``want`` (name -> (tier, pinned)), nothing else."""
    held = engine.held()
    return {n: (a["tier"], a["pinned"]) for n, a in held.items() if a["tier"] != "disk"} == want


def report_matches_listing(client: redis.Redis, pod: str, engine: Engine, adapters: dict[str, Adapter]) -> bool:
    report = read_report(client, pod)
    if report is None or not report.ready:
        return False
    rows = report.by_name()
    for name, held in engine.held().items():
        row = rows.get(name)
        if row is None or row.tier.value != held["tier"]:
            return False
        content = held.get("adapter_digest") or held["digest"]  # the engine's own digest of what it loaded
        assert content == adapters[name].adapter_digest
        assert row.digest == adapters[name].artifact_digest  # the report speaks in artifact digests ...
        assert row.adapter_digest == adapters[name].adapter_digest  # ... next to the content digest
        if any(getattr(row, field) != held[field] for field in ("bytes", "pinned", "in_flight", "hits", "loads",
                                                                 "evictions")):
            return False  # the next heartbeat brings the report up to date
    return True


def test_target_state_drives_the_engine_and_the_report_matches(engine: Engine, adapters: dict[str, Adapter],
                                                               redis_srv: RedisServer, sidecar_factory) -> None:
    client = redis.Redis.from_url(redis_srv.url)
    base = engine.listing()["base_model_digest"]
    a, b, c, d = (adapters[n] for n in ("alpha@v1", "beta@v1", "gamma@v1", "delta@v1"))
    sidecar = sidecar_factory("pod-1", redis_srv)
    write_target(client, "pod-1", 1, [a.target(Tier.GPU, base, pinned=True), b.target(Tier.CPU, base),
                                      c.target(Tier.DISK, base)])
    wait_until(lambda: holds(engine, {a.name: ("gpu", True), b.name: ("cpu", False)}), 30, "first target")
    wait_until(lambda: report_matches_listing(client, "pod-1", engine, adapters), 10, "report == listing")
    report = read_report(client, "pod-1")
    assert report is not None and report.target_generation == 1 and not report.residency_inferred
    rows = report.by_name()
    assert rows[c.name].tier is Tier.DISK and rows[c.name].digest == c.artifact_digest

    # move them around: alpha down to host memory, beta and gamma up to the two GPU slots, delta to disk
    write_target(client, "pod-1", 2, [a.target(Tier.CPU, base), b.target(Tier.GPU, base),
                                      c.target(Tier.GPU, base), d.target(Tier.DISK, base)])
    wait_until(lambda: holds(engine, {a.name: ("cpu", False), b.name: ("gpu", False), c.name: ("gpu", False)}),
               30, "second target")
    wait_until(lambda: report_matches_listing(client, "pod-1", engine, adapters), 10, "report == listing")
    wait_until(lambda: read_report(client, "pod-1").by_name()[d.name].tier is Tier.DISK, 10, "delta on disk")

    # alpha leaves the target: unloaded; the others stay
    write_target(client, "pod-1", 3, [b.target(Tier.GPU, base), c.target(Tier.GPU, base)])
    wait_until(lambda: holds(engine, {b.name: ("gpu", False), c.name: ("gpu", False)}), 30, "third target")
    wait_until(lambda: report_matches_listing(client, "pod-1", engine, adapters), 10, "report == listing")
    text = sidecar.metrics()
    assert 'adapter_resident_count{tier="gpu"} 2.0' in text
    assert "adapter_cache_misses_total" in text and "adapter_h2d_seconds_count" in text


def test_tampered_artifact_is_never_loaded(engine: Engine, adapters: dict[str, Adapter], redis_srv: RedisServer,
                                           https_files, tmp_path: Path, sidecar_factory) -> None:
    client = redis.Redis.from_url(redis_srv.url)
    base = engine.listing()["base_model_digest"]
    good, other = adapters["beta@v1"], adapters["delta@v1"]
    # the revision declares beta's digest, but its URI serves delta's bytes
    tampered = Adapter("beta@v2", other.uri, good.artifact_digest, good.adapter_digest)
    # and an adapter whose tensors do not fit the model's shapes: only the engine itself can tell
    misfit_dir = write_peft_dir(tmp_path / "misfit", rank=8, dtype="float32", modules=tuple(MODULES), hidden=32)
    misfit_tar = tmp_path / "misfit.tar"
    with tarfile.open(misfit_tar, "w") as tar:
        tar.add(misfit_dir, arcname="misfit")
    misfit = Adapter("misfit@v1", https_files.publish(misfit_tar), _sha256(misfit_tar), adapter_digest(misfit_dir))
    sidecar = sidecar_factory("pod-2", redis_srv)
    write_target(client, "pod-2", 1, [tampered.target(Tier.GPU, base), misfit.target(Tier.CPU, base)])

    def refused() -> bool:
        report = read_report(client, "pod-2")
        rows = report.by_name() if report else {}
        return rows.get("beta@v2", rows.get("x")) is not None and rows["beta@v2"].error_reason == ERROR_DIGEST_MISMATCH \
            and rows["misfit@v1"].error_reason == ERROR_INCOMPATIBLE

    wait_until(refused, 20, "digest mismatch and incompatibility in the report")
    rows = read_report(client, "pod-2").by_name()
    assert rows["beta@v2"].tier is Tier.ABSENT and "sha256" in (rows["beta@v2"].error or "")
    assert "refused" in (rows["misfit@v1"].error or "")
    assert "beta@v2" not in engine.held() and "misfit@v1" not in engine.held()
    # a retry may be downloading right now; no partial file stays
    wait_until(lambda: not [p for p in (sidecar.cache_dir / "tmp").rglob("*") if p.is_file()], 10, "empty tmp/")
    entries = [p.name for p in (sidecar.cache_dir / "adapters").iterdir()]
    assert entries == [misfit.target(Tier.CPU, base).cache_key.removeprefix("sha256:")]  # verified, only refused


def test_engine_restart_is_healed_without_redis_changes(engine: Engine, adapters: dict[str, Adapter],
                                                        redis_srv: RedisServer, sidecar_factory) -> None:
    client = redis.Redis.from_url(redis_srv.url)
    base = engine.listing()["base_model_digest"]
    a, b = adapters["alpha@v1"], adapters["beta@v1"]
    sidecar = sidecar_factory("pod-3", redis_srv)
    write_target(client, "pod-3", 1, [a.target(Tier.GPU, base, pinned=True), b.target(Tier.CPU, base)])
    want = {a.name: ("gpu", True), b.name: ("cpu", False)}
    wait_until(lambda: holds(engine, want), 30, "target")
    engine.restart()
    wait_until(lambda: holds(engine, want), 30, "target after the engine restart")
    wait_until(lambda: report_matches_listing(client, "pod-3", engine, adapters), 10, "report == listing")
    assert "sidecar_runtime_restarts_total 1.0" in sidecar.metrics()


def test_the_picker_stops_routing_a_leaving_revision_before_the_engine_unloads_it(
        engine: Engine, adapters: dict[str, Adapter], redis_srv: RedisServer, sidecar_factory) -> None:
    """The drain protocol across processes: the sidecar reports the revision draining, the picker's Redis-fed state
    and scheduler route it to another pod holding it, and only then does the engine lose it (no 404 window)."""
    client = redis.Redis.from_url(redis_srv.url)
    base = engine.listing()["base_model_digest"]
    d = adapters["delta@v1"]
    sidecar_factory("pod-6", redis_srv)  # the default drain grace (1 s)
    write_target(client, "pod-6", 1, [d.target(Tier.CPU, base)])
    wait_until(lambda: holds(engine, {d.name: ("cpu", False)}), 30, "target")
    here = f"{LOOPBACK}:{engine.port}"
    elsewhere = ResidencyReport(pool=POOL, pod="pod-7", address="10.0.0.7:8000", heartbeat_at=time.time(),
                                ttl_seconds=600, adapters=[AdapterResidency(served_name=d.name, tier=Tier.CPU,
                                                                            digest=d.artifact_digest)])
    client.set(keys.residency_report(POOL, "pod-7"), elsewhere.to_json())
    client.sadd(keys.residency_index(POOL), "pod-7")
    request = SchedulingRequest(served_name=d.name, digest=d.artifact_digest)
    scheduler = Scheduler.default()

    async def watch() -> list[tuple[bool, bool]]:
        """(engine holds it, the picker would route it here) samples from the target change to the unload."""
        state = PoolState(POOL, InFlightTracker(), time.time)
        sync = RedisSync(state, aioredis.Redis.from_url(redis_srv.url), RequestStats(time.time), "picker-0",
                         resync_seconds=60, publish_seconds=60)
        stop = asyncio.Event()
        task = asyncio.create_task(sync.run(stop))

        def routed_here() -> bool:
            picks = {scheduler.schedule(request, state.snapshot, np.random.default_rng(seed)).endpoints[0]
                     for seed in range(16)}
            return here in picks

        try:
            deadline = time.monotonic() + 30
            while not (state.synced and len(state.snapshot) == 2 and routed_here()):  # both pods share the traffic
                assert time.monotonic() < deadline, "the picker never routed to pod-6"
                await asyncio.sleep(0.05)
            write_target(client, "pod-6", 2, [])
            samples: list[tuple[bool, bool]] = []
            while not samples or samples[-1][0]:
                assert time.monotonic() < deadline + 30, "never unloaded"
                held = d.name in await asyncio.to_thread(engine.held)
                samples.append((held, routed_here()))
                await asyncio.sleep(0.02)
            return samples
        finally:
            stop.set()
            await asyncio.wait_for(task, 5)  # the follow loop ends on stop, with no cancellation
            await sync.client.aclose()

    samples = asyncio.run(watch())
    assert not any(routed for held, routed in samples if not held)
    draining = [held for held, routed in samples if not routed]
    assert draining[0] and sum(draining) >= 2, samples  # routed elsewhere before the unload


def test_redis_outage_keeps_serving_and_report_returns(engine: Engine, adapters: dict[str, Adapter],
                                                       tmp_path: Path, sidecar_factory) -> None:
    redis_server = start_redis(tmp_path / "redis")
    try:
        client = redis.Redis.from_url(redis_server.url)
        base = engine.listing()["base_model_digest"]
        a = adapters["alpha@v1"]
        sidecar_factory("pod-4", redis_server)
        write_target(client, "pod-4", 1, [a.target(Tier.GPU, base)])
        wait_until(lambda: holds(engine, {a.name: ("gpu", False)}), 30, "target")
        results: list[int] = []
        stop = threading.Event()

        def traffic() -> None:
            with httpx.Client(base_url=engine.url, timeout=30) as http:
                while not stop.is_set():
                    body = {"model": a.name, "prompt": "hello", "max_tokens": 2, "temperature": 0}
                    results.append(http.post("/v1/completions", json=body).status_code)

        thread = threading.Thread(target=traffic)
        thread.start()
        try:
            redis_server.process.stop()
            time.sleep(10)
            before_return = len(results)
            redis_server.process.start()
            wait_for_port(redis_server.port, proc=redis_server.process.proc)
            wait_until(lambda: read_report(client, "pod-4") is not None, 15, "report republished")
        finally:
            stop.set()
            thread.join()
        assert before_return > 0 and set(results) == {200}, results
        assert engine.held()[a.name]["tier"] == "gpu"  # an empty Redis is no instruction to unload
    finally:
        redis_server.stop()


def test_killed_mid_download_leaves_no_corrupt_entry(engine: Engine, tmp_path: Path, redis_srv: RedisServer,
                                                     https_files, sidecar_factory) -> None:
    from loraplane.engine.make_adapters import model_config, write_adapter

    client = redis.Redis.from_url(redis_srv.url)
    base = engine.listing()["base_model_digest"]
    directory = tmp_path / "big"
    write_adapter(directory, model_config("tiny"), 8, seed=9, targets=["q_proj", "k_proj", "v_proj", "o_proj"])
    archive = tmp_path / "big.tar"
    with tarfile.open(archive, "w") as tar:
        tar.add(directory, arcname="big")
    big = Adapter(served_name("big", "v1"), https_files.publish(archive, "big.tar"), _sha256(archive),
                  adapter_digest(directory))
    target = big.target(Tier.CPU, base)
    target.lora.target_modules = ["q_proj", "k_proj", "v_proj", "o_proj"]
    https_files.throttle_bytes_per_s = max(4096, archive.stat().st_size // 6)
    try:
        sidecar = sidecar_factory("pod-5", redis_srv)
        write_target(client, "pod-5", 1, [target])
        partial = sidecar.cache_dir / "tmp"
        wait_until(lambda: any(p.is_file() and p.stat().st_size > 0 for p in partial.rglob("*")), 20,
                   "a download in progress")
        os.kill(sidecar.process.pid, signal.SIGKILL)
        sidecar.process.proc.wait()
        assert not list((sidecar.cache_dir / "adapters").iterdir())
    finally:
        https_files.throttle_bytes_per_s = 0
    restarted = sidecar_factory("pod-5", redis_srv)
    wait_until(lambda: holds(engine, {big.name: ("cpu", False)}), 30, "loaded after the restart")
    held = engine.held()[big.name]
    assert (held.get("adapter_digest") or held["digest"]) == big.adapter_digest
    assert not [p for p in (restarted.cache_dir / "tmp").rglob("*") if p.is_file()]
