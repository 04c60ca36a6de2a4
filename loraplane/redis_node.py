"""A Redis data node of a Sentinel deployment (``loraplane.stack.sentinel``) that starts in the role the sentinels
give it: ``python -m loraplane.redis_node --config FILE --port N --service NAME --sentinels HOST:PORT,...
[--initial-primary HOST:PORT]``.

It asks the sentinels for the service's primary, then execs ``redis-server FILE --replicaof ...`` (the same PID,
so a supervisor sees one process). Named the primary itself -- it died and is being restarted before the
sentinels failed it over -- it waits for their failover (at most ``--failover-wait`` s) rather than come back an
empty primary whose replica would copy the empty data set. With no sentinel answering on its first start (a
``FILE.started`` marker says whether it ran before) it takes its initial role: a replica of ``--initial-primary``,
or the primary without one; on a restart it waits for an answer first.

Standard library and redis-py only: a restart should not wait for the rest of loraplane to import.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from loraplane.processes import LOOPBACK, redis_server_binary

#: the variable naming the file of the sentinels' own password (``loraplane.credentials``)
SENTINEL_PASSWORD_FILE_ENV = "LORAPLANE_REDIS_SENTINEL_PASSWORD_FILE"
#: how long a restarted node whose sentinels still name it the primary waits for their failover
FAILOVER_WAIT_S = 30.0


def _address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host.strip("[]"), int(port)


def sentinel_master(host: str, port: int, service: str, password: str | None,
                    timeout: float = 0.5) -> dict[str, str] | None:
    """One sentinel's ``SENTINEL MASTER <service>`` as a dict; None when it does not answer."""
    client = redis.Redis(host=host, port=port, password=password, socket_timeout=timeout,
                         socket_connect_timeout=timeout, decode_responses=True, retry=Retry(NoBackoff(), 0))
    try:
        state = client.execute_command("SENTINEL", "MASTER", service)
    except (redis.RedisError, OSError):
        return None
    finally:
        client.close()
    if isinstance(state, dict):
        return {str(k): str(v) for k, v in state.items()}
    return {str(k): str(v) for k, v in zip(state[::2], state[1::2], strict=True)}


def ask_sentinels(sentinels: Sequence[tuple[str, int]], service: str, password: str | None,
                  timeout: float = 0.5) -> tuple[str, int] | None:
    """The primary of ``service`` according to the reachable sentinels (the highest config-epoch wins)."""
    best: tuple[int, tuple[str, int]] | None = None
    for host, port in sentinels:
        fields = sentinel_master(host, port, service, password, timeout)
        if fields is None:
            continue
        epoch = int(fields.get("config-epoch", 0))
        if best is None or epoch > best[0]:
            best = (epoch, (fields["ip"], int(fields["port"])))
    return best[1] if best else None


def choose_primary(ask: Callable[[], tuple[str, int] | None], me: tuple[str, int],
                   initial: tuple[str, int] | None, restarted: bool, wait_s: float,
                   clock: Callable[[], float] = time.monotonic,
                   sleep: Callable[[float], None] = time.sleep,
                   say: Callable[[str], None] = print) -> tuple[str, int] | None:
    """The primary this node replicates (None or ``me``: it is the primary).

    ``ask`` returns what the sentinels name (None: no answer). Named itself, the node waits for their failover; not
    answered on a restart (``restarted``), it waits for an answer, since its initial role may be the primary's
    and it comes back empty. Either wait ends after ``wait_s``; then a node named itself is the primary, and one
    not answered takes its initial role (``initial``: replicate it; None: the primary).
    """
    deadline = clock() + wait_s
    primary = ask()
    if primary == me:
        say(f"the sentinels still name this node ({me[1]}) the primary: waiting for their failover")
    elif primary is None and restarted:
        say("no sentinel answers and this node ran before: waiting for one (its initial role may be stale)")
    while (primary == me or (primary is None and restarted)) and clock() < deadline:
        sleep(0.25)
        primary = ask() or primary
    if primary is None:
        return initial
    return primary


def main(argv: Sequence[str]) -> int:
    """``python -m loraplane.redis_node``: exec ``redis-server`` as a replica of the primary the sentinels
    name (after their failover when they name this node), or in its initial role when no sentinel answers."""
    p = argparse.ArgumentParser(prog="python -m loraplane.redis_node")
    p.add_argument("--config", required=True, type=Path)
    p.add_argument("--port", required=True, type=int)
    p.add_argument("--service", required=True)
    p.add_argument("--sentinels", required=True, help="host:port,host:port,...")
    p.add_argument("--initial-primary", help="host:port this node replicates when no sentinel answers (none: it "
                   "starts as the primary)")
    p.add_argument("--failover-wait", type=float, default=FAILOVER_WAIT_S)
    args = p.parse_args(list(argv))
    sentinels = [_address(a) for a in args.sentinels.split(",") if a]
    password_file = os.environ.get(SENTINEL_PASSWORD_FILE_ENV)
    password = (Path(password_file).read_text().strip() or None) if password_file else None
    me = (LOOPBACK, args.port)
    marker = args.config.with_name(args.config.name + ".started")
    restarted = marker.exists()
    marker.touch()
    primary = choose_primary(lambda: ask_sentinels(sentinels, args.service, password), me,
                             _address(args.initial_primary) if args.initial_primary else None, restarted,
                             args.failover_wait, say=lambda m: print(m, flush=True))
    replicaof = ["no", "one"] if primary is None or primary == me else [primary[0], str(primary[1])]
    print(f"starting redis-server on {args.port} with replicaof {' '.join(replicaof)}", flush=True)
    binary = redis_server_binary()
    os.umask(0o077)  # the config file Sentinel has it rewrite holds a password: keep it private
    os.execv(binary, [binary, str(args.config), "--replicaof", *replicaof])
    return 1  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
