"""Secrets every process reads the same way: from the environment or a file, never from the command line.

The Redis connection of every component (controller, picker, sidecar, tools) takes its ACL user and password from
``LORAPLANE_REDIS_USERNAME`` and ``LORAPLANE_REDIS_PASSWORD`` or ``LORAPLANE_REDIS_PASSWORD_FILE`` (a file wins
over nothing, the variable over the file), and for ``rediss://`` URLs a CA bundle from ``LORAPLANE_REDIS_CA_FILE``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import redis
import redis.asyncio as aioredis

REDIS_USERNAME_ENV = "LORAPLANE_REDIS_USERNAME"
REDIS_PASSWORD_ENV = "LORAPLANE_REDIS_PASSWORD"
REDIS_PASSWORD_FILE_ENV = "LORAPLANE_REDIS_PASSWORD_FILE"
REDIS_CA_FILE_ENV = "LORAPLANE_REDIS_CA_FILE"


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
    options: dict[str, Any] = {}
    username = env.get(REDIS_USERNAME_ENV) or None
    password = secret(env.get(REDIS_PASSWORD_ENV), env.get(REDIS_PASSWORD_FILE_ENV))
    if username:
        options["username"] = username
    if password:
        options["password"] = password
    if env.get(REDIS_CA_FILE_ENV):
        options["ssl_ca_certs"] = env[REDIS_CA_FILE_ENV]
    return options


def async_redis(url: str, **kwargs: Any) -> aioredis.Redis:
    """An asyncio Redis client for ``url`` with the credentials of ``redis_options``."""
    return aioredis.Redis.from_url(url, **redis_options(), **kwargs)


def sync_redis(url: str, **kwargs: Any) -> redis.Redis:
    """A blocking Redis client for ``url`` with the credentials of ``redis_options``."""
    return redis.Redis.from_url(url, **redis_options(), **kwargs)
