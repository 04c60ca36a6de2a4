"""Issue 31's picker faults on ``loraplane up``'s real processes: the API server, Redis with ACL users, three
reference engines with sidecars, two picker replicas (the chart's default) behind the real Envoy, the controller.

One stack for the module, without a supervisor (a stopped or killed process stays so until the test restores it).
In order: the rates two replicas publish (placement plans what one replica would); every sidecar stopped for 45 s
under traffic, and Redis refusing every write for 45 s (the pool never vanishes); sidecars whose clocks run 600 s
ahead and 120 s behind (reports aged by the picker's receive time). Each test prints its figures (``PICKER {...}``
lines, one JSON object per test).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import redis
import yaml

from loraplane.api import (
    SERVED_ADAPTER_HEADER,
    RequestRates,
    ResidencyReport,
    TargetState,
    Tier,
    keys,
    served_name,
)
from loraplane.credentials import redis_options
from loraplane.picker.envoy import UPSTREAM_HEADER
from loraplane.processes import ManagedProcess
from loraplane.stack.demo import Artifact, manifest, write_artifacts
from loraplane.stack.services import POOL, LocalStack, StackOptions

pytestmark = pytest.mark.slow

HOT = ("support", "claims")
GROUP_PATH = "/apis/loraplane.io/v1alpha1/namespaces/default/adapterrevisions"
#: requests/s one pod serves for one adapter before placement gives it another GPU replica (PlacementConfig)
REPLICA_RATE = 4.0


def _report(name: str, figures: dict[str, Any]) -> None:
    print(f"PICKER {json.dumps({'test': name, **figures})}", flush=True)


@dataclass
class World:
    stack: LocalStack
    artifacts: dict[str, Artifact]
    base_digest: str

    def admin(self) -> redis.Redis:
        return redis.Redis.from_url(self.stack.redis_url, **redis_options(self.stack.secrets.redis_env("admin")),
                                    socket_timeout=5)

    def phases(self) -> dict[str, str]:
        assert self.stack.cluster is not None
        listing = httpx.get(f"{self.stack.cluster.url}{GROUP_PATH}", timeout=10).json()
        return {o["metadata"]["name"]: (o.get("status") or {}).get("phase", "Pending") for o in listing["items"]}

    def gpu_holders(self, name: str) -> set[str]:
        """Pods whose target state (the controller's plan) holds ``name`` on a GPU."""
        client = self.admin()
        out = set()
        for engine in self.stack.engines:
            raw = client.get(keys.target_state(POOL, engine.pod))
            if raw and TargetState.from_json(raw).tiers().get(name) is Tier.GPU:
                out.add(engine.pod)
        return out

    def published_rates(self) -> dict[str, RequestRates]:
        """Every rates key the pickers wrote (one per replica; one shared key before issue 31)."""
        client = self.admin()
        found = {}
        for key in client.scan_iter(match=f"loraplane:{{{POOL}}}:rates*"):
            raw = client.get(key)
            if raw:
                found[key.decode()] = RequestRates.from_json(raw)
        return found

    def picker_metrics(self, replica: int = 0) -> str:
        picker = self.stack.pickers[replica]
        port = picker.args[picker.args.index("--metrics-address") + 1].rpartition(":")[2]
        return httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text

    def endpoint_states(self, replica: int = 0) -> dict[str, float]:
        out = {}
        for line in self.picker_metrics(replica).splitlines():
            if line.startswith("loraplane_picker_endpoints{"):
                state = line.split('state="', 1)[1].split('"', 1)[0]
                out[state] = float(line.rsplit(" ", 1)[1])
        return out

    def sidecar(self, pod: str) -> ManagedProcess:
        return next(e.sidecar for e in self.stack.engines if e.pod == pod and e.sidecar is not None)


def _wait(predicate: Callable[[], Any], within: float, step: float = 0.2) -> Any:
    """Poll ``predicate`` until it returns something truthy (returned); AssertionError after ``within`` s."""
    deadline = time.monotonic() + within
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"not within {within} s (last: {value!r})"
        time.sleep(step)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    work = tmp_path_factory.mktemp("picker-reliability")
    stack = LocalStack(StackOptions(workdir=work, engines=3, pickers=2))
    try:
        stack.start()
        artifacts = write_artifacts(stack.artifacts, [(a, "v1") for a in HOT], stack.options.model)
        engine = stack.engines[0]
        base = httpx.get(f"http://{engine.address}/admin/adapters", headers=stack.admin_headers(engine.pod)).json()
        world = World(stack, artifacts, base["base_model_digest"])
        path = work / "revisions.yaml"
        path.write_text(yaml.safe_dump_all([manifest(artifacts[served_name(a, "v1")], stack.options.model,
                                                     world.base_digest, "gpu-preferred") for a in HOT]))
        assert stack.cluster is not None
        stack.cluster.kubectl("apply", "-f", str(path))
        _wait(lambda: all(world.phases().get(f"{a}-v1") == "Stable" for a in HOT), within=240, step=0.5)
        yield world
    finally:
        stack.stop()


class Traffic:
    """Open-loop requests at ``rate`` through the gateway, in a thread with its own event loop; every answer kept."""

    def __init__(self, world: World, rate: float, models: tuple[str, ...] = HOT) -> None:
        self.world, self.rate, self.models = world, rate, models
        self.records: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)
        self.pod_of = {e.address: e.pod for e in world.stack.engines}
        self.started = self.ended = 0.0

    def __enter__(self) -> Traffic:
        self.started = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self.ended = time.monotonic()
        self._thread.join(60)

    async def _run(self) -> None:
        limits = httpx.Limits(max_connections=200, max_keepalive_connections=50)
        async with httpx.AsyncClient(timeout=30, limits=limits) as http:
            tasks, n = [], 0
            while not self._stop.is_set():
                delay = self.started + n / self.rate - time.monotonic()
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
                      pod=self.pod_of.get(response.headers.get(UPSTREAM_HEADER, "")),
                      error="" if response.status_code == 200 else response.text[:160])

    def offered(self) -> float:
        """Requests/s sent (the client's own count over its own time)."""
        return len(self.records) / max(1e-9, (self.ended or time.monotonic()) - self.started)

    def failed(self, after: float = 0.0, before: float = math.inf) -> list[dict[str, Any]]:
        return [r for r in self.records if r.get("status") != 200 and after <= r["sent_at"] < before]

    def failures(self, after: float = 0.0, before: float = math.inf) -> dict[str, int]:
        return dict(Counter(f"{r.get('status')} {r.get('error', '')[:70]}" for r in self.failed(after, before)))


# --- 1: rates summed over picker replicas --------------------------------------------------------------------------

def test_two_picker_replicas_publish_the_rate_the_pool_gets(world: World) -> None:
    """12 requests/s to one adapter through Envoy, which splits the streams over the two pickers: placement gives it
    the GPU replicas 12 req/s asks for (3 at 4 req/s a replica), as with one picker. Before, both replicas wrote the
    one per-pool rates key and the last writer won: ~6 req/s, 2 replicas."""
    name = served_name("claims", "v1")
    with Traffic(world, rate=12.0, models=("claims",)) as traffic:
        time.sleep(5)
        wanted = math.ceil(traffic.offered() / REPLICA_RATE - 1e-9)
        expected = min(len(world.stack.engines), wanted)
        try:
            _wait(lambda: len(world.gpu_holders(name)) >= expected, within=60, step=0.5)
        except AssertionError:
            pass  # reported and asserted below
        published = world.published_rates()
        holders = world.gpu_holders(name)
    by_picker = {k.rsplit(":", 1)[1]: round(r.windows.get("5m", {}).get(name, 0.0), 2)
                 for k, r in sorted(published.items())}
    served_by = Counter(r.get("pod") for r in traffic.records if r.get("status") == 200)
    _report("rates-two-pickers", {"offered_rps": round(traffic.offered(), 2), "rates_5m_by_key": by_picker,
                                  "rates_5m_summed": round(sum(by_picker.values()), 2),
                                  "gpu_replicas_expected": expected, "gpu_replicas_planned": len(holders),
                                  "served_by_pod": dict(served_by), "requests": len(traffic.records),
                                  "failed": len(traffic.failed())})
    assert len(holders) == expected
    assert sum(by_picker.values()) >= (expected - 1) * REPLICA_RATE  # what the controller plans with
    assert traffic.failed() == []


# --- 2: a pool that never vanishes while its pods are healthy ------------------------------------------------------

def _engine_404s(traffic: Traffic) -> list[dict[str, Any]]:
    """Answers from a model server that did not hold the revision it was sent (its own 404)."""
    return [r for r in traffic.records if r.get("status") == 404 and "does not exist" in r.get("error", "")]


def _sample_states(world: World, out: list[tuple[float, dict[str, float]]], stop: threading.Event,
                   started: float) -> None:
    while not stop.wait(1.0):
        try:
            out.append((round(time.monotonic() - started, 1), world.endpoint_states()))
        except httpx.HTTPError:
            continue


def _silence(world: World, name: str, silence: Callable[[], None], restore: Callable[[], None],
             seconds: float = 45.0) -> dict[str, Any]:
    """Traffic at 20 req/s on both adapters; ``silence`` for ``seconds``, then ``restore``; every request must be
    served. Returns the figures."""
    states: list[tuple[float, dict[str, float]]] = []
    stop = threading.Event()
    with Traffic(world, rate=20.0) as traffic:
        time.sleep(3)
        silenced = time.monotonic()
        sampler = threading.Thread(target=_sample_states, args=(world, states, stop, silenced), daemon=True)
        sampler.start()
        silence()
        try:
            time.sleep(seconds)
        finally:
            restore()
        restored = time.monotonic()
        _wait(lambda: world.endpoint_states().get("fresh") == len(world.stack.engines), within=60)
        back = time.monotonic() - restored
        time.sleep(3)
        stop.set()
        sampler.join(5)
    seen = {f"{s}:{int(v)}" for _, st in states for s, v in st.items() if v}
    figures = {"requests": len(traffic.records), "silent_s": seconds, "failed": len(traffic.failed()),
               "failed_while_silent": len(traffic.failed(silenced, restored)),
               "failed_after": len(traffic.failed(restored)), "engine_404s": len(_engine_404s(traffic)),
               "failures": traffic.failures(), "all_fresh_again_after_s": round(back, 1),
               "picker_endpoint_states_seen": sorted(seen),
               "states_at": {f"{mark}s": next((st for t, st in states if t >= mark), None) for mark in (5, 20, 40)}}
    _report(name, figures)
    assert traffic.failed() == [], traffic.failures()
    return figures


def test_every_sidecar_stopped_45_s_under_traffic_fails_no_request(world: World) -> None:
    """Every sidecar SIGSTOPped for 45 s (stalled: no report is written, Redis answers): the picker keeps the pods as
    last heard, then as stale members whose last reports say what they hold, and routes there (before: ~33 s in,
    the reports 30 s past their TTL were dropped, the pool was empty and every request got 503 no-endpoint). The
    ``fresh`` gauge leaves the silent pods at once (before: fresh until the cliff)."""
    sidecars = [world.sidecar(e.pod) for e in world.stack.engines]

    def send(sig: int) -> None:
        for sidecar in sidecars:
            os.kill(sidecar.pid, sig)

    figures = _silence(world, "every-sidecar-stopped-45s", lambda: send(signal.SIGSTOP), lambda: send(signal.SIGCONT))
    assert {"in-grace:3", "stale:3"} <= set(figures["picker_endpoint_states_seen"])


def test_redis_refusing_every_write_45_s_fails_no_request_and_sidecars_say_refused(world: World) -> None:
    """Redis at ``maxmemory`` with ``noeviction`` for 45 s: every report, target and rates write is refused (OOM)
    while reads work. No request fails, none reaches a pod without its revision around the recovery (before: 220 of
    845 failed, then 11 engine 404s), and the sidecars log the refusal, not "redis unreachable"."""
    admin = world.admin()
    logs = {e.pod: world.sidecar(e.pod).log_path for e in world.stack.engines}
    sizes = {pod: path.stat().st_size for pod, path in logs.items()}
    policy = admin.config_get("maxmemory-policy")["maxmemory-policy"]

    def full() -> None:
        admin.config_set("maxmemory-policy", "noeviction")
        admin.config_set("maxmemory", 1)  # every write command refused with OOM; reads answered

    def freed() -> None:
        admin.config_set("maxmemory", 0)
        admin.config_set("maxmemory-policy", policy)

    try:
        figures = _silence(world, "redis-refusing-writes-45s", full, freed)
    finally:
        freed()
    said = {}
    for pod, path in logs.items():
        with path.open() as log:
            log.seek(sizes[pod])
            text = log.read()
        said[pod] = {"refused": text.count("redis refused the write"), "unreachable": text.count("unreachable")}
    _report("redis-refusing-writes-45s-sidecar-logs", said)
    assert figures["engine_404s"] == 0
    assert all(s["refused"] >= 1 and s["unreachable"] == 0 for s in said.values()), said


# --- 5: reports aged by the picker's receive time ------------------------------------------------------------------

SKEWED = ("import runpy, sys, time; real = time.time; time.time = lambda: real() + {skew}; "
          "sys.argv = ['loraplane.sidecar', *sys.argv[1:]]; runpy.run_module('loraplane.sidecar', run_name='__main__')")


def _skew_sidecar(world: World, pod: str, skew: float) -> ManagedProcess:
    """Replace ``pod``'s sidecar with the same one whose wall clock runs ``skew`` seconds off (its heartbeats)."""
    engine = next(e for e in world.stack.engines if e.pod == pod)
    old = engine.sidecar
    assert old is not None
    old.stop()
    module = list(old.args).index("loraplane.sidecar")
    args = [sys.executable, "-c", SKEWED.format(skew=skew), *list(old.args)[module + 1:]]
    engine.sidecar = ManagedProcess(args, old.log_path.with_name(f"sidecar-{pod}-skewed.log"), env=old.env).start()
    return engine.sidecar


def _restore_sidecar(world: World, pod: str, original: ManagedProcess) -> None:
    engine = next(e for e in world.stack.engines if e.pod == pod)
    if engine.sidecar is not None:
        engine.sidecar.stop()
    engine.sidecar = original.start()


def _heartbeat(world: World, pod: str) -> float:
    raw = world.admin().get(keys.residency_report(POOL, pod))
    return ResidencyReport.from_json(raw).heartbeat_at if raw else math.nan


def test_a_sidecar_clock_120_s_behind_is_fresh(world: World) -> None:
    """Aged by the sidecar's clock, a pod whose clock runs 120 s behind was stale on arrival: excluded from
    routing while it served. By the picker's receive time it is fresh, and takes its share of the traffic."""
    pod = world.stack.engines[1].pod
    original = world.sidecar(pod)
    _skew_sidecar(world, pod, -120.0)
    try:
        _wait(lambda: _heartbeat(world, pod) < time.time() - 100, within=30)
        time.sleep(2)
        states = [world.endpoint_states(i) for i in range(2)]
        with Traffic(world, rate=20.0) as traffic:
            time.sleep(8)
        served = Counter(r.get("pod") for r in traffic.records if r.get("status") == 200)
        _report("sidecar-clock-120s-behind", {"heartbeat_behind_s": round(time.time() - _heartbeat(world, pod), 1),
                                              "picker_endpoint_states": states, "served_by_pod": dict(served),
                                              "failed": len(traffic.failed())})
        assert all(s.get("fresh") == len(world.stack.engines) for s in states), states
        assert served[pod] > 0
    finally:
        _restore_sidecar(world, pod, original)
        _wait(lambda: abs(_heartbeat(world, pod) - time.time()) < 5, within=30)


def test_a_pod_whose_clock_runs_600_s_ahead_leaves_when_it_dies(world: World) -> None:
    """A pod whose sidecar's clock runs 600 s ahead dies (engine and sidecar SIGKILLed): by its heartbeat its last
    report is fresh for ten more minutes, and the picker sent it traffic all that time (Envoy retried what it
    could). By the picker's receive time it leaves the fresh count after its TTL and the routing after the grace;
    the report-age histogram observed at decision time shows no chosen report older than TTL + grace."""
    engine = world.stack.engines[2]
    original = world.sidecar(engine.pod)
    _skew_sidecar(world, engine.pod, 600.0)
    try:
        _wait(lambda: _heartbeat(world, engine.pod) > time.time() + 500, within=30)
        time.sleep(2)
        with Traffic(world, rate=10.0) as traffic:
            time.sleep(2)
            assert engine.sidecar is not None
            engine.sidecar.stop(sig=signal.SIGKILL)
            engine.engine.stop(sig=signal.SIGKILL)
            killed = time.monotonic()
            _wait(lambda: all(world.endpoint_states(i).get("fresh") == 2 for i in range(2)), within=60)
            not_fresh = time.monotonic() - killed
            _wait(lambda: all(world.endpoint_states(i).get("stale") == 1 for i in range(2)), within=90)
            left = time.monotonic() - killed
            time.sleep(5)
        after = [r for r in traffic.records if r["sent_at"] >= killed + left]
        ages = {}
        for line in world.picker_metrics().splitlines():
            if line.startswith("loraplane_picker_report_age_seconds_bucket"):
                ages[line.split('le="', 1)[1].split('"', 1)[0]] = float(line.rsplit(" ", 1)[1])
        _report("sidecar-clock-600s-ahead-pod-killed", {
            "heartbeat_ahead_s": 600, "not_fresh_after_s": round(not_fresh, 1), "stale_after_s": round(left, 1),
            "requests": len(traffic.records), "failed_before_stale": len(traffic.failed(killed, killed + left)),
            "requests_after_stale": len(after), "failed_after_stale": len([r for r in after if r.get("status") != 200]),
            "report_age_buckets": ages})
        assert after and all(r.get("status") == 200 and r.get("pod") != engine.pod for r in after)
        assert ages["+Inf"] == ages["60.0"]  # every chosen report younger than TTL + grace
    finally:
        engine.engine.start()
        _restore_sidecar(world, engine.pod, original)
        _wait(lambda: world.endpoint_states().get("fresh") == len(world.stack.engines), within=120)
