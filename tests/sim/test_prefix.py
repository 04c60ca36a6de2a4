"""The simulator's prefix caches: the per-pod block LRU, prefill of the unmatched suffix, traces with prefix
structure (scenario and CSV columns) and the ``prefix_hit_rate`` accounting."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from loraplane.picker.prefix import PrefixCacheScorer, without_prefix_scorer
from loraplane.picker.scheduler import EndpointPickerConfig, Scheduler
from loraplane.sim.cli import main as sim_main
from loraplane.sim.cluster import SimConfig, Simulator
from loraplane.sim.metrics import prefix_hit_rate, summarize
from loraplane.sim.policies import build_policy, picker_config_for
from loraplane.sim.prefix import BLOCK_TOKENS, PickerPrefixSignal, PodPrefixCaches, PrefixCache
from loraplane.sim.profile import LARGE_GPU
from loraplane.sim.runner import without_burst
from loraplane.sim.trace import Adapter, Tenant, Trace, TraceError, load_csv, scenario
from tests.sim.conftest import ADAPTER_BYTES, free_loads

B = BLOCK_TOKENS


def chat(rows: list[tuple[float, int, int, int, int, int, int]], adapters: int = 2) -> Trace:
    """A trace of (arrival, adapter, input, output, group, group tokens, session) rows."""
    table = [Adapter(f"a{i}@v1", 0, ADAPTER_BYTES) for i in range(adapters)]
    return Trace(
        name="chat",
        tenants=[Tenant("t")],
        adapters=table,
        arrival=[r[0] for r in rows],
        adapter=[r[1] for r in rows],
        tenant=[0] * len(rows),
        input_tokens=[r[2] for r in rows],
        output_tokens=[r[3] for r in rows],
        prefix_group=[r[4] for r in rows],
        prefix_tokens=[r[5] for r in rows],
        session=[r[6] for r in rows],
    )


def test_cache_keeps_leading_blocks_and_evicts_least_recent_tails_first() -> None:
    cache = PrefixCache()
    cache.touch(1, 10)
    cache.touch(2, 5)
    cache.touch(1, 4)  # fewer blocks than held: keeps 10, now the most recent
    assert (cache.held(1), cache.held(2), cache.blocks) == (10, 5, 15)
    assert cache.trim(12) == 3
    assert (cache.held(1), cache.held(2)) == (10, 2)  # segment 2 was least recent: its tail went first
    assert cache.trim(4) == 8
    assert (cache.held(1), cache.held(2), cache.blocks) == (4, 0, 4)


def test_match_is_keyed_by_adapter_group_and_session() -> None:
    trace = chat([
        (0.0, 0, 1000, 200, 0, 640, 0),   # session 0, turn 1
        (10.0, 0, 1300, 50, 0, 640, 0),   # session 0, turn 2: turn 1's prompt + answer + 100 new tokens
        (11.0, 0, 900, 50, 0, 640, 1),    # another session of the same group and adapter
        (12.0, 1, 1300, 50, 0, 640, 0),   # the same text under another adapter (revision)
    ])  # fmt: skip
    caches = PodPrefixCaches(trace, LARGE_GPU, pods=2)
    assert caches.match(0, 0) == 0
    caches.admitted(0, 0, kv_reserved=1200)
    caches.finished(0, 0, kv_reserved=0)
    assert caches.match(0, 1) == (1200 // B) * B  # the whole of turn 1's prompt and answer, in full blocks
    assert caches.match(1, 1) == 0  # another pod
    assert caches.match(0, 2) == 640  # only the group's system prompt
    assert caches.match(0, 3) == 0  # a prefix cached for a0 is no hit for a1


def test_a_hit_never_covers_the_last_prompt_token_and_a_cold_group_blocks_the_session() -> None:
    trace = chat([(0.0, 0, 64, 32, 0, 32, 0), (1.0, 0, 96, 8, 0, 32, 0)])
    caches = PodPrefixCaches(trace, LARGE_GPU, pods=1)
    caches.admitted(0, 0, kv_reserved=0)
    assert caches.match(0, 0) == 63  # fully cached prompt: vLLM still computes its last token
    caches.finished(0, 0, kv_reserved=0)
    assert caches.match(0, 1) == 95
    caches.caches[0].trim(caches.caches[0].blocks - caches.caches[0].held(0))  # evict the group's blocks only
    assert caches.caches[0].held(0) == 0 and caches.match(0, 1) == 0


def test_cache_capacity_is_the_kv_no_running_request_reserved() -> None:
    trace = chat([(float(i), 0, 8000, 8, -1, 0, i) for i in range(4)])
    caches = PodPrefixCaches(trace, LARGE_GPU, pods=1)
    capacity = LARGE_GPU.kv_capacity_tokens // B
    for rid in range(4):
        caches.admitted(0, rid, kv_reserved=0)
    assert caches.caches[0].blocks == 4 * 500 and caches.evicted == 0
    caches.admitted(0, 0, kv_reserved=(capacity - 1000) * B)  # a nearly full pod leaves room for 1,000 blocks
    assert caches.caches[0].blocks == 1000 and caches.evicted == 1000
    assert caches.caches[0].held(trace_tail(caches, 0)) == 500  # the most recently used survives whole


def trace_tail(caches: PodPrefixCaches, rid: int) -> int:
    return caches.layout.segments(rid)[2]


def run(trace: Trace, policy: str = "least-request", pods: int = 1, picker_config: Path | None = None) -> Simulator:
    profile = free_loads()
    config = SimConfig(pods=pods)
    built = build_policy(policy, 0, trace, profile, config, picker_config)
    sim = Simulator(trace, config, profile, built.router, built.eviction, built.placement,
                    counted_tokens=built.counted_tokens)
    sim.run()
    return sim


def test_only_the_unmatched_suffix_is_prefilled() -> None:
    # the second turn arrives on an idle pod after the first finished: its TTFT is one step plus the prefill of
    # the tokens its pod's cache does not hold
    rows = [(0.0, 0, 2000, 100, 0, 1000, 0), (60.0, 0, 2200, 10, 0, 1000, 0)]
    sim = run(chat(rows))
    res = sim.result
    cached = (2100 // B) * B
    assert list(res.cached_tokens) == [0, cached]
    step = LARGE_GPU.decode_step_ms(1, 1) / 1e3
    prefill = LARGE_GPU.prefill_per_token_ms / 1e3
    assert res.ttft[0] == pytest.approx(step + 2000 * prefill)
    assert res.ttft[1] == pytest.approx(step + (2200 - cached) * prefill)
    # without the prefix columns the same requests prefill everything
    plain = chat(rows)
    plain.prefix_group = plain.prefix_tokens = plain.session = None
    base = run(plain).result
    assert base.ttft[1] == pytest.approx(step + 2200 * prefill) and list(base.cached_tokens) == [0, 0]


def test_prefix_hit_rate_is_cached_over_prompt_tokens_of_served_requests() -> None:
    rows = [(0.0, 0, 2000, 100, 0, 1000, 0), (60.0, 0, 2200, 10, 0, 1000, 0), (61.0, 1, 500, 10, -1, 0, -1)]
    sim = run(chat(rows))
    cached = (2100 // B) * B
    assert prefix_hit_rate(sim.result) == round(cached / (2000 + 2200 + 500), 4)
    summary = summarize(sim.result, sim.config, 1)
    assert summary["prefix_hit_rate"] == prefix_hit_rate(sim.result)
    plain = scenario("gie-multilora", 300, seed=0, adapter_bytes=ADAPTER_BYTES)
    assert summarize(run(plain).result, SimConfig(pods=1), 1)["prefix_hit_rate"] == 0.0


def test_prefix_chat_sessions_grow_turn_by_turn() -> None:
    trace = scenario("prefix-chat", 3000, seed=1, adapter_bytes=ADAPTER_BYTES)
    assert trace.has_prefixes and len(trace) == 3000 and trace.arrival == sorted(trace.arrival)
    assert trace.session is not None and trace.prefix_tokens is not None and trace.prefix_group is not None
    last: dict[int, int] = {}
    grew = 0
    for rid, s in enumerate(trace.session):
        assert trace.prefix_group[rid] == trace.tenant[rid]
        assert trace.prefix_tokens[rid] < trace.input_tokens[rid] <= 8192
        if s in last:
            prev = last[s]
            assert trace.adapter[rid] == trace.adapter[prev]
            assert trace.input_tokens[rid] > trace.input_tokens[prev] + trace.output_tokens[prev]
            grew += 1
        last[s] = rid
    assert grew > len(trace) / 2  # most requests are later turns


def test_csv_prefix_columns_round_trip_and_stay_optional(tmp_path: Path) -> None:
    trace = scenario("prefix-chat", 400, seed=2, adapter_bytes=ADAPTER_BYTES)
    path = tmp_path / "chat.csv"
    path.write_text(trace.to_csv())
    back = load_csv(path, ADAPTER_BYTES)
    assert back.has_prefixes and back.prefix_tokens == trace.prefix_tokens
    assert back.session is not None and trace.session is not None
    # names are renumbered in order of appearance: the partition into sessions is what must survive
    pairs = set(zip(back.session, trace.session, strict=True))
    assert len(pairs) == len(set(trace.session)) == len(set(back.session))
    old = scenario("rollout", 50, seed=2, adapter_bytes=ADAPTER_BYTES)
    path.write_text(old.to_csv())
    assert "session" not in path.read_text().splitlines()[0] and not load_csv(path, ADAPTER_BYTES).has_prefixes
    header = "timestamp,adapter,tenant,input_tokens,output_tokens,session\n"
    path.write_text(header + "0,a@v1,t,100,5,s1\n1,a@v1,t,200,5,s1\n2,a@v1,t,50,5,\n")
    only_sessions = load_csv(path, ADAPTER_BYTES)
    assert only_sessions.session == [0, 0, -1] and only_sessions.prefix_group == [-1, -1, -1]
    for bad in ("g1,,s1", "g1,101,s1", "g1,x,s1"):
        path.write_text("timestamp,adapter,tenant,input_tokens,output_tokens,prefix_group,prefix_tokens,session\n"
                        f"0,a@v1,t,100,5,{bad}\n")  # fmt: skip
        with pytest.raises(TraceError, match=r"chat.csv:2: a prefix_group needs prefix_tokens"):
            load_csv(path, ADAPTER_BYTES)


def test_routing_on_prefixes_matters_in_prefix_chat() -> None:
    trace = scenario("prefix-chat", 4000, seed=3, adapter_bytes=ADAPTER_BYTES)
    blind = run(trace, "round-robin", pods=4)
    sticky = run(trace, "gie-lora-filter", pods=4)  # adapter affinity keeps sessions on few pods
    rates = [prefix_hit_rate(s.result) for s in (blind, sticky)]
    assert 0 < rates[0] < rates[1]
    cached = np.frombuffer(sticky.result.cached_tokens, dtype=np.int32)
    assert (cached <= np.asarray(trace.input_tokens) - 1).all()


def test_llmd_prefix_follows_the_prefix_it_routed_and_is_gie_default_without_prefixes() -> None:
    # light load: a session's later turns go back to the pod its earlier turns were routed to
    trace = scenario("prefix-chat", 1500, seed=4, adapter_bytes=ADAPTER_BYTES)
    trace.arrival = [t * 20 for t in trace.arrival]  # a twentieth of the rate: queues stay empty
    sim = run(trace, "llmd-prefix", pods=4)
    assert sticky_share(trace, sim) > 0.95
    assert prefix_hit_rate(sim.result) > prefix_hit_rate(run(trace, "gie-default", pods=4).result)
    plain = scenario("gie-multilora", 2000, seed=4, adapter_bytes=ADAPTER_BYTES)
    picks = [list(run(plain, p, pods=4).result.pod) for p in ("llmd-prefix", "gie-default")]
    assert picks[0] == picks[1]


def sticky_share(trace: Trace, sim: Simulator) -> float:
    """Of the requests that continue a session, the share sent to the pod of the session's previous turn."""
    assert trace.session is not None
    previous: dict[int, int] = {}
    same = later = 0
    for rid, s in enumerate(trace.session):
        if s in previous:
            later += 1
            same += sim.result.pod[rid] == sim.result.pod[previous[s]]
        previous[s] = rid
    return same / later


def test_loraplane_runs_the_pickers_prefix_scorer_on_its_own_routing(tmp_path: Path) -> None:
    # one adapter, warm everywhere: tier affinity cannot keep a session together, only the prefix signal can
    rows = sorted(
        (s * 0.4 + turn * 12.0, 0, 1200 + 300 * turn, 100, 0, 1000, s) for s in range(150) for turn in range(5)
    )
    trace = chat(rows, adapters=1)
    path = tmp_path / "no-prefix.yaml"
    path.write_text(without_prefix_scorer(picker_config_for(free_loads())).to_yaml())
    with_scorer, without = run(trace, "loraplane", pods=4), run(trace, "loraplane", pods=4, picker_config=path)
    assert with_scorer.router.scheduler.preparer(PrefixCacheScorer) is not None
    assert without.router.scheduler.preparer(PrefixCacheScorer) is None
    assert sticky_share(trace, with_scorer) > sticky_share(trace, without) + 0.05
    assert prefix_hit_rate(with_scorer.result) > prefix_hit_rate(without.result)


def test_loraplane_counts_a_turns_prefill_queue_without_the_history_it_expects_its_pod_to_hold() -> None:
    # as the picker (``Decision.prefill_tokens``): the pods' first-token queues count what is left to prefill
    rows = [(0.0, 0, 2000, 100, 0, 1000, 0), (60.0, 0, 2200, 10, 0, 1000, 0)]
    sim = run(chat(rows, adapters=1), "loraplane", pods=2)
    counted = list(sim.counted_tokens)
    # the second turn's pod was sent the first turn's prompt (the picker never sees the answer): that much is held
    assert counted == [2000, 2200 - 2000]
    assert sim.result.pod[0] == sim.result.pod[1]


def test_picker_prefix_signal_keys_by_adapter_and_expires_on_the_simulators_clock() -> None:
    trace = chat([(0.0, 0, 2000, 10, 0, 1000, 0), (1.0, 1, 2000, 10, 0, 1000, 0)])
    scorer = Scheduler(EndpointPickerConfig.load()).preparer(PrefixCacheScorer)
    assert scorer is not None
    now = [0.0]
    signal = PickerPrefixSignal(scorer, trace, lambda: now[0])
    first, other = signal.request(0), signal.request(1)
    assert len(first.hashes) == 2000 // 16  # 64-byte blocks taken as 16 tokens each
    signal.routed(first, "10.0.0.1:8000")
    assert scorer.index.matches(first) == {"10.0.0.1:8000": 125}
    assert scorer.index.matches(other) == {}  # the same text under another adapter
    now[0] = scorer.params.ttl_seconds + 1.0
    assert scorer.index.matches(first) == {}
    precise = scorer.params.model_copy(update={"mode": "precise"})
    scorer.params = precise
    with pytest.raises(ValueError, match="approximate mode only"):
        PickerPrefixSignal(scorer, trace, lambda: 0.0)


def test_the_no_burst_companion_keeps_the_prefix_columns_aligned() -> None:
    rows = [(float(i), 0, 100 + i, 5, 0, 50, i // 3) for i in range(30)]
    trace = chat(rows)
    trace.tenants = [Tenant("t"), Tenant("b", cls="burst")]
    trace.tenant = [1 if i % 5 == 0 else 0 for i in range(30)]
    trace.burst_window = (10.0, 12.0)
    cut = without_burst(trace)
    kept = [i for i in range(30) if i % 5 != 0]
    assert cut.input_tokens == [trace.input_tokens[i] for i in kept]
    assert cut.session == [i // 3 for i in kept] and cut.prefix_group == [0] * len(kept)
    assert cut.prefix_tokens == [50] * len(kept)


def test_a_saved_prefix_trace_runs_again_from_csv(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    saved = tmp_path / "chat.csv"
    common = ["--policies", "llmd-prefix,least-request", "--pods", "4", "--jobs", "1", "--json"]
    assert sim_main(["--scenario", "prefix-chat", "--requests", "600", "--save-trace", str(saved), *common]) == 0
    generated = json.loads(capsys.readouterr().out)
    assert sim_main(["--trace", str(saved), *common]) == 0
    replayed = json.loads(capsys.readouterr().out)
    for policy in ("llmd-prefix", "least-request"):
        rate = generated["policies"][policy]["prefix_hit_rate"]
        assert rate > 0 and replayed["policies"][policy]["prefix_hit_rate"] == rate
