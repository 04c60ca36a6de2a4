"""The ``loraplane-picker`` command: argument errors, and a real start/stop against redis-server."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from e2e.fixtures.processes import ManagedProcess, RedisServer, free_port, wait_for_port
from loraplane.picker.cli import main


def test_bad_arguments_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--pool", "p", "--endpoint", "no-address"])
    assert info.value.code == 2
    assert main(["--pool", "Not_A_Pool"]) == 2
    bad = tmp_path / "bad.yaml"
    bad.write_text("plugins: [{type: nope}]\nschedulingProfiles: [{plugins: [{pluginRef: nope}]}]\n")
    assert main(["--pool", "p", "--config", str(bad), "--redis-url", "redis://127.0.0.1:1/0"]) == 2
    assert "unknown plugin type 'nope'" in capsys.readouterr().err


def test_serves_health_and_refuses_unknown_methods(tmp_path: Path, redis_srv: RedisServer) -> None:
    port = free_port()
    proc = ManagedProcess([sys.executable, "-m", "loraplane.picker.cli", "--pool", "pool", "--redis-url", redis_srv.url,
                           "--grpc-address", f"127.0.0.1:{port}", "--health-address", "", "--metrics-address", ""],
                          tmp_path / "picker.log").start()
    try:
        wait_for_port(port, proc=proc.proc)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            status = health.Check(health_pb2.HealthCheckRequest(service="liveness"), timeout=5).status
            assert status == health_pb2.HealthCheckResponse.SERVING
            unknown = channel.unary_unary("/nope.Service/Method")
            with pytest.raises(grpc.RpcError) as info:
                unknown(b"", timeout=5)
            assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
            # graceful, with a client still connected: it exits 0 by itself (stop() SIGKILLs after 10 s: -9)
            assert proc.stop(sig=signal.SIGTERM) == 0, proc.log_tail()
    finally:
        proc.stop()
