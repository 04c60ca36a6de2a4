"""Open-loop replay of a trace through the gateway: every request leaves at its timestamp whatever the answers do.

Each request is a streamed completion (``stream_options.include_usage``); the client records the HTTP status,
the time to the first streamed token and to the end, the pod that answered (Envoy's upstream header), the
picker's refusal reason, and whether the text came from the revision the request named (``check``). TTFT is
measured here, at the client, on the first chunk that carries text: it includes Envoy, the picker and any wait in
its queue, as a user sees it.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import aiohttp
import orjson

from loraplane.picker.envoy import UPSTREAM_HEADER

#: the header the picker names its refusals in (llm-d-router's name)
DROPPED_REASON_HEADER = "x-llm-d-request-dropped-reason"
#: status recorded for a request that got no HTTP answer (connection refused, reset, timed out)
NO_ANSWER = 0


@dataclass(frozen=True)
class ReplayRequest:
    """One request of the trace: when it leaves (seconds after the replay starts) and what it asks."""

    at: float
    model: str
    prompt: str
    max_tokens: int
    headers: tuple[tuple[str, str], ...] = ()


@dataclass
class Outcome:
    """What the client saw of one request."""

    status: int = NO_ANSWER
    #: seconds from sending to the first chunk with text (NaN: none came)
    ttft_s: float = math.nan
    #: seconds from sending to the end of the answer (NaN: it did not end well)
    e2e_s: float = math.nan
    #: completion tokens the usage chunk reported
    tokens: int = 0
    #: ``ip:port`` of the pod that answered (Envoy's upstream header)
    upstream: str | None = None
    #: the picker's refusal reason, or the error text of a failed request
    reason: str | None = None
    #: the text was not what the named revision answers (``check`` said so)
    wrong: bool = False
    #: seconds the request left after its timestamp (a late client would bias every figure)
    late_s: float = 0.0
    text: list[str] = field(default_factory=list, repr=False)


#: (request, text of the answer) -> whether a revision the request may be served by wrote this text
Check = Callable[[ReplayRequest, str], bool]


async def _send(http: aiohttp.ClientSession, url: str, request: ReplayRequest, outcome: Outcome,
                check: Check | None, timeout_s: float) -> None:
    body = orjson.dumps({"model": request.model, "prompt": request.prompt, "max_tokens": request.max_tokens,
                         "stream": True, "stream_options": {"include_usage": True}})
    headers = {"content-type": "application/json", **dict(request.headers)}
    started = time.perf_counter()
    try:
        async with http.post(url, data=body, headers=headers,
                             timeout=aiohttp.ClientTimeout(total=timeout_s)) as response:
            outcome.status = response.status
            outcome.upstream = response.headers.get(UPSTREAM_HEADER)
            if response.status != 200:
                outcome.reason = response.headers.get(DROPPED_REASON_HEADER) or (await response.text())[:200]
                return
            async for line in response.content:
                if not line.startswith(b"data: "):
                    continue
                payload = line[6:].strip()
                if payload == b"[DONE]":
                    outcome.e2e_s = time.perf_counter() - started
                    break
                chunk = orjson.loads(payload)
                for choice in chunk.get("choices") or ():
                    text = choice.get("text") or ""
                    if text and math.isnan(outcome.ttft_s):
                        outcome.ttft_s = time.perf_counter() - started
                    outcome.text.append(text)
                usage = chunk.get("usage")
                if usage:
                    outcome.tokens = int(usage.get("completion_tokens") or 0)
    except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
        outcome.status = outcome.status if outcome.status != 200 else NO_ANSWER
        outcome.reason = f"{type(exc).__name__}: {exc}"[:200]
        outcome.e2e_s = math.nan
        return
    if check is not None and not math.isnan(outcome.e2e_s):
        outcome.wrong = not check(request, "".join(outcome.text))
    outcome.text = []


async def replay(gateway_url: str, requests: Sequence[ReplayRequest], check: Check | None = None,
                 timeout_s: float = 300.0, progress: Callable[[int], None] | None = None) -> list[Outcome]:
    """Send every request at its time (open loop) to ``gateway_url``'s completions; one ``Outcome`` each."""
    url = gateway_url.rstrip("/") + "/v1/completions"
    outcomes = [Outcome() for _ in requests]
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=connector) as http:
        tasks: list[asyncio.Task[None]] = []
        start = time.perf_counter()
        for i, request in enumerate(requests):
            delay = request.at - (time.perf_counter() - start)
            if delay > 0:
                await asyncio.sleep(delay)
            outcomes[i].late_s = max(0.0, -delay)
            tasks.append(asyncio.create_task(_send(http, url, request, outcomes[i], check, timeout_s)))
            if progress is not None:
                progress(i + 1)
        await asyncio.gather(*tasks)
    return outcomes
