"""A small evaluator for the CEL rules of ``x-kubernetes-validations``.

Supported subset (anything else is refused when the CRD is installed, so an unsupported rule never passes
silently): literals (int, double, string, bool, null, lists), ``self`` and ``oldSelf``, field selection
(``self.a.b``), indexing (``self.items[0]``, ``self.labels["k"]``), ``has(self.a.b)``, ``size(x)`` / ``x.size()``,
``x.startsWith(s)``, ``x.endsWith(s)``, ``x.contains(s)``, ``!``, unary ``-``, ``&&``, ``||``, ``==``, ``!=``,
``<``, ``<=``, ``>``, ``>=``, ``in``, ``+``, ``-``, ``*``, ``/``, ``%`` and ``cond ? a : b``.
Evaluation errors (a missing key, mixed types) make the rule fail, as in Kubernetes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

_TOKEN = re.compile(
    r"""\s*(?:
    (?P<float>\d+\.\d+(?:[eE][+-]?\d+)?)
  | (?P<int>\d+)
  | (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*')
  | (?P<ident>[A-Za-z_][A-Za-z0-9_]*)
  | (?P<op>==|!=|<=|>=|&&|\|\||[!<>+\-*/%().,\[\]?:])
    )""",
    re.VERBOSE,
)
_VARIABLES = ("self", "oldSelf")
_METHODS = ("size", "startsWith", "endsWith", "contains")
_BINARY_LEVELS: list[tuple[str, ...]] = [("||",), ("&&",), ("==", "!=", "<", "<=", ">", ">=", "in"), ("+", "-"), ("*", "/", "%")]


class CelError(Exception):
    """A rule outside the supported subset, or an evaluation error."""


@dataclass(frozen=True)
class Program:
    """A compiled rule."""

    source: str
    ast: tuple[Any, ...]

    @property
    def uses_old_self(self) -> bool:
        """True for transition rules (they run on updates only)."""
        return _mentions(self.ast, "oldSelf")

    def evaluate(self, self_value: Any, old_self: Any = None) -> bool:
        """The rule's verdict; ``CelError`` when it cannot be evaluated."""
        result = _eval(self.ast, {"self": self_value, "oldSelf": old_self})
        if not isinstance(result, bool):
            raise CelError(f"rule evaluated to {type(result).__name__}, not bool")
        return result


def _mentions(node: Any, name: str) -> bool:
    if isinstance(node, tuple):
        if node[:2] == ("var", name):
            return True
        return any(_mentions(child, name) for child in node[1:])
    if isinstance(node, list):
        return any(_mentions(child, name) for child in node)
    return False


def _tokenize(source: str) -> list[tuple[str, str]]:
    tokens: list[tuple[str, str]] = []
    pos = 0
    while pos < len(source):
        if source[pos:].strip() == "":
            break
        match = _TOKEN.match(source, pos)
        if match is None or match.end() == pos:
            raise CelError(f"unsupported syntax at {source[pos:]!r}")
        kind = match.lastgroup
        assert kind is not None
        tokens.append((kind, match.group(kind)))
        pos = match.end()
    return tokens


class _Parser:
    def __init__(self, source: str) -> None:
        self.tokens = _tokenize(source)
        self.pos = 0

    def peek(self) -> str | None:
        return self.tokens[self.pos][1] if self.pos < len(self.tokens) else None

    def take(self, expected: str | None = None) -> tuple[str, str]:
        if self.pos >= len(self.tokens):
            raise CelError("unexpected end of rule")
        token = self.tokens[self.pos]
        if expected is not None and token[1] != expected:
            raise CelError(f"expected {expected!r}, found {token[1]!r}")
        self.pos += 1
        return token

    def parse(self) -> tuple[Any, ...]:
        node = self.conditional()
        if self.pos != len(self.tokens):
            raise CelError(f"unexpected {self.peek()!r}")
        return node

    def conditional(self) -> tuple[Any, ...]:
        cond = self.binary(0)
        if self.peek() == "?":
            self.take("?")
            then = self.conditional()
            self.take(":")
            return ("cond", cond, then, self.conditional())
        return cond

    def binary(self, level: int) -> tuple[Any, ...]:
        if level == len(_BINARY_LEVELS):
            return self.unary()
        node = self.binary(level + 1)
        while self.peek() in _BINARY_LEVELS[level] and self.tokens[self.pos][0] in ("op", "ident"):
            op = self.take()[1]
            node = ("binop", op, node, self.binary(level + 1))
        return node

    def unary(self) -> tuple[Any, ...]:
        if self.peek() in ("!", "-"):
            op = self.take()[1]
            return ("unary", op, self.unary())
        return self.member()

    def member(self) -> tuple[Any, ...]:
        node = self.primary()
        while self.peek() in (".", "["):
            if self.take()[1] == "[":
                index = self.conditional()
                self.take("]")
                node = ("index", node, index)
                continue
            kind, name = self.take()
            if kind != "ident":
                raise CelError(f"expected a field name, found {name!r}")
            if self.peek() == "(":
                if name not in _METHODS:
                    raise CelError(f"unsupported function {name}()")
                node = ("call", name, [node, *self.arguments()])
            else:
                node = ("select", node, name)
        return node

    def arguments(self) -> list[tuple[Any, ...]]:
        self.take("(")
        return self.sequence(")")

    def sequence(self, close: str) -> list[tuple[Any, ...]]:
        """Comma-separated expressions up to and including ``close``."""
        items: list[tuple[Any, ...]] = []
        while self.peek() != close:
            items.append(self.conditional())
            if self.peek() != close:
                self.take(",")
        self.take(close)
        return items

    def primary(self) -> tuple[Any, ...]:
        kind, text = self.take()
        if kind == "int":
            return ("lit", int(text))
        if kind == "float":
            return ("lit", float(text))
        if kind == "string":
            return ("lit", text[1:-1].encode().decode("unicode_escape"))
        if text == "(":
            node = self.conditional()
            self.take(")")
            return node
        if text == "[":
            return ("list", self.sequence("]"))
        if kind != "ident":
            raise CelError(f"unexpected {text!r}")
        if text in ("true", "false", "null"):
            return ("lit", {"true": True, "false": False, "null": None}[text])
        if text in _VARIABLES:
            return ("var", text)
        if text == "has":
            args = self.arguments()
            if len(args) != 1 or args[0][0] != "select":
                raise CelError("has() takes one field selection, e.g. has(self.spec.x)")
            return ("has", args[0])
        if text == "size" and self.peek() == "(":
            return ("call", "size", self.arguments())
        raise CelError(f"unsupported identifier {text!r}")


def compile_rule(source: str) -> Program:
    """Parse a rule; ``CelError`` if it uses anything outside the supported subset."""
    return Program(source, _Parser(source).parse())


def _select(value: Any, name: str) -> Any:
    if not isinstance(value, dict):
        raise CelError(f"no such key: {name}")
    if name not in value:
        raise CelError(f"no such key: {name}")
    return value[name]


_COMPARE = {
    "<": lambda a, b: a < b,
    "<=": lambda a, b: a <= b,
    ">": lambda a, b: a > b,
    ">=": lambda a, b: a >= b,
}
_ARITHMETIC = {
    "+": lambda a, b: a + b,
    "-": lambda a, b: a - b,
    "*": lambda a, b: a * b,
    "/": lambda a, b: a // b if isinstance(a, int) and isinstance(b, int) else a / b,
    "%": lambda a, b: a % b,
}


def _same_kind(a: Any, b: Any) -> bool:
    numeric = (int, float)
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool)
    if isinstance(a, numeric) and isinstance(b, numeric):
        return True
    return type(a) is type(b)


def _binop(op: str, node: tuple[Any, ...], env: dict[str, Any]) -> Any:
    if op in ("&&", "||"):
        # CEL's commutative logic: an error on one side is absorbed when the other side decides.
        results: list[Any] = []
        for side in node[2:]:
            try:
                results.append(_eval(side, env))
            except CelError as exc:
                results.append(exc)
        decisive = op == "||"
        if any(r is decisive for r in results):
            return decisive
        for r in results:
            if isinstance(r, CelError):
                raise r
            if not isinstance(r, bool):
                raise CelError(f"{op} needs booleans")
        return not decisive
    left, right = _eval(node[2], env), _eval(node[3], env)
    if op == "==":
        return _same_kind(left, right) and left == right
    if op == "!=":
        return not (_same_kind(left, right) and left == right)
    if op == "in":
        if not isinstance(right, list | dict):
            raise CelError("'in' needs a list or a map on its right")
        return left in right
    if not _same_kind(left, right):
        raise CelError(f"no such overload: {type(left).__name__} {op} {type(right).__name__}")
    try:
        return (_COMPARE | _ARITHMETIC)[op](left, right)
    except (TypeError, ZeroDivisionError) as exc:
        raise CelError(str(exc)) from exc


def _call(name: str, args: list[Any]) -> Any:
    target, *rest = args
    if name == "size":
        if not isinstance(target, str | list | dict) or rest:
            raise CelError("size() takes a string, list or map")
        return len(target)
    if len(rest) != 1 or not isinstance(target, str) or not isinstance(rest[0], str):
        raise CelError(f"{name}() takes a string and one string argument")
    return {"startsWith": target.startswith, "endsWith": target.endswith, "contains": target.__contains__}[name](rest[0])


def _eval(node: tuple[Any, ...], env: dict[str, Any]) -> Any:
    kind = node[0]
    if kind == "lit":
        return node[1]
    if kind == "var":
        return env[node[1]]
    if kind == "list":
        return [_eval(item, env) for item in node[1]]
    if kind == "select":
        return _select(_eval(node[1], env), node[2])
    if kind == "index":
        container, index = _eval(node[1], env), _eval(node[2], env)
        try:
            return container[index]
        except (KeyError, IndexError, TypeError) as exc:
            raise CelError(f"no such key: {index!r}") from exc
    if kind == "has":
        target = _eval(node[1][1], env)
        return isinstance(target, dict) and node[1][2] in target
    if kind == "unary":
        value = _eval(node[2], env)
        if node[1] == "!":
            if not isinstance(value, bool):
                raise CelError("! needs a boolean")
            return not value
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise CelError("unary - needs a number")
        return -value
    if kind == "binop":
        return _binop(node[1], node, env)
    if kind == "call":
        return _call(node[1], [_eval(arg, env) for arg in node[2]])
    if kind == "cond":
        cond = _eval(node[1], env)
        if not isinstance(cond, bool):
            raise CelError("?: needs a boolean condition")
        return _eval(node[2] if cond else node[3], env)
    raise CelError(f"unknown node {kind}")
