"""The emulator as a process, started by ``start_vllm`` from vLLM's command line and environment: real HTTP,
streaming, a client that disconnects (its request aborted), adapters registered at start-up, SIGTERM."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from loraplane.emulator.tokens import expected_text
from loraplane.vllm_server import VllmOptions, VllmServer, start_vllm
from tests.emulator.conftest import digest, write_adapter, write_model


def metric(server: VllmServer, name: str, **labels: str) -> float:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and labels.items() <= sample.labels.items():
                return sample.value
    raise KeyError(name)


@pytest.fixture
def server(tmp_path: Path) -> VllmServer:
    adapter = write_adapter(tmp_path / "adapters" / "a", 8)
    options = VllmOptions(model=write_model(tmp_path / "model"), served_model_name="base", max_loras=1,
                          max_cpu_loras=2, max_model_len=4096, emulated=True, api_key="k1",
                          extra_args=("--lora-modules", f"a={adapter}", "--stream-interval", "0.05"),
                          env={"VLLM_LOGGING_LEVEL": "DEBUG"})
    started = start_vllm(options, tmp_path / "emulator.log")
    try:
        yield started.wait_ready(timeout=60)
    finally:
        started.stop()


def test_a_process_serves_streams_and_aborts_a_disconnected_client(server: VllmServer, tmp_path: Path) -> None:
    keyed = {"authorization": "Bearer k1"}
    models = httpx.get(server.url + "/v1/models", headers=keyed, timeout=10).json()["data"]
    assert [m["id"] for m in models] == ["base", "a"]  # --lora-modules: loaded at start-up
    answer = httpx.post(server.url + "/v1/completions", headers=keyed, timeout=30,
                        json={"model": "a", "prompt": "one two", "max_tokens": 4})
    assert answer.json()["choices"][0]["text"] == expected_text(digest(tmp_path / "adapters" / "a"), "one two", 4)

    # a long stream (about 24 s of decode steps): read its first chunk, then hang up
    with httpx.stream("POST", server.url + "/v1/completions", headers=keyed, timeout=30, json={
            "model": "base", "prompt": "x", "max_tokens": 2000, "stream": True}) as stream:
        lines = stream.iter_lines()  # (a dropped iterator would close the response)
        first = next(lines)
        assert first.startswith("data: {") and '"text":" w' in first
        assert metric(server, "vllm:num_requests_running") == 1
    deadline = time.monotonic() + 10
    while metric(server, "vllm:request_success_total", finished_reason="abort") < 1:
        assert time.monotonic() < deadline, "the abandoned stream was not aborted"
        time.sleep(0.1)
    assert metric(server, "vllm:num_requests_running") == 0
    assert metric(server, "vllm:kv_cache_usage_perc") == 0
    assert "Adding lora. Model id: 1, int id: 1" in server.process.log_tail(50)


def test_sigterm_stops_it_on_its_own(server: VllmServer) -> None:
    code = server.process.stop(timeout=30.0)  # SIGTERM; SIGKILL only if it is still running 30 s later
    assert code != -signal.SIGKILL and not server.process.alive(), code
