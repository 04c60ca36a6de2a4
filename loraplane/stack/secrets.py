"""The local stack's secrets: Redis ACL users (one per component, least privilege) and the runtimes' admin tokens.

Every secret is a random string in a file of mode 0600 below ``<workdir>/secrets``; processes get the file's path
in their environment (never a secret on a command line). Redis reads an ACL file that holds only SHA-256 hashes
of the passwords and has the ``default`` user switched off, so a client without a password can run no command.

Who may do what (``acl_rules``), by the key names of ``loraplane.api.keys``:

- ``controller``: reads the pool's keys; writes only target states, their catalogue, the route table and the
  revisions' status records, publishes their notices;
- ``sidecar-<pod>``: reads its own pod's target state and the pool's catalogue of target specs; writes only its own
  residency report and the report index;
- ``picker``: reads the pool's keys; writes only the request rates and its own counters;
- ``observer``: reads the pool's keys (the demo and the tests watching the stack);
- ``admin``: everything (an operator's ``redis-cli``; the tests that forge or delete keys on purpose).

With Sentinel (``create(..., sentinel=True)``, ``loraplane up --redis-sentinel``) two more users, no key and no
channel of the pool's: ``replication`` (a replica's link to its primary: ``PSYNC``, ``REPLCONF``) and ``sentinel``
(what a sentinel sends a data node to watch and reconfigure it, per Redis's Sentinel ACL guide); and the sentinels'
own password (``sentinel_password_file``), which every client presents to ask them for the primary.
"""

from __future__ import annotations

import hashlib
import os
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from loraplane.api import keys
from loraplane.credentials import (
    REDIS_PASSWORD_FILE_ENV,
    REDIS_SENTINEL_PASSWORD_FILE_ENV,
    REDIS_USERNAME_ENV,
)

_CONNECT = "+ping +echo +client|setname +client|id +select"
_READ = "+get +mget +smembers +scan +exists +ttl +pttl +type"
_SUBSCRIBE = "+subscribe +unsubscribe"


def _pool_prefix(pool: str) -> str:
    """``loraplane:{pool}`` (the hash-tagged prefix every key of the pool starts with)."""
    return keys.route_table(pool).removesuffix(":routes")


def acl_rules(pool: str, pods: Sequence[str], picker_replicas: Sequence[str] = ("picker-0",)) -> dict[str, str]:
    """ACL rules (everything after ``user <name> on #<hash>``) of every component user of one pool."""
    prefix = _pool_prefix(pool)
    rules = {
        "controller": f"resetkeys %R~{prefix}:* %W~{keys.target_state_pattern(pool)} %W~{keys.target_spec_pattern(pool)} "
        f"%W~{keys.route_keys_pattern(pool)} %W~{keys.revision_status_pattern(pool)} "
        f"resetchannels &{keys.target_changed_channel(pool)} &{keys.routes_changed_channel(pool)} "
        f"-@all {_CONNECT} {_READ} +set +expire +publish",
        "picker": "resetkeys " + f"%R~{prefix}:* "
        + " ".join(f"%W~{keys.request_rates(pool, r)} %W~{keys.picker_counters(pool, r)} "
                   f"%W~{keys.picker_in_flight(pool, r)}" for r in picker_replicas)
        + f" resetchannels &{keys.residency_changed_channel(pool)} &{keys.routes_changed_channel(pool)} "
        f"&{keys.kv_blocks_changed_channel(pool)} -@all {_CONNECT} {_READ} {_SUBSCRIBE} +set",
        "observer": f"resetkeys %R~{prefix}:* resetchannels &{prefix}:* -@all {_CONNECT} {_READ} {_SUBSCRIBE}",
        "admin": "~* &* +@all",
    }
    for pod in pods:
        rules[sidecar_user(pod)] = (
            f"resetkeys %R~{keys.target_state(pool, pod)} %R~{keys.target_spec_pattern(pool)} "
            f"%W~{keys.residency_report(pool, pod)} "
            f"%W~{keys.residency_index(pool)} %W~{keys.kv_blocks(pool, pod)} "
            f"resetchannels &{keys.target_changed_channel(pool)} &{keys.residency_changed_channel(pool)} "
            f"&{keys.kv_blocks_changed_channel(pool)} -@all {_CONNECT} +get +mget {_SUBSCRIBE} +set +sadd +publish "
            "+multi +exec +discard"
        )
    return rules


#: ACL rules of the users a Sentinel deployment adds on the data nodes
SENTINEL_ACL_RULES = {
    "replication": "resetkeys resetchannels -@all +psync +replconf +ping",
    "sentinel": "resetkeys allchannels -@all +multi +slaveof +replicaof +ping +exec +subscribe +config|rewrite "
                "+role +publish +info +client|setname +client|kill +script|kill",
}


def sidecar_user(pod: str) -> str:
    """The Redis user of ``pod``'s sidecar."""
    return f"sidecar-{pod}"


def write_private(path: Path, value: str) -> None:
    """Write ``value`` to ``path`` readable by this user only (0600, its directory 0700 when created)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(value)


@dataclass
class StackSecrets:
    """The secret files of one local stack (created once; a restart of Redis or of a child reuses them)."""

    directory: Path

    def password_file(self, user: str) -> Path:
        """The file holding ``user``'s Redis password."""
        return self.directory / f"redis-{user}"

    def token_file(self, pod: str) -> Path:
        """The file holding ``pod``'s runtime admin token (the engine requires it; the sidecar sends it)."""
        return self.directory / f"admin-token-{pod}"

    def acl_file(self) -> Path:
        """Redis's ACL file (password hashes only)."""
        return self.directory / "users.acl"

    def sentinel_password_file(self) -> Path:
        """The file holding the sentinels' own password (only with ``create(..., sentinel=True)``)."""
        return self.directory / "sentinel-auth"

    def create(self, pool: str, pods: Sequence[str], picker_replicas: Sequence[str] = ("picker-0",),
               sentinel: bool = False) -> None:
        """Write a random password per Redis user, the ACL file, and a random admin token per pod; with
        ``sentinel`` also the ``replication`` and ``sentinel`` users and the sentinels' own password."""
        lines = ["user default off resetkeys resetchannels -@all"]
        rules_of = {**acl_rules(pool, pods, picker_replicas), **(SENTINEL_ACL_RULES if sentinel else {})}
        if sentinel:
            write_private(self.sentinel_password_file(), secrets.token_hex(24))
        else:  # a workdir reused without Sentinel
            self.sentinel_password_file().unlink(missing_ok=True)
        for user, rules in rules_of.items():
            password = secrets.token_hex(24)
            write_private(self.password_file(user), password)
            lines.append(f"user {user} on #{hashlib.sha256(password.encode()).hexdigest()} {rules}")
        write_private(self.acl_file(), "\n".join(lines) + "\n")
        for pod in pods:
            write_private(self.token_file(pod), secrets.token_hex(24))

    def redis_env(self, user: str) -> dict[str, str]:
        """The environment that makes a loraplane process connect to Redis as ``user`` (and, with Sentinel, present
        the sentinels' password)."""
        env = {REDIS_USERNAME_ENV: user, REDIS_PASSWORD_FILE_ENV: str(self.password_file(user))}
        if self.sentinel_password_file().exists():
            env[REDIS_SENTINEL_PASSWORD_FILE_ENV] = str(self.sentinel_password_file())
        return env

    def redis_password(self, user: str) -> str:
        """``user``'s password (for in-process clients such as the demo's)."""
        return self.password_file(user).read_text().strip()
