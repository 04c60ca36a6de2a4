"""Secrets every process reads the same way: from the environment or a file, never from the command line; and the
one way every component connects to Redis (``async_redis`` / ``sync_redis``).

The Redis connection of every component (controller, picker, sidecar, tools) takes its ACL user and password from
``LORAPLANE_REDIS_USERNAME`` and ``LORAPLANE_REDIS_PASSWORD`` or ``LORAPLANE_REDIS_PASSWORD_FILE`` (a file wins
over nothing, the variable over the file), and for ``rediss://`` URLs a CA bundle from ``LORAPLANE_REDIS_CA_FILE``.

A Sentinel-managed Redis is one URL too: ``redis+sentinel://host[:port][,host[:port]...]/<service>[/<db>]``
(``rediss+sentinel://`` for TLS to the sentinels and the data nodes; a sentinel's port defaults to 26379). The
client asks the sentinels for the service's primary on every new connection, so after a failover it reconnects to
the new primary: a command on a connection to the old one fails (connection refused or reset, or ``READONLY`` from
a demoted one, which redis-py turns into a ``ConnectionError``) and the component's own loop retries it, a pub/sub
loop subscribing again on the new primary. The sentinels' own credentials, when they require them, come from
``LORAPLANE_REDIS_SENTINEL_USERNAME`` and ``LORAPLANE_REDIS_SENTINEL_PASSWORD`` or
``LORAPLANE_REDIS_SENTINEL_PASSWORD_FILE``; the data nodes' from the variables above.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import redis
import redis.asyncio as aioredis
import redis.asyncio.sentinel as aiosentinel
import redis.sentinel

from loraplane.api.validation import split_host_port

REDIS_USERNAME_ENV = "LORAPLANE_REDIS_USERNAME"
REDIS_PASSWORD_ENV = "LORAPLANE_REDIS_PASSWORD"
REDIS_PASSWORD_FILE_ENV = "LORAPLANE_REDIS_PASSWORD_FILE"
REDIS_CA_FILE_ENV = "LORAPLANE_REDIS_CA_FILE"
REDIS_SENTINEL_USERNAME_ENV = "LORAPLANE_REDIS_SENTINEL_USERNAME"
REDIS_SENTINEL_PASSWORD_ENV = "LORAPLANE_REDIS_SENTINEL_PASSWORD"
REDIS_SENTINEL_PASSWORD_FILE_ENV = "LORAPLANE_REDIS_SENTINEL_PASSWORD_FILE"

#: URL schemes of a Sentinel-managed Redis (plain and TLS)
SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")
#: a sentinel's port when its address has none
DEFAULT_SENTINEL_PORT = 26379
_SERVICE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def secret(value: str | None, file: str | os.PathLike[str] | None) -> str | None:
    """``value`` when set, else the stripped content of ``file`` when given, else None (an empty one is None)."""
    if value:
        return value
    if file:
        text = Path(file).read_text().strip()
        return text or None
    return None


def redis_options(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Keyword arguments of a Redis client: ACL user, password, TLS CA bundle, from the environment."""
    env = os.environ if environ is None else environ
    options = _user_and_password(env, REDIS_USERNAME_ENV, REDIS_PASSWORD_ENV, REDIS_PASSWORD_FILE_ENV)
    if env.get(REDIS_CA_FILE_ENV):
        options["ssl_ca_certs"] = env[REDIS_CA_FILE_ENV]
    return options


def sentinel_options(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Keyword arguments of a client of the sentinels themselves: their user and password, from the environment."""
    env = os.environ if environ is None else environ
    return _user_and_password(env, REDIS_SENTINEL_USERNAME_ENV, REDIS_SENTINEL_PASSWORD_ENV,
                              REDIS_SENTINEL_PASSWORD_FILE_ENV)


def _user_and_password(env: Mapping[str, str], user_env: str, password_env: str, file_env: str) -> dict[str, Any]:
    """``username`` and ``password`` client options from those variables (each only when set)."""
    options: dict[str, Any] = {}
    if username := env.get(user_env):
        options["username"] = username
    if password := secret(env.get(password_env), env.get(file_env)):
        options["password"] = password
    return options


@dataclass(frozen=True)
class SentinelUrl:
    """A parsed ``redis+sentinel://`` URL."""

    sentinels: tuple[tuple[str, int], ...]
    service: str
    db: int = 0
    tls: bool = False

    def __str__(self) -> str:
        hosts = ",".join(f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in self.sentinels)
        return f"{SENTINEL_SCHEMES[self.tls]}://{hosts}/{self.service}/{self.db}"


def parse_sentinel_url(url: str) -> SentinelUrl | None:
    """The sentinels, service name and database of a ``redis+sentinel://`` or ``rediss+sentinel://`` URL; None for
    any other scheme; ValueError for a malformed one (credentials in it included: they come from the environment)."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() not in SENTINEL_SCHEMES:
        return None
    parts = urlsplit(url)
    if parts.query or parts.fragment:
        raise ValueError(f"redis url {url!r}: a sentinel URL takes no query or fragment")
    netloc, _, path = rest.partition("/")
    if "@" in netloc:
        raise ValueError(f"redis url {url!r}: no credentials in the URL (they come from the environment)")
    sentinels = []
    for address in filter(None, netloc.split(",")):
        host, port = split_host_port(address)
        sentinels.append((host, DEFAULT_SENTINEL_PORT if port is None else port))
    if not sentinels:
        raise ValueError(f"redis url {url!r} names no sentinel (redis+sentinel://host:port[,host:port]/service[/db])")
    segments = path.split("/") if path else []
    if not segments or not _SERVICE_NAME.fullmatch(segments[0]) or len(segments) > 2 or (
            len(segments) == 2 and not segments[1].isdigit()):
        raise ValueError(f"redis url {url!r}: the path is /<service name>[/<db>] "
                         "(redis+sentinel://host:port[,host:port]/service[/db])")
    db = int(segments[1]) if len(segments) == 2 else 0
    return SentinelUrl(tuple(sentinels), segments[0], db, scheme.lower() == SENTINEL_SCHEMES[1])


def _sentinel_kwargs(parsed: SentinelUrl, environ: Mapping[str, str] | None,
                     kwargs: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the sentinels' connection arguments, the data nodes') of a parsed sentinel URL."""
    nodes = {**redis_options(environ), **kwargs, "db": parsed.db}
    sentinels = {k: v for k, v in kwargs.items() if k.startswith("socket_")}
    sentinels.update(sentinel_options(environ))
    if parsed.tls:
        nodes["ssl"] = sentinels["ssl"] = True
        if nodes.get("ssl_ca_certs"):
            sentinels["ssl_ca_certs"] = nodes["ssl_ca_certs"]
    return sentinels, nodes


class SentinelRedis(aioredis.Redis):
    """A client of a Sentinel-managed primary that closes its sentinel clients with itself."""

    sentinel_manager: aiosentinel.Sentinel | None = None

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        await super().aclose(close_connection_pool)
        if self.sentinel_manager is not None:
            await self.sentinel_manager.aclose()


class SyncSentinelRedis(redis.Redis):
    """The blocking ``SentinelRedis``."""

    sentinel_manager: redis.sentinel.Sentinel | None = None

    def close(self) -> None:
        super().close()
        if self.sentinel_manager is not None:
            self.sentinel_manager.close()


def async_redis(url: str, environ: Mapping[str, str] | None = None, **kwargs: Any) -> aioredis.Redis:
    """An asyncio Redis client for ``url`` with the credentials of ``redis_options`` (``environ``: the process's
    environment by default); for a ``redis+sentinel://`` URL, a client of the service's current primary."""
    parsed = parse_sentinel_url(url)
    if parsed is None:
        return aioredis.Redis.from_url(url, **{**redis_options(environ), **kwargs})
    sentinel_kwargs, nodes = _sentinel_kwargs(parsed, environ, kwargs)
    manager = aiosentinel.Sentinel(list(parsed.sentinels), sentinel_kwargs=sentinel_kwargs)
    client: SentinelRedis = manager.master_for(parsed.service, redis_class=SentinelRedis, **nodes)
    client.sentinel_manager = manager
    return client


def sync_redis(url: str, environ: Mapping[str, str] | None = None, **kwargs: Any) -> redis.Redis:
    """A blocking Redis client for ``url`` with the credentials of ``redis_options``; for a ``redis+sentinel://``
    URL, a client of the service's current primary."""
    parsed = parse_sentinel_url(url)
    if parsed is None:
        return redis.Redis.from_url(url, **{**redis_options(environ), **kwargs})
    sentinel_kwargs, nodes = _sentinel_kwargs(parsed, environ, kwargs)
    manager = redis.sentinel.Sentinel(list(parsed.sentinels), sentinel_kwargs=sentinel_kwargs)
    client: SyncSentinelRedis = manager.master_for(parsed.service, redis_class=SyncSentinelRedis, **nodes)
    client.sentinel_manager = manager
    return client
