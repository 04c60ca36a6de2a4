"""Running a devcluster: the uvicorn server on a bound socket, the snapshot file, the kubeconfig, and a
background-thread runner for tests."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import uvicorn
import yaml

from loraplane.devcluster.cluster import Cluster
from loraplane.devcluster.server import ApiServer, ServerConfig
from loraplane.devcluster.store import Store

CONTEXT = "loraplane-devcluster"


def _write_atomically(path: Path, data: bytes, mode: int = 0o600) -> None:
    """Write a file so readers see the old or the new content, never a part."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


class SnapshotFile:
    """The JSON snapshot of a store: written atomically, read back at start."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def load_store(self, history_limit: int = 10_000) -> Store:
        """A store holding the snapshot's objects (empty when there is no snapshot yet)."""
        store = Store(history_limit)
        if self.path.exists():
            try:
                store.restore(orjson.loads(self.path.read_bytes()))
            except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
                raise ValueError(f"{self.path} is not a devcluster snapshot ({type(exc).__name__}: {exc})") from exc
        return store

    def save(self, store: Store) -> None:
        """Write the store's current state."""
        _write_atomically(self.path, orjson.dumps(store.snapshot()))

    async def keep(self, store: Store, stop: asyncio.Event, delay: float = 0.2) -> None:
        """Save after writes (at most once per ``delay`` seconds) until ``stop``, then once more."""
        dirty = asyncio.Event()
        store.on_write(dirty.set)
        stopping = asyncio.ensure_future(stop.wait())
        try:
            while not stop.is_set():
                changed = asyncio.ensure_future(dirty.wait())
                await asyncio.wait({changed, stopping}, return_when=asyncio.FIRST_COMPLETED)
                changed.cancel()
                if not stop.is_set():
                    await asyncio.sleep(delay)
                dirty.clear()
                self.save(store)
        finally:
            stopping.cancel()
            self.save(store)


def kubeconfig(url: str, token: str | None = None, namespace: str = "default") -> dict[str, Any]:
    """A kubeconfig whose current context talks to ``url`` (plain HTTP)."""
    user: dict[str, Any] = {"token": token} if token else {}
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": CONTEXT, "cluster": {"server": url}}],
        "users": [{"name": CONTEXT, "user": user}],
        "contexts": [{"name": CONTEXT, "context": {"cluster": CONTEXT, "user": CONTEXT, "namespace": namespace}}],
        "current-context": CONTEXT,
        "preferences": {},
    }


def write_kubeconfig(path: Path, url: str, token: str | None = None) -> Path:
    """Write a kubeconfig for ``url`` (mode 0600, atomically); returns its path."""
    _write_atomically(path, yaml.safe_dump(kubeconfig(url, token), sort_keys=False).encode())
    return path


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket (port 0: a free one the OS picks)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY only on such sockets (else each response waits ~40 ms on
    # Nagle and the client's delayed ACK).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    sock.setblocking(False)
    return sock


def url_of(sock: socket.socket) -> str:
    """``http://host:port`` of a bound socket."""
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


async def serve(api: ApiServer, sock: socket.socket, stop: asyncio.Event, snapshot: SnapshotFile | None = None,
                on_ready: Callable[[], None] | None = None, handle_signals: bool = False) -> None:
    """Serve ``api`` on ``sock`` until ``stop`` is set (or SIGINT/SIGTERM with ``handle_signals``)."""
    server = uvicorn.Server(uvicorn.Config(api.app, log_level="warning", access_log=False, lifespan="off",
                                           timeout_graceful_shutdown=5))
    keeper = asyncio.ensure_future(snapshot.keep(api.cluster.store, stop)) if snapshot else None
    serving = asyncio.ensure_future(server.serve(sockets=[sock]))
    while not server.started and not serving.done():  # noqa: ASYNC110 (uvicorn only exposes a flag)
        await asyncio.sleep(0.01)
    if handle_signals:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
    if server.started and on_ready is not None:
        on_ready()
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait({serving, stopping}, return_when=asyncio.FIRST_COMPLETED)
    stop.set()
    api.closing.set()
    server.should_exit = True
    await serving
    if keeper is not None:
        await keeper


class ServerThread:
    """A devcluster served from a background thread on a free loopback port (for tests and embedding)."""

    def __init__(self, cluster: Cluster | None = None, config: ServerConfig | None = None,
                 snapshot: SnapshotFile | None = None) -> None:
        self.api = ApiServer(cluster or Cluster(), config)
        self.snapshot = snapshot
        self._sock = bind("127.0.0.1", 0)
        self.url = url_of(self._sock)
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="devcluster", daemon=True)

    def _run(self) -> None:
        async def main() -> None:
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            await serve(self.api, self._sock, self._stop, self.snapshot, self._ready.set)

        try:
            asyncio.run(main())
        finally:
            self._ready.set()

    def start(self, timeout: float = 10.0) -> ServerThread:
        """Start serving; returns once the server accepts requests."""
        self._thread.start()
        if not self._ready.wait(timeout) or not self._thread.is_alive():
            raise RuntimeError("the devcluster did not start")
        return self

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the server's event loop (the only safe way to touch its cluster) and return its result."""
        assert self._loop is not None
        async def run() -> Any:
            return fn()

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(10)

    def stop(self) -> None:
        """Stop serving and wait for the thread."""
        if self._loop is not None and self._stop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(15)
        self._sock.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
