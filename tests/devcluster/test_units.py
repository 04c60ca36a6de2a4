"""The pure pieces: the CEL subset, selectors, the three patch formats, ages and JSONPath."""

from __future__ import annotations

from typing import Any

import pytest

from loraplane.api.crd import crd
from loraplane.devcluster.cel import CelError, compile_rule
from loraplane.devcluster.errors import ApiError
from loraplane.devcluster.patch import PatchError, json_patch, merge_patch, strategic_merge
from loraplane.devcluster.schema import rule_errors
from loraplane.devcluster.selectors import matcher, parse_field_selector, parse_label_selector
from loraplane.devcluster.tables import human_duration, json_path


@pytest.mark.parametrize(("rule", "self_value", "old", "expected"), [
    ("self.adapter == oldSelf.adapter", {"adapter": "a"}, {"adapter": "a"}, True),
    ("self.adapter == oldSelf.adapter", {"adapter": "a"}, {"adapter": "b"}, False),
    ("!(has(self.pods) && has(self.fraction))", {"pods": 1}, None, True),
    ("!(has(self.pods) && has(self.fraction))", {"pods": 1, "fraction": 0.5}, None, False),
    ("self.kind != 'Service' || has(self.port)", {"kind": "Service"}, None, False),
    ("self.kind != 'Service' || has(self.port)", {"kind": "Other"}, None, True),
    ("size(self.items) <= 2 && self.items[0] in ['a', 'b']", {"items": ["a", "c"]}, None, True),
    ("self.name.startsWith('lp-') ? self.n * 2 > 3 : false", {"name": "lp-x", "n": 2}, None, True),
    ("self.x.size() == 0 || self.y", {"x": "", "y": False}, None, True),
])
def test_cel_subset_evaluates(rule: str, self_value: Any, old: Any, expected: bool) -> None:
    assert compile_rule(rule).evaluate(self_value, old) is expected


def test_cel_fails_closed() -> None:
    for unsupported in ("self.all(x, x > 0)", "self.matches('a')", "int(self.x) > 1", "self.x ==", "timestamp(self.t)"):
        with pytest.raises(CelError):
            compile_rule(unsupported)
    with pytest.raises(CelError, match="no such key"):
        compile_rule("self.missing == 1").evaluate({}, None)
    with pytest.raises(CelError):
        compile_rule("self.a < self.b").evaluate({"a": 1, "b": "x"}, None)
    assert compile_rule("has(self.a) || self.missing == 1").evaluate({"a": 1}, None) is True  # CEL's error absorption


def test_every_rule_of_the_adapter_revision_crd_is_in_the_subset() -> None:
    schema = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    assert rule_errors(schema) == []


def test_label_selector_forms() -> None:
    labels = {"metadata": {"labels": {"tier": "gpu", "n": "5"}}}
    cases = {"tier=gpu": True, "tier==cpu": False, "tier!=cpu": True, "tier in (gpu, cpu)": True,
             "tier notin (gpu)": False, "tier": True, "!tier": False, "missing!=x": True, "n>4": True, "n<5": False,
             "tier=gpu,n in (5)": True}
    for text, expected in cases.items():
        assert matcher(parse_label_selector(text), [])(labels) is expected, text
    for broken in ("tier in gpu", "=x", "a b c"):
        with pytest.raises(ApiError):
            parse_label_selector(broken)


def test_field_selector_only_on_declared_fields() -> None:
    obj = {"metadata": {"name": "a"}, "status": {"phase": "Running"}}
    fields = parse_field_selector("metadata.name=a,status.phase!=Pending", ["metadata.name", "status.phase"])
    assert matcher([], fields)(obj) is True
    assert matcher([], parse_field_selector("status.podIP=", ["status.podIP"]))(obj) is True  # unset reads as ""
    with pytest.raises(ApiError, match=r"field label not supported: spec\.x"):
        parse_field_selector("spec.x=1", ["metadata.name"])


def test_merge_patch_rfc7386() -> None:
    assert merge_patch({"a": "b", "c": {"d": "e", "f": "g"}}, {"a": "z", "c": {"f": None}}) == {"a": "z", "c": {"d": "e"}}
    assert merge_patch({"a": [1, 2]}, {"a": [3]}) == {"a": [3]}
    assert merge_patch({"a": 1}, {"b": {"c": None}}) == {"a": 1, "b": {}}


def test_json_patch_rfc6902() -> None:
    doc = {"a": {"b": [1, 2]}, "c": "x"}
    ops = [{"op": "add", "path": "/a/b/-", "value": 3}, {"op": "remove", "path": "/c"},
           {"op": "copy", "from": "/a/b", "path": "/d"}, {"op": "move", "from": "/d", "path": "/e"},
           {"op": "replace", "path": "/a/b/0", "value": 0}, {"op": "add", "path": "/a/b/1", "value": 9},
           {"op": "test", "path": "/e/2", "value": 3}, {"op": "add", "path": "/f~1g", "value": True}]
    assert json_patch(doc, ops) == {"a": {"b": [0, 9, 2, 3]}, "e": [1, 2, 3], "f/g": True}
    assert doc == {"a": {"b": [1, 2]}, "c": "x"}  # the input is untouched
    for bad in ([{"op": "remove", "path": "/nope"}], [{"op": "test", "path": "/c", "value": "y"}],
                [{"op": "add", "path": "/a/b/7", "value": 1}], [{"op": "jump", "path": "/c"}], {"op": "add"},
                [{"op": "test", "path": "/a/b/0", "value": True}]):  # 1 is not true (Kubernetes: the test fails)
        with pytest.raises(PatchError):
            json_patch(doc, bad)


def test_strategic_merge_patch_directives() -> None:
    meta = {("spec", "containers"): "name", ("spec", "containers", "env"): "name", ("metadata", "finalizers"): None}
    original = {"metadata": {"finalizers": ["a"]}, "spec": {
        "containers": [{"name": "x", "image": "1", "env": [{"name": "A", "value": "1"}]}, {"name": "y", "image": "1"}],
        "strategy": {"type": "Recreate", "rollingUpdate": {"maxSurge": 1}}, "tolerations": [{"key": "k"}]}}
    patch = {"metadata": {"finalizers": ["b"], "$deleteFromPrimitiveList/finalizers": ["a"]}, "spec": {
        "$setElementOrder/containers": [{"name": "z"}, {"name": "y"}, {"name": "x"}],
        "containers": [{"name": "x", "env": [{"name": "B", "value": "2"}]}, {"name": "z", "image": "3"}],
        "strategy": {"$retainKeys": ["type"], "type": "RollingUpdate"}, "tolerations": [{"key": "j"}]}}
    result = strategic_merge(original, patch, meta)
    assert result["metadata"]["finalizers"] == ["b"]
    assert [c["name"] for c in result["spec"]["containers"]] == ["z", "y", "x"]
    assert result["spec"]["containers"][2]["env"] == [{"name": "A", "value": "1"}, {"name": "B", "value": "2"}]
    assert result["spec"]["strategy"] == {"type": "RollingUpdate"}
    assert result["spec"]["tolerations"] == [{"key": "j"}]  # no merge key: replaced
    replaced = strategic_merge(original, {"spec": {"containers": [{"name": "q"}, {"$patch": "replace"}]}}, meta)
    assert replaced["spec"]["containers"] == [{"name": "q"}]
    assert "spec" not in strategic_merge(original, {"spec": {"$patch": "delete"}}, meta)
    with pytest.raises(PatchError):
        strategic_merge(original, {"spec": {"containers": [{"image": "no-name"}]}}, meta)


@pytest.mark.parametrize(("seconds", "text"), [
    (-5, "<invalid>"), (-1, "0s"), (59, "59s"), (119, "119s"), (125, "2m5s"), (600, "10m"), (3 * 3600, "3h"),
    (3 * 3600 + 300, "3h5m"), (47 * 3600, "47h"), (50 * 3600, "2d2h"), (30 * 86400, "30d"), (3 * 365 * 86400, "3y"),
])
def test_ages_read_like_kubectl(seconds: float, text: str) -> None:
    assert human_duration(seconds) == text


def test_json_path_for_printer_columns() -> None:
    obj = {"status": {"residency": {"gpu": 2}, "conditions": [{"type": "Ready"}]}, "metadata": {"labels": {"a.b/c": "x"}}}
    assert json_path(obj, ".status.residency.gpu") == 2
    assert json_path(obj, ".status.conditions[0].type") == "Ready"
    assert json_path(obj, ".metadata.labels['a.b/c']") == "x"
    assert json_path(obj, ".status.phase") is None
    assert json_path(obj, ".status.conditions[3].type") is None
