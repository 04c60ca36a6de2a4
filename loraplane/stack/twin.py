"""``loraplane bench twin``: the whole real control plane on emulated vLLM pods, driven by a trace through Envoy.

The local stack (``loraplane up``) runs with ``--runtime emulated``: every pod is loraplane's vLLM emulator (vLLM's
HTTP API, metrics and adapter semantics, time charged from a profile) with a real sidecar; the API server, Redis,
the picker, Envoy and the controller are the production processes. The benchmark applies one AdapterRevision per
adapter of the trace with the real kubectl, waits until every one is ``Stable``, replays the trace open loop through
Envoy at its timestamps, and reports what ``loraplane sim --json`` reports per policy (computed by the simulator's
own functions), plus the control plane's own figures and each process's CPU and memory.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import math
import os
import sys
import tarfile
import time
from array import array
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import yaml
from prometheus_client.parser import text_string_to_metric_families

from loraplane.api import parse_served_name
from loraplane.emulator.tokens import expected_text
from loraplane.picker.envoy import CLIENT_REQUEST_ID_HEADER
from loraplane.picker.peers import peer_configs
from loraplane.processes import process_usage
from loraplane.sim.cluster import SERVED, SimResult
from loraplane.sim.control import revision_manifest
from loraplane.sim.metrics import (
    DEFAULT_SLO_TTFT_MS,
    every_request_p50_ms,
    hot_ttft_p99_ms,
    percentiles_ms,
    served_ttft,
    slo_figures,
)
from loraplane.sim.policies import CONTROLLER_RESYNC_S
from loraplane.sim.profile import LARGE_GPU
from loraplane.sim.trace import Trace
from loraplane.stack.replay import NO_ANSWER, Outcome, ReplayRequest, replay
from loraplane.stack.services import POOL, LocalStack, StackOptions

#: the AdapterRevisions' API path on the embedded API server
GROUP_PATH = "/apis/loraplane.io/v1alpha1/namespaces/default/adapterrevisions"
#: the twin's adapters: rank 16 on q_proj/v_proj of the tiny model the emulated pods are given (the emulator
#: charges loads by the profile's adapter bytes for rank 16, so the file's own size does not matter)
ADAPTER_RANK = 16
ADAPTER_TARGETS = ("q_proj", "v_proj")
#: the refusal code recorded for a request that got no HTTP answer at all (``Outcome.status == NO_ANSWER``)
NO_ANSWER_STATUS = 502
#: the model the emulated pods are given (its shapes check the adapters' tensors, as vLLM does)
MODEL = "tiny-hd32"
#: the stack's artifacts folder (``LocalStack.artifacts``), relative to its workdir
ARTIFACTS = "artifacts"
LORAPLANE = "loraplane"
#: the policies the twin runs: loraplane and every peer with a packaged picker config
TWIN_POLICIES = (LORAPLANE, *peer_configs())
#: kubectl applies the manifests in files of this many objects
APPLY_CHUNK = 100
#: after every revision is Stable, the replay waits until the pods' registrations (``load_lora_adapter`` calls: the
#: sidecars register each pod's targets one at a time, disk-tier ones last) have stopped for this long: Stable says
#: a revision serves, not that every holder the plan gave it has it yet, and the simulator starts set up
SETTLED_S = 3.0
#: requests a scenario generates for the twin unless told (a few minutes of real time at the scenarios' rates)
DEFAULT_REQUESTS = 3000


@dataclass(frozen=True)
class TwinOptions:
    """The pool the twin runs and how long it may take to onboard the adapters."""

    pods: int = 32
    max_loras: int = 4
    max_cpu_loras: int = 16
    profile: str = LARGE_GPU.name
    slo_ttft_ms: float = DEFAULT_SLO_TTFT_MS
    #: seconds between sidecar heartbeats: reports about a second old, as the simulator's loraplane policy sees
    #: them (the controller plans at its default resync, ``CONTROLLER_RESYNC_S``, as the chart and the simulator do)
    heartbeat: float = 1.0
    stable_timeout_s: float = 1800.0
    #: seconds between a peer's picker scrapes of each pod: llm-d-router's ``--refresh-metrics-interval`` is 0.05,
    #: but on 2 cores a picker scraping 32 pods that often falls behind (docs/picker.md, "Scrape data source");
    #: ``bench fidelity`` gives the simulator's peers the same interval
    scrape_interval: float = 0.25
    #: picker replicas behind the one Envoy (each routes on its own requests in flight plus the others' shared ones)
    pickers: int = 1


@dataclass(frozen=True)
class TwinAdapter:
    """One adapter revision of the trace as the twin serves it."""

    adapter: str
    revision: str
    tenant: str
    priority: int
    uri: str
    digest: str
    content_digest: str

    @property
    def object_name(self) -> str:
        """The AdapterRevision's name."""
        return f"{self.adapter}-{self.revision}"


def write_adapters(trace: Trace, artifacts: Path, model: str) -> list[TwinAdapter]:
    """A real PEFT adapter per revision of ``trace`` (seeded by its index), archived as a tar below ``artifacts``."""
    from loraplane.engine.make_adapters import model_config, write_adapter

    config = model_config(model)
    written = []
    for index, entry in enumerate(trace.adapters):
        adapter, revision = parse_served_name(entry.name)
        directory = artifacts / "adapters" / f"{adapter}-{revision}"
        content_digest = write_adapter(directory, config, ADAPTER_RANK, seed=index, targets=ADAPTER_TARGETS,
                                       base_model_name=model)
        archive = artifacts / f"{adapter}-{revision}.tar"
        with tarfile.open(archive, "w") as tar:
            tar.add(directory, arcname=directory.name)
        tenant = trace.tenants[entry.tenant]
        written.append(TwinAdapter(adapter, revision, tenant.name, tenant.priority, archive.as_uri(),
                                   "sha256:" + hashlib.sha256(archive.read_bytes()).hexdigest(), content_digest))
    return written


def manifest(adapter: TwinAdapter, base_model: str, base_digest: str) -> dict[str, Any]:
    """The AdapterRevision of ``adapter`` (``revision_manifest``: as the simulator's controller plans it)."""
    return revision_manifest(adapter.adapter, adapter.revision, adapter.tenant, adapter.priority, adapter.uri,
                             adapter.digest, pool=POOL, base_model=base_model, base_digest=base_digest,
                             rank=ADAPTER_RANK, target_modules=ADAPTER_TARGETS)


#: the words that make a replayed prompt's first blocks its own (no accidental prefix-cache hits)
UNIQUE_WORDS = 32


def prompt_text(rid: int, tokens: int) -> str:
    """A prompt of ``tokens`` words (the emulator's tokens) no other request shares a first block with, about four
    bytes a word after the first ``UNIQUE_WORDS``, as English text has a token: the picker estimates a prompt's
    tokens from its body's size (``picker.body.BYTES_PER_TOKEN``), as the simulator knows them."""
    unique = min(tokens, UNIQUE_WORDS)
    return " ".join([f"q{rid}w{i}" for i in range(unique)] + ["abc"] * (tokens - unique))


def request_id(index: int) -> str:
    """The id the client gives request ``index`` of the trace (``CLIENT_REQUEST_ID_HEADER``, in Envoy's access log)."""
    return f"twin-{index}"


def replay_requests(trace: Trace, models: Sequence[str]) -> list[ReplayRequest]:
    """One request per trace row, leaving at its arrival (seconds after the first), naming its adapter's model and
    carrying its id for Envoy's access log."""
    start = trace.arrival[0] if len(trace) else 0.0
    return [ReplayRequest(at=trace.arrival[i] - start, model=models[trace.adapter[i]],
                          prompt=prompt_text(i, trace.input_tokens[i]), max_tokens=trace.output_tokens[i],
                          headers=((CLIENT_REQUEST_ID_HEADER, request_id(i)),))
            for i in range(len(trace))]


@dataclass(frozen=True)
class GatewayTimes:
    """What Envoy's access log says of one request (seconds from its first byte at Envoy)."""

    #: to its sending upstream: the picker's header and body round trips, its decision, any wait in its queue
    to_upstream_s: float
    #: to the upstream's first response body byte (a stream's first chunk)
    first_body_s: float


def read_access_log(path: Path, count: int, wait_s: float = 10.0) -> list[GatewayTimes | None]:
    """Envoy's access log lines of the trace's ``count`` requests, in trace order (None: no line, or Envoy sent
    nothing upstream or got no body). Envoy flushes the file about once a second: wait up to ``wait_s`` for them."""
    deadline = time.monotonic() + wait_s
    while True:
        times: list[GatewayTimes | None] = [None] * count
        seen = 0
        lines = path.read_text().splitlines() if path.exists() else []
        for line in lines:
            try:
                entry = json.loads(line)
                index = int(str(entry.get("id", "")).removeprefix("twin-"))
            except ValueError:
                continue
            if not 0 <= index < count:
                continue
            seen += 1
            to_upstream, first_body = entry.get("to_upstream_us"), entry.get("first_body_us")
            if isinstance(to_upstream, int | float) and isinstance(first_body, int | float):
                times[index] = GatewayTimes(to_upstream / 1e6, first_body / 1e6)
        if seen >= count or time.monotonic() > deadline:
            return times
        time.sleep(0.5)


def gateway_path(outcomes: Sequence[Outcome], times: Sequence[GatewayTimes | None]) -> dict[str, Any]:
    """Each served request's TTFT split by Envoy's timestamps: ``ttft_at_pod_ms`` from Envoy's sending it upstream
    to the pod's first chunk (what the simulator models: the pod's queue, load and prefill), and the path around it,
    which the simulator does not model: ``ingress_ms`` (client to Envoy, the picker's round trips and decision, any
    wait in its queue) and ``egress_ms`` (the first chunk from the pod through the picker's response processing and
    Envoy to the client); ``path_ms`` = client TTFT - ``ttft_at_pod``."""
    pod, ingress, egress, path = [], [], [], []
    for outcome, t in zip(outcomes, times, strict=True):
        if t is None or outcome.status != 200 or math.isnan(outcome.ttft_s) or math.isnan(outcome.e2e_s):
            continue
        at_pod = t.first_body_s - t.to_upstream_s
        pod.append(at_pod)
        ingress.append(t.to_upstream_s)
        egress.append(outcome.ttft_s - t.first_body_s)
        path.append(outcome.ttft_s - at_pod)
    return {"requests": len(pod), "ttft_at_pod_ms": finite_ms(pod),
            "ttft_at_pod_mean_ms": mean_ms(np.asarray(pod, dtype=np.float64)), "path_ms": finite_ms(path),
            "ingress_ms": finite_ms(ingress), "egress_ms": finite_ms(egress)}


def outcomes_as_result(policy: str, trace: Trace, outcomes: Sequence[Outcome],
                       pod_of: Callable[[str | None], int]) -> SimResult:
    """The replay's outcomes in the simulator's result shape, so the twin's figures are computed by the same code:
    a request counts as served when it got a 200 and its stream ended; any other status is a refusal with that
    status (no HTTP answer at all: ``NO_ANSWER_STATUS``)."""
    n = len(trace)
    ttft, refused, pod = array("d", bytes(8 * n)), array("H", bytes(2 * n)), array("i", bytes(4 * n))
    for i, outcome in enumerate(outcomes):
        served = outcome.status == 200 and not math.isnan(outcome.e2e_s) and not math.isnan(outcome.ttft_s)
        ttft[i] = outcome.ttft_s if served else math.nan
        if served:
            refused[i] = SERVED
        else:  # no answer, or a 200 whose stream broke off: the client got nothing usable
            refused[i] = NO_ANSWER_STATUS if outcome.status in (NO_ANSWER, 200) else outcome.status
        pod[i] = pod_of(outcome.upstream)
    return SimResult(policy=policy, trace=trace, ttft=ttft, tier=bytearray(n), pod=pod, refused=refused,
                     held_s=array("d", bytes(8 * n)))


def mean_ms(seconds: np.ndarray) -> float | None:
    """The mean in ms of the finite ``seconds``."""
    finite = seconds[np.isfinite(seconds)]
    return round(float(finite.mean()) * 1e3, 2) if finite.size else None


def finite_ms(values: Iterable[float]) -> dict[str, float | None]:
    """p50 / p95 / p99 in ms of the finite ``values`` (seconds)."""
    return percentiles_ms(np.asarray([v for v in values if not math.isnan(v)], dtype=np.float64))


# -- what the processes say ----------------------------------------------------------------------------------------
def metric_samples(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Prometheus text -> sample name -> [(labels, value)]."""
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((dict(sample.labels), float(sample.value)))
    return samples


def total(samples: dict[str, list[tuple[dict[str, str], float]]], name: str) -> float:
    """The sum of every series of ``name``."""
    return sum(value for _, value in samples.get(name, ()))


def increase(before: dict[str, dict[str, list[tuple[dict[str, str], float]]]],
             after: dict[str, dict[str, list[tuple[dict[str, str], float]]]], name: str) -> int:
    """Counter ``name``'s increase between two scrapes of every pod, all series together."""
    return int(sum(total(samples, name) - total(before.get(pod, {}), name) for pod, samples in after.items()))


def by_label(before: dict[str, dict[str, list[tuple[dict[str, str], float]]]],
             after: dict[str, dict[str, list[tuple[dict[str, str], float]]]], name: str, label: str) -> dict[str, int]:
    """Counter ``name``'s increase between two scrapes of every pod, by the value of ``label``."""
    out: Counter[str] = Counter()
    for pod, samples in after.items():
        for labels, value in samples.get(name, ()):
            earlier = sum(v for ls, v in before.get(pod, {}).get(name, ()) if ls == labels)
            out[labels.get(label, "")] += round(value - earlier)
    return dict(sorted(out.items()))


def pooled_histogram(before: dict[str, dict[str, list[tuple[dict[str, str], float]]]],
                     after: dict[str, dict[str, list[tuple[dict[str, str], float]]]], name: str) -> dict[str, Any]:
    """Histogram ``name`` of every pod between two scrapes, pooled: its count, exact mean (from ``_sum``) and
    p50 / p99 interpolated linearly within their bucket (as Prometheus' ``histogram_quantile``), all in ms."""
    counts: dict[float, float] = {}
    total_s = 0.0
    for pod, samples in after.items():
        earlier = before.get(pod, {})
        total_s += total(samples, f"{name}_sum") - total(earlier, f"{name}_sum")
        for labels, value in samples.get(f"{name}_bucket", ()):
            start = sum(v for ls, v in earlier.get(f"{name}_bucket", ()) if ls == labels)
            bound = float(labels["le"])
            counts[bound] = counts.get(bound, 0.0) + value - start
    cumulative = sorted(counts.items())
    count = cumulative[-1][1] if cumulative else 0.0
    out: dict[str, Any] = {"count": int(count), "mean_ms": round(total_s / count * 1e3, 2) if count else None}
    for q in (0.5, 0.99):
        quantile: float | None = None
        lower, below = 0.0, 0.0
        for bound, cum in cumulative:
            if count and cum >= q * count:
                quantile = (lower if math.isinf(bound) else
                            lower + (bound - lower) * (q * count - below) / (cum - below) if cum > below else bound)
                break
            lower, below = bound, cum
        out[f"p{round(q * 100)}_ms"] = None if quantile is None else round(quantile * 1e3, 2)
    return out


def histogram_quantiles(before: dict[str, list[tuple[dict[str, str], float]]],
                        after: dict[str, list[tuple[dict[str, str], float]]], name: str,
                        quantiles: Sequence[float] = (0.5, 0.99)) -> dict[str, float | None]:
    """Quantiles (ms, the upper bound of the bucket they fall in) of histogram ``name`` between two scrapes."""
    def buckets(samples: dict[str, list[tuple[dict[str, str], float]]]) -> dict[float, float]:
        counts: dict[float, float] = {}
        for labels, value in samples.get(f"{name}_bucket", ()):
            bound = float(labels["le"])
            counts[bound] = counts.get(bound, 0.0) + value
        return counts

    start, end = buckets(before), buckets(after)
    delta = sorted((bound, end[bound] - start.get(bound, 0.0)) for bound in end)
    count = delta[-1][1] if delta else 0.0
    out: dict[str, float | None] = {"count": count}
    for q in quantiles:
        bound = next((b for b, c in delta if count and c >= q * count), None)
        out[f"p{round(q * 100)}_ms_le"] = None if bound is None else (math.inf if math.isinf(bound) else bound * 1e3)
    return out


@dataclass
class Scrapes:
    """Every emulated pod's, the picker's and the controller's /metrics at one moment."""

    pods: dict[str, dict[str, list[tuple[dict[str, str], float]]]] = field(default_factory=dict)
    picker: dict[str, list[tuple[dict[str, str], float]]] = field(default_factory=dict)
    controller: dict[str, list[tuple[dict[str, str], float]]] = field(default_factory=dict)


async def scrape_all(stack: LocalStack) -> Scrapes:
    """Scrape every pod's, every picker replica's and the controller's metrics directly (not through Envoy)."""
    async def one(http: aiohttp.ClientSession, url: str) -> dict[str, list[tuple[dict[str, str], float]]]:
        async with http.get(url, timeout=aiohttp.ClientTimeout(total=30)) as response:
            return metric_samples(await response.text())

    async with aiohttp.ClientSession() as http:
        pods = await asyncio.gather(*(one(http, f"http://{e.address}/metrics") for e in stack.engines))
        picker: dict[str, list[tuple[dict[str, str], float]]] = {}
        for replica in await asyncio.gather(*(one(http, f"http://127.0.0.1:{port}/metrics")
                                              for port in stack.picker_metrics_ports or [stack.picker_metrics_port])):
            for name, samples in replica.items():  # every replica's series: histograms sum their buckets
                picker.setdefault(name, []).extend(samples)
        controller = (await one(http, f"http://127.0.0.1:{stack.controller_metrics_port}/metrics")
                      if stack.controller is not None else {})
    return Scrapes(dict(zip((e.pod for e in stack.engines), pods, strict=True)), picker, controller)


# -- the run --------------------------------------------------------------------------------------------------------
class Twin:
    """One trace through a started emulated stack."""

    def __init__(self, stack: LocalStack, trace: Trace, options: TwinOptions, adapters: Sequence[TwinAdapter],
                 say: Callable[[str], None] = lambda _m: None) -> None:
        assert stack.cluster is not None and stack.model_digest is not None
        self.stack, self.trace, self.options, self.say = stack, trace, options, say
        self.adapters = list(adapters)
        #: what the client saw of each request of the last run, in trace order
        self.outcomes: list[Outcome] = []

    def onboard(self) -> float:
        """``kubectl apply`` one AdapterRevision per adapter, wait until all are Stable; returns the seconds it took
        from the first apply."""
        stack = self.stack
        assert stack.cluster is not None and stack.model_digest is not None
        manifests = [manifest(a, stack.options.model, stack.model_digest) for a in self.adapters]
        directory = stack.options.workdir / "manifests"
        directory.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        for first in range(0, len(manifests), APPLY_CHUNK):
            path = directory / f"twin-{first // APPLY_CHUNK:03d}.yaml"
            path.write_text(yaml.safe_dump_all(manifests[first:first + APPLY_CHUNK], sort_keys=False))
            stack.cluster.kubectl("apply", "-f", str(path), timeout=120)
        asyncio.run(self._wait_stable({a.object_name for a in self.adapters}))
        asyncio.run(self._wait_registered())
        return time.monotonic() - started

    async def _wait_registered(self) -> None:
        """Until the pods' registration loads (``loraplane_emulator_lora_api_loads_total``) stop for ``SETTLED_S``
        (at most the Stable timeout: a pool that never settles is replayed as it is)."""
        deadline = time.monotonic() + self.options.stable_timeout_s
        last, since = -1.0, time.monotonic()
        while time.monotonic() < deadline:
            scrapes = await scrape_all(self.stack)
            loads = sum(total(pod, "loraplane_emulator_lora_api_loads_total") for pod in scrapes.pods.values())
            if loads != last:
                last, since = loads, time.monotonic()
            elif time.monotonic() - since >= SETTLED_S:
                self.say(f"twin: {loads:.0f} registrations on the pods, settled")
                return
            await asyncio.sleep(0.5)

    async def _wait_stable(self, names: set[str]) -> None:
        assert self.stack.cluster is not None
        deadline = time.monotonic() + self.options.stable_timeout_s
        last = -1
        async with aiohttp.ClientSession() as http:
            while True:
                async with http.get(self.stack.cluster.url + GROUP_PATH) as response:
                    items = (await response.json())["items"]
                status = {i["metadata"]["name"]: i.get("status") or {} for i in items}
                phases = {name: st.get("phase", "") for name, st in status.items()}
                stable = sum(phases.get(n) == "Stable" for n in names)
                ended = {n: f"{phases[n]} ({status[n].get('reason')}: {status[n].get('message')})"
                         for n in names if phases.get(n) in ("Failed", "RolledBack")}
                if ended:
                    raise RuntimeError(f"{len(ended)} revisions ended without becoming Stable: "
                                       f"{dict(list(ended.items())[:5])}")
                if stable != last:
                    self.say(f"twin: {stable} of {len(names)} revisions Stable")
                    last = stable
                if stable == len(names):
                    return
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{len(names) - stable} revisions not Stable after "
                                       f"{self.options.stable_timeout_s:.0f} s")
                await asyncio.sleep(1.0)

    def run(self, policy: str) -> dict[str, Any]:
        """Replay the trace through the gateway; the report of ``policy`` on this stack."""
        stack = self.stack
        models = [a.adapter for a in self.adapters]
        requests = replay_requests(self.trace, models)
        identity = {a.adapter: a.content_digest for a in self.adapters}

        def check(request: ReplayRequest, text: str) -> bool:
            """The emulator's answer under the revision's weights (its content digest), token for token."""
            words = len(text.split())
            return words > 0 and text == expected_text(identity[request.model], request.prompt, words)

        pod_index = {e.address: i for i, e in enumerate(stack.engines)}
        usage_before = {name: process_usage(pid) for name, pid in {**stack.pids(), "client": os.getpid()}.items()}
        before = asyncio.run(scrape_all(stack))
        started = time.monotonic()
        outcomes = self.outcomes = asyncio.run(replay(stack.gateway_url, requests, check=check))
        wall = time.monotonic() - started
        after = asyncio.run(scrape_all(stack))
        usage_after = {name: process_usage(pid) for name, pid in {**stack.pids(), "client": os.getpid()}.items()}
        result = outcomes_as_result(policy, self.trace, outcomes, lambda upstream: pod_index.get(upstream or "", -1))
        summary = twin_summary(result, outcomes, before, after, self.options.slo_ttft_ms)
        access_log = stack.logs / "envoy-access.log"
        if access_log.exists():
            summary["gateway_path"] = gateway_path(outcomes, read_access_log(access_log, len(outcomes)))
        summary["replay_wall_s"] = round(wall, 1)
        summary["processes"] = usage_summary(usage_before, usage_after, wall)
        return summary


def twin_summary(result: SimResult, outcomes: Sequence[Outcome], before: Scrapes, after: Scrapes,
                 slo_ttft_ms: float) -> dict[str, Any]:
    """The figures ``loraplane sim --json`` reports for a policy (the same functions), from the twin's run."""
    loads = sum(total(after.pods[p], "loraplane_emulator_lora_loads_total")
                - total(before.pods[p], "loraplane_emulator_lora_loads_total") for p in after.pods)
    hits = sum(total(after.pods[p], "vllm:prefix_cache_hits_total") - total(before.pods[p], "vllm:prefix_cache_hits_total")
               for p in after.pods)
    queries = sum(total(after.pods[p], "vllm:prefix_cache_queries_total")
                  - total(before.pods[p], "vllm:prefix_cache_queries_total") for p in after.pods)
    late = [o.late_s for o in outcomes]
    return {
        "requests": len(result.trace),
        **slo_figures(result, slo_ttft_ms),
        "ttft_ms": percentiles_ms(served_ttft(result)),
        "ttft_p50_every_request_ms": every_request_p50_ms(result),
        "ttft_mean_ms": mean_ms(served_ttft(result)),
        # the TTFT the emulated pods charged (from a request's arrival to its first token on the engine's clock): a
        # late event loop on a starved machine delays the chunk, not this
        "emulator_ttft_ms": pooled_histogram(before.pods, after.pods, "vllm:time_to_first_token_seconds"),
        "hot_ttft_p99_ms": hot_ttft_p99_ms(result),
        "e2e_ms": finite_ms(o.e2e_s for o in outcomes if o.status == 200),
        "cold_starts": int(loads),
        "gpu_loads_by_tier": by_label(before.pods, after.pods, "loraplane_emulator_lora_loads_total", "tier"),
        # of those, the loads the sidecars' registrations made (load_lora_adapter), as the simulator counts them
        "registration_loads": increase(before.pods, after.pods, "loraplane_emulator_lora_api_loads_total"),
        # GPU copies pushed out while their requests ran (vLLM's LRU spares none), as the simulator counts them
        "running_evictions": increase(before.pods, after.pods, "loraplane_emulator_running_lora_evictions_total"),
        "prefix_hit_rate": round(hits / queries, 4) if queries else 0.0,
        "refusal_reasons": dict(Counter(f"{o.status} {o.reason}" for o in outcomes if o.status != 200).most_common(8)),
        "wrong_revision": sum(o.wrong for o in outcomes),
        "no_answer": sum(o.status == NO_ANSWER for o in outcomes),
        "client_late_p99_ms": finite_ms(late)["p99"],
        "control_plane": {
            "picker_decision": histogram_quantiles(before.picker, after.picker,
                                                   "loraplane_picker_decision_duration_seconds"),
            # how old what the picker knew of the chosen pod was when it decided: its sidecar's report, or a peer's
            # last scrape of its metrics (the simulator's ``report_age_at_decision``)
            "report_age_at_decision": pooled_histogram({"picker": before.picker}, {"picker": after.picker},
                                                       "loraplane_picker_report_age_seconds"),
            # requests the picker's flow control queued, and how long (the simulator's ``held``)
            "picker_queue_wait": histogram_quantiles(before.picker, after.picker,
                                                     "loraplane_picker_queue_wait_seconds"),
            "controller_reconcile": histogram_quantiles(before.controller, after.controller,
                                                        "loraplane_controller_reconcile_seconds"),
            # its pool plans by how they were come by (the simulator's ``controller_plans``)
            "controller_plans": by_label({"controller": before.controller}, {"controller": after.controller},
                                         "loraplane_controller_plans_total", "outcome"),
        },
    }


def usage_summary(before: dict[str, tuple[float, int, int]], after: dict[str, tuple[float, int, int]],
                  wall_s: float) -> dict[str, Any]:
    """Per process kind (emulated pods, sidecars, picker, ..., and ``client``, this benchmark's own process, which
    sends the trace): CPU share of one core over the replay, RSS now and
    at its peak (largest process of the kind, and the kind's sum)."""
    kinds: dict[str, list[tuple[float, int, int]]] = {}
    for name, (cpu, rss, peak) in after.items():
        kind = ("sidecar" if name.startswith("sidecar-") else "pod" if name.startswith("engine-")
                else "redis" if name.startswith("redis-") else name)
        kinds.setdefault(kind, []).append((cpu - before.get(name, (0.0, 0, 0))[0], rss, peak))
    return {kind: {"processes": len(rows), "cpu_core_share": round(sum(r[0] for r in rows) / wall_s, 3) if wall_s else None,
                   "rss_mb_sum": round(sum(r[1] for r in rows) / 2**20, 1),
                   "rss_mb_max": round(max(r[1] for r in rows) / 2**20, 1),
                   "peak_rss_mb_max": round(max(r[2] for r in rows) / 2**20, 1)}
            for kind, rows in sorted(kinds.items())}


def start_stack(workdir: Path, options: TwinOptions, peer: str | None = None,
                adapters: Sequence[TwinAdapter] = ()) -> LocalStack:
    """The local stack on ``options.pods`` emulated pods: loraplane's, or run as ``peer``'s users run it (its
    packaged picker config over the pods' scraped metrics, ``adapters`` registered on every pod at start-up)."""
    modules = {a.adapter: workdir / ARTIFACTS / "adapters" / a.object_name for a in adapters} if peer else {}
    stack = LocalStack(StackOptions(workdir=workdir, engines=options.pods, runtime="emulated", model=MODEL,
                                    profile=options.profile, max_loras=options.max_loras,
                                    max_cpu_loras=options.max_cpu_loras, heartbeat=options.heartbeat,
                                    controller_resync=CONTROLLER_RESYNC_S,  # as the simulator plans
                                    body_mode="FULL_DUPLEX_STREAMED", peer=peer, lora_modules=modules,
                                    scrape_interval=options.scrape_interval, pickers=options.pickers,
                                    envoy_access_log=True))
    return stack.start()


def run_policy(trace: Trace, options: TwinOptions, policy: str, workdir: Path,
               say: Callable[[str], None] = lambda _m: None) -> dict[str, Any]:
    """``policy`` (loraplane, or a peer's packaged config) on a fresh twin: the adapters written, the stack
    started, loraplane's revisions onboarded through kubectl (a peer's registered at start-up), the trace
    replayed; its report, with ``onboard_s``."""
    adapters = write_adapters(trace, workdir / ARTIFACTS, MODEL)
    peer = None if policy == LORAPLANE else policy
    stack = start_stack(workdir, options, peer, adapters)
    try:
        twin = Twin(stack, trace, options, adapters, say)
        onboard_s = twin.onboard() if peer is None else 0.0
        say(f"twin: {policy}: {len(adapters)} adapters ready after {onboard_s:.1f} s; replaying {len(trace)} requests")
        report = twin.run(policy)
    finally:
        stack.stop()
    report["onboard_s"] = round(onboard_s, 1)
    return report


def twin_policies(text: str) -> list[str]:
    """``--policies``: loraplane and the peers' packaged configs."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in TWIN_POLICIES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown policy {', '.join(unknown)}; choose from {', '.join(TWIN_POLICIES)}")
    return list(dict.fromkeys(names))


def add_pool_options(p: argparse.ArgumentParser, pods: int) -> None:
    """The flags of the twin's pool (read them with ``pool_options``); ``bench fidelity`` takes them too."""
    p.add_argument("--pods", type=int, default=pods, help="emulated model-server pods, each with its sidecar")
    p.add_argument("--max-loras", type=int, default=TwinOptions.max_loras, help="GPU adapter slots per pod")
    p.add_argument("--max-cpu-loras", type=int, default=TwinOptions.max_cpu_loras,
                   help="host-memory adapter slots per pod")
    p.add_argument("--profile", default=TwinOptions.profile,
                   help="the emulated pods' timing profile: a built-in name or a JSON file (loraplane.sim.profile)")
    p.add_argument("--slo-ttft-ms", type=float, default=TwinOptions.slo_ttft_ms,
                   help="TTFT a served request must meet for slo_attainment")
    p.add_argument("--scrape-interval", type=float, default=TwinOptions.scrape_interval,
                   help="seconds between a peer picker's scrapes of each pod's metrics (llm-d's default is 0.05; "
                   "on a small machine a picker scraping dozens of pods that often falls behind)")
    p.add_argument("--pickers", type=int, default=TwinOptions.pickers,
                   help="picker replicas behind the one Envoy (the twin only; the simulator runs one)")
    p.add_argument("--workdir", type=Path, default=Path(".run-twin"),
                   help="the stack's logs, artifacts and manifests go here")
    p.add_argument("--json", action="store_true", help="print one JSON object (always on; kept for symmetry)")


def pool_options(args: argparse.Namespace) -> TwinOptions:
    """The ``TwinOptions`` of ``add_pool_options``' flags."""
    return TwinOptions(pods=args.pods, max_loras=args.max_loras, max_cpu_loras=args.max_cpu_loras,
                       profile=args.profile, slo_ttft_ms=args.slo_ttft_ms, scrape_interval=args.scrape_interval,
                       pickers=args.pickers)


def parser() -> argparse.ArgumentParser:
    """The command's flags."""
    from loraplane.helptext import HelpFormatter
    from loraplane.sim.cli import add_trace_source

    p = argparse.ArgumentParser(prog="loraplane bench twin", formatter_class=HelpFormatter,
                                description=__doc__.split("\n\n")[0] if __doc__ else None)
    add_trace_source(p, default_requests=DEFAULT_REQUESTS)
    add_pool_options(p, pods=TwinOptions.pods)
    p.add_argument("--policies", type=twin_policies, default=[LORAPLANE],
                   help=f"comma-separated, each on a fresh twin: {', '.join(TWIN_POLICIES)}")
    return p


def main(argv: Sequence[str]) -> int:
    """Entry point of ``loraplane bench twin``."""
    from loraplane.sim.cli import trace_from_args
    from loraplane.sim.profile import load_profile
    from loraplane.sim.trace import TraceError

    p = parser()
    args = p.parse_args(list(argv))
    options = pool_options(args)
    profile = load_profile(args.profile)
    try:
        trace = trace_from_args(p, args, profile.default_adapter_bytes)
    except TraceError as exc:
        print(f"loraplane bench twin: {exc}", file=sys.stderr)
        return 2

    def say(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    started = time.monotonic()
    report = {"scenario": trace.name, "pods": options.pods, "requests": len(trace), "seed": args.seed,
              "profile": profile.name, "slo_ttft_ms": options.slo_ttft_ms,
              "pool": {"pods": options.pods, "max_loras": options.max_loras, "max_cpu_loras": options.max_cpu_loras},
              "pickers": options.pickers,
              "policies": {policy: run_policy(trace, options, policy, args.workdir.resolve() / policy, say)
                           for policy in args.policies}}
    report["wall_s"] = round(time.monotonic() - started, 1)
    print(json.dumps(report, indent=2))
    return 0
