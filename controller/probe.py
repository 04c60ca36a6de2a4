"""The health probe: a real completion sent straight to one canary pod, bypassing the gateway.

It passes when the pod answers 200, the response says the revision's own served name answered
(``x-loraplane-served-adapter``; vLLM sends no such header, so there the ``model`` its streamed events name) with
the content digest the pod's sidecar reported for the verified artifact (``x-loraplane-adapter-digest`` =
``AdapterResidency.adapter_digest``; checked when the sidecar reports one and the runtime stamps identity headers:
vLLM stamps none, and its sidecar vouches only for files it loaded itself), and the first byte of the streamed
response arrives within the revision's TTFT bound. The address comes from the pod's sidecar report, never from a
client.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from datetime import UTC, datetime

import httpx

from loraplane.api import ADAPTER_DIGEST_HEADER, SERVED_ADAPTER_HEADER, AdapterRevision
from loraplane.controller.rollout import ProbeResult

#: bytes of the probe's stream kept to read the first event's ``model``
_HEAD_BYTES = 16 << 10


def _streamed_model(head: bytes) -> str | None:
    """The ``model`` of the first ``data:`` event of an OpenAI completions stream (None when there is none)."""
    for line in head.splitlines():
        if line.startswith(b"data:") and line[5:].strip() not in (b"", b"[DONE]"):
            try:
                event = json.loads(line[5:])
            except ValueError:
                return None
            model = event.get("model") if isinstance(event, dict) else None
            return model if isinstance(model, str) else None
    return None


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
                head = bytearray()  # the start of the stream: its first event names the model that answered
                async for chunk in response.aiter_bytes():
                    if chunk and ttft_ms is None:
                        ttft_ms = (self.monotonic() - started) * 1000
                    if len(head) < _HEAD_BYTES:
                        head += chunk[:_HEAD_BYTES - len(head)]
                if response.status_code != 200:
                    return self._result(False, f"HTTP {response.status_code}", ttft_ms)
                stamped = SERVED_ADAPTER_HEADER in response.headers  # the engine stamps identity; vLLM does not
                served = response.headers.get(SERVED_ADAPTER_HEADER) or _streamed_model(bytes(head))
                digest = response.headers.get(ADAPTER_DIGEST_HEADER)
        except httpx.HTTPError as exc:
            return self._result(False, f"request failed: {type(exc).__name__}: {exc}")
        if served != rev.served_name:
            return self._result(False, f"answered by {served!r}, not {rev.served_name!r}", ttft_ms)
        if stamped and expected_digest is not None and digest != expected_digest:
            return self._result(False, f"served digest {digest} is not the verified {expected_digest}", ttft_ms)
        if ttft_ms is None or ttft_ms > spec.ttft_bound_ms:
            shown = "no body" if ttft_ms is None else f"{ttft_ms:.0f} ms"
            return self._result(False, f"TTFT {shown} over the {spec.ttft_bound_ms:.0f} ms bound", ttft_ms)
        checked = ("digest not reported by the sidecar" if expected_digest is None else f"digest {digest}" if stamped
                   else "no digest stamped by the runtime: the sidecar loaded the verified files under this name")
        return self._result(True, f"200 from {served} ({checked}) in {ttft_ms:.0f} ms", ttft_ms)
