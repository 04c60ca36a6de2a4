"""``loraplane devcluster`` as a process: snapshot across restarts, bearer token, CRDs from a folder, bad input."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from kubernetes import client, config

from e2e.fixtures.devcluster import start_devcluster
from loraplane.devcluster import Cluster, ServerThread, SnapshotFile
from loraplane.devcluster.cli import main
from tests.devcluster.conftest import TLS, adapter_revision

WIDGET_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
    "metadata": {"name": "widgets.example.com"},
    "spec": {"group": "example.com", "scope": "Namespaced", "names": {"kind": "Widget", "plural": "widgets"},
             "versions": [{"name": "v1", "served": True, "storage": True, "additionalPrinterColumns": [
                 {"name": "Size", "type": "integer", "jsonPath": ".spec.size"}],
                 "schema": {"openAPIV3Schema": {"type": "object", "properties": {"spec": {
                     "type": "object", "properties": {"size": {"type": "integer"}}}}}}}]},
}


@pytest.mark.slow
def test_snapshot_survives_a_restart(tmp_path: Path) -> None:
    snapshot = tmp_path / "state.json"
    first = start_devcluster(tmp_path / "a", ["--snapshot", str(snapshot)])
    try:
        first.kubectl("apply", "-f", "-", stdin=yaml.safe_dump(adapter_revision("claims-v1")))
        before = json.loads(first.kubectl("get", "ar", "claims-v1", "-o", "json").stdout)
    finally:
        assert first.stop() == 0
    saved = json.loads(snapshot.read_text())
    assert int(saved["resourceVersion"]) >= int(before["metadata"]["resourceVersion"])
    second = start_devcluster(tmp_path / "b", ["--snapshot", str(snapshot)])
    try:
        after = json.loads(second.kubectl("get", "ar", "claims-v1", "-o", "json").stdout)
        assert after["metadata"] == before["metadata"]
        second.kubectl("apply", "-f", "-", stdin=yaml.safe_dump(adapter_revision("claims-v2", revision="v2")))
        newer = json.loads(second.kubectl("get", "ar", "claims-v2", "-o", "json").stdout)
        assert int(newer["metadata"]["resourceVersion"]) > int(before["metadata"]["resourceVersion"])
        # The history before the restart is gone: watching from it is 410 Gone, not a silent gap.
        with httpx.Client(base_url=second.url, verify=TLS) as http:
            gone = http.get("/apis/loraplane.io/v1alpha1/adapterrevisions",
                            params={"watch": "true", "resourceVersion": "1", "timeoutSeconds": "1"})
        assert json.loads(gone.text.splitlines()[0])["object"]["code"] == 410
    finally:
        second.stop()


@pytest.mark.slow
def test_token_and_crds_from_a_folder(tmp_path: Path) -> None:
    crds = tmp_path / "crds"
    crds.mkdir()
    (crds / "widgets.yaml").write_text(yaml.safe_dump(WIDGET_CRD))
    (crds / "notes.txt").write_text("not a CRD")
    cluster = start_devcluster(tmp_path / "c", ["--token", "s3cret", "--crds", str(crds), "--no-default-crds"])
    try:
        widgets = "/apis/example.com/v1/namespaces/default/widgets"
        widget = {"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w"}, "spec": {"size": 3}}
        with httpx.Client(base_url=cluster.url, verify=TLS) as http:
            assert http.post(widgets, json=widget).status_code == 401
            assert http.get(widgets, headers={"Authorization": "Bearer wrong"}).status_code == 401
            assert http.get("/readyz").status_code == 200
        # The kubeconfig carries the token (the Python client sends it; kubectl sends credentials only over TLS).
        api = config.new_client_from_config(config_file=str(cluster.kubeconfig))
        try:
            custom: Any = client.CustomObjectsApi(api)
            custom.create_namespaced_custom_object("example.com", "v1", "default", "widgets", widget)
            listed = custom.list_namespaced_custom_object("example.com", "v1", "default", "widgets")
            assert [w["spec"]["size"] for w in listed["items"]] == [3]
            groups = {g.name for g in client.ApisApi(api).get_api_versions().groups}
            assert "example.com" in groups and "loraplane.io" not in groups
        finally:
            api.close()
    finally:
        cluster.stop()


def test_in_process_server_keeps_a_snapshot(tmp_path: Path) -> None:
    snapshot = SnapshotFile(tmp_path / "state.json")
    with ServerThread(snapshot=snapshot) as server, httpx.Client(base_url=server.url, verify=TLS) as http:
        created = http.post("/api/v1/namespaces", json={"metadata": {"name": "kept"}}).json()
    restored = Cluster(store=snapshot.load_store())
    namespace = restored.get(restored.resource("", "v1", "namespaces"), None, "kept")
    assert namespace["metadata"]["uid"] == created["metadata"]["uid"]
    assert restored.store.revision == int(created["metadata"]["resourceVersion"])


def test_bad_start_up_input_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    corrupt = tmp_path / "state.json"
    for content in ("{ half a snapshot", "[1, 2]", '{"objects": {"pods": [{"no": "metadata"}]}}'):
        corrupt.write_text(content)
        assert main(["--port", "0", "--kubeconfig", str(tmp_path / "kc"), "--snapshot", str(corrupt)]) == 1
        assert corrupt.read_text() == content  # nothing overwritten
        assert "is not a devcluster snapshot" in capsys.readouterr().err
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        assert main(["--port", str(port), "--kubeconfig", str(tmp_path / "kc")]) == 1
    bad_crds = tmp_path / "bad"
    bad_crds.mkdir()
    (bad_crds / "x.yaml").write_text(yaml.safe_dump({**WIDGET_CRD, "metadata": {"name": "wrong.name"}}))
    assert main(["--port", "0", "--kubeconfig", str(tmp_path / "kc"), "--crds", str(bad_crds)]) == 1
    assert not (tmp_path / "kc").exists()
