"""The official ``kubernetes`` Python client (what the controller uses) against a devcluster: typed and custom
object CRUD, list + watch with resourceVersion, bookmarks, 410 Gone and optimistic concurrency."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client, config, watch
from kubernetes.client.rest import ApiException

from loraplane.api import AdapterRevision
from loraplane.devcluster import ServerThread, write_kubeconfig
from tests.devcluster.conftest import adapter_revision

GROUP, VERSION, PLURAL = "loraplane.io", "v1alpha1", "adapterrevisions"


@pytest.fixture
def api(server: ServerThread, tmp_path: Path) -> Iterator[client.ApiClient]:
    path = write_kubeconfig(tmp_path / "kubeconfig", server.url)
    api_client = config.new_client_from_config(config_file=str(path))
    try:
        yield api_client
    finally:
        api_client.close()


def test_typed_clients_read_and_write_core_objects(api: client.ApiClient) -> None:
    core: Any = client.CoreV1Api(api)
    assert {"default", "kube-system"} <= {ns.metadata.name for ns in core.list_namespace().items}
    pod = client.V1Pod(metadata=client.V1ObjectMeta(name="engine-0", labels={"pool": "llama3-8b"}),
                       spec=client.V1PodSpec(containers=[client.V1Container(name="engine", image="engine:1")]))
    created = core.create_namespaced_pod("default", pod)
    assert created.status.phase == "Pending"
    created.status = client.V1PodStatus(phase="Running", pod_ip="10.0.0.9")
    core.replace_namespaced_pod_status("engine-0", "default", created)
    pods = core.list_namespaced_pod("default", label_selector="pool=llama3-8b", field_selector="status.phase=Running")
    assert [(p.metadata.name, p.status.pod_ip) for p in pods.items] == [("engine-0", "10.0.0.9")]
    with pytest.raises(ApiException) as missing:
        core.read_namespaced_pod("nope", "default")
    assert missing.value.status == 404


def test_custom_objects_round_trip_through_the_api_models(api: client.ApiClient) -> None:
    custom: Any = client.CustomObjectsApi(api)
    custom.create_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, adapter_revision("claims-v1"))
    custom.patch_namespaced_custom_object_status(GROUP, VERSION, "default", PLURAL, "claims-v1",
                                                 {"status": {"phase": "Verifying", "observedGeneration": 1}})
    raw = custom.get_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, "claims-v1")
    model = AdapterRevision.model_validate(raw)
    assert model.status.phase == "Verifying" and model.status.observed_generation == 1
    with pytest.raises(ApiException) as invalid:
        custom.patch_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, "claims-v1",
                                              {"spec": {"lora": {"rank": 3}}})
    assert invalid.value.status == 422
    assert "spec.lora.rank: Unsupported value: 3" in str(invalid.value.body)


def test_optimistic_concurrency_on_leases(api: client.ApiClient) -> None:
    leases: Any = client.CoordinationV1Api(api)
    lease = client.V1Lease(metadata=client.V1ObjectMeta(name="controller"),
                           spec=client.V1LeaseSpec(holder_identity="replica-a", lease_duration_seconds=15))
    mine = leases.create_namespaced_lease("default", lease)
    theirs = leases.read_namespaced_lease("controller", "default")
    theirs.spec.holder_identity = "replica-b"
    leases.replace_namespaced_lease("controller", "default", theirs)
    mine.spec.holder_identity = "replica-a"
    with pytest.raises(ApiException) as conflict:
        leases.replace_namespaced_lease("controller", "default", mine)
    assert conflict.value.status == 409


def _collect(stream: Iterator[dict[str, Any]], events: list[tuple[str, str]]) -> None:
    for event in stream:
        obj = event["raw_object"]
        events.append((event["type"], obj["metadata"].get("name", "")))


def test_list_then_watch_from_the_list_resource_version(api: client.ApiClient) -> None:
    custom: Any = client.CustomObjectsApi(api)
    custom.create_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, adapter_revision("before"))
    listed = custom.list_namespaced_custom_object(GROUP, VERSION, "default", PLURAL)
    events: list[tuple[str, str]] = []
    stream = watch.Watch().stream(custom.list_namespaced_custom_object, GROUP, VERSION, "default", PLURAL,
                                  resource_version=listed["metadata"]["resourceVersion"], timeout_seconds=3,
                                  label_selector="team=claims")
    reader = threading.Thread(target=_collect, args=(stream, events))
    reader.start()
    time.sleep(0.3)
    labelled = adapter_revision("claims-v2")
    labelled["metadata"]["labels"] = {"team": "claims"}
    custom.create_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, labelled)
    custom.create_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, adapter_revision("unlabelled"))
    custom.patch_namespaced_custom_object_status(GROUP, VERSION, "default", PLURAL, "claims-v2",
                                                 {"status": {"phase": "Canary"}})
    custom.patch_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, "claims-v2",
                                          {"metadata": {"labels": {"team": "other"}}})
    reader.join(10)
    # Leaving the selector reads as a deletion, as the API server's watch cache reports it.
    assert events == [("ADDED", "claims-v2"), ("MODIFIED", "claims-v2"), ("DELETED", "claims-v2")]


def test_watch_without_resource_version_starts_with_what_exists(api: client.ApiClient) -> None:
    core: Any = client.CoreV1Api(api)
    events = [(e["type"], e["object"].metadata.name)
              for e in watch.Watch().stream(core.list_namespace, timeout_seconds=1)]
    assert ("ADDED", "default") in events and all(kind == "ADDED" for kind, _ in events)


def test_bookmarks_carry_the_current_resource_version(api: client.ApiClient, server: ServerThread) -> None:
    custom: Any = client.CustomObjectsApi(api)
    created = custom.create_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, adapter_revision("claims-v1"))
    kinds = []
    watcher = watch.Watch()
    for event in watcher.stream(custom.list_namespaced_custom_object, GROUP, VERSION, "default", PLURAL,
                                resource_version=created["metadata"]["resourceVersion"], allow_watch_bookmarks=True,
                                timeout_seconds=1):
        kinds.append(event["type"])
        if event["type"] == "BOOKMARK":
            assert event["raw_object"]["metadata"]["resourceVersion"] == str(server.api.cluster.store.revision)
    assert kinds and set(kinds) == {"BOOKMARK"}  # nothing changed: only bookmarks (every 0.2 s and at the end)
    assert watcher.resource_version == str(server.api.cluster.store.revision)


def test_watch_from_a_compacted_resource_version_is_gone(api: client.ApiClient, server: ServerThread) -> None:
    custom: Any = client.CustomObjectsApi(api)
    old = custom.create_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, adapter_revision("claims-v1"))
    custom.patch_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, "claims-v1", {"spec": {"paused": True}})
    server.call(server.api.cluster.store.compact)
    with pytest.raises(ApiException) as gone:
        list(watch.Watch().stream(custom.list_namespaced_custom_object, GROUP, VERSION, "default", PLURAL,
                                  resource_version=old["metadata"]["resourceVersion"], timeout_seconds=2))
    assert gone.value.status == 410
    current = custom.list_namespaced_custom_object(GROUP, VERSION, "default", PLURAL)["metadata"]["resourceVersion"]
    assert list(watch.Watch().stream(custom.list_namespaced_custom_object, GROUP, VERSION, "default", PLURAL,
                                     resource_version=current, timeout_seconds=1)) == []
