"""The generated CRD: up to date, accepted by kubernetes-validate, and as strict as the models."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from pydantic import Field, create_model

from loraplane import gen_crds
from loraplane.api import adapterrevision as ar
from loraplane.api import crd
from tests.api.conftest import EXAMPLES, REPO, load_yaml

INVALID = REPO / "tests" / "api" / "invalid" / "bad-everything.yaml"


def _validator() -> jsonschema.Draft202012Validator:
    schema = crd.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return jsonschema.Draft202012Validator(crd.to_json_schema(schema))


def test_committed_crd_is_up_to_date() -> None:
    assert crd.check(REPO / "crds") is None
    assert gen_crds.main(["--check", "--out", str(REPO / "crds")]) == 0


def test_check_fails_after_an_unregenerated_model_change(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shutil.copytree(REPO / "crds", tmp_path / "crds")
    assert gen_crds.main(["--check", "--out", str(tmp_path / "crds")]) == 0
    changed_spec = create_model(
        "AdapterRevisionSpec", __base__=ar.AdapterRevisionSpec, max_replicas=(int, Field(default=1, ge=1))
    )
    changed = create_model("AdapterRevision", __base__=ar.AdapterRevision, spec=(changed_spec, ...))
    monkeypatch.setattr(ar, "AdapterRevision", changed)
    assert gen_crds.main(["--check", "--out", str(tmp_path / "crds")]) == 1
    assert gen_crds.main(["--out", str(tmp_path / "crds")]) == 0
    assert gen_crds.main(["--check", "--out", str(tmp_path / "crds")]) == 0


def test_check_fails_when_the_file_is_missing(tmp_path: Path) -> None:
    assert gen_crds.main(["--check", "--out", str(tmp_path)]) == 1


def test_kubernetes_validate_accepts_the_crd() -> None:
    data = yaml.safe_load((REPO / "crds" / crd.CRD_FILENAME).read_text())
    kubernetes_validate.validate(data, "1.30", strict=True)


def _walk(node: Any, path: str = "") -> list[tuple[str, dict[str, Any]]]:
    out = []
    if isinstance(node, dict):
        out.append((path, node))
        for key in ("properties",):
            for name, sub in node.get(key, {}).items():
                out += _walk(sub, f"{path}.{name}")
        if isinstance(node.get("items"), dict):
            out += _walk(node["items"], f"{path}[]")
        if isinstance(node.get("additionalProperties"), dict):
            out += _walk(node["additionalProperties"], f"{path}{{}}")
    return out


def test_schema_is_structural() -> None:
    schema = crd.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for path, node in _walk(schema):
        assert "type" in node, f"{path} has no type"
        for forbidden in ("$ref", "anyOf", "oneOf", "allOf", "const", "title", "$defs"):
            assert forbidden not in node, f"{path} uses {forbidden}"
        assert node.get("additionalProperties") is not False, f"{path} sets additionalProperties: false"


def test_crd_has_status_subresource_printer_columns_and_cel() -> None:
    version = crd.crd()["spec"]["versions"][0]
    assert version["subresources"] == {"status": {}}
    assert [c["name"] for c in version["additionalPrinterColumns"]] == [
        "Adapter", "Revision", "Phase", "Weight", "GPU", "CPU", "Reason", "Age"]
    spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert spec["properties"]["artifact"]["properties"]["digest"]["x-kubernetes-validations"] == [
        {"rule": "self == oldSelf", "message": "spec.artifact.digest is immutable; create a new AdapterRevision"}]
    # every field that defines what is served, and nothing else
    assert crd.immutable_paths() == ["spec.adapter", "spec.revision", "spec.poolRef", "spec.baseModel",
                                     "spec.artifact.uri", "spec.artifact.digest", "spec.lora"]
    assert "x-loraplane-immutable" not in json.dumps(crd.crd())


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_validate_against_the_crd_schema(path: Path) -> None:
    _validator().validate(load_yaml(path))


def test_invalid_example_is_rejected_by_the_crd_schema_with_readable_messages() -> None:
    errors = {"/".join(map(str, e.absolute_path)): e.message for e in _validator().iter_errors(load_yaml(INVALID))}
    assert "does not match '^sha256:[a-f0-9]{64}$'" in errors["spec/artifact/digest"]
    assert "7 is not one of [1, 8, 16, 32, 64, 128, 256, 320, 512]" in errors["spec/lora/rank"]
    assert "'file://../etc' does not match" in errors["spec/artifact/uri"]


def test_invalid_example_is_rejected_by_the_models_with_readable_messages() -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError) as info:
        ar.AdapterRevision.model_validate(load_yaml(INVALID))
    text = str(info.value)
    assert "rank 7 is not one vLLM accepts" in text
    assert "spec.artifact.digest" in text
    assert "'..' path segment" in text


def test_openapi_exclusive_bounds_translate_to_json_schema() -> None:
    node = {"type": "number", "minimum": 0, "exclusiveMinimum": True, "nullable": True, "x-kubernetes-foo": 1}
    assert crd.to_json_schema(node) == {"type": ["number", "null"], "exclusiveMinimum": 0}
    validator = jsonschema.Draft202012Validator(crd.to_json_schema(node))
    assert not validator.is_valid(0) and validator.is_valid(0.5) and validator.is_valid(None)
