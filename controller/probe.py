"""The health probe: a real completion sent straight to one canary pod, bypassing the gateway.

It passes when the pod answers 200, the response says the revision's own served name answered
(``x-loraplane-served-adapter``) with the content digest the pod's sidecar reported for the verified artifact
(``x-loraplane-adapter-digest`` = ``AdapterResidency.adapter_digest``; checked when the sidecar reports one — vLLM
stamps no digest), and the first byte of the streamed response arrives within the revision's TTFT bound. The
address comes from the pod's sidecar report, never from a client.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import UTC, datetime

import httpx

from loraplane.api import ADAPTER_DIGEST_HEADER, SERVED_ADAPTER_HEADER, AdapterRevision
from loraplane.controller.rollout import ProbeResult


class HealthProber:
    """Sends probes with one shared HTTP client; clocks injected (monotonic for TTFT, wall for the result time)."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        monotonic: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.client = client
        self.monotonic = monotonic
        self.wall_clock = wall_clock

    def _result(self, ok: bool, message: str, ttft_ms: float | None = None) -> ProbeResult:
        return ProbeResult(at=datetime.fromtimestamp(self.wall_clock(), UTC), ok=ok, message=message, ttft_ms=ttft_ms)

    async def probe(self, rev: AdapterRevision, address: str, expected_digest: str | None) -> ProbeResult:
        """Probe ``rev`` at ``address`` (``host:port``); the response must carry ``expected_digest`` when given."""
        spec = rev.spec.rollout.health_probe
        body = {"model": rev.served_name, "prompt": spec.prompt, "max_tokens": spec.max_tokens, "stream": True}
        started = self.monotonic()
        try:
            async with self.client.stream("POST", f"http://{address}/v1/completions", json=body,
                                          timeout=spec.timeout_seconds) as response:
                ttft_ms = None
                async for chunk in response.aiter_bytes():
                    if chunk and ttft_ms is None:
                        ttft_ms = (self.monotonic() - started) * 1000
                if response.status_code != 200:
                    return self._result(False, f"HTTP {response.status_code}", ttft_ms)
                served = response.headers.get(SERVED_ADAPTER_HEADER)
                digest = response.headers.get(ADAPTER_DIGEST_HEADER)
        except httpx.HTTPError as exc:
            return self._result(False, f"request failed: {type(exc).__name__}: {exc}")
        if served != rev.served_name:
            return self._result(False, f"answered by {served!r}, not {rev.served_name!r}", ttft_ms)
        if expected_digest is not None and digest != expected_digest:
            return self._result(False, f"served digest {digest} is not the verified {expected_digest}", ttft_ms)
        if ttft_ms is None or ttft_ms > spec.ttft_bound_ms:
            shown = "no body" if ttft_ms is None else f"{ttft_ms:.0f} ms"
            return self._result(False, f"TTFT {shown} over the {spec.ttft_bound_ms:.0f} ms bound", ttft_ms)
        checked = f"digest {digest}" if expected_digest is not None else "digest not reported by the sidecar"
        return self._result(True, f"200 from {served} ({checked}) in {ttft_ms:.0f} ms", ttft_ms)
