"""Chaos and hostile clients against ``loraplane up``'s real processes, at a steady 20 requests/s through Envoy.

One stack (3 reference engines with sidecars, Redis with ACL users, picker, Envoy, controller, the API server) runs
for the whole module with its supervisor restarting whatever dies. Each test injects one fault (SIGKILL, SIGSTOP) or
one hostile action while traffic flows, then checks every response: status, and for a 200 the served revision and
content digest against the route table and the artifact (a wrong revision is any other). Each prints its figures
(``CHAOS {...}`` lines, one JSON object per test) for the issue notes.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from redis.exceptions import AuthenticationError, NoPermissionError, ResponseError

from loraplane.api import (
    ADAPTER_DIGEST_HEADER,
    SERVED_ADAPTER_HEADER,
    ResidencyReport,
    RouteTable,
    TargetState,
    keys,
    served_name,
)
from loraplane.credentials import redis_options
from loraplane.picker.envoy import UPSTREAM_HEADER
from loraplane.processes import ManagedProcess, wait_for_port
from loraplane.stack.demo import Artifact, manifest, write_artifacts
from loraplane.stack.secrets import sidecar_user
from loraplane.stack.services import POOL, LocalStack, StackOptions

pytestmark = pytest.mark.slow

RATE = 20.0
HOT = ("support", "claims")
GROUP_PATH = "/apis/loraplane.io/v1alpha1/namespaces/default/adapterrevisions"


@dataclass
class Record:
    """One request and what came back."""

    sent_at: float
    model: str
    status: int = 0
    served: str | None = None
    pod: str | None = None
    wrong_revision: bool = False
    error: str = ""
    done_at: float = 0.0


@dataclass
class Chaos:
    """The running stack, its artifacts, and the supervisor thread's log."""

    stack: LocalStack
    artifacts: dict[str, Artifact]
    base_digest: str
    said: list[str] = field(default_factory=list)

    def admin_redis(self) -> redis.Redis:
        return self.user_redis("admin")

    def user_redis(self, user: str) -> redis.Redis:
        return redis.Redis.from_url(self.stack.redis_url, **redis_options(self.stack.secrets.redis_env(user)),
                                    socket_timeout=2)

    def routes(self) -> RouteTable | None:
        raw = self.admin_redis().get(keys.route_table(POOL))
        return RouteTable.from_json(raw) if raw else None

    def named(self, model: str) -> set[str]:
        table = self.routes()
        entry = table.models.get(model) if table else None
        return {r.served_name for r in entry.revisions} if entry else set()

    def holders(self) -> dict[str, set[str]]:
        """Served name -> pods whose report holds it servable (gpu, cpu, or registered on disk) with its digest."""
        client = self.admin_redis()
        held: dict[str, set[str]] = {}
        for engine in self.stack.engines:
            raw = client.get(keys.residency_report(POOL, engine.pod))
            if raw is None:
                continue
            report = ResidencyReport.from_json(raw)
            for row in report.adapters:
                servable = row.tier.value in ("gpu", "cpu") or (row.tier.value == "disk" and row.registered)
                if row.digest and servable and not row.draining:
                    held.setdefault(row.served_name, set()).add(report.pod)
        return held

    def process(self, name: str) -> ManagedProcess:
        return next(p for p in self.stack.processes() if Path(p.log_path).stem == name)

    def apply(self, manifests: list[dict[str, Any]], name: str) -> None:
        import yaml

        path = self.stack.options.workdir / "manifests" / f"{name}.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump_all(manifests))
        assert self.stack.cluster is not None
        self.stack.cluster.kubectl("apply", "-f", str(path))

    def phases(self) -> dict[str, str]:
        assert self.stack.cluster is not None
        listing = httpx.get(f"{self.stack.cluster.url}{GROUP_PATH}", timeout=10).json()
        return {o["metadata"]["name"]: (o.get("status") or {}).get("phase", "Pending") for o in listing["items"]}

    def wait_stable(self, names: list[str], within: float) -> None:
        deadline = time.monotonic() + within
        while True:
            phases = self.phases()
            if all(phases.get(n) == "Stable" for n in names):
                return
            assert not {n: phases.get(n) for n in names if phases.get(n) in ("Failed", "RolledBack")}, phases
            assert time.monotonic() < deadline, phases
            time.sleep(0.3)


def _supervise(stack: LocalStack, stop: threading.Event, said: list[str]) -> None:
    while not stop.wait(0.2):
        stack.restart_dead(said.append)


@pytest.fixture(scope="module")
def chaos(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Chaos]:
    work = tmp_path_factory.mktemp("chaos")
    stack = LocalStack(StackOptions(workdir=work, engines=3))
    stop = threading.Event()
    said: list[str] = []
    try:
        stack.start()
        supervisor = threading.Thread(target=_supervise, args=(stack, stop, said), daemon=True)
        supervisor.start()
        revisions = [(a, "v1") for a in HOT] + [("claims", "v2")]
        artifacts = write_artifacts(stack.artifacts, revisions, stack.options.model)
        engine = stack.engines[0]
        base = httpx.get(f"http://{engine.address}/admin/adapters", headers=stack.admin_headers(engine.pod)).json()
        world = Chaos(stack, artifacts, base["base_model_digest"], said)
        first = [manifest(artifacts[served_name(a, "v1")], stack.options.model, world.base_digest, "gpu-preferred")
                 for a in HOT]
        world.apply(first, "v1")
        world.wait_stable([m["metadata"]["name"] for m in first], within=240)
        yield world
    finally:
        stop.set()
        stack.stop()


class Traffic:
    """Open-loop requests at a steady ``rate`` through the gateway, in a thread with its own event loop."""

    def __init__(self, world: Chaos, rate: float = RATE, models: tuple[str, ...] = HOT) -> None:
        self.world, self.rate, self.models = world, rate, models
        self.records: list[Record] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)
        self.content_digest = {a.served_name: a.content_digest for a in world.artifacts.values()}
        self.pod_of = {e.address: e.pod for e in world.stack.engines}

    def __enter__(self) -> Traffic:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(60)

    async def _run(self) -> None:
        limits = httpx.Limits(max_connections=200, max_keepalive_connections=50)
        async with httpx.AsyncClient(timeout=30, limits=limits) as http:
            tasks = []
            started, n = time.monotonic(), 0
            while not self._stop.is_set():
                delay = started + n / self.rate - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                model = self.models[n % len(self.models)]
                tasks.append(asyncio.create_task(self._one(http, model)))
                n += 1
            await asyncio.gather(*tasks)

    async def _one(self, http: httpx.AsyncClient, model: str) -> None:
        record = Record(time.monotonic(), model)
        self.records.append(record)
        body = {"model": model, "prompt": "Say one word:", "max_tokens": 1, "temperature": 0}
        try:
            response = await http.post(f"{self.world.stack.gateway_url}/v1/completions", json=body)
        except httpx.HTTPError as exc:
            record.error, record.done_at = f"{type(exc).__name__}: {exc}", time.monotonic()
            return
        record.done_at, record.status = time.monotonic(), response.status_code
        if response.status_code != 200:
            record.error = response.text[:200]
            return
        record.served = response.headers.get(SERVED_ADAPTER_HEADER)
        record.pod = self.pod_of.get(response.headers.get(UPSTREAM_HEADER, ""))
        adapter = (record.served or "").split("@")[0]
        digest_ok = self.content_digest.get(record.served or "") == response.headers.get(ADAPTER_DIGEST_HEADER)
        record.wrong_revision = adapter != model or not digest_ok

    def failed(self, between: tuple[float, float] = (0.0, float("inf"))) -> list[Record]:
        return [r for r in self.records if r.status != 200 and between[0] <= r.sent_at <= between[1]]

    def figures(self, **extra: Any) -> dict[str, Any]:
        span = max((r.sent_at for r in self.records), default=0.0) - min((r.sent_at for r in self.records), default=0.0)
        statuses: dict[str, int] = {}
        for r in self.records:
            statuses[str(r.status)] = statuses.get(str(r.status), 0) + 1
        return {"requests": len(self.records), "rate_per_s": round(len(self.records) / span, 1) if span else 0,
                "failed": len(self.failed()), "statuses": statuses,
                "wrong_revision": sum(r.wrong_revision for r in self.records), **extra}


def _report(name: str, figures: dict[str, Any]) -> None:
    print(f"CHAOS {json.dumps({'test': name, **figures})}", flush=True)


def _envoy_stat(world: Chaos, name: str) -> int:
    """One counter from Envoy's admin interface (its port is in the stack's Envoy config)."""
    config = json.loads((world.stack.options.workdir / "envoy.json").read_text())
    port = config["admin"]["address"]["socket_address"]["port_value"]
    text = httpx.get(f"http://127.0.0.1:{port}/stats", params={"filter": f"^{name}$"}, timeout=10).text
    return sum(int(line.rsplit(":", 1)[1]) for line in text.splitlines() if line.strip())


def _engine_404s(traffic: Traffic) -> list[Record]:
    """Responses from a model server that does not hold the revision it was sent (its own 404)."""
    return [r for r in traffic.records if r.status == 404 and "does not exist" in r.error]


def _wait(predicate: Callable[[], bool], within: float, step: float = 0.05) -> float:
    """Seconds until ``predicate`` held (AssertionError after ``within``)."""
    started = time.monotonic()
    while not predicate():
        assert time.monotonic() - started < within, f"not within {within} s"
        time.sleep(step)
    return time.monotonic() - started


# --- hostile clients ------------------------------------------------------------------------------------------------

ADMIN_PATHS = [
    ("POST", "/v1/unload_lora_adapter", {"lora_name": "claims@v1"}),
    ("POST", "/v1/load_lora_adapter", {"lora_name": "claims@v1", "lora_path": "support-v1"}),
    ("POST", "/admin/adapters/claims%40v1/offload", None),
    ("POST", "/admin/adapters/claims@v1/unpin", None),
    ("GET", "/admin/adapters", None),
    ("POST", "/v1/completions/../unload_lora_adapter", {"lora_name": "claims@v1"}),
    ("POST", "/v1/completions/..%2Funload_lora_adapter", {"lora_name": "claims@v1"}),
    ("POST", "//v1/unload_lora_adapter", {"lora_name": "claims@v1"}),
    ("POST", "/V1/unload_lora_adapter", {"lora_name": "claims@v1"}),
    ("POST", "/v1/unload_lora_adapter?x=/v1/completions", {"lora_name": "claims@v1"}),
    ("GET", "/metrics", None),
    ("GET", "/health", None),
    ("POST", "/adapters", {"name": "claims@v1", "src": "support-v1"}),  # vLLM's SageMaker alias, not behind its key
    ("POST", "/invocations", {"model": "claims", "prompt": "hi"}),
]


def _listings(world: Chaos) -> dict[str, Any]:
    """Per pod: what each engine holds, by served name (content digest, pinned, loads): an unload, a load or a
    reload of other files under a served name, a pin, all change it."""
    out = {}
    for engine in world.stack.engines:
        listing = httpx.get(f"http://{engine.address}/admin/adapters", headers=world.stack.admin_headers(engine.pod),
                            timeout=10).json()
        out[engine.pod] = sorted((a["served_name"], a["adapter_digest"], a["pinned"], a["loads"])
                                 for a in listing["adapters"])
    return out


def test_admin_paths_through_the_gateway_change_nothing(chaos: Chaos) -> None:
    """No traffic meanwhile (traffic moves adapters by placement, which would hide or fake a change)."""
    before = _listings(chaos)
    answers = {}
    with httpx.Client(timeout=10) as http:
        for method, path, body in ADMIN_PATHS:
            request = http.build_request(method, chaos.stack.gateway_url, json=body)
            request.url = request.url.copy_with(raw_path=path.encode())
            answers[path] = http.send(request).status_code
    # a caller on the engines' own host without the token, and with a wrong one
    direct = [httpx.post(f"http://{e.address}/v1/unload_lora_adapter", json={"lora_name": "claims@v1"},
                         headers=headers, timeout=10).status_code
              for e in chaos.stack.engines for headers in ({}, {"authorization": "Bearer guess"})]
    time.sleep(1)
    after = _listings(chaos)
    changed = sum(before[p] != after[p] for p in before)
    _report("hostile-admin-paths", {"answers": answers, "direct_without_token": sorted(set(direct)),
                                    "admin_actions": changed})
    assert all(status in (400, 404) for status in answers.values()), answers
    assert set(direct) == {403}
    assert changed == 0, (before, after)


def test_reloading_another_adapters_files_through_the_gateway_serves_no_wrong_revision(chaos: Chaos) -> None:
    """The issue's attack: ``load_inplace`` of one adapter's files under another's live served name, repeated
    through the gateway while traffic flows."""
    attack = {"lora_name": served_name("claims", "v1"), "lora_path": "support-v1", "load_inplace": True}
    answers: set[int] = set()
    with Traffic(chaos) as traffic, httpx.Client(timeout=10) as http:
        for _ in range(25):
            for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
                answers.add(http.post(f"{chaos.stack.gateway_url}{path}", json=attack).status_code)
            time.sleep(0.2)
    _report("hostile-load-inplace", traffic.figures(attack_answers=sorted(answers)))
    assert answers == {404}
    assert traffic.figures()["wrong_revision"] == 0 and traffic.failed() == []


def test_forged_redis_payloads_need_the_password_and_the_right_user(chaos: Chaos) -> None:
    forged = RouteTable(pool=POOL, generation=10**6, updated_at=time.time(), models={})
    refusals = {}
    for who, client in {
        "no password": redis.Redis.from_url(chaos.stack.redis_url, socket_timeout=2),
        "wrong password": redis.Redis.from_url(chaos.stack.redis_url, username="controller", password="guess"),
        "a sidecar's user": chaos.user_redis(sidecar_user(chaos.stack.engines[0].pod)),
        "the picker's user": chaos.user_redis("picker"),
    }.items():
        try:
            client.set(keys.route_table(POOL), forged.to_json())
            refusals[who] = "ACCEPTED"
        except (AuthenticationError, NoPermissionError, ResponseError) as exc:
            refusals[who] = type(exc).__name__
    sidecar = chaos.user_redis(sidecar_user(chaos.stack.engines[0].pod))
    other = chaos.stack.engines[1].pod
    try:
        sidecar.set(keys.residency_report(POOL, other), b"{}")
        refusals["a sidecar writing another pod's report"] = "ACCEPTED"
    except NoPermissionError as exc:
        refusals["a sidecar writing another pod's report"] = type(exc).__name__
    table = chaos.routes()
    _report("hostile-forged-redis", {"refusals": refusals, "route_generation": table.generation if table else None})
    assert "ACCEPTED" not in refusals.values(), refusals
    assert table is not None and table.generation < 10**6 and set(table.models) == set(HOT)


def test_a_forged_or_deleted_key_is_repaired_within_one_resync(chaos: Chaos) -> None:
    """An operator (the admin user) overwrites the route table and deletes a pod's target: the controller puts its
    own back on its next pass (resync 0.5 s)."""
    admin = chaos.admin_redis()
    target_key = keys.target_state(POOL, chaos.stack.engines[0].pod)
    ours = chaos.routes()
    assert ours is not None
    forged = ours.model_copy(update={"generation": ours.generation + 100, "models": {}, "writer": "intruder"})
    report_key = keys.residency_report(POOL, chaos.stack.engines[1].pod)
    admin.set(keys.route_table(POOL), forged.to_json())
    admin.delete(target_key, report_key)
    deleted = time.monotonic()
    # the repair is level-triggered (the next pass); the seconds it took are reported, ``within`` only guards a hang
    routes_back = _wait(lambda: (t := chaos.routes()) is not None and set(t.models) == set(HOT), within=60)
    target_back = _wait(lambda: admin.get(target_key) is not None, within=60) + routes_back
    report_back = time.monotonic() - deleted + _wait(lambda: admin.get(report_key) is not None, within=60)
    repaired = chaos.routes()
    _report("repair-forged-and-deleted", {"routes_back_s": round(routes_back, 2), "target_back_s": round(target_back, 2),
                                          "report_back_s": round(report_back, 2),
                                          "resync_s": chaos.stack.options.heartbeat,
                                          "generation": repaired.generation if repaired else None})
    assert repaired is not None and repaired.generation > forged.generation
    assert TargetState.from_json(admin.get(target_key)).pod == chaos.stack.engines[0].pod  # type: ignore[arg-type]
    assert max(routes_back, target_back, report_back) <= chaos.stack.options.heartbeat + 1.5


# --- faults ---------------------------------------------------------------------------------------------------------

def _kill(process: ManagedProcess, sig: int = signal.SIGKILL) -> float:
    os.kill(process.pid, sig)
    return time.monotonic()


def _wait_restarted(world: Chaos, name: str, count: int, within: float = 30) -> float:
    return _wait(lambda: world.stack.restarts.get(name, 0) >= count and world.process(name).alive(), within)


def test_redis_sigkill_and_restart(chaos: Chaos) -> None:
    redis_name = next(n for n in chaos.stack.pids() if n.startswith("redis"))
    restarts = chaos.stack.restarts.get(redis_name, 0)
    with Traffic(chaos) as traffic:
        time.sleep(3)
        killed = _kill(chaos.process(redis_name))
        _wait_restarted(chaos, redis_name, restarts + 1)
        assert chaos.stack.redis is not None
        wait_for_port(chaos.stack.redis.port, timeout=10)
        up = time.monotonic()
        admin = chaos.admin_redis()
        target_keys = [keys.target_state(POOL, e.pod) for e in chaos.stack.engines]
        _wait(lambda: admin.get(keys.route_table(POOL)) is not None and all(admin.exists(k) for k in target_keys),
              within=60)  # a hang guard: the seconds are reported
        restored = time.monotonic()
        time.sleep(6)
    late = traffic.failed((restored, float("inf")))
    _report("redis-sigkill", traffic.figures(
        redis_down_s=round(up - killed, 2), routes_and_targets_back_after_up_s=round(restored - up, 2),
        resync_s=chaos.stack.options.heartbeat, failed_while_down=len(traffic.failed((killed, restored))),
        failed_after_restored=len(late)))
    assert restored - up <= chaos.stack.options.heartbeat + 1.5
    assert late == [], late[:3]
    assert traffic.figures()["wrong_revision"] == 0


def test_redis_paused_ten_seconds_routes_nothing_to_pods_without_the_adapter(chaos: Chaos) -> None:
    redis_process = chaos.process(next(n for n in chaos.stack.pids() if n.startswith("redis")))
    with Traffic(chaos) as traffic:
        time.sleep(2)
        _kill(redis_process, signal.SIGSTOP)
        try:
            time.sleep(10)
        finally:
            _kill(redis_process, signal.SIGCONT)
        time.sleep(4)
    without = _engine_404s(traffic)
    _report("redis-sigstop-10s", traffic.figures(routed_to_pods_without_the_adapter=len(without)))
    assert without == [], without[:3]
    assert traffic.failed() == [], traffic.failed()[:3]
    assert traffic.figures()["wrong_revision"] == 0


def test_picker_sigkill_is_restarted_and_envoy_fails_closed_meanwhile(chaos: Chaos) -> None:
    restarts = chaos.stack.restarts.get("picker", 0)
    with Traffic(chaos) as traffic:
        time.sleep(2)
        killed = _kill(chaos.process("picker"))
        restarted = killed + _wait_restarted(chaos, "picker", restarts + 1)
        time.sleep(6)
    served_again = min(r.sent_at for r in traffic.records if r.sent_at > killed and r.status == 200)
    during = traffic.failed((killed, served_again))
    after = traffic.failed((served_again, float("inf")))
    _report("picker-sigkill", traffic.figures(
        failure_mode=chaos.stack.options.failure_mode, restarted_after_s=round(restarted - killed, 2),
        served_again_after_s=round(served_again - killed, 2), failed_while_down=len(during),
        statuses_while_down=sorted({r.status for r in during}), failed_after=len(after)))
    # FailClose: Envoy's own 500 while the picker is down, its 503 not-ready until it has read Redis; never a 404
    assert {r.status for r in during} <= {500, 503}, {r.status for r in during}
    assert after == [], after[:3]
    assert traffic.figures()["wrong_revision"] == 0


def test_engine_sigkill_loses_no_request_another_pod_could_serve(chaos: Chaos) -> None:
    holders = chaos.holders()
    retries_before = _envoy_stat(chaos, "cluster.pool.upstream_rq_retry")
    with Traffic(chaos) as traffic:
        time.sleep(3)
        busiest = Counter(r.pod for r in traffic.records if r.pod is not None)
        victim = busiest.most_common(1)[0][0]  # the pod serving most of the traffic right now
        others_hold = {name: pods - {victim} for name, pods in holders.items()}
        restarts = chaos.stack.restarts.get(victim, 0)
        _kill(chaos.process(victim))
        _wait_restarted(chaos, victim, restarts + 1, within=60)
        time.sleep(6)
    retried = _envoy_stat(chaos, "cluster.pool.upstream_rq_retry") - retries_before
    servable = [r for r in traffic.failed() if others_hold.get(next(iter(chaos.named(r.model)), ""), set())]
    _report("engine-sigkill", traffic.figures(victim=victim, holders_before={k: sorted(v) for k, v in holders.items()},
                                              envoy_retries=retried, failed_another_pod_could_serve=len(servable),
                                              failures=[f"{r.status} {r.error[:60]}" for r in traffic.failed()][:5]))
    assert servable == [], servable[:3]
    assert traffic.figures()["wrong_revision"] == 0


def test_sidecar_sigkill_loses_no_request(chaos: Chaos) -> None:
    name = f"sidecar-{chaos.stack.engines[1].pod}"
    restarts = chaos.stack.restarts.get(name, 0)
    with Traffic(chaos) as traffic:
        time.sleep(2)
        _kill(chaos.process(name))
        _wait_restarted(chaos, name, restarts + 1)
        time.sleep(6)
    _report("sidecar-sigkill", traffic.figures(sidecar=name))
    assert traffic.failed() == [], traffic.failed()[:3]
    assert traffic.figures()["wrong_revision"] == 0


def _timeline(world: Chaos, name: str, stop: threading.Event, out: list[tuple[str, float, int]]) -> None:
    """Every (phase label, time, weight) the revision passes through (a watch would be exact; polling at 0.1 s
    is enough for pauses of 4 s); the time is the controller's own record, ``status.phaseSince``, in seconds after
    the first one seen."""
    started: float | None = None
    last = None
    assert world.stack.cluster is not None
    while not stop.is_set():
        try:
            obj = httpx.get(f"{world.stack.cluster.url}{GROUP_PATH}/{name}", timeout=5).json()
        except httpx.HTTPError:
            continue
        status = obj.get("status") or {}
        phase = status.get("phase") or "Pending"
        label = f"Canary({status.get('canaryStep', 0) + 1})" if phase == "Canary" else phase
        if label != last:
            since = status.get("phaseSince")
            at = datetime.fromisoformat(since.replace("Z", "+00:00")).timestamp() if since else None
            started = at if started is None else started
            offset = at - started if at is not None and started is not None else 0.0
            out.append((label, round(offset, 2), int(status.get("trafficWeight") or 0)))
            last = label
        if phase in ("Stable", "Failed", "RolledBack"):
            return
        time.sleep(0.1)


def test_controller_sigkill_mid_canary_skips_and_repeats_no_gate(chaos: Chaos) -> None:
    new = manifest(chaos.artifacts[served_name("claims", "v2")], chaos.stack.options.model, chaos.base_digest,
                   "gpu-preferred")
    name = new["metadata"]["name"]
    restarts = chaos.stack.restarts.get("controller", 0)
    timeline: list[tuple[str, float, int]] = []
    stop = threading.Event()
    follower = threading.Thread(target=_timeline, args=(chaos, name, stop, timeline), daemon=True)
    with Traffic(chaos) as traffic:
        chaos.apply([new], "v2")
        follower.start()
        _wait(lambda: any(label == "Canary(1)" for label, _, _ in timeline), within=120, step=0.1)
        time.sleep(1.0)
        killed_at_label = timeline[-1][0]
        _kill(chaos.process("controller"))
        _wait_restarted(chaos, "controller", restarts + 1)
        follower.join(180)
        stop.set()
        time.sleep(2)
    labels = [label for label, _, _ in timeline]
    pauses = {label: round(nxt - at, 2) for (label, at, _), (_, nxt, _) in itertools.pairwise(timeline)
              if label.startswith("Canary")}
    _report("controller-sigkill-mid-canary", traffic.figures(killed_in=killed_at_label, timeline=timeline,
                                                            canary_step_seconds=pauses))
    assert labels[-1] == "Stable", timeline
    assert [x for x in labels if x.startswith("Canary")] == ["Canary(1)", "Canary(2)"], timeline
    assert len(labels) == len(set(labels)), timeline  # no phase entered twice
    # each pause held, by the controller's own record (4 s in manifest()): the restart neither cut one short
    assert all(seconds >= 4 for seconds in pauses.values()), pauses
    assert traffic.failed() == [], traffic.failed()[:3]
    assert traffic.figures()["wrong_revision"] == 0
