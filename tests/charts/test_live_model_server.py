"""The chart's model-server pod, run for real with the reference engine: the engine and the sidecar started with
the arguments the chart gives them (listen address loopback instead of 0.0.0.0, the pod's IP 127.0.0.1), a real
redis-server, and an adapter artifact the sidecar may read (``modelServer.sidecar.extraArgs: --file-root``).

It checks the wiring a unit test cannot: the sidecar reaches the engine's loopback-only admin API, the engine accepts
adapters from the cache directory the sidecar fills (its ``--adapter-root``), and the report names the address the
InferencePool routes to.
"""

from __future__ import annotations

import hashlib
import re
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from e2e.fixtures.processes import ManagedProcess, RedisServer, free_port, wait_for_port
from e2e.fixtures.waiting import wait_until
from loraplane.api import (
    AdapterTarget,
    Artifact,
    LoraSpec,
    ResidencyReport,
    TargetState,
    Tier,
    cache_key,
    keys,
    served_name,
)
from loraplane.engine.make_adapters import model_config, write_adapter
from tests.charts.conftest import RenderFn, name_of

POOL = "live-pool"
POD = "model-server-0"
MODULES = ["q_proj", "v_proj"]




def _artifact(tmp_path: Path) -> tuple[Path, str]:
    """A real PEFT adapter for the tiny model, as a tar file; (path, sha256 digest)."""
    directory = tmp_path / "artifacts" / "support-bot-v3"
    write_adapter(directory, model_config("tiny"), 8, seed=3, targets=MODULES)
    artifact = directory.parent / "support-bot-v3.tar"
    with tarfile.open(artifact, "w") as tar:
        tar.add(directory, arcname=directory.name)
    return artifact, "sha256:" + hashlib.sha256(artifact.read_bytes()).hexdigest()


def _command(container: dict[str, Any]) -> list[str]:
    """The container's command line with the kubelet's $(VAR)s filled in and loopback for 0.0.0.0."""
    values = {"POD_NAME": POD, "POD_IP": "127.0.0.1"}
    args = [re.sub(r"\$\((\w+)\)", lambda m: values[m.group(1)], a).replace("0.0.0.0", "127.0.0.1")
            for a in container["args"]]
    return [str(Path(sys.executable).with_name(container["command"][0])), *args]


@pytest.mark.slow
def test_the_charts_sidecar_loads_an_adapter_into_the_charts_engine(
    render: RenderFn, redis_srv: RedisServer, tmp_path: Path
) -> None:
    artifact, digest = _artifact(tmp_path)
    port, metrics = free_port(), free_port()
    values = {
        "pool": {"name": POOL},
        "redis": {"bundled": False, "external": {"url": redis_srv.url}},
        "modelServer": {
            "runtime": "engine", "port": port,
            "adapterCache": {"mountPath": str(tmp_path / "cache")},
            "engine": {"extraArgs": ["--max-model-len=128"]},
            "sidecar": {"ports": {"metrics": metrics},
                        "extraArgs": [f"--file-root={artifact.parent}", "--heartbeat=0.3"]},
        },
    }
    pod = render(values).get("Deployment", name_of("model-server"))["spec"]["template"]["spec"]
    (tmp_path / "cache").mkdir()  # the emptyDir
    engine = ManagedProcess(_command(pod["containers"][0]), tmp_path / "engine.log").start()
    sidecar = ManagedProcess(_command(pod["initContainers"][0]), tmp_path / "sidecar.log").start()
    client = redis.Redis.from_url(redis_srv.url)
    try:
        wait_for_port(port, proc=engine.proc, timeout=120)
        wait_for_port(metrics, proc=sidecar.proc, timeout=60)
        base = httpx.get(f"http://127.0.0.1:{port}/admin/adapters", timeout=10).json()["base_model_digest"]
        name = served_name("support-bot", "v3")
        target = AdapterTarget(
            served_name=name, adapter="support-bot", revision="v3", tier=Tier.GPU,
            artifact=Artifact(uri=artifact.as_uri(), digest=digest),
            lora=LoraSpec(rank=8, alpha=8, dtype="float32", target_modules=MODULES),
            base_model_digest=base, cache_key=cache_key(base, "support-bot", "v3", digest),
        )
        state = TargetState(pool=POOL, pod=POD, generation=1, adapters=[target], updated_at=time.time())
        client.set(keys.target_state(POOL, POD), state.to_json())
        client.publish(keys.target_changed_channel(POOL), POD)

        def warm_report() -> ResidencyReport | None:
            raw = client.get(keys.residency_report(POOL, POD))
            report = ResidencyReport.model_validate_json(raw) if raw else None
            row = report.by_name().get(name) if report else None
            return report if row is not None and row.tier is Tier.GPU and row.digest == digest else None

        report = wait_until(warm_report, 60, "the adapter GPU-warm in the report", engine, sidecar)
        assert report.address == f"127.0.0.1:{port}" and report.ready and report.runtime == "engine"
        held = httpx.get(f"http://127.0.0.1:{port}/admin/adapters", timeout=10).json()["adapters"]
        assert [a["served_name"] for a in held if a["tier"] == "gpu"] == [name]
        assert httpx.get(f"http://127.0.0.1:{metrics}/healthz", timeout=5).status_code == 200  # the readiness probe
        completion = httpx.post(f"http://127.0.0.1:{port}/v1/completions",
                                json={"model": name, "prompt": "hi", "max_tokens": 2}, timeout=30)
        assert completion.status_code == 200, completion.text
    finally:
        client.close()
        sidecar.stop()
        engine.stop()
