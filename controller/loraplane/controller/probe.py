"""The health probe: a real completion sent straight to one canary pod, bypassing the gateway.

It passes when the pod answers 200, the response says the revision's own served name answered
(``x-loraplane-served-adapter``; vLLM sends no such header, so there the ``model`` its streamed events name) with
the content digest the pod's sidecar reported for the verified artifact (``x-loraplane-adapter-digest`` =
``AdapterResidency.adapter_digest``; checked when the sidecar reports one and the runtime stamps identity headers:
vLLM stamps none, and its sidecar vouches only for files it loaded itself), and the first byte of the streamed
response arrives within the revision's TTFT bound. The address comes from the pod's sidecar report, never from a
client.

A transport error before the pod's response began (no status line: a refused or reset connection, a keep-alive
connection the server closed just as the probe reused it -- uvicorn, under vLLM and the emulator, closes idle
connections after 5 s, httpx keeps them 5 s) says nothing about the revision: the probe is sent again on a fresh
connection, at most ``ATTEMPTS`` times within the probe's ``timeoutSeconds``. Only then is it a failure.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime

import httpx

from loraplane.api import ADAPTER_DIGEST_HEADER, SERVED_ADAPTER_HEADER, AdapterRevision
from loraplane.controller.rollout import ProbeResult

log = logging.getLogger(__name__)

#: bytes of the probe's stream kept to read the first event's ``model``
_HEAD_BYTES = 16 << 10
#: sends of one probe, the first included, while the pod's response has not begun (each after the first on a new
#: connection)
ATTEMPTS = 3
#: seconds before the second send; doubled before each one after it
RETRY_DELAY_S = 0.1


class _NoResponse(Exception):
    """The transport failed before the response's status line arrived."""

    def __init__(self, error: httpx.TransportError) -> None:
        super().__init__(str(error))
        self.error = error


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
    """Sends probes with one shared HTTP client (a resend after a failed transport on a new one); clocks injected
    (monotonic for TTFT and the retry budget, wall for the result time) and the sleep between sends."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        monotonic: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.client = client
        self.monotonic = monotonic
        self.wall_clock = wall_clock
        self.sleep = sleep

    def _result(self, ok: bool, message: str, ttft_ms: float | None = None, status: int | None = None) -> ProbeResult:
        return ProbeResult(at=datetime.fromtimestamp(self.wall_clock(), UTC), ok=ok, message=message, ttft_ms=ttft_ms,
                           status=status)

    async def probe(self, rev: AdapterRevision, address: str, expected_digest: str | None) -> ProbeResult:
        """Probe ``rev`` at ``address`` (``host:port``); the response must carry ``expected_digest`` when given."""
        budget = float(rev.spec.rollout.health_probe.timeout_seconds)
        deadline = self.monotonic() + budget
        delay, attempt = RETRY_DELAY_S, 1
        while True:
            try:
                # the first send may reuse a kept-alive connection; the others go on a connection of their own
                if attempt == 1:
                    return await self._send(self.client, rev, address, expected_digest, budget)
                async with httpx.AsyncClient(headers=self.client.headers) as fresh:
                    return await self._send(fresh, rev, address, expected_digest, budget)
            except _NoResponse as exc:
                left = deadline - self.monotonic()
                if attempt >= ATTEMPTS or left <= delay:
                    shown = f" ({attempt} attempts)" if attempt > 1 else ""
                    return self._result(False, f"request failed{shown}: {type(exc.error).__name__}: {exc.error}")
                log.info("probe of %s at %s got no response (%s: %s); sending it again on a new connection",
                         rev.served_name, address, type(exc.error).__name__, exc.error)
                await self.sleep(delay)
                budget, delay, attempt = left - delay, delay * 2, attempt + 1

    async def _send(self, client: httpx.AsyncClient, rev: AdapterRevision, address: str,
                    expected_digest: str | None, budget_s: float) -> ProbeResult:
        """One send of the probe; ``_NoResponse`` when the transport failed before the response began."""
        spec = rev.spec.rollout.health_probe
        body = {"model": rev.served_name, "prompt": spec.prompt, "max_tokens": spec.max_tokens, "stream": True}
        started = self.monotonic()
        responded = False
        try:
            async with client.stream("POST", f"http://{address}/v1/completions", json=body,
                                     timeout=budget_s) as response:
                responded = True
                ttft_ms = None
                head = bytearray()  # the start of the stream: its first event names the model that answered
                async for chunk in response.aiter_bytes():
                    if chunk and ttft_ms is None:
                        ttft_ms = (self.monotonic() - started) * 1000
                    if len(head) < _HEAD_BYTES:
                        head += chunk[:_HEAD_BYTES - len(head)]
                status = response.status_code
                if status != 200:
                    return self._result(False, f"HTTP {status}", ttft_ms, status)
                stamped = SERVED_ADAPTER_HEADER in response.headers  # the engine stamps identity; vLLM does not
                served = response.headers.get(SERVED_ADAPTER_HEADER) or _streamed_model(bytes(head))
                digest = response.headers.get(ADAPTER_DIGEST_HEADER)
        except httpx.TransportError as exc:
            if not responded and not isinstance(exc, httpx.TimeoutException):
                raise _NoResponse(exc) from exc
            return self._result(False, f"request failed: {type(exc).__name__}: {exc}")
        except httpx.HTTPError as exc:
            return self._result(False, f"request failed: {type(exc).__name__}: {exc}")
        if served != rev.served_name:
            return self._result(False, f"answered by {served!r}, not {rev.served_name!r}", ttft_ms, status)
        if stamped and expected_digest is not None and digest != expected_digest:
            return self._result(False, f"served digest {digest} is not the verified {expected_digest}", ttft_ms, status)
        if ttft_ms is None or ttft_ms > spec.ttft_bound_ms:
            shown = "no body" if ttft_ms is None else f"{ttft_ms:.0f} ms"
            return self._result(False, f"TTFT {shown} over the {spec.ttft_bound_ms:.0f} ms bound", ttft_ms, status)
        checked = ("digest not reported by the sidecar" if expected_digest is None else f"digest {digest}" if stamped
                   else "no digest stamped by the runtime: the sidecar loaded the verified files under this name")
        return self._result(True, f"200 from {served} ({checked}) in {ttft_ms:.0f} ms", ttft_ms, status)
