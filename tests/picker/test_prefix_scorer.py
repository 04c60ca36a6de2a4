"""The prefix-cache scorer plugin: configured from YAML, fed by the scheduler once per cycle, recording through the
lifecycle, keyed by revision, bounded, expiring, and inside the predicted-TTFT cost model."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import orjson
import pytest
from prometheus_client import CollectorRegistry
from pydantic import ValidationError

from loraplane.api import AdapterBlocks, KvBlockSet, Tier
from loraplane.bench.picker import bench_request_path
from loraplane.engine.tokenizer import write_byte_tokenizer
from loraplane.picker.extproc import ExtProcHandler
from loraplane.picker.lifecycle import InFlightRequest, Lifecycle, PluginRuntime
from loraplane.picker.plugins import Cycle, SchedulingRequest
from loraplane.picker.prefix import (
    PrefixCacheParameters,
    PrefixCacheScorer,
    PrefixHasher,
    without_prefix_scorer,
)
from loraplane.picker.scheduler import EndpointPickerConfig, Scheduler
from loraplane.picker.snapshot import EndpointState, InFlightTracker, PoolSnapshot
from tests.picker.conftest import DIGEST_V1, REQUEST_HEADERS, body, headers, make_context
from tests.picker.test_prefix import D17, D18, Clock

SYSTEM = "You are the claims assistant of ACME. Cite the policy section in every answer you give. " * 6

def pool(in_flight: tuple[int, int] = (0, 0)) -> PoolSnapshot:
    """Two pods, both holding v17 and v18 on GPU (tier affinity is equal)."""
    residency = {"claims@v17": (Tier.GPU, D17), "claims@v18": (Tier.GPU, D18)}
    snapshot = PoolSnapshot([EndpointState(name=f"pod-{i}", address=f"10.0.0.{i + 1}:8000", residency=residency)
                             for i in range(2)])
    snapshot.in_flight[:] = in_flight
    return snapshot


def chat(*turns: str) -> dict:
    messages = [{"role": "system", "content": SYSTEM}]
    for i, turn in enumerate(turns):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": turn})
    return {"model": "claims", "messages": messages}


def default_scheduler(profile: str | None = None) -> tuple[Scheduler, Lifecycle]:
    scheduler = Scheduler(EndpointPickerConfig.load(), profile)
    assert scheduler.preparer(PrefixCacheScorer) is not None
    lifecycle = scheduler.lifecycle(PluginRuntime(InFlightTracker(), time.monotonic, registry=CollectorRegistry()))
    return scheduler, lifecycle


def send(scheduler: Scheduler, lifecycle: Lifecycle, snapshot: PoolSnapshot, served: str, digest: str, document: dict,
         seed: int = 0) -> str:
    """Hash, schedule and route one request the way the picker does; returns the chosen address."""
    request = scheduler.read_body(SchedulingRequest(served, digest), document)
    assert request.prefix is not None
    decision = scheduler.schedule(request, snapshot, np.random.default_rng(seed))
    lifecycle.pre_request(InFlightRequest(request, "t", decision.endpoints[0]))
    lifecycle.response_complete(InFlightRequest(request, "t", decision.endpoints[0]))
    return decision.endpoints[0]


def test_second_turn_goes_where_the_first_went_even_against_load() -> None:
    scheduler, lifecycle = default_scheduler()
    first = send(scheduler, lifecycle, pool(in_flight=(3, 0)), "claims@v17", D17, chat("my car was hit"))
    assert first == "10.0.0.2:8000"  # the first turn went to pod-1 by load
    # a short prompt (~140 tokens, ~14 ms of prefill): its hit scores the share floor, above the load scorers
    second_turn = chat("my car was hit", "Sorry to hear that. Was anyone hurt?", "no, what do I file?")
    # now pod-1 is the busier one: without the prefix, the load scorers would pick pod-0
    assert send(scheduler, lifecycle, pool(in_flight=(0, 2)), "claims@v17", D17, second_turn) == "10.0.0.2:8000"
    # the same conversation under the next revision holds no prefix anywhere: load decides
    assert send(scheduler, lifecycle, pool(in_flight=(0, 2)), "claims@v18", D18, second_turn) == "10.0.0.1:8000"


def test_scores_are_the_matched_share_and_the_revision_is_part_of_the_key() -> None:
    scorer = PrefixCacheScorer(PrefixCacheParameters(block_size=32), clock=Clock())
    snapshot = pool()
    first = scorer.hash_text("claims@v17", D17, SYSTEM)
    scorer.routed(first, "10.0.0.1:8000")
    grown = scorer.hash_text("claims@v17", D17, SYSTEM + SYSTEM)
    cycle = _cycle(scorer, SchedulingRequest("claims@v17", D17, prefix=grown), snapshot)
    assert cycle.prefix_hit is not None
    assert cycle.prefix_hit.tolist() == [len(first.hashes) / len(grown.hashes), 0.0]
    assert cycle.prefix_tokens == len(grown.hashes) * 32 / 4  # bytes -> tokens at 4 bytes a token
    other = scorer.hash_text("claims@v18", D18, SYSTEM + SYSTEM)
    cycle = _cycle(scorer, SchedulingRequest("claims@v18", D18, prefix=other), snapshot)
    assert cycle.prefix_hit is not None and not cycle.prefix_hit.any()
    assert scorer(SchedulingRequest("claims@v18", D18, prefix=other), snapshot, cycle) is None
    same_name_other_bytes = scorer.hash_text("claims@v17", D18, SYSTEM)
    assert not set(same_name_other_bytes.hashes) & set(first.hashes)


def _cycle(scorer: PrefixCacheScorer, request: SchedulingRequest, snapshot: PoolSnapshot) -> Cycle:
    cycle = Cycle(np.ones(snapshot.size, dtype=np.bool_), np.zeros(snapshot.size), np.ones(snapshot.size, dtype=np.bool_))
    assert request.prefix is not None
    scorer.cycle_match(request.prefix, snapshot, cycle)
    return cycle


def test_saturated_pods_get_no_prefix_score() -> None:
    scorer = PrefixCacheScorer(PrefixCacheParameters(block_size=32))
    snapshot = pool()
    prefix = scorer.hash_text("claims@v17", D17, SYSTEM)
    scorer.routed(prefix, "10.0.0.1:8000")
    cycle = _cycle(scorer, SchedulingRequest("claims@v17", D17, prefix=prefix), snapshot)
    cycle.unsaturated = np.asarray([False, True])
    score = scorer(SchedulingRequest("claims@v17", D17, prefix=prefix), snapshot, cycle)
    assert score is not None and score.tolist() == [0.0, 0.0]


def test_ttl_and_lru_capacity_come_from_the_config() -> None:
    clock = Clock()
    scorer = PrefixCacheScorer(PrefixCacheParameters(block_size=16, lru_capacity=8, ttl_seconds=10), clock=clock)
    old = scorer.hash_text("a@v1", None, "o" * 16 * 6)
    new = scorer.hash_text("a@v1", None, "n" * 16 * 6)
    scorer.routed(old, "10.0.0.1:8000")
    scorer.routed(new, "10.0.0.1:8000")
    assert scorer.index.match(["10.0.0.1:8000"], new).tolist() == [6]
    assert scorer.index.match(["10.0.0.1:8000"], old).tolist() == [2]  # least recently routed: tail evicted
    clock.now += 11
    assert scorer.index.match(["10.0.0.1:8000"], new).tolist() == [0]  # expired


def test_cost_model_counts_saved_prefill() -> None:
    scheduler, lifecycle = default_scheduler("predicted-ttft")
    long_prompt = {"model": "claims", "prompt": SYSTEM * 8}
    assert send(scheduler, lifecycle, pool(in_flight=(17, 0)), "claims@v17", D17, long_prompt) == "10.0.0.2:8000"
    # pod-1 now has a queue (17 in flight: 2 past its 16 batch slots, 62 ms), pod-0 none; the saved prefill of the
    # whole prompt (66 blocks of 64 bytes, 1,056 tokens at 0.1 ms: 106 ms) outweighs the wait
    assert send(scheduler, lifecycle, pool(in_flight=(0, 17)), "claims@v17", D17, long_prompt) == "10.0.0.2:8000"
    # without the prefix signal (prefillSecondsPerToken 0) the queue wins
    config = EndpointPickerConfig.load().with_parameters("predicted-ttft-scorer", prefillSecondsPerToken=0.0)
    blind = Scheduler(config, "predicted-ttft")
    blind_lifecycle = blind.lifecycle(PluginRuntime(InFlightTracker(), time.monotonic, registry=CollectorRegistry()))
    assert send(blind, blind_lifecycle, pool(in_flight=(17, 0)), "claims@v17", D17, long_prompt) == "10.0.0.2:8000"
    assert send(blind, blind_lifecycle, pool(in_flight=(0, 17)), "claims@v17", D17, long_prompt) == "10.0.0.1:8000"


def test_precise_mode_scores_from_published_block_sets(tmp_path: Path) -> None:
    write_byte_tokenizer(tmp_path, 260, 256, (257,))
    params = PrefixCacheParameters(mode="precise", unit="tokens", block_size=32,
                                   tokenizer=str(tmp_path / "tokenizer.json"))
    wall = Clock()
    scorer = PrefixCacheScorer(params, wall_clock=wall)
    prompt = SYSTEM
    prefix = scorer.hash_text("claims@v17", D17, prompt)
    assert prefix.unit == "tokens" and len(prefix.hashes) == (len(prompt.encode()) + 1) // 32  # BOS counts
    assert scorer.precise_index is not None
    scorer.precise_index.update(KvBlockSet(pool="p", pod="pod-1", block_size=32, heartbeat_at=wall.now,
                                           adapters=[AdapterBlocks(served_name="claims@v17", digest=D17,
                                                                   block_hashes=[h.hex() for h in prefix.hashes])]))
    cycle = _cycle(scorer, SchedulingRequest("claims@v17", D17, prefix=prefix), pool())
    assert cycle.prefix_hit is not None and cycle.prefix_hit.tolist() == [0.0, 1.0]  # keyed by pod name
    assert scorer.routed(prefix, "10.0.0.2:8000") == len(prefix.hashes)  # precise mode records nothing itself
    assert scorer.routed(prefix, "10.0.0.2:8000") is None  # reported once per decision
    _cycle(scorer, SchedulingRequest("claims@v17", D17, prefix=prefix), pool())
    assert scorer.routed(prefix, "10.0.0.1:8000") == 0


def test_parameters_are_checked() -> None:
    with pytest.raises(ValidationError, match="needs a tokenizer"):
        PrefixCacheParameters(unit="tokens")
    with pytest.raises(ValidationError, match="needs unit: tokens"):
        PrefixCacheParameters(mode="precise")
    with pytest.raises(ValueError, match="mode: precise needs unit: tokens"):  # a config naming it is refused
        EndpointPickerConfig.load().with_parameters("prefix-cache-scorer", mode="precise")


def test_the_picker_hashes_the_parsed_body_once_and_counts_the_metrics(monkeypatch: pytest.MonkeyPatch) -> None:
    ctx, _state = make_context()
    calls = []
    original = PrefixHasher.hash_request

    def counting(self: PrefixHasher, served_name: str | None, digest: str | None, document: dict) -> object:
        calls.append((served_name, digest))
        return original(self, served_name, digest, document)

    monkeypatch.setattr(PrefixHasher, "hash_request", counting)
    data = orjson.dumps({"model": "claims", "prompt": SYSTEM})
    destinations = []
    for _ in range(2):
        handler = ExtProcHandler(ctx)
        handler.on_message(headers(REQUEST_HEADERS).SerializeToString())
        handler.on_message(body(data).SerializeToString())
        destinations.append(handler.exchange.director.destination)
        handler.on_close()
    assert calls == [("claims@v1", DIGEST_V1)] * 2  # once per request, keyed by the resolved revision
    assert destinations[0] == destinations[1]
    registry = ctx.metrics.registry
    hashed = registry.get_sample_value("loraplane_picker_prefix_blocks_total", {"state": "hashed"})
    matched = registry.get_sample_value("loraplane_picker_prefix_blocks_total", {"state": "matched"})
    blocks = len(SYSTEM.encode()) // 64
    assert (hashed, matched) == (2 * blocks, blocks)
    assert registry.get_sample_value("loraplane_picker_prefix_requests_total", {"hit": "true"}) == 1
    assert registry.get_sample_value("loraplane_picker_prefix_requests_total", {"hit": "false"}) == 1


def test_benchmark_rows_and_the_config_without_the_scorer() -> None:
    assert Scheduler(without_prefix_scorer(EndpointPickerConfig.load())).preparer(PrefixCacheScorer) is None
    (row,) = bench_request_path((1024,), rounds=5)
    assert row["body_bytes"] == 1024 and row["blocks"] == (1024 - 60) // 64 and row["with_prefix_us"] > 0


def test_saved_prefill_score_is_seconds_over_full_score_seconds_and_capped() -> None:
    params = PrefixCacheParameters(block_size=32, prefill_seconds_per_token=1e-4, full_score_seconds=0.05)
    scorer = PrefixCacheScorer(params, clock=Clock())
    snapshot = pool()
    short, long = scorer.hash_text("claims@v17", D17, SYSTEM), scorer.hash_text("claims@v17", D17, SYSTEM * 4)
    scorer.routed(short, "10.0.0.1:8000")
    request = SchedulingRequest("claims@v17", D17, prefix=long)
    cycle = _cycle(scorer, request, snapshot)
    score = scorer(request, snapshot, cycle)
    saved = len(short.hashes) * 32 / 4 * 1e-4  # matched blocks -> tokens -> seconds (17 blocks: 13.6 ms)
    assert score is not None and score.tolist() == pytest.approx([saved / 0.05, 0.0])
    scorer.routed(long, "10.0.0.2:8000")  # 4 x the blocks: 54 ms saved, more than 50 ms scores 1
    cycle = _cycle(scorer, request, snapshot)
    score = scorer(request, snapshot, cycle)
    assert score is not None and score.tolist() == pytest.approx([saved / 0.05, 1.0])
    # over 1 s the whole prompt's 54 ms scores 0.054: below a share floor of 0.5, which then scores each share
    floored = PrefixCacheScorer(params.model_copy(update={"full_score_seconds": 1.0, "share_floor": 0.5}))
    score = floored(request, snapshot, _cycle(scorer, request, snapshot))
    share = len(short.hashes) / len(long.hashes)
    assert score is not None and score.tolist() == pytest.approx([0.5 * share, 0.5])
    fresh = scorer.hash_text("claims@v17", D17, "no one routed this prompt " * 8)
    request = SchedulingRequest("claims@v17", D17, prefix=fresh)
    assert scorer(request, snapshot, _cycle(scorer, request, snapshot)) is None  # no hit anywhere: no score


def _awaiting_first_token(snapshot: PoolSnapshot, counts: tuple[int, int]) -> PoolSnapshot:
    tracker = InFlightTracker()
    for i, count in enumerate(counts):
        for _ in range(count):
            # in flight, no first token yet; a 1,000-token prompt: 0.1 s of prefill, one request of the queue scorer
            tracker.start(snapshot.addresses[i], "claims@v17", prompt_tokens=1_000)
    tracker.attach(snapshot)
    return snapshot


@pytest.mark.parametrize(("repeats", "behind"), [(32, 2), (1, 2), (32, 12)])
def test_a_prefix_hit_wins_over_a_shorter_first_token_queue_only_when_it_saves_more_than_the_wait(
        repeats: int, behind: int) -> None:
    """The default profile: pod-0 holds the whole prompt; pod-1 has ``behind`` fewer requests awaiting their first
    token. At the prefix scorer's weight equal to the prefill-queue-scorer's, one such request is worth
    ``fullScoreSeconds / capacity`` of saved prefill (50 ms): pod-0 wins when its hit saves more than ``behind`` of
    those (a 16 KiB prompt: 0.41 s against 0.1 s), and loses when it saves less (against 0.6 s; a 540-byte prompt,
    13 ms, scores its share floor, 10 points, against 20)."""
    config = EndpointPickerConfig.load()
    weights = {ref.plugin_ref: ref.weight for ref in config.scheduling_profiles[0].plugins}
    scheduler, lifecycle = default_scheduler()
    scorer = scheduler.preparer(PrefixCacheScorer)
    assert scorer is not None
    params = scorer.params
    assert params.prefill_seconds_per_token is not None
    capacity = next(p for p in config.plugins if p.type == "prefill-queue-scorer").parameters["capacity"]
    prompt = {"model": "claims", "prompt": SYSTEM * repeats}
    prefix = scorer.hash_request("claims@v17", D17, prompt)
    assert prefix is not None
    saved = len(prefix.hashes) * params.block_size / params.bytes_per_token * params.prefill_seconds_per_token
    prefix_points = weights["prefix-cache-scorer"] * min(1.0, max(saved / params.full_score_seconds,
                                                                  params.share_floor))
    queue_points = weights["prefill-queue-scorer"] * behind / capacity
    first = send(scheduler, lifecycle, _awaiting_first_token(pool(), (0, behind + 1)), "claims@v17", D17, prompt)
    assert first == "10.0.0.1:8000"  # the first time, the shorter queue
    # now pod-0 holds the prompt and has ``behind`` more awaiting their first token than pod-1
    second = send(scheduler, lifecycle, _awaiting_first_token(pool(), (behind + 1, 1)), "claims@v17", D17, prompt)
    assert second == ("10.0.0.1:8000" if prefix_points > queue_points else "10.0.0.2:8000")
    assert (prefix_points > queue_points) == (repeats == 32 and behind == 2)  # the cases test both sides


def test_the_prefill_queue_counts_only_the_prompt_the_chosen_pod_is_expected_to_hold() -> None:
    # a turn of a conversation whose history its pod holds waits for the prefill of its new tokens only: counting
    # its whole prompt made pods serving long conversations look busy and sent turns away from their history
    ctx, state = make_context()
    data = orjson.dumps({"model": "claims", "prompt": SYSTEM})
    estimate = len(data) // 4
    handlers = []
    for _ in range(2):  # both stay in flight, before their first token
        handler = ExtProcHandler(ctx)
        handler.on_message(headers(REQUEST_HEADERS).SerializeToString())
        handler.on_message(body(data).SerializeToString())
        handlers.append(handler)
    first, second = (h.exchange.director.destination for h in handlers)
    assert first == second  # the second went to the prefix
    held = len(SYSTEM.encode()) // 64 * 64 // 4  # the matched blocks (64 bytes, 4 bytes a token)
    assert 0 < held < estimate
    tokens = state.snapshot.prefill_tokens[state.snapshot.index_by_address[first]]
    assert tokens == estimate + (estimate - held)
    for handler in handlers:
        handler.on_close()
    assert state.snapshot.prefill_tokens.sum() == 0
