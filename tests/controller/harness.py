"""Integration harness: the devcluster over HTTP, a real Redis, and pods that behave like sidecar + engine.

``ScriptedPods`` publishes, for each pod, the ``ResidencyReport`` a sidecar publishes once it has applied the
pod's ``TargetState`` (every targeted adapter at its tier, with the digest it verified) and serves completions the
way the engine stamps them (served-name and digest headers), so the controller's whole loop runs over real HTTP
and real Redis in a second or two. The real sidecar and engine are exercised by the e2e tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import redis.asyncio as aioredis
import uvicorn
from kubernetes import client as k8s
from kubernetes import config as k8s_config
from redis.exceptions import RedisError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from e2e.fixtures.processes import free_port
from loraplane.api import (
    ADAPTER_DIGEST_HEADER,
    GROUP,
    PLURAL,
    SERVED_ADAPTER_HEADER,
    VERSION,
    AdapterResidency,
    PodLoad,
    ResidencyReport,
    TargetState,
    keys,
)
from loraplane.api.catalogue import SpecCache
from loraplane.controller.kube import KubeApi
from loraplane.controller.leader import LeaseConfig, LeaseElector
from loraplane.controller.manager import Controller, ControllerConfig
from loraplane.controller.probe import HealthProber
from loraplane.controller.store import RedisStore
from loraplane.devcluster.runner import write_kubeconfig

POOL = "pool"


def content_digest(artifact_digest: str) -> str:
    """The digest a runtime stamps on responses: of the unpacked files, so not the artifact's own."""
    return "sha256:" + hashlib.sha256(artifact_digest.encode()).hexdigest()
FAST_LEASE = LeaseConfig(lease_duration=2.0, renew_deadline=1.5, retry_period=0.2)


@dataclass
class ScriptedPods:
    """Pods whose reports follow their target states; one HTTP server answers every pod's completions."""

    redis: aioredis.Redis
    pods: list[str]
    base_digest: str
    port: int = field(default_factory=free_port)
    #: served name -> digest the "runtime" verifies/serves instead of the target's (a tampered artifact)
    wrong_digest: dict[str, str] = field(default_factory=dict)
    #: served name -> HTTP status of its completions
    status: dict[str, int] = field(default_factory=dict)
    probes: Counter[str] = field(default_factory=Counter)
    digests: dict[str, str] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    #: served names the pods go on reporting as they last did after their targets drop them (a slow unload)
    slow_unload: set[str] = field(default_factory=set)
    reported: dict[str, dict[str, AdapterResidency]] = field(default_factory=dict)
    #: the pool's catalogue entries the pods' target states named (their refs resolved as a sidecar does)
    specs: SpecCache = field(default_factory=lambda: SpecCache(POOL))

    def app(self) -> Starlette:
        async def completions(request: Request) -> Response:
            body = await request.json()
            model = body["model"]
            self.probes[model] += 1
            if model not in self.digests:
                return JSONResponse({"error": "unknown model"}, status_code=404)

            async def stream() -> AsyncIterator[bytes]:
                yield b'data: {"choices": [{"text": "hi"}]}\n\n'
                yield b"data: [DONE]\n\n"

            headers = {SERVED_ADAPTER_HEADER: model, ADAPTER_DIGEST_HEADER: self.digests[model]}
            return StreamingResponse(stream(), status_code=self.status.get(model, 200), headers=headers,
                                     media_type="text/event-stream")

        return Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])

    async def publish_once(self) -> None:
        for pod in self.pods:
            raw = await self.redis.get(keys.target_state(POOL, pod))
            target = await self.specs.resolve(self.redis, TargetState.from_json(raw)) if raw else None
            adapters = []
            for t in target.adapters if target else []:
                bad = self.wrong_digest.get(t.served_name)
                if bad:
                    adapters.append(AdapterResidency(served_name=t.served_name, tier="absent", error="digest mismatch",
                                                     error_reason="DigestMismatch"))
                    continue
                self.digests[t.served_name] = content_digest(t.artifact.digest)
                adapters.append(AdapterResidency(served_name=t.served_name, tier=t.tier, digest=t.artifact.digest,
                                                 adapter_digest=self.digests[t.served_name], bytes=1 << 20))
            targeted = {a.served_name for a in adapters}
            adapters += [held for name, held in self.reported.get(pod, {}).items()
                         if name in self.slow_unload and name not in targeted]
            self.reported[pod] = {a.served_name: a for a in adapters}
            report = ResidencyReport(
                pool=POOL, pod=pod, address=f"127.0.0.1:{self.port}", base_model_digest=self.base_digest,
                max_lora_rank=64, target_generation=target.generation if target else None, heartbeat_at=time.time(),
                ttl_seconds=5.0, adapters=adapters, load=PodLoad(max_gpu_slots=4, max_cpu_slots=8),
            )
            await self.redis.set(keys.residency_report(POOL, pod), report.to_json(), px=5000)
            await self.redis.sadd(keys.residency_index(POOL), pod)

    async def run(self, stop: asyncio.Event) -> None:
        server = uvicorn.Server(uvicorn.Config(self.app(), host="127.0.0.1", port=self.port, log_level="warning",
                                              lifespan="off"))
        serving = asyncio.ensure_future(server.serve())
        try:
            while not stop.is_set():
                try:
                    await self.publish_once()
                except RedisError as exc:  # a sidecar rides out Redis hiccups, and so do these pods
                    self.errors.append(repr(exc))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), 0.1)
        finally:
            server.should_exit = True
            await serving


def api_client(url: str, workdir: Path) -> k8s.ApiClient:
    """A kubernetes client for a devcluster URL (through a kubeconfig, as users configure it)."""
    path = write_kubeconfig(workdir / f"kubeconfig-{free_port()}", url)
    return k8s_config.new_client_from_config(config_file=str(path))


def make_controller(
    url: str, workdir: Path, redis: aioredis.Redis, identity: str = "controller-a", lease: bool = True,
    clock: Callable[[], float] = time.time, monotonic: Callable[[], float] = time.monotonic,
    lease_config: LeaseConfig = FAST_LEASE,
) -> Controller:
    client = api_client(url, workdir)
    elector = LeaseElector(client, identity, lease_config, time.monotonic, clock) if lease else None
    import httpx

    return Controller(
        KubeApi(client, identity, clock), RedisStore(redis, clock), HealthProber(httpx.AsyncClient()), elector,
        ControllerConfig(resync_seconds=0.1), clock, monotonic=monotonic,
    )


@contextlib.asynccontextmanager
async def running(controller: Controller) -> AsyncIterator[Controller]:
    """Run the controller for the block; then stop it and close its probe client."""
    stop = asyncio.Event()
    task = asyncio.ensure_future(controller.run(stop))
    try:
        yield controller
    finally:
        stop.set()
        await task
        await controller.aclose()
        await controller.prober.client.aclose()


def create(client: k8s.ApiClient, body: dict[str, Any], namespace: str = "default") -> dict[str, Any]:
    """Create a custom object (AdapterRevision by default)."""
    return cast(dict[str, Any], k8s.CustomObjectsApi(client).create_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, body))


def get(client: k8s.ApiClient, name: str, namespace: str = "default") -> dict[str, Any]:
    return cast(dict[str, Any], k8s.CustomObjectsApi(client).get_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, name))


def patch_spec(client: k8s.ApiClient, name: str, spec: dict[str, Any], namespace: str = "default") -> None:
    k8s.CustomObjectsApi(client).patch_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, name, {"spec": spec}, _content_type="application/merge-patch+json")


async def eventually(predicate: Callable[[], Any], within: float = 20.0, what: str = "condition") -> Any:
    """Poll ``predicate`` (sync, run in a thread) until it returns something truthy."""
    deadline = time.monotonic() + within
    last: Any = None
    while time.monotonic() < deadline:
        last = await asyncio.to_thread(predicate)
        if last:
            return last
        await asyncio.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what} (last: {last!r})")
