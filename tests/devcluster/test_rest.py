"""The REST semantics over real HTTP: discovery, CRUD, patches, status, generation, conflicts, finalizers,
namespaces, selectors, validation and tables."""

from __future__ import annotations

import copy
import json
import time
from typing import Any

import httpx
import pytest

from loraplane.api import AdapterRevision, AdapterRevisionSpec, LoraSpec
from loraplane.devcluster import ServerThread
from tests.devcluster.conftest import (
    AR_PATH,
    DIGEST_A,
    DIGEST_B,
    POOL_PATH,
    FixedClock,
    adapter_revision,
    inference_pool,
)

MERGE = {"Content-Type": "application/merge-patch+json"}
JSON_PATCH = {"Content-Type": "application/json-patch+json"}
STRATEGIC = {"Content-Type": "application/strategic-merge-patch+json"}
TABLE = {"Accept": "application/json;as=Table;v=v1;g=meta.k8s.io,application/json"}


def _create(http: httpx.Client, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = http.post(path, json=body)
    assert response.status_code == 201, response.text
    created: dict[str, Any] = response.json()
    return created


def _pod(name: str, labels: dict[str, str] | None = None) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels or {}},
            "spec": {"containers": [{"name": "engine", "image": "engine:1", "env": [{"name": "A", "value": "1"}]},
                                    {"name": "sidecar", "image": "sidecar:1"}]}}


def test_discovery_lists_builtin_and_crd_kinds(http: httpx.Client) -> None:
    assert http.get("/api").json()["versions"] == ["v1"]
    groups = {g["name"]: g for g in http.get("/apis").json()["groups"]}
    assert {"loraplane.io", "inference.networking.k8s.io", "coordination.k8s.io", "events.k8s.io",
            "apiextensions.k8s.io"} <= set(groups)
    assert groups["loraplane.io"]["preferredVersion"]["groupVersion"] == "loraplane.io/v1alpha1"
    resources = {r["name"]: r for r in http.get("/apis/loraplane.io/v1alpha1").json()["resources"]}
    assert resources["adapterrevisions"]["kind"] == "AdapterRevision"
    assert resources["adapterrevisions"]["namespaced"] is True
    assert set(resources["adapterrevisions"]["shortNames"]) == {"ar", "adrev"}
    assert "adapterrevisions/status" in resources
    core = {r["name"] for r in http.get("/api/v1").json()["resources"]}
    assert {"pods", "pods/status", "namespaces", "events"} <= core
    assert http.get("/version").json()["major"] == "1"
    assert "/apis" in http.get("/").json()["paths"]
    assert http.get("/apis/nope.example/v1").status_code == 404


def test_aggregated_discovery_in_one_request(http: httpx.Client) -> None:
    accept = {"Accept": "application/json;g=apidiscovery.k8s.io;v=v2;as=APIGroupDiscoveryList,application/json"}
    response = http.get("/apis", headers=accept)
    assert response.headers["content-type"] == "application/json;g=apidiscovery.k8s.io;v=v2;as=APIGroupDiscoveryList"
    groups = {g["metadata"]["name"]: g for g in response.json()["items"]}
    [version] = groups["loraplane.io"]["versions"]
    [resource] = version["resources"]
    assert resource["responseKind"] == {"group": "loraplane.io", "version": "v1alpha1", "kind": "AdapterRevision"}
    assert resource["scope"] == "Namespaced" and resource["subresources"][0]["subresource"] == "status"
    core = http.get("/api", headers=accept).json()["items"]
    assert [v["version"] for v in core[0]["versions"]] == ["v1"]
    assert http.get("/apis").json()["kind"] == "APIGroupList"  # plain clients still get the legacy document


def test_openapi_v3_advertises_field_validation_and_the_crd_schema(http: httpx.Client) -> None:
    index = http.get("/openapi/v3").json()["paths"]
    doc = http.get(index["apis/loraplane.io/v1alpha1"]["serverRelativeURL"]).json()
    item = doc["paths"]["/apis/loraplane.io/v1alpha1/namespaces/{namespace}/adapterrevisions/{name}"]
    assert "fieldValidation" in {p["name"] for p in item["patch"]["parameters"]}
    schema = doc["components"]["schemas"]["io.loraplane.v1alpha1.AdapterRevision"]
    assert schema["x-kubernetes-group-version-kind"] == [{"group": "loraplane.io", "version": "v1alpha1", "kind": "AdapterRevision"}]
    assert schema["properties"]["spec"]["properties"]["lora"]["properties"]["rank"]["enum"][0] == 1
    assert http.get("/openapi/v2").status_code == 404


def test_create_get_list_delete_round_trip(http: httpx.Client) -> None:
    created = _create(http, AR_PATH, adapter_revision("claims-v1"))
    meta = created["metadata"]
    assert meta["generation"] == 1 and meta["uid"] and meta["creationTimestamp"] == "2026-01-02T03:04:05Z"
    assert "status" not in created  # the status subresource owns status
    # Defaults from the CRD schema are the api models' defaults.
    spec = AdapterRevisionSpec.model_fields
    assert created["spec"]["tenant"] == spec["tenant"].default
    assert created["spec"]["lora"]["dtype"] == LoraSpec.model_fields["dtype"].default
    assert AdapterRevision.model_validate(created).spec.adapter == "claims"
    fetched = http.get(f"{AR_PATH}/claims-v1").json()
    assert fetched == created
    listed = http.get(AR_PATH).json()
    assert listed["kind"] == "AdapterRevisionList"
    assert [i["metadata"]["name"] for i in listed["items"]] == ["claims-v1"]
    assert int(listed["metadata"]["resourceVersion"]) >= int(meta["resourceVersion"])
    again = http.post(AR_PATH, json=adapter_revision("claims-v1"))
    assert again.status_code == 409 and again.json()["reason"] == "AlreadyExists"
    assert http.delete(f"{AR_PATH}/claims-v1").status_code == 200
    missing = http.get(f"{AR_PATH}/claims-v1")
    assert missing.status_code == 404
    assert missing.json()["message"] == 'adapterrevisions.loraplane.io "claims-v1" not found'


def test_invalid_custom_resource_gets_kubernetes_field_errors(http: httpx.Client) -> None:
    body = adapter_revision("bad")
    body["spec"]["lora"]["rank"] = 7
    del body["spec"]["artifact"]
    body["spec"]["tenant"] = "Not_A_Label"
    response = http.post(AR_PATH, json=body)
    assert response.status_code == 422
    status = response.json()
    assert status["reason"] == "Invalid" and status["details"]["kind"] == "AdapterRevision"
    causes = {c["field"]: c["message"] for c in status["details"]["causes"]}
    assert causes["spec.lora.rank"] == ('Unsupported value: 7: supported values: "1", "8", "16", "32", "64", "128", '
                                        '"256", "320", "512"')
    assert causes["spec.artifact"] == "Required value"
    assert causes["spec.tenant"].startswith('Invalid value: "Not_A_Label": spec.tenant in body should match')
    assert status["message"].startswith('AdapterRevision.loraplane.io "bad" is invalid: [')
    assert http.get(f"{AR_PATH}/bad").status_code == 404


def test_unknown_fields_are_pruned_warned_or_refused(http: httpx.Client) -> None:
    body = adapter_revision("extra")
    body["spec"]["typo"] = 1
    body["metadata"]["colour"] = "red"
    strict = http.post(f"{AR_PATH}?fieldValidation=Strict", json=body)
    assert strict.status_code == 400
    assert strict.json()["message"] == ('AdapterRevision in version "v1alpha1" cannot be handled as a AdapterRevision: '
                                        'strict decoding error: unknown field "metadata.colour", unknown field "spec.typo"')
    warned = http.post(AR_PATH, json=body)
    assert warned.status_code == 201
    assert "typo" not in warned.json()["spec"] and "colour" not in warned.json()["metadata"]
    ignored = http.post(f"{AR_PATH}?fieldValidation=Ignore", json={**body, "metadata": {"name": "quiet"}})
    assert ignored.status_code == 201 and "warning" not in ignored.headers
    assert 'unknown field \\"spec.typo\\"' in warned.headers["warning"]


@pytest.mark.parametrize(("field", "patch"), [
    ("spec.adapter", {"adapter": "other"}),
    ("spec.revision", {"revision": "v9"}),
    ("spec.poolRef", {"poolRef": {"name": "another-pool"}}),
    ("spec.baseModel", {"baseModel": {"digest": DIGEST_A}}),
    ("spec.artifact.uri", {"artifact": {"uri": "oci://registry.local/adapters/claims:elsewhere"}}),
    ("spec.artifact.digest", {"artifact": {"digest": DIGEST_B}}),
    ("spec.lora", {"lora": {"alpha": 64}}),
    ("spec.lora", {"lora": {"targetModules": ["q_proj"]}}),
])
def test_the_fields_that_define_what_is_served_are_immutable(http: httpx.Client, field: str,
                                                               patch: dict[str, Any]) -> None:
    """CEL ``self == oldSelf`` rules generated from the api models' marks, enforced on update as a real API server
    does; the object is left as it was."""
    created = _create(http, AR_PATH, adapter_revision("claims-v1"))
    changed = http.patch(f"{AR_PATH}/claims-v1", json={"spec": patch}, headers=MERGE)
    assert changed.status_code == 422, changed.text
    (cause,) = changed.json()["details"]["causes"]
    assert (cause["field"], cause["reason"]) == (field, "FieldValueInvalid")
    assert cause["message"].endswith(f"{field} is immutable; create a new AdapterRevision")
    assert http.get(f"{AR_PATH}/claims-v1").json()["spec"] == created["spec"]


def test_the_rest_of_the_spec_stays_mutable(http: httpx.Client) -> None:
    _create(http, AR_PATH, adapter_revision("claims-v1"))
    patch = {"spec": {"paused": True, "warmPolicy": "cpu", "tenant": "other", "artifact": {"sizeBytes": 1024},
                      "rollout": {"steps": [{"weight": 50, "pauseSeconds": 5}], "progressDeadlineSeconds": 60}}}
    changed = http.patch(f"{AR_PATH}/claims-v1", json=patch, headers=MERGE)
    assert changed.status_code == 200, changed.text
    assert changed.json()["spec"]["rollout"]["progressDeadlineSeconds"] == 60


def test_cel_either_or(http: httpx.Client) -> None:
    both = adapter_revision("both")
    both["spec"]["rollout"] = {"canary": {"pods": 1, "fraction": 0.5}}
    refused = http.post(AR_PATH, json=both)
    assert refused.status_code == 422
    assert "canary: set either pods or fraction, not both" in refused.json()["message"]


def test_annotations_over_256_kib_in_total_are_refused(http: httpx.Client) -> None:
    """A real API server refuses annotations whose keys and values total more than 256 KiB (one 300 KiB value, or
    several smaller ones), on create and on update."""
    body = adapter_revision("annotated")
    body["metadata"]["annotations"] = {"example.com/big": "x" * (300 * 1024)}
    refused = http.post(AR_PATH, json=body)
    assert refused.status_code == 422
    assert refused.json()["details"]["causes"] == [{
        "reason": "FieldValueTooLong", "field": "metadata.annotations",
        "message": "Too long: may not be more than 262144 bytes"}]
    body["metadata"]["annotations"] = {f"example.com/part-{i}": "x" * (64 * 1024) for i in range(3)}
    _create(http, AR_PATH, body)  # 192 KiB: allowed
    more = http.patch(f"{AR_PATH}/annotated", json={"metadata": {"annotations": {"example.com/part-3": "x" * 65536}}},
                      headers=MERGE)
    assert more.status_code == 422 and "metadata.annotations: Too long" in more.json()["message"]
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "annotations": {"a": "x" * (257 * 1024)}},
           "spec": {"containers": [{"name": "c", "image": "i"}]}}
    assert http.post("/api/v1/namespaces/default/pods", json=pod).status_code == 422  # every kind


def test_an_object_larger_than_etcd_stores_is_refused(http: httpx.Client) -> None:
    """Under the 3 MiB request limit but over etcd's 1.5 MiB: refused, nothing stored."""
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "huge"},
           "spec": {"containers": [{"name": f"c{i}", "image": "i", "command": ["x" * 1024] * 100}
                                   for i in range(18)]}}
    refused = http.post("/api/v1/namespaces/default/pods", json=pod)
    assert refused.status_code == 413
    assert refused.json()["reason"] == "RequestEntityTooLarge"
    assert "etcdserver: request is too large" in refused.json()["message"]
    assert http.get("/api/v1/namespaces/default/pods/huge").status_code == 404


def test_generation_moves_on_spec_changes_only(http: httpx.Client) -> None:
    _create(http, AR_PATH, adapter_revision("claims-v1"))
    labelled = http.patch(f"{AR_PATH}/claims-v1", json={"metadata": {"labels": {"team": "a"}}}, headers=MERGE).json()
    assert labelled["metadata"]["generation"] == 1
    paused = http.patch(f"{AR_PATH}/claims-v1", json={"spec": {"paused": True}}, headers=MERGE).json()
    assert paused["metadata"]["generation"] == 2
    status = http.patch(f"{AR_PATH}/claims-v1/status", json={"status": {"phase": "Verifying"}}, headers=MERGE).json()
    assert status["metadata"]["generation"] == 2
    assert status["status"]["phase"] == "Verifying" and status["status"]["trafficWeight"] == 0  # defaulted
    same = http.patch(f"{AR_PATH}/claims-v1", json={"spec": {"paused": True}}, headers=MERGE).json()
    assert same["metadata"]["resourceVersion"] == status["metadata"]["resourceVersion"]  # no-op writes nothing


def test_status_subresource_separates_spec_and_status(http: httpx.Client) -> None:
    created = _create(http, AR_PATH, adapter_revision("claims-v1"))
    on_main = copy.deepcopy(created)
    on_main["status"] = {"phase": "Stable"}
    on_main["spec"]["pinned"] = True
    updated = http.put(f"{AR_PATH}/claims-v1", json=on_main).json()
    assert "status" not in updated and updated["spec"]["pinned"] is True
    on_status = copy.deepcopy(updated)
    on_status["status"] = {"phase": "Canary", "canaryStep": 1, "trafficWeight": 10}
    on_status["spec"]["pinned"] = False
    result = http.put(f"{AR_PATH}/claims-v1/status", json=on_status).json()
    assert result["status"]["phase"] == "Canary" and result["spec"]["pinned"] is True
    bad = http.patch(f"{AR_PATH}/claims-v1/status", json={"status": {"trafficWeight": 101}}, headers=MERGE)
    assert bad.status_code == 422
    assert bad.json()["details"]["causes"][0]["field"] == "status.trafficWeight"


def test_stale_resource_version_is_a_conflict(http: httpx.Client) -> None:
    created = _create(http, AR_PATH, adapter_revision("claims-v1"))
    first = copy.deepcopy(created)
    first["spec"]["pinned"] = True
    assert http.put(f"{AR_PATH}/claims-v1", json=first).status_code == 200
    second = copy.deepcopy(created)
    second["spec"]["paused"] = True
    stale = http.put(f"{AR_PATH}/claims-v1", json=second)
    assert stale.status_code == 409
    assert stale.json()["reason"] == "Conflict"
    assert "the object has been modified" in stale.json()["message"]
    stale_patch = http.patch(f"{AR_PATH}/claims-v1", headers=MERGE, json={
        "metadata": {"resourceVersion": created["metadata"]["resourceVersion"]}, "spec": {"paused": True}})
    assert stale_patch.status_code == 409
    precondition = http.request("DELETE", f"{AR_PATH}/claims-v1",
                                json={"preconditions": {"resourceVersion": created["metadata"]["resourceVersion"]}})
    assert precondition.status_code == 409


def test_json_patch_and_its_test_operation(http: httpx.Client) -> None:
    _create(http, AR_PATH, adapter_revision("claims-v1"))
    ops = [{"op": "test", "path": "/spec/pinned", "value": False}, {"op": "replace", "path": "/spec/pinned", "value": True},
           {"op": "add", "path": "/metadata/labels", "value": {"a": "b"}}]
    patched = http.patch(f"{AR_PATH}/claims-v1", json=ops, headers=JSON_PATCH)
    assert patched.status_code == 200
    assert patched.json()["spec"]["pinned"] is True and patched.json()["metadata"]["labels"] == {"a": "b"}
    failed = http.patch(f"{AR_PATH}/claims-v1", json=ops[:1], headers=JSON_PATCH)
    assert failed.status_code == 422


def test_strategic_merge_patch_merges_lists_by_key_for_builtin_kinds(http: httpx.Client) -> None:
    _create(http, "/api/v1/namespaces/default/pods", _pod("engine-0"))
    patch = {"spec": {"$setElementOrder/containers": [{"name": "engine"}, {"name": "sidecar"}],
                      "containers": [{"name": "engine", "image": "engine:2"}]}}
    pod = http.patch("/api/v1/namespaces/default/pods/engine-0", json=patch, headers=STRATEGIC).json()
    assert [(c["name"], c["image"]) for c in pod["spec"]["containers"]] == [("engine", "engine:2"), ("sidecar", "sidecar:1")]
    assert pod["spec"]["containers"][0]["env"] == [{"name": "A", "value": "1"}]
    delete = {"spec": {"containers": [{"name": "sidecar", "$patch": "delete"}]}}
    pod = http.patch("/api/v1/namespaces/default/pods/engine-0", json=delete, headers=STRATEGIC).json()
    assert [c["name"] for c in pod["spec"]["containers"]] == ["engine"]
    on_cr = http.patch(f"{AR_PATH}/x", json={}, headers=STRATEGIC)
    assert on_cr.status_code in (404, 415)
    _create(http, AR_PATH, adapter_revision("x"))
    assert http.patch(f"{AR_PATH}/x", json={"spec": {}}, headers=STRATEGIC).status_code == 415


def test_pod_status_subresource_and_table(http: httpx.Client, clock: FixedClock) -> None:
    pod = _create(http, "/api/v1/namespaces/default/pods", _pod("engine-0"))
    assert pod["status"]["phase"] == "Pending"
    status = {"status": {"phase": "Running", "podIP": "10.0.0.7", "containerStatuses": [
        {"name": "engine", "ready": True, "restartCount": 2}, {"name": "sidecar", "ready": True, "restartCount": 0}]}}
    running = http.patch("/api/v1/namespaces/default/pods/engine-0/status", json=status, headers=MERGE).json()
    assert running["status"]["podIP"] == "10.0.0.7"
    clock.advance(125)
    table = http.get("/api/v1/namespaces/default/pods", headers=TABLE)
    assert table.headers["content-type"].startswith("application/json;as=Table")
    data = table.json()
    assert [c["name"] for c in data["columnDefinitions"]][:5] == ["Name", "Ready", "Status", "Restarts", "Age"]
    assert data["rows"][0]["cells"][:5] == ["engine-0", "2/2", "Running", 2, "2m5s"]
    assert data["rows"][0]["object"]["kind"] == "PartialObjectMetadata"


def test_adapter_revision_table_uses_printer_columns(http: httpx.Client, clock: FixedClock) -> None:
    _create(http, AR_PATH, adapter_revision("claims-v1"))
    http.patch(f"{AR_PATH}/claims-v1/status", headers=MERGE,
               json={"status": {"phase": "Canary", "trafficWeight": 10, "residency": {"gpu": 2}, "reason": "Waiting"}})
    clock.advance(3600 * 3 + 60 * 5)
    data = http.get(AR_PATH, headers=TABLE).json()
    columns = [c["name"] for c in data["columnDefinitions"]]
    assert columns == ["Name", "Adapter", "Revision", "Phase", "Weight", "GPU", "CPU", "Reason", "Age"]
    assert [c["priority"] for c in data["columnDefinitions"]][7] == 1
    assert data["rows"][0]["cells"] == ["claims-v1", "claims", "v1", "Canary", 10, 2, 0, "Waiting", "3h5m"]


def test_labels_follow_kubernetes_syntax(http: httpx.Client) -> None:
    for labels in ({"bad key": "x"}, {"ok": "no spaces"}, {"Bad_Prefix/name": "x"}, {"k": "v" * 64}):
        response = http.post("/api/v1/namespaces/default/pods", json=_pod("p", labels))
        assert response.status_code == 422, labels
        assert response.json()["details"]["causes"][0]["field"] == "metadata.labels"
    fine = {"app.kubernetes.io/name": "engine", "pool": "", "x": "A-1.b_2"}
    assert http.post("/api/v1/namespaces/default/pods", json=_pod("p", fine)).status_code == 201


def test_label_and_field_selectors(http: httpx.Client) -> None:
    for name, labels in [("a", {"tier": "gpu", "team": "x"}), ("b", {"tier": "cpu"}), ("c", {})]:
        _create(http, "/api/v1/namespaces/default/pods", _pod(name, labels))

    def names(query: str) -> list[str]:
        response = http.get("/api/v1/namespaces/default/pods", params=query)
        assert response.status_code == 200, response.text
        return [i["metadata"]["name"] for i in response.json()["items"]]

    assert names("labelSelector=tier=gpu") == ["a"]
    assert names("labelSelector=tier!=gpu") == ["b", "c"]
    assert names("labelSelector=tier in (gpu,cpu)") == ["a", "b"]
    assert names("labelSelector=tier notin (gpu)") == ["b", "c"]
    assert names("labelSelector=team") == ["a"]
    assert names("labelSelector=!team") == ["b", "c"]
    assert names("labelSelector=tier,team=x") == ["a"]
    assert names("fieldSelector=metadata.name=b") == ["b"]
    assert names("fieldSelector=metadata.name!=b") == ["a", "c"]
    assert names("fieldSelector=status.phase=Pending,metadata.name=c") == ["c"]
    assert http.get("/api/v1/namespaces/default/pods", params="fieldSelector=spec.bogus=1").status_code == 400
    assert http.get("/api/v1/namespaces/default/pods", params="labelSelector=a in b").status_code == 400


def test_pagination_with_limit_and_continue(http: httpx.Client) -> None:
    for i in range(5):
        _create(http, "/api/v1/namespaces/default/pods", _pod(f"p{i}"))
    seen, token = [], ""
    while True:
        page = http.get("/api/v1/namespaces/default/pods", params={"limit": 2, "continue": token}).json()
        seen += [i["metadata"]["name"] for i in page["items"]]
        token = page["metadata"].get("continue", "")
        if not token:
            break
    assert seen == ["p0", "p1", "p2", "p3", "p4"]
    assert http.get("/api/v1/namespaces/default/pods", params={"continue": "garbage"}).status_code == 400


def test_finalizers_hold_deletion_until_removed(http: httpx.Client, clock: FixedClock) -> None:
    body = adapter_revision("claims-v1")
    body["metadata"]["finalizers"] = ["loraplane.io/unload"]
    _create(http, AR_PATH, body)
    clock.advance(10)
    marked = http.delete(f"{AR_PATH}/claims-v1")
    assert marked.status_code == 202
    assert marked.json()["metadata"]["deletionTimestamp"] == "2026-01-02T03:04:15Z"
    assert marked.json()["metadata"]["generation"] == 2
    assert http.get(f"{AR_PATH}/claims-v1").status_code == 200
    more = http.patch(f"{AR_PATH}/claims-v1", headers=MERGE,
                      json={"metadata": {"finalizers": ["loraplane.io/unload", "other"]}})
    assert more.status_code == 422
    done = http.patch(f"{AR_PATH}/claims-v1", headers=MERGE, json={"metadata": {"finalizers": None}})
    assert done.status_code == 200
    assert http.get(f"{AR_PATH}/claims-v1").status_code == 404


def test_namespaces_scope_objects_and_their_deletion_removes_content(http: httpx.Client) -> None:
    assert http.post("/api/v1/namespaces/nowhere/pods", json=_pod("x")).status_code == 404
    _create(http, "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "team-a"}})
    _create(http, "/api/v1/namespaces/team-a/pods", _pod("x"))
    held = adapter_revision("held")
    held["metadata"].update(namespace="team-a", finalizers=["loraplane.io/unload"])
    _create(http, "/apis/loraplane.io/v1alpha1/namespaces/team-a/adapterrevisions", held)
    _create(http, "/api/v1/namespaces/default/pods", _pod("x"))
    everywhere = http.get("/api/v1/pods").json()["items"]
    assert sorted(p["metadata"]["namespace"] for p in everywhere) == ["default", "team-a"]
    assert http.delete("/api/v1/namespaces/team-a").status_code == 202
    namespace = http.get("/api/v1/namespaces/team-a").json()
    assert namespace["status"]["phase"] == "Terminating"
    assert http.get("/api/v1/namespaces/team-a/pods/x").status_code == 404
    assert http.post("/api/v1/namespaces/team-a/pods", json=_pod("y")).status_code == 403
    http.patch("/apis/loraplane.io/v1alpha1/namespaces/team-a/adapterrevisions/held", headers=MERGE,
               json={"metadata": {"finalizers": []}})
    assert http.get("/api/v1/namespaces/team-a").status_code == 404
    assert http.get("/api/v1/namespaces/default/pods/x").status_code == 200
    assert http.delete("/api/v1/namespaces/default").status_code == 403


def test_creating_a_crd_serves_its_kind_and_deleting_it_removes_it(http: httpx.Client) -> None:
    crd = {
        "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
        "metadata": {"name": "widgets.example.com"},
        "spec": {"group": "example.com", "scope": "Cluster",
                 "names": {"kind": "Widget", "plural": "widgets", "singular": "widget"},
                 "versions": [{"name": "v1", "served": True, "storage": True, "schema": {"openAPIV3Schema": {
                     "type": "object", "properties": {"spec": {"type": "object", "properties": {
                         "size": {"type": "integer", "minimum": 1, "default": 3}}}}}}}]},
    }
    created = _create(http, "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", crd)
    assert {c["type"] for c in created["status"]["conditions"]} == {"Established", "NamesAccepted"}
    widget = _create(http, "/apis/example.com/v1/widgets", {"apiVersion": "example.com/v1", "kind": "Widget",
                                                             "metadata": {"name": "w"}, "spec": {}})
    assert widget["spec"]["size"] == 3
    bad = http.post("/apis/example.com/v1/widgets", json={"metadata": {"name": "v"}, "spec": {"size": 0}})
    assert bad.json()["details"]["causes"][0]["message"] == \
        "Invalid value: 0: spec.size in body should be greater than or equal to 1"
    assert http.delete("/apis/apiextensions.k8s.io/v1/customresourcedefinitions/widgets.example.com").status_code in (200, 202)
    assert http.get("/apis/example.com/v1/widgets").status_code == 404
    assert http.get("/apis/apiextensions.k8s.io/v1/customresourcedefinitions/widgets.example.com").status_code == 404


def test_crd_with_cel_outside_the_subset_or_a_broken_schema_is_refused(http: httpx.Client) -> None:
    crd = {"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
           "metadata": {"name": "gadgets.example.com"},
           "spec": {"group": "example.com", "scope": "Namespaced", "names": {"kind": "Gadget", "plural": "gadgets"},
                    "versions": [{"name": "v1", "served": True, "storage": True, "schema": {"openAPIV3Schema": {
                        "type": "object", "x-kubernetes-validations": [{"rule": "self.all(x, x > 0)"}]}}}]}}
    refused = http.post("/apis/apiextensions.k8s.io/v1/customresourcedefinitions", json=crd)
    assert refused.status_code == 422
    assert "compilation failed" in refused.json()["message"]
    schema = crd["spec"]["versions"][0]["schema"]
    for broken in ({"type": "object", "properties": {"a": True}}, {"type": 5}, {"type": "object", "items": []}):
        schema["openAPIV3Schema"] = broken
        response = http.post("/apis/apiextensions.k8s.io/v1/customresourcedefinitions", json=crd)
        assert response.status_code == 422, broken
    crd["spec"]["versions"] = "v1"
    assert http.post("/apis/apiextensions.k8s.io/v1/customresourcedefinitions", json=crd).json()["details"]["causes"] == [
        {"reason": "FieldValueInvalid", "field": "spec.versions",
         "message": 'Invalid value: "string": spec.versions in body must be of type array: "string"'}]


def test_inference_pool_crd_validates_and_defaults(http: httpx.Client) -> None:
    pool = _create(http, POOL_PATH, inference_pool())
    assert pool["spec"]["endpointPickerRef"]["failureMode"] == "FailClose"
    assert pool["spec"]["endpointPickerRef"]["kind"] == "Service"
    no_port = inference_pool("other")
    del no_port["spec"]["endpointPickerRef"]["port"]
    refused = http.post(POOL_PATH, json=no_port)
    assert refused.status_code == 422
    assert "port is required when kind is 'Service'" in refused.json()["message"]


def test_events_are_one_store_seen_through_two_api_groups(http: httpx.Client) -> None:
    _create(http, "/apis/events.k8s.io/v1/namespaces/default/events", {
        "apiVersion": "events.k8s.io/v1", "kind": "Event", "metadata": {"name": "claims.1"},
        "eventTime": "2026-01-02T03:04:05.000000Z", "reason": "Promoted", "note": "v2 is stable", "type": "Normal",
        "action": "Promote", "reportingController": "loraplane.io/controller", "reportingInstance": "c-0",
        "regarding": {"kind": "AdapterRevision", "name": "claims-v2", "namespace": "default", "uid": "u-1"}})
    core = http.get("/api/v1/namespaces/default/events", params={
        "fieldSelector": "involvedObject.name=claims-v2,involvedObject.uid=u-1"}).json()["items"]
    assert [(e["message"], e["reportingComponent"]) for e in core] == [("v2 is stable", "loraplane.io/controller")]
    table = http.get("/apis/events.k8s.io/v1/namespaces/default/events", headers=TABLE).json()
    assert table["rows"][0]["cells"][1:4] == ["Normal", "Promoted", "adapterrevision/claims-v2"]


def test_leases_for_leader_election(http: httpx.Client) -> None:
    path = "/apis/coordination.k8s.io/v1/namespaces/default/leases"
    lease = _create(http, path, {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": {"name": "ctl"},
                                 "spec": {"holderIdentity": "a", "leaseDurationSeconds": 15}})
    lease["spec"]["holderIdentity"] = "b"
    assert http.put(f"{path}/ctl", json=lease).status_code == 200
    lease["spec"]["holderIdentity"] = "c"
    assert http.put(f"{path}/ctl", json=lease).status_code == 409  # a second replica with a stale copy loses


@pytest.mark.parametrize(("method", "path", "body", "code"), [
    ("POST", AR_PATH, b"{not json", 400),
    ("POST", AR_PATH, b"[1, 2]", 400),
    ("POST", AR_PATH, b'{"apiVersion": "v1", "kind": "Pod"}', 400),
    ("PATCH", f"{AR_PATH}/x", b"{}", 415),
    ("PUT", "/api", b"{}", 405),
    ("GET", "/apis/loraplane.io/v1alpha1/namespaces/default/adapterrevisions/x/scale", b"", 404),
])
def test_malformed_requests_get_4xx(http: httpx.Client, method: str, path: str, body: bytes, code: int) -> None:
    response = http.request(method, path, content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == code
    assert response.json()["kind"] == "Status"


def test_oversized_body_is_refused(http: httpx.Client) -> None:
    response = http.post(AR_PATH, content=b" " * (3 * 1024 * 1024 + 1), headers={"Content-Type": "application/json"})
    assert response.status_code == 413


def _watch_events(http: httpx.Client, path: str, params: dict[str, str]) -> list[dict[str, Any]]:
    with http.stream("GET", path, params={"watch": "true", **params}) as response:
        assert response.status_code == 200
        return [json.loads(line) for line in response.iter_lines() if line]


def test_watch_stream_replays_filters_and_times_out(http: httpx.Client) -> None:
    first = _create(http, AR_PATH, adapter_revision("claims-v1"))
    http.patch(f"{AR_PATH}/claims-v1/status", json={"status": {"phase": "Verifying"}}, headers=MERGE)
    _create(http, AR_PATH, adapter_revision("other"))
    http.delete(f"{AR_PATH}/claims-v1")
    events = _watch_events(http, AR_PATH, {"resourceVersion": first["metadata"]["resourceVersion"],
                                           "fieldSelector": "metadata.name=claims-v1", "timeoutSeconds": "1"})
    assert [(e["type"], e["object"].get("status", {}).get("phase")) for e in events] == [
        ("MODIFIED", "Verifying"), ("DELETED", "Verifying")]
    assert int(events[1]["object"]["metadata"]["resourceVersion"]) > int(events[0]["object"]["metadata"]["resourceVersion"])
    with http.stream("GET", AR_PATH, params={"watch": "true", "timeoutSeconds": "1"}, headers=TABLE) as response:
        rows = [json.loads(line)["object"] for line in response.iter_lines() if line]
    assert [r["kind"] for r in rows] == ["Table"] and rows[0]["rows"][0]["cells"][0] == "other"


def test_watch_with_initial_events_ends_them_with_a_bookmark(http: httpx.Client) -> None:
    _create(http, AR_PATH, adapter_revision("claims-v1"))
    events = _watch_events(http, AR_PATH, {"sendInitialEvents": "true", "allowWatchBookmarks": "true",
                                           "resourceVersionMatch": "NotOlderThan", "timeoutSeconds": "1"})
    assert events[0]["type"] == "ADDED"
    assert events[1]["type"] == "BOOKMARK"
    assert events[1]["object"]["metadata"]["annotations"] == {"k8s.io/initial-events-end": "true"}


def test_closed_watches_leave_no_subscription(http: httpx.Client, server: ServerThread) -> None:
    with http.stream("GET", AR_PATH, params={"watch": "true"}) as response:
        assert response.status_code == 200
    deadline = time.monotonic() + 5
    while server.call(lambda: len(server.api.cluster.store.subscriptions())) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.call(lambda: len(server.api.cluster.store.subscriptions())) == 0


def test_dry_run_and_delete_collection(http: httpx.Client) -> None:
    dry = http.post(f"{AR_PATH}?dryRun=All", json=adapter_revision("dry"))
    assert dry.status_code == 201 and dry.json()["spec"]["tenant"] == "default"
    assert http.get(f"{AR_PATH}/dry").status_code == 404
    assert http.post(f"{AR_PATH}?dryRun=Some", json=adapter_revision("dry")).status_code == 400
    for name, team in [("a", "x"), ("b", "x"), ("c", "y")]:
        body = adapter_revision(name)
        body["metadata"]["labels"] = {"team": team}
        _create(http, AR_PATH, body)
    deleted = http.delete(AR_PATH, params={"labelSelector": "team=x"}).json()
    assert [i["metadata"]["name"] for i in deleted["items"]] == ["a", "b"]
    assert [i["metadata"]["name"] for i in http.get(AR_PATH).json()["items"]] == ["c"]
