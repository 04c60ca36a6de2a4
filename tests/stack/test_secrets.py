"""The local stack's Redis ACL against a real redis-server: no password, no command; each component only its keys."""

from __future__ import annotations

import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from redis.exceptions import AuthenticationError, NoPermissionError, ResponseError

from loraplane.api import keys
from loraplane.credentials import REDIS_PASSWORD_FILE_ENV, REDIS_USERNAME_ENV, redis_options
from loraplane.processes import RedisServer, start_redis
from loraplane.stack.secrets import StackSecrets, sidecar_user

POOL = "local"
PODS = ["engine-0", "engine-1"]


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RedisServer, StackSecrets]]:
    work = tmp_path_factory.mktemp("acl")
    secrets = StackSecrets(work / "secrets")
    secrets.create(POOL, PODS)
    server = start_redis(work, acl_file=secrets.acl_file())
    try:
        yield server, secrets
    finally:
        server.stop()


def _as(secured: tuple[RedisServer, StackSecrets], user: str) -> redis.Redis:
    server, secrets = secured
    return redis.Redis.from_url(server.url, **redis_options(secrets.redis_env(user)))


def test_secrets_are_private_files_and_the_acl_file_holds_no_password(
        secured: tuple[RedisServer, StackSecrets]) -> None:
    _, secrets = secured
    acl = secrets.acl_file().read_text()
    for user in ("controller", "picker", "observer", "admin", *map(sidecar_user, PODS)):
        path = secrets.password_file(user)
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert path.read_text() not in acl
    assert stat.S_IMODE(secrets.token_file(PODS[0]).stat().st_mode) == 0o600


@pytest.mark.parametrize("password", [None, "wrong"])
def test_without_the_password_nothing_can_be_read_or_forged(secured: tuple[RedisServer, StackSecrets],
                                                             password: str | None) -> None:
    server, _ = secured
    for user in (None, "controller"):
        client = redis.Redis.from_url(server.url, username=user if password else None, password=password)
        with pytest.raises((AuthenticationError, ResponseError)):
            client.set(keys.route_table(POOL), b'{"forged": true}')
        with pytest.raises((AuthenticationError, ResponseError)):
            client.get(keys.route_table(POOL))
    assert _as(secured, "admin").get(keys.route_table(POOL)) is None


def test_each_component_writes_only_its_own_keys(secured: tuple[RedisServer, StackSecrets]) -> None:
    controller, picker, observer = (_as(secured, u) for u in ("controller", "picker", "observer"))
    sidecar = _as(secured, sidecar_user(PODS[0]))
    allowed = [
        (controller, keys.route_table(POOL)), (controller, keys.target_state(POOL, PODS[1])),
        (controller, keys.revision_status(POOL, "default", "claims-v2")),
        (picker, keys.request_rates(POOL, "picker-0")), (picker, keys.picker_counters(POOL, "picker-0")),
        (sidecar, keys.residency_report(POOL, PODS[0])),
    ]
    refused = [
        (controller, keys.residency_report(POOL, PODS[0])), (controller, keys.request_rates(POOL, "picker-0")),
        (picker, keys.route_table(POOL)), (picker, keys.target_state(POOL, PODS[0])),
        (picker, keys.residency_report(POOL, PODS[0])), (picker, keys.revision_status(POOL, "default", "claims-v2")),
        (sidecar, keys.route_table(POOL)), (sidecar, keys.revision_status(POOL, "default", "claims-v2")), (sidecar, keys.target_state(POOL, PODS[0])),
        (sidecar, keys.residency_report(POOL, PODS[1])), (sidecar, keys.request_rates(POOL, "picker-0")),
        (observer, keys.route_table(POOL)),
        (controller, keys.route_table("other-pool")),
    ]
    for client, key in allowed:
        assert client.set(key, b"{}", ex=30)
    for client, key in refused:
        with pytest.raises(NoPermissionError):
            client.set(key, b"forged")
    with pytest.raises(NoPermissionError):
        sidecar.get(keys.target_state(POOL, PODS[1]))  # another pod's instructions are not its business
    with pytest.raises(NoPermissionError):
        picker.publish(keys.target_changed_channel(POOL), PODS[0])
    with pytest.raises(NoPermissionError):
        sidecar.publish(keys.routes_changed_channel(POOL), "99")
    with pytest.raises(NoPermissionError):
        controller.flushall()
    assert observer.get(keys.route_table(POOL)) == b"{}"


def test_the_sidecars_report_transaction_runs_under_its_acl(secured: tuple[RedisServer, StackSecrets]) -> None:
    sidecar = _as(secured, sidecar_user(PODS[1]))
    with sidecar.pipeline(transaction=True) as pipe:
        pipe.set(keys.residency_report(POOL, PODS[1]), b"{}", px=3000)
        pipe.sadd(keys.residency_index(POOL), PODS[1])
        pipe.publish(keys.residency_changed_channel(POOL), PODS[1])
        assert pipe.execute()[:2] == [True, 1]


def test_the_sidecars_block_set_is_written_under_its_acl_and_the_picker_follows_it(
        secured: tuple[RedisServer, StackSecrets]) -> None:
    sidecar, picker = _as(secured, sidecar_user(PODS[1])), _as(secured, "picker")
    notices = picker.pubsub()
    notices.subscribe(keys.kv_blocks_changed_channel(POOL))
    assert notices.get_message(timeout=5)["type"] == "subscribe"
    with sidecar.pipeline(transaction=True) as pipe:  # what RedisBus.publish_blocks sends
        pipe.set(keys.kv_blocks(POOL, PODS[1]), b"{}", px=3000)
        pipe.publish(keys.kv_blocks_changed_channel(POOL), PODS[1])
        assert pipe.execute() == [True, 1]
    assert notices.get_message(timeout=5)["data"] == PODS[1].encode()
    assert picker.mget([keys.kv_blocks(POOL, PODS[1])]) == [b"{}"]
    with pytest.raises(NoPermissionError):
        sidecar.set(keys.kv_blocks(POOL, PODS[0]), b"forged")  # another pod's blocks
    with pytest.raises(NoPermissionError):
        picker.set(keys.kv_blocks(POOL, PODS[1]), b"forged")
    notices.close()


def test_credentials_come_from_the_environment_or_a_file(tmp_path: Path) -> None:
    secret = tmp_path / "pw"
    secret.write_text("from-file\n")
    assert redis_options({REDIS_USERNAME_ENV: "u", REDIS_PASSWORD_FILE_ENV: str(secret)}) == {
        "username": "u", "password": "from-file"}
    assert redis_options({"LORAPLANE_REDIS_PASSWORD": "env", REDIS_PASSWORD_FILE_ENV: str(secret)}) == {
        "password": "env"}
    assert redis_options({}) == {}
