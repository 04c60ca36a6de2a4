"""Redis with Sentinel: the ``redis+sentinel://`` URL every component is given, and the local stack's primary,
replica and three sentinels (real ``redis-server`` / ``redis-sentinel`` processes) failing over under a client."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from redis.exceptions import AuthenticationError, NoPermissionError, ResponseError
from redis.sentinel import MasterNotFoundError

from loraplane.api import keys
from loraplane.credentials import (
    REDIS_SENTINEL_PASSWORD_ENV,
    REDIS_SENTINEL_USERNAME_ENV,
    SentinelRedis,
    SentinelUrl,
    async_redis,
    parse_sentinel_url,
    sync_redis,
)
from loraplane.redis_node import choose_primary
from loraplane.sidecar.bus import RedisBus
from loraplane.stack.secrets import StackSecrets, sidecar_user
from loraplane.stack.sentinel import SentinelRedis as SentinelGroup
from loraplane.stack.sentinel import start_sentinel_redis

POOL = "local"


@pytest.mark.parametrize(("url", "parsed"), [
    ("redis+sentinel://a:26380,b,[::1]:26381/mymaster/3",
     SentinelUrl((("a", 26380), ("b", 26379), ("::1", 26381)), "mymaster", 3)),
    ("rediss+sentinel://s.data.svc/loraplane", SentinelUrl((("s.data.svc", 26379),), "loraplane", 0, tls=True)),
    ("redis://127.0.0.1:6379/0", None),
    ("rediss://redis:6380", None),
])
def test_sentinel_urls_parse(url: str, parsed: SentinelUrl | None) -> None:
    assert parse_sentinel_url(url) == parsed
    if parsed is not None:
        assert parse_sentinel_url(str(parsed)) == parsed


@pytest.mark.parametrize("url", [
    "redis+sentinel://user:pw@a:26379/m/0",  # credentials come from the environment
    "redis+sentinel:///m/0",  # no sentinel
    "redis+sentinel://a:26379",  # no service
    "redis+sentinel://a:26379/m/x",  # db not a number
    "redis+sentinel://a:26379/m/0/extra",
    "redis+sentinel://a:26379/m/0?ssl=true",
    "redis+sentinel://a:notaport/m",
    "redis+sentinel://a:26379/bad name",
])
def test_malformed_sentinel_urls_are_refused(url: str) -> None:
    with pytest.raises(ValueError):
        parse_sentinel_url(url)


async def test_a_sentinel_url_gives_a_client_of_the_primary_with_both_credentials() -> None:
    env = {"LORAPLANE_REDIS_USERNAME": "controller", "LORAPLANE_REDIS_PASSWORD": "node-secret",
           REDIS_SENTINEL_USERNAME_ENV: "watcher", REDIS_SENTINEL_PASSWORD_ENV: "sentinel-secret"}
    client = async_redis("redis+sentinel://127.0.0.1:1,127.0.0.1:2/mymaster/4", environ=env, socket_timeout=0.5)
    try:
        assert isinstance(client, SentinelRedis)
        pool = client.connection_pool
        assert pool.service_name == "mymaster"  # type: ignore[attr-defined]
        nodes = pool.connection_kwargs
        assert (nodes["username"], nodes["password"], nodes["db"]) == ("controller", "node-secret", 4)
        assert client.sentinel_manager is not None
        sentinels = [s.connection_pool.connection_kwargs for s in client.sentinel_manager.sentinels]
        assert [(s["host"], s["port"]) for s in sentinels] == [("127.0.0.1", 1), ("127.0.0.1", 2)]
        assert all((s["username"], s["password"], s["socket_timeout"]) == ("watcher", "sentinel-secret", 0.5)
                   for s in sentinels)
    finally:
        await client.aclose()
    plain = sync_redis("redis://127.0.0.1:1/0", environ=env)
    assert plain.connection_pool.connection_kwargs["password"] == "node-secret"


ME, OTHER = ("127.0.0.1", 7001), ("127.0.0.1", 7002)


@pytest.mark.parametrize(("answers", "restarted", "chosen"), [
    ([None], False, OTHER),  # the deployment's first start: the initial role (a replica of OTHER)
    ([OTHER], False, OTHER),
    ([ME, ME, ME, OTHER], True, OTHER),  # restarted before the failover: waits for it, then replicates
    ([None, None, OTHER], True, OTHER),  # restarted, no sentinel answering yet: waits for one
    ([ME] * 100, True, ME),  # never failed over: the primary again once the wait is over
])
def test_a_data_node_takes_the_role_the_sentinels_give_it(answers: list[tuple[str, int] | None], restarted: bool,
                                                          chosen: tuple[str, int]) -> None:
    replies = iter(answers)
    now = [0.0]

    def sleep(s: float) -> None:
        now[0] += s

    said: list[str] = []
    got = choose_primary(lambda: next(replies, answers[-1]), ME, OTHER, restarted, wait_s=10.0,
                         clock=lambda: now[0], sleep=sleep, say=said.append)
    assert got == chosen
    assert bool(said) == (answers[0] == ME or (answers[0] is None and restarted))


# --- the local stack's Sentinel deployment, for real ----------------------------------------------------------------

@pytest.fixture(scope="module")
def group(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[SentinelGroup, StackSecrets]]:
    work = tmp_path_factory.mktemp("sentinel")
    secrets = StackSecrets(work / "secrets")
    secrets.create(POOL, ["engine-0"], sentinel=True)
    started = start_sentinel_redis(work / "logs", secrets)
    try:
        yield started, secrets
    finally:
        started.stop()


def _wait(predicate: Callable[[], bool], within: float = 60.0) -> None:
    """Poll ``predicate`` (a hang guard, not a timing check)."""
    deadline = time.monotonic() + within
    while not predicate():
        assert time.monotonic() < deadline, f"not within {within} s"
        time.sleep(0.05)


@pytest.mark.slow
def test_sentinel_users_and_the_sentinels_themselves_need_their_passwords(
        group: tuple[SentinelGroup, StackSecrets]) -> None:
    started, secrets = group
    primary = started.primary()
    assert primary is not None and primary[1] == started.node_ports[0]
    for user in ("replication", "sentinel"):  # infrastructure users touch no key of the pool
        client = redis.Redis(port=primary[1], username=user, password=secrets.redis_password(user))
        with pytest.raises(NoPermissionError):
            client.get(keys.route_table(POOL))
        with pytest.raises(NoPermissionError):
            client.set(keys.route_table(POOL), b"forged")
    sentinel_port = started.sentinel_ports[0]
    with pytest.raises((AuthenticationError, ResponseError)):
        redis.Redis(port=sentinel_port).execute_command("SENTINEL", "MASTERS")
    # a client with the wrong sentinel password finds no primary: every sentinel refused it
    with pytest.raises(MasterNotFoundError, match="AuthenticationError"):
        sync_redis(started.url, environ={**secrets.redis_env("admin"), REDIS_SENTINEL_PASSWORD_ENV: "guess"},
                   socket_timeout=2).get(keys.route_table(POOL))
    assert sync_redis(started.url, environ=secrets.redis_env("admin"), socket_timeout=2).ping()


@pytest.mark.slow
async def test_clients_follow_a_failover_and_the_old_primary_returns_as_a_replica(
        group: tuple[SentinelGroup, StackSecrets], monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGKILL the primary under a writer and a sidecar's target subscription: the sentinels promote the replica,
    the same client objects write to it and the subscription comes back on it; the old primary, restarted at once
    (before the failover), waits for it and comes back a replica holding the data, not an empty primary."""
    started, secrets = group
    admin = async_redis(started.url, environ=secrets.redis_env("admin"), socket_timeout=1, socket_connect_timeout=1)
    for name, value in secrets.redis_env(sidecar_user("engine-0")).items():  # the sidecar's own ACL user
        monkeypatch.setenv(name, value)
    bus = RedisBus(started.url, POOL, "engine-0")
    notices: list[float] = []
    stop = asyncio.Event()
    watcher = asyncio.create_task(bus.watch_targets(lambda: notices.append(time.monotonic()), stop))
    try:
        await admin.set(keys.route_table(POOL), b"before")
        before = started.primary()
        assert before is not None
        victim = started.node(before[1])
        await asyncio.to_thread(_wait, lambda: len(notices) >= 1)  # subscribed
        await admin.execute_command("WAIT", 1, 5000)  # the replica has the table
        assert victim.proc is not None
        victim.proc.send_signal(signal.SIGKILL)
        victim.proc.wait()
        victim.start()  # what the stack's supervisor does: at once, while the sentinels still name it
        killed = time.monotonic()
        written = None
        for n in range(2000):  # a writer retrying as the components' loops do
            try:
                await admin.set(keys.residency_index(POOL), n)
                written = n
                break
            except (redis.RedisError, OSError):
                await asyncio.sleep(0.05)
        assert written is not None
        after = started.primary()
        assert after is not None and after != before and after[1] in started.node_ports
        assert await admin.get(keys.route_table(POOL)) == b"before"  # replicated before the kill
        # the subscription is back on the new primary: a notice published there reaches the sidecar
        seen = len(notices)

        async def notice_arrives() -> bool:
            await admin.publish(keys.target_changed_channel(POOL), "engine-0")
            await asyncio.sleep(0.2)
            return len(notices) > seen

        for _ in range(300):
            if await notice_arrives():
                break
        assert len(notices) > seen and notices[-1] > killed
        # the restarted old primary is a replica of the new one, with the data
        old = redis.Redis(port=before[1], username="admin", password=secrets.redis_password("admin"),
                          socket_timeout=1)

        def replica_with_data() -> bool:
            try:
                role = old.role()
                return role[0] == b"slave" and role[2] == after[1] and role[3] == b"connected" and \
                    old.get(keys.route_table(POOL)) == b"before"
            except (redis.RedisError, OSError):
                return False

        await asyncio.to_thread(_wait, replica_with_data)
        log = await asyncio.to_thread(Path(victim.log_path).read_text)
        assert f"replicaof 127.0.0.1 {after[1]}" in log
    finally:
        stop.set()
        await watcher
        await bus.close()
        await admin.aclose()
