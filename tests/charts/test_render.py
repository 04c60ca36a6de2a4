"""The chart renders valid, consistent manifests over a matrix of runtimes, Redis setups and gateway modes."""

from __future__ import annotations

import argparse
import functools
import importlib
import itertools
import json
import re
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from kubernetes_validate import utils as kv_utils
from referencing import Registry, Resource

from loraplane.api import crd
from loraplane.controller.config import load_config
from loraplane.picker.scheduler import EndpointPickerConfig
from tests.charts.conftest import CHART, NAMESPACE, RELEASE, Rendered, RenderFn, helm_template, name_of
from tests.charts.custom_kinds import CUSTOM_KINDS, validate_custom

#: Oldest Kubernetes the chart supports (native sidecars are on by default from 1.29) and the newest schemas.
K8S_VERSIONS = ("1.29", kubernetes_validate.latest_version())

EXAMPLES = CHART.parents[1] / "examples"
PICKER_DEFAULT_CONFIG = CHART.parents[1] / "picker" / "loraplane" / "picker" / "default-config.yaml"

#: The console scripts the chart runs -> their argument parsers (the chart's flags must parse).
PARSERS = {
    "loraplane-picker": "loraplane.picker.cli:parser",
    "loraplane-sidecar": "loraplane.sidecar.cli:build_parser",
    "loraplane-engine": "loraplane.engine.cli:parser",
    "loraplane-controller": "loraplane.controller.cli:_parser",
}
#: What the kubelet puts in for $(VAR) references, for parsing.
KUBELET_VARS = {"POD_NAME": "lp-model-server-0", "POD_IP": "10.1.2.3", "POD_NAMESPACE": NAMESPACE,
                "LORAPLANE_REDIS_PASSWORD": "secret"}
#: A controller config file as a user would write one (docs/controller.md).
CONTROLLER_CONFIG = {"placement": {"stickiness": 0.5}, "tenantBudgets": {"claims": {"gpuBytes": 2 << 30}}}

RUNTIMES = {
    "engine": {"runtime": "engine"},
    "vllm": {"runtime": "vllm", "model": "meta-llama/Llama-3.1-8B-Instruct"},
    "vllm-ascend": {"runtime": "vllm-ascend", "model": "Qwen/Qwen2.5-7B-Instruct",
                    "lora": {"maxLoras": 2, "maxCpuLoras": 8, "maxLoraRank": 32}},
}
REDIS = {
    "bundled": {"bundled": True},
    "external": {"bundled": False, "external": {"url": "rediss://redis.data.svc:6380/2",
                                                 "passwordSecret": {"name": "redis-auth", "key": "password"}}},
}
GATEWAY_PEER = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gateway"}}}
GATEWAYS = {
    "envoy": {"mode": "envoy"},
    "httproute": {"mode": "httproute", "httpRoute": {"parentRefs": [{"name": "inference-gateway"}]},
                  "clientPeers": [GATEWAY_PEER]},
    "none": {"mode": "none", "clientPeers": [GATEWAY_PEER]},
}


def _adapter_revisions() -> list[dict[str, Any]]:
    """The repository's example AdapterRevisions as chart values (one without a poolRef: the chart fills it in)."""
    out = []
    for path in sorted(EXAMPLES.glob("*.yaml")):
        doc = yaml.safe_load(path.read_text())
        out.append({"name": doc["metadata"]["name"], "spec": doc["spec"]})
    out[0]["spec"].pop("poolRef")
    return out


def _picker_config() -> dict[str, Any]:
    """The picker's packaged default config, as a user would start a custom one."""
    config: dict[str, Any] = yaml.safe_load(PICKER_DEFAULT_CONFIG.read_text())
    return config


def matrix_values(runtime: str, redis: str, gateway: str) -> dict[str, Any]:
    """Chart values for one cell of the matrix (monitoring and GitOps revisions on in every other cell)."""
    extras = (list(RUNTIMES).index(runtime) + list(GATEWAYS).index(gateway)) % 2 == 0
    return {
        "modelServer": RUNTIMES[runtime],
        "redis": REDIS[redis],
        "gateway": GATEWAYS[gateway],
        "serviceMonitor": {"enabled": extras},
        "grafanaDashboard": {"enabled": extras},
        "adapterRevisions": _adapter_revisions() if extras else [],
        "picker": {"config": _picker_config() if extras else {}, "inferencePoolDiscovery": not extras},
        "controller": {"config": CONTROLLER_CONFIG if extras else {}},
    }


MATRIX = list(itertools.product(RUNTIMES, REDIS, GATEWAYS))


# ---------------------------------------------------------------------------------------------------------------
# Checks every rendered set must pass


@functools.cache
def _k8s_validator(version: str, kind: str, api_version: str) -> jsonschema.Draft202012Validator:
    """kubernetes-validate's strict schema for one kind, loaded once (its own ``validate`` re-reads every file)."""
    schema_dir = f"kubernetes-json-schema/v{version}-local-strict"
    group_version = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)
    try:
        schema = kv_utils.schema_contents(f"{schema_dir}/{kind.lower()}-{group_version}.json", version)
    except FileNotFoundError:
        pytest.fail(f"kubernetes-validate has no schema for {api_version} {kind} in Kubernetes {version}")
    definitions = kv_utils.schema_contents(f"{schema_dir}/_definitions.json", version)
    registry: Registry = Resource.from_contents(definitions) @ (Resource.from_contents(schema) @ Registry())
    return jsonschema.Draft202012Validator(schema, registry=registry)


def _schema_version(version: str) -> str:
    """The newest schema set not newer than ``version`` (as kubernetes-validate picks it)."""
    key = tuple(int(p) for p in version.split(".")[:2])
    return [v for v in kv_utils.all_versions() if tuple(int(p) for p in v.split(".")[:2]) <= key][-1]


def _validate_schemas(rendered: Rendered) -> None:
    for obj in rendered.objects:
        where = f"{obj['kind']} {obj['metadata']['name']}"
        if obj["kind"] in CUSTOM_KINDS:
            validate_custom(obj)
            continue
        for version in K8S_VERSIONS:
            validator = _k8s_validator(_schema_version(version), obj["kind"], obj["apiVersion"])
            error = jsonschema.exceptions.best_match(validator.iter_errors(obj))
            assert error is None, f"{where} is invalid for Kubernetes {version}: {error.message} at {list(error.path)}"


def _pod_specs(rendered: Rendered) -> dict[str, dict[str, Any]]:
    return {w["metadata"]["name"]: w["spec"]["template"] for w in rendered.workloads()}


def _matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def _containers(pod: dict[str, Any]) -> list[dict[str, Any]]:
    return pod["spec"].get("initContainers", []) + pod["spec"]["containers"]


def _check_security(rendered: Rendered) -> None:
    for name, pod in _pod_specs(rendered).items():
        assert pod["spec"]["securityContext"]["runAsNonRoot"] is True, name
        for c in _containers(pod):
            sc = c["securityContext"]
            where = f"{name}/{c['name']}"
            assert sc["runAsNonRoot"] is True and sc["readOnlyRootFilesystem"] is True, where
            assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"]["drop"] == ["ALL"], where
            assert c["resources"]["requests"].get("cpu") and c["resources"]["requests"].get("memory"), where
            assert c["resources"]["limits"].get("memory"), where


def _user_secrets(values: dict[str, Any]) -> set[str]:
    """Secrets the values name and the user creates: Redis passwords, secretKeyRefs in extra environments."""
    redis = values["redis"]
    env = values["modelServer"]["runtimeEnv"] + values["modelServer"]["sidecar"]["extraEnv"]
    refs = {e["valueFrom"]["secretKeyRef"]["name"] for e in env if "secretKeyRef" in e.get("valueFrom", {})}
    return {redis["auth"]["existingSecret"], redis["external"]["passwordSecret"]["name"], *refs} - {""}


def _check_references(rendered: Rendered, values: dict[str, Any]) -> None:
    """Selectors select something; names referred to exist; named ports are declared."""
    pods = _pod_specs(rendered)
    service_accounts = rendered.names("ServiceAccount")
    config_maps = rendered.names("ConfigMap")
    secrets = rendered.names("Secret") | _user_secrets(values)
    for workload in rendered.workloads():
        assert _matches(workload["spec"]["selector"]["matchLabels"], workload["spec"]["template"]["metadata"]["labels"])
    for name, pod in pods.items():
        assert pod["spec"]["serviceAccountName"] in service_accounts, name
        for volume in pod["spec"].get("volumes", []):
            if "configMap" in volume:
                assert volume["configMap"]["name"] in config_maps, (name, volume)
        for c in _containers(pod):
            for env in c.get("env", []):
                ref = env.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["name"] in secrets, (name, ref)
    for svc in rendered.of_kind("Service"):
        selected = [p for p in pods.values() if _matches(svc["spec"]["selector"], p["metadata"]["labels"])]
        assert selected, f"Service {svc['metadata']['name']} selects no pod"
        declared = {port["name"] for p in selected for c in _containers(p) for port in c.get("ports", [])}
        for port in svc["spec"]["ports"]:
            assert port["targetPort"] in declared, (svc["metadata"]["name"], port)
    for pdb in rendered.of_kind("PodDisruptionBudget"):
        assert any(_matches(pdb["spec"]["selector"]["matchLabels"], p["metadata"]["labels"]) for p in pods.values())
    roles = rendered.names("Role")
    for binding in rendered.of_kind("RoleBinding"):
        assert binding["roleRef"]["name"] in roles
        assert all(s["name"] in service_accounts for s in binding["subjects"])


def _check_pool(rendered: Rendered, values: dict[str, Any]) -> None:
    pool = rendered.get("InferencePool", values["pool"]["name"] or f"{RELEASE}-loraplane")
    model_servers = rendered.get("Deployment", name_of("model-server"))["spec"]["template"]
    assert _matches(pool["spec"]["selector"]["matchLabels"], model_servers["metadata"]["labels"])
    # Only the model-server pods: the selector must not catch the picker, the controller or Envoy.
    for name, pod in _pod_specs(rendered).items():
        if name != name_of("model-server"):
            assert not _matches(pool["spec"]["selector"]["matchLabels"], pod["metadata"]["labels"]), name
    runtime = model_servers["spec"]["containers"][0]
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == [runtime["ports"][0]["containerPort"]]
    picker_ref = pool["spec"]["endpointPickerRef"]
    picker_svc = rendered.get("Service", picker_ref["name"])
    grpc = next(p for p in picker_svc["spec"]["ports"] if p["name"] == "grpc")
    assert picker_ref["port"]["number"] == grpc["port"] == 9002


def _check_model_server(rendered: Rendered, values: dict[str, Any]) -> None:
    pod = rendered.get("Deployment", name_of("model-server"))["spec"]["template"]["spec"]
    runtime_name = values["modelServer"]["runtime"]
    (sidecar,) = pod["initContainers"]
    (runtime,) = pod["containers"]
    assert sidecar["restartPolicy"] == "Always", "the sidecar must be a native sidecar"
    assert runtime["name"] == runtime_name
    assert pod["automountServiceAccountToken"] is False
    cache = {m["name"]: m for m in sidecar["volumeMounts"]}["adapter-cache"]
    runtime_cache = {m["name"]: m for m in runtime["volumeMounts"]}["adapter-cache"]
    assert cache["mountPath"] == runtime_cache["mountPath"], "the runtime must see the paths the sidecar passes it"
    assert runtime_cache["readOnly"] is True and not cache.get("readOnly")
    args = _flags(sidecar["args"])
    assert args["--runtime-url"] == f"http://127.0.0.1:{runtime['ports'][0]['containerPort']}"
    assert args["--cache-dir"] == cache["mountPath"]
    assert args["--runtime"] == runtime_name
    lora = values["modelServer"]["lora"]
    rargs = _flags(runtime["args"])
    assert rargs["--max-loras"] == str(lora["maxLoras"])
    assert rargs["--max-cpu-loras"] == str(lora["maxCpuLoras"])
    assert rargs["--max-lora-rank"] == str(lora["maxLoraRank"])
    limits = runtime["resources"]["limits"]
    if runtime_name == "vllm":
        assert limits["nvidia.com/gpu"] == 1
    if runtime_name == "vllm-ascend":
        assert limits["huawei.com/Ascend910"] == 1
        assert any("hostPath" in v for v in pod["volumes"])
    if runtime_name != "engine":
        env = {e["name"]: e.get("value") for e in runtime["env"]}
        assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
        assert "--enable-lora" in runtime["args"]


def _flags(args: list[str]) -> dict[str, str]:
    return dict(a.split("=", 1) for a in args if a.startswith("--") and "=" in a)


def _check_redis(rendered: Rendered, values: dict[str, Any]) -> None:
    urls, users = set(), set()
    for name, pod in _pod_specs(rendered).items():
        for c in _containers(pod):
            url = _flags(c.get("args", [])).get("--redis-url")
            if url is None:
                continue
            urls.add(url)
            env = {e["name"]: e for e in c.get("env", [])}
            where = f"{name}/{c['name']}"
            assert "LORAPLANE_REDIS_PASSWORD" in env, f"{where} has no Redis password"
            assert "valueFrom" in env["LORAPLANE_REDIS_PASSWORD"], f"{where}: the password comes from a Secret"
            if values["redis"]["bundled"]:  # each component its own ACL user
                users.add(env["LORAPLANE_REDIS_USERNAME"]["value"])
                key = env["LORAPLANE_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]["key"]
                assert key == env["LORAPLANE_REDIS_USERNAME"]["value"], where
    assert len(urls) == 1, f"every component must use the same Redis: {urls}"
    (url,) = urls
    assert "@" not in url, "no credentials on a command line"
    if values["redis"]["bundled"]:
        svc = rendered.get("Service", name_of("redis"))
        assert url == f"redis://{svc['metadata']['name']}.{NAMESPACE}.svc:6379/0"
        assert users == {"controller", "picker", "sidecar"}
        rendered.get("StatefulSet", name_of("redis"))
        secret = rendered.get("Secret", name_of("redis"))
        assert set(secret["data"]) == {"redis-password", "controller", "picker", "sidecar"}
    else:
        assert url == values["redis"]["external"]["url"]
        assert not rendered.of_kind("StatefulSet")
        assert rendered.names("Secret") == {f"{name_of('runtime')}-token"}  # only the runtimes' admin token


def _check_network_policies(rendered: Rendered, values: dict[str, Any]) -> None:
    pods = {name: pod["metadata"]["labels"] for name, pod in _pod_specs(rendered).items()}
    policies = {p["metadata"]["name"]: p["spec"] for p in rendered.of_kind("NetworkPolicy")}

    def admitted(policy: dict[str, Any], port: int) -> list[dict[str, Any]]:
        """The peers of the rules that open ``port`` (an empty list: any peer)."""
        rules = [r for r in policy["ingress"] if any(p["port"] == port for p in r["ports"])]
        assert rules, f"port {port} is closed"
        return [peer for r in rules for peer in r.get("from", [{}])]

    def pods_admitted(peers: list[dict[str, Any]]) -> set[str]:
        return {name for name, labels in pods.items() for peer in peers
                if "podSelector" in peer and "namespaceSelector" not in peer
                and _matches(peer["podSelector"].get("matchLabels", {}), labels)}

    runtime_peers = admitted(policies[name_of("model-server")], values["modelServer"]["port"])
    assert {} not in runtime_peers, "the runtime port must not be open to everyone"
    expected = {name_of("controller")} | ({name_of("envoy")} if values["gateway"]["mode"] == "envoy" else set())
    assert pods_admitted(runtime_peers) == expected
    assert all(peer in runtime_peers for peer in values["gateway"]["clientPeers"])
    picker_peers = admitted(policies[name_of("picker")], 9002)
    assert {} not in picker_peers
    if values["redis"]["bundled"]:
        redis_peers = admitted(policies[name_of("redis")], 6379)
        assert pods_admitted(redis_peers) == {name_of(c) for c in ("picker", "controller", "model-server")}


def _check_rbac(rendered: Rendered, values: dict[str, Any]) -> None:
    assert not rendered.of_kind("ClusterRole") and not rendered.of_kind("ClusterRoleBinding")
    for role in rendered.of_kind("Role"):
        for rule in role["rules"]:
            assert "*" not in rule["verbs"] and "*" not in rule["resources"] and "*" not in rule["apiGroups"]
    api_users = {name_of("controller")} | ({name_of("picker")} if values["picker"]["inferencePoolDiscovery"] else set())
    assert rendered.names("Role") == rendered.names("RoleBinding") == api_users
    picker_args = _flags(rendered.get("Deployment", name_of("picker"))["spec"]["template"]["spec"]["containers"][0]["args"])
    if values["picker"]["inferencePoolDiscovery"]:
        assert picker_args["--inference-pool"] in rendered.names("InferencePool")
        picker_role = rendered.get("Role", name_of("picker"))
        assert {v for r in picker_role["rules"] for v in r["verbs"]} == {"list", "watch"}
        assert {res for r in picker_role["rules"] for res in r["resources"]} == {"inferencepools", "inferenceobjectives", "pods"}
        # InferenceObjectives in llm-d-router's group and GIE's deprecated one (the picker watches both)
        assert {g for r in picker_role["rules"] if "inferenceobjectives" in r["resources"] for g in r["apiGroups"]} == {
            "llm-d.ai", "inference.networking.x-k8s.io"}
    else:
        assert "--inference-pool" not in picker_args
    controller = rendered.get("Role", name_of("controller"))
    lease_rules = [r for r in controller["rules"] if "leases" in r["resources"]]
    lease_name = _flags(rendered.get("Deployment", name_of("controller"))["spec"]["template"]["spec"]["containers"][0]["args"])["--lease-name"]
    for rule in lease_rules:
        assert rule.get("resourceNames") == [lease_name] or rule["verbs"] == ["create"], rule
    sa_tokens = {sa["metadata"]["name"]: sa["automountServiceAccountToken"] for sa in rendered.of_kind("ServiceAccount")}
    assert {name for name, mounted in sa_tokens.items() if mounted} == api_users


def _check_gateway(rendered: Rendered, values: dict[str, Any]) -> None:
    mode = values["gateway"]["mode"]
    assert bool(rendered.of_kind("HTTPRoute")) == (mode == "httproute")
    assert (name_of("envoy") in rendered.names("Deployment")) == (mode == "envoy")
    for route in rendered.of_kind("HTTPRoute"):
        paths = [m["path"]["value"] for rule in route["spec"]["rules"] for m in rule["matches"]]
        assert "/v1/completions" in paths and not [p for p in paths if "lora_adapter" in p]
        (backend,) = route["spec"]["rules"][0]["backendRefs"]
        assert backend["kind"] == "InferencePool"
        assert backend["name"] in rendered.names("InferencePool")


def _parser(command: str) -> argparse.ArgumentParser:
    module, _, factory = PARSERS[command].partition(":")
    parser: argparse.ArgumentParser = getattr(importlib.import_module(module), factory)()
    return parser


def _check_flags_parse(rendered: Rendered, tmp_path: Path) -> None:
    """Every loraplane container's arguments parse with that component's own parser."""
    for name, pod in _pod_specs(rendered).items():
        for c in _containers(pod):
            command = c.get("command", [""])[0]
            if command not in PARSERS:
                continue
            args = [re.sub(r"\$\((\w+)\)", lambda m: KUBELET_VARS[m.group(1)], a) for a in c["args"]]
            parser = _parser(command)
            parser.exit_on_error = False
            try:
                parsed = parser.parse_args(args)
            except (argparse.ArgumentError, SystemExit) as exc:
                pytest.fail(f"{name}/{c['name']}: {command} rejects {args}: {exc}")
            if command == "loraplane-picker" and parsed.config is not None:
                EndpointPickerConfig.from_yaml(rendered.get("ConfigMap", name_of("picker"))["data"]["config.yaml"])
            if command == "loraplane-controller":
                assert parsed.namespace == parsed.lease_namespace == NAMESPACE and not parsed.no_leader_election
                if parsed.config is not None:
                    config_file = tmp_path / "controller.yaml"
                    config_file.write_text(rendered.get("ConfigMap", name_of("controller"))["data"]["config.yaml"])
                    load_config(config_file)
            if command == "loraplane-sidecar":
                assert all(getattr(parsed, f) for f in ("pool", "pod", "runtime_url", "redis_url", "cache_dir"))


def _merged(overrides: dict[str, Any], base: dict[str, Any] | None = None) -> dict[str, Any]:
    """``overrides`` over the chart's defaults, as Helm merges values (maps merge, everything else replaces)."""
    out = dict(base if base is not None else yaml.safe_load((CHART / "values.yaml").read_text()))
    for key, value in overrides.items():
        out[key] = _merged(value, out[key]) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _check_all(rendered: Rendered, values: dict[str, Any], tmp_path: Path) -> None:
    """Every check on one rendered set; ``values`` are the merged values it was rendered from."""
    _validate_schemas(rendered)
    _check_security(rendered)
    _check_references(rendered, values)
    _check_pool(rendered, values)
    _check_model_server(rendered, values)
    _check_redis(rendered, values)
    _check_network_policies(rendered, values)
    _check_rbac(rendered, values)
    _check_gateway(rendered, values)
    _check_flags_parse(rendered, tmp_path)
    assert len(rendered.of_kind("AdapterRevision")) == len(values["adapterRevisions"])
    for revision in rendered.of_kind("AdapterRevision"):
        assert revision["metadata"]["namespace"] == NAMESPACE
        assert revision["spec"]["poolRef"]["name"] in {"llama3-8b", *rendered.names("InferencePool")}


@pytest.mark.parametrize(("runtime", "redis", "gateway"), MATRIX, ids=["-".join(c) for c in MATRIX])
def test_matrix_renders_valid_consistent_manifests(render: RenderFn, tmp_path: Path, runtime: str, redis: str,
                                                   gateway: str) -> None:
    values = matrix_values(runtime, redis, gateway)
    _check_all(render(values), _merged(values), tmp_path)


@pytest.mark.parametrize("example", sorted(p.name for p in (CHART / "examples").glob("*.yaml")))
def test_example_values_files_render_valid_consistent_manifests(render: RenderFn, tmp_path: Path,
                                                                example: str) -> None:
    values = yaml.safe_load((CHART / "examples" / example).read_text())
    _check_all(render(values), _merged(values), tmp_path)


# ---------------------------------------------------------------------------------------------------------------
# Chart-level checks


def test_helm_lint_passes_in_strict_mode(helm_bin: str, tmp_path: Path) -> None:
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump(matrix_values("vllm", "external", "httproute")))
    for extra in ([], ["-f", str(values)]):
        result = subprocess.run([helm_bin, "lint", "--strict", str(CHART), *extra], capture_output=True, text=True,
                                timeout=60, check=False)
        assert result.returncode == 0, result.stdout + result.stderr


def test_chart_crds_are_the_generated_ones() -> None:
    chart_crds = sorted(p.name for p in (CHART / "crds").iterdir())
    generated = sorted(p.name for p in (CHART.parents[1] / "crds").iterdir())
    assert chart_crds == generated == [crd.CRD_FILENAME]
    assert (CHART / "crds" / crd.CRD_FILENAME).read_text() == crd.render(), (
        "charts/loraplane/crds differs from what the api generates: run `loraplane gen-crds` and copy "
        f"crds/{crd.CRD_FILENAME} into charts/loraplane/crds/"
    )


def test_include_crds_renders_the_adapterrevision_crd(render: RenderFn) -> None:
    rendered = render({}, "--include-crds")
    (definition,) = rendered.of_kind("CustomResourceDefinition")
    assert definition == crd.crd()
    assert not [o for o in rendered.of_kind("CustomResourceDefinition") if "inference.networking" in o["metadata"]["name"]]


def test_defaults_give_a_working_cpu_demo(render: RenderFn) -> None:
    rendered = render()
    names = {(o["kind"], o["metadata"]["name"]) for o in rendered.objects}
    for kind, component in [("Deployment", "picker"), ("Deployment", "controller"), ("Deployment", "model-server"),
                            ("Deployment", "envoy"), ("StatefulSet", "redis"), ("Service", "picker")]:
        assert (kind, name_of(component)) in names
    assert rendered.get("Deployment", name_of("controller"))["spec"]["replicas"] == 2
    assert rendered.get("Deployment", name_of("model-server"))["spec"]["replicas"] == 3
    pool = rendered.of_kind("InferencePool")[0]
    assert pool["metadata"]["name"] == f"{RELEASE}-loraplane"
    assert pool["spec"]["endpointPickerRef"]["failureMode"] == "FailClose"
    picker = rendered.get("Deployment", name_of("picker"))["spec"]["template"]["spec"]["containers"][0]
    assert "--config" not in _flags(picker["args"]), "no picker.config: the picker's packaged default"
    assert name_of("picker") not in rendered.names("ConfigMap")


def test_picker_config_and_pool_settings_come_from_values(render: RenderFn) -> None:
    custom = _picker_config()
    custom["saturationDetector"]["queueThreshold"] = 9
    rendered = render({"pool": {"name": "llama3-8b", "failureMode": "FailOpen"}, "picker": {"config": custom}})
    pool = rendered.get("InferencePool", "llama3-8b")
    assert pool["spec"]["endpointPickerRef"]["failureMode"] == "FailOpen"
    config_map = rendered.get("ConfigMap", name_of("picker"))
    config = EndpointPickerConfig.from_yaml(config_map["data"]["config.yaml"])
    assert config.saturation_detector.queue_threshold == 9
    picker = rendered.get("Deployment", name_of("picker"))["spec"]["template"]["spec"]
    (mount,) = [m for m in picker["containers"][0]["volumeMounts"] if m["name"] == "config"]
    (volume,) = [v for v in picker["volumes"] if v["name"] == "config"]
    assert volume["configMap"]["name"] == config_map["metadata"]["name"]
    flags = _flags(picker["containers"][0]["args"])
    assert flags["--config"] == f"{mount['mountPath']}/config.yaml"
    assert flags["--pool"] == "llama3-8b"
    sidecar = rendered.get("Deployment", name_of("model-server"))["spec"]["template"]["spec"]["initContainers"][0]
    assert _flags(sidecar["args"])["--pool"] == "llama3-8b"


@pytest.mark.parametrize(("values", "message"), [
    ({"modelServer": {"runtime": "tgi"}}, "modelServer/runtime"),
    ({"modelServer": {"runtime": "vllm"}}, "set the base model vLLM serves"),
    ({"modelServer": {"lora": {"maxLoras": 8, "maxCpuLoras": 4, "maxLoraRank": 16}}}, "maxCpuLoras must be >="),
    ({"modelServer": {"lora": {"maxLoras": 1, "maxCpuLoras": 4, "maxLoraRank": 24}}}, "maxLoraRank"),
    ({"inferencePaths": ["/v1/completions", "/v1/load_lora_adapter"]}, "adapter admin endpoints"),
    ({"inferencePaths": ["/v1/completions", "/v1/loraplane/pin_lora_adapter"]}, "adapter admin endpoints"),
    ({"gateway": {"mode": "httproute", "clientPeers": [GATEWAY_PEER]}}, "parentRefs must name"),
    ({"gateway": {"mode": "none"}}, "set gateway.clientPeers"),
    ({"redis": {"bundled": False}}, "redis.external.url (or redis.external.sentinel.addresses) is required"),
    ({"redis": {"bundled": False, "external": {"url": "redis://user:pw@redis:6379/0"}}}, "without a password"),
    ({"redis": {"bundled": False, "external": {"sentinel": {"addresses": ["s0:26379"]}}}},
     "sentinel.serviceName"),
    ({"redis": {"bundled": False, "external": {"url": "redis://redis:6379/0", "sentinel": {
        "addresses": ["s0:26379"], "serviceName": "m"}}}}, "set url or sentinel.addresses, not both"),
    ({"redis": {"bundled": False, "external": {"sentinel": {"addresses": ["user:pw@s0:26379"],
                                                             "serviceName": "m"}}}}, "does not match pattern"),
    ({"pool": {"failureMode": "Sometimes"}}, "pool/failureMode"),
    ({"replicas": 3}, "additional properties 'replicas' not allowed"),
    ({"modelServer": {"lora": {"maxLora": 2}}}, "additional properties 'maxLora' not allowed"),
], ids=["runtime", "vllm-model", "cpu-loras", "rank", "admin-path", "plugin-admin-path", "parent-refs", "peers",
        "redis-url", "redis-password-in-url", "sentinel-service", "url-and-sentinel", "sentinel-credentials", "failure-mode",
        "typo", "nested-typo"])
def test_bad_values_fail_with_a_clear_message(helm_bin: str, tmp_path: Path, values: dict[str, Any],
                                              message: str) -> None:
    result = helm_template(helm_bin, values, tmp_path)
    assert result.returncode != 0, f"rendered although {values} is wrong"
    assert message in result.stderr, result.stderr


def test_existing_redis_secret_is_used_and_none_created(render: RenderFn) -> None:
    rendered = render({"redis": {"auth": {"existingSecret": "my-redis", "secretKey": "pw"}}})
    assert rendered.names("Secret") == {f"{name_of('runtime')}-token"}
    refs = set()
    for pod in _pod_specs(rendered).values():
        for c in _containers(pod):
            for env in c.get("env", []):
                if env["name"] == "LORAPLANE_REDIS_PASSWORD" or env["name"].startswith("REDIS_PASSWORD_"):
                    assert env["valueFrom"]["secretKeyRef"]["name"] == "my-redis"
                    refs.add(env["valueFrom"]["secretKeyRef"]["key"])
    assert refs == {"pw", "controller", "picker", "sidecar"}


def test_bundled_redis_starts_from_the_acl_file_only(render: RenderFn) -> None:
    redis = render().get("StatefulSet", name_of("redis"))["spec"]["template"]["spec"]["containers"][0]
    script = redis["args"][0]
    assert "--aclfile /data/users.acl" in script and "--requirepass" not in script
    assert "users.acl.in > /data/users.acl" in script and "umask 077" in script


def test_redis_tls_reaches_redis_and_every_client(render: RenderFn) -> None:
    rendered = render({"redis": {"tls": {"enabled": True, "secretName": "redis-tls"}}})
    redis = rendered.get("StatefulSet", name_of("redis"))["spec"]["template"]["spec"]
    assert "--port 0 --tls-port 6379" in redis["containers"][0]["args"][0]
    clients = 0
    for name, pod in _pod_specs(rendered).items():
        for c in _containers(pod):
            url = _flags(c.get("args", [])).get("--redis-url")
            if url is None:
                continue
            clients += 1
            assert url.startswith("rediss://"), name
            env = {e["name"]: e.get("value") for e in c.get("env", [])}
            ca = env["LORAPLANE_REDIS_CA_FILE"]
            mount = next(m for m in c["volumeMounts"] if ca.startswith(m["mountPath"]))
            volume = next(v for v in pod["spec"]["volumes"] if v["name"] == mount["name"])
            assert volume["secret"]["secretName"] == "redis-tls", name
    assert clients == 3


@pytest.mark.parametrize("tls", [False, True])
def test_external_sentinel_reaches_every_component(render: RenderFn, tls: bool) -> None:
    """A Sentinel-managed Redis: every component gets the same redis+sentinel:// URL, which loraplane's client
    parses back to the sentinels, the service and the database; the sentinels' password and the data nodes' come
    from their Secrets, never the command line."""
    from loraplane.credentials import parse_sentinel_url

    sentinel = {"addresses": ["redis-sentinel-0.data.svc:26379", "redis-sentinel-1.data.svc", "10.0.0.7:26380"],
                "serviceName": "loraplane", "db": 2, "username": "watcher",
                "passwordSecret": {"name": "sentinel-auth", "key": "password"}}
    rendered = render({"redis": {"bundled": False, "tls": {"enabled": tls, "secretName": "redis-tls"},
                                 "external": {"sentinel": sentinel, "username": "loraplane",
                                              "passwordSecret": {"name": "redis-auth", "key": "password"}}}})
    _validate_schemas(rendered)
    assert not rendered.of_kind("StatefulSet")
    urls, clients = set(), 0
    for name, pod in _pod_specs(rendered).items():
        for c in _containers(pod):
            url = _flags(c.get("args", [])).get("--redis-url")
            if url is None:
                continue
            clients += 1
            urls.add(url)
            env = {e["name"]: e for e in c.get("env", [])}
            assert env["LORAPLANE_REDIS_SENTINEL_USERNAME"]["value"] == "watcher", name
            assert env["LORAPLANE_REDIS_SENTINEL_PASSWORD"]["valueFrom"]["secretKeyRef"] == {
                "name": "sentinel-auth", "key": "password"}, name
            assert env["LORAPLANE_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == "redis-auth", name
            assert ("LORAPLANE_REDIS_CA_FILE" in env) == tls, name
    assert clients == 3 and len(urls) == 1, urls
    parsed = parse_sentinel_url(urls.pop())
    assert parsed is not None and parsed.tls == tls
    assert parsed.sentinels == (("redis-sentinel-0.data.svc", 26379), ("redis-sentinel-1.data.svc", 26379),
                                ("10.0.0.7", 26380))
    assert (parsed.service, parsed.db) == ("loraplane", 2)


def test_placement_values_reach_their_pods_only(render: RenderFn) -> None:
    gpu_nodes = {"nodeSelector": {"nvidia.com/gpu.present": "true"},
                 "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]}
    rendered = render({"modelServer": {"runtime": "vllm", "model": "m", **gpu_nodes},
                       "controller": {"affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
                           {"weight": 1, "podAffinityTerm": {"topologyKey": "kubernetes.io/hostname"}}]}}}})
    _validate_schemas(rendered)
    pods = _pod_specs(rendered)
    model_server = pods[name_of("model-server")]["spec"]
    assert {k: model_server[k] for k in gpu_nodes} == gpu_nodes
    assert "podAntiAffinity" in pods[name_of("controller")]["spec"]["affinity"]
    for name in (name_of("picker"), name_of("envoy"), name_of("redis")):
        assert not {"nodeSelector", "tolerations", "affinity"} & set(pods[name]["spec"]), name


def test_vllm_publishes_kv_events_to_its_sidecar_when_asked(render: RenderFn) -> None:
    for enabled in (False, True):
        rendered = render({"modelServer": {"runtime": "vllm", "model": "m",
                                           "kvEvents": {"enabled": enabled, "port": 5600, "blockSize": 32}}})
        _validate_schemas(rendered)
        pod = rendered.get("Deployment", name_of("model-server"))["spec"]["template"]["spec"]
        sidecar, (runtime,) = pod["initContainers"][0], pod["containers"]
        sidecar_flags, runtime_flags = _flags(sidecar["args"]), _flags(runtime["args"])
        if not enabled:
            assert "--kv-events-endpoint" not in sidecar_flags and "--kv-events-config" not in runtime_flags
            continue
        assert sidecar_flags["--kv-events-endpoint"] == "tcp://127.0.0.1:5600"
        assert json.loads(runtime_flags["--kv-events-config"]) == {
            "enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://127.0.0.1:5600"}
        assert runtime_flags["--block-size"] == "32"


@pytest.mark.parametrize("runtime", ["engine", "vllm"])
def test_runtimes_schedule_by_the_priority_the_picker_writes(render: RenderFn, runtime: str) -> None:
    def flags(values: dict[str, Any]) -> tuple[dict[str, str], list[str]]:
        rendered = render({"modelServer": {"runtime": runtime, "model": "m" if runtime == "vllm" else "tiny", **values}})
        _validate_schemas(rendered)
        (runtime_container,) = rendered.get("Deployment", name_of("model-server"))["spec"]["template"]["spec"][
            "containers"]
        (picker,) = rendered.get("Deployment", name_of("picker"))["spec"]["template"]["spec"]["containers"]
        return _flags(runtime_container["args"]), picker["args"]

    runtime_flags, picker_args = flags({})
    assert runtime_flags["--scheduling-policy"] == "priority" and "--runtime-priority" in picker_args
    # the reference engine does not chunk prefills: only vLLM gets the smaller step budget
    assert runtime_flags.get("--max-num-batched-tokens") == ("2048" if runtime == "vllm" else None)
    runtime_flags, picker_args = flags({"scheduling": {"policy": "fcfs", "maxNumBatchedTokens": 0}})
    assert runtime_flags["--scheduling-policy"] == "fcfs" and "--runtime-priority" not in picker_args
    assert "--max-num-batched-tokens" not in runtime_flags


def test_single_replica_components_get_no_blocking_disruption_budget(render: RenderFn) -> None:
    one = {"replicas": 1}
    rendered = render({"picker": one, "controller": one, "gateway": {"envoy": one}, "modelServer": one})
    assert rendered.names("PodDisruptionBudget") == {name_of("model-server")}  # maxUnavailable: 1 never blocks
    assert len(render().of_kind("PodDisruptionBudget")) == 4


def test_clusters_without_native_sidecars_are_refused(helm_bin: str, tmp_path: Path) -> None:
    for version, ok in (("1.28.9", False), ("1.29.0", True)):
        result = helm_template(helm_bin, {}, tmp_path, "--kube-version", version)
        assert (result.returncode == 0) is ok, (version, result.stderr)
        if not ok:
            assert "kubeVersion" in result.stderr or ">=1.29" in result.stderr, result.stderr


def test_model_weights_from_a_volume_and_runtime_environment(render: RenderFn) -> None:
    weights = {"name": "models", "persistentVolumeClaim": {"claimName": "llama-weights", "readOnly": True}}
    mount = {"name": "models", "mountPath": "/models", "readOnly": True}
    token = {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}
    for runtime, model in (("vllm", "/models/llama"), ("engine", "tiny")):
        rendered = render({"modelServer": {"runtime": runtime, "model": model, "runtimeEnv": [token],
                                           "extraVolumes": [weights], "runtimeVolumeMounts": [mount]}})
        _validate_schemas(rendered)
        pod = rendered.get("Deployment", name_of("model-server"))["spec"]["template"]["spec"]
        (runtime_container,) = pod["containers"]
        assert weights in pod["volumes"] and mount in runtime_container["volumeMounts"]
        assert token in runtime_container["env"]
        assert mount not in pod["initContainers"][0]["volumeMounts"], "the sidecar does not need the weights"
