"""Engine test helpers: generated adapters, engines as real subprocesses over HTTP, and in-process ASGI engines."""

from __future__ import annotations

import sys
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from e2e.fixtures.processes import LOOPBACK, ManagedProcess, free_port, wait_for_port
from loraplane.engine.app import BuiltEngine, EngineOptions, build


@dataclass(frozen=True)
class GeneratedAdapter:
    """One adapter written by ``write_adapter``."""

    name: str
    path: Path
    digest: str


class EngineProcess:
    """``python -m loraplane.engine`` on a free loopback port, stopped by PID."""

    def __init__(self, args: Sequence[str], log_dir: Path) -> None:
        self.port = free_port()
        self.url = f"http://{LOOPBACK}:{self.port}"
        cmd = [sys.executable, "-m", "loraplane.engine", "--host", LOOPBACK, "--port", str(self.port), *args]
        self.process = ManagedProcess(cmd, log_dir / f"engine-{self.port}.log")

    def start(self, timeout: float = 60.0) -> EngineProcess:
        """Start and wait until ``/health`` answers."""
        self.process.start()
        try:
            wait_for_port(self.port, timeout=timeout, proc=self.process.proc)
            deadline = time.monotonic() + timeout
            while httpx.get(f"{self.url}/health").status_code != 200:
                if time.monotonic() > deadline:
                    raise TimeoutError("engine never became healthy")
                time.sleep(0.05)
        except Exception:
            self.process.stop()
            raise RuntimeError(f"engine did not start:\n{self.process.log_tail()}") from None
        return self

    def stop(self) -> None:
        """Stop the process group."""
        self.process.stop()


@asynccontextmanager
async def inprocess(options: EngineOptions, client: tuple[str, int] = ("127.0.0.1", 40000),
                    **build_kwargs: object) -> AsyncIterator[tuple[BuiltEngine, httpx.AsyncClient]]:
    """An engine built in this process (lifespan running) and an httpx client talking ASGI to it from ``client``."""
    built = build(options, **build_kwargs)  # type: ignore[arg-type]
    transport = httpx.ASGITransport(app=built.app, client=client)
    async with built.app.router.lifespan_context(built.app), httpx.AsyncClient(transport=transport, base_url="http://engine") as http:
        yield built, http


def completion(model: str, prompt: str | list[int], max_tokens: int = 6, **extra: object) -> dict[str, object]:
    """A greedy completion request body."""
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}
