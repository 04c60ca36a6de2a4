"""The bus as a fleet runs it: ``loraplane up --redis-sentinel`` (a primary, a replica and three sentinels, every
component connected through ``redis+sentinel://``), its primary SIGKILLed under a steady 20 requests/s through
Envoy.

One stack for the module (3 reference engines with sidecars, the picker, Envoy, the controller, the API server),
its supervisor restarting whatever dies. Each kill checks: the sentinels promote the replica; every component
follows (the controller's repair writes there, every sidecar's report, the picker's counters, and the picker's
endpoints fresh again by reports it read there); 0 failed requests (no pod dies, so every one was a request a pod
could serve) and 0 wrong-revision responses; and what the failover lost comes back: the route table
and a target state deleted on the primary just before the kill (and replicated, so the promoted replica lacks
them) are rewritten by the controller's level-triggered repair. The killed node, restarted at once, waits for the
failover and returns as a replica of the new primary, so a second kill fails over back to it. Each prints its
figures (``SENTINEL {...}`` lines) for docs/local-stack.md.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
import redis

from e2e.test_chaos import Chaos, Traffic
from loraplane.api import PickerCounters, ResidencyReport, keys, served_name
from loraplane.credentials import sync_redis
from loraplane.stack.demo import manifest, write_artifacts
from loraplane.stack.sentinel import SentinelRedis
from loraplane.stack.services import POOL, LocalStack, StackOptions

pytestmark = pytest.mark.slow

HOT = ("support", "claims")


class SentinelChaos(Chaos):
    """``Chaos`` whose Redis clients go through the sentinels (to whichever node is the primary now)."""

    def user_redis(self, user: str) -> redis.Redis:
        return sync_redis(self.stack.redis_url, environ=self.stack.secrets.redis_env(user), socket_timeout=2,
                          socket_connect_timeout=2)

    @property
    def group(self) -> SentinelRedis:
        assert self.stack.sentinel_redis is not None
        return self.stack.sentinel_redis

    def endpoint_states(self) -> dict[str, float]:
        picker = self.stack.pickers[0]
        port = picker.args[picker.args.index("--metrics-address") + 1].rpartition(":")[2]
        out = {}
        for line in httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text.splitlines():
            if line.startswith("loraplane_picker_endpoints{"):
                out[line.split('state="', 1)[1].split('"', 1)[0]] = float(line.rsplit(" ", 1)[1])
        return out


def _supervise(stack: LocalStack, stop: threading.Event, said: list[str]) -> None:
    while not stop.wait(0.2):
        stack.restart_dead(said.append)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SentinelChaos]:
    work = tmp_path_factory.mktemp("sentinel-stack")
    stack = LocalStack(StackOptions(workdir=work, engines=3, redis_sentinel=True))
    stop = threading.Event()
    said: list[str] = []
    try:
        stack.start()
        threading.Thread(target=_supervise, args=(stack, stop, said), daemon=True).start()
        artifacts = write_artifacts(stack.artifacts, [(a, "v1") for a in HOT], stack.options.model)
        engine = stack.engines[0]
        base = httpx.get(f"http://{engine.address}/admin/adapters", headers=stack.admin_headers(engine.pod)).json()
        chaos = SentinelChaos(stack, artifacts, base["base_model_digest"], said)
        first = [manifest(artifacts[served_name(a, "v1")], stack.options.model, chaos.base_digest, "gpu-preferred")
                 for a in HOT]
        chaos.apply(first, "v1")
        chaos.wait_stable([m["metadata"]["name"] for m in first], within=240)
        # every adapter servable somewhere and routed: no pod dies here, so any failed request is one a pod
        # could have served
        _wait(lambda: all(chaos.holders().get(served_name(a, "v1")) and chaos.named(a) for a in HOT), within=120)
        yield chaos
    finally:
        stop.set()
        stack.stop()


def _wait(predicate: Callable[[], bool], within: float, step: float = 0.05) -> float:
    """Seconds until ``predicate`` held (a hang guard: AssertionError after ``within``); errors count as not yet."""
    started = time.monotonic()
    while True:
        try:
            if predicate():
                return time.monotonic() - started
        except (redis.RedisError, OSError, httpx.HTTPError):
            pass
        assert time.monotonic() - started < within, f"not within {within} s"
        time.sleep(step)


def _report(name: str, figures: dict[str, Any]) -> None:
    print(f"SENTINEL {json.dumps({'test': name, **figures})}", flush=True)


def _kill_primary_losing_keys(world: SentinelChaos, lost: list[str]) -> tuple[tuple[str, int], float, float]:
    """Delete ``lost`` on the primary, wait until the replica has the deletion too, SIGKILL the primary; returns
    (the killed primary, the kill's monotonic and wall-clock times). The controller is paused (SIGSTOP) from just
    before the deletion to just after the kill, so its repair (every 0.5 s) cannot put the keys back on the
    primary first: what the promoted replica lacks is exactly what the failover lost."""
    primary = world.group.primary()
    assert primary is not None
    admin = world.admin_redis()
    controller = world.process("controller")
    os.kill(controller.pid, signal.SIGSTOP)
    try:
        assert admin.delete(*lost) == len(lost)
        assert admin.execute_command("WAIT", 1, 5000) >= 1  # replicated: the replica lacks them too
        wall, killed = time.time(), time.monotonic()
        os.kill(world.group.node(primary[1]).pid, signal.SIGKILL)
    finally:
        os.kill(controller.pid, signal.SIGCONT)
    admin.close()
    return primary, killed, wall


def _fail_over(world: SentinelChaos, name: str) -> None:
    stack = world.stack
    ttl = max(3.0, 6 * stack.options.heartbeat)  # the sidecars' --report-ttl
    lost = [keys.route_table(POOL), keys.target_state(POOL, stack.engines[1].pod)]
    at: dict[str, float] = {}  # seconds after the kill
    with Traffic(world) as traffic:
        time.sleep(3)
        old, killed, wall = _kill_primary_losing_keys(world, lost)

        def reached(what: str, predicate: Callable[[], bool], step: float = 0.05) -> None:
            _wait(predicate, within=90, step=step)
            at[what] = round(time.monotonic() - killed, 2)

        reached("failover", lambda: world.group.primary() not in (None, old), step=0.02)
        new = world.group.primary()
        assert new is not None
        admin = world.admin_redis()
        target_keys = [keys.target_state(POOL, e.pod) for e in stack.engines]
        # the controller follows: its repair writes what the failover lost to the new primary
        reached("lost_keys_back", lambda: admin.exists(keys.route_table(POOL), *target_keys) == 1 + len(target_keys),
                step=0.02)

        def reported_after_kill() -> bool:  # every sidecar follows: a report written after the kill
            raws = [admin.get(keys.residency_report(POOL, e.pod)) for e in stack.engines]
            return all(r is not None and ResidencyReport.from_json(r).heartbeat_at > wall for r in raws)

        reached("sidecars_reported", reported_after_kill)

        def picker_published() -> bool:  # the picker's writes follow
            raw = admin.get(keys.picker_counters(POOL, "picker-0"))
            return raw is not None and PickerCounters.from_json(raw).published_at > wall

        reached("picker_published", picker_published)
        # the picker's reads follow: past the reports' TTL since the kill, every pod is fresh only on reports it
        # read from the new primary (by its own receive time, a report read before the kill is stale by then)
        time.sleep(max(0.0, killed + ttl + 1.0 - time.monotonic()))
        reached("picker_fresh", lambda: world.endpoint_states().get("fresh") == len(stack.engines))
        # the killed node, restarted by the supervisor, comes back a replica of the new primary
        old_node = redis.Redis(port=old[1], username="admin", password=stack.secrets.redis_password("admin"),
                               socket_timeout=1)

        def rejoined() -> bool:
            role = old_node.role()
            return role[0] == b"slave" and role[2] == new[1] and role[3] == b"connected"

        reached("old_primary_replica_again", rejoined)
        time.sleep(4)
    figures = traffic.figures(**{f"{k}_after_kill_s": v for k, v in at.items()},
                              failed_after_kill=len(traffic.failed((killed, float("inf")))),
                              lost_keys=lost, old_primary=old[1], new_primary=new[1])
    _report(name, figures)
    failures = [f"{r.status} {r.error[:80]}" for r in traffic.failed()]
    assert failures == [], failures[:5]  # no pod died: any failure is one a pod could have served
    assert figures["wrong_revision"] == 0


def test_primary_sigkill_under_traffic_fails_over_losing_no_request(world: SentinelChaos) -> None:
    _fail_over(world, "primary-sigkill")


def test_a_second_failover_returns_to_the_restarted_node(world: SentinelChaos) -> None:
    """The node killed first is now a replica (restarted by the supervisor): killing the primary again promotes
    it, and every component follows again."""
    before = world.group.primary()
    _fail_over(world, "primary-sigkill-again")
    after = world.group.primary()
    assert before is not None and after is not None and after != before
