"""uvicorn without its 0.1 s housekeeping tick, so an idle emulator sleeps: the tick comes once a second and an exit
signal wakes the server at once."""

from __future__ import annotations

import asyncio
from contextlib import suppress
from types import FrameType

import uvicorn
from starlette.types import ASGIApp

#: seconds between the server's housekeeping ticks (uvicorn's: 0.1)
TICK_S = 1.0


class QuietServer(uvicorn.Server):
    """``uvicorn.Server`` ticking every :data:`TICK_S` seconds."""

    _wake: asyncio.Event | None = None
    _loop: asyncio.AbstractEventLoop | None = None

    async def main_loop(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        ticks_per_tick = round(TICK_S / 0.1)  # uvicorn counts 0.1 s ticks (the date header is refreshed every 10)
        counter = 0
        while not self.should_exit:
            with suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), TICK_S)
            counter += ticks_per_tick
            if await self.on_tick(counter):
                return

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        if self._loop is not None and self._wake is not None:
            self._loop.call_soon_threadsafe(self._wake.set)


def serve(app: ASGIApp, host: str, port: int) -> None:
    """Serve ``app`` until SIGINT or SIGTERM (uvloop and httptools when installed; no access log)."""
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False, lifespan="on")
    QuietServer(config).run()
