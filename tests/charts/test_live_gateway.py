"""The chart's gateway wiring, run for real: the picker started with the arguments the chart gives it, Envoy with
the bootstrap the chart renders, a real redis-server, and two loopback HTTP servers standing in the model-server
pods' places. The pool's state is what sidecars and the controller would have written to Redis.

Only four things differ from the cluster: listen addresses are loopback instead of 0.0.0.0, Envoy reaches the
picker at 127.0.0.1 instead of its Service's DNS name, the pool cluster lists the stand-ins' loopback addresses
instead of resolving the model servers' headless Service, and the picker takes its members from the sidecars'
reports (``picker.inferencePoolDiscovery=false``) as there is no API server here.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from e2e.fixtures.processes import ManagedProcess, RedisServer, free_port, wait_for_port
from loraplane.api import (
    AdapterResidency,
    ResidencyReport,
    RouteEntry,
    RouteTable,
    Tier,
    WeightedRevision,
    keys,
    served_name,
)
from tests.charts.conftest import ModelServerStandIn, RenderFn, model_server_stand_in, name_of
from tests.charts.test_envoy import bootstrap, envoy_command

POOL = "live-pool"
ADAPTER, REVISION = "support-bot", "v3"
SERVED = served_name(ADAPTER, REVISION)
DIGEST = "sha256:" + "ab" * 32


@pytest.fixture
def model_servers() -> Iterator[list[ModelServerStandIn]]:
    """Two running model-server stand-ins: the first will hold the revision GPU-warm."""
    with model_server_stand_in("pod-warm") as warm, model_server_stand_in("pod-cold") as cold:
        yield [warm, cold]


def _write_pool_state(redis_url: str, pods: list[ModelServerStandIn]) -> None:
    """The controller's route table and the sidecars' reports: the revision is GPU-warm on the first pod only."""
    client = redis.Redis.from_url(redis_url)
    now = time.time()
    routes = RouteTable(pool=POOL, generation=1, updated_at=now, models={
        ADAPTER: RouteEntry(revisions=[WeightedRevision(revision=REVISION, served_name=SERVED, digest=DIGEST, weight=100)]),
    })
    client.set(keys.route_table(POOL), routes.to_json())
    for i, pod in enumerate(pods):
        warm = [AdapterResidency(served_name=SERVED, tier=Tier.GPU, digest=DIGEST)] if i == 0 else []
        report = ResidencyReport(pool=POOL, pod=pod.name, address=f"127.0.0.1:{pod.port}", heartbeat_at=now,
                                 ttl_seconds=600, adapters=warm)
        client.set(keys.residency_report(POOL, pod.name), report.to_json())
        client.sadd(keys.residency_index(POOL), pod.name)
    client.close()


def _picker_command(render_values: dict[str, Any], render: RenderFn) -> list[str]:
    """The picker container's command line from the chart, with loopback listen addresses."""
    rendered = render(render_values)
    container = rendered.get("Deployment", name_of("picker"))["spec"]["template"]["spec"]["containers"][0]
    args = [a.replace("0.0.0.0:", "127.0.0.1:").replace("$(POD_NAME)", "picker-0") for a in container["args"]]
    script = Path(sys.executable).with_name(container["command"][0])
    return [str(script), *args]


def _check_probes(render: RenderFn, values: dict[str, Any], health_port: int) -> None:
    """The picker answers the gRPC health services the chart's probes ask for, on the port they ask."""
    container = render(values).get("Deployment", name_of("picker"))["spec"]["template"]["spec"]["containers"][0]
    with grpc.insecure_channel(f"127.0.0.1:{health_port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for probe in ("livenessProbe", "readinessProbe"):
            assert container[probe]["grpc"]["port"] == health_port
            request = health_pb2.HealthCheckRequest(service=container[probe]["grpc"]["service"])
            assert stub.Check(request, timeout=5).status == health_pb2.HealthCheckResponse.SERVING, probe


@pytest.mark.slow
def test_request_goes_through_the_charts_envoy_and_picker_to_the_warm_pod(
    render: RenderFn, envoy_bin: str, redis_srv: RedisServer, model_servers: list[ModelServerStandIn], tmp_path: Path
) -> None:
    grpc, health, metrics, listen = free_port(), free_port(), free_port(), free_port()
    values = {
        "pool": {"name": POOL},
        "redis": {"bundled": False, "external": {"url": redis_srv.url}},
        "picker": {"inferencePoolDiscovery": False, "ports": {"grpc": grpc, "health": health, "metrics": metrics}},
        "gateway": {"mode": "envoy", "envoy": {"port": listen, "adminPort": free_port()}},
    }
    _write_pool_state(redis_srv.url, model_servers)
    command = _picker_command(values, render)
    assert "--no-destination-fallbacks" not in command  # the ordered list: a retry takes the next endpoint

    config = bootstrap(render, values)
    picker_cluster = next(c for c in config["static_resources"]["clusters"] if c["name"] == "picker")
    address = picker_cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]
    assert address["socket_address"]["port_value"] == grpc
    address["socket_address"]["address"] = "127.0.0.1"
    pool_cluster = next(c for c in config["static_resources"]["clusters"] if c["name"] == "model-servers")
    pool_cluster["type"] = "STATIC"
    pool_cluster["load_assignment"]["endpoints"][0]["lb_endpoints"] = [
        {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": s.port}}}}
        for s in model_servers]
    config_path = tmp_path / "envoy.yaml"
    config_path.write_text(json.dumps(config))

    picker = ManagedProcess(command, tmp_path / "picker.log").start()
    envoy = ManagedProcess([*envoy_command(render, values, envoy_bin, config_path), "--base-id", str(listen)],
                           tmp_path / "envoy.log").start()
    try:
        wait_for_port(grpc, proc=picker.proc)
        wait_for_port(listen, proc=envoy.proc)
        url = f"http://127.0.0.1:{listen}/v1/completions"
        deadline = time.monotonic() + 20
        while True:  # Envoy's 500 until a health check found the picker ready (its first Redis sync)
            response = httpx.post(url, json={"model": ADAPTER, "prompt": "hi", "max_tokens": 1}, timeout=10)
            if response.status_code not in (500, 503) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert response.status_code == 200, (response.status_code, response.text, picker.log_tail(), envoy.log_tail())
        assert response.json()["model"] == ADAPTER, "the picker rewrites the served name back for the client"
        warm, cold = model_servers
        assert [s["model"] for s in warm.seen] == [SERVED], "the request must land on the pod where it is warm"
        assert warm.seen[0]["destination"] == f"127.0.0.1:{warm.port}"
        assert cold.seen == []

        unknown = httpx.post(url, json={"model": "nobody", "prompt": "hi"}, timeout=10)
        assert unknown.status_code == 404
        assert len(warm.seen) + len(cold.seen) == 1
        _check_probes(render, values, health)
    finally:
        envoy.stop()
        picker.stop()
