"""The shared fixtures start real servers and stop them."""

from __future__ import annotations

import subprocess
from collections import deque
from pathlib import Path

import pytest
import redis

from e2e.fixtures.processes import RedisServer, free_port, start_redis
from loraplane import processes


def test_redis_fixture_is_a_real_server(redis_srv: RedisServer) -> None:
    client = redis.Redis.from_url(redis_srv.url)
    assert client.ping()
    client.set("k", "v")
    assert client.get("k") == b"v"
    assert "redis_version" in client.info("server")


def test_redis_stops_by_pid(tmp_path: Path) -> None:
    server = start_redis(tmp_path)
    assert server.process.alive()
    server.stop()
    assert not server.process.alive()


def test_free_ports_differ() -> None:
    assert len({free_port() for _ in range(5)}) == 5


def test_a_port_handed_out_is_not_handed_out_again_even_when_the_os_picks_it_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """Children bind their ports later: the OS may offer a port handed out a moment ago, nobody listening on it yet."""
    offered = iter([41_001, 41_001, 41_002, 41_001, 41_003])

    class Socket:
        def __init__(self, *_args: object) -> None:
            self.port = 0

        def __enter__(self) -> Socket:
            return self

        def __exit__(self, *_exc: object) -> None:
            return None

        def bind(self, _address: tuple[str, int]) -> None:
            self.port = next(offered)

        def getsockname(self) -> tuple[str, int]:
            return ("127.0.0.1", self.port)

    monkeypatch.setattr(processes.socket, "socket", Socket)
    monkeypatch.setattr(processes, "_handed_out", deque(maxlen=4096))
    assert [free_port(), free_port(), free_port()] == [41_001, 41_002, 41_003]


def test_envoy_binary_validates_a_config(envoy_bin: str, tmp_path: Path) -> None:
    cfg = tmp_path / "envoy.yaml"
    cfg.write_text(
        f"""
static_resources:
  listeners:
  - name: l
    address: {{socket_address: {{address: 127.0.0.1, port_value: {free_port()}}}}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: t
          route_config: {{virtual_hosts: [{{name: v, domains: ["*"], routes: [{{match: {{prefix: /}}, direct_response: {{status: 200}}}}]}}]}}
          http_filters: [{{name: envoy.filters.http.router, typed_config: {{"@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router}}}}]
"""
    )
    out = subprocess.run([envoy_bin, "--mode", "validate", "-c", str(cfg)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text("static_resources: {listeners: [{name: x}]}\n")
    assert subprocess.run([envoy_bin, "--mode", "validate", "-c", str(bad)], capture_output=True, timeout=60).returncode != 0
