"""Model resolution: a logical model name -> the revision to serve, from the controller's ``RouteTable``.

The stable/canary split is sticky: a request with a session key (a header, hashed with the model name) always
lands in the same percentile bucket, so one user does not flip between revisions while the weights stay put.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from typing import Any

import numpy as np

from loraplane.api import RevisionRole, RouteEntry, RouteTable
from loraplane.api.routedeltas import changed_names


@dataclass(frozen=True, slots=True)
class Resolution:
    """What a logical model name resolves to for one request."""

    logical: str
    #: the name the runtime serves the chosen revision under; None for the base model (no rewrite, no affinity).
    served_name: str | None
    digest: str | None
    role: RevisionRole | None
    tenant: str
    priority: int


class UnknownModelError(Exception):
    """The model is not in the route table (HTTP 404)."""


@dataclass(frozen=True, slots=True)
class _Route:
    tenant: str
    priority: int
    #: (cumulative weight upper bound in percent, served name, digest, role), in table order
    choices: tuple[tuple[int, str, str, RevisionRole], ...]


class RouteResolver:
    """Resolves model names against one ``RouteTable`` generation (rebuild on change)."""

    def __init__(self, table: RouteTable | None) -> None:
        """Index the table; None (no table yet) routes nothing."""
        self.table = table
        self.base_model = table.base_model if table else None
        self._routes: dict[str, _Route] = {}
        #: served name -> what a request naming that revision directly resolves to (the model-name rewrite header)
        self._served: dict[str, Resolution] = {}
        self._priorities: dict[str, int] | None = None
        for name, entry in (table.models if table else {}).items():
            self._index(name, entry)

    def _index(self, name: str, entry: RouteEntry) -> None:
        total, choices = 0, []
        for rev in entry.revisions:
            self._served.setdefault(rev.served_name, Resolution(name, rev.served_name, rev.digest, rev.role,
                                                                entry.tenant, entry.priority))
            if rev.weight == 0:
                continue
            total += rev.weight
            choices.append((total, rev.served_name, rev.digest, rev.role))
        self._routes[name] = _Route(entry.tenant, entry.priority, tuple(choices))

    def updated(self, table: RouteTable | None) -> RouteResolver:
        """A resolver for ``table``, a later generation of this one's: the entries that did not change are taken
        over as they are (a table of 10,000 names changed in a few is indexed in those few, not rebuilt), so a
        route change costs the picker's event loop in proportion to the change. This resolver is left as it was:
        requests resolving on it meanwhile see the old generation whole, the caller swaps in the new one."""
        names = changed_names(self.table, table)
        if table is None or names is None or len(names) > max(64, len(table.models) // 4):
            return RouteResolver(table)
        new = RouteResolver.__new__(RouteResolver)
        new.table, new.base_model = table, table.base_model
        new._routes, new._served, new._priorities = dict(self._routes), dict(self._served), None
        old_models = self.table.models if self.table is not None else {}
        for name in names:
            new._routes.pop(name, None)
            old = old_models.get(name)
            for rev in old.revisions if old is not None else ():
                if (hit := new._served.get(rev.served_name)) is not None and hit.logical == name:
                    del new._served[rev.served_name]
        for name in sorted(names):
            entry = table.models.get(name)
            if entry is not None:
                new._index(name, entry)
        if self._priorities is not None:  # patched too: not recomputed over every name
            priorities = dict(self._priorities)
            for name in names:
                for _, served, _, _ in self._routes[name].choices if name in self._routes else ():
                    priorities.pop(served, None)
            for name in names:
                route = new._routes.get(name)
                if route is not None:
                    priorities.update((served, route.priority) for _, served, _, _ in route.choices)
            new._priorities = priorities
        return new

    @property
    def generation(self) -> int | None:
        """The generation of the table in use."""
        return self.table.generation if self.table else None

    def priorities(self) -> dict[str, int]:
        """Served name -> route priority, for the snapshot's gold protection (computed once per resolver)."""
        if self._priorities is None:
            self._priorities = {served: route.priority for route in self._routes.values()
                                for _, served, _, _ in route.choices}
        return self._priorities

    def staging_pods(self) -> frozenset[str]:
        """The pods that take a revision no pod holds yet (the table's ``staging_pods``; empty: any pod)."""
        return frozenset(self.table.staging_pods) if self.table else frozenset()

    def has_route(self, model: str) -> bool:
        """Does the table route ``model`` (a logical name: llm-d-router's rewrite rule for it)?"""
        return model in self._routes

    def served(self, served_name: str) -> Resolution | None:
        """The revision the table serves as ``served_name`` (any weight, 0 too: it is named directly), with its
        logical name's tenant and priority; None when no revision is served under that name."""
        return self._served.get(served_name)

    def resolve(self, model: str, session_key: str | None, rng: np.random.Generator) -> Resolution:
        """The revision ``model`` goes to for this session; ``UnknownModelError`` for unregistered names."""
        route = self._routes.get(model)
        if route is None:
            if model == self.base_model:
                return Resolution(model, None, None, None, "default", 0)
            raise UnknownModelError(f"model {model!r} is not served by this pool")
        bucket = sticky_bucket(model, session_key) if session_key else float(rng.random()) * 100.0
        for upper, served, digest, role in route.choices:
            if bucket < upper:
                return Resolution(model, served, digest, role, route.tenant, route.priority)
        _, served, digest, role = route.choices[-1]
        return Resolution(model, served, digest, role, route.tenant, route.priority)

    def model_cards(self, created: int) -> list[dict[str, Any]] | None:
        """What ``GET /v1/models`` lists through the gateway, in vLLM's shape (``ModelCard``): the base model, then
        every logical name of the table (``parent``: the base model; ``root``: the served name of the revision
        most of its traffic goes to) -- the names a client may send, not the pods' served names. None without a
        table (the request then goes to a pod, as the reference picker sends it)."""
        if self.table is None:
            return None

        def card(model_id: str, root: str, parent: str | None) -> dict[str, Any]:
            permission = {"id": f"modelperm-{secrets.token_hex(8)}", "object": "model_permission", "created": created,
                          "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
                          "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
                          "organization": "*", "group": None, "is_blocking": False}
            return {"id": model_id, "object": "model", "created": created, "owned_by": "vllm", "root": root,
                    "parent": parent, "max_model_len": None, "permission": [permission]}

        base = self.base_model
        cards = [card(base, base, None)] if base else []
        for name, entry in sorted(self.table.models.items()):
            top = max(entry.revisions, key=lambda rev: rev.weight)  # the first of the heaviest
            cards.append(card(name, top.served_name, base))
        return cards


def sticky_bucket(model: str, session_key: str) -> float:
    """A stable number in [0, 100) for (model, session key)."""
    digest = hashlib.blake2b(f"{model}\x1f{session_key}".encode(errors="surrogatepass"), digest_size=8).digest()
    return (int.from_bytes(digest, "big") % 1_000_000) / 10_000.0
