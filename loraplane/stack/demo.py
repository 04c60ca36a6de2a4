"""``loraplane up --demo``: adapters, AdapterRevisions applied with kubectl, hot-plus-burst traffic through Envoy, a
canary rollout of one hot adapter, and a summary (warm vs cold TTFT, picker decisions by tier, rollout timeline), also
written as an HTML report with charts (``loraplane.stack.report``).

Every response is checked as it arrives: the served name and digest headers must belong to a revision the route
table named for the requested model around the request, and the serving pod's reported tier for that revision
(read from Redis just before sending) classifies the request as warm (GPU), CPU or cold.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import random
import re
import statistics
import sys
import tarfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from loraplane.api import (
    ADAPTER_DIGEST_HEADER,
    SERVED_ADAPTER_HEADER,
    AdapterRevision,
    ResidencyReport,
    RouteTable,
    keys,
    read_payload_or_none,
    served_name,
)
from loraplane.picker.envoy import UPSTREAM_HEADER
from loraplane.processes import LOOPBACK
from loraplane.stack.report import demo_report
from loraplane.stack.services import POOL, LocalStack

log = logging.getLogger(__name__)

HOT = ("support", "claims")
TAIL = tuple(f"tail-{i}" for i in range(12))
#: on vLLM pods (a host cache of 16, no demotion to disk) the demo keeps its first six tails
VLLM_TAILS = 6
#: the engines' host caches in the demo: their GPU slots' adapters (``max_loras`` 4) plus two, so most tails are kept
#: on disk (registered: the engine reads one back when a request needs it) and the cold row shows real disk loads
DEMO_MAX_CPU_LORAS = 6
#: tail requests in a row that go to one tail adapter before the burst moves on to the next
TAIL_TURN = 4
#: the hot adapter rolled out to a new revision
ROLLED = "claims"
RANK = 8
PROMPT = "Write one word:"
TARGETS = ("q_proj", "v_proj")
GROUP_PATH = "/apis/loraplane.io/v1alpha1/namespaces/default/adapterrevisions"
#: share of requests that may get the runtime's 404 of a just-unloaded revision (a known, documented race)
MAX_UNLOAD_RACES = 0.02
#: what every demo request asks beyond model, prompt and length: greedy, fixed length, the token ids back
GREEDY_BODY = {"temperature": 0, "ignore_eos": True, "return_token_ids": True}
#: the HTML report, in the stack's workdir
REPORT_FILE = "demo-report.html"
#: the traffic phases (``RequestRecord.phase``)
HOT_PHASE, BURST_PHASE, ROLLOUT_PHASE = "hot adapters", "hot + burst of tail", f"{ROLLED}@v2 canary + hot"


@dataclass
class DemoPlan:
    """How much traffic the demo sends (small enough for a few minutes on 2 cores)."""

    hot_requests: int = 150
    burst_requests: int = 180
    #: requests sent after the new revision is Stable, to see it served
    after_rollout_requests: int = 40
    #: the rollout phase stops sending after this many seconds even if the rollout is not done
    rollout_timeout_s: float = 180.0
    #: requests per second at most during the rollout (its length is set by the rollout, not by a count)
    rollout_rate: float = 12.0
    concurrency: int = 4
    max_tokens: int = 4
    seed: int = 7


@dataclass
class RequestRecord:
    """One request through Envoy and what came back."""

    phase: str
    model: str
    status: int
    served: str | None = None
    pod: str | None = None
    #: tier the serving pod reported for the served revision just before the request (gpu, cpu, disk, absent)
    tier_before: str = "absent"
    #: whether some pod reported the served revision at GPU just before the request
    warm_somewhere: bool = False
    ttft_ms: float | None = None
    #: the served revision was in the route table for ``model`` before or after the request
    named: bool = True
    #: the digest header equals the content digest of the served revision's weights
    digest_ok: bool = True
    #: why the request failed (transport error or the non-200 body)
    error: str | None = None
    #: seconds after the demo's first request that this one was sent
    sent_at_s: float = 0.0


@dataclass
class RolloutStep:
    """The new revision entered ``phase`` at ``at_s`` seconds after it was applied, with ``weight`` % of traffic."""

    phase: str
    at_s: float
    weight: int


@dataclass
class LatencySummary:
    """Time to first byte through Envoy, in milliseconds."""

    count: int
    p50_ms: float | None
    p95_ms: float | None
    mean_ms: float | None


@dataclass
class DemoResult:
    """What the demo measured (``loraplane up --demo --json`` prints it)."""

    requests: int
    errors: list[str]
    requests_by_phase: dict[str, int]
    ttft_by_tier: dict[str, LatencySummary]
    decisions: dict[str, int]
    #: requests whose served revision was GPU-resident on some pod, and how many of them that pod served
    warm_available: int
    warm_landed: int
    #: responses from a revision the route table did not name, or with the wrong digest
    wrong_revision: list[dict[str, Any]]
    rollout: list[RolloutStep]
    rollout_final_phase: str
    previous_revision_phase: str
    served_after_rollout: dict[str, int]
    pids: dict[str, int]
    gateway_url: str
    wall_seconds: float
    #: seconds after the demo's first request that the rollout's new revision was applied
    rollout_applied_at_s: float | None = None
    #: the HTML report written for this run
    report: str | None = None
    #: requests the engines served during the traffic by the tier their adapter was in on arrival (L0 slot, L1
    #: host, L2 disk: read from disk first), from their own TTFT histograms (empty on vLLM pods)
    engine_requests_by_tier: dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """The rollout ended Stable, nothing was served from a wrong revision, and failures were at most the rare
        404 of a revision unloaded just after the picker routed to it (docs/controller.md, "Known limits")."""
        unload_races = [e for e in self.errors if is_unload_race(e)]
        return (self.rollout_final_phase == "Stable" and not self.wrong_revision
                and len(unload_races) == len(self.errors) <= MAX_UNLOAD_RACES * self.requests)

    def to_json(self) -> str:
        """The summary as one JSON object."""
        return json.dumps({**asdict(self), "ok": self.ok})


def is_unload_race(error: str) -> bool:
    """A runtime's 404 for a revision it no longer holds (``DemoResult.errors`` entry)."""
    return error.split(" ", 2)[1:2] == ["404"] and "does not exist" in error


@dataclass
class Artifact:
    """An adapter revision written as a tar archive below the sidecars' file root."""

    adapter: str
    revision: str
    uri: str
    digest: str
    content_digest: str

    @property
    def served_name(self) -> str:
        return served_name(self.adapter, self.revision)


def write_artifacts(root: Path, revisions: list[tuple[str, str]], model: str) -> dict[str, Artifact]:
    """Real PEFT adapters (``loraplane engine make-adapters``' writer) archived as tar files: served name -> artifact."""
    from loraplane.engine.make_adapters import model_config, write_adapter

    config = model_config(model)
    artifacts = {}
    for seed, (adapter, revision) in enumerate(revisions):
        directory = root / "adapters" / f"{adapter}-{revision}"
        content_digest = write_adapter(directory, config, RANK, seed=seed, targets=TARGETS, base_model_name=model)
        archive = root / f"{adapter}-{revision}.tar"
        with tarfile.open(archive, "w") as tar:
            tar.add(directory, arcname=directory.name)
        digest = "sha256:" + hashlib.sha256(archive.read_bytes()).hexdigest()
        artifact = Artifact(adapter, revision, archive.as_uri(), digest, content_digest)
        artifacts[artifact.served_name] = artifact
    return artifacts


async def reference_tokens(model_dir: Path, adapters: dict[str, Path], prompt: str,
                           max_tokens: int) -> dict[str, list[int]]:
    """Greedy token ids of ``prompt`` under each adapter (served name -> PEFT directory), from loraplane's reference
    engine run in this process on the same checkpoint.

    vLLM pods send no served-adapter header, so on them the demo tells which revision answered by its tokens.
    """
    from loraplane.engine.app import EngineOptions, build

    built = build(EngineOptions(model=str(model_dir), max_loras=1, max_cpu_loras=len(adapters), max_lora_rank=16,
                                lora_modules=adapters))
    transport = httpx.ASGITransport(app=built.app)
    tokens = {}
    async with built.app.router.lifespan_context(built.app), httpx.AsyncClient(
            transport=transport, base_url="http://engine") as http:
        for name in adapters:
            body = {"model": name, "prompt": prompt, **GREEDY_BODY, "max_tokens": max_tokens}
            response = await http.post("/v1/completions", json=body)
            response.raise_for_status()
            tokens[name] = response.json()["choices"][0]["token_ids"]
    return tokens


def manifest(artifact: Artifact, base_model: str, base_digest: str, warm_policy: str) -> dict[str, Any]:
    """The AdapterRevision of ``artifact`` with short rollout pauses (validated against ``loraplane.api``)."""
    body = {
        "apiVersion": "loraplane.io/v1alpha1",
        "kind": "AdapterRevision",
        "metadata": {"name": f"{artifact.adapter}-{artifact.revision}", "namespace": "default"},
        "spec": {
            "adapter": artifact.adapter, "revision": artifact.revision, "poolRef": {"name": POOL},
            "baseModel": {"name": base_model, "digest": base_digest},
            "artifact": {"uri": artifact.uri, "digest": artifact.digest},
            "lora": {"rank": RANK, "alpha": RANK, "dtype": "float32", "targetModules": list(TARGETS)},
            "tenant": "demo", "warmPolicy": warm_policy,
            "rollout": {
                "canary": {"pods": 1},
                "steps": [{"weight": 20, "pauseSeconds": 4}, {"weight": 50, "pauseSeconds": 4}],
                "analysis": {"minRequests": 3, "maxErrorRateIncrease": 0.05, "maxTtftRatio": 20},
                "healthProbe": {"prompt": "hello", "maxTokens": 2, "ttftBoundMs": 20000, "timeoutSeconds": 60},
                "rollbackWindowSeconds": 5, "evictionDelaySeconds": 5,
            },
        },
    }
    AdapterRevision.model_validate(body)
    return body


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def latency_summary(values: list[float]) -> LatencySummary:
    """Count, median, 95th percentile and mean (None without values)."""
    if not values:
        return LatencySummary(0, None, None, None)
    return LatencySummary(len(values), round(_percentile(values, 0.5), 2), round(_percentile(values, 0.95), 2),
                          round(statistics.fmean(values), 2))


_DECISION_LINE = re.compile(r'^loraplane_picker_decisions_total\{outcome="([^"]+)"\} ([0-9.e+]+)$', re.M)


def parse_decisions(metrics_text: str) -> dict[str, int]:
    """``loraplane_picker_decisions_total`` by outcome from the picker's Prometheus text."""
    return {outcome: int(float(value)) for outcome, value in _DECISION_LINE.findall(metrics_text)}


_TIER_TTFT_LINE = re.compile(r'^loraplane_engine_time_to_first_token_seconds_count\{tier="(L[0-9])"\} ([0-9.e+]+)$',
                             re.M)


def parse_engine_tiers(metrics_text: str) -> dict[str, int]:
    """Requests an engine served by the adapter's tier on arrival (``L0``/``L1``/``L2``; base-model ones left out),
    from its ``loraplane_engine_time_to_first_token_seconds`` histogram."""
    return {tier: int(float(value)) for tier, value in _TIER_TTFT_LINE.findall(metrics_text)}


class Demo:
    """The demo scenario against a started ``LocalStack``."""

    def __init__(self, stack: LocalStack, stop: threading.Event, console: Console, plan: DemoPlan) -> None:
        assert stack.cluster is not None
        self.stack, self.stop, self.console, self.plan = stack, stop, console, plan
        self.cluster = stack.cluster
        self.redis = stack.redis_client()
        self.pod_of_address = {e.address: e.pod for e in stack.engines}
        self.rng = random.Random(plan.seed)
        self.records: list[RequestRecord] = []
        self.artifacts: dict[str, Artifact] = {}
        #: on vLLM pods: served name -> its greedy tokens for the demo's prompt
        self.expected: dict[str, list[int]] = {}
        self.timeline: list[RolloutStep] = []
        #: the demo's clock: time.monotonic() at its first request
        self.clock_zero = time.monotonic()
        self.applied_at_s: float | None = None
        #: the tail adapters, and the burst requests sent to them so far (their turns)
        self.tails = TAIL[:VLLM_TAILS] if stack.options.runtime == "vllm" else TAIL
        self.tail_sent = 0

    # -- the cluster side ---------------------------------------------------------------------------------------
    async def _phases(self, http: httpx.AsyncClient) -> dict[str, str]:
        return {item["metadata"]["name"]: (item.get("status") or {}).get("phase", "")
                for item in (await self._list(http))["items"]}

    async def _list(self, http: httpx.AsyncClient) -> dict[str, Any]:
        response = await http.get(f"{self.cluster.url}{GROUP_PATH}")
        response.raise_for_status()
        listing: dict[str, Any] = response.json()
        return listing

    def _apply(self, manifests: list[dict[str, Any]], name: str) -> str:
        path = self.stack.options.workdir / "manifests" / f"{name}.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump_all(manifests, sort_keys=False))
        return self.cluster.kubectl("apply", "-f", str(path)).stdout

    async def _wait_stable(self, http: httpx.AsyncClient, names: list[str], within: float) -> None:
        deadline = time.monotonic() + within
        with self._progress() as progress:
            task = progress.add_task("revisions becoming Stable", total=len(names), stats="")
            while True:
                phases = await self._phases(http)
                stable = sum(phases.get(n) == "Stable" for n in names)
                progress.update(task, completed=stable)
                failed = {n: phases[n] for n in names if phases.get(n) in ("Failed", "RolledBack")}
                if failed:
                    raise RuntimeError(f"revisions did not become Stable: {failed} (kubectl describe adapterrevision)")
                if stable == len(names):
                    return
                if time.monotonic() > deadline or self.stop.is_set():
                    raise TimeoutError(f"revisions not Stable after {within} s: {phases}")
                await asyncio.sleep(0.3)

    async def _follow_rollout(self, http: httpx.AsyncClient, name: str, since: str, applied_at: float,
                              done: asyncio.Event) -> None:
        """Record every phase the revision passes through, from a watch (polling would miss short phases)."""
        params = {"watch": "true", "fieldSelector": f"metadata.name={name}", "resourceVersion": since}
        last = None
        while not done.is_set():
            async with http.stream("GET", f"{self.cluster.url}{GROUP_PATH}", params=params,
                                   timeout=httpx.Timeout(10, read=None)) as response:
                response.raise_for_status()
                async for line in response.aiter_lines():
                    if not line.strip():
                        continue
                    event = json.loads(line)
                    obj = event.get("object") or {}
                    params["resourceVersion"] = (obj.get("metadata") or {}).get("resourceVersion", params["resourceVersion"])
                    if event.get("type") not in ("ADDED", "MODIFIED"):
                        continue
                    status = obj.get("status") or {}
                    phase = status.get("phase") or "Pending"
                    label = f"Canary({status.get('canaryStep', 0) + 1})" if phase == "Canary" else phase
                    if label != last:
                        self.timeline.append(RolloutStep(label, round(time.monotonic() - applied_at, 2),
                                                         int(status.get("trafficWeight") or 0)))
                        last = label
                    if phase in ("Stable", "Failed", "RolledBack"):
                        done.set()
                        return

    # -- traffic --------------------------------------------------------------------------------------------------
    async def _observe(self, model: str) -> tuple[set[str], dict[tuple[str, str], str]]:
        """Served names the route table names for ``model`` and (pod, served name) -> reported tier."""
        names = [keys.route_table(POOL)] + [keys.residency_report(POOL, e.pod) for e in self.stack.engines]
        raw = await self.redis.mget(names)
        table = read_payload_or_none(RouteTable, raw[0], log)
        entry = table.models.get(model) if table is not None else None
        named = {w.served_name for w in entry.revisions} if entry else set()
        tiers = {}
        for blob in raw[1:]:
            if (report := read_payload_or_none(ResidencyReport, blob, log)) is not None:
                tiers.update({(report.pod, a.served_name): a.tier.value for a in report.adapters})
        return named, tiers

    async def _send(self, http: httpx.AsyncClient, phase: str, model: str) -> RequestRecord:
        named_before, tiers = await self._observe(model)
        body = {"model": model, "prompt": PROMPT, "max_tokens": self.plan.max_tokens, **GREEDY_BODY}
        sent_at_s = round(time.monotonic() - self.clock_zero, 3)
        started = time.perf_counter()
        try:
            response = await http.post(f"{self.stack.gateway_url}/v1/completions", json=body,
                                       headers={"x-session-id": f"user-{self.rng.randrange(10_000)}"})
        except httpx.HTTPError as exc:
            return RequestRecord(phase, model, 0, error=f"{type(exc).__name__}: {exc}", sent_at_s=sent_at_s)
        ttft_ms = (time.perf_counter() - started) * 1000  # the whole head arrived: the first byte was before it
        record = RequestRecord(phase, model, response.status_code, ttft_ms=ttft_ms, sent_at_s=sent_at_s)
        if response.status_code != 200:
            record.error = response.text[:160]
            return record
        record.served = response.headers.get(SERVED_ADAPTER_HEADER)
        if self.expected:  # a vLLM pod: the revision whose greedy tokens these are (the weights, not a header)
            tokens = response.json()["choices"][0].get("token_ids")
            record.served = next((name for name, want in self.expected.items()
                                  if name.startswith(f"{model}@") and want == tokens), None)
        record.pod = self.pod_of_address.get(response.headers.get(UPSTREAM_HEADER, ""))
        record.tier_before = tiers.get((record.pod or "", record.served or ""), "absent")
        record.warm_somewhere = any(t == "gpu" for (_, s), t in tiers.items() if s == record.served)
        named_after, _ = await self._observe(model)
        record.named = record.served in named_before | named_after
        artifact = self.artifacts.get(record.served or "")
        record.digest_ok = artifact is not None and (
            bool(self.expected) or response.headers.get(ADAPTER_DIGEST_HEADER) == artifact.content_digest)
        return record

    async def _drive(self, http: httpx.AsyncClient, phase: str, total: int | None, choose: Callable[[], str],
                     until: asyncio.Event | None = None, after: int = 0, within: float = float("inf"),
                     rate: float | None = None) -> None:
        """Send ``total`` requests, or with ``until`` until it is set (at most ``within`` seconds) and then ``after``
        more, at most ``rate`` per second, showing a live progress bar."""
        sent = 0
        extra_left = after
        started = time.monotonic()

        def next_request() -> int | None:
            """The index of the next request to send, or None when the phase is over."""
            nonlocal sent, extra_left
            if self.stop.is_set() or (total is not None and sent >= total) or time.monotonic() > started + within:
                return None
            if until is not None and until.is_set():
                if extra_left <= 0:
                    return None
                extra_left -= 1
            sent += 1
            return sent - 1

        with self._progress() as progress:
            task = progress.add_task(phase, total=total, stats="")

            async def worker() -> None:
                while (index := next_request()) is not None:
                    if rate is not None:
                        await asyncio.sleep(max(0.0, started + index / rate - time.monotonic()))
                    record = await self._send(http, phase, choose())
                    self.records.append(record)
                    mine = [r for r in self.records if r.phase == phase]
                    warm = sum(r.tier_before == "gpu" for r in mine)
                    errors = sum(r.status != 200 for r in mine)
                    progress.update(task, advance=1, stats=f"warm {warm} other {len(mine) - warm - errors} "
                                                           f"errors {errors}")

            await asyncio.gather(*(worker() for _ in range(self.plan.concurrency)))

    def _progress(self) -> Progress:
        return Progress(TextColumn("{task.description:<26}"), BarColumn(bar_width=16), MofNCompleteColumn(),
                        TimeElapsedColumn(), TextColumn("{task.fields[stats]}"), console=self.console)

    def _hot(self) -> str:
        return self.rng.choice(HOT)

    def _hot_or_burst(self) -> str:
        """Half hot, half the tail adapters in turns (``TAIL_TURN`` requests each), so a turn starts on disk."""
        if self.rng.random() < 0.5:
            return self.rng.choice(HOT)
        self.tail_sent += 1
        return self.tails[(self.tail_sent - 1) // TAIL_TURN % len(self.tails)]

    async def _engine_tiers(self, http: httpx.AsyncClient) -> Counter[str]:
        """Requests served so far by the adapter's tier on arrival, summed over the engines."""
        total: Counter[str] = Counter()
        if self.expected:  # vLLM pods: no per-tier histogram
            return total
        for engine in self.stack.engines:
            response = await http.get(f"http://{engine.address}/metrics")
            response.raise_for_status()
            total.update(parse_engine_tiers(response.text))
        return total

    async def _decisions(self, http: httpx.AsyncClient) -> dict[str, int]:
        response = await http.get(f"http://{LOOPBACK}:{self.stack.picker_metrics_port}/metrics")
        response.raise_for_status()
        return parse_decisions(response.text)

    # -- the scenario ---------------------------------------------------------------------------------------------
    async def run(self) -> DemoResult:
        """Run the whole scenario and summarise it."""
        started = time.monotonic()
        first = [(a, "v1") for a in (*HOT, *self.tails)]
        self.console.print(f"[bold]writing {len(first) + 1} PEFT adapters[/] (tiny model, rank {RANK}) ...")
        self.artifacts = await asyncio.to_thread(write_artifacts, self.stack.artifacts, [*first, (ROLLED, "v2")],
                                                 self.stack.options.model)
        async with httpx.AsyncClient(timeout=60) as http:
            base_model = self.stack.options.model
            if self.stack.model_dir is not None:  # vLLM pods: the checkpoint's digest, revisions told by their tokens
                base_digest = str(self.stack.model_digest)
                adapters = {name: self.stack.artifacts / "adapters" / f"{a.adapter}-{a.revision}"
                            for name, a in self.artifacts.items()}
                self.expected = await reference_tokens(self.stack.model_dir, adapters, PROMPT, self.plan.max_tokens)
                if self.expected[served_name(ROLLED, "v1")] == self.expected[served_name(ROLLED, "v2")]:
                    raise RuntimeError(f"{ROLLED}'s two revisions give the same tokens: they cannot be told apart")
            else:
                engine = self.stack.engines[0]
                base_digest = (await http.get(f"http://{engine.address}/admin/adapters",
                                              headers=self.stack.admin_headers(engine.pod))).json()["base_model_digest"]
            manifests = [manifest(self.artifacts[served_name(a, r)], base_model, base_digest,
                                  "gpu-preferred" if a in HOT else "on-demand") for a, r in first]
            self.console.print(f"[bold]kubectl apply[/] {len(manifests)} AdapterRevisions:")
            self.console.print(self._apply(manifests, "v1").rstrip())
            await self._wait_stable(http, [m["metadata"]["name"] for m in manifests], within=240)
            decisions_before = await self._decisions(http)
            tiers_before = await self._engine_tiers(http)

            self.clock_zero = time.monotonic()
            await self._drive(http, HOT_PHASE, self.plan.hot_requests, self._hot)
            await self._drive(http, BURST_PHASE, self.plan.burst_requests, self._hot_or_burst)

            new = manifest(self.artifacts[served_name(ROLLED, "v2")], base_model, base_digest, "gpu-preferred")
            self.console.print(f"[bold]canary rollout[/]: kubectl apply {new['metadata']['name']}")
            since = (await self._list(http))["metadata"]["resourceVersion"]
            self.console.print(self._apply([new], "v2").rstrip())
            applied_at = time.monotonic()
            self.applied_at_s = round(applied_at - self.clock_zero, 3)
            done = asyncio.Event()
            follower = asyncio.create_task(self._follow_rollout(http, new["metadata"]["name"], since, applied_at,
                                                                done))
            await self._drive(http, ROLLOUT_PHASE, None, self._hot, until=done,
                              after=self.plan.after_rollout_requests, within=self.plan.rollout_timeout_s,
                              rate=self.plan.rollout_rate)
            done.set()
            await follower
            decisions_after = await self._decisions(http)
            engine_tiers = await self._engine_tiers(http)
            engine_tiers.subtract(tiers_before)
            phases = await self._phases(http)
        await self.redis.aclose()
        result = self._summarise(started, decisions_before, decisions_after, phases)
        result.engine_requests_by_tier = {tier: n for tier, n in sorted(engine_tiers.items()) if n}
        return result

    def _summarise(self, started: float, before: dict[str, int], after: dict[str, int],
                   phases: dict[str, str]) -> DemoResult:
        ok = [r for r in self.records if r.status == 200]
        by_tier: dict[str, list[float]] = {"gpu": [], "cpu": [], "cold": []}
        for r in ok:
            if r.ttft_ms is not None:
                by_tier[r.tier_before if r.tier_before in ("gpu", "cpu") else "cold"].append(r.ttft_ms)
        warm_available = [r for r in ok if r.warm_somewhere]
        wrong = [asdict(r) for r in ok if not r.named or not r.digest_ok]
        last_phase = self.timeline[-1].phase if self.timeline else "Pending"
        final_stage = [r for r in self.records if r.phase == ROLLOUT_PHASE][-self.plan.after_rollout_requests:]
        return DemoResult(
            requests=len(self.records),
            errors=[f"{r.model}: {r.status} {r.error}" for r in self.records if r.status != 200],
            requests_by_phase=dict(Counter(r.phase for r in self.records)),
            ttft_by_tier={tier: latency_summary(values) for tier, values in by_tier.items()},
            decisions={k: after.get(k, 0) - before.get(k, 0) for k in after if after.get(k, 0) - before.get(k, 0)},
            warm_available=len(warm_available),
            warm_landed=sum(r.tier_before == "gpu" for r in warm_available),
            wrong_revision=wrong,
            rollout=self.timeline,
            rollout_final_phase=last_phase,
            previous_revision_phase=phases.get(f"{ROLLED}-v1", ""),
            served_after_rollout=dict(Counter(r.served or "" for r in final_stage if r.status == 200 and r.model == ROLLED)),
            pids=self.stack.pids(),
            gateway_url=self.stack.gateway_url,
            wall_seconds=round(time.monotonic() - started, 1),
            rollout_applied_at_s=self.applied_at_s,
        )


def render(result: DemoResult, console: Console) -> None:
    """The final tables: TTFT by tier, picker decisions, rollout timeline, checks."""
    ttft = Table(title="time to first byte through Envoy, ms")
    for column in ("serving pod held it in", "requests", "p50", "p95", "mean"):
        ttft.add_column(column, justify="right")
    labels = {"gpu": "GPU slot (warm)", "cpu": "host cache", "cold": "disk / nowhere (cold)"}
    for tier, summary in result.ttft_by_tier.items():
        ttft.add_row(labels[tier], str(summary.count), *(f"{v:.1f}" if v is not None else "-" for v in
                                                          (summary.p50_ms, summary.p95_ms, summary.mean_ms)))
    decisions = Table(title="picker decisions by tier")
    decisions.add_column("outcome")
    decisions.add_column("decisions", justify="right")
    for outcome, count in sorted(result.decisions.items(), key=lambda kv: -kv[1]):
        decisions.add_row(outcome, str(count))
    timeline = Table(title=f"rollout of {ROLLED}@v2")
    for column in ("phase", "entered at s", "weight %"):
        timeline.add_column(column, justify="right")
    for step in result.rollout:
        timeline.add_row(step.phase, f"{step.at_s:.1f}", str(step.weight))
    for table in (ttft, decisions, timeline):
        console.print(table)
    landed = f"{result.warm_landed}/{result.warm_available}"
    console.print(f"requests: {result.requests} ({', '.join(f'{k}: {v}' for k, v in result.requests_by_phase.items())}), "
                  f"errors: {len(result.errors)}; warm revisions served by a warm pod: {landed}; "
                  f"wrong-revision responses: {len(result.wrong_revision)}; {ROLLED}-v1 is now "
                  f"{result.previous_revision_phase}; served after the rollout: {result.served_after_rollout}; "
                  f"engine requests by adapter tier on arrival: {result.engine_requests_by_tier}; "
                  f"{result.wall_seconds} s")
    console.print("[bold green]demo ok[/]" if result.ok else "[bold red]demo found problems[/] (see above)")


def run_demo(stack: LocalStack, stop: threading.Event, as_json: bool = False, plan: DemoPlan | None = None) -> int:
    """Run the demo on a started stack; 0 when the rollout ended Stable with every response from a named revision."""
    console = Console(stderr=as_json)
    demo = Demo(stack, stop, console, plan or DemoPlan())
    result = asyncio.run(demo.run())
    if stop.is_set():
        console.print("interrupted")
        return 130
    render(result, console)
    report = stack.options.workdir / REPORT_FILE
    result.report = str(report)
    report.write_text(demo_report(result, demo.records, f"{ROLLED}@v2"))
    console.print(f"[bold]report[/]: {report}", soft_wrap=True)
    if as_json:
        sys.stdout.write(result.to_json() + "\n")
        sys.stdout.flush()
    return 0 if result.ok else 1
