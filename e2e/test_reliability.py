"""Issue 31's faults and hostile inputs on ``loraplane up``'s real processes: the API server, Redis with ACL users,
three reference engines with sidecars, two picker replicas behind the real Envoy, the controller.

One stack for the module, without a supervisor (a killed process stays dead). In order: the spec's immutable fields
and the API server's size limits through kubectl; a status patch that tries to skip a canary gate; a fetch that
keeps failing meets its progress deadline; 2,000 concurrent streams through Envoy; one picker replica SIGKILLed
under traffic. Each test prints its figures (``RELIABILITY {...}`` lines, one JSON object per test).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import yaml

from loraplane.api import SERVED_ADAPTER_HEADER, RouteTable, keys, served_name
from loraplane.credentials import redis_options
from loraplane.picker.envoy import UPSTREAM_HEADER
from loraplane.picker.extproc import DROPPED_REASON_HEADER
from loraplane.stack.demo import Artifact, manifest, write_artifacts
from loraplane.stack.services import POOL, LocalStack, StackOptions

pytestmark = pytest.mark.slow

HOT = ("support", "claims")
GROUP_PATH = "/apis/loraplane.io/v1alpha1/namespaces/default/adapterrevisions"


def _report(name: str, figures: dict[str, Any]) -> None:
    print(f"RELIABILITY {json.dumps({'test': name, **figures})}", flush=True)


class World:
    """The running stack, its artifacts and helpers."""

    def __init__(self, stack: LocalStack, artifacts: dict[str, Artifact], base_digest: str) -> None:
        self.stack, self.artifacts, self.base_digest = stack, artifacts, base_digest

    @property
    def cluster(self) -> Any:
        assert self.stack.cluster is not None
        return self.stack.cluster

    def kubectl(self, *args: str, stdin: str | None = None, check: bool = True) -> Any:
        return self.cluster.kubectl(*args, stdin=stdin, check=check)

    def apply(self, manifests: list[dict[str, Any]], check: bool = True) -> Any:
        return self.kubectl("apply", "-f", "-", stdin=yaml.safe_dump_all(manifests), check=check)

    def manifest(self, adapter: str, revision: str, **rollout: Any) -> dict[str, Any]:
        body = manifest(self.artifacts[served_name(adapter, revision)], self.stack.options.model, self.base_digest,
                        "gpu-preferred")
        body["spec"]["rollout"].update(rollout)
        return body

    def status(self, name: str) -> dict[str, Any]:
        obj = httpx.get(f"{self.cluster.url}{GROUP_PATH}/{name}", timeout=10).json()
        return obj.get("status") or {}

    def wait_phase(self, name: str, phase: str, within: float, step: int | None = None) -> dict[str, Any]:
        deadline = time.monotonic() + within
        while True:
            status = self.status(name)
            if status.get("phase") == phase and (step is None or status.get("canaryStep") == step):
                return status
            assert time.monotonic() < deadline, (name, phase, status)
            time.sleep(0.2)

    def admin_redis(self) -> redis.Redis:
        return redis.Redis.from_url(self.stack.redis_url, **redis_options(self.stack.secrets.redis_env("admin")),
                                    socket_timeout=2)

    def weights(self) -> dict[str, int]:
        raw = self.admin_redis().get(keys.route_table(POOL))
        table = RouteTable.from_json(raw) if raw else None
        return {w.served_name: w.weight for e in (table.models.values() if table else []) for w in e.revisions}

    def envoy_admin(self, path: str) -> Any:
        config = json.loads((self.stack.options.workdir / "envoy.json").read_text())
        port = config["admin"]["address"]["socket_address"]["port_value"]
        return httpx.get(f"http://127.0.0.1:{port}{path}", timeout=10)

    def unhealthy_pickers(self) -> dict[int, list[str]]:
        """Port -> Envoy's health flags of each picker host it takes out (failed active check, ejected)."""
        clusters = self.envoy_admin("/clusters?format=json").json()["cluster_statuses"]
        picker = next(c for c in clusters if c["name"] == "picker")
        out = {}
        for host in picker.get("host_statuses", []):
            flags = [k for k, v in host.get("health_status", {}).items() if v is True]
            if flags:
                out[host["address"]["socket_address"]["port_value"]] = flags
        return out


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    work = tmp_path_factory.mktemp("reliability")
    stack = LocalStack(StackOptions(workdir=work, engines=3, pickers=2))
    try:
        stack.start()
        revisions = [(a, "v1") for a in HOT] + [("claims", "v2")]
        artifacts = write_artifacts(stack.artifacts, revisions, stack.options.model)
        engine = stack.engines[0]
        base = httpx.get(f"http://{engine.address}/admin/adapters", headers=stack.admin_headers(engine.pod)).json()
        world = World(stack, artifacts, base["base_model_digest"])
        world.apply([world.manifest(a, "v1") for a in HOT])
        for adapter in HOT:
            world.wait_phase(f"{adapter}-v1", "Stable", within=240)
        yield world
    finally:
        stack.stop()


# --- 9: immutability and size limits -------------------------------------------------------------------------------

def test_served_fields_are_immutable_and_the_api_server_refuses_oversized_annotations(world: World) -> None:
    """Every field that defines what is served is refused on change by kubectl apply (CEL ``self == oldSelf``, as a
    real API server runs it), and so is a 300 KiB annotation; the Stable revision is left as it was."""
    before = httpx.get(f"{world.cluster.url}{GROUP_PATH}/support-v1", timeout=10).json()
    changes = {
        "spec.artifact.uri": lambda s: s["artifact"].update(uri=world.artifacts["claims@v1"].uri),
        "spec.artifact.digest": lambda s: s["artifact"].update(digest=world.artifacts["claims@v1"].digest),
        "spec.baseModel": lambda s: s["baseModel"].update(digest="sha256:" + "0" * 64),
        "spec.lora": lambda s: s["lora"].update(alpha=99),
        "spec.adapter": lambda s: s.update(adapter="other"),
        "spec.poolRef": lambda s: s.update(poolRef={"name": "elsewhere"}),
    }
    refused = {}
    for field, change in changes.items():
        body = world.manifest("support", "v1")
        change(body["spec"])
        result = world.apply([body], check=False)
        refused[field] = result.returncode != 0 and f"{field} is immutable" in result.stderr
    patch = world.stack.options.workdir / "big-annotation.json"
    patch.write_text(json.dumps({"metadata": {"annotations": {"example.com/big": "x" * (300 * 1024)}}}))
    big = world.kubectl("patch", "adapterrevision", "support-v1", "--type=merge", "--patch-file", str(patch),
                        check=False)
    after = httpx.get(f"{world.cluster.url}{GROUP_PATH}/support-v1", timeout=10).json()
    _report("immutable-fields-and-size-limits", {"refused": refused, "annotation_300kib_exit": big.returncode,
                                                 "annotation_error": big.stderr.strip()[-120:]})
    assert all(refused.values()), refused
    assert big.returncode != 0 and "metadata.annotations: Too long: may not be more than 262144 bytes" in big.stderr
    assert after["spec"] == before["spec"] and after["metadata"].get("annotations") == before["metadata"].get(
        "annotations")


def test_a_fetch_that_keeps_failing_fails_at_its_progress_deadline(world: World) -> None:
    body = world.manifest("support", "v1", progressDeadlineSeconds=8)
    body["metadata"]["name"] = "missing-v1"
    body["spec"].update(adapter="missing")
    body["spec"]["artifact"] = {"uri": (world.stack.artifacts / "no-such-file.tar").as_uri(),
                                "digest": "sha256:" + "1" * 64}
    applied = time.monotonic()
    world.apply([body])
    status = world.wait_phase("missing-v1", "Failed", within=60)
    waited = time.monotonic() - applied
    _report("progress-deadline", {"deadline_s": 8, "failed_after_s": round(waited, 1), "reason": status["reason"],
                                  "message": status["message"][:200]})
    assert status["reason"] == "ProgressDeadlineExceeded"
    assert "not verified within 8s" in status["message"] and "fetch failed" in status["message"]
    # not before the deadline: tests/controller/test_rollout.py checks that on the controller's clock


# --- 7: a status patch cannot skip a gate --------------------------------------------------------------------------

class Traffic:
    """Open-loop requests at ``rate`` through the gateway, in a thread with its own event loop."""

    def __init__(self, world: World, rate: float = 20.0, models: tuple[str, ...] = HOT) -> None:
        self.world, self.rate, self.models = world, rate, models
        self.records: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    def __enter__(self) -> Traffic:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(60)

    async def _run(self) -> None:
        async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=200)) as http:
            tasks, started, n = [], time.monotonic(), 0
            while not self._stop.is_set():
                delay = started + n / self.rate - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(self._one(http, self.models[n % len(self.models)])))
                n += 1
            await asyncio.gather(*tasks)

    async def _one(self, http: httpx.AsyncClient, model: str) -> None:
        record: dict[str, Any] = {"sent_at": time.monotonic(), "model": model}
        self.records.append(record)
        body = {"model": model, "prompt": "Say one word:", "max_tokens": 1, "temperature": 0}
        try:
            response = await http.post(f"{self.world.stack.gateway_url}/v1/completions", json=body)
        except httpx.HTTPError as exc:
            record.update(status=0, error=f"{type(exc).__name__}: {exc}")
            return
        record.update(status=response.status_code, served=response.headers.get(SERVED_ADAPTER_HEADER),
                      upstream=response.headers.get(UPSTREAM_HEADER), error=response.text[:120]
                      if response.status_code != 200 else "")

    def failed(self, after: float = 0.0) -> list[dict[str, Any]]:
        return [r for r in self.records if r.get("status") != 200 and r["sent_at"] >= after]


def test_a_status_patch_during_canary_step_one_skips_no_gate(world: World) -> None:
    """``kubectl patch --subresource=status`` of ``phase: Stable`` (weight 100) during Canary(1): the route keeps
    the canary at step 1's 20 %, the controller writes its own status back, and step 2 still runs."""
    new = world.manifest("claims", "v2", steps=[{"weight": 20, "pauseSeconds": 20}, {"weight": 50, "pauseSeconds": 4}])
    with Traffic(world) as traffic:
        world.apply([new])
        ours = world.wait_phase("claims-v2", "Canary", within=120, step=0)
        forged = json.dumps({"status": {"phase": "Stable", "trafficWeight": 100, "reason": "Promoted"}})
        world.kubectl("patch", "adapterrevision", "claims-v2", "--subresource=status", "--type=merge", "-p", forged)
        patched = time.monotonic()
        weights, phases = [], []
        while time.monotonic() - patched < 5:
            weights.append(world.weights().get("claims@v2", 0))
            phases.append(world.status("claims-v2").get("phase"))
            time.sleep(0.05)
        restored = world.status("claims-v2")
        final = world.wait_phase("claims-v2", "Stable", within=120)
        events = json.loads(world.kubectl("get", "events", "-o", "json").stdout)["items"]
    overwritten = [e for e in events if e["involvedObject"]["name"] == "claims-v2" and e["reason"] == "StatusOverwritten"]
    served_v2 = Counter(r.get("served") for r in traffic.records if r.get("status") == 200 and r["model"] == "claims")
    _report("status-patch-mid-canary", {"weights_after_patch": sorted(set(weights)),
                                        "phases_seen_after_patch": sorted(set(filter(None, phases))),
                                        "restored": f"{restored.get('phase')}({restored.get('canaryStep')})",
                                        "events_status_overwritten": len(overwritten),
                                        "served_claims": dict(served_v2), "failed": len(traffic.failed())})
    assert max(weights) == 20, weights
    assert (restored["phase"], restored["canaryStep"], restored["phaseSince"]) == (
        "Canary", 0, ours["phaseSince"])
    assert overwritten and "restored Canary step 1" in overwritten[0]["message"]
    assert final["phase"] == "Stable"
    reasons = [e["reason"] for e in sorted(events, key=lambda e: e.get("lastTimestamp") or "")
               if e["involvedObject"]["name"] == "claims-v2"]
    assert reasons.count("CanaryStep") == 2, reasons  # step 2 ran: no gate skipped


# --- 6: circuit breakers above the picker's queue limits -----------------------------------------------------------

def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def test_two_thousand_concurrent_streams_get_only_the_pickers_answers(world: World) -> None:
    """2,000 streamed completions at once through Envoy: each gets a 200 or the picker's own 429 / 503 with its
    reason header, never Envoy's empty 500 of an overflowing circuit breaker."""
    assert world.stack.envoy is not None
    envoy_pid = world.stack.envoy.pid
    rss_before = _rss_kib(envoy_pid)
    answers: list[tuple[int, str | None, int]] = []
    peak = [rss_before]

    async def one(http: httpx.AsyncClient, i: int, gate: asyncio.Event) -> None:
        await gate.wait()
        body = {"model": HOT[i % 2], "prompt": "Say one word:", "max_tokens": 1, "temperature": 0, "stream": True}
        try:
            async with http.stream("POST", f"{world.stack.gateway_url}/v1/completions", json=body) as response:
                size = sum([len(chunk) async for chunk in response.aiter_bytes()])
                answers.append((response.status_code, response.headers.get(DROPPED_REASON_HEADER), size))
        except httpx.HTTPError as exc:
            answers.append((0, f"{type(exc).__name__}", 0))

    async def sample(stop: asyncio.Event) -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], _rss_kib(envoy_pid))
            await asyncio.sleep(0.2)

    async def run() -> float:
        limits = httpx.Limits(max_connections=2100, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=120, limits=limits) as http:
            gate, stop = asyncio.Event(), asyncio.Event()
            sampler = asyncio.create_task(sample(stop))
            tasks = [asyncio.create_task(one(http, i, gate)) for i in range(2000)]
            await asyncio.sleep(0.5)
            started = time.monotonic()
            gate.set()
            await asyncio.gather(*tasks)
            stop.set()
            await sampler
            return time.monotonic() - started

    wall = asyncio.run(run())
    time.sleep(2)
    rss_after = _rss_kib(envoy_pid)
    statuses = Counter(status for status, _, _ in answers)
    reasons = Counter(f"{status} {reason}" for status, reason, _ in answers if status != 200)
    without_reason = [a for a in answers if a[0] != 200 and (a[0] not in (429, 503) or not a[1])]
    _report("2000-concurrent-streams", {"streams": len(answers), "wall_s": round(wall, 1),
                                        "statuses": {str(k): v for k, v in sorted(statuses.items())},
                                        "refusals": dict(reasons), "without_picker_reason": len(without_reason),
                                        "envoy_rss_mib": {
                                            "before": round(rss_before / 1024, 1), "peak": round(peak[0] / 1024, 1),
                                            "after": round(rss_after / 1024, 1)}})
    assert len(answers) == 2000
    assert without_reason == [], Counter(f"{s} {r}" for s, r, _ in without_reason)
    assert statuses[200] > 0


# --- 8: a dead picker replica is taken out -------------------------------------------------------------------------

def test_one_of_two_pickers_sigkilled_under_traffic_fails_nothing_after_detection(world: World) -> None:
    """Both replicas listed in Envoy's picker cluster; one SIGKILLed: Envoy's active gRPC health check and outlier
    detection take it out, and from then on no request fails (before: about half failed until it came back)."""
    victim = world.stack.pickers[1]
    config = json.loads((world.stack.options.workdir / "envoy.json").read_text())
    picker_cluster = next(c for c in config["static_resources"]["clusters"] if c["name"] == "picker")
    ports = [h["endpoint"]["address"]["socket_address"]["port_value"]
             for h in picker_cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]]
    victim_port = ports[1]
    assert world.unhealthy_pickers() == {}
    with Traffic(world) as traffic:
        time.sleep(3)
        os.kill(victim.pid, signal.SIGKILL)
        killed = time.monotonic()
        detected, detected_flags = None, None
        while time.monotonic() - killed < 15:
            flags = world.unhealthy_pickers().get(victim_port)
            if flags and detected is None:
                detected, detected_flags = time.monotonic(), flags
            if detected is not None and time.monotonic() - detected > 10:
                break
            time.sleep(0.05)
    cut = killed if detected is None else detected
    before = [r for r in traffic.records if killed <= r["sent_at"] < cut]
    after = [r for r in traffic.records if r["sent_at"] >= cut]
    _report("picker-sigkill-two-replicas", {
        "requests": len(traffic.records),
        "detected_after_s": None if detected is None else round(detected - killed, 2), "flags": detected_flags,
        "failed_before_detection": len([r for r in before if r.get("status") != 200]),
        "failed_after_detection": len([r for r in after if r.get("status") != 200]), "requests_after_detection":
        len(after), "failures": Counter(f"{r.get('status')} {r.get('error', '')[:40]}" for r in traffic.failed())})
    assert detected is not None, "Envoy never took the dead picker out"
    assert len(after) > 100
    assert [r for r in after if r.get("status") != 200] == []
