"""vLLM's documented HTTP behaviour, table-driven: dynamic LoRA loading, errors, models, completions."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import orjson
import pytest

from loraplane.api import ADAPTER_DIGEST_HEADER, SERVED_ADAPTER_HEADER
from loraplane.engine.app import EngineOptions
from loraplane.engine.make_adapters import write_adapter
from loraplane.engine.model import PRESETS
from tests.engine.helpers import GeneratedAdapter, completion, inprocess

LOADED = "claims-assistant@v18"


def _error(status: int, err_type: str, message: str) -> dict[str, Any]:
    return {"status": status, "json": {"error": {"message": message, "type": err_type, "param": None, "code": status}}}


# (what, method, path, body, expected). Every row runs against an engine that has LOADED (tenant-00) registered.
CASES: list[tuple[str, str, dict[str, Any] | bytes, dict[str, Any]]] = [
    ("load a new adapter", "/v1/load_lora_adapter", {"lora_name": "other@v1", "lora_path": "tenant-01"},
     {"status": 200, "text": "Success: LoRA adapter 'other@v1' added successfully."}),
    ("reload without load_inplace", "/v1/load_lora_adapter", {"lora_name": LOADED, "lora_path": "tenant-01"},
     _error(400, "InvalidUserInput", f"The lora adapter '{LOADED}' has already been loaded. If you want to load "
                                     "the adapter in place, set 'load_inplace' to True.")),
    ("reload with load_inplace", "/v1/load_lora_adapter", {"lora_name": LOADED, "lora_path": "tenant-01", "load_inplace": True},
     {"status": 200, "text": f"Success: LoRA adapter '{LOADED}' added successfully."}),
    ("load without a path", "/v1/load_lora_adapter", {"lora_name": "x@v1"},
     _error(400, "InvalidUserInput", "Both 'lora_name' and 'lora_path' must be provided.")),
    ("load without a name", "/v1/load_lora_adapter", {"lora_path": "tenant-01"},
     _error(400, "InvalidUserInput", "Both 'lora_name' and 'lora_path' must be provided.")),
    ("load a path that does not exist", "/v1/load_lora_adapter", {"lora_name": "x@v1", "lora_path": "nope"},
     _error(404, "NotFoundError", "No adapter found for nope")),
    ("unload a loaded adapter", "/v1/unload_lora_adapter", {"lora_name": LOADED},
     {"status": 200, "text": f"Success: LoRA adapter '{LOADED}' removed successfully."}),
    ("unload an unknown adapter", "/v1/unload_lora_adapter", {"lora_name": "ghost@v1"},
     _error(404, "NotFoundError", "The lora adapter 'ghost@v1' cannot be found.")),
    ("unload without a name", "/v1/unload_lora_adapter", {"lora_int_id": 3},
     _error(400, "InvalidUserInput", "'lora_name' needs to be provided to unload a LoRA adapter.")),
    ("completion for an unknown model", "/v1/completions", completion("ghost@v1", "hi"),
     {"status": 404, "json": {"error": {"message": "The model `ghost@v1` does not exist.", "type": "NotFoundError",
                                        "param": "model", "code": 404}}}),
    ("chat for an unknown model", "/v1/chat/completions", {"model": "ghost", "messages": [{"role": "user", "content": "hi"}]},
     {"status": 404, "error_type": "NotFoundError"}),
    ("body that is not JSON", "/v1/completions", b"{not json", {"status": 400, "error_type": "BadRequestError"}),
    ("prompt missing", "/v1/completions", {"model": LOADED}, {"status": 400, "error_type": "BadRequestError"}),
    ("n > 1", "/v1/completions", completion(LOADED, "hi", n=2), {"status": 400, "error_type": "BadRequestError"}),
    ("token id outside the vocabulary", "/v1/completions", completion(LOADED, [1, 99999]),
     {"status": 400, "error_type": "BadRequestError"}),
    ("body over the size limit", "/v1/completions", b'{"prompt": "' + b"x" * (5 << 20) + b'"}',
     {"status": 413, "error_type": "BadRequestError"}),
    ("longer than max_model_len", "/v1/completions", completion(LOADED, "hi", max_tokens=100000),
     {"status": 400, "error_type": "BadRequestError"}),
]


@pytest.mark.parametrize(("what", "path", "body", "expected"), CASES, ids=[c[0] for c in CASES])
async def test_vllm_endpoint_behaviour(what: str, path: str, body: dict[str, Any] | bytes, expected: dict[str, Any],
                                       tiny_adapters: list[GeneratedAdapter], adapter_root: Path) -> None:
    options = EngineOptions(max_loras=2, max_cpu_loras=4, adapter_root=adapter_root, allow_runtime_lora_updating=True)
    async with inprocess(options) as (_, http):
        loaded = await http.post("/v1/load_lora_adapter", json={"lora_name": LOADED, "lora_path": "tenant-00"})
        assert loaded.status_code == 200
        content = body if isinstance(body, bytes) else orjson.dumps(body)
        response = await http.post(path, content=content, headers={"content-type": "application/json"})
    assert response.status_code == expected["status"], response.text
    if "text" in expected:
        assert response.text == expected["text"]
    if "json" in expected:
        assert response.json() == expected["json"]
    if "error_type" in expected:
        error = response.json()["error"]
        assert (error["type"], error["code"]) == (expected["error_type"], expected["status"])


async def test_reload_in_place_serves_the_new_weights(tiny_adapters: list[GeneratedAdapter], adapter_root: Path) -> None:
    options = EngineOptions(max_loras=1, max_cpu_loras=2, adapter_root=adapter_root, allow_runtime_lora_updating=True)
    async with inprocess(options) as (_, http):
        await http.post("/v1/load_lora_adapter", json={"lora_name": LOADED, "lora_path": "tenant-00"})
        before = await http.post("/v1/completions", json=completion(LOADED, "hello"))
        await http.post("/v1/load_lora_adapter", json={"lora_name": LOADED, "lora_path": "tenant-01", "load_inplace": True})
        after = await http.post("/v1/completions", json=completion(LOADED, "hello"))
        await http.post("/v1/load_lora_adapter", json={"lora_name": "direct@v1", "lora_path": "tenant-01"})
        direct = await http.post("/v1/completions", json=completion("direct@v1", "hello"))
    assert before.headers[ADAPTER_DIGEST_HEADER] == tiny_adapters[0].digest
    assert after.headers[ADAPTER_DIGEST_HEADER] == tiny_adapters[1].digest
    assert after.json()["choices"][0]["text"] == direct.json()["choices"][0]["text"]
    assert before.json()["choices"][0]["text"] != after.json()["choices"][0]["text"]


async def test_dynamic_loading_is_off_unless_enabled(tiny_adapters: list[GeneratedAdapter], adapter_root: Path) -> None:
    async with inprocess(EngineOptions(adapter_root=adapter_root)) as (_, http):
        load = await http.post("/v1/load_lora_adapter", json={"lora_name": "a@v1", "lora_path": "tenant-00"})
        unload = await http.post("/v1/unload_lora_adapter", json={"lora_name": "a@v1"})
    assert (load.status_code, unload.status_code) == (404, 404)


async def test_models_completions_and_stream_shapes(tiny_adapters: list[GeneratedAdapter], adapter_root: Path) -> None:
    options = EngineOptions(max_loras=1, lora_modules={LOADED: tiny_adapters[0].path})
    async with inprocess(options) as (_, http):
        models = (await http.get("/v1/models")).json()
        plain = await http.post("/v1/completions", json=completion(LOADED, "hello", return_token_ids=True))
        base = await http.post("/v1/completions", json=completion("tiny", "hello"))
        stream = await http.post("/v1/completions", json=completion(LOADED, "hello", stream=True,
                                                                    stream_options={"include_usage": True}))
        chat = await http.post("/v1/chat/completions", json={"model": LOADED, "messages": [{"role": "user", "content": "hi"}],
                                                             "max_tokens": 4, "temperature": 0})
        health = await http.get("/health")
    assert health.status_code == 200
    assert [(m["id"], m["parent"]) for m in models["data"]] == [("tiny", None), (LOADED, "tiny")]
    body = plain.json()
    choice = body["choices"][0]
    assert body["object"] == "text_completion" and body["model"] == LOADED
    assert len(choice["token_ids"]) == body["usage"]["completion_tokens"] <= 6
    assert choice["prompt_token_ids"][1:] == list(b"hello")  # after the BOS token
    assert plain.headers[SERVED_ADAPTER_HEADER] == LOADED
    assert plain.headers[ADAPTER_DIGEST_HEADER] == tiny_adapters[0].digest
    assert base.headers[SERVED_ADAPTER_HEADER] == "tiny" and base.headers[ADAPTER_DIGEST_HEADER].startswith("sha256:")
    assert base.json()["choices"][0]["text"] != choice["text"]
    assert stream.headers["content-type"].startswith("text/event-stream")
    assert stream.headers[SERVED_ADAPTER_HEADER] == LOADED
    events = [line[len("data: "):] for line in stream.text.split("\n\n") if line]
    assert events[-1] == "[DONE]"
    chunks = [orjson.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == choice["text"]
    assert chunks[-1]["usage"]["completion_tokens"] == body["usage"]["completion_tokens"]
    assert chat.json()["choices"][0]["message"]["role"] == "assistant"
    assert chat.headers[ADAPTER_DIGEST_HEADER] == tiny_adapters[0].digest


async def test_a_failed_step_fails_its_requests_not_the_engine() -> None:
    async with inprocess(EngineOptions()) as (built, http):
        model = built.engine.model
        healthy = model.forward

        def broken(*args: object, **kwargs: object) -> object:
            model.forward = healthy  # type: ignore[method-assign]
            raise RuntimeError("device lost")

        model.forward = broken  # type: ignore[method-assign,assignment]
        failed = await http.post("/v1/completions", json=completion("tiny", "hi"))
        recovered = await http.post("/v1/completions", json=completion("tiny", "hi"))
    assert failed.status_code == 500
    assert "device lost" in failed.json()["error"]["message"]
    assert recovered.status_code == 200


async def test_seeded_sampling_repeats_and_stop_strings_cut() -> None:
    async with inprocess(EngineOptions()) as (_, http):
        async def sample(seed: int) -> list[int]:
            body = {"model": "tiny", "prompt": "once upon", "max_tokens": 12, "temperature": 1.0, "top_p": 0.9,
                    "seed": seed, "return_token_ids": True, "ignore_eos": True}
            return (await http.post("/v1/completions", json=body)).json()["choices"][0]["token_ids"]

        first, again, other = await sample(7), await sample(7), await sample(8)
        greedy = (await http.post("/v1/completions", json=completion("tiny", "once upon", 12, ignore_eos=True))).json()
        text = greedy["choices"][0]["text"]
        stop = text[3:5]
        cut = (await http.post("/v1/completions", json=completion("tiny", "once upon", 12, ignore_eos=True, stop=[stop]))).json()
    assert first == again and first != other
    assert cut["choices"][0]["finish_reason"] == "stop"
    assert cut["choices"][0]["text"] == text[: text.find(stop)]


def _bad_adapters(root: Path, good: Path) -> dict[str, str]:
    """Adapter directories the engine must refuse, keyed by what is wrong, -> the expected message fragment."""
    write_adapter(root / "bad-rank", PRESETS["tiny"], 32, seed=1)
    write_adapter(root / "bad-shapes", PRESETS["small"], 8, seed=1)
    for name, edit in (("bad-dora", {"use_dora": True}), ("bad-extra-modules", {"modules_to_save": ["lm_head"]})):
        shutil.copytree(good, root / name, dirs_exist_ok=True)
        config = json.loads((root / name / "adapter_config.json").read_text())
        (root / name / "adapter_config.json").write_text(json.dumps({**config, **edit}))
    shutil.copytree(good, root / "bad-weights", dirs_exist_ok=True)
    (root / "bad-weights" / "adapter_model.safetensors").write_bytes(b"not safetensors")
    shutil.copytree(good, root / "bad-config", dirs_exist_ok=True)
    (root / "bad-config" / "adapter_config.json").write_text("{")
    return {"bad-rank": "max_lora_rank", "bad-shapes": "do not fit", "bad-dora": "DoRA",
            "bad-extra-modules": "modules_to_save", "bad-weights": "safetensors", "bad-config": "JSON"}


async def test_incompatible_adapters_are_refused_with_the_reason(tiny_adapters: list[GeneratedAdapter],
                                                                 tmp_path: Path) -> None:
    expected = _bad_adapters(tmp_path, tiny_adapters[0].path)
    options = EngineOptions(adapter_root=tmp_path, allow_runtime_lora_updating=True)
    async with inprocess(options) as (built, http):
        for directory, reason in expected.items():
            response = await http.post("/v1/load_lora_adapter", json={"lora_name": "x@v1", "lora_path": directory})
            assert response.status_code == 400, directory
            assert response.json()["error"]["type"] == "BadRequestError"
            assert reason in response.json()["error"]["message"], (directory, response.json())
        assert built.engine.tiers.registered == {}
