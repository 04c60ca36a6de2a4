"""The shared fixtures start real servers and stop them."""

from __future__ import annotations

import subprocess
from pathlib import Path

import redis

from e2e.fixtures.processes import RedisServer, free_port, start_redis


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
    assert len({free_port() for _ in range(5)}) >= 4


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
