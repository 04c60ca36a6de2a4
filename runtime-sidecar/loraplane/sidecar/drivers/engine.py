"""The ``engine`` driver: loraplane's reference engine, with real tier control and reported residency.

Loading and unloading use the same vLLM endpoints as the ``vllm`` driver; tiers, pins, tenant priorities and the
residency listing (whose ``adapter_digest`` is the engine's content digest of what it loaded) use the engine's
admin endpoints (``GET /admin/adapters``, ``POST /admin/adapters/<name>/<action>``), which answer
loopback callers or the admin token.
"""

from __future__ import annotations

import dataclasses
import urllib.parse

from loraplane.api import AdapterResidency
from loraplane.api.vllm_metrics import lora_requests
from loraplane.sidecar.drivers.base import Capabilities, Observation, RuntimeAdapter
from loraplane.sidecar.drivers.vllm import VllmApiDriver, pod_load


class EngineDriver(VllmApiDriver):
    """Drives ``loraplane-engine`` (started with dynamic LoRA loading enabled)."""

    kind = "engine"
    capabilities = Capabilities(tier_control=True, pin=True, reports_residency=True, exports_residency_metrics=True,
                                priority=True, demote=True)

    async def observe(self) -> Observation:
        """The engine's own listing (tiers, digests, counters) and its /metrics."""
        listing = (await self._call("GET", "/admin/adapters")).json()
        samples = await self.scrape()
        limits = self._limits
        info = dataclasses.replace(
            limits,
            base_model=str(listing.get("base_model", "")),
            instance=self._instance(samples),
            base_model_digest=listing.get("base_model_digest") or limits.base_model_digest,
            max_lora_rank=listing.get("max_lora_rank") or limits.max_lora_rank,
            max_loras=listing.get("max_loras") or limits.max_loras,
            max_cpu_loras=listing.get("max_cpu_loras") or limits.max_cpu_loras,
        )
        adapters = {}
        for raw in listing.get("adapters", []):
            held = AdapterResidency.model_validate(raw)
            adapters[held.served_name] = RuntimeAdapter(
                served_name=held.served_name, tier=held.tier,
                digest=held.adapter_digest, bytes=held.bytes, pinned=held.pinned, in_flight=held.in_flight,
                hits=held.hits, loads=held.loads, evictions=held.evictions, last_access=held.last_access,
                priority=held.priority,
            )
        running, waiting = lora_requests(samples)
        for name in running | waiting:
            if name in adapters and adapters[name].in_flight == 0:
                adapters[name].in_flight = 1
        return Observation(info, adapters, pod_load(samples, info))

    async def _admin(self, served_name: str, action: str, body: dict[str, object] | None = None) -> None:
        await self._call("POST", f"/admin/adapters/{urllib.parse.quote(served_name, safe='')}/{action}", body)

    async def activate(self, served_name: str) -> None:
        """Copy the adapter into a GPU slot (the engine evicts by its policy, never a busy or pinned one)."""
        await self._admin(served_name, "activate")

    async def offload(self, served_name: str) -> None:
        """Free the adapter's GPU slot, keeping it in host memory."""
        await self._admin(served_name, "offload")

    async def demote(self, served_name: str) -> None:
        """Drop the adapter from GPU and host memory; it stays registered and is read back from disk on demand."""
        await self._admin(served_name, "demote")

    async def set_pinned(self, served_name: str, pinned: bool) -> None:
        """Pin (activating first) or unpin."""
        await self._admin(served_name, "pin" if pinned else "unpin")

    async def set_priority(self, served_name: str, priority: int) -> None:
        """The tenant priority the engine's keep-score policy weighs when it picks an eviction victim."""
        await self._admin(served_name, "priority", {"priority": priority})
