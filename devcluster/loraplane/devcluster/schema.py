"""Custom resources against their CRD's structural ``openAPIV3Schema``: pruning, defaulting, validation, CEL rules.

The order is the API server's: unknown fields are pruned (or refused with ``fieldValidation=Strict``), defaults
are applied, the object is validated (JSON Schema via ``jsonschema``, after ``loraplane.api.crd.to_json_schema``),
and, when the schema holds, the ``x-kubernetes-validations`` rules run (transition rules only on updates).
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import jsonschema

from loraplane.api.crd import to_json_schema
from loraplane.devcluster import errors as e
from loraplane.devcluster.cel import CelError, Program, compile_rule

_ROOT_KEPT = ("apiVersion", "kind", "metadata")
_JSON_TYPES = {dict: "object", list: "array", str: "string", bool: "boolean", int: "integer", float: "number"}


@functools.lru_cache(maxsize=1024)
def _compiled(rule: str) -> Program:
    return compile_rule(rule)


def _type_name(value: Any) -> str:
    return "null" if value is None else _JSON_TYPES.get(type(value), type(value).__name__)


def _join(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


def rule_errors(schema: Any, path: str = "openAPIV3Schema") -> list[e.FieldError]:
    """What makes a schema unusable here: nodes that are not structural (a subschema that is not an object) and
    CEL rules outside the supported subset (the CRD is refused with these)."""
    if not isinstance(schema, dict):
        return [e.invalid(path, schema, "must be a schema object (structural schemas only)")]
    out: list[e.FieldError] = []
    rules = schema.get("x-kubernetes-validations", [])
    if not isinstance(rules, list) or not all(isinstance(r, dict) and isinstance(r.get("rule"), str) for r in rules):
        return [e.invalid(f"{path}.x-kubernetes-validations", rules, "must be a list of {rule, message}")]
    for index, rule in enumerate(rules):
        try:
            _compiled(rule["rule"])
        except CelError as exc:
            out.append(e.invalid(f"{path}.x-kubernetes-validations[{index}].rule", rule["rule"],
                                 f"compilation failed: {exc} (see docs/devcluster.md for the supported CEL subset)"))
    properties = schema.get("properties", {})
    if not isinstance(properties, dict):
        return [*out, e.invalid(f"{path}.properties", properties, "must be an object")]
    for name, sub in properties.items():
        out += rule_errors(sub, f"{path}.properties[{name}]")
    if "items" in schema:
        out += rule_errors(schema["items"], f"{path}.items")
    if not isinstance(schema.get("additionalProperties", True), bool):
        out += rule_errors(schema["additionalProperties"], f"{path}.additionalProperties")
    return out


def schema_errors(schema: dict[str, Any], path: str) -> list[e.FieldError]:
    """Why an openAPIV3Schema cannot be used: not a valid schema, or CEL rules outside the supported subset."""
    json_schema = to_json_schema(schema)
    try:
        jsonschema.validators.validator_for(json_schema, default=jsonschema.Draft202012Validator).check_schema(json_schema)
    except jsonschema.SchemaError as exc:
        where = "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in exc.absolute_path)
        return [e.invalid(f"{path}{where}", exc.instance, f"invalid schema: {exc.message}")]
    return rule_errors(schema, path)


def prune(value: Any, schema: dict[str, Any], path: str, unknown: list[str]) -> Any:
    """``value`` without the fields ``schema`` does not declare; their paths are appended to ``unknown``."""
    if isinstance(value, dict):
        if schema.get("x-kubernetes-preserve-unknown-fields") and "properties" not in schema:
            return value
        props = schema.get("properties")
        extra = schema.get("additionalProperties")
        out: dict[str, Any] = {}
        for key, sub in value.items():
            if not path and key in _ROOT_KEPT:
                out[key] = sub
            elif props is not None and key in props:
                out[key] = prune(sub, props[key], _join(path, key), unknown)
            elif isinstance(extra, dict):
                out[key] = prune(sub, extra, _join(path, key), unknown)
            elif extra is True or schema.get("x-kubernetes-preserve-unknown-fields"):
                out[key] = sub
            else:
                unknown.append(_join(path, key))
        return out
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [prune(item, schema["items"], _join(path, i), unknown) for i, item in enumerate(value)]
    return value


def apply_defaults(value: Any, schema: dict[str, Any]) -> Any:
    """``value`` with the schema's defaults filled in wherever a field is absent (in place, returns it)."""
    if isinstance(value, dict):
        for key, sub in schema.get("properties", {}).items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                value[key] = apply_defaults(value[key], sub)
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for key in value:
                if key not in schema.get("properties", {}):
                    value[key] = apply_defaults(value[key], extra)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [apply_defaults(item, schema["items"]) for item in value]
    return value


def _field_errors(error: jsonschema.ValidationError) -> Iterator[e.FieldError]:
    """One jsonschema error as the field errors the API server reports."""
    path = ""
    for key in error.absolute_path:
        path = _join(path, key)
    kind, limit, value = error.validator, error.validator_value, error.instance
    where = f"{path} in body" if path else "body"
    if kind == "required":
        for name in limit:
            if isinstance(value, dict) and name not in value:
                yield e.required(_join(path, name))
    elif kind == "type":
        expected = limit if isinstance(limit, str) else " or ".join(limit)
        yield e.invalid(path, _type_name(value), f'{where} must be of type {expected}: "{_type_name(value)}"')
    elif kind == "enum":
        yield e.not_supported(path, value, list(limit))
    elif kind == "pattern":
        yield e.invalid(path, value, f"{where} should match '{limit}'")
    elif kind == "maxLength":
        yield e.too_long(path, limit)
    elif kind == "minLength":
        yield e.invalid(path, value, f"{where} should be at least {limit} chars long")
    elif kind in ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum"):
        relation = {"minimum": "greater than or equal to", "exclusiveMinimum": "greater than",
                    "maximum": "less than or equal to", "exclusiveMaximum": "less than"}[kind]
        yield e.invalid(path, value, f"{where} should be {relation} {limit}")
    elif kind == "minItems":
        yield e.invalid(path, len(value), f"{where} should have at least {limit} items")
    elif kind == "maxItems":
        yield e.too_many(path, len(value), limit)
    elif kind == "uniqueItems":
        yield e.FieldError(path, "FieldValueDuplicate", f"Duplicate value: {e.format_value(value)}")
    elif kind == "format":
        yield e.invalid(path, value, f'{where} must be of type {limit}: {e.format_value(value)}')
    else:
        yield e.invalid(path, value, error.message)


@dataclass
class CustomResourceSchema:
    """The validation schema of one served CRD version."""

    openapi: dict[str, Any]
    validator: jsonschema.protocols.Validator = field(init=False)

    def __post_init__(self) -> None:
        json_schema = to_json_schema(self.openapi)
        cls = jsonschema.validators.validator_for(json_schema, default=jsonschema.Draft202012Validator)
        self.validator = cls(json_schema, format_checker=cls.FORMAT_CHECKER)

    def prune(self, obj: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
        """The object without undeclared fields, and the pruned fields' paths."""
        unknown: list[str] = []
        pruned = prune(obj, self.openapi, "", unknown)
        return pruned, unknown

    def default(self, obj: dict[str, Any]) -> None:
        """Apply the schema's defaults to the object, in place."""
        apply_defaults(obj, self.openapi)

    def validate(self, obj: dict[str, Any], old: dict[str, Any] | None) -> list[e.FieldError]:
        """Schema errors, then (when there are none) the CEL rules' errors."""
        errors: list[e.FieldError] = []
        seen: set[str] = set()
        for error in sorted(self.validator.iter_errors(obj), key=lambda err: [str(k) for k in err.absolute_path]):
            for fe in _field_errors(error):
                if str(fe) not in seen:
                    seen.add(str(fe))
                    errors.append(fe)
        if errors:
            return errors
        return _check_rules(obj, old, self.openapi, "")


def _check_rules(value: Any, old: Any, schema: dict[str, Any], path: str) -> list[e.FieldError]:
    errors: list[e.FieldError] = []
    for rule in schema.get("x-kubernetes-validations", []):
        program = _compiled(rule["rule"])
        if program.uses_old_self and old is None:
            continue
        message = rule.get("message") or f"failed rule: {rule['rule']}"
        try:
            if not program.evaluate(value, old):
                errors.append(e.invalid(path, value, message))
        except CelError as exc:
            errors.append(e.invalid(path, value, f"rule evaluation error: {rule['rule']}: {exc}"))
    if isinstance(value, dict):
        props = schema.get("properties", {})
        extra = schema.get("additionalProperties")
        for key, sub in value.items():
            sub_schema = props.get(key, extra if isinstance(extra, dict) else None)
            if sub_schema is not None:
                old_sub = old.get(key) if isinstance(old, dict) else None
                errors += _check_rules(sub, old_sub, sub_schema, _join(path, key))
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            errors += _check_rules(item, None, schema["items"], _join(path, i))
    return errors
