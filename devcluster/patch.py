"""The three patch formats: JSON merge patch (RFC 7386), JSON patch (RFC 6902) and the strategic merge patch
kubectl's client-side apply sends for built-in kinds (list merge keys, ``$patch``, ``$retainKeys``,
``$setElementOrder/``, ``$deleteFromPrimitiveList/``)."""

from __future__ import annotations

import copy
from typing import Any

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


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise PatchError(f"JSON pointer {path!r} must start with '/'")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _index(container: list[Any], token: str, allow_end: bool) -> int:
    if token == "-" and allow_end:
        return len(container)
    if not token.isdigit() or (len(token) > 1 and token.startswith("0")):
        raise PatchError(f"invalid array index {token!r}")
    index = int(token)
    if index > len(container) or (index == len(container) and not allow_end):
        raise PatchError(f"array index {index} out of range")
    return index


def _parent(doc: Any, tokens: list[str]) -> Any:
    node = doc
    for token in tokens[:-1]:
        if isinstance(node, dict):
            if token not in node:
                raise PatchError(f"missing path element {token!r}")
            node = node[token]
        elif isinstance(node, list):
            node = node[_index(node, token, allow_end=False)]
        else:
            raise PatchError(f"cannot descend into a scalar at {token!r}")
    return node


def _locate(doc: Any, path: str) -> tuple[Any, str | int]:
    """The container holding an existing member, and the member's key or index."""
    tokens = _pointer(path)
    if not tokens:
        raise PatchError("the whole document has no parent")
    parent, last = _parent(doc, tokens), tokens[-1]
    if isinstance(parent, dict) and last in parent:
        return parent, last
    if isinstance(parent, list):
        return parent, _index(parent, last, allow_end=False)
    raise PatchError(f"path {path!r} does not exist")


def _get(doc: Any, path: str) -> Any:
    if not _pointer(path):
        return doc
    container, key = _locate(doc, path)
    return container[key]


def _add(doc: Any, path: str, value: Any) -> Any:
    tokens = _pointer(path)
    if not tokens:
        return value
    parent, last = _parent(doc, tokens), tokens[-1]
    if isinstance(parent, dict):
        parent[last] = value
    elif isinstance(parent, list):
        parent.insert(_index(parent, last, allow_end=True), value)
    else:
        raise PatchError(f"cannot add to a scalar at {path!r}")
    return doc


def _remove(doc: Any, path: str) -> Any:
    container, key = _locate(doc, path)
    del container[key]
    return doc


def json_patch(doc: Any, operations: Any) -> Any:
    """RFC 6902: add, remove, replace, move, copy, test, applied in order to a copy of ``doc``."""
    if not isinstance(operations, list):
        raise PatchError("a JSON patch must be a list of operations")
    result = copy.deepcopy(doc)
    for op in operations:
        if not isinstance(op, dict) or not isinstance(op.get("path"), str):
            raise PatchError(f"malformed operation {op!r}")
        kind, path = op.get("op"), op["path"]
        if kind in ("add", "replace", "test") and "value" not in op:
            raise PatchError(f"operation {kind} needs a value")
        if kind == "add":
            result = _add(result, path, copy.deepcopy(op["value"]))
        elif kind == "remove":
            result = _remove(result, path)
        elif kind == "replace":
            _get(result, path)
            result = _add(_remove(result, path) if _pointer(path) else result, path, copy.deepcopy(op["value"]))
        elif kind in ("move", "copy"):
            source = op.get("from")
            if not isinstance(source, str):
                raise PatchError(f"operation {kind} needs 'from'")
            value = copy.deepcopy(_get(result, source))
            if kind == "move":
                result = _remove(result, source)
            result = _add(result, path, value)
        elif kind == "test":
            if _get(result, path) != op["value"]:
                raise PatchError(f"test operation failed at {path!r}")
        else:
            raise PatchError(f"unknown operation {kind!r}")
    return result


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
