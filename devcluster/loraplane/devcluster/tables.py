"""Server-side printing: the ``meta.k8s.io/v1`` ``Table`` kubectl asks for, with each kind's columns.

Built-in kinds get the columns the real API server prints; custom resources get their CRD's
``additionalPrinterColumns`` (or ``Age``). Ages are computed on the server from the injected clock.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

Cell = str | int | float | bool | None


@dataclass(frozen=True)
class Column:
    """One table column: its definition and how to compute its cell from an object and the current time."""

    name: str
    type: str
    value: Callable[[dict[str, Any], datetime], Cell]
    description: str = ""
    format: str = ""
    priority: int = 0

    def definition(self) -> dict[str, Any]:
        """The ``TableColumnDefinition``."""
        return {"name": self.name, "type": self.type, "format": self.format, "description": self.description,
                "priority": self.priority}


def parse_time(text: Any) -> datetime | None:
    """An RFC 3339 timestamp, None when absent or malformed."""
    if not isinstance(text, str):
        return None
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None


def human_duration(seconds: float) -> str:
    """Go's ``duration.HumanDuration`` (what kubectl shows as AGE)."""
    total = int(seconds)
    if total < -1:
        return "<invalid>"
    if total < 0:
        return "0s"
    if total < 120:
        return f"{total}s"
    minutes, hours = total // 60, total // 3600
    if minutes < 10:
        rest = total % 60
        return f"{minutes}m{rest}s" if rest else f"{minutes}m"
    if minutes < 180:
        return f"{minutes}m"
    if hours < 8:
        rest = minutes % 60
        return f"{hours}h{rest}m" if rest else f"{hours}h"
    if hours < 48:
        return f"{hours}h"
    days = hours // 24
    if hours < 24 * 8:
        rest = hours % 24
        return f"{days}d{rest}h" if rest else f"{days}d"
    if hours < 24 * 365 * 2:
        return f"{days}d"
    years = days // 365
    if hours < 24 * 365 * 8:
        rest = days % 365
        return f"{years}y{rest}d" if rest else f"{years}y"
    return f"{years}y"


def age(timestamp: Any, now: datetime) -> str | None:
    """The human age of a timestamp, None when there is none."""
    when = parse_time(timestamp)
    return None if when is None else human_duration((now - when).total_seconds())


_PATH_TOKEN = re.compile(r"\.([A-Za-z0-9_$-]+)|\[(\d+)\]|\['([^']*)'\]")


def json_path(obj: Any, path: str) -> Any:
    """The value at a simple JSONPath (``.status.phase``, ``.spec.items[0].name``); None when absent."""
    node = obj
    pos = 0
    path = path.strip().removeprefix("{").removesuffix("}").removeprefix("$")
    while pos < len(path):
        m = _PATH_TOKEN.match(path, pos)
        if m is None:
            return None
        pos = m.end()
        key: str | int = m.group(1) or m.group(3) if m.group(2) is None else int(m.group(2))
        if isinstance(key, int):
            if not isinstance(node, list) or key >= len(node):
                return None
        elif not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return node


def _meta(obj: dict[str, Any], key: str) -> Any:
    return obj.get("metadata", {}).get(key)


def _name(obj: dict[str, Any], _now: datetime) -> Cell:
    return _meta(obj, "name")


def _age(obj: dict[str, Any], now: datetime) -> Cell:
    return age(_meta(obj, "creationTimestamp"), now)


NAME = Column("Name", "string", _name, "Name must be unique within a namespace.", "name")
AGE = Column("Age", "string", _age, "CreationTimestamp is a timestamp representing the server time when this object was created.")


def _cell(kind: str, value: Any, now: datetime) -> Cell:
    if value is None:
        return None
    if kind == "date":
        return age(value, now)
    if kind in ("integer", "number", "boolean") and isinstance(value, int | float | bool):
        return value
    if isinstance(value, str | int | float | bool):
        return str(value) if kind == "string" else value
    return str(value)


def printer_column(spec: dict[str, Any]) -> Column:
    """A column from a CRD's ``additionalPrinterColumns`` entry."""
    kind, path = spec.get("type", "string"), spec.get("jsonPath", "")
    return Column(spec["name"], kind, lambda obj, now: _cell(kind, json_path(obj, path), now),
                  spec.get("description", ""), spec.get("format", ""), int(spec.get("priority", 0)))


def custom_resource_columns(printer_columns: list[dict[str, Any]]) -> list[Column]:
    """Name plus the CRD's printer columns (Age when it declares none), as the API server prints them."""
    return [NAME, *(printer_column(c) for c in printer_columns)] if printer_columns else [NAME, AGE]


def _pod_ready(obj: dict[str, Any], _now: datetime) -> Cell:
    statuses = obj.get("status", {}).get("containerStatuses") or []
    return f"{sum(1 for s in statuses if s.get('ready'))}/{len(obj.get('spec', {}).get('containers') or [])}"


def _pod_status(obj: dict[str, Any], _now: datetime) -> Cell:
    if _meta(obj, "deletionTimestamp"):
        return "Terminating"
    status = obj.get("status", {})
    for container in status.get("containerStatuses") or []:
        waiting = (container.get("state") or {}).get("waiting")
        if waiting and waiting.get("reason"):
            return str(waiting["reason"])
    return str(status.get("reason") or status.get("phase") or "Unknown")


def _pod_restarts(obj: dict[str, Any], _now: datetime) -> Cell:
    return sum(int(s.get("restartCount", 0)) for s in obj.get("status", {}).get("containerStatuses") or [])


def _involved(obj: dict[str, Any], _now: datetime) -> Cell:
    ref = obj.get("involvedObject") or {}
    return f"{str(ref.get('kind', '')).lower()}/{ref.get('name', '')}"


def _last_seen(obj: dict[str, Any], now: datetime) -> Cell:
    when = obj.get("lastTimestamp") or (obj.get("series") or {}).get("lastObservedTime") or obj.get("eventTime")
    return age(when or _meta(obj, "creationTimestamp"), now)


def _field(path: str) -> Callable[[dict[str, Any], datetime], Cell]:
    return lambda obj, _now: _cell("string", json_path(obj, path), _now)


POD_COLUMNS = [
    NAME,
    Column("Ready", "string", _pod_ready, "The aggregate readiness state of this pod for accepting traffic."),
    Column("Status", "string", _pod_status, "The aggregate status of the containers in this pod."),
    Column("Restarts", "string", _pod_restarts, "The number of times the containers in this pod have been restarted."),
    AGE,
    Column("IP", "string", _field(".status.podIP"), "IP address allocated to the pod.", priority=1),
    Column("Node", "string", _field(".spec.nodeName"), "Name of the node this pod runs on.", priority=1),
]
NAMESPACE_COLUMNS = [NAME, Column("Status", "string", _field(".status.phase"), "The status of the namespace"), AGE]
LEASE_COLUMNS = [NAME, Column("Holder", "string", _field(".spec.holderIdentity"), "The holder of the lease"), AGE]
EVENT_COLUMNS = [
    Column("Last Seen", "string", _last_seen, "Time since the event was last seen."),
    Column("Type", "string", _field(".type"), "Type of this event (Normal, Warning)."),
    Column("Reason", "string", _field(".reason"), "Why the action was taken."),
    Column("Object", "string", _involved, "The object this event is about."),
    Column("Source", "string", _field(".reportingComponent"), "The component reporting this event.", priority=1),
    Column("Message", "string", _field(".message"), "A human-readable description of the event."),
    Column("Count", "string", _field(".count"), "How many times this event occurred.", priority=1),
    Column("Name", "string", _name, "Name of the event.", "name", priority=1),
]
CRD_COLUMNS = [NAME, Column("Created At", "date", lambda obj, _now: _meta(obj, "creationTimestamp"),
                            "The time the CustomResourceDefinition was created.", "date-time")]


def partial_metadata(obj: dict[str, Any]) -> dict[str, Any]:
    """``PartialObjectMetadata`` of an object (what a row carries with ``includeObject=Metadata``)."""
    return {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1", "metadata": obj.get("metadata", {})}


def table(columns: list[Column], rows: list[tuple[dict[str, Any], dict[str, Any]]], now: datetime,
          include_object: str, list_meta: dict[str, Any], with_definitions: bool = True) -> dict[str, Any]:
    """A ``Table``: ``rows`` pairs the object the cells are computed from with the object the row carries."""
    def carried(obj: dict[str, Any]) -> dict[str, Any] | None:
        if include_object == "None":
            return None
        return obj if include_object == "Object" else partial_metadata(obj)

    return {
        "kind": "Table",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": list_meta,
        "columnDefinitions": [c.definition() for c in columns] if with_definitions else [],
        "rows": [{"cells": [c.value(source, now) for c in columns], "object": carried(shown)} for source, shown in rows],
    }
