"""Validation rules shared by the api models and the generated CRD schema.

Every rule is written once here as a regular expression or a constant, so the pydantic models and the
CustomResourceDefinition reject exactly the same input. The regular expressions use only the syntax that
Go's RE2 (the API server), Python's ``re`` and JSON Schema validators all share: no look-around.
"""

from __future__ import annotations

import re

#: Ranks vLLM accepts for ``max_lora_rank`` and therefore for an adapter.
ALLOWED_RANKS: tuple[int, ...] = (1, 8, 16, 32, 64, 128, 256, 320, 512)

#: Artifact URI schemes the sidecar knows how to fetch.
ALLOWED_URI_SCHEMES: tuple[str, ...] = ("oci", "https", "s3", "file")

#: A DNS-1123 label: what Kubernetes accepts for most names.
DNS1123_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
DNS1123_LABEL_MAX = 63

#: A DNS-1123 subdomain (object names, pool names).
DNS1123_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
DNS1123_SUBDOMAIN_MAX = 253

#: ``sha256:`` and 64 lowercase hex digits.
DIGEST = r"^sha256:[a-f0-9]{64}$"

#: A module name as PEFT writes it: dotted identifiers (``q_proj``, ``model.layers.0.mlp.up_proj``).
MODULE_NAME = r"^[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*$"

#: A base model name such as ``meta-llama/Llama-3.1-8B-Instruct``: no ``..``, no control characters.
MODEL_NAME = r"^[A-Za-z0-9_-]+([./][A-Za-z0-9_-]+)*$"

# One path segment that is not ``.`` or ``..`` and holds no ``/``, space, control character or backslash.
_SEG_CHAR = r"[^/\\\x00-\x20\x7f]"
_SEG_NODOT = r"[^/.\\\x00-\x20\x7f]"
_SEGMENT = rf"(?:{_SEG_NODOT}{_SEG_CHAR}*|\.{_SEG_NODOT}{_SEG_CHAR}*|\.\.{_SEG_CHAR}+)"

#: An artifact URI: an allowed scheme, then ``/``-separated segments none of which is ``.`` or ``..``.
ARTIFACT_URI = rf"^(?:oci|https|s3|file)://(?:/)?{_SEGMENT}(?:/{_SEGMENT})*/?$"

_compiled: dict[str, re.Pattern[str]] = {}


def matches(pattern: str, value: str) -> bool:
    """True when ``value`` matches one of the patterns above (compiled once)."""
    rx = _compiled.get(pattern)
    if rx is None:
        rx = _compiled[pattern] = re.compile(pattern)
    return rx.fullmatch(value) is not None


def explain_uri(uri: str) -> str | None:
    """Why an artifact URI is refused, in words a user understands; None when it is fine."""
    scheme, sep, rest = uri.partition("://")
    if not sep:
        return f"artifact uri {uri!r} has no scheme; use one of {', '.join(s + '://' for s in ALLOWED_URI_SCHEMES)}"
    if scheme not in ALLOWED_URI_SCHEMES:
        return f"artifact uri scheme {scheme!r} is not allowed; use one of {', '.join(ALLOWED_URI_SCHEMES)}"
    if any(seg in (".", "..") for seg in rest.split("/")):
        return f"artifact uri {uri!r} contains a '.' or '..' path segment"
    if any(ord(c) < 0x21 or ord(c) == 0x7F or c == "\\" for c in uri):
        return f"artifact uri {uri!r} contains a space, backslash or control character"
    if not matches(ARTIFACT_URI, uri):
        return f"artifact uri {uri!r} is not a valid <scheme>://<path> URI"
    return None


def is_pod_name(name: str) -> bool:
    """True for a valid Pod name (a DNS-1123 subdomain of at most 253 characters)."""
    return len(name) <= DNS1123_SUBDOMAIN_MAX and matches(DNS1123_SUBDOMAIN, name)


def split_host_port(text: str) -> tuple[str, int | None]:
    """``host``, ``host:port``, ``[ipv6]``, ``[ipv6]:port`` or a bare IPv6 address -> (host without brackets, port
    or None); ValueError with the reason otherwise. The host is not checked (it may be a name, an address or a
    CIDR)."""
    if text.startswith("["):
        host, bracket, rest = text[1:].partition("]")
        if not bracket or (rest and not rest.startswith(":")):
            raise ValueError(f"address {text!r}: a bracketed host is [host] or [host]:port")
        port = rest[1:] if rest else None
    elif text.count(":") == 1:
        host, _, port = text.partition(":")
    else:  # no port, or a bare IPv6 address
        host, port = text, None
    if not host:
        raise ValueError(f"address {text!r} has no host")
    if port is not None and (not port.isdigit() or int(port) > 65535):
        raise ValueError(f"address {text!r} is not host:port with a port in 0-65535")
    return host, None if port is None else int(port)


def parse_host_port(address: str) -> tuple[str, int]:
    """``host:port`` or ``[ipv6]:port`` -> (host without brackets, port); ValueError with the reason otherwise."""
    host, port = split_host_port(address)
    if port is None:
        if ":" in host:
            raise ValueError(f"address {address!r}: an IPv6 host must be written in brackets, [host]:port")
        raise ValueError(f"address {address!r} is not host:port")
    return host, port


def join_host_port(host: str, port: int) -> str:
    """The inverse of ``parse_host_port``: ``host:port``, an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
