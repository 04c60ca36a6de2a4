"""The profile fit (``loraplane.emulator.fit``) on synthetic measurements: it recovers the parameters they were made
from, through noise; and ``loraplane bench profile``'s log reading. No vLLM needed."""

from __future__ import annotations

import json
import math
import random
from dataclasses import replace
from pathlib import Path

import pytest

from loraplane.api import Tier
from loraplane.emulator.calibrate import read_limits, step_of
from loraplane.emulator.client import TOGETHER_S, Timing
from loraplane.emulator.fit import (
    DecodeSample,
    LoadSample,
    Measurements,
    PrefillSample,
    fit_profile,
    front_end_ms,
    least_squares,
    prefill_steps,
)
from loraplane.sim.profile import LARGE_GPU, Profile, load_profile

TRUE = replace(LARGE_GPU, name="true", step_overhead_ms=3.2, decode_base_ms=0.0, decode_per_seq_ms=0.15,
               lora_base_ms=1.1, lora_per_adapter_ms=0.4, prefill_per_token_ms=0.02, request_overhead_ms=6.5,
               h2d_fixed_ms=2.5, h2d_ms_per_mb=0.0, disk_fixed_ms=9.0, disk_read_ms_per_mb=0.0, parse_ms_per_mb=0.0,
               max_num_seqs=128, max_batched_tokens=64, kv_capacity_tokens=2_097_152, default_adapter_bytes=131_072)


def synthetic(profile: Profile, noise: float, seed: int, repeats: int = 5) -> Measurements:
    """What a client would measure of a server that runs ``profile`` exactly, each figure off by up to +-noise."""
    rng = random.Random(seed)

    def jitter(ms: float) -> float:
        return ms * (1 + rng.uniform(-noise, noise))

    m = Measurements(max_num_seqs=profile.max_num_seqs, max_batched_tokens=profile.max_batched_tokens,
                     kv_capacity_tokens=profile.kv_capacity_tokens, adapter_bytes=profile.default_adapter_bytes)
    for _ in range(repeats):
        for batch in (1, 2, 4, 8, 16, 32):
            for adapters in (0, 1, 2, 4):
                if adapters <= batch:
                    m.decode.append(DecodeSample(batch, adapters, jitter(profile.decode_step_ms(batch, adapters))))
        for prompt in (8, 32, 64, 128, 192, 248):  # 248 tokens under a 64-token budget: 4 steps
            for adapters in (0, 1):
                steps = prefill_steps(prompt, profile.max_batched_tokens)
                ttft = (profile.request_overhead_ms + steps * profile.decode_step_ms(1, adapters)
                        + profile.prefill_per_token_ms * prompt)
                m.prefill.append(PrefillSample(prompt, adapters, jitter(ttft)))
        gpu = profile.request_overhead_ms + profile.decode_step_ms(1, 1) + profile.prefill_per_token_ms * 16
        for tier, level in ((0, Tier.GPU), (1, Tier.CPU), (2, Tier.DISK)):
            for _ in range(4):
                m.loads.append(LoadSample(tier, jitter(gpu + profile.load_ms(level, profile.default_adapter_bytes))))
    return m


def test_the_fit_recovers_the_profile_exactly_without_noise() -> None:
    profile, fits = fit_profile(synthetic(TRUE, 0.0, 0), "fitted")
    assert profile == replace(TRUE, name="fitted")
    for fit in fits.values():
        assert fit["residual_rms"] == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_fit_recovers_the_profile_through_noise(seed: int) -> None:
    profile, fits = fit_profile(synthetic(TRUE, 0.05, seed), "fitted")
    for name in ("decode_per_seq_ms", "lora_base_ms", "lora_per_adapter_ms", "request_overhead_ms", "h2d_fixed_ms",
                 "disk_fixed_ms"):
        assert getattr(profile, name) == pytest.approx(getattr(TRUE, name), rel=0.25, abs=0.1), name
    assert profile.step_overhead_ms + profile.decode_base_ms == pytest.approx(3.2, rel=0.1)
    assert profile.prefill_per_token_ms == pytest.approx(0.02, abs=0.01)
    for n in (1, 8, 32):
        for a in (0, 1, 4):
            assert profile.decode_step_ms(n, a) == pytest.approx(TRUE.decode_step_ms(n, a), rel=0.05)
    assert 0 < fits["decode_tpot_ms"]["residual_rms_rel"] < 0.05
    assert fits["decode_tpot_ms"]["n"] == 5 * 21 and fits["loads_ttft_ms"]["n"] == 5 * 12


def test_least_squares_keeps_coefficients_non_negative() -> None:
    # y = 2 + 0 x, with noise that an unconstrained fit turns into a negative slope
    fit = least_squares(("c", "slope"), [[1, 0], [1, 1], [1, 2], [1, 3]], [2.2, 2.1, 1.9, 1.8])
    assert fit.coef["slope"] == 0.0 and fit.coef["c"] == pytest.approx(2.0)
    free = least_squares(("c", "slope"), [[1, 0], [1, 1], [1, 2], [1, 3]], [2.2, 2.1, 1.9, 1.8], nonnegative=False)
    assert free.coef["slope"] < 0
    unused = least_squares(("c", "never"), [[1, 0], [1, 0]], [3.0, 5.0])
    assert unused.coef == {"c": pytest.approx(4.0), "never": 0.0} and unused.summary()["residual_rms"] == 1.0


def test_a_fitted_profile_saved_as_bench_profile_writes_it_loads(tmp_path: Path) -> None:
    profile, fits = fit_profile(synthetic(TRUE, 0.02, 4), "my-pod")
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"profile": profile.to_dict(), "measurement": {"note": "synthetic"}, "fit": fits}))
    assert load_profile(str(path)) == profile


VLLM_LOG = """\
(APIServer pid=1) DEBUG 12-06 00:07:42 [engine/arg_utils.py:3172] Defaulting max_num_batched_tokens to 2048 for \
OPENAI_API_SERVER usage context.
(APIServer pid=1) DEBUG 12-06 00:07:42 [engine/arg_utils.py:3182] Defaulting max_num_seqs to 128 for \
OPENAI_API_SERVER usage context.
(EngineCore pid=2) INFO 12-06 00:09:11 [v1/core/kv_cache_utils.py:2327] CPU KV cache size: 2,097,152 tokens, \
Maximum concurrency for 256 tokens per request: 8192.00x
"""
EMULATOR_LOG = """\
INFO 12-06 00:20:01 [loraplane.emulator] GPU KV cache size: 400,000 tokens
INFO 12-06 00:20:01 [loraplane.emulator] max_num_batched_tokens 8192, max_num_seqs 256
"""


def test_limits_are_read_from_either_runtimes_log_and_flags_win() -> None:
    assert read_limits(VLLM_LOG, []) == {"kv_capacity_tokens": 2_097_152, "max_batched_tokens": 2048,
                                         "max_num_seqs": 128, "long_prefill_token_threshold": 0}
    assert read_limits(EMULATOR_LOG, ["--max-num-batched-tokens", "512"])["max_batched_tokens"] == 512
    assert read_limits(EMULATOR_LOG, [])["kv_capacity_tokens"] == 400_000
    with pytest.raises(RuntimeError, match="kv_capacity_tokens"):
        read_limits("nothing", [])


def test_an_outlier_from_a_burst_of_other_work_is_dropped_and_counted() -> None:
    rows = [[1, x] for x in range(12)]
    observed = [2.0 + x + (0.01 if x % 2 else -0.01) for x in range(12)]
    observed[5] += 40.0  # the machine was busy for this one
    fit = least_squares(("c", "slope"), rows, observed)
    assert fit.dropped == 1 and fit.coef["slope"] == pytest.approx(1.0, abs=0.01)
    assert fit.summary()["dropped_outliers"] == 1 and len(fit.residuals) == 11
    assert least_squares(("c", "slope"), rows, observed, trim=0).coef["slope"] != pytest.approx(1.0, abs=0.01)


def timing(gaps_ms: list[float]) -> Timing:
    """A stream whose tokens after the first came ``gaps_ms`` apart (those under ``TOGETHER_S`` together)."""
    t = Timing(status=200, ttft_s=0.02, tokens=len(gaps_ms) + 1, together=sum(g / 1000 < TOGETHER_S for g in gaps_ms))
    t.last_token_s = t.ttft_s + sum(gaps_ms) / 1000
    return t


def test_a_decode_step_is_the_median_time_per_token_of_the_streams_not_held_up() -> None:
    steady = [4.0] * 60
    released = [4.0] * 20 + [80.0] + [0.3] * 39  # held up mid-way, let go in a burst: it still ends on time
    held = [0.0] * 60  # its first token came with all the others, at the end: it says nothing of the steps
    assert step_of([timing(steady), timing(steady), timing(held), timing(held), timing(held)]) == pytest.approx(4.0)
    assert step_of([timing(steady), timing(released), timing(steady)]) == pytest.approx(4.0)
    assert math.isnan(step_of([timing(held)]))
    coalesced = [0.0, 0.0, 0.0, 12.0] * 15  # an engine that outruns its API server: four tokens a chunk
    assert math.isnan(step_of([timing(coalesced)] * 3))
    assert step_of([timing(coalesced)] * 3, held_up=True) == pytest.approx(3.0)


def test_the_emulators_own_front_end_is_fitted_from_its_ttfts() -> None:
    # the emulator runs TRUE with no request overhead; its HTTP front end and the client add 2.5 ms to every TTFT
    bare = replace(TRUE, request_overhead_ms=0.0)
    front = 2.5
    samples = [PrefillSample(s.prompt_tokens, s.adapters, s.ttft_ms + front)
               for s in synthetic(bare, 0.0, 0, repeats=2).prefill]
    fit = front_end_ms(samples, bare)
    assert fit.coef["request_overhead_ms"] == pytest.approx(front)
    assert fit.coef["prefill_per_token_ms"] == pytest.approx(TRUE.prefill_per_token_ms)
