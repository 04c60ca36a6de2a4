"""The engine loop: sleeps until the engine has something due (a run's end, a load's reply, tokens for streaming
clients) or a caller pokes it, then lets the engine catch up. An idle engine waits without a timer: no CPU.

Time comes from ``clock`` and ``sleep`` (``time.monotonic`` and ``asyncio.sleep`` by default), so tests run it on a
virtual clock.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable

from loraplane.emulator.engine import Engine


class EngineLoop:
    """Drives one :class:`Engine` on the running event loop."""

    def __init__(self, engine: Engine, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        self.engine = engine
        self.clock = clock
        self._sleep = sleep
        self._poke = asyncio.Event()

    def poke(self) -> None:
        """The engine got something new (a request, an abort, a load): look at it now."""
        self._poke.set()

    async def run(self) -> None:
        """Forever: catch the engine up with the clock, then wait for its next due time or a poke."""
        while True:
            self._poke.clear()
            self.engine.advance(self.clock())
            delay = self.engine.next_due() - self.clock()
            if delay == math.inf:
                await self._poke.wait()
            elif delay > 0:
                await self._sleep_or_poke(delay)
            else:
                await asyncio.sleep(0)

    async def _sleep_or_poke(self, delay: float) -> None:
        sleeper = asyncio.ensure_future(self._sleep(delay))
        poked = asyncio.ensure_future(self._poke.wait())
        try:
            await asyncio.wait((sleeper, poked), return_when=asyncio.FIRST_COMPLETED)
        finally:
            sleeper.cancel()
            poked.cancel()
