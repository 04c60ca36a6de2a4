"""Precise prefix-cache routing through a real Envoy over two real vLLM-CPU pods.

Redis, two vLLM-CPU servers publishing their KV-cache events, a real sidecar process per pod (``--kv-events-endpoint``:
it writes the pod's ``KvBlockSet``), the real picker CLI with the default config's ``prefix-cache-scorer`` in precise
mode (the model's tokenizer, vLLM's block size) and Envoy in front. The test plays the controller: both pods hold
``claims@v17`` and ``claims@v18`` on GPU (tier affinity is equal), and the route table sends ``claims`` to one of them.

A multi-turn session's first turn goes to the pod the load says (the other pod holds a long request); its second turn
(the first turn's prompt + the answer + new text) goes to the pod holding its prefix although that pod is now the
busier one. vLLM's own counters (``cached_tokens`` of the response, ``vllm:prefix_cache_hits_total``) must equal what
the picker matched (``loraplane_picker_prefix_blocks_total``). After the route moves to ``claims@v18`` the same
prompt is a hit neither for the picker nor for vLLM.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
import redis
import tokenizers

from e2e.fixtures.picker import Gateway, start_gateway
from e2e.fixtures.processes import LOOPBACK, ManagedProcess, RedisServer, free_port, start_redis
from e2e.fixtures.vllm import ServableModel, require_vllm
from e2e.fixtures.waiting import wait_until
from e2e.test_vllm_stack import expected_source
from loraplane.api import (
    AdapterTarget,
    Artifact,
    KvBlockSet,
    LoraSpec,
    ResidencyReport,
    RouteEntry,
    RouteTable,
    TargetState,
    Tier,
    WeightedRevision,
    cache_key,
    keys,
)
from loraplane.picker.envoy import UPSTREAM_HEADER, ExtProcModes
from loraplane.picker.prefix import PrefixHasher, precise_parameters
from loraplane.picker.scheduler import EndpointPickerConfig
from loraplane.stack.demo import RANK, TARGETS, write_artifacts
from loraplane.vllm_server import VllmOptions, VllmServer, start_vllm

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

POOL = "pool-prefix"
PODS = ("pod-0", "pod-1")
BLOCK = 32  # vLLM-CPU takes block sizes in multiples of 32
REVISIONS = ("claims@v17", "claims@v18")
#: 199 bytes (+ BOS: 200 tokens with the byte tokenizer, 6 full blocks), then turns appended
FIRST_TURN = ("You are the claims assistant of ACME Insurance. Cite the policy section in every answer. "
              "Customer: my car was hit in the parking lot yesterday and the other driver left. What do I do now? "
              "Thanks, bye")
assert len(FIRST_TURN) == 199
#: a long streamed answer (stopped by the test once it has served its purpose): its pod counts it in flight
LONG = {"max_tokens": 1700, "ignore_eos": True, "temperature": 0, "stream": True}


@dataclass
class Pod:
    name: str
    server: VllmServer
    sidecar: ManagedProcess

    @property
    def address(self) -> str:
        return f"{LOOPBACK}:{self.server.port}"

    def prefix_hits(self) -> float:
        """vLLM's ``vllm:prefix_cache_hits_total`` (tokens)."""
        text = httpx.get(f"http://{self.address}/metrics", timeout=10).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("vllm:prefix_cache_hits_total"))


@dataclass
class Stack:
    redis: RedisServer
    client: redis.Redis
    pods: list[Pod]
    gateway: Gateway
    digests: dict[str, str]
    tokenizer: tokenizers.Tokenizer

    def pod_of(self, response: httpx.Response) -> Pod:
        return next(p for p in self.pods if p.address == response.headers[UPSTREAM_HEADER])

    def picker_metric(self, name: str, labels: str) -> float:
        text = httpx.get(f"http://{LOOPBACK}:{self.gateway.metrics_port}/metrics", timeout=5).text
        line = next((x for x in text.splitlines() if x.startswith(f"{name}{{{labels}}}")), None)
        return 0.0 if line is None else float(line.rsplit(" ", 1)[1])

    def matched_blocks(self) -> float:
        return self.picker_metric("loraplane_picker_prefix_blocks_total", 'state="matched"')

    def hashed_blocks(self) -> float:
        return self.picker_metric("loraplane_picker_prefix_blocks_total", 'state="hashed"')

    def tokens(self, prompt: str) -> int:
        return len(self.tokenizer.encode(prompt).ids)

    def decisions(self) -> dict[str, float]:
        """The picker's ``loraplane_picker_decisions_total`` by outcome (those not 0)."""
        text = httpx.get(f"http://{LOOPBACK}:{self.gateway.metrics_port}/metrics", timeout=5).text
        return {line.split('outcome="', 1)[1].split('"', 1)[0]: float(line.rsplit(" ", 1)[1])
                for line in text.splitlines()
                if line.startswith("loraplane_picker_decisions_total{") and float(line.rsplit(" ", 1)[1])}

    def residency_sources(self) -> dict[str, str | None]:
        """Each pod's ``residency_source`` in its sidecar's last report."""
        reports = {pod.name: self.client.get(keys.residency_report(POOL, pod.name)) for pod in self.pods}
        sources = {name: ResidencyReport.from_json(raw).residency_source if raw else None
                   for name, raw in reports.items()}
        return {name: None if source is None else str(source) for name, source in sources.items()}


def _routes(generation: int, served_name: str, digest: str) -> RouteTable:
    return RouteTable(pool=POOL, generation=generation, updated_at=time.time(), models={
        "claims": RouteEntry(tenant="acme", revisions=[WeightedRevision(
            revision=served_name.split("@")[1], served_name=served_name, digest=digest, weight=100)])})


def _publish_routes(client: redis.Redis, table: RouteTable) -> None:
    client.set(keys.route_table(POOL), table.to_json())
    client.publish(keys.routes_changed_channel(POOL), str(table.generation))


@pytest.fixture(scope="module")
def stack(servable_model: ServableModel, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    python = require_vllm()
    work = tmp_path_factory.mktemp("vllm-prefix")
    artifacts = write_artifacts(work / "artifacts", [tuple(n.split("@")) for n in REVISIONS], servable_model.preset)
    redis_server = start_redis(work)
    client = redis.Redis.from_url(redis_server.url)
    pods: list[Pod] = []
    servers: list[VllmServer] = []
    try:
        for i, _pod in enumerate(PODS):
            options = VllmOptions(model=servable_model.path, max_loras=2, max_cpu_loras=3, max_lora_rank=16,
                                  max_model_len=2048, block_size=BLOCK, cpu_bind=str(i),
                                  kv_events_endpoint=f"tcp://{LOOPBACK}:{free_port()}",
                                  extra_args=("--enable-prompt-tokens-details",))
            servers.append(start_vllm(options, work / f"vllm-{i}.log", python=python))
        for pod, server in zip(PODS, servers, strict=True):
            server.wait_ready()
            root = work / pod
            root.mkdir()
            sidecar = ManagedProcess(
                [sys.executable, "-m", "loraplane.sidecar", "--pool", POOL, "--pod", pod, "--runtime", "vllm",
                 "--runtime-url", f"http://{LOOPBACK}:{server.port}", "--redis-url", redis_server.url,
                 # a long TTL: on a loaded two-core machine Redis calls have stalled for over a second (both sidecars
                 # and the picker logged timeouts at once), and a block set that expires meanwhile is no prefix hit;
                 # this test is about matching, not expiry (tests/picker cover that)
                 "--cache-dir", str(root), "--heartbeat", "0.3", "--report-ttl", "10", "--metrics-port", "0",
                 "--file-root", str(work / "artifacts"), "--max-loras", "2", "--max-cpu-loras", "3",
                 "--max-lora-rank", "16", "--base-model-digest", servable_model.digest,
                 "--kv-events-endpoint", str(server.options.kv_events_endpoint)],
                work / f"sidecar-{pod}.log").start()
            pods.append(Pod(pod, server, sidecar))
        targets = [AdapterTarget(
            served_name=a.served_name, adapter=a.adapter, revision=a.revision, tier=Tier.GPU,
            artifact=Artifact(uri=a.uri, digest=a.digest), lora=LoraSpec(rank=RANK, alpha=RANK, dtype="float32",
                                                               target_modules=list(TARGETS)),
            base_model_digest=servable_model.digest,
            cache_key=cache_key(servable_model.digest, a.adapter, a.revision, a.digest)) for a in artifacts.values()]
        for pod in PODS:
            state = TargetState(pool=POOL, pod=pod, generation=1, updated_at=time.time(), adapters=targets)
            client.set(keys.target_state(POOL, pod), state.to_json())
            client.publish(keys.target_changed_channel(POOL), pod)
        digests = {name: a.digest for name, a in artifacts.items()}

        def placed() -> bool:
            for pod in PODS:
                raw = client.get(keys.residency_report(POOL, pod))
                held = ResidencyReport.from_json(raw).by_name() if raw is not None else {}
                if any(n not in held or held[n].tier is not Tier.GPU or held[n].digest != d
                       for n, d in digests.items()):
                    return False
            return True

        wait_until(placed, 180, "both pods to hold both revisions on GPU")
        _publish_routes(client, _routes(1, "claims@v17", digests["claims@v17"]))
        tokenizer_path = servable_model.path / "tokenizer.json"
        config = EndpointPickerConfig.load().with_parameters("prefix-cache-scorer",
                                                             **precise_parameters(BLOCK, tokenizer_path))
        # responses streamed through (BUFFERED would hold a long answer's headers until its end)
        gateway = start_gateway(work, POOL, redis_server.url, config_yaml=config.to_yaml(),
                                modes=ExtProcModes(response_body_mode="STREAMED"))
        try:
            yield Stack(redis_server, client, pods, gateway, digests,
                        tokenizers.Tokenizer.from_file(str(tokenizer_path)))
        finally:
            gateway.stop()
    finally:
        for pod in pods:
            pod.sidecar.stop()
        for server in servers:
            server.stop()
        client.close()
        redis_server.stop()


class Holder:
    """A long streamed completion through the gateway, read in a thread: the pod serving it counts it in flight
    until it ends or ``finish`` stops reading it (the stream closes, Envoy resets it, vLLM aborts it)."""

    def __init__(self, stack: Stack, prompt: str) -> None:
        self.started = threading.Event()
        self.stopping = threading.Event()
        self.response: httpx.Response | None = None
        self.body = b""
        self.done = threading.Event()
        self.done_at = float("inf")
        self.first_token_after = float("inf")  # seconds from sending it to its first body chunk
        self.thread = threading.Thread(target=self._run, args=(stack, prompt), daemon=True)
        self.thread.start()
        assert self.started.wait(120), "the long request did not start"

    def _run(self, stack: Stack, prompt: str) -> None:
        sent_at = time.monotonic()
        try:
            with httpx.stream("POST", f"{stack.gateway.url}/v1/completions", timeout=300,
                              json={"model": "claims", "prompt": prompt, **LONG}) as response:
                self.response = response
                for chunk in response.iter_bytes():
                    if not self.body:
                        # its first token is back (through the picker, which saw it first): it is decoding now,
                        # no longer waiting for a prefill, and counts in flight until its body ends
                        self.first_token_after = time.monotonic() - sent_at
                        self.started.set()
                    self.body += chunk
                    if self.stopping.is_set():
                        break
        finally:
            self.done_at = time.monotonic()
            self.done.set()
            self.started.set()  # ended without a token: the checks on its response say why

    def finish(self) -> None:
        self.stopping.set()
        assert self.done.wait(300), "the long request did not end"
        assert self.response is not None and self.response.status_code == 200


def complete(stack: Stack, prompt: str, max_tokens: int = 8) -> tuple[httpx.Response, str, int]:
    """A greedy completion through the gateway: the response, its text and vLLM's cached prompt tokens."""
    response = httpx.post(f"{stack.gateway.url}/v1/completions", timeout=120,
                          json={"model": "claims", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    assert response.status_code == 200, response.text
    body = response.json()
    return response, body["choices"][0]["text"], int(body["usage"]["prompt_tokens_details"]["cached_tokens"])


def expected_cached(stack: Stack, prompt: str, matched_blocks: float) -> int:
    """vLLM's cached tokens for a prefix of ``matched_blocks`` full blocks: it always recomputes the last token."""
    return int(min(matched_blocks * BLOCK, (stack.tokens(prompt) - 1) // BLOCK * BLOCK))


def prompt_blocks(stack: Stack, served_name: str, prompt: str) -> list[str]:
    """``prompt``'s full blocks as the picker and the sidecar hash them under ``served_name`` (hex)."""
    hasher = PrefixHasher(BLOCK, tokenizer=lambda text: stack.tokenizer.encode(text).ids)
    return [h.hex() for h in hasher.hash_text(served_name, stack.digests[served_name], prompt).hashes]


def wait_published(stack: Stack, pod: Pod, served_name: str, prompt: str) -> None:
    """Wait until ``pod``'s published block set holds every full block of ``prompt`` under ``served_name``."""
    wanted = set(prompt_blocks(stack, served_name, prompt))
    held: dict[str | None, tuple[str | None, int]] = {}

    def published() -> bool:
        raw = stack.client.get(keys.kv_blocks(POOL, pod.name))
        if raw is None:
            return False
        block_set = KvBlockSet.from_json(raw)
        held.clear()
        held.update({a.served_name: (a.digest, len(a.block_hashes)) for a in block_set.adapters})
        entry = block_set.by_name().get(served_name)
        return entry is not None and wanted <= set(entry.block_hashes)

    try:
        wait_until(published, 30, f"{pod.name} to publish {len(wanted)} blocks of {served_name}", pod.sidecar)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\nits block set: {held}") from None


def explain_match(stack: Stack, pod: Pod, served_name: str, prompt: str) -> str:
    """What the picker could have matched on ``pod`` now (its published set's age and how many of ``prompt``'s
    blocks it holds) and the warnings the processes logged: a failed match's message."""
    wanted = prompt_blocks(stack, served_name, prompt)
    raw = stack.client.get(keys.kv_blocks(POOL, pod.name))
    if raw is None:
        state = "no block set published"
    else:
        block_set = KvBlockSet.from_json(raw)
        entry = block_set.by_name().get(served_name)
        held = set(entry.block_hashes) if entry is not None else set()
        state = (f"block set {time.time() - block_set.heartbeat_at:.1f} s old (ttl {block_set.ttl_seconds} s), "
                 f"{sum(h in held for h in wanted)} of {len(wanted)} blocks of the prompt held")
    logs = [pod.sidecar.log_path, stack.gateway.picker.log_path]
    warnings = [line for path in logs for line in path.read_text(errors="replace").splitlines()
                if " WARNING " in line or " ERROR " in line]
    return f"{pod.name}: {state}; warnings logged: {warnings[-8:]}"


def test_second_turn_follows_its_prefix_and_a_new_revision_is_no_hit(stack: Stack) -> None:
    # turn 1: the other pod is busy with a long request, so the load sends it to the idle one
    busy = Holder(stack, "Unrelated warm-up request that keeps one pod busy for a while, " * 2)
    assert busy.response is not None
    first_busy = stack.pod_of(busy.response)
    response, answer, cached = complete(stack, FIRST_TURN)
    holder = stack.pod_of(response)
    assert holder is not first_busy and cached == 0
    busy.finish()
    wait_published(stack, holder, "claims@v17", FIRST_TURN)
    time.sleep(1.5)  # the picker reads them on the change notice (or its 1 s resync)

    # the pod holding the prefix gets a long request of the same conversation: now it is the busier one; the
    # second turn goes out the moment the long one's first token is back (nothing in between: on a loaded machine
    # even two metric scrapes there once let the long answer run out first). A starved machine can still deliver the
    # long answer's first token only with its last (Envoy holds the chunks while the picker answers for the first):
    # then nothing was in flight, and the pair is sent again with new text after the first turn (no block of an
    # earlier try is shared)
    tries: list[str] = []
    while True:
        second_turn = FIRST_TURN + answer + f" ({len(tries)}) And what do I file first?"
        long_prompt = FIRST_TURN + f" ({len(tries)}) Please explain every step of the claim in great detail."
        matched, hashed = stack.matched_blocks(), stack.hashed_blocks()
        busy = Holder(stack, long_prompt)
        sent_at = time.monotonic()
        response, _, cached = complete(stack, second_turn)
        assert busy.response is not None
        # the picker routes a request as it arrives (milliseconds): the long one must still run well after that
        if busy.done_at - sent_at > 0.25:
            break
        tries.append(f"the long request ended {busy.done_at - sent_at:.2f} s after the second turn was sent (its "
                     f"first token came {busy.first_token_after:.2f} s after it was sent; the second turn took "
                     f"{time.monotonic() - sent_at:.2f} s): {busy.response.status_code} {busy.body[-120:]!r}")
        busy.finish()
        # another try is fair only while no other pod holds the first turn's blocks
        assert len(tries) < 3 and {stack.pod_of(busy.response), stack.pod_of(response)} == {holder}, "\n".join(tries)
    assert stack.pod_of(busy.response) is holder
    assert stack.pod_of(response) is holder  # the prefix outweighs the other pod's lighter load
    # both went through the prefix scorer: the long one matched the first turn's blocks as well
    first_turn_blocks = stack.tokens(FIRST_TURN) // BLOCK
    matched_now = stack.matched_blocks() - matched - first_turn_blocks
    assert stack.hashed_blocks() - hashed == stack.tokens(long_prompt) // BLOCK + stack.tokens(second_turn) // BLOCK
    # every full block of the first turn
    assert matched_now == first_turn_blocks, explain_match(stack, holder, "claims@v17", FIRST_TURN)
    assert cached > 0 and cached == expected_cached(stack, second_turn, matched_now)  # vLLM agrees
    turn_two_cached = cached
    busy.finish()

    # the next revision: the same prompt is a hit neither for the picker nor for vLLM
    _publish_routes(stack.client, _routes(2, "claims@v18", stack.digests["claims@v18"]))
    time.sleep(1.5)
    matched, hashed, hits = stack.matched_blocks(), stack.hashed_blocks(), [p.prefix_hits() for p in stack.pods]
    response, _, cached = complete(stack, second_turn)
    assert cached == 0 and stack.matched_blocks() == matched and stack.hashed_blocks() > hashed
    assert [p.prefix_hits() for p in stack.pods] == hits  # vLLM's own counter: no hit anywhere
    v18_pod = stack.pod_of(response)
    wait_published(stack, v18_pod, "claims@v18", second_turn)
    time.sleep(1.5)
    matched, hits_there = stack.matched_blocks(), v18_pod.prefix_hits()
    response, _, cached = complete(stack, second_turn)  # now v18 holds it, on the pod that served it
    assert stack.pod_of(response) is v18_pod
    assert cached > 0 and cached == expected_cached(stack, second_turn, stack.matched_blocks() - matched)
    assert v18_pod.prefix_hits() - hits_there == cached
    # the sidecars' tiers came from the plugin's exact series (or, with LORAPLANE_VLLM_RESIDENCY=0, their LRU model)
    sources = stack.residency_sources()
    print(f"\nvllm-prefix-routing residency {sources}: turn 2 on the prefix holder after {len(tries)} retries, "
          f"{matched_now:.0f} blocks matched, {turn_two_cached} tokens cached; v18 again: {cached} cached; picker "
          f"decisions {stack.decisions()}")
    assert set(sources.values()) == {expected_source()}, sources
