"""Planning in proportion to what changed (``IncrementalPlanner``) and reads that parse only what changed.

A pool at rest keeps its plan while nothing planning reads moves: a heartbeat, a load figure or a rate drift
inside the hysteresis plans nothing; a residency change, a rate beyond the hysteresis, new revisions, a rollout
in progress and the full-plan period each plan the pool again.
"""

from __future__ import annotations

import random
import time
from dataclasses import replace
from datetime import UTC, datetime

import redis.asyncio as aioredis

from e2e.fixtures.processes import RedisServer
from loraplane.api import AdapterRevision, Phase, RequestRates, ResidencyReport, Tier, keys
from loraplane.bench import controller as bench
from loraplane.controller.incremental import IncrementalPlanner, PlanOutcome, rates_moved, windows_of
from loraplane.controller.placement import TenantBudget
from loraplane.controller.pool import PoolInputs, PoolPlan, plan_pool
from loraplane.controller.store import RedisStore

NOW = datetime(2026, 1, 1, tzinfo=UTC)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _pool(n: int = 40, pods: int = 6) -> tuple[list[AdapterRevision], dict[str, float], list[ResidencyReport]]:
    rng = random.Random(3)
    revs = bench._revisions(n, rng, NOW)
    return revs, bench._rates(revs, rng, 50.0), bench._reports(pods, None, 4, 8)


def _inputs(revs: list[AdapterRevision], rates: dict[str, float], reports: list[ResidencyReport]) -> PoolInputs:
    return PoolInputs(pool=bench.POOL, now=NOW, revisions=revs, reports=reports, rates=bench._request_rates(rates))


def _settled() -> tuple[IncrementalPlanner, Clock, list[AdapterRevision], dict[str, float], list[ResidencyReport],
                        PoolPlan]:
    revs, rates, reports = _pool()
    clock = Clock()
    planner = IncrementalPlanner(hysteresis=0.25, full_plan_seconds=60, clock=clock)
    first = planner.plan(_inputs(revs, rates, reports), "t1", {})
    assert not first.reused
    return planner, clock, revs, rates, reports, first.plan


def test_a_pool_at_rest_keeps_its_plan_through_rate_drift_within_the_hysteresis() -> None:
    planner, _, revs, rates, reports, plan = _settled()
    drifted = {n: r * (1.1 if i % 2 else 0.9) for i, (n, r) in enumerate(rates.items())}
    again = planner.plan(_inputs(revs, drifted, reports), "t1", {})
    assert again.reused and again.plan is plan
    assert (planner.planned, planner.reused) == (1, 1)


def test_a_rate_beyond_the_hysteresis_plans_again() -> None:
    planner, _, revs, rates, reports, _ = _settled()
    hot = dict(rates)
    name = revs[7].served_name
    hot[name] *= 3
    again = planner.plan(_inputs(revs, hot, reports), "t1", {})
    assert not again.reused and "1 revisions" in again.why


def _sweeping(disk_revisions: int | None) -> tuple[IncrementalPlanner, list[AdapterRevision], dict[str, float],
                                                  list[ResidencyReport]]:
    """A pool of 10 busy revisions and 30 trickles (below ``gpu_min_rate``), each pod's disk holding
    ``disk_revisions`` revisions (None: unbounded), planned whole once."""
    revs, rates, reports = _pool()
    rates = {n: r if i < 10 else 0.05 for i, (n, r) in enumerate(rates.items())}
    if disk_revisions is not None:
        size = plan_pool(_inputs(revs, rates, reports)).demands[0].bytes
        reports = [r.model_copy(update={"load": r.load.model_copy(update={"max_disk_bytes": disk_revisions * size})})
                   for r in reports]
    planner = IncrementalPlanner(hysteresis=0.25, full_plan_seconds=60, clock=Clock())
    assert not planner.plan(_inputs(revs, rates, reports), "t1", {}).reused
    return planner, revs, rates, reports


def test_floor_revisions_placed_again_alone_since_the_whole_plan_stay_few_where_it_deferred_their_holders() -> None:
    """Where the disks cannot hold three holders of every revision (12 revisions a pod, 6 pods, 40 revisions), the
    floors' further holders move between revisions in whole plans only. A sweep moves a few trickles' rates at every
    pass: each few is placed again alone while the floors placed again alone since the last whole plan stay
    ``few_enough`` (8 of 40), then the pool is planned whole, so the holders move a few passes' worth at a time, not
    a full-plan period's worth at once (each a registration stalling its pod's batch). With room for every holder
    nothing waits for a whole plan."""
    for disk, kinds in ((12, [True, True, True, False, True]), (None, [True] * 5)):
        planner, revs, rates, reports = _sweeping(disk)
        assert planner._memo[bench.POOL].plan.placement.deferred is (disk is not None)
        outcomes = []
        for first in range(10, 25, 3):
            for rev in revs[first:first + 3]:
                rates[rev.served_name] = 0.15
            outcomes.append(planner.plan(_inputs(revs, rates, reports), "t1", {}))
        assert [o.delta for o in outcomes] == kinds
        assert not any(o.reused for o in outcomes)


def test_the_full_plan_period_plans_a_pool_at_rest_again() -> None:
    planner, clock, revs, rates, reports, _ = _settled()
    clock.now = 59.0
    assert planner.plan(_inputs(revs, rates, reports), "t1", {}).reused
    clock.now = 60.0
    outcome = planner.plan(_inputs(revs, rates, reports), "t1", {})
    assert not outcome.reused and outcome.why == "full plan period"


def test_changed_revisions_or_reports_plan_again() -> None:
    planner, _, revs, rates, reports, _ = _settled()
    assert planner.plan(_inputs(revs, rates, reports), "t2", {}).reused  # another token, the same objects
    pinned = revs[3].model_copy(update={"spec": revs[3].spec.model_copy(update={"pinned": True})})
    revs = [*revs[:3], pinned, *revs[4:]]
    assert not planner.plan(_inputs(revs, rates, reports), "t3", {}).reused  # a changed spec
    assert planner.plan(_inputs(revs, rates, reports), "t3", {}).reused
    # pod-01's report changed, not in what planning reads of it
    assert planner.plan(_inputs(revs, rates, reports), "t3", {"pod-01": 7}).reused
    assert not planner.plan(_inputs(revs, rates, reports[1:]), "t3", {"pod-01": 7}).reused  # a pod went away


def test_a_rollout_in_progress_is_planned_alone_every_time() -> None:
    """An adapter rolling out is not at rest: every pass plans it again, alone (``plan_part``); the other adapters'
    statuses are not decided again (the caller writes back only ``decided``)."""
    revs, rates, reports = _pool()
    canary = revs[0].model_copy(update={"status": revs[0].status.model_copy(update={"phase": Phase.PENDING})})
    planner = IncrementalPlanner(full_plan_seconds=60, clock=Clock())
    inputs = _inputs([canary, *revs[1:]], rates, reports)
    first = planner.plan(inputs, "t", {})
    assert not first.reused and first.decided is None
    for _ in range(2):
        again = planner.plan(inputs, "t", {})
        assert not again.reused and again.decided == {("default", canary.metadata.name)}
        assert again.why == "1 adapters planned again alone" and planner.parts >= 1
        assert again.plan.revisions[("default", revs[1].metadata.name)] is first.plan.revisions[
            ("default", revs[1].metadata.name)]


def _pods_holding(plan: PoolPlan, name: str) -> set[str]:
    return {pod for pod, held in plan.placement.pods.items() if name in held}


def test_a_new_revision_is_planned_and_placed_alone() -> None:
    """A revision added to a pool at rest: planned alone -- routed, placed on what the others leave -- and only the
    pods it lands on get new target lists; every other pod keeps its list object, every other revision its place."""
    planner, _, revs, rates, reports, plan = _settled()
    new = bench._revisions(1, random.Random(9), NOW, first=len(revs))[0]
    rates = {**rates, new.served_name: 5.0}
    outcome = planner.plan(_inputs([*revs, new], rates, reports), "t2", {})
    assert outcome.decided == {("default", new.metadata.name)} and planner.planned == 1
    after = outcome.plan
    assert new.spec.adapter in after.routes and after.routes.keys() - {new.spec.adapter} == plan.routes.keys()
    holders = _pods_holding(after, new.served_name)
    assert holders
    for pod, targets in after.targets.items():
        if pod not in holders:
            assert targets is plan.targets[pod]
        assert {n: t for n, t in after.placement.pods[pod].items() if n != new.served_name} == \
            plan.placement.pods[pod]
        assert sum(t is Tier.GPU for t in after.placement.pods[pod].values()) <= 4  # within the pod's slots
    # what the pool would be planned whole routes the same and decides the same statuses
    whole = plan_pool(_inputs([*revs, new], rates, reports))
    assert after.routes == whole.routes
    # as many holders as the whole plan gives it: its share of the pool's traffic, not of the part's (all of it)
    assert len(holders) == len(_pods_holding(whole, new.served_name)) < len(after.targets)
    assert {k: rp.status.phase for k, rp in after.revisions.items()} == {
        k: rp.status.phase for k, rp in whole.revisions.items()}
    # at rest again: the same inputs reuse it
    assert planner.plan(_inputs([*revs, new], rates, reports), "t2", {}).reused
    # and it is one of the pool's revisions from now on: its rates moving is a placement delta of its own
    spiked = planner.plan(_inputs([*revs, new], {**rates, new.served_name: 40.0}, reports), "t2", {})
    assert spiked.delta and "1 revisions" in spiked.why
    assert len(spiked.plan.placement.replicas(Tier.GPU)[new.served_name]) > len(
        after.placement.replicas(Tier.GPU)[new.served_name])  # more GPU replicas for its rate


def test_a_deleted_revision_leaves_routes_and_targets_alone() -> None:
    planner, _, revs, rates, reports, plan = _settled()
    gone = revs[3]
    assert _pods_holding(plan, gone.served_name)
    outcome = planner.plan(_inputs([r for r in revs if r is not gone], rates, reports), "t2", {})
    assert outcome.decided == set() and planner.planned == 1  # no object of that adapter is left to decide
    assert gone.spec.adapter not in outcome.plan.routes and not _pods_holding(outcome.plan, gone.served_name)
    assert all(gone.served_name not in {t.served_name for t in targets} for targets in outcome.plan.targets.values())


def test_a_report_change_plans_the_adapters_it_touches_and_a_capacity_change_the_pool() -> None:
    planner, _, revs, rates, reports, plan = _settled()
    reports = bench._reports(len(reports), plan, 4, 8)
    # the sidecars carrying the plan out is no news to planning
    assert planner.plan(_inputs(revs, rates, reports), "t1", {r.pod: 1 for r in reports}).reused
    pod = reports[0]
    row = pod.adapters[0]
    failed = row.model_copy(update={"tier": Tier.ABSENT, "error": "digest mismatch", "error_reason": "DigestMismatch"})
    changed = [pod.model_copy(update={"adapters": [failed, *pod.adapters[1:]]}), *reports[1:]]
    versions = {r.pod: 1 for r in reports} | {pod.pod: 2}
    outcome = planner.plan(_inputs(revs, rates, changed), "t1", versions)
    touched = next(r for r in revs if r.served_name == row.served_name)
    assert outcome.decided == {("default", touched.metadata.name)}
    bigger = [changed[0].model_copy(update={"load": changed[0].load.model_copy(update={"max_gpu_slots": 6})}),
              *changed[1:]]
    whole = planner.plan(_inputs(revs, rates, bigger), "t1", versions | {pod.pod: 3})
    assert whole.decided is None and planner.planned == 2


def _written_back(revs: list[AdapterRevision], plan: PoolPlan) -> list[AdapterRevision]:
    """The revisions as the watch hands them back after the controller wrote ``plan``'s statuses."""
    return [r.model_copy(update={"status": plan.revisions[("default", r.metadata.name)].status}) for r in revs]


def test_the_controllers_own_status_writes_handed_back_plan_nothing_again() -> None:
    """Each status the plan decided comes back from the watch as a new object: nothing planning reads moved, so the
    plan is kept (in the twin each write was answered by another plan, part or whole, which wrote again)."""
    planner, _, revs, rates, reports, plan = _settled()
    echoed = _written_back(revs, plan)
    assert any(e.status != r.status for e, r in zip(echoed, revs, strict=True))
    outcome = planner.plan(_inputs(echoed, rates, reports), "t2", {})
    assert outcome.reused and outcome.plan is plan and planner.planned == 1
    # a status written by someone else is not the plan's: the adapter is planned again
    other = echoed[5].model_copy(update={"status": echoed[5].status.model_copy(update={"traffic_weight": 50})})
    outcome = planner.plan(_inputs([*echoed[:5], other, *echoed[6:]], rates, reports), "t3", {})
    assert not outcome.reused and outcome.decided == {("default", other.metadata.name)}


def _dropped_row(reports: list[ResidencyReport]) -> tuple[list[ResidencyReport], str]:
    """``reports`` with the first GPU row of a pod gone (its sidecar unregistered it), and its name."""
    pod = next(r for r in reports if any(a.tier is Tier.GPU for a in r.adapters))
    gone = next(a for a in pod.adapters if a.tier is Tier.GPU)
    dropped = pod.model_copy(update={"adapters": [a for a in pod.adapters if a is not gone]})
    return [dropped if r is pod else r for r in reports], gone.served_name


def _with_row(reports: list[ResidencyReport], pod: str, name: str, tier: Tier) -> list[ResidencyReport]:
    """``reports`` with ``pod``'s row of ``name`` at ``tier`` (added as its other rows are, where it has none)."""
    out = []
    for r in reports:
        if r.pod == pod:
            rows = [a for a in r.adapters if a.served_name != name]
            like = next(a for rep in reports for a in rep.adapters if a.served_name == name)
            r = r.model_copy(update={"adapters": [*rows, like.model_copy(update={"tier": tier})]})
        out.append(r)
    return out


def test_a_copy_moving_in_and_out_of_host_memory_plans_again_only_where_it_moves_a_hold() -> None:
    """vLLM's LRU moves copies between GPU slots, host memory and disk with every request. Planning reads whether a
    pod serves a revision only for make-before-break (``keep_until_replaced``), so such a move plans nothing unless
    it moves a hold: a copy leaving the last of its planned holders while a pod the plan does not place it on serves
    it plans it again (held there), and its planned holder serving it again plans it again (the hold ends)."""
    planner, _, revs, rates, _, plan = _settled()
    vllm = [r.model_copy(update={"loads_activate": True, "demotes_to_disk": False,
                                 "adapters": [a.model_copy(update={"registered": True}) for a in r.adapters]})
            for r in bench._reports(6, plan, 4, 8)]
    version = iter(range(1, 100))

    def plan_on(reports: list[ResidencyReport]) -> PlanOutcome:
        v = next(version)
        return planner.plan(_inputs(revs, rates, reports), "t1", {r.pod: v for r in reports})

    tiers = plan.placement.tiers_of
    loading = [r.model_copy(update={"adapters": [
        a.model_copy(update={"tier": Tier.ABSENT, "registered": False}) if tiers(a.served_name).get(r.pod) is Tier.GPU
        else a for a in r.adapters]}) for r in vllm]
    assert plan_on(loading).reused  # its GPU targets on their way (reported absent first)
    assert plan_on(vllm).reused  # the plan carried out
    name = next(n for n in (r.served_name for r in revs)
                if sum(t in (Tier.GPU, Tier.CPU) for t in tiers(n).values()) >= 2)
    holders = sorted(pod for pod, t in tiers(name).items() if t in (Tier.GPU, Tier.CPU))
    other = next(r.pod for r in vllm if r.pod not in tiers(name))
    reports = _with_row(vllm, holders[0], name, Tier.CPU if tiers(name)[holders[0]] is Tier.GPU else Tier.GPU)
    assert plan_on(reports).reused  # between GPU and host memory
    reports = _with_row(reports, other, name, Tier.CPU)
    stray = plan_on(reports)  # a pod the plan does not place it on serves it: news
    assert not stray.reused and not stray.plan.placement.holds
    reports = _with_row(reports, holders[0], name, Tier.DISK)
    assert plan_on(reports).reused  # out of host memory (still registered): its other holders serve it
    for pod in holders[1:]:
        reports = _with_row(reports, pod, name, Tier.DISK)
    held = plan_on(reports)  # no planned holder serves it; the stray pod does: held there
    assert not held.reused and held.decided is not None
    assert {key[1] for key in held.decided} == {r.metadata.name for r in revs if r.served_name == name}
    assert (name, other) in held.plan.placement.holds
    reports = _with_row(reports, holders[0], name, Tier.CPU)
    released = plan_on(reports)
    assert not released.reused and not any(n == name for n, _ in released.plan.placement.holds)


def test_rates_beyond_the_hysteresis_with_a_report_change_are_planned_again_with_the_part() -> None:
    """A report change and a rate beyond the hysteresis in one pass: the adapters of both are planned again alone,
    not the pool whole."""
    planner, _, revs, rates, reports, plan = _settled()
    reports = bench._reports(len(reports), plan, 4, 8)
    assert planner.plan(_inputs(revs, rates, reports), "t1", {r.pod: 1 for r in reports}).reused
    changed, touched = _dropped_row(reports)
    hot = dict(rates)
    spiked = revs[9].served_name if revs[9].served_name != touched else revs[10].served_name
    hot[spiked] *= 3
    whole = planner.planned
    outcome = planner.plan(_inputs(revs, hot, changed), "t1", {r.pod: 2 for r in reports})
    assert not outcome.reused and outcome.decided is not None and planner.planned == whole
    assert {key[1] for key in outcome.decided} == {r.metadata.name for r in revs if r.served_name in (touched, spiked)}
    assert planner.plan(_inputs(revs, hot, changed), "t1", {r.pod: 2 for r in reports}).reused  # rebased


def test_rates_moved_counts_revisions_appearing_and_going_quiet() -> None:
    def rates(**by_name: float) -> RequestRates:
        return RequestRates(pool="p", published_at=0.0, windows={"5m": by_name, "1h": by_name, "24h": by_name})

    names = {"a", "b", "c", "t"}
    planned = rates(a=1.0, b=2.0, t=0.001, other=5.0)
    assert rates_moved(windows_of(planned), rates(a=1.2, b=2.0, t=0.001, other=50.0), names, 0.25) == []  # not the pool's
    assert rates_moved(windows_of(planned), rates(a=1.5, c=1.0, t=0.001), names, 0.25) == ["a", "b", "c"]
    assert rates_moved(windows_of(planned), rates(a=1.0, b=2.0, t=0.005), names, 0.25) == []  # below the floor


async def test_reads_parse_a_report_again_only_when_planning_would_see_a_change(redis_srv: RedisServer) -> None:
    client = aioredis.Redis.from_url(redis_srv.url)
    now = [1000.0]
    store = RedisStore(client, lambda: now[0])
    report = bench._reports(1, None, 4, 8)[0]
    await client.sadd(keys.residency_index(bench.POOL), report.pod)

    async def publish(r: ResidencyReport) -> tuple[ResidencyReport, int]:
        await client.set(keys.residency_report(bench.POOL, r.pod), r.to_json())
        readings = await store.read(bench.POOL)
        return readings.reports[0], readings.report_versions[r.pod]

    _, version = await publish(report)
    now[0] += 5
    beat, beat_version = await publish(report.model_copy(update={"heartbeat_at": report.heartbeat_at + 5}))
    assert beat_version == version and beat.heartbeat_at == now[0]  # received now, on the controller's clock
    busy = report.model_copy(update={"load": report.load.model_copy(update={"running": 9, "queue_depth": 3})})
    parsed, busy_version = await publish(busy)
    assert busy_version == version and parsed.load.running == 9  # parsed again, but planning reads no load figure
    moved = report.model_copy(update={"ready": False})
    _, moved_version = await publish(moved)
    assert moved_version == version + 1
    await client.aclose()


def test_a_few_revisions_beyond_the_hysteresis_are_placed_again_alone() -> None:
    """One adapter's traffic grows tenfold: its revision alone is placed again (more GPU replicas, on what the other
    revisions leave of each pod); every other pod's targets are the same objects, routes and statuses untouched."""
    planner, _, revs, rates, reports, plan = _settled()
    hot_rev = revs[len(revs) // 2]
    hot = dict(rates)
    hot[hot_rev.served_name] = 40.0  # 10 GPU replicas' worth at 4 requests/s each, capped by the pods
    outcome = planner.plan(_inputs(revs, hot, reports), "t1", {})
    assert outcome.delta and not outcome.reused and planner.deltas == 1 and planner.planned == 1
    after = outcome.plan
    gpu = {pod for pod, held in after.placement.pods.items() if held.get(hot_rev.served_name) is Tier.GPU}
    before = {pod for pod, held in plan.placement.pods.items() if held.get(hot_rev.served_name) is Tier.GPU}
    assert len(gpu) > len(before) and len(gpu) >= 4
    changed = {pod for pod in after.targets if after.targets[pod] is not plan.targets[pod]}
    assert changed and changed <= gpu | before | {p for p, h in plan.placement.pods.items() if hot_rev.served_name in h}
    for pod in set(after.targets) - changed:
        assert after.targets[pod] is plan.targets[pod]
    for pod, held in after.placement.pods.items():  # the other revisions kept their places
        assert {n: t for n, t in held.items() if n != hot_rev.served_name} == {
            n: t for n, t in plan.placement.pods[pod].items() if n != hot_rev.served_name}
        assert sum(t is Tier.GPU for t in held.values()) <= 4  # within the pod's slots
    assert after.routes is plan.routes and after.revisions is plan.revisions and after.events == []
    # the new rates are its baseline now: the same rates again plan nothing
    assert planner.plan(_inputs(revs, hot, reports), "t1", {}).reused


def test_placement_across_the_pool_plans_whole() -> None:
    """Tenant budgets span every revision: a rate beyond the hysteresis plans the pool whole."""
    revs, rates, reports = _pool()
    planner = IncrementalPlanner(clock=Clock())
    budgets = {"tenant-3": TenantBudget(gpu_bytes=1 << 40)}
    inputs = PoolInputs(pool=bench.POOL, now=NOW, revisions=revs, reports=reports, rates=bench._request_rates(rates),
                        budgets=budgets)
    assert not planner.plan(inputs, "t", {}).reused
    hot = dict(rates)
    hot[revs[5].served_name] *= 10
    outcome = planner.plan(replace(inputs, rates=bench._request_rates(hot)), "t", {})
    assert not outcome.reused and not outcome.delta and planner.planned == 2


async def test_rates_republished_unchanged_are_not_parsed_again(redis_srv: RedisServer) -> None:
    client = aioredis.Redis.from_url(redis_srv.url)
    store = RedisStore(client, time.time)
    rates = bench._request_rates({"adapter-0001@v1": 2.0}).model_copy(update={"replica": "bench"})
    await client.set(keys.picker_counters(bench.POOL, "bench"), b"{}")
    await client.set(keys.request_rates(bench.POOL, "bench"), rates.to_json())
    first = (await store.read(bench.POOL)).replica_rates[0]
    later = rates.model_copy(update={"published_at": rates.published_at + 10})
    await client.set(keys.request_rates(bench.POOL, "bench"), later.to_json())
    again = (await store.read(bench.POOL)).replica_rates[0]
    assert again.published_at == later.published_at and again.windows is first.windows  # shared, not parsed again
    moved = rates.model_copy(update={"windows": {"5m": {"adapter-0001@v1": 3.0}}})
    await client.set(keys.request_rates(bench.POOL, "bench"), moved.to_json())
    assert (await store.read(bench.POOL)).replica_rates[0].windows == {"5m": {"adapter-0001@v1": 3.0}}
    await client.aclose()


def test_a_part_routes_an_adapter_name_two_namespaces_share_as_the_whole_plan_does() -> None:
    """Routes are keyed by the adapter's name: when one namespace's adapter is planned alone, the entry for that
    name is made from every namespace's adapter of the name, as the whole pool's plan makes it."""
    revs, rates, reports = _pool()
    shared = revs[5]
    spec = shared.spec.model_copy(update={"artifact": shared.spec.artifact.model_copy(
        update={"digest": "sha256:" + "e" * 64})})  # another revision under the name: its route entry differs
    other = shared.model_copy(update={"metadata": shared.metadata.model_copy(update={"namespace": "team-b"}),
                                      "spec": spec})
    planner = IncrementalPlanner(clock=Clock())
    assert planner.plan(_inputs([*revs, other], rates, reports), "t1", {}).decided is None
    changed = shared.model_copy()  # another object: its adapter (default namespace) is planned alone
    now = [*revs[:5], changed, *revs[6:], other]
    outcome = planner.plan(_inputs(now, rates, reports), "t2", {})
    assert outcome.decided == {("default", shared.metadata.name)}
    whole = plan_pool(_inputs(now, rates, reports)).routes
    alone = plan_pool(_inputs(revs, rates, reports)).routes  # the default namespace's entry alone
    assert outcome.plan.routes == whole and whole[shared.spec.adapter] != alone[shared.spec.adapter]


def test_a_part_for_a_report_change_plans_at_the_rates_its_adapters_were_placed_with() -> None:
    """A report row plans its adapter again alone; its rate drifted 24 % since it was placed (within the
    hysteresis): the part places it as it would without the drift, so a drift the hysteresis holds back does not
    come in through the part (16 -> 19.8 requests/s is a third GPU replica in a whole plan)."""
    revs, rates, reports = _pool()
    name = revs[7].served_name
    rates = {**rates, name: 16.0}

    def part(now: dict[str, float]) -> PoolPlan:
        planner = IncrementalPlanner(hysteresis=0.25, full_plan_seconds=60, clock=Clock())
        first = planner.plan(_inputs(revs, rates, reports), "t1", {}).plan
        held = bench._reports(len(reports), first, 4, 8)
        planner.plan(_inputs(revs, rates, held), "t1", {r.pod: 1 for r in held})
        pod = next(r for r in held if any(a.served_name == name and a.tier is Tier.GPU for a in r.adapters))
        rows = [a for a in pod.adapters if a.served_name != name]  # its sidecar unregistered it
        changed = [pod.model_copy(update={"adapters": rows}) if r is pod else r for r in held]
        outcome = planner.plan(_inputs(revs, now, changed), "t1", {r.pod: 1 for r in held} | {pod.pod: 2})
        assert not outcome.reused and outcome.decided is not None and not outcome.delta  # a part
        return outcome.plan

    drifted = {**rates, name: 19.8}
    assert len(plan_pool(_inputs(revs, drifted, reports)).placement.replicas(Tier.GPU)[name]) > len(
        plan_pool(_inputs(revs, rates, reports)).placement.replicas(Tier.GPU)[name])
    assert part(drifted).placement.pods == part(rates).placement.pods


def test_a_part_for_a_report_row_keeps_out_of_the_burst_reserve_as_the_whole_plan_does() -> None:
    """An adapter at rest planned again alone for a report row gets the GPU replicas the whole plan gives it: the
    part's residual keeps each pod's burst reserve free of steady replicas (without it the part took the reserved
    slots: 4 replicas where the whole plan gives 2, taken back at the next whole plan)."""
    revs, rates, reports = _pool()
    name = revs[7].served_name
    rates = {**rates, name: 16.0}
    planner = IncrementalPlanner(hysteresis=0.25, full_plan_seconds=60, clock=Clock())
    first = planner.plan(_inputs(revs, rates, reports), "t1", {}).plan
    held = bench._reports(len(reports), first, 4, 8)
    whole = planner.plan(_inputs(revs, rates, held), "t1", {r.pod: 1 for r in held}).plan
    pod = next(r for r in held if any(a.served_name == name and a.tier is Tier.GPU for a in r.adapters))
    rows = [a for a in pod.adapters if a.served_name != name]  # its sidecar unregistered it
    changed = [pod.model_copy(update={"adapters": rows}) if r is pod else r for r in held]
    outcome = planner.plan(_inputs(revs, rates, changed), "t1", {r.pod: 1 for r in held} | {pod.pod: 2})
    assert outcome.kind == "part"
    gpu = [n for held_ in outcome.plan.placement.pods.values() for n, t in held_.items() if t is Tier.GPU]
    assert len(outcome.plan.placement.replicas(Tier.GPU)[name]) == len(whole.placement.replicas(Tier.GPU)[name])
    assert len(gpu) == sum(t is Tier.GPU for held_ in whole.placement.pods.values() for t in held_.values())
