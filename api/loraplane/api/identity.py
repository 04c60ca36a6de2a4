"""Identity of an adapter revision: its served name and its cache key.

A runtime registers every revision under its own served name, so two revisions of one adapter can be resident side
by side and a response always says which one answered. The cache key changes whenever anything that changes the
loaded weights changes, so a cache keyed by it can never hand out the wrong revision.
"""

from __future__ import annotations

import functools
import hashlib

from loraplane.api import validation as v

#: Separates adapter and revision in a served name; neither part can contain it (both are DNS-1123 labels).
SERVED_NAME_SEPARATOR = "@"

#: Bumped whenever the way runtimes turn an artifact into loaded weights changes incompatibly.
RUNTIME_COMPAT_VERSION = "1"


@functools.lru_cache(maxsize=1 << 16)
def served_name(adapter: str, revision: str) -> str:
    """``claims-assistant`` + ``v18`` -> ``claims-assistant@v18`` (remembered: a controller asks for each of its
    revisions' names many times a plan)."""
    for part, what in ((adapter, "adapter"), (revision, "revision")):
        if not v.matches(v.DNS1123_LABEL, part):
            raise ValueError(f"{what} {part!r} is not a DNS-1123 label")
    return f"{adapter}{SERVED_NAME_SEPARATOR}{revision}"


def parse_served_name(name: str) -> tuple[str, str]:
    """The (adapter, revision) a served name was made from; ValueError for any other string."""
    adapter, sep, revision = name.partition(SERVED_NAME_SEPARATOR)
    if not sep:
        raise ValueError(f"{name!r} is not a served revision name (adapter{SERVED_NAME_SEPARATOR}revision)")
    served_name(adapter, revision)  # validates both parts
    return adapter, revision


@functools.lru_cache(maxsize=1 << 16)
def cache_key(
    base_model_digest: str,
    adapter: str,
    revision: str,
    artifact_digest: str,
    runtime_compat_version: str = RUNTIME_COMPAT_VERSION,
) -> str:
    """``sha256:<hex>`` over every input that determines the loaded weights."""
    for digest in (base_model_digest, artifact_digest):
        if not v.matches(v.DIGEST, digest):
            raise ValueError(f"{digest!r} is not a sha256:<64 hex> digest")
    material = "\x1f".join(
        ("loraplane-cache-key/1", base_model_digest, adapter, revision, artifact_digest, runtime_compat_version)
    )
    return "sha256:" + hashlib.sha256(material.encode()).hexdigest()
