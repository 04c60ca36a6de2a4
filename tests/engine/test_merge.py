"""Dynamic merge in the engine: the policy, exactness against transformers + peft, a base that never moves, metrics."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Hashable
from pathlib import Path

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from loraplane.engine.app import BuiltEngine, EngineOptions
from loraplane.engine.core import Engine, Request, SamplingParams
from loraplane.engine.merging import MergeConfig, MergePolicy
from loraplane.engine.model import PRESETS, LlamaModel, seeded_weights
from loraplane.kernels.peft import load_peft_adapter
from tests.engine.helpers import GeneratedAdapter, inprocess

A, B = "adapter-a", "adapter-b"


# --- the policy on its own ------------------------------------------------------------------------------------------
Rows = dict[Hashable | None, int]
Cost = Callable[[bool, Rows], float]


def _paying(used: bool, rows: Rows) -> float:
    return 0.006 if used else 0.010


def _run(policy: MergePolicy, steps: int, rows: Rows, held: set[Hashable], cost: Cost = _paying,
         room: int = 2, uses: list[bool] | None = None) -> list[tuple[int, str, Hashable]]:
    """Drive the policy like the engine: decide, apply, time a decode step at ``cost``; the switches."""
    switches = []
    for _ in range(steps):
        decision = policy.decide(rows, frozenset(held), room - len(held))
        for key in decision.unmerge:
            held.discard(key)
            switches.append((policy.step, "unmerge", key))
        for key in decision.merge:
            held.add(key)
            policy.switched(0.001)
            switches.append((policy.step, "merge", key))
        if uses is not None:
            uses.append(decision.use)
        for key in policy.record(rows, frozenset(held), decision.use, cost(decision.use, rows), decode=True).unmerge:
            held.discard(key)
            switches.append((policy.step, "unmerge", key))
    return switches


def test_policy_probes_a_dominant_adapter_by_alternating_steps_and_keeps_it_merged_where_it_pays() -> None:
    policy = MergePolicy(MergeConfig(window=16, probe_steps=8))
    held: set[Hashable] = set()
    uses: list[bool] = []
    switches = _run(policy, 60, {A: 8}, held, uses=uses)
    assert switches == [(16, "merge", A)]  # a full window of dominance
    assert uses[15:31] == [True, False] * 8  # the probe: with and without the copy, paired
    assert all(uses[31:]) and held == {A}
    assert policy.verdicts_json() == [{"adapters": 1, "rank": 0, "rows": 8, "pure": True, "pays": True,
                                       "merged_over_unmerged": 0.6, "unmerged_ms": 10.0, "merged_ms": 6.0}]


def test_policy_unmerges_where_merged_steps_are_not_faster_and_does_not_retry_soon() -> None:
    policy = MergePolicy(MergeConfig(window=16, probe_steps=8, retry_steps=500))
    held: set[Hashable] = set()
    flat: Cost = lambda used, rows: 0.0099 if used else 0.010  # noqa: E731  # 1 %: under min_gain
    switches = _run(policy, 300, {A: 8}, held, flat)
    assert switches == [(16, "merge", A), (31, "unmerge", A)]
    assert not held
    later = _run(policy, 300, {A: 8}, held, flat)
    assert [s[1] for s in later] == ["merge", "unmerge"] and later[0][0] >= 31 + 500  # measured again, once


def test_policy_serves_pure_steps_merged_and_mixed_steps_unmerged_from_one_copy() -> None:
    policy = MergePolicy(MergeConfig(window=16, probe_steps=4, enter_share=0.8))
    held: set[Hashable] = set()
    pure_pays: Cost = lambda used, rows: (0.006 if None not in rows else 0.012) if used else 0.010  # noqa: E731
    _run(policy, 40, {A: 8}, held, pure_pays)
    uses: list[bool] = []
    switches = _run(policy, 30, {A: 7, None: 1}, held, pure_pays, uses=uses)
    assert not switches and held == {A}  # still dominant: the copy stays
    assert uses[:8] == [True, False] * 4 and not any(uses[8:])  # probed, then served unmerged
    uses = []
    _run(policy, 5, {A: 8}, held, pure_pays, uses=uses)
    assert all(uses)
    assert {(v["pure"], v["pays"]) for v in policy.verdicts_json()} == {(True, True), (False, False)}


def test_policy_hysteresis_keeps_a_merged_adapter_through_a_dip_and_leaves_on_a_change() -> None:
    policy = MergePolicy(MergeConfig(window=16, probe_steps=8))
    held: set[Hashable] = set()
    _run(policy, 40, {A: 8}, held)
    dip = _run(policy, 6, {A: 6, B: 2}, held)  # 75 %: under enter_share, over exit_share
    assert not dip and held == {A}
    flapping = []
    for n in itertools.islice(itertools.cycle([8, 7]), 100):  # 87.5 % / 100 %: around enter_share
        flapping += _run(policy, 1, {A: n, B: 8 - n}, held)
    assert not flapping and held == {A}
    change = _run(policy, 40, {A: 1, B: 7}, held)
    assert change[0][1:] == ("unmerge", A)


def test_policy_merges_two_adapters_only_with_room_for_two() -> None:
    policy = MergePolicy(MergeConfig(window=8, probe_steps=4))
    assert not _run(policy, 40, {A: 4, B: 3, None: 1}, set())  # together 87.5 %: under enter_share
    policy = MergePolicy(MergeConfig(window=8, probe_steps=4))
    held: set[Hashable] = set()
    _run(policy, 40, {A: 5, B: 5}, held)
    assert held == {A, B}
    policy = MergePolicy(MergeConfig(window=8, probe_steps=4))
    assert not _run(policy, 40, {A: 5, B: 5}, set(), room=1)  # memory for one copy only


def test_policy_force_and_off() -> None:
    force = MergePolicy(MergeConfig(mode="force", max_merged=1))
    decision = force.decide({A: 2, B: 5, None: 3}, frozenset({A}), room=0)
    assert decision.merge == [B] and decision.unmerge == [A] and decision.use
    off = MergePolicy(MergeConfig(mode="off"))
    decision = off.decide({A: 8}, frozenset({A}), room=1)
    assert decision.unmerge == [A] and not decision.use
    with pytest.raises(ValueError, match="--lora-merge"):
        MergeConfig(mode="sometimes")


# --- exactness ------------------------------------------------------------------------------------------------------
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
PROMPTS = [[1, 72, 101, 108, 108, 111], [1, 3, 44, 32, 119, 111, 114], [1, 200, 17, 9], [1, 64, 65, 66, 67, 68]]
NEW_TOKENS = 8
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Path], dict[tuple[str | None, int], list[int]]]:
    """A transformers Llama directory, two PEFT adapters on it, and transformers + peft's greedy tokens of every
    prompt with each adapter and without."""
    root = tmp_path_factory.mktemp("merge-reference")
    torch.manual_seed(4321)
    config = transformers.LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                      bos_token_id=1, eos_token_id=2)
    hf = transformers.LlamaForCausalLM(config).eval()
    hf.save_pretrained(root / "model")
    lora = {A: dict(r=8, lora_alpha=16, target_modules=TARGETS),
            B: dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"])}
    model = None
    for name, kwargs in lora.items():
        lora_config = peft.LoraConfig(init_lora_weights=False, lora_dropout=0.0, **kwargs)
        model = peft.get_peft_model(hf, lora_config, adapter_name=name) if model is None else model
        if name != A:
            model.add_adapter(name, lora_config)
    assert model is not None
    model.eval()
    with torch.no_grad():  # deltas that change greedy tokens
        for param_name, param in model.named_parameters():
            if "lora_B" in param_name:
                param.mul_(8.0)
    paths = {}
    for name in lora:
        model.save_pretrained(str(root / "adapters"), selected_adapters=[name])
        paths[name] = root / "adapters" / name if (root / "adapters" / name).is_dir() else root / "adapters"

    def greedy(prompt: list[int]) -> list[int]:
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)
        return [int(t) for t in out[0, len(prompt):]]

    expected: dict[tuple[str | None, int], list[int]] = {}
    for index, prompt in enumerate(PROMPTS):
        with model.disable_adapter():
            expected[(None, index)] = greedy(prompt)
        for name in lora:
            model.set_adapter(name)
            expected[(name, index)] = greedy(prompt)
    for index in range(len(PROMPTS)):
        assert len({tuple(expected[(name, index)]) for name in (None, A, B)}) == 3, "every adapter must change tokens"
    return root / "model", paths, expected


async def _serve(engine: Engine, requests: list[tuple[str | None, int]]) -> list[list[int]]:
    """Submit every request before the step loop runs (one batch), then collect each one's tokens."""
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    submitted = []
    for name, index in requests:
        adapter = engine.tiers.registered[name] if name else None
        if adapter is not None:
            await engine.activate(adapter)
        submitted.append(engine.submit(PROMPTS[index], params, adapter))
    for request in submitted:
        async for _ in engine.stream(request):
            pass
    return [request.output_ids for request in submitted]


def _samples(built: BuiltEngine) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = built.engine.metrics.render().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


@pytest.mark.parametrize("max_merged", [1, 2])
async def test_greedy_tokens_equal_transformers_and_peft_with_merge_forced_on(reference, max_merged: int) -> None:
    model_dir, paths, expected = reference
    options = EngineOptions(model=str(model_dir), max_loras=2, max_lora_rank=8, lora_merge="force",
                            max_merged_loras=max_merged, lora_modules=paths)
    async with inprocess(options) as (built, _):
        engine = built.engine
        pure: list[tuple[str | None, int]] = [(A, i) for i in range(len(PROMPTS))]
        mixed: list[tuple[str | None, int]] = [(A, 0), (A, 1), (B, 2), (None, 3), (B, 0), (None, 1)]
        batches: list[list[tuple[str | None, int]]] = [pure, mixed, [(B, i) for i in range(len(PROMPTS))]]
        for batch in batches:
            tokens = await _serve(engine, batch)
            assert tokens == [expected[request] for request in batch]
        samples = _samples(built)
    assert samples[("loraplane_engine_lora_merged_steps_total", (("batch", "pure"),))] > 0
    assert samples[("loraplane_engine_lora_merged_steps_total", (("batch", "mixed"),))] > 0  # base or B unmerged
    assert samples[("loraplane_engine_lora_merges_total", (("action", "merge"),))] >= 2
    assert samples[("loraplane_engine_lora_merged_rows_total", ())] > 0


def test_a_thousand_merge_cycles_leave_the_engine_base_weights_bitwise_equal(tiny_adapters: list[GeneratedAdapter]) -> None:
    for dtype in (torch.float32, torch.bfloat16):
        model = LlamaModel(PRESETS["tiny"], seeded_weights(PRESETS["tiny"], 0), max_loras=2, max_lora_rank=16, dtype=dtype)
        for slot in (0, 1):
            model.load_slot(slot, load_peft_adapter(tiny_adapters[slot].path))
        original = [linear.base_weight.clone() for linear in model.lora_linears()]
        nbytes = model.merge_nbytes(0)
        assert nbytes == model.merge_nbytes() > 0  # the adapter touches every projection
        for cycle in range(1000):
            slots = (0,) if cycle % 3 else (0, 1)
            for slot in slots:
                assert model.merge_slot(slot) == nbytes
            assert model.merged_nbytes() == nbytes * len(slots)
            for slot in slots:
                assert model.unmerge_slot(slot)
        assert model.merged_nbytes() == 0 and not model.merged_slots
        assert all(torch.equal(linear.base_weight, before) for linear, before in zip(model.lora_linears(), original, strict=True))


async def test_memory_caps_the_merged_copies(tiny_adapters: list[GeneratedAdapter]) -> None:
    options = EngineOptions(max_loras=2, lora_merge="force", max_merged_loras=2,
                            lora_modules={a.name: a.path for a in tiny_adapters[:2]})
    async with inprocess(options) as (built, _):
        engine = built.engine
        copy = engine.model.merge_nbytes()
        # memory_fraction 0.5 of 2.5 copies takes one copy; of the 1.5 left after it, none
        engine.available_memory = lambda _device: int(2.5 * copy) - engine.model.merged_nbytes()
        first, second = (engine.tiers.registered[a.name] for a in tiny_adapters[:2])
        params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
        for adapter in (first, second):
            await engine.activate(adapter)
        requests = [engine.submit([256, 1, 2], params, a) for a in (first, first, second)]
        for request in requests:
            async for _ in engine.stream(request):
                pass
        assert engine.merged_adapters() == [first]  # room for one copy: the adapter with more rows
        for mode, available in (("off", 0), ("force", 0)):
            engine.set_merge_mode(mode)
            engine.available_memory = lambda _device, _available=available: _available  # type: ignore[misc]
            request = engine.submit([256, 1, 2], params, second)
            async for _ in engine.stream(request):
                pass
            assert engine.merged_adapters() == []  # off unmerges; force finds no memory: served unmerged


async def test_a_merged_adapter_evicted_from_its_slot_is_unmerged_first(tiny_adapters: list[GeneratedAdapter]) -> None:
    adapters = tiny_adapters[:2]
    options = EngineOptions(max_loras=1, max_cpu_loras=2, lora_merge="force", lora_modules={a.name: a.path for a in adapters})
    async with inprocess(options) as (built, _):
        engine = built.engine
        first, second = (engine.tiers.registered[a.name] for a in adapters)
        params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
        await engine.activate(first)
        request = engine.submit([256, 5, 6, 7], params, first)
        async for _ in engine.stream(request):
            pass
        assert engine.merged_adapters() == [first]
        assert await engine.activate(second)  # takes the only slot: the merged copy of `first` goes first
        assert engine.merged_adapters() == [] and engine.model.merged_nbytes() == 0
        assert first.slot is None and second.slot == 0
        samples = _samples(built)
    assert samples[("loraplane_engine_lora_merges_total", (("action", "unmerge"),))] == 1


# --- the auto policy in the engine, on step costs it is told ------------------------------------------------------
def _step_costs(engine: Engine, merged_seconds: float, unmerged_seconds: float) -> None:
    """Make the engine's step clock read ``merged_seconds`` per step while anything is merged, else the other."""
    ticks = itertools.count()

    def clock_factory() -> Callable[[], float]:
        now = [next(ticks) * 100.0]
        readings = itertools.count()

        def clock() -> float:  # every second reading ends an interval: it took the cost of what is in use then
            if next(readings) % 2:
                now[0] += merged_seconds if engine.model.lora_context.merged_slots else unmerged_seconds
            return now[0]

        return clock

    engine._step_clock = clock_factory  # type: ignore[method-assign]


@pytest.mark.parametrize("pays", [True, False], ids=["merging-pays", "merging-does-not-pay"])
async def test_auto_merges_a_dominant_adapter_only_where_its_measurement_says_it_pays(
    tiny_adapters: list[GeneratedAdapter], pays: bool
) -> None:
    adapter_files = tiny_adapters[0]
    options = EngineOptions(max_loras=1, lora_modules={adapter_files.name: adapter_files.path})  # auto is the default
    async with inprocess(options) as (built, _):
        engine = built.engine
        assert engine.merge_config.mode == "auto"
        _step_costs(engine, 0.006 if pays else 0.0099, 0.010)
        adapter = engine.tiers.registered[adapter_files.name]
        params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
        await engine.activate(adapter)
        requests = [engine.submit([256, 10 + i, 11], params, adapter) for i in range(4)]
        await asyncio.gather(*[_drain(engine, r) for r in requests])
        samples = _samples(built)
        merged_now = engine.merged_adapters()
    merges = samples.get(("loraplane_engine_lora_merges_total", (("action", "merge"),)), 0)
    unmerges = samples.get(("loraplane_engine_lora_merges_total", (("action", "unmerge"),)), 0)
    assert merges == 1  # the probe
    if pays:
        assert merged_now == [adapter] and unmerges == 0
        assert samples[("loraplane_engine_lora_merged_adapters", (("adapter_name", adapter.name),))] == 1
        assert samples[("loraplane_engine_lora_merged_bytes", ())] > 0
    else:
        assert merged_now == [] and unmerges == 1


async def _drain(engine: Engine, request: Request) -> None:
    async for _ in engine.stream(request):
        pass

