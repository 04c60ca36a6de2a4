"""The picker's ``PoolSnapshot`` as the simulator updates it: a pod whose tiers changed is re-indexed by the rows that
changed, not by all of them."""

from __future__ import annotations

from loraplane.api.runtime import Tier
from loraplane.picker.snapshot import EndpointState, PoolSnapshot


class SimSnapshot(PoolSnapshot):
    """``PoolSnapshot`` whose ``_reindex`` finds the changed rows with one set operation over the two residency maps
    (in C) where neither endpoint is stale or draining anything (the simulator's pods never are): a fleet's pods
    hold hundreds of revisions each, a heartbeat changes a few, and the picker's re-index passes over every row of
    both reports. The same residency index, draining lists and protected counts as ``PoolSnapshot._reindex``."""

    def _reindex(self, index: int, old: EndpointState, new: EndpointState) -> None:
        if old.stale or new.stale or old.last_heard or new.last_heard or old.draining or new.draining:
            super()._reindex(index, old, new)
            return
        before_rows, after_rows = old.residency, new.residency
        changed = {name for name, _ in before_rows.items() ^ after_rows.items()}
        priorities = self._priorities
        before: dict[tuple[str, str], int] = {}
        after: dict[tuple[str, str], int] = {}
        protected = 0
        for name in changed:
            was, now = before_rows.get(name), after_rows.get(name)
            gold = priorities.get(name, 0) > 0
            if was is not None and was[1] is not None and was[0] is not Tier.ABSENT:
                before[(name, was[1])] = was[0].level
                protected -= gold and was[0].level == 0
            if now is not None and now[1] is not None and now[0] is not Tier.ABSENT:
                after[(name, now[1])] = now[0].level
                protected += gold and now[0].level == 0
        for key in before.keys() | after.keys():
            level = after.get(key)
            if level == before.get(key):
                continue
            entry = self.residency.get(key)
            level_of = {i: lv for i, lv in entry.level_of.items() if i != index} if entry else {}
            if level is not None:
                level_of[index] = level
            self._set_holders(key, level_of, [i for i in self.draining.get(key, ()) if i != index])
        self.protected_warm[index] += protected
        self._memo.clear()
