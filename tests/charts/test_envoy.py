"""The standalone Envoy's rendered bootstrap: valid for Envoy, and safe when run.

The live tests run the real Envoy with the rendered bootstrap and no picker (its Service name does not resolve
here), so they show what holds even when the picker is down: the readiness route answers, the adapter admin paths
are never forwarded, and a client cannot choose the upstream by sending ``x-gateway-destination-endpoint`` itself.
"""

from __future__ import annotations

import base64
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from e2e.fixtures.processes import ManagedProcess, free_port, wait_for_port
from tests.charts.conftest import ModelServerStandIn, RenderFn, model_server_stand_in, name_of

DESTINATION_HEADER = "x-gateway-destination-endpoint"
#: the runtimes' adapter admin endpoints: vLLM's own and the pin, unpin and offload routes of loraplane's vLLM plugin
ADMIN_PATHS = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/v1/loraplane/pin_lora_adapter",
               "/v1/loraplane/unpin_lora_adapter", "/v1/loraplane/offload_lora_adapter")


def envoy_command(render: RenderFn, values: dict[str, Any], envoy_bin: str, config_path: Path) -> list[str]:
    """The chart's Envoy container command line, with the real binary and ``config_path`` for the bootstrap."""
    container = render(values).get("Deployment", name_of("envoy"))["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["envoy"]
    args = list(container["args"])
    args[args.index("-c") + 1] = str(config_path)
    return [envoy_bin, *args]


def bootstrap(render: RenderFn, values: dict[str, Any]) -> dict[str, Any]:
    """The Envoy bootstrap the chart renders for ``values`` (gateway.mode envoy)."""
    rendered = render({"gateway": {"mode": "envoy", **values.get("gateway", {})}, **{k: v for k, v in values.items() if k != "gateway"}})
    config_map = rendered.get("ConfigMap", name_of("envoy"))
    pod = rendered.get("Deployment", name_of("envoy"))["spec"]["template"]["spec"]
    assert config_map["metadata"]["name"] == pod["volumes"][0]["configMap"]["name"]
    mount = pod["containers"][0]["volumeMounts"][0]
    args = pod["containers"][0]["args"]
    assert args[args.index("-c") + 1] == f"{mount['mountPath']}/envoy.yaml", "Envoy must read the mounted bootstrap"
    loaded: dict[str, Any] = yaml.safe_load(config_map["data"]["envoy.yaml"])
    return loaded


def _validate(envoy_bin: str, config: dict[str, Any], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "envoy.yaml"
    path.write_text(yaml.safe_dump(config))
    return subprocess.run([envoy_bin, "--mode", "validate", "-c", str(path)], capture_output=True, text=True,
                          timeout=60, check=False)


@pytest.mark.parametrize("runtime", ["engine", "vllm"])
@pytest.mark.parametrize("body_mode", ["FULL_DUPLEX_STREAMED", "BUFFERED"])
@pytest.mark.parametrize("failure_mode", ["FailClose", "FailOpen"])
def test_rendered_bootstrap_passes_envoy_validate(render: RenderFn, envoy_bin: str, tmp_path: Path,
                                                  body_mode: str, failure_mode: str, runtime: str) -> None:
    model = {"modelServer": {"runtime": runtime, "model": "org/model"}} if runtime != "engine" else {}
    config = bootstrap(render, {"gateway": {"envoy": {"bodyMode": body_mode}}, "pool": {"failureMode": failure_mode},
                                **model})
    if runtime != "engine":  # the Secret's SDS file, where the Deployment mounts it, here a copy
        source = _http_filter(config, "envoy.filters.http.credential_injector")["credential"]["typed_config"][
            "credential"]["sds_config"]["path_config_source"]
        sds = tmp_path / "envoy-sds.yaml"
        sds.write_text(base64.b64decode(render(model).get("Secret", f"{name_of('runtime')}-token")["data"]
                                        ["envoy-sds.yaml"]).decode())
        source["path"] = str(sds)
    result = _validate(envoy_bin, config, tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    ext_proc = _http_filter(config, "envoy.filters.http.ext_proc")
    assert ext_proc["failure_mode_allow"] is (failure_mode == "FailOpen")
    assert ext_proc["processing_mode"]["request_body_mode"] == body_mode


@pytest.mark.parametrize("streams", [None, 7])
def test_envoy_puts_no_more_streams_on_a_picker_connection_than_the_picker_accepts(render: RenderFn,
                                                                                  streams: int | None) -> None:
    values: dict[str, Any] = {"picker": {"maxConcurrentStreams": streams}} if streams else {}
    (cluster,) = [c for c in bootstrap(render, values)["static_resources"]["clusters"] if c["name"] == "picker"]
    options = cluster["typed_extension_protocol_options"]["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
    picker = render(values).get("Deployment", name_of("picker"))["spec"]["template"]["spec"]["containers"][0]
    (flag,) = [a for a in picker["args"] if a.startswith("--max-concurrent-streams=")]
    limit = int(flag.partition("=")[2])
    assert limit == (streams or 100)
    assert options["explicit_http_config"]["http2_protocol_options"]["max_concurrent_streams"] == limit


def test_envoy_validate_catches_a_broken_bootstrap(render: RenderFn, envoy_bin: str, tmp_path: Path) -> None:
    config = bootstrap(render, {})
    _http_filter(config, "envoy.filters.http.ext_proc")["processing_mode"].pop("request_trailer_mode")
    result = _validate(envoy_bin, config, tmp_path)
    assert result.returncode != 0 and "request_trailer_mode" in result.stdout + result.stderr


def _http_filter(config: dict[str, Any], name: str) -> dict[str, Any]:
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    (found,) = [f["typed_config"] for f in hcm["http_filters"] if f["name"] == name]
    return found


def test_bootstrap_routes_to_the_picker_and_the_pickers_endpoints_with_retries(render: RenderFn) -> None:
    rendered = render({"gateway": {"mode": "envoy"}})
    config = bootstrap(render, {})
    clusters = {c["name"]: c for c in config["static_resources"]["clusters"]}
    picker = clusters["picker"]["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]
    assert picker["socket_address"] == {"address": f"{name_of('picker')}-replicas.serving.svc", "port_value": 9002}
    pool = clusters["model-servers"]
    assert pool["type"] == "STRICT_DNS"
    host = pool["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]
    headless = rendered.get("Service", name_of("model-server"))
    assert headless["spec"]["clusterIP"] == "None" and host == {"address": f"{name_of('model-server')}.serving.svc",
                                                                 "port_value": headless["spec"]["ports"][0]["port"]}
    policy = pool["load_balancing_policy"]["policies"][0]["typed_extension_config"]
    assert policy["name"] == "envoy.load_balancing_policies.override_host"
    assert policy["typed_config"]["override_host_sources"] == [
        {"metadata": {"key": "envoy.lb", "path": [{"key": DESTINATION_HEADER}]}}, {"header": DESTINATION_HEADER}]
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    assert (hcm["request_headers_timeout"], hcm["stream_idle_timeout"]) == ("10s", "300s")
    assert hcm["common_http_protocol_options"]["idle_timeout"] == "300s"
    routed = [r for r in hcm["route_config"]["virtual_hosts"][0]["routes"] if "route" in r]
    assert routed and all(r["route"]["retry_policy"] == {
        "retry_on": "connect-failure,reset,refused-stream,retriable-status-codes", "num_retries": 2,
        "retriable_status_codes": [404]} for r in routed)
    assert config["admin"]["address"]["socket_address"]["address"] == "127.0.0.1"
    filters = [f["name"] for f in config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
               ["typed_config"]["http_filters"]]
    assert filters.index("envoy.filters.http.header_mutation") < filters.index("envoy.filters.http.ext_proc")


# ---------------------------------------------------------------------------------------------------------------
# Live


@pytest.fixture
def backend() -> Iterator[ModelServerStandIn]:
    """A loopback HTTP server a spoofed destination header would name."""
    with model_server_stand_in("backend") as server:
        yield server


def _run_envoy(render: RenderFn, envoy_bin: str, config: dict[str, Any], tmp_path: Path, port: int) -> ManagedProcess:
    """Envoy as the chart runs it (its arguments), with ``config``, until it listens on ``port``."""
    path = tmp_path / f"envoy-{port}.yaml"
    path.write_text(yaml.safe_dump(config))
    command = [*envoy_command(render, {"gateway": {"mode": "envoy"}}, envoy_bin, path), "--base-id", str(port)]
    process = ManagedProcess(command, tmp_path / f"envoy-{port}.log").start()
    try:
        wait_for_port(port, proc=process.proc)
    except Exception:
        process.stop()
        raise
    return process


def _live_config(render: RenderFn, failure_mode: str) -> tuple[dict[str, Any], int]:
    port = free_port()
    config = bootstrap(render, {"gateway": {"envoy": {"port": port, "adminPort": free_port()}},
                                "pool": {"failureMode": failure_mode}})
    return config, port


def _completion(port: int, path: str, destination: str) -> httpx.Response:
    return httpx.post(f"http://127.0.0.1:{port}{path}", json={"model": "support-bot", "prompt": "hi"},
                      headers={DESTINATION_HEADER: destination}, timeout=10)


@pytest.mark.slow
def test_live_envoy_routes_only_inference_paths_and_ignores_a_client_destination(
    render: RenderFn, envoy_bin: str, tmp_path: Path, backend: ModelServerStandIn
) -> None:
    seen = backend.seen
    spoofed = f"127.0.0.1:{backend.port}"
    for failure_mode in ("FailClose", "FailOpen"):
        config, port = _live_config(render, failure_mode)
        envoy = _run_envoy(render, envoy_bin, config, tmp_path, port)
        try:
            ready = httpx.get(f"http://127.0.0.1:{port}/ready", timeout=10)
            assert ready.status_code == 200, f"{failure_mode}: readiness must not depend on the picker"
            for path in ADMIN_PATHS:
                admin = _completion(port, path, spoofed)
                assert (admin.status_code, admin.text) == (404, "not an inference path\n"), (failure_mode, path)
            completion = _completion(port, "/v1/completions", spoofed)
            assert completion.status_code >= 500, (failure_mode, completion.status_code, completion.text)
        finally:
            envoy.stop()
        assert seen == [], f"{failure_mode}: a client-chosen destination reached the backend: {seen}"

    # The control, with the backend and a decoy as the pool's pods (FailOpen: Envoy balances without the picker):
    # with the header_mutation filter a spoofed destination is ignored (round robin reaches the decoy too);
    # without it, every request goes where the client said, so the header stripping is what the filter buys.
    with model_server_stand_in("decoy") as decoy:
        landed = {}
        for keep_filter in (True, False):
            config, port = _live_config(render, "FailOpen")
            pool = next(c for c in config["static_resources"]["clusters"] if c["name"] == "model-servers")
            pool["type"] = "STATIC"
            pool["load_assignment"]["endpoints"][0]["lb_endpoints"] = [
                {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": s.port}}}}
                for s in (backend, decoy)]
            hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
            if not keep_filter:
                hcm["http_filters"] = [f for f in hcm["http_filters"]
                                       if f["name"] != "envoy.filters.http.header_mutation"]
            envoy = _run_envoy(render, envoy_bin, config, tmp_path, port)
            before = len(decoy.seen)
            try:
                assert all(_completion(port, "/v1/completions", spoofed).status_code == 200 for _ in range(6))
            finally:
                envoy.stop()
            landed[keep_filter] = len(decoy.seen) - before
    assert landed[True] > 0 and landed[False] == 0, landed


VLLM = {"modelServer": {"runtime": "vllm", "model": "org/model"}}


def test_the_runtime_token_reaches_only_the_sidecar_controller_runtime_and_envoy(render: RenderFn) -> None:
    for values, runtime_var in ((VLLM, "VLLM_API_KEY"), ({}, "LORAPLANE_ENGINE_ADMIN_TOKEN")):
        rendered = render({"gateway": {"mode": "envoy"}, **values})
        secret = f"{name_of('runtime')}-token"
        holders = set()
        for workload in rendered.workloads():
            pod = workload["spec"]["template"]["spec"]
            for c in [*pod.get("initContainers", []), *pod["containers"]]:
                for env in c.get("env", []):
                    if env.get("valueFrom", {}).get("secretKeyRef", {}).get("name") == secret:
                        holders.add((workload["metadata"]["name"], c["name"], env["name"]))
                assert secret not in " ".join(c.get("args", [])), "never on a command line"
            for volume in pod.get("volumes", []):
                if volume.get("secret", {}).get("secretName") == secret:
                    holders.add((workload["metadata"]["name"], volume["name"], "volume"))
        runtime = values.get("modelServer", {}).get("runtime", "engine")
        expected = {(name_of("model-server"), "sidecar", "LORAPLANE_SIDECAR_RUNTIME_TOKEN"),
                    (name_of("model-server"), runtime, runtime_var),
                    (name_of("controller"), "controller", "LORAPLANE_CONTROLLER_RUNTIME_TOKEN")}
        if runtime != "engine":
            expected.add((name_of("envoy"), "runtime-token", "volume"))
        assert holders == expected, runtime


@pytest.mark.slow
def test_live_envoy_adds_the_runtime_token_for_vllm_and_replaces_a_clients(
    render: RenderFn, envoy_bin: str, tmp_path: Path, backend: ModelServerStandIn
) -> None:
    port = free_port()
    values = {**VLLM, "gateway": {"mode": "envoy", "envoy": {"port": port, "adminPort": free_port()}},
              "pool": {"failureMode": "FailOpen"}}
    config = bootstrap(render, values)
    data = render(values).get("Secret", f"{name_of('runtime')}-token")["data"]
    token = base64.b64decode(data["token"]).decode()
    sds = tmp_path / "envoy-sds.yaml"
    sds.write_text(base64.b64decode(data["envoy-sds.yaml"]).decode())
    injector = _http_filter(config, "envoy.filters.http.credential_injector")
    assert injector["credential"]["typed_config"]["credential"]["sds_config"]["path_config_source"]["path"] == \
        "/etc/envoy/runtime-token/envoy-sds.yaml"
    injector["credential"]["typed_config"]["credential"]["sds_config"]["path_config_source"]["path"] = str(sds)
    pool = next(c for c in config["static_resources"]["clusters"] if c["name"] == "model-servers")
    pool["type"] = "STATIC"
    pool["load_assignment"]["endpoints"][0]["lb_endpoints"] = [
        {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": backend.port}}}}]
    envoy = _run_envoy(render, envoy_bin, config, tmp_path, port)
    try:
        plain = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"model": "m", "prompt": "hi"}, timeout=10)
        spoofed = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"model": "m", "prompt": "hi"},
                             headers={"authorization": "Bearer client-guess"}, timeout=10)
    finally:
        envoy.stop()
    assert plain.status_code == spoofed.status_code == 200
    assert [s["authorization"] for s in backend.seen] == [f"Bearer {token}"] * 2


def test_every_picker_replica_is_health_checked_and_a_dead_one_ejected(render: RenderFn) -> None:
    """Envoy lists the pickers one by one (a headless Service), checks each one's gRPC health on its health port for
    the ext_proc service (NOT_SERVING until it has read Redis) and ejects one at its first refused connection."""
    rendered = render({"gateway": {"mode": "envoy"}})
    config = bootstrap(render, {})
    (cluster,) = [c for c in config["static_resources"]["clusters"] if c["name"] == "picker"]
    replicas = rendered.get("Service", f"{name_of('picker')}-replicas")
    assert replicas["spec"]["clusterIP"] == "None"
    assert replicas["spec"]["selector"] == rendered.get("Service", name_of("picker"))["spec"]["selector"]
    host = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
    assert host["health_check_config"] == {"port_value": 9003}
    picker = rendered.get("Deployment", name_of("picker"))["spec"]["template"]["spec"]["containers"][0]
    assert "--health-address=0.0.0.0:9003" in picker["args"]
    (check,) = cluster["health_checks"]
    assert check["grpc_health_check"] == {"service_name": "envoy.service.ext_proc.v3.ExternalProcessor"}
    assert (check["interval"], check["no_traffic_interval"], check["unhealthy_threshold"]) == ("1s", "1s", 3)
    outlier = cluster["outlier_detection"]
    assert outlier["consecutive_local_origin_failure"] == 1 and outlier["split_external_local_origin_errors"]
    assert cluster["common_lb_config"] == {"healthy_panic_threshold": {"value": 50}}
    httproute = render({"gateway": {"mode": "httproute", "httpRoute": {"parentRefs": [{"name": "gw"}]}},
                        "networkPolicy": {"enabled": False}})
    assert f"{name_of('picker')}-replicas" not in httproute.names("Service")


def test_circuit_breakers_sit_above_what_the_picker_admits(render: RenderFn) -> None:
    """Envoy's default breakers (1,024) refused the 1,025th concurrent request with an empty 500; the picker's own
    queue limits (and the pods below saturation) bound what it admits, then it answers 429 / 503 with a reason."""
    import importlib.resources

    default = yaml.safe_load(importlib.resources.files("loraplane.picker").joinpath("default-config.yaml").read_text())
    flow = next(p for p in default["plugins"] if p["type"] == "flow-control")["parameters"]
    queued = sum(flow["queueLimit"].values())
    clusters = {c["name"]: c for c in bootstrap(render, {})["static_resources"]["clusters"]}
    for name in ("picker", "model-servers"):
        (limits,) = clusters[name]["circuit_breakers"]["thresholds"]
        assert min(limits["max_connections"], limits["max_pending_requests"], limits["max_requests"]) >= 32 * queued
        assert limits["retry_budget"] == {"budget_percent": {"value": 20.0}, "min_retry_concurrency": 32}
    custom = bootstrap(render, {"gateway": {"envoy": {"maxRequests": 4096}}})
    assert {c["name"]: c["circuit_breakers"]["thresholds"][0]["max_requests"]
            for c in custom["static_resources"]["clusters"]} == {"picker": 4096, "model-servers": 4096}
