"""Admin endpoints: loopback or token only; dynamic loading confined to the adapter root; tier controls work."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from loraplane.api import Tier
from loraplane.engine.app import EngineOptions
from tests.engine.helpers import GeneratedAdapter, completion, inprocess

REMOTE = ("10.1.2.3", 50000)
TOKEN = "s3cret-token"
ADMIN_CALLS = [
    ("GET", "/admin/adapters", None),
    ("POST", "/admin/adapters/a@v1/pin", None),
    ("POST", "/admin/adapters/a@v1/activate", None),
    ("POST", "/v1/load_lora_adapter", {"lora_name": "b@v1", "lora_path": "tenant-01"}),
    ("POST", "/v1/unload_lora_adapter", {"lora_name": "a@v1"}),
]


def _options(root: Path, adapters: list[GeneratedAdapter], token: str | None = TOKEN) -> EngineOptions:
    return EngineOptions(max_loras=2, max_cpu_loras=4, adapter_root=root, allow_runtime_lora_updating=True,
                         admin_token=token, lora_modules={"a@v1": adapters[0].path})


@pytest.mark.parametrize(("method", "path", "body"), ADMIN_CALLS)
async def test_remote_callers_need_the_token(method: str, path: str, body: dict[str, str] | None,
                                             tiny_adapters: list[GeneratedAdapter], adapter_root: Path) -> None:
    async with inprocess(_options(adapter_root, tiny_adapters), client=REMOTE) as (_, http):
        refused = await http.request(method, path, json=body)
        wrong = await http.request(method, path, json=body, headers={"authorization": "Bearer nope"})
        allowed = await http.request(method, path, json=body, headers={"authorization": f"Bearer {TOKEN}"})
        completion_ok = await http.post("/v1/completions", json=completion("tiny", "hi"))
    assert refused.status_code == wrong.status_code == 403
    assert refused.json()["error"]["type"] == "PermissionDeniedError"
    assert allowed.status_code == 200, allowed.text
    assert completion_ok.status_code == 200  # serving is open; only administration is guarded


async def test_loopback_is_trusted_unless_proxied_and_no_token_means_loopback_only(
    tiny_adapters: list[GeneratedAdapter], adapter_root: Path
) -> None:
    async with inprocess(_options(adapter_root, tiny_adapters, token=None)) as (_, http):
        direct = await http.get("/admin/adapters")
        proxied = await http.get("/admin/adapters", headers={"x-forwarded-for": "203.0.113.9"})
        bearer_without_configured_token = await http.get("/admin/adapters", headers={"authorization": "Bearer "})
    async with inprocess(_options(adapter_root, tiny_adapters, token=None), client=REMOTE) as (_, http):
        remote = await http.get("/admin/adapters", headers={"authorization": "Bearer "})
    assert direct.status_code == 200 and bearer_without_configured_token.status_code == 200
    assert proxied.status_code == 403 and remote.status_code == 403


@pytest.mark.parametrize(("method", "path", "body"), ADMIN_CALLS)
async def test_a_configured_token_is_required_from_loopback_too(method: str, path: str, body: dict[str, str] | None,
                                                               tiny_adapters: list[GeneratedAdapter],
                                                               adapter_root: Path) -> None:
    """Behind a local proxy that adds no forwarding header, loopback says nothing: with a token, only it counts."""
    async with inprocess(_options(adapter_root, tiny_adapters)) as (built, http):
        before = {name: (a.tier, a.pinned) for name, a in built.engine.tiers.registered.items()}
        refused = await http.request(method, path, json=body)
        after = {name: (a.tier, a.pinned) for name, a in built.engine.tiers.registered.items()}
    assert refused.status_code == 403, refused.text
    assert after == before  # nothing loaded, unloaded, pinned or moved


def _escape_fixtures(root: Path, outside: Path, adapter: GeneratedAdapter) -> dict[str, str]:
    """Paths that must all be refused, keyed by what they try."""
    shutil.copytree(adapter.path, outside / "evil", dirs_exist_ok=True)
    (root / "link-out").unlink(missing_ok=True)
    (root / "link-out").symlink_to(outside / "evil", target_is_directory=True)
    files_out = root / "files-out"
    shutil.rmtree(files_out, ignore_errors=True)
    files_out.mkdir()
    (files_out / "adapter_config.json").symlink_to(outside / "evil" / "adapter_config.json")
    (files_out / "adapter_model.safetensors").symlink_to(outside / "evil" / "adapter_model.safetensors")
    return {
        "dot-dot traversal": f"../{outside.name}/evil",
        "deep traversal": "tenant-00/../../" + outside.name + "/evil",
        "absolute path outside": str(outside / "evil"),
        "symlinked directory escaping": "link-out",
        "symlinked files escaping": "files-out",
        "system path": "/etc",
    }


async def test_paths_outside_the_adapter_root_are_refused(tiny_adapters: list[GeneratedAdapter], adapter_root: Path,
                                                          tmp_path_factory: pytest.TempPathFactory) -> None:
    outside = tmp_path_factory.mktemp("outside")
    attempts = _escape_fixtures(adapter_root, outside, tiny_adapters[0])
    auth = {"authorization": f"Bearer {TOKEN}"}
    async with inprocess(_options(adapter_root, tiny_adapters)) as (built, http):
        for what, path in attempts.items():
            response = await http.post("/v1/load_lora_adapter", json={"lora_name": "evil@v1", "lora_path": path},
                                       headers=auth)
            assert response.status_code in (400, 404), what
            assert "evil@v1" not in built.engine.tiers.registered, what
        absolute_inside = await http.post("/v1/load_lora_adapter", headers=auth,
                                          json={"lora_name": "ok@v1", "lora_path": str(tiny_adapters[1].path)})
        assert absolute_inside.status_code == 200


async def test_no_adapter_root_means_no_dynamic_loading(tiny_adapters: list[GeneratedAdapter]) -> None:
    options = EngineOptions(allow_runtime_lora_updating=True)
    async with inprocess(options) as (_, http):
        response = await http.post("/v1/load_lora_adapter", json={"lora_name": "x@v1", "lora_path": str(tiny_adapters[0].path)})
    assert response.status_code == 400
    assert "adapter-root" in response.json()["error"]["message"]


async def test_tier_controls_and_listing(tiny_adapters: list[GeneratedAdapter], adapter_root: Path) -> None:
    options = EngineOptions(max_loras=2, max_cpu_loras=3, lora_modules={a.name: a.path for a in tiny_adapters[:4]})
    names = [a.name for a in tiny_adapters[:4]]
    async with inprocess(options) as (built, http):
        tiers = built.engine.tiers
        listing = (await http.get("/admin/adapters")).json()
        assert listing["max_loras"] == 2 and listing["eviction_policy"] == "lru"
        by_name = {a["served_name"]: a for a in listing["adapters"]}
        assert by_name[names[0]]["tier"] == "disk"  # pushed out of the 3-entry host cache by the later three
        # the content digest of the files it loaded; the artifact digest is the sidecar's to report
        assert (by_name[names[3]]["adapter_digest"], by_name[names[3]]["digest"]) == (tiny_adapters[3].digest, None)
        pinned = await http.post(f"/admin/adapters/{names[0]}/pin")  # read back from disk, activated, pinned
        assert (pinned.json()["tier"], pinned.json()["pinned"]) == ("gpu", True)
        starving = await http.post(f"/admin/adapters/{names[1]}/pin")
        assert starving.status_code == 409  # pinning every slot would starve all other adapters
        for name in names[1:]:  # the other slot keeps turning over; the pinned adapter never moves
            assert (await http.post(f"/admin/adapters/{name}/activate")).json()["tier"] == "gpu"
            served = await http.post("/v1/completions", json=completion(name, "hi"))
            assert served.status_code == 200
            assert tiers.registered[names[0]].tier is Tier.GPU
        assert (await http.post(f"/admin/adapters/{names[0]}/offload")).status_code == 409  # pinned
        await http.post(f"/admin/adapters/{names[0]}/unpin")
        offloaded = await http.post(f"/admin/adapters/{names[0]}/offload")
        assert (offloaded.json()["tier"], offloaded.json()["pinned"]) == ("cpu", False)
        unknown = await http.post("/admin/adapters/ghost@v1/pin")
        assert unknown.status_code == 404


async def test_demote_keeps_the_adapter_registered_and_a_request_reads_it_back(
    tiny_adapters: list[GeneratedAdapter], adapter_root: Path
) -> None:
    options = EngineOptions(max_loras=2, max_cpu_loras=3, lora_modules={tiny_adapters[0].name: tiny_adapters[0].path})
    name = tiny_adapters[0].name
    async with inprocess(options) as (built, http):
        adapter = built.engine.tiers.registered[name]
        await http.post(f"/admin/adapters/{name}/pin")
        assert (await http.post(f"/admin/adapters/{name}/demote")).status_code == 409  # pinned
        await http.post(f"/admin/adapters/{name}/unpin")
        demoted = (await http.post(f"/admin/adapters/{name}/demote")).json()
        assert (demoted["tier"], demoted["registered"], demoted["evictions"]) == ("disk", True, 0)
        assert adapter.weights is None and adapter.slot is None and name not in built.engine.tiers.host
        assert (await http.post(f"/admin/adapters/{name}/demote")).json()["tier"] == "disk"  # already there: no-op
        served = await http.post("/v1/completions", json=completion(name, "hi"))
        metrics = (await http.get("/metrics")).text
    assert served.status_code == 200  # served after a real read from disk
    assert adapter.loads == 2 and adapter.tier is not Tier.DISK
    assert 'loraplane_engine_time_to_first_token_seconds_count{tier="L2"} 1.0' in metrics
