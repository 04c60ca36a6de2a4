"""The emulator's HTTP API in process, on a virtual clock: vLLM's dynamic LoRA API and its refusals, vLLM's adapter
semantics seen through its worker's debug lines and the residency gauges, the completion and chat bodies, stream
chunks and usage, deterministic tokens, vLLM's validation errors, ``--api-key`` and ``/metrics``."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from loraplane.emulator.engine import EngineConfig
from loraplane.emulator.tokens import encode, expected_text, expected_tokens, render
from tests.emulator.conftest import Emulator, digest, emulator


async def load(emu: Emulator, name: str, path: Path) -> Any:
    return await emu.http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})


async def complete(emu: Emulator, model: str, prompt: str = "hello world", max_tokens: int = 3, **extra: Any) -> Any:
    return await emu.http.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                                        **extra})


def samples(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    found: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    return found


async def residency(emu: Emulator) -> dict[str, str]:
    metrics = samples((await emu.http.get("/metrics")).text)
    return {labels["adapter_name"]: labels["level"] for labels, _ in metrics.get("vllm:lora_adapter_loaded", [])}


class WorkerLog:
    """The worker's LoRA cache lines ("add" = read from disk, "activate" = into a slot) since the last read."""

    def __init__(self, caplog: pytest.LogCaptureFixture) -> None:
        caplog.set_level(logging.DEBUG, logger="loraplane.emulator.worker")
        self.caplog = caplog

    def events(self) -> list[tuple[str, int]]:
        found = []
        for record in self.caplog.records:
            message = record.getMessage()
            if m := re.search(r"Adding lora\. Model id: (\d+), int id: \1", message):
                found.append(("add", int(m.group(1))))
            elif m := re.search(r"Activating LoRA\. int id: (\d+), slot index: \d+", message):
                found.append(("activate", int(m.group(1))))
        self.caplog.clear()
        return found


async def test_loads_activate_unload_keeps_the_copy_and_lru_follows_loads_and_requests(
        tmp_path: Path, adapters: dict[str, Path], caplog: pytest.LogCaptureFixture) -> None:
    """vLLM's caches (2 slots, 3 host copies), as e2e/test_vllm_driver.py walks them against real vLLM."""
    log = WorkerLog(caplog)
    async with emulator(tmp_path) as emu:
        for name in "ab":
            answer = await load(emu, name, adapters[name])
            assert (answer.status_code, answer.text) == (200, f"Success: LoRA adapter '{name}' added successfully.")
        assert log.events() == [("add", 1), ("activate", 1), ("add", 2), ("activate", 2)]
        assert await residency(emu) == {"a": "gpu", "b": "gpu"}
        await load(emu, "c", adapters["c"])  # a third load pushes a, the least recently used, out of its slot
        assert await residency(emu) == {"a": "cpu", "b": "gpu", "c": "gpu"}
        log.events()
        assert (await complete(emu, "a")).status_code == 200  # host copy -> slot: b is now the oldest
        assert log.events() == [("activate", 1)]
        assert await residency(emu) == {"a": "gpu", "b": "cpu", "c": "gpu"}
        await load(emu, "d", adapters["d"])  # a fourth copy: the host cache drops b
        assert await residency(emu) == {"a": "gpu", "c": "cpu", "d": "gpu"}
        log.events()
        await complete(emu, "b")  # read from disk again; c falls out
        assert log.events() == [("add", 2), ("activate", 2)]
        assert await residency(emu) == {"a": "cpu", "b": "gpu", "d": "gpu"}
        unload = await emu.http.post("/v1/unload_lora_adapter", json={"lora_name": "d"})
        assert (unload.status_code, unload.text) == (200, "Success: LoRA adapter 'd' removed successfully.")
        metrics = samples((await emu.http.get("/metrics")).text)
        assert metrics["vllm:num_gpu_loaded_lora_adapters"][0][1] == 2  # d's copy keeps its slot
        assert "d" not in {m["id"] for m in (await emu.http.get("/v1/models")).json()["data"]}
        await complete(emu, "a")  # a takes the unloaded copy's slot
        assert log.events() == [("activate", 1)]
        assert await residency(emu) == {"a": "gpu", "b": "gpu"}
        await load(emu, "e", adapters["e"])  # the host cache is full: the unloaded copy is the oldest and goes
        assert await residency(emu) == {"a": "gpu", "b": "cpu", "e": "gpu"}
        assert len(emu.engine.cache.host) == 3


async def test_refusals_answer_as_vllm_does(tmp_path: Path, adapters: dict[str, Path]) -> None:
    async with emulator(tmp_path) as emu:
        rank = await load(emu, "big", adapters["rank32"])
        assert rank.status_code == 500 and rank.json()["error"]["type"] == "InternalServerError"
        assert "Worker failed with error 'LoRA rank 32 is greater than max_lora_rank 16.'" in rank.json()["error"]["message"]
        wide = await load(emu, "wide", adapters["wide"])
        assert wide.status_code == 500
        assert ("The size of tensor a (64) must match the size of tensor b (256) at non-singleton dimension 1"
                in wide.json()["error"]["message"])
        missing = await load(emu, "missing", tmp_path / "nowhere")
        assert missing.status_code == 404
        assert missing.json()["error"] == {"message": "Loading lora missing failed: No adapter found for <path>",
                                           "type": "NotFoundError", "param": None, "code": 404}
        assert (await load(emu, "a", adapters["a"])).status_code == 200
        duplicate = await load(emu, "a", adapters["b"])
        assert duplicate.status_code == 400 and duplicate.json()["error"]["type"] == "InvalidUserInput"
        assert "has already been loaded" in duplicate.json()["error"]["message"]
        nameless = await emu.http.post("/v1/load_lora_adapter", json={"lora_name": "", "lora_path": "x"})
        assert nameless.json()["error"]["message"] == "Both 'lora_name' and 'lora_path' must be provided."
        unknown = await complete(emu, "nobody")
        assert unknown.status_code == 404
        assert unknown.json()["error"] == {"message": "The model `nobody` does not exist. Valid aliases: base.",
                                           "type": "NotFoundError", "param": "model", "code": 404}
        gone = await emu.http.post("/v1/unload_lora_adapter", json={"lora_name": "nobody"})
        assert gone.status_code == 404 and gone.json()["error"]["message"] == "The lora adapter 'nobody' cannot be found."
        # int ids as vLLM counts them: every checked load (refused or not) and the unknown model's lookup
        assert emu.engine.registered["a"].int_id == 4
        assert (await load(emu, "b", adapters["b"])).status_code == 200
        assert emu.engine.registered["b"].int_id == 6
        # the wide adapter's copy stayed in both caches after its refusal (vLLM copies it into a slot first)
        assert 2 in emu.engine.cache.host and len((await emu.http.get("/v1/models")).json()["data"]) == 3


async def test_without_runtime_updating_the_lora_routes_are_404(tmp_path: Path, adapters: dict[str, Path]) -> None:
    async with emulator(tmp_path, runtime_lora_updating=False) as emu:
        answer = await load(emu, "a", adapters["a"])
        assert answer.status_code == 404 and answer.json() == {"detail": "Not Found"}
        assert (await emu.http.post("/adapters", json={"name": "a", "src": str(adapters["a"])})).status_code == 404


async def test_the_api_key_guards_v1_only(tmp_path: Path, adapters: dict[str, Path]) -> None:
    async with emulator(tmp_path, api_keys=("k1",)) as emu:
        for headers in ({}, {"authorization": "Bearer guess"}, {"authorization": "Basic k1"}):
            answer = await emu.http.post("/v1/load_lora_adapter", headers=headers,
                                         json={"lora_name": "a", "lora_path": str(adapters["a"])})
            assert (answer.status_code, answer.json()) == (401, {"error": "Unauthorized"})
        for path in ("/health", "/metrics", "/version"):
            assert (await emu.http.get(path)).status_code == 200, path
        keyed = {"authorization": "Bearer k1"}
        assert (await emu.http.get("/v1/models", headers=keyed)).status_code == 200
        sagemaker = await emu.http.post("/adapters", json={"name": "a", "src": str(adapters["a"])})
        assert (sagemaker.status_code, sagemaker.text) == (200, "Adapter a registered")
        assert (await emu.http.delete("/adapters/a")).text == "Adapter a unregistered"


async def test_answers_are_deterministic_per_adapter_content_and_shaped_as_vllms(
        tmp_path: Path, adapters: dict[str, Path]) -> None:
    async with emulator(tmp_path, prompt_tokens_details=True) as emu:
        await load(emu, "a", adapters["a"])
        await load(emu, "b", adapters["b"])
        prompt = "the quick brown fox"
        answers = {model: (await complete(emu, model, prompt, 6)).json() for model in ("a", "b", "base")}
        assert answers["a"]["choices"][0]["text"] == expected_text(digest(adapters["a"]), prompt, 6)
        assert answers["b"]["choices"][0]["text"] == expected_text(digest(adapters["b"]), prompt, 6)
        assert answers["base"]["choices"][0]["text"] == expected_text("base", prompt, 6)
        assert len({a["choices"][0]["text"] for a in answers.values()}) == 3
        body = answers["a"]
        assert set(body) == {"id", "object", "created", "model", "choices", "service_tier", "system_fingerprint",
                             "usage", "kv_transfer_params", "ec_transfer_params", "metrics"}
        assert body["object"] == "text_completion" and body["model"] == "a" and body["id"].startswith("cmpl-")
        assert body["choices"][0]["finish_reason"] == "length"
        assert body["usage"] == {"prompt_tokens": 4, "total_tokens": 10, "completion_tokens": 6,
                                 "prompt_tokens_details": {"cached_tokens": 0, "created_cache_tokens": None,
                                                           "multimodal_tokens": None},
                                 "completion_tokens_details": None}
        ids = (await complete(emu, "a", prompt, 4, return_token_ids=True)).json()["choices"][0]
        assert ids["prompt_token_ids"] == encode(prompt)
        assert ids["token_ids"] == expected_tokens(digest(adapters["a"]), encode(prompt), 4)
        # an answer sent back as the next prompt tokenizes to the ids it was made of
        assert encode(prompt + render(ids["token_ids"])) == encode(prompt) + ids["token_ids"]
        chat = (await emu.http.post("/v1/chat/completions", json={
            "model": "b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})).json()
        assert chat["object"] == "chat.completion" and chat["choices"][0]["message"]["role"] == "assistant"
        assert chat["choices"][0]["message"]["content"] == render(
            expected_tokens(digest(adapters["b"]), encode("user: hi\nassistant:"), 2))


def events(text: str) -> list[Any]:
    assert text.endswith("data: [DONE]\n\n")
    return [orjson.loads(line[6:]) for line in text.split("\n\n") if line.startswith("data: {")]


async def test_stream_chunks_usage_and_coalescing(tmp_path: Path) -> None:
    # one token per chunk
    async with emulator(tmp_path, EngineConfig(stream_interval=0.0)) as emu:
        text = (await complete(emu, "base", "a b c", 3, stream=True,
                               stream_options={"include_usage": True})).text
        chunks = events(text)
        assert [c["choices"][0]["text"] for c in chunks[:3]] == [f" w{t}" for t in
                                                                 expected_tokens("base", encode("a b c"), 3)]
        assert [c["choices"][0]["finish_reason"] for c in chunks[:3]] == [None, None, "length"]
        assert chunks[0]["choices"][0] == {"index": 0, "text": chunks[0]["choices"][0]["text"], "logprobs": None,
                                           "finish_reason": None, "stop_reason": None, "prompt_token_ids": None,
                                           "token_ids": None}
        assert chunks[3]["choices"] == [] and chunks[3]["usage"] == {"prompt_tokens": 3, "total_tokens": 6,
                                                                     "completion_tokens": 3}
        assert "system_fingerprint" in chunks[3] and "system_fingerprint" not in chunks[2]
        chat = events((await emu.http.post("/v1/chat/completions", json={
            "model": "base", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True})).text)
        assert chat[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert [c["choices"][0]["delta"] for c in chat[1:]] == [{"content": f" w{t}"} for t in expected_tokens(
            "base", encode("user: hi\nassistant:"), 2)]
        assert chat[-1]["choices"][0]["finish_reason"] == "length" and "system_fingerprint" in chat[-1]
    # the default interval: the first token alone, then chunks a quarter second of steps apart
    async with emulator(tmp_path) as emu:
        chunks = events((await complete(emu, "base", "a b c", 200, stream=True)).text)
        sizes = [len(c["choices"][0]["text"].split()) for c in chunks]
        assert sizes[0] == 1 and sum(sizes) == 200 and 3 <= len(chunks) <= 12


async def test_validation_answers_as_vllm(tmp_path: Path) -> None:
    async with emulator(tmp_path, max_model_len=32) as emu:
        bad_json = await emu.http.post("/v1/completions", content=b"{nope")
        assert bad_json.status_code == 400 and bad_json.json()["error"]["type"] == "Bad Request"
        assert bad_json.json()["error"]["message"].startswith("1 validation error:\n  {'type': 'json_invalid'")
        wrong_type = await emu.http.post("/v1/completions", json={"prompt": "x", "max_tokens": "lots"})
        assert wrong_type.json()["error"]["param"] == "body.max_tokens"
        assert (await complete(emu, "base", "x", 1, n=2)).status_code == 400
        too_long = (await complete(emu, "base", " ".join(["w"] * 40), 1)).json()["error"]
        assert too_long["param"] == "input_tokens" and "maximum context length is 32 tokens" in too_long["message"]
        too_many = (await complete(emu, "base", "x", 100)).json()["error"]
        assert too_many["message"].startswith("max_tokens=100 cannot be greater than max_model_len=32.")
        clamped = (await complete(emu, "base", " ".join(["w"] * 30), 16)).json()
        assert clamped["usage"]["completion_tokens"] == 2  # as vLLM: what the context leaves
        assert (await emu.http.post("/v1/chat/completions", json={"model": "base"})).json()["error"]["param"] == (
            "body.messages")
        assert (await emu.http.get("/v1/completions")).json() == {"detail": "Method Not Allowed"}


async def test_priority_is_ignored_under_fcfs_as_vllm_does(tmp_path: Path) -> None:
    async with emulator(tmp_path) as emu:
        answer = await complete(emu, "base", "x", 1, priority=5)
        assert answer.status_code == 200


async def test_metrics_carry_vllms_names_and_labels(tmp_path: Path, adapters: dict[str, Path]) -> None:
    async with emulator(tmp_path) as emu:
        await load(emu, "a", adapters["a"])
        await complete(emu, "a", "x y z", 5)
        await complete(emu, "base", "x y z", 5)
        metrics = samples((await emu.http.get("/metrics")).text)
        base = {"engine": "0", "model_name": "base"}
        for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                     "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:prompt_tokens_total",
                     "vllm:generation_tokens_total", "vllm:num_preemptions_total",
                     "vllm:time_to_first_token_seconds_count", "vllm:inter_token_latency_seconds_count",
                     "vllm:e2e_request_latency_seconds_count", "vllm:request_queue_time_seconds_count"):
            assert [labels for labels, _ in metrics[name]] == [base], name
        assert metrics["vllm:generation_tokens_total"][0][1] == 10
        assert metrics["vllm:prompt_tokens_total"][0][1] == 6
        assert {labels["finished_reason"]: v for labels, v in metrics["vllm:request_success_total"]}["length"] == 2
        info = metrics["vllm:lora_requests_info"]
        newest = max(info, key=lambda s: s[1])[0]
        assert newest == {"max_lora": "2", "running_lora_adapters": "", "waiting_lora_adapters": ""}
        assert {"max_lora": "2", "running_lora_adapters": "a", "waiting_lora_adapters": "a"} in [s[0] for s in info]
        assert metrics["vllm:lora_adapter_loaded"] == [({"adapter_name": "a", "level": "gpu", "pinned": "false",
                                                         "rank": "8"}, 1.0)]
        assert metrics["vllm:max_gpu_lora_adapters"][0][1] == 2
        assert metrics["vllm:lora_adapter_load_seconds_count"][0][1] == 1
        assert {labels["tier"]: v for labels, v in metrics["loraplane_emulator_lora_loads_total"]} == {
            "cpu": 0.0, "disk": 1.0}
        assert metrics["loraplane_emulator_lora_api_loads_total"] == [(base, 1.0)]  # the load, not the request
        assert metrics["loraplane_emulator_running_lora_evictions_total"] == [(base, 0.0)]
        assert metrics["process_start_time_seconds"][0][1] > 0
