"""The bundled Redis as the chart renders it, run for real: its container script writes the ACL file from the
Secret's passwords and starts redis-server with it; then each component user may write only its own keys."""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from redis.exceptions import AuthenticationError, NoPermissionError, ResponseError

from e2e.fixtures.processes import ManagedProcess, free_port, wait_for_port
from loraplane.api import keys
from tests.charts.conftest import RenderFn, name_of

POOL = "lp-loraplane"


@pytest.fixture
def chart_redis(render: RenderFn, tmp_path: Path) -> Iterator[tuple[int, dict[str, str]]]:
    port = free_port()
    rendered = render({"redis": {"port": port}})
    acl = rendered.get("ConfigMap", f"{name_of('redis')}-acl")["data"]["users.acl.in"]
    secret = {k: base64.b64decode(v).decode() for k, v in rendered.get("Secret", name_of("redis"))["data"].items()}
    container = rendered.get("StatefulSet", name_of("redis"))["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["sh", "-c"]
    (tmp_path / "etc").mkdir()
    (tmp_path / "data").mkdir()
    (tmp_path / "etc" / "users.acl.in").write_text(acl)
    script = (container["args"][0].replace("/etc/redis-acl", str(tmp_path / "etc")).replace("/data", str(tmp_path / "data"))
              .replace("exec redis-server", "exec redis-server --bind 127.0.0.1"))
    env = {"LORAPLANE_REDIS_PASSWORD": secret["redis-password"],
           **{f"REDIS_PASSWORD_{user.upper()}": secret[user] for user in ("controller", "picker", "sidecar")}}
    process = ManagedProcess(["sh", "-c", script], tmp_path / "redis.log", env=env).start()
    try:
        wait_for_port(port, proc=process.proc, timeout=20)
        yield port, {"admin": secret["redis-password"], **{u: secret[u] for u in ("controller", "picker", "sidecar")}}
    finally:
        process.stop()
    stored = (tmp_path / "data" / "users.acl").read_text()
    assert all(password not in stored for password in secret.values())  # hashes only
    assert hashlib.sha256(secret["controller"].encode()).hexdigest() in stored


def test_the_charts_redis_refuses_clients_without_a_password(chart_redis: tuple[int, dict[str, str]]) -> None:
    port, _ = chart_redis
    with pytest.raises((AuthenticationError, ResponseError)):
        redis.Redis(port=port).set(keys.route_table(POOL), b"forged")


def test_each_chart_user_writes_only_its_own_keys(chart_redis: tuple[int, dict[str, str]]) -> None:
    port, passwords = chart_redis

    def as_user(user: str) -> redis.Redis:
        return redis.Redis(port=port, username=user, password=passwords[user])

    controller, picker, sidecar, admin = (as_user(u) for u in ("controller", "picker", "sidecar", "admin"))
    for client, key in [(controller, keys.route_table(POOL)), (controller, keys.target_state(POOL, "pod-0")),
                        (picker, keys.request_rates(POOL, "picker-abc")), (picker, keys.picker_counters(POOL, "picker-abc")),
                        (sidecar, keys.residency_report(POOL, "pod-0")), (admin, "anything")]:
        assert client.set(key, b"{}")
    for client, key in [(controller, keys.residency_report(POOL, "pod-0")), (picker, keys.route_table(POOL)),
                        (picker, keys.target_state(POOL, "pod-0")), (sidecar, keys.route_table(POOL)),
                        (sidecar, keys.target_state(POOL, "pod-0")), (controller, keys.route_table("other"))]:
        with pytest.raises(NoPermissionError):
            client.set(key, b"forged")
    with sidecar.pipeline(transaction=True) as pipe:  # the sidecar's report transaction
        pipe.set(keys.residency_report(POOL, "pod-1"), b"{}", px=3000)
        pipe.sadd(keys.residency_index(POOL), "pod-1")
        pipe.publish(keys.residency_changed_channel(POOL), "pod-1")
        assert pipe.execute()[:2] == [True, 1]
    notices = picker.pubsub()
    notices.subscribe(keys.kv_blocks_changed_channel(POOL))
    assert notices.get_message(timeout=5)["type"] == "subscribe"
    with sidecar.pipeline(transaction=True) as pipe:  # the sidecar's KvBlockSet (RedisBus.publish_blocks)
        pipe.set(keys.kv_blocks(POOL, "pod-1"), b"{}", px=3000)
        pipe.publish(keys.kv_blocks_changed_channel(POOL), "pod-1")
        assert pipe.execute() == [True, 1]
    assert notices.get_message(timeout=5)["data"] == b"pod-1"
    notices.close()
    assert sidecar.get(keys.target_state(POOL, "pod-0")) == b"{}"
    assert picker.get(keys.route_table(POOL)) == b"{}"
