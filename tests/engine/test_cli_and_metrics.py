"""Commands (make-adapters, the server's flag errors, the bench's output shape) and the /metrics exposition."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from loraplane.api import adapter_digest
from loraplane.bench.engine import merge_backends
from loraplane.cli import main as loraplane_main
from loraplane.engine.app import EngineOptions
from loraplane.engine.cli import main as engine_main
from loraplane.engine.core import SamplingParams
from loraplane.kernels.peft import load_peft_adapter
from tests.engine.helpers import GeneratedAdapter, completion, inprocess


def test_make_adapters_writes_real_peft_dirs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = loraplane_main(["engine", "make-adapters", "--count", "3", "--ranks", "8,16", "--out", str(tmp_path),
                           "--targets", "q_proj,v_proj", "--prefix", "demo"])
    assert code == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(x["name"], x["rank"]) for x in lines] == [("demo-000", 8), ("demo-001", 16), ("demo-002", 8)]
    for line in lines:
        assert line["digest"] == adapter_digest(Path(line["path"]))
        adapter = load_peft_adapter(line["path"])
        assert adapter.max_rank == line["rank"]
        assert {m.rsplit(".", 1)[-1] for m in adapter.modules} == {"q_proj", "v_proj"}
        assert all(m.lora_b.abs().sum() > 0 for m in adapter.modules.values())
    assert loraplane_main(["engine", "make-adapters", "--out", str(tmp_path), "--targets", "lm_head"]) == 2


def test_engine_refuses_bad_flags_clearly(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert engine_main(["--model", str(tmp_path / "missing")]) == 2
    assert "neither a preset" in capsys.readouterr().err
    assert engine_main(["--max-loras", "4", "--max-cpu-loras", "2"]) == 2
    assert "max_cpu_loras" in capsys.readouterr().err


async def test_metrics_follow_the_vllm_names(tiny_adapters: list[GeneratedAdapter]) -> None:
    adapters = tiny_adapters[:3]
    options = EngineOptions(max_loras=2, max_cpu_loras=2, lora_modules={a.name: a.path for a in adapters})
    async with inprocess(options) as (built, http):
        for adapter in (adapters[2], adapters[0], adapters[1]):  # in the host cache (L1), then two from disk (L2)
            assert (await http.post("/v1/completions", json=completion(adapter.name, "hi", 2))).status_code == 200
        await http.post("/admin/adapters/" + adapters[2].name + "/pin")
        queued = built.engine.submit([256, 1], SamplingParams(max_tokens=2, temperature=0),
                                     built.engine.tiers.registered[adapters[1].name])
        text = (await http.get("/metrics")).text  # scraped before the step loop ran: the request is waiting
        resident = {(a.name, a.tier.value, str(a.pinned).lower()) for a in built.engine.tiers.registered.values()
                    if a.tier.value in ("gpu", "cpu")}
        async for _ in built.engine.stream(queued):
            pass
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    by_name: dict[str, list[tuple[dict[str, str], float]]] = {}
    for (name, labels), value in samples.items():
        by_name.setdefault(name, []).append((dict(labels), value))
    assert by_name["vllm:num_requests_waiting"][0][1] == 1
    assert by_name["vllm:num_requests_running"][0][1] == 0
    assert 0 <= by_name["vllm:kv_cache_usage_perc"][0][1] <= 1
    [(info_labels, info_value)] = by_name["vllm:lora_requests_info"]
    assert info_labels == {"max_lora": "2", "running_lora_adapters": "", "waiting_lora_adapters": adapters[1].name}
    assert info_value > 1e9  # a unix timestamp
    loaded = {(labels["adapter_name"], labels["level"], labels["pinned"]) for labels, _ in by_name["vllm:lora_adapter_loaded"]}
    assert (adapters[2].name, "gpu", "true") in loaded
    assert loaded == resident and len(loaded) == 2  # the third adapter is on disk: not reported as loaded
    ttft_tiers = {labels["tier"] for labels, _ in by_name["loraplane_engine_time_to_first_token_seconds_count"]}
    assert {"L1", "L2"} <= ttft_tiers
    stages = {labels["stage"] for labels, _ in by_name["loraplane_engine_adapter_load_seconds_count"]}
    assert stages == {"disk_read", "parse", "host_to_device"}
    weight_bytes = {labels["tier"]: value for labels, value in by_name["loraplane_engine_adapter_weight_bytes"]}
    assert weight_bytes["gpu"] > 0 and weight_bytes["cpu"] >= weight_bytes["gpu"]
    assert by_name["loraplane_engine_lora_slot_bytes"][0][1] > 0
    assert by_name["process_resident_memory_bytes"][0][1] > 0
    assert by_name["vllm:time_to_first_token_seconds_count"][0][1] == 3


@pytest.mark.slow
def test_bench_prints_one_json_object(capsys: pytest.CaptureFixture[str]) -> None:
    code = loraplane_main(["bench", "engine", "--json", "--model", "tiny", "--trials", "1", "--batch", "2",
                           "--decode-tokens", "3", "--merge-ranks", "16,64", "--merge-dtypes", "float32,bfloat16",
                           "--merge-repeats", "1", "--auto-runs", "1"])
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result["ttft_ms"]) == {"L0", "L1", "L2"}
    assert set(result["load_stages_ms"]) == {"disk_read", "parse", "host_to_device"}
    assert set(result["decode_tokens_per_s"]) == {"base", "1_adapter", "2_adapters"}
    cases = result["merge"]["cases"]
    assert {(c["backend"], c["dtype"], c["rank"]) for c in cases} == {
        (backend, dtype, rank) for backend in merge_backends("cpu") for dtype in ("float32", "bfloat16") for rank in (16, 64)}
    for case in cases:
        for shape in ("pure", "mixed"):
            figures = case[shape]
            assert figures["merged_tokens_per_s"] > 0 and figures["unmerged_tokens_per_s"] > 0
            assert figures["merged_over_unmerged"] == round(figures["merged_tokens_per_s"] / figures["unmerged_tokens_per_s"], 3)
            assert figures["merged_over_unmerged_cpu"] > 0
        assert case["merge_ms"] > 0 and case["merged_mib"] > 0
        assert isinstance(case["auto"]["pure_held_at_end"], bool) and len(case["auto"]["mixed_tokens_per_s"]) == 1
