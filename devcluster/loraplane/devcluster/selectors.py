"""Label selectors (``=``, ``==``, ``!=``, ``in``, ``notin``, exists, ``!`` not-exists, ``>``, ``<``) and field
selectors (``=``, ``==``, ``!=`` on the fields each kind declares), parsed from query strings as the API server does."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from loraplane.devcluster.errors import bad_request

_SET = re.compile(r"^\s*(!?)\s*([A-Za-z0-9_./-]+)\s+(in|notin)\s+\(([^)]*)\)\s*$")
_COMPARE = re.compile(r"^\s*([A-Za-z0-9_./-]+)\s*(==|!=|=|>|<)\s*([A-Za-z0-9_.-]*)\s*$")
_EXISTS = re.compile(r"^\s*(!?)\s*([A-Za-z0-9_./-]+)\s*$")


def _split_top_level(text: str) -> list[str]:
    """Split on commas outside parentheses."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p for p in parts if p.strip()]


@dataclass(frozen=True)
class Requirement:
    """One term of a selector."""

    key: str
    op: str
    values: tuple[str, ...]

    def matches(self, fields: dict[str, str]) -> bool:
        """Whether the labels (or fields) satisfy this term."""
        present = self.key in fields
        value = fields.get(self.key)
        if self.op == "exists":
            return present
        if self.op == "!exists":
            return not present
        if self.op in ("=", "=="):
            return present and value == self.values[0]
        if self.op == "!=":
            return value != self.values[0]
        if self.op == "in":
            return present and value in self.values
        if self.op == "notin":
            return value not in self.values
        try:
            number, bound = int(value or ""), int(self.values[0])
        except ValueError:
            return False
        return number > bound if self.op == ">" else number < bound


def parse_label_selector(text: str | None) -> list[Requirement]:
    """The terms of a ``labelSelector`` query parameter; 400 when it does not parse."""
    out: list[Requirement] = []
    for part in _split_top_level(text or ""):
        if m := _SET.match(part):
            if m.group(1):
                raise bad_request(f"unable to parse requirement: {part!r}")
            values = tuple(v.strip() for v in m.group(4).split(",") if v.strip())
            out.append(Requirement(m.group(2), m.group(3), values))
        elif m := _COMPARE.match(part):
            out.append(Requirement(m.group(1), m.group(2), (m.group(3),)))
        elif m := _EXISTS.match(part):
            out.append(Requirement(m.group(2), "!exists" if m.group(1) else "exists", ()))
        else:
            raise bad_request(f"unable to parse requirement: {part.strip()!r}")
    return out


def parse_field_selector(text: str | None, supported: Iterable[str]) -> list[Requirement]:
    """The terms of a ``fieldSelector``; 400 for a malformed term or a field the kind does not index."""
    allowed = set(supported)
    out: list[Requirement] = []
    for part in _split_top_level(text or ""):
        key, op, value = _split_field_term(part)
        if key not in allowed:
            raise bad_request(f'field label not supported: {key}')
        out.append(Requirement(key, op, (value,)))
    return out


def _split_field_term(part: str) -> tuple[str, str, str]:
    for op in ("!=", "==", "="):
        key, sep, value = part.partition(op)
        if sep:
            return key.strip(), op, value.strip()
    raise bad_request(f"invalid selector: {part!r}; can't understand {part!r}")


def field_value(obj: dict[str, Any], path: str) -> str | None:
    """The string value at a dotted path (``involvedObject.name``), None when absent."""
    node: Any = obj
    for key in path.split("."):
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    if node is None or isinstance(node, dict | list):
        return None
    if isinstance(node, bool):
        return "true" if node else "false"
    return str(node)


def matcher(labels: list[Requirement], fields: list[Requirement]) -> Callable[[dict[str, Any]], bool]:
    """A predicate over objects for a parsed label and field selector."""

    def matches(obj: dict[str, Any]) -> bool:
        obj_labels = obj.get("metadata", {}).get("labels") or {}
        if not all(req.matches(obj_labels) for req in labels):
            return False
        values = {req.key: v for req in fields if (v := field_value(obj, req.key)) is not None}
        # A field selector compares against "" when the field is unset, like the API server.
        return all(req.matches({**{req.key: ""}, **values}) for req in fields)

    return matches
