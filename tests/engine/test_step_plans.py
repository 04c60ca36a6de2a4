"""Which plan each engine step gets: prefill steps sort by slot, all-decode steps use the decode plan."""

from __future__ import annotations

from pathlib import Path

import pytest

from loraplane.engine.app import EngineOptions
from loraplane.kernels import BatchPlan
from tests.engine.helpers import GeneratedAdapter, completion, inprocess

LOADED = "tenant-a@v1"


async def test_decode_steps_use_the_decode_plan(
    tiny_adapters: list[GeneratedAdapter], adapter_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    options = EngineOptions(max_loras=1, lora_modules={LOADED: tiny_adapters[0].path})
    async with inprocess(options) as (built, http):
        planner = built.engine.planner
        plans: list[tuple[str, BatchPlan]] = []
        for method in ("plan", "plan_decode"):
            original = getattr(planner, method)

            def record(*args: object, _method: str = method, _original=original) -> BatchPlan:  # type: ignore[no-untyped-def]
                plan = _original(*args)
                plans.append((_method, plan))
                return plan

            monkeypatch.setattr(planner, method, record)
        response = await http.post("/v1/completions", json=completion(LOADED, "hello there", max_tokens=4))
        assert response.status_code == 200
    assert [method for method, _ in plans] == ["plan"] + ["plan_decode"] * 3  # the 4th token needs no step
    first = plans[0][1]
    assert first.num_tokens > 1  # the prompt
    for _, plan in plans[1:]:
        assert plan.mode == "decode" and plan.num_tokens == 1 and plan.contiguous
        assert plan.token_slots.tolist() == [first.token_slots[0].item()] and plan.token_slots[0] >= 0
