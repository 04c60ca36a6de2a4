"""A reader's side of target states by reference: the pool's catalogue entries it needs, fetched once each.

The controller writes each served revision's ``TargetSpec`` once per pool (``keys.target_spec``) and each pod's
``TargetState`` as ``TargetRef`` entries naming them, so a change to one pod writes kilobytes however many specs it
holds. A reader resolves a state before acting on it (``SpecCache.resolve``): all of it or nothing, for a ref whose
spec is missing (lost, not yet written) or is another revision's under the name (``cache_key``) raises
``MissingSpecs``; the controller's level-triggered repair writes missing catalogue keys back.
"""

from __future__ import annotations

import logging
from typing import Any

from loraplane.api import keys
from loraplane.api.payload import read_payload_or_none
from loraplane.api.runtime import TargetSpec, TargetState

log = logging.getLogger(__name__)


class SpecCache:
    """The catalogue entries of one pool that a reader's states have named; fetches only those it lacks."""

    def __init__(self, pool: str) -> None:
        self.pool = pool
        self.specs: dict[str, TargetSpec] = {}
        #: catalogue entries fetched since start
        self.fetched = 0

    async def resolve(self, client: Any, state: TargetState) -> TargetState:
        """``state`` with its refs made whole from the catalogue (``TargetState.resolve``); entries no longer named
        are forgotten."""
        lacking = [r.served_name for r in state.refs
                   if (spec := self.specs.get(r.served_name)) is None or spec.cache_key != r.cache_key]
        if lacking:
            raws = await client.mget([keys.target_spec(self.pool, name) for name in lacking])
            for name, raw in zip(lacking, raws, strict=True):
                spec = read_payload_or_none(TargetSpec, raw, log)
                if spec is not None and spec.pool == self.pool and spec.served_name == name:
                    self.specs[name] = spec
                    self.fetched += 1
        resolved = state.resolve(self.specs)
        if len(self.specs) > 2 * len(resolved.adapters) + 64:
            named = {a.served_name for a in resolved.adapters}
            self.specs = {n: s for n, s in self.specs.items() if n in named}
        return resolved
