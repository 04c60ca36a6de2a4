"""Redis as a fleet runs it, on one machine: a primary, a replica and three sentinels (``loraplane up
--redis-sentinel``), every one a supervised child like the rest of the stack.

- Data nodes: ``redis-server`` with a config file of their own (port, the ACL file, the replication user's
  password: no secret on a command line), no persistence. Each is started through ``python -m
  loraplane.redis_node`` (stdlib and redis-py only, so a restart is quick), which asks the sentinels for the
  service's primary and then *execs* ``redis-server`` (same PID) as a replica of it. A node whose sentinels still
  name it the primary -- it died and was restarted before they failed it over -- waits for the failover first:
  started at once it would come back an empty primary, and the replica would copy the empty data set (Redis's
  replication guide warns of exactly this for primaries without persistence that restart on their own). With no
  sentinel reachable (the stack's first start) a node takes its initial role.
- Sentinels: Debian's ``redis-sentinel`` (``redis-server --sentinel`` where it is not installed), quorum 2 of 3,
  the primary down after ``DOWN_AFTER_MS``; they log in to the data nodes as the ``sentinel`` ACL user and require
  their own password (``StackSecrets.sentinel_password_file``) from clients and from each other.

Every component gets ``redis+sentinel://<sentinels>/loraplane/0`` (``loraplane.credentials``) and follows a
failover on its own.
"""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from loraplane.credentials import REDIS_SENTINEL_PASSWORD_FILE_ENV, secret
from loraplane.processes import LOOPBACK, ManagedProcess, free_port, redis_server_binary, wait_for_port
from loraplane.redis_node import ask_sentinels, sentinel_master
from loraplane.stack.secrets import StackSecrets, write_private

#: the Sentinel service name of the local stack's Redis
SERVICE = "loraplane"
#: a sentinel calls the primary down after this long without a valid reply (Redis's default is 30 s; the local
#: stack is on loopback, and its tests wait for the failover)
DOWN_AFTER_MS = 1000
#: sentinels that must agree the primary is down before one of them fails it over
QUORUM = 2
#: Sentinel's failover-timeout: how long a failover may take before another is tried
FAILOVER_TIMEOUT_MS = 10_000


def sentinel_command() -> list[str]:
    """Debian's ``redis-sentinel`` binary, or ``redis-server --sentinel`` (the same program in Sentinel mode)."""
    found = shutil.which("redis-sentinel")
    return [found] if found else [redis_server_binary(), "--sentinel"]


@dataclass
class SentinelRedis:
    """The data nodes (the primary first, as started) and the sentinels that watch them."""

    service: str
    node_ports: list[int]
    nodes: list[ManagedProcess]
    sentinel_ports: list[int]
    sentinels: list[ManagedProcess]
    secrets: StackSecrets
    db: int = 0
    #: node port -> the config file it starts from
    configs: dict[int, Path] = field(default_factory=dict)

    @property
    def url(self) -> str:
        """``redis+sentinel://127.0.0.1:<s1>,...,127.0.0.1:<s3>/loraplane/0``: what every component is given."""
        hosts = ",".join(f"{LOOPBACK}:{p}" for p in self.sentinel_ports)
        return f"redis+sentinel://{hosts}/{self.service}/{self.db}"

    def processes(self) -> list[ManagedProcess]:
        """The data nodes, then the sentinels."""
        return [*self.nodes, *self.sentinels]

    def node(self, port: int) -> ManagedProcess:
        """The data node listening on ``port``."""
        return self.nodes[self.node_ports.index(port)]

    def primary(self) -> tuple[str, int] | None:
        """The primary the sentinels name now (the answer of the highest configuration epoch); None when none
        answers."""
        return ask_sentinels([(LOOPBACK, p) for p in self.sentinel_ports], self.service,
                             secret(None, self.secrets.sentinel_password_file()))

    def stop(self) -> None:
        """Stop every process (sentinels first, so they fail nothing over while the nodes go)."""
        for process in [*self.sentinels, *self.nodes]:
            process.stop()


def _node_config(secrets: StackSecrets, workdir: Path, port: int) -> Path:
    """A data node's config file (it holds the replication user's password, so it lives with the secrets)."""
    path = secrets.directory / f"redis-node-{port}.conf"
    path.with_name(path.name + ".started").unlink(missing_ok=True)  # a new node (``loraplane.redis_node``)
    write_private(path, "\n".join([
        f"port {port}", f"bind {LOOPBACK}", 'save ""', "appendonly no", "daemonize no", f"dir {workdir}",
        f"aclfile {secrets.acl_file()}", "masteruser replication",
        f"masterauth {secrets.password_file('replication').read_text().strip()}",
        "repl-diskless-sync-delay 0",
    ]) + "\n")
    return path


def _sentinel_config(secrets: StackSecrets, workdir: Path, port: int, service: str, primary_port: int) -> Path:
    """A sentinel's config file (Sentinel rewrites it with what it learns: the current primary, its peers)."""
    path = secrets.directory / f"sentinel-{port}.conf"
    own = secrets.sentinel_password_file().read_text().strip()
    write_private(path, "\n".join([
        f"port {port}", f"bind {LOOPBACK}", "daemonize no", f"dir {workdir}",
        f"requirepass {own}", f"sentinel sentinel-pass {own}",
        f"sentinel monitor {service} {LOOPBACK} {primary_port} {QUORUM}",
        f"sentinel down-after-milliseconds {service} {DOWN_AFTER_MS}",
        f"sentinel failover-timeout {service} {FAILOVER_TIMEOUT_MS}",
        f"sentinel parallel-syncs {service} 1",
        f"sentinel auth-user {service} sentinel",
        f"sentinel auth-pass {service} {secrets.password_file('sentinel').read_text().strip()}",
    ]) + "\n")
    return path


def start_sentinel_redis(workdir: Path, secrets: StackSecrets, replicas: int = 1, sentinels: int = 3,
                         service: str = SERVICE, timeout: float = 60.0) -> SentinelRedis:
    """Start a primary, ``replicas`` replicas and ``sentinels`` sentinels on free loopback ports; return once the
    replicas are in sync and every sentinel knows them and its peers (a failover can happen from then on).

    ``secrets`` must have been created with ``sentinel=True``. Logs: ``<workdir>/redis-<port>.log`` and
    ``<workdir>/sentinel-<port>.log``.
    """
    node_ports = [free_port() for _ in range(1 + replicas)]
    sentinel_ports = [free_port() for _ in range(sentinels)]
    env = {REDIS_SENTINEL_PASSWORD_FILE_ENV: str(secrets.sentinel_password_file())}
    group = SentinelRedis(service, node_ports, [], sentinel_ports, [], secrets)
    try:
        for i, port in enumerate(node_ports):
            config = group.configs[port] = _node_config(secrets, workdir, port)
            args = [sys.executable, "-m", "loraplane.redis_node", "--config", str(config),
                    "--port", str(port), "--service", service,
                    "--sentinels", ",".join(f"{LOOPBACK}:{p}" for p in sentinel_ports)]
            if i > 0:
                args += ["--initial-primary", f"{LOOPBACK}:{node_ports[0]}"]
            group.nodes.append(ManagedProcess(args, workdir / f"redis-{port}.log", env=env).start())
            wait_for_port(port, proc=group.nodes[-1].proc, timeout=timeout)
        admin = secret(None, secrets.password_file("admin"))
        _wait_until(lambda: _replicas_in_sync(node_ports[0], admin) >= replicas, timeout, "the replicas to sync")
        for port in sentinel_ports:
            config = _sentinel_config(secrets, workdir, port, service, node_ports[0])
            # umask 077: a sentinel rewrites its config file (passwords in it) with the mode the umask gives
            args = ["sh", "-c", 'umask 077 && exec "$0" "$@"', *sentinel_command(), str(config)]
            group.sentinels.append(ManagedProcess(args, workdir / f"sentinel-{port}.log", env=env).start())
            wait_for_port(port, proc=group.sentinels[-1].proc, timeout=timeout)
        own = secret(None, secrets.sentinel_password_file())
        _wait_until(lambda: all(_sentinel_ready(p, service, own, replicas, sentinels - 1) for p in sentinel_ports),
                    timeout, "every sentinel to know the replicas and its peers")
    except BaseException:
        group.stop()
        raise
    return group


def _wait_until(ready: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            raise TimeoutError(f"Redis Sentinel: waited {timeout} s for {what}")
        time.sleep(0.1)


def _replicas_in_sync(primary_port: int, admin_password: str | None) -> int:
    client = redis.Redis(port=primary_port, username="admin", password=admin_password, socket_timeout=2,
                         retry=Retry(NoBackoff(), 0))
    try:
        info = client.info("replication")
    except (redis.RedisError, OSError):
        return 0
    finally:
        client.close()
    return sum(1 for k, v in info.items() if k.startswith("slave") and isinstance(v, dict) and v.get("state") == "online")


def _sentinel_ready(port: int, service: str, password: str | None, replicas: int, peers: int) -> bool:
    state = sentinel_master(LOOPBACK, port, service, password, timeout=2)
    return state is not None and int(state.get("num-slaves", 0)) >= replicas and \
        int(state.get("num-other-sentinels", 0)) >= peers
