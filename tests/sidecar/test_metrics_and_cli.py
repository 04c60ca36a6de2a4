"""Metrics cardinality (top-K per adapter, tenant folds), vLLM metric parsing, and the command line."""

from __future__ import annotations

import subprocess
import sys

import pytest

from loraplane.api import Tier
from loraplane.sidecar.cli import build_parser, main
from loraplane.sidecar.drivers.base import RuntimeInfo
from loraplane.sidecar.drivers.vllm import lora_requests, parse_metrics, pod_load
from loraplane.sidecar.metrics import OTHER, AdapterSample, SidecarMetrics


def sample_lines(text: str, name: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(name + "{")]


def test_top_k_adapters_get_labels_and_the_rest_fold_into_tenants() -> None:
    metrics = SidecarMetrics(top_k=2, reexport_residency=True)
    metrics.adapters = [
        AdapterSample("hot@v1", "acme", Tier.GPU, True, 100, 2, 1000),
        AdapterSample("warm@v1", "acme", Tier.CPU, False, 50, 0, 1000),
        AdapterSample("cold-a@v1", "acme", Tier.DISK, False, 3, 1, 500),
        AdapterSample("cold-b@v1", "acme", Tier.DISK, False, 4, 0, 500),
        AdapterSample("cold-c@v1", "zeta", Tier.DISK, False, 1, 0, 500),
    ]
    text = metrics.render().decode()
    requests = sample_lines(text, "adapter_requests_total")
    assert 'adapter_requests_total{adapter="hot@v1",tenant="acme"} 100.0' in requests
    assert f'adapter_requests_total{{adapter="{OTHER}",tenant="acme"}} 7.0' in requests
    assert f'adapter_requests_total{{adapter="{OTHER}",tenant="zeta"}} 1.0' in requests
    assert len(requests) == 4
    loaded = sample_lines(text, "vllm:lora_adapter_loaded")
    assert loaded == ['vllm:lora_adapter_loaded{adapter_name="hot@v1",level="gpu",pinned="true"} 1.0',
                      'vllm:lora_adapter_loaded{adapter_name="warm@v1",level="cpu",pinned="false"} 1.0']
    for name in ("adapter_cache_hits_total", "adapter_cache_misses_total", "adapter_resident_count",
                 "adapter_resolve_seconds", "adapter_disk_load_seconds", "adapter_remote_download_seconds",
                 "adapter_h2d_seconds", "adapter_activation_seconds", "adapter_evictions_total",
                 "adapter_reload_after_eviction_total", "adapter_thrash_ratio"):
        assert f"# TYPE {name.removesuffix('_total')}" in text, name


def test_thrash_ratio_counts_reloads_after_eviction() -> None:
    metrics = SidecarMetrics()
    for after_eviction in (False, False, True, False):
        metrics.promoted(after_eviction)
    text = metrics.render().decode()
    assert "adapter_thrash_ratio 0.25" in text and "adapter_reload_after_eviction_total 1.0" in text


def test_vllm_metrics_are_read_as_the_gie_protocol_defines_them() -> None:
    text = "\n".join([
        'vllm:num_requests_waiting{model_name="m"} 3',
        'vllm:num_requests_running{model_name="m"} 5',
        'vllm:kv_cache_usage_perc{model_name="m"} 0.42',
        'vllm:lora_requests_info{max_lora="2",running_lora_adapters="a,b",waiting_lora_adapters=""} 100.0',
        'vllm:lora_requests_info{max_lora="2",running_lora_adapters="c",waiting_lora_adapters="d"} 200.0',
        "",
    ])
    samples = parse_metrics(text)
    assert lora_requests(samples) == ({"c"}, {"d"})  # the newest series wins
    load = pod_load(samples, RuntimeInfo(base_model="m", max_loras=2, max_cpu_loras=8))
    assert (load.queue_depth, load.running, load.kv_utilization, load.max_gpu_slots) == (3, 5, 0.42, 2)


def test_flags_come_from_the_environment_too(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LORAPLANE_SIDECAR_POOL", "pool-a")
    monkeypatch.setenv("LORAPLANE_SIDECAR_CACHE_BYTES", "2G")
    monkeypatch.setenv("LORAPLANE_SIDECAR_FILE_ROOT", "/a,/b")
    args = build_parser().parse_args(["--pod", "pod-0", "--heartbeat", "0.5"])
    assert (args.pool, args.pod, args.cache_bytes, args.heartbeat) == ("pool-a", "pod-0", 2 << 30, 0.5)
    assert args.file_root == ["/a", "/b"]


def test_missing_or_bad_flags_are_clear_errors(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--pool", "pool-a"])
    assert exit_info.value.code == 2
    assert "--pod, --runtime-url, --redis-url, --cache-dir" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--pool", "Bad_Pool", "--pod", "p", "--runtime-url", "http://x", "--redis-url", "redis://x",
              "--cache-dir", "/tmp/x"])
    assert "DNS-1123" in capsys.readouterr().err


def test_console_help() -> None:
    out = subprocess.run([sys.executable, "-m", "loraplane.sidecar", "--help"], capture_output=True, text=True,
                         check=True).stdout
    assert "--runtime-url" in out and "LORAPLANE_SIDECAR_" in out


def test_the_sidecars_scrape_reads_its_series_as_the_full_parse_does_and_skips_the_rest() -> None:
    """``VllmApiDriver.scrape`` parses only ``SIDECAR_SERIES`` (the picker's, the plugin's marker and the process
    start that tells a restart); each reads as prometheus_client's parser reads it, histograms are left unread."""
    from loraplane.api import vllm_metrics
    from loraplane.api.vllm_metrics import parse_series
    from tests.picker.vllm_text import exposition

    text = exposition(waiting=3, running=2, lora_info=[(["a"], ["a"], 50.0), (["a", "b"], ["a", "b"], 90.0)],
                      loaded={"a": ("gpu", False), "b": ("cpu", True)}, max_gpu=4)
    text += ("# TYPE process_start_time_seconds gauge\nprocess_start_time_seconds 1.7654321e+09\n"
             '# TYPE loraplane_vllm_unregistered_lora_copies gauge\nloraplane_vllm_unregistered_lora_copies{level="gpu"} 1.0\n'
             "# TYPE vllm:time_to_first_token_seconds histogram\n"
             'vllm:time_to_first_token_seconds_bucket{le="0.1",model_name="base-llm"} 4.0\n'
             'vllm:time_to_first_token_seconds_bucket{le="+Inf",model_name="base-llm"} 5.0\n'
             'vllm:time_to_first_token_seconds_count{model_name="base-llm"} 5.0\n'
             'vllm:time_to_first_token_seconds_sum{model_name="base-llm"} 0.7\n')
    full, read = parse_metrics(text), parse_series(text, vllm_metrics.SIDECAR_SERIES)
    assert read == {name: full[name] for name in vllm_metrics.SIDECAR_SERIES if name in full}
    assert vllm_metrics.PROCESS_START in read and vllm_metrics.exported_by_plugin(read)
    assert lora_requests(read) == ({"a", "b"}, {"a", "b"}) and "vllm:time_to_first_token_seconds_count" not in read
