"""The three patch formats: JSON merge patch (RFC 7386), JSON patch (RFC 6902) and the strategic merge patch
kubectl's client-side apply sends for built-in kinds (list merge keys, ``$patch``, ``$retainKeys``,
``$setElementOrder/``, ``$deleteFromPrimitiveList/``)."""

from __future__ import annotations

import copy
from typing import Any

import jsonpatch
import jsonpointer

#: A field's merge strategy for strategic merge patch: a path of field names (list indices skipped) -> the merge
#: key of a list of objects, or None for a list of scalars merged as a set.
PatchMeta = dict[tuple[str, ...], str | None]

_DIRECTIVE = "$patch"
_RETAIN = "$retainKeys"
_ORDER = "$setElementOrder/"
_DELETE_PRIMITIVE = "$deleteFromPrimitiveList/"


class PatchError(ValueError):
    """A patch that cannot be applied (its message says why)."""


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386: objects merge key by key, ``null`` deletes, everything else replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def json_patch(doc: Any, operations: Any) -> Any:
    """RFC 6902 (add, remove, replace, move, copy, test), applied in order to a copy of ``doc`` by the jsonpatch
    library; a ``test`` of a value of another JSON type fails (``1`` is not ``true``), as in Kubernetes."""
    if not isinstance(operations, list):
        raise PatchError("a JSON patch must be a list of operations")
    try:
        return jsonpatch.apply_patch(doc, operations)
    except (jsonpatch.JsonPatchException, jsonpointer.JsonPointerException) as exc:
        raise PatchError(str(exc)) from exc


def _strip(value: Any) -> Any:
    """A patch value with every directive removed (what gets stored)."""
    if isinstance(value, dict):
        return {k: _strip(v) for k, v in value.items() if not k.startswith("$")}
    if isinstance(value, list):
        return [_strip(v) for v in value if not (isinstance(v, dict) and v.get(_DIRECTIVE) in ("replace", "delete"))]
    return value


def _order(items: list[Any], order: list[Any], merge_key: str | None) -> list[Any]:
    """Reorder ``items`` as ``$setElementOrder`` asks; items it does not name keep their place after them."""
    def key_of(item: Any) -> Any:
        return item.get(merge_key) if merge_key and isinstance(item, dict) else item

    wanted = [key_of(o) for o in order]
    rank = {k: i for i, k in enumerate(wanted) if isinstance(k, str | int | float | bool)}
    return sorted(items, key=lambda item: rank.get(key_of(item), len(rank)))


def _merge_list(original: list[Any], patch: list[Any], path: tuple[str, ...], meta: PatchMeta) -> list[Any]:
    merge_key = meta[path]
    if any(isinstance(p, dict) and p.get(_DIRECTIVE) == "replace" for p in patch):
        stripped: list[Any] = _strip(patch)
        return stripped
    if merge_key is None:
        return list(original) + [p for p in patch if p not in original]
    result = [copy.deepcopy(o) for o in original]
    for item in patch:
        if not isinstance(item, dict) or merge_key not in item:
            raise PatchError(f"list {'.'.join(path)} items must carry their merge key {merge_key!r}")
        positions = [i for i, o in enumerate(result) if isinstance(o, dict) and o.get(merge_key) == item[merge_key]]
        if item.get(_DIRECTIVE) == "delete":
            result = [o for i, o in enumerate(result) if i not in positions]
        elif positions:
            result[positions[0]] = strategic_merge(result[positions[0]], item, meta, path)
        else:
            result.append(_strip(item))
    return result


def strategic_merge(original: Any, patch: Any, meta: PatchMeta, path: tuple[str, ...] = ()) -> Any:
    """Apply a strategic merge patch to ``original`` using the kind's list merge keys."""
    if not isinstance(patch, dict):
        return _strip(patch)
    directive = patch.get(_DIRECTIVE)
    if directive == "replace":
        return _strip(patch)
    if directive == "delete":
        return {}
    if directive not in (None, "merge"):
        raise PatchError(f"unknown $patch directive {directive!r}")
    result = copy.deepcopy(original) if isinstance(original, dict) else {}
    retain = patch.get(_RETAIN)
    if isinstance(retain, list):
        result = {k: v for k, v in result.items() if k in retain}
    orders: dict[str, list[Any]] = {}
    for key, value in patch.items():
        if key.startswith(_ORDER):
            orders[key[len(_ORDER):]] = value
        elif key.startswith(_DELETE_PRIMITIVE):
            name = key[len(_DELETE_PRIMITIVE):]
            result[name] = [v for v in result.get(name) or [] if v not in value]
        elif key.startswith("$"):
            continue
        elif value is None:
            result.pop(key, None)
        elif isinstance(value, dict):
            if value.get(_DIRECTIVE) == "delete":
                result.pop(key, None)
            else:
                result[key] = strategic_merge(result.get(key), value, meta, (*path, key))
        elif isinstance(value, list) and (*path, key) in meta:
            result[key] = _merge_list(result.get(key) or [], value, (*path, key), meta)
        else:
            result[key] = _strip(value)
    for name, order in orders.items():
        if isinstance(result.get(name), list) and isinstance(order, list):
            result[name] = _order(result[name], order, meta.get((*path, name)))
    return result
