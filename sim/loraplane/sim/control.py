"""The real controller's planning, driven by the simulator.

loraplane's placement in the simulator is the controller's own ``IncrementalPlanner`` (``plan_pool``, placement,
``keep_until_replaced``, ``fit_to_sidecars``, its parts and deltas) fed what the real one reads from Redis and the
API server, made from the simulated pods:

- the trace's adapters as Stable AdapterRevisions (``revision_manifest``, as the twin applies them), each status
  the planner decides written back onto the object (a new object, as the API server's informer hands it back);
- each pod's ``ResidencyReport`` as its sidecar builds it (``SimulatedController._report``), its version bumped when what planning
  reads of it changes (as ``PoolReadings.report_versions``);
- the request rates the picker's ``RequestStats`` counts over the arrivals so far, published every
  ``RATES_PUBLISH_S``;
- the target states it last wrote.

It had its own model of the planner here before: the twin at 16 pods made 67 target adds where that model made 34,
because the real planner also plans again the adapters whose report rows changed and those whose statuses it wrote.
"""

from __future__ import annotations

import hashlib
import re
from collections import Counter
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from typing import Any

from loraplane.api import (
    AdapterRevision,
    AdapterTarget,
    PodLoad,
    PriorityClass,
    RequestRates,
    ResidencyReport,
    TargetState,
    Tier,
    parse_served_name,
    served_name,
)
from loraplane.api import validation as v
from loraplane.api.runtime import AdapterResidency
from loraplane.controller.incremental import IncrementalPlanner, PlanOutcome
from loraplane.controller.placement import PlacementConfig
from loraplane.controller.pool import PoolInputs, PoolPlan
from loraplane.picker.telemetry import RequestStats

#: the pool's name in the simulated controller's inputs
POOL = "sim"
#: the simulator's time 0 as unix seconds (reports, statuses and rate buckets are dated from it)
EPOCH = 1_700_000_000.0
#: how often the picker publishes its request rates (the local stack's ``--publish-seconds``)
RATES_PUBLISH_S = 2.0
BASE_MODEL = "base"
BASE_DIGEST = "sha256:" + "b" * 64
#: the rank the simulated revisions declare (what planning reads of ``spec.lora``: nothing)
SIM_RANK = 16
#: what a pass of the controller takes: CPU per revision it decides (a whole plan at 10,000 revisions and 256 pods
#: takes about 2.8 s of CPU here: cProfile of ``fleet``), and each status patch after it (one API request at a time:
#: the twin's controller log has them 2-4 ms apart); the watch hands the last patched object back ``WATCH_S`` later
#: (the next pass followed 20-60 ms after the last patch)
PLAN_S_PER_REVISION = 0.0003
PATCH_S = 0.004
WATCH_S = 0.05


def priority_class(priority: int) -> PriorityClass:
    """A trace's tenant priority (1 gold, 0 standard, -1 sheddable) as an AdapterRevision's class."""
    return PriorityClass.GOLD if priority > 0 else PriorityClass.SHEDDABLE if priority < 0 else PriorityClass.STANDARD


def revision_manifest(adapter: str, revision: str, tenant: str, priority: int, uri: str, digest: str, *,
                      pool: str, base_model: str, base_digest: str, rank: int,
                      target_modules: Iterable[str]) -> dict[str, Any]:
    """The AdapterRevision of one trace adapter: GPU-preferred, its tenant's priority class, a one-pod canary probed
    with two tokens (a first revision goes Stable after its probe). Validated."""
    body = {
        "apiVersion": "loraplane.io/v1alpha1",
        "kind": "AdapterRevision",
        "metadata": {"name": f"{adapter}-{revision}", "namespace": "default"},
        "spec": {
            "adapter": adapter, "revision": revision, "poolRef": {"name": pool},
            "baseModel": {"name": base_model, "digest": base_digest},
            "artifact": {"uri": uri, "digest": digest},
            "lora": {"rank": rank, "alpha": rank, "dtype": "float32", "targetModules": list(target_modules)},
            "tenant": tenant, "priorityClass": priority_class(priority).value,
            "warmPolicy": "gpu-preferred",
            "rollout": {"canary": {"pods": 1},
                        "healthProbe": {"prompt": "hello", "maxTokens": 2, "ttftBoundMs": 60000,
                                        "timeoutSeconds": 60}},
        },
    }
    AdapterRevision.model_validate(body)
    return body


def adapter_digest(name: str) -> str:
    """A stable stand-in artifact digest for a simulated served revision (its AdapterRevision's, and what its pods
    report)."""
    return "sha256:" + hashlib.sha256(name.encode()).hexdigest()


def dns_label(text: str) -> str:
    """``text`` where it is a DNS-1123 label, else one made from it (with a short hash of it: no two meet)."""
    if v.matches(v.DNS1123_LABEL, text):
        return text
    label = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")[:50]
    return f"{label}-{hashlib.sha256(text.encode()).hexdigest()[:8]}".lstrip("-")


def as_served_name(name: str) -> str:
    """A trace adapter's name as a served revision name: itself where it is one (``adapter@revision``), else
    ``dns_label(name)`` at revision ``v1``."""
    try:
        parse_served_name(name)
        return name
    except ValueError:
        return served_name(dns_label(name), "v1")


def stable_revision(served: str, tenant: str, priority: int, nbytes: int) -> AdapterRevision:
    """The Stable AdapterRevision of one trace adapter, as the twin's is once its probe passed."""
    adapter, revision = parse_served_name(served)
    body = revision_manifest(adapter, revision, dns_label(tenant), priority, f"oci://adapters.invalid/{adapter}:{revision}",
                             adapter_digest(served), pool=POOL, base_model=BASE_MODEL, base_digest=BASE_DIGEST,
                             rank=SIM_RANK, target_modules=("q_proj", "v_proj"))
    body["spec"]["artifact"]["sizeBytes"] = max(1, nbytes)
    body["status"] = {"phase": "Stable", "trafficWeight": 100, "servedName": served,
                      "phaseSince": datetime.fromtimestamp(EPOCH, UTC).isoformat()}
    return AdapterRevision.model_validate(body)


#: one report row's fields: (served name, tier, registered, draining)
Row = tuple[str, Tier, bool, bool]


class _Rows:
    """Report rows by their fields, made once (10,000 revisions' rows are not validated again at each plan)."""

    def __init__(self, digests: dict[str, str], sizes: dict[str, int]) -> None:
        self._digests, self._sizes = digests, sizes
        self._made: dict[Row, AdapterResidency] = {}

    def __call__(self, row: Row) -> AdapterResidency:
        made = self._made.get(row)
        if made is None:
            name, tier, registered, draining = row
            held = tier is not Tier.ABSENT
            made = self._made[row] = AdapterResidency(
                served_name=name, tier=tier, digest=self._digests[name] if held else None,
                bytes=self._sizes[name] if held else 0, registered=registered, draining=draining)
        return made


class SimulatedController:
    """``IncrementalPlanner`` on the simulated pool (see the module docstring): ``record`` counts each routed request
    as the picker does, ``plan(now, rows)`` runs one pass on each pod's report rows now."""

    def __init__(self, served: list[str], tenants: list[tuple[str, int]], sizes: list[int], pods: list[str],
                 max_gpu_slots: int, max_cpu_slots: int, disk_bytes: int | None, vllm: bool,
                 placement: PlacementConfig) -> None:
        self._clock = 0.0
        self.planner = IncrementalPlanner(clock=lambda: self._clock)
        self._stats = RequestStats(clock=lambda: EPOCH + self._clock)
        self.revisions = [stable_revision(name, tenant, priority, nbytes)
                          for name, (tenant, priority), nbytes in zip(served, tenants, sizes, strict=True)]
        self._token = 0
        #: (namespace, name) -> the revision's place in ``revisions``
        self._at = {(r.metadata.namespace or "default", r.metadata.name): i for i, r in enumerate(self.revisions)}
        self._rows = _Rows({n: adapter_digest(n) for n in served}, dict(zip(served, sizes, strict=True)))
        self._pods = pods
        self._vllm = vllm
        self._load = PodLoad(max_gpu_slots=max_gpu_slots, max_cpu_slots=max_cpu_slots, max_disk_bytes=disk_bytes)
        self._placement = placement
        #: pod -> (its rows as last reported, its report, its version)
        self._reports: dict[str, tuple[tuple[Row, ...], ResidencyReport, int]] = {}
        self._rates: RequestRates | None = None
        self._published = -RATES_PUBLISH_S
        #: pod -> the target state last written
        self.written: dict[str, TargetState] = {}
        #: the statuses the last pass patched (the watch queues the pool again once they are written)
        self.patched = 0
        #: how long the last pass took (``PLAN_S_PER_REVISION``, ``PATCH_S``)
        self.pass_seconds = 0.0
        #: what the last pass planned on (for tests)
        self.last_inputs: PoolInputs | None = None
        #: passes run, by how the plan was come by (``PlanOutcome.kind``)
        self.plans: Counter[str] = Counter()

    def record(self, at: float, served_name: str) -> None:
        """The picker routed a request for ``served_name`` at ``at`` (simulator seconds)."""
        self._clock = at
        self._stats.record_request(served_name)

    def _report(self, pod: str, rows: tuple[Row, ...], now: float) -> ResidencyReport:
        known = self._reports.get(pod)
        if known is not None and known[0] == rows:
            return known[1].model_copy(update={"heartbeat_at": EPOCH + now})
        version = known[2] + 1 if known is not None else 0
        report = ResidencyReport(
            pool=POOL, pod=pod, address=f"{pod}:8000", runtime="vllm" if self._vllm else "engine",
            demotes_to_disk=not self._vllm, loads_activate=self._vllm, base_model_digest=BASE_DIGEST,
            max_lora_rank=SIM_RANK, heartbeat_at=EPOCH + now, adapters=[self._rows(r) for r in rows], load=self._load)
        self._reports[pod] = (rows, report, version)
        return report

    def plan(self, now: float, rows: Callable[[int], tuple[Row, ...]]) -> PoolPlan:
        """One resync at ``now``: the plan the controller holds, its target states written and its statuses written
        back onto the revisions."""
        self._clock = now
        if now - self._published >= RATES_PUBLISH_S:
            self._rates, self._published = self._stats.rates(POOL, "sim"), now
        reports = [self._report(pod, rows(i), now) for i, pod in enumerate(self._pods)]
        self.last_inputs = PoolInputs(
            pool=POOL, now=datetime.fromtimestamp(EPOCH + now, UTC), revisions=list(self.revisions), reports=reports,
            rates=self._rates, previous_targets=dict(self.written), placement=self._placement)
        outcome = self.planner.plan(self.last_inputs, self._token, {pod: self._reports[pod][2] for pod in self._pods})
        self.plans[outcome.kind] += 1
        self.patched = 0
        if not outcome.reused:
            self._write(outcome, now)
        decided = (0 if outcome.reused or outcome.delta else len(self.revisions) if outcome.decided is None
                   else len(outcome.decided))
        self.pass_seconds = PLAN_S_PER_REVISION * decided + PATCH_S * self.patched
        return outcome.plan

    def _write(self, outcome: PlanOutcome, now: float) -> None:
        """What the manager writes: each changed target state, and the statuses the plan decided (a delta decides
        none; a part its adapters'), handed back onto the revisions as the watch does."""
        plan = outcome.plan
        for pod, targets in plan.targets.items():
            written = self.written.get(pod)
            if written is None or _by_tier(written.adapters) != _by_tier(targets):
                generation = written.generation + 1 if written is not None else 1
                self.written[pod] = TargetState(pool=POOL, pod=pod, generation=generation, adapters=targets,
                                                 updated_at=EPOCH + now)
        if outcome.delta:
            return
        keys = outcome.decided if outcome.decided is not None else plan.revisions.keys()
        for key in keys:
            i, decided = self._at.get(key), plan.revisions.get(key)
            if i is not None and decided is not None and decided.status != self.revisions[i].status:
                self.revisions[i] = self.revisions[i].model_copy(update={"status": decided.status})
                self.patched += 1
        if self.patched:
            self._token += 1  # the informer hands the patched objects back: the pool's revisions changed


def _by_tier(targets: list[AdapterTarget]) -> dict[str, Tier]:
    return {t.served_name: t.tier for t in targets}

