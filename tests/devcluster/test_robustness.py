"""Whatever a client sends, the answer is a Kubernetes Status (4xx) or a success, never a crash (a 500)."""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loraplane.devcluster import Cluster, default_crds
from loraplane.devcluster.errors import ApiError

_CLUSTER = Cluster()
for _crd in default_crds():
    _CLUSTER.install_crd(_crd)
_KINDS = [("", "v1", "pods"), ("", "v1", "namespaces"), ("loraplane.io", "v1alpha1", "adapterrevisions"),
          ("apiextensions.k8s.io", "v1", "customresourcedefinitions"), ("events.k8s.io", "v1", "events"),
          ("inference.networking.k8s.io", "v1", "inferencepools")]

_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 600) | st.floats(allow_nan=False, width=32) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
        st.sampled_from(["metadata", "spec", "status", "name", "generateName", "finalizers", "labels", "names",
                         "group", "versions", "scope", "lora", "rank", "plural", "kind", "x"]), inner, max_size=4),
    max_leaves=12,
)
_BODIES = st.fixed_dictionaries({"metadata": st.fixed_dictionaries(
    {"name": st.sampled_from(["fuzz", "Fuzz", "", "a" * 300])},
    optional={"generateName": _JSON, "finalizers": _JSON, "labels": _JSON, "annotations": _JSON})},
    optional={"spec": _JSON, "status": _JSON, "x": _JSON})


def _only_api_errors(call: Any) -> None:
    try:
        call()
    except ApiError as err:
        assert 400 <= err.code < 500, err.status()


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from(_KINDS), body=_BODIES | _JSON, patch=_JSON,
       patch_type=st.sampled_from(["merge", "json", "strategic"]))
def test_any_body_is_answered_with_a_status(kind: tuple[str, str, str], body: Any, patch: Any, patch_type: str) -> None:
    rt = _CLUSTER.resource(*kind)
    namespace = "default" if rt.namespaced else None
    _only_api_errors(lambda: _CLUSTER.create(rt, namespace, body))
    _only_api_errors(lambda: _CLUSTER.create(rt, namespace, {"metadata": {"name": "target"}}))
    _only_api_errors(lambda: _CLUSTER.patch(rt, namespace, "target", patch_type, patch))
    _only_api_errors(lambda: _CLUSTER.patch(rt, namespace, "target", patch_type, patch, subresource="status"))
    _only_api_errors(lambda: _CLUSTER.update(rt, namespace, "target", body))
    _only_api_errors(lambda: _CLUSTER.delete(rt, namespace, "fuzz", body if isinstance(body, dict) else None))
