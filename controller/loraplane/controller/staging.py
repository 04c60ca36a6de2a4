"""The staging rules of placement: idle revisions, floors, staging pods and their shield.

Pure predicates over the few facts they read of a plan (each revision's steady rate, the GPU replicas it asks for,
whether it is gold or pinned; the pods' GPU slots; the previous plan), used by ``placement``'s planner. What they
decide is described in ``placement``'s module docstring and in ``docs/controller.md`` ("Staging pods"):

- ``is_idle``: no traffic in any window (a sweep yet to come);
- ``is_floor``: below ``gpu_min_rate`` and not pinned: it plans like an idle revision (its warm policy's floor);
- ``floors_fit``: whether the GPU slots left hold a floor replica for every revision with a trickle of traffic;
- ``staging_pods``: the pods that stage idle revisions (every pod unless the pool has gold revisions, room for
  their minimum on the other pods, scarce slots and some idle revision);
- ``shields_staging``: whether cold traffic shows on the staging pods (revisions held on staging pods only carry
  ``gpu_min_rate`` or more);
- ``Staging``: one plan's staging pods and shield, with the rules that follow from them (``hosts``, ``shields``,
  ``floor_barred``, ``gpu_reserve``, ``routed``).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from loraplane.api.runtime import Tier

if TYPE_CHECKING:
    from loraplane.controller.placement import PlacementConfig


class Revision(Protocol):
    """What the staging rules read of one revision in a plan."""

    @property
    def rate(self) -> float:
        """Its steady request rate (requests/s, bursts excluded)."""

    @property
    def need(self) -> int:
        """The GPU replicas it asks for."""

    @property
    def gold(self) -> bool:
        """Priority above 0."""

    @property
    def pinned(self) -> bool:
        """Pinned by its spec."""


def is_idle(rev: Revision) -> bool:
    """No traffic in any window: a revision staged on the staging pods only."""
    return rev.rate <= 0


def is_floor(rev: Revision, config: PlacementConfig) -> bool:
    """True when ``rev`` plans like an idle adapter: below ``gpu_min_rate``, not pinned."""
    return not rev.pinned and rev.rate < config.gpu_min_rate


def floors_fit(revisions: Iterable[Revision], free_slots: int, config: PlacementConfig) -> bool:
    """Whether the GPU slots left beyond the burst reserve (``free_slots``) and the replicas of adapters with real
    demand hold a slot for every adapter with a trickle of traffic (below ``gpu_min_rate``). Only then do
    warm-policy floor replicas get GPU slots: otherwise the trickles' on-demand loads evict them, and every plan
    would load them again (a GPU load per on-demand load, each stalling its pod's batch), so the floors stay in
    host memory."""
    wanted = trickles = 0
    for rev in revisions:
        if not is_floor(rev, config):
            wanted += rev.need
        elif rev.rate > 0:
            trickles += 1
    return trickles <= free_slots - wanted


def staging_pods(gpu_slots: Mapping[str, int], revisions: Mapping[str, Revision],
                 previous: Mapping[str, Mapping[str, Tier]], config: PlacementConfig) -> frozenset[str]:
    """The pods (of ``gpu_slots``: pod -> its GPU slots) that stage idle revisions: ``staging_share`` of the pool,
    those that held the most idle revisions in the ``previous`` plan (served name -> pod -> tier), then those with
    the fewest gold GPU replicas in it, so the set stays the same from plan to plan. Every pod when that share
    rounds to none or all of them, when no revision is idle (no sweep is to come), when no revision is gold (there
    is no one to shield from the cold traffic), when the other pods' GPU slots cannot hold ``gold_min_replicas``
    replicas of every gold revision (the pool has no pods to spare), or when they hold every replica the pool needs
    (what the revisions with traffic ask for, at least the gold minimum) and a free slot each besides: slots are not
    scarce, cold loads take free slots without evicting anyone, and a few staging pods would only concentrate the
    cold traffic's loads and prefill on themselves."""
    every = frozenset(gpu_slots)
    count = math.floor(len(gpu_slots) * config.staging_share + 1e-9)
    if count <= 0 or count >= len(gpu_slots) or not any(is_idle(rev) for rev in revisions.values()):
        return every
    idle_held = dict.fromkeys(gpu_slots, 0)
    gold_gpu = dict.fromkeys(gpu_slots, 0)
    for name, held in previous.items():
        rev = revisions.get(name)
        if rev is None:
            continue
        for pod, tier in held.items():
            if tier is Tier.GPU:
                gold_gpu[pod] += rev.gold
            elif is_idle(rev):
                idle_held[pod] += 1
    staging = frozenset(sorted(gpu_slots, key=lambda p: (-idle_held[p], gold_gpu[p], p))[:count])
    room = sum(slots for pod, slots in gpu_slots.items() if pod not in staging)
    gold_replicas = sum(config.gold_min_replicas for rev in revisions.values() if rev.gold)
    # the replicas the pool must hold: what its traffic asks for, and the gold minimum (before traffic shows)
    needed = max(gold_replicas, sum(rev.need for rev in revisions.values() if not is_floor(rev, config)))
    scarce = needed >= room - (len(gpu_slots) - count)
    return staging if 0 < gold_replicas <= room and scarce else every


def shields_staging(staging: frozenset[str], pods: int, revisions: Mapping[str, Revision],
                    previous: Mapping[str, Mapping[str, Tier]], config: PlacementConfig) -> bool:
    """True while cold traffic shows on the ``staging`` pods (of ``pods`` in all): revisions below ``gpu_min_rate``
    that the ``previous`` plan (served name -> pod -> tier) held on staging pods only carry ``gpu_min_rate`` or
    more."""
    if len(staging) == pods:
        return False
    cold = 0.0
    for name, held in previous.items():
        rev = revisions.get(name)
        if rev is not None and is_floor(rev, config) and held.keys() <= staging:
            cold += rev.rate
    return cold >= config.gpu_min_rate


@dataclass(frozen=True)
class Staging:
    """One plan's staging pods (``pods``: every pod of the ``pool`` while every pod stages) and whether they are
    shielded, with the rules that follow from them."""

    pods: frozenset[str]
    pool: frozenset[str]
    shielded: bool
    config: PlacementConfig

    @classmethod
    def of(cls, gpu_slots: Mapping[str, int], revisions: Mapping[str, Revision],
           previous: Mapping[str, Mapping[str, Tier]], config: PlacementConfig) -> Staging:
        """The staging pods of a plan (``staging_pods``) and their shield (``shields_staging``)."""
        pods = staging_pods(gpu_slots, revisions, previous, config)
        return cls(pods, frozenset(gpu_slots), shields_staging(pods, len(gpu_slots), revisions, previous, config),
                   config)

    @property
    def apart(self) -> bool:
        """True while some pods stage apart (not every pod)."""
        return len(self.pods) < len(self.pool)

    @property
    def routed(self) -> frozenset[str]:
        """The staging pods the plan names (``Placement.staging``, the route table's): none while every pod stages."""
        return self.pods if self.apart else frozenset()

    def hosts(self, rev: Revision) -> Collection[str]:
        """The pods that may stage ``rev`` in host memory or on disk: the staging pods for an idle revision."""
        return self.pods if is_idle(rev) else self.pool

    def shields(self, rev: Revision, pod: str) -> bool:
        """True for a gold revision on a shielded staging pod: it is held there at no tier, except a GPU replica
        the other pods have no room for."""
        return self.shielded and rev.gold and pod in self.pods

    def floor_barred(self, rev: Revision) -> bool:
        """True for a floor replica of a non-gold revision while the staging pods are shielded: on a staging pod it
        would take a slot the cold traffic's own loads need, elsewhere it would draw that traffic to the gold
        adapters' pods."""
        return self.shielded and not rev.gold and is_floor(rev, self.config)

    def gpu_reserve(self, pod: str, gpu_slots: int, reserve: int) -> int:
        """GPU slots ``pod`` keeps out of the plan (``reserve``: its burst reserve): while shielded, a staging pod
        plans one replica at most (its other slots are for the cold traffic's own loads) and the other pods keep no
        burst slot (it holds the gold replicas)."""
        if not self.shielded:
            return reserve
        return max(0, gpu_slots - 1) if pod in self.pods else 0
