"""A streaming completions client that times every request the same way against real vLLM and the emulator.

Each request is a streamed completion of token ids (``prompt`` as a list of ints: the same prompt length for any
tokenizer) with ``ignore_eos`` (every answer is ``max_tokens`` long, as the emulator's always are) and
``return_token_ids`` (a chunk can carry a token whose text is empty: vLLM's byte tokenizer holds back partial
characters). The client records, from the moment it sends: the first chunk that carries a token (TTFT) and the
last one (so TPOT = (last - first) / (tokens - 1), whatever the server coalesces in between), and how many tokens
after the first reached it together with the one before (in one chunk, or within ``TOGETHER_S``): a server whose
stream delivers a token per chunk but whose tokens arrive together was held up -- its API server or this client did
not get the CPU -- and its TPOT says nothing of its steps. ``replay`` sends a list open loop, each request at its own
time whatever the answers do; ``burst`` sends them all at once.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp
import orjson

#: status of a request that got no HTTP answer
NO_ANSWER = 0
#: tokens this close after the previous one came together with it (no engine step is that short)
TOGETHER_S = 1e-4


@dataclass(frozen=True)
class TimedRequest:
    """One request: when it leaves (seconds after the start), the model or adapter name, its prompt ids, its length."""

    at: float
    model: str
    prompt: tuple[int, ...]
    max_tokens: int


@dataclass
class Timing:
    """What the client saw of one request (seconds from its send)."""

    status: int = NO_ANSWER
    #: the first chunk carrying a token (NaN: none came)
    ttft_s: float = math.nan
    #: the last chunk carrying a token
    last_token_s: float = math.nan
    #: tokens received (``token_ids`` of the chunks)
    tokens: int = 0
    #: tokens after the first that came together with the previous one
    together: int = 0
    #: seconds the request left after its time (a late client would bias the figures)
    late_s: float = 0.0
    error: str | None = None

    @property
    def ok(self) -> bool:
        """Answered 200 with at least one token."""
        return self.status == 200 and self.tokens > 0 and self.error is None

    @property
    def held_up(self) -> float:
        """Share of the tokens after the first that came together with the one before (0 for one token)."""
        return self.together / (self.tokens - 1) if self.tokens > 1 else 0.0

    @property
    def tpot_s(self) -> float:
        """Mean time per output token after the first (NaN for answers of one token)."""
        if self.tokens < 2:
            return math.nan
        return (self.last_token_s - self.ttft_s) / (self.tokens - 1)


def body(request: TimedRequest) -> bytes:
    """The completion request both runtimes get."""
    return orjson.dumps({"model": request.model, "prompt": list(request.prompt), "max_tokens": request.max_tokens,
                         "temperature": 0, "ignore_eos": True, "return_token_ids": True, "stream": True,
                         "stream_options": {"include_usage": True}})


async def send(http: aiohttp.ClientSession, url: str, request: TimedRequest, timing: Timing,
               timeout_s: float = 300.0) -> None:
    """Send ``request`` to ``url`` (``/v1/completions``) and fill ``timing``."""
    started = time.perf_counter()
    try:
        async with http.post(url, data=body(request), headers={"content-type": "application/json"},
                             timeout=aiohttp.ClientTimeout(total=timeout_s)) as response:
            timing.status = response.status
            if response.status != 200:
                timing.error = (await response.text())[:300]
                return
            async for line in response.content:
                if not line.startswith(b"data: "):
                    continue
                payload = line[6:].strip()
                if payload == b"[DONE]":
                    break
                for choice in orjson.loads(payload).get("choices") or ():
                    count = len(choice.get("token_ids") or ())
                    if count:
                        now = time.perf_counter() - started
                        if timing.tokens == 0:
                            timing.ttft_s = now
                            timing.together += count - 1
                        else:
                            timing.together += count - 1 + (now - timing.last_token_s < TOGETHER_S)
                        timing.last_token_s = now
                        timing.tokens += count
    except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
        timing.error = f"{type(exc).__name__}: {exc}"[:300]


async def replay(base_url: str, requests: Sequence[TimedRequest], timeout_s: float = 300.0) -> list[Timing]:
    """Send every request at its time (open loop); one ``Timing`` each, in the same order."""
    url = base_url.rstrip("/") + "/v1/completions"
    timings = [Timing() for _ in requests]
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        tasks = []
        start = time.perf_counter()
        for request, timing in zip(requests, timings, strict=True):
            delay = request.at - (time.perf_counter() - start)
            if delay > 0:
                await asyncio.sleep(delay)
            timing.late_s = max(0.0, -delay)
            tasks.append(asyncio.create_task(send(http, url, request, timing, timeout_s)))
        await asyncio.gather(*tasks)
    return timings


def run_replay(base_url: str, requests: Sequence[TimedRequest], timeout_s: float = 300.0) -> list[Timing]:
    """``replay`` from synchronous code."""
    return asyncio.run(replay(base_url, requests, timeout_s))


def burst(base_url: str, requests: Sequence[TimedRequest], timeout_s: float = 300.0) -> list[Timing]:
    """Send every request at once (their ``at`` ignored)."""
    now = [TimedRequest(0.0, r.model, r.prompt, r.max_tokens) for r in requests]
    return run_replay(base_url, now, timeout_s)
