"""The kernel benchmark's case runner and command line (timings are reported, never asserted)."""

from __future__ import annotations

import time

import pytest
import torch

from loraplane.bench.kernels import Case, _useful_threads, main, run_case, time_interleaved, zipf_token_slots

FIELDS = {
    "name", "tokens", "adapters", "rank", "d_in", "d_out", "dtype", "loop_ms", "gather_bmm_ms", "sgmv_ms",
    "base_gemm_ms", "speedup_vs_loop", "speedup_vs_gather_bmm", "lora_overhead_vs_base", "bytes_ratio",
    "copy_gbps", "floor_ratio", "threads", "plan_ms", "path", "loop_cpu_ms", "sgmv_cpu_ms", "speedup_vs_loop_cpu",
}


@pytest.mark.parametrize(
    "case",
    [
        Case("tiny_decode", tokens=24, adapters=4, ranks=(8,), d_in=64, d_out=48),
        Case("tiny_prefill", tokens=64, adapters=3, ranks=(8,), d_in=64, d_out=48, seq_len=16),
        Case("tiny_mixed", tokens=24, adapters=4, ranks=(8, 16), d_in=64, d_out=48),
    ],
    ids=lambda case: case.name,
)
def test_run_case_reports_every_field(case: Case) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls on a shared machine: a second thread only waits
    try:
        result = run_case(case, torch.device("cpu"), torch.float32, rounds=2, copy_gbps=5.0)
    finally:
        torch.set_num_threads(threads)
    assert FIELDS <= set(result) and result["threads"] == 1
    assert result["path"] == ("prefill/contiguous" if case.seq_len > 1 else "decode/contiguous")
    ratio = result["loop_ms"] / result["sgmv_ms"]
    assert result["speedup_vs_loop"] == pytest.approx(ratio, rel=1e-2, abs=2e-3)
    if len(case.ranks) == 1:  # distinct adapters' A/B bytes over the base weight's bytes
        adapter_bytes = result["distinct_adapters"] * case.ranks[0] * (case.d_in + case.d_out)
        assert result["bytes_ratio"] == pytest.approx(adapter_bytes / (case.d_in * case.d_out), rel=1e-2)
    else:
        assert "sgmv_rank_padded_ms" in result
    assert ("sgmv_torch_ms" in result) == (result["backend"] == "cpu")


def test_zipf_popularity_is_skewed_and_timing_is_interleaved() -> None:
    slots = zipf_token_slots(2000, 8, torch.Generator().manual_seed(0))
    counts = [slots.count(k) for k in range(8)]
    assert counts[0] > 2 * counts[1] > 0 and counts[0] > 10 * counts[7]
    calls: list[str] = []
    variants = {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}
    timings = time_interleaved(variants, 3, torch.device("cpu"), 1, flush=lambda: calls.append("flush"))
    assert calls == ["a", "b"] + ["flush", "a", "flush", "b"] * 3  # warm-up, then a flush before every timed call
    assert set(timings) == {"a", "b"} and all(t.wall >= 0 and t.cpu >= 0 for t in timings.values())


def test_command_line_rejects_bad_options() -> None:
    with pytest.raises(SystemExit):
        main(["--threads", "0"])
    with pytest.raises(SystemExit):
        main(["--case", "nope"])
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            main(["--device", "cuda"])


@pytest.mark.parametrize(
    ("one_thread_ms", "all_cores_ms", "expected"),
    [
        ([6.0], [5.0], 2),  # a modest gain in every pair
        ([2.0], [6.0], 1),  # a second thread only waits
        ([4.0], [1.0] * 4 + [12.0] * 7, 1),  # faster on a few calls, slower in most pairs (a loaded machine)
        ([4.0] * 3 + [30.0] * 2 + [4.0] * 6, [3.0] + [5.0] * 2 + [3.0] * 8, 2),  # load bursts on a few calls
        ([5.0] * 5 + [1.0] * 6, [4.9] * 5 + [0.9] * 3 + [9.0] * 3, 1),  # wins 8 pairs narrowly, median higher
    ],
)
def test_thread_probe_needs_all_cores_to_win_most_pairs(
    one_thread_ms: list[float], all_cores_ms: list[float], expected: int
) -> None:
    calls = {1: -1, 2: -1}  # the warm-up call comes first

    def op() -> None:
        threads = torch.get_num_threads()
        pattern = one_thread_ms if threads == 1 else all_cores_ms
        time.sleep(pattern[max(calls[threads], 0) % len(pattern)] / 1e3)
        calls[threads] += 1

    threads = torch.get_num_threads()
    try:
        chosen, probe = _useful_threads(2, op, flush=lambda: None)
    finally:
        torch.set_num_threads(threads)
    assert chosen == expected and probe["pairs_won_by_all_cores"].endswith("/11")
