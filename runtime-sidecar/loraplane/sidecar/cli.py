"""The ``loraplane-sidecar`` command: every flag can also be set by ``LORAPLANE_SIDECAR_<FLAG>`` in the environment."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
import urllib.parse
from collections.abc import Sequence
from pathlib import Path

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from loraplane.api import validation
from loraplane.credentials import secret
from loraplane.helptext import HelpFormatter
from loraplane.sidecar.artifacts import Allowance, ArtifactSources, SourceConfig, parse_allowance
from loraplane.sidecar.bus import RedisBus
from loraplane.sidecar.cache import DiskCache, UnpackLimits
from loraplane.sidecar.drivers import DRIVERS, make_driver
from loraplane.sidecar.drivers.base import RuntimeInfo
from loraplane.sidecar.metrics import SidecarMetrics
from loraplane.sidecar.reconcile import DEFAULT_DRAIN_GRACE_S, Backoff, Reconciler
from loraplane.sidecar.service import Sidecar, SidecarConfig

ENV_PREFIX = "LORAPLANE_SIDECAR_"


def _env(flag: str) -> str | None:
    return os.environ.get(ENV_PREFIX + flag.upper().replace("-", "_"))


def _list_env(flag: str) -> list[str]:
    value = _env(flag)
    return [v for v in value.split(",") if v] if value else []


def _bytes(text: str) -> int:
    """``500M``, ``20G``, ``1024`` -> bytes."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def _allowance(text: str) -> Allowance:
    try:
        return parse_allowance(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected CIDR[:PORT], got {text!r}: {exc}") from None


def build_parser() -> argparse.ArgumentParser:
    """The command's flags (defaults from the environment)."""
    p = argparse.ArgumentParser(
        prog="loraplane-sidecar", formatter_class=HelpFormatter,
        description="Drive one model server into its TargetState and report its residency. "
        f"Every flag can also be set as {ENV_PREFIX}<FLAG> (e.g. {ENV_PREFIX}REDIS_URL).",
    )

    def opt(flag: str, help_text: str, default: object = None, **kw: object) -> None:
        env = _env(flag)
        p.add_argument(f"--{flag}", default=env if env is not None else default, help=help_text, **kw)  # type: ignore[arg-type]

    opt("pool", "InferencePool name (required)")
    opt("pod", "this pod's name (required)")
    opt("runtime", "runtime kind", default="engine", choices=sorted(DRIVERS))
    opt("runtime-url", "model server base URL, e.g. http://127.0.0.1:8000 (required)")
    opt("address", "ip:port the picker routes to (default: host:port of --runtime-url)")
    opt("runtime-token", "bearer token for the runtime's admin/load endpoints (the engine's admin token, vLLM's "
        "--api-key); prefer --runtime-token-file or the environment: the command line is visible to ps")
    opt("runtime-token-file", "file holding the runtime token (a mounted Secret)")
    opt("redis-url", "Redis URL without credentials (required); the ACL user and password come from "
        "LORAPLANE_REDIS_USERNAME and LORAPLANE_REDIS_PASSWORD or LORAPLANE_REDIS_PASSWORD_FILE")
    opt("cache-dir", "local disk cache directory (required; must be readable by the runtime)")
    opt("cache-bytes", "disk cache byte budget (e.g. 20G)", default="20G", type=_bytes)
    opt("heartbeat", "seconds between heartbeats (reports and resync)", default=1.0, type=float)
    opt("report-ttl", "TTL of the residency report in Redis, seconds", default=5.0, type=float)
    opt("drain-grace", "seconds an adapter leaving the runtime is reported draining before it is unloaded "
        "(0: unload at once)", default=DEFAULT_DRAIN_GRACE_S, type=float)
    opt("concurrency", "actions (downloads, loads) running at once", default=4, type=int)
    opt("backoff-base", "first retry delay after a failed action, seconds", default=0.5, type=float)
    opt("backoff-cap", "longest retry delay, seconds", default=60.0, type=float)
    opt("metrics-host", "bind address of the metrics/health port", default="127.0.0.1")
    opt("metrics-port", "metrics/health port (0: none)", default=9091, type=int)
    opt("top-k", "adapters with their own per-adapter metric labels", default=20, type=int)
    opt("max-lora-rank", "vllm: the server's --max-lora-rank", default=None, type=int)
    opt("max-loras", "vllm: the server's --max-loras", default=None, type=int)
    opt("max-cpu-loras", "vllm: the server's --max-cpu-loras", default=None, type=int)
    opt("base-model-digest", "vllm: the base model digest the server serves")
    opt("kv-events-endpoint", "vllm: the endpoint of the server's KV-events publisher (its --kv-events-config "
        "endpoint, e.g. ipc:///run/loraplane/kv-events.sock); publishes the pod's prefix-cache block set")
    opt("kv-events-max-blocks", "most prefix-cache blocks published", default=16_384, type=int)
    p.add_argument("--file-root", action="append", default=_list_env("file-root"),
                   help="directory file:// artifacts may come from (repeatable; none: file:// refused)")
    p.add_argument("--oci-plain-http", action="append", default=_list_env("oci-plain-http"),
                   help="registry host:port reached over plain HTTP (repeatable; for local registries)")
    opt("https-ca-file", "CA bundle for https:// artifacts (default: system CAs)")
    opt("s3-endpoint-url", "S3 endpoint (default: AWS)")
    p.add_argument("--artifact-scheme", action="append", default=_list_env("artifact-scheme"),
                   choices=validation.ALLOWED_URI_SCHEMES, help="scheme artifacts may use (repeatable; default: all)")
    p.add_argument("--artifact-host", action="append", default=_list_env("artifact-host"),
                   help="host pattern https/oci artifacts may name, s3: bucket (repeatable, '*.example.com'; "
                        "default: any host with public addresses)")
    p.add_argument("--artifact-allow-internal", action="append", default=_list_env("artifact-allow-internal"),
                   type=_allowance, metavar="CIDR[:PORT]",
                   help="internal network (loopback, private, link-local ...) artifacts may still come from, "
                        "e.g. an in-cluster registry 10.0.12.7:5000 (repeatable; default: none)")
    opt("fetch-connect-timeout", "seconds to connect to an artifact host", default=10.0, type=float)
    opt("fetch-read-timeout", "seconds an artifact host may stay silent", default=30.0, type=float)
    opt("fetch-deadline", "seconds one artifact fetch may take in all", default=900.0, type=float)
    opt("max-unpacked-bytes", "largest size an archive may unpack to (e.g. 4G)", default="4G", type=_bytes)
    opt("max-archive-files", "most members an archive may hold", default=64, type=int)
    opt("max-compression-ratio", "most unpacked bytes per archive byte (above 16 MiB unpacked)", default=100.0,
        type=float)
    opt("log-level", "logging level", default="INFO")
    return p


def _metrics_app(sidecar: Sidecar) -> Starlette:
    async def metrics(request: Request) -> Response:
        return Response(sidecar.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def health(request: Request) -> Response:
        return Response("ok" if sidecar.ready else "runtime not ready", status_code=200 if sidecar.ready else 503)

    return Starlette(routes=[Route("/metrics", metrics), Route("/healthz", health)])


async def serve(args: argparse.Namespace) -> int:
    """Run the sidecar until SIGTERM/SIGINT."""
    metrics = SidecarMetrics(top_k=args.top_k, reexport_residency=not DRIVERS[args.runtime].capabilities
                             .exports_residency_metrics)
    limits = RuntimeInfo(
        base_model="",
        base_model_digest=args.base_model_digest,
        max_lora_rank=args.max_lora_rank,
        max_loras=args.max_loras,
        max_cpu_loras=args.max_cpu_loras,
    )
    try:
        driver = make_driver(args.runtime, args.runtime_url, limits,
                             token=secret(args.runtime_token, args.runtime_token_file))
    except ValueError as exc:  # e.g. a vLLM whose LoRA resolver is on
        print(f"loraplane-sidecar: {exc}", file=sys.stderr)
        return 2
    sources = ArtifactSources(SourceConfig(
        file_roots=tuple(Path(r) for r in args.file_root),
        oci_plain_http=frozenset(args.oci_plain_http),
        https_ca_file=args.https_ca_file,
        s3_endpoint_url=args.s3_endpoint_url,
        schemes=frozenset(args.artifact_scheme or validation.ALLOWED_URI_SCHEMES),
        allowed_hosts=tuple(args.artifact_host),
        allow_internal=tuple(a if isinstance(a, tuple) else parse_allowance(a) for a in args.artifact_allow_internal),
        connect_timeout_s=args.fetch_connect_timeout,
        read_timeout_s=args.fetch_read_timeout,
        deadline_s=args.fetch_deadline,
    ))
    unpack_limits = UnpackLimits(args.max_unpacked_bytes, args.max_archive_files, args.max_compression_ratio)
    cache = DiskCache(Path(args.cache_dir), args.cache_bytes, sources,
                      on_evict=lambda entry: metrics.evictions.labels("disk").inc(), limits=unpack_limits)
    reconciler = Reconciler(driver, cache, metrics, concurrency=args.concurrency,
                            backoff=Backoff(args.backoff_base, args.backoff_cap), drain_grace_s=args.drain_grace)
    bus = RedisBus(args.redis_url, args.pool, args.pod)
    address = args.address or urllib.parse.urlsplit(args.runtime_url).netloc
    sidecar = Sidecar(SidecarConfig(args.pool, args.pod, address, args.runtime, args.heartbeat, args.report_ttl,
                                    args.kv_events_endpoint, args.kv_events_max_blocks), reconciler, bus)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    server_task = None
    if args.metrics_port:
        import uvicorn

        server = uvicorn.Server(uvicorn.Config(_metrics_app(sidecar), host=args.metrics_host, port=args.metrics_port,
                                               log_level="warning", lifespan="off"))
        server_task = asyncio.create_task(server.serve())
    logging.getLogger(__name__).info("sidecar for %s/%s driving %s at %s", args.pool, args.pod, args.runtime,
                                     args.runtime_url)
    try:
        await sidecar.run(stop)
    finally:
        if server_task is not None:
            server.should_exit = True
            with contextlib.suppress(Exception):
                await server_task
        await driver.close()
        await bus.close()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``loraplane-sidecar``."""
    parser = build_parser()
    args = parser.parse_args(argv)
    missing = [f for f in ("pool", "pod", "runtime_url", "redis_url", "cache_dir") if not getattr(args, f)]
    if missing:
        parser.error("missing " + ", ".join("--" + m.replace("_", "-") for m in missing)
                     + f" (or {ENV_PREFIX}<FLAG>)")
    for what in ("pool", "pod"):
        if not validation.matches(validation.DNS1123_SUBDOMAIN, getattr(args, what)):
            parser.error(f"--{what} {getattr(args, what)!r} is not a DNS-1123 name")
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per runtime call is noise
    return asyncio.run(serve(args))
