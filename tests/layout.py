"""The checkout's layout as setup.py reads it: ``loraplane`` is a namespace package whose parts live in ``loraplane/``
and under each component folder (``picker/loraplane/picker``, ...)."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def namespace_roots() -> list[Path]:
    """The folders that hold a part of the namespace: the checkout itself, then every component folder."""
    return [REPO, *sorted({p.parents[2] for p in REPO.glob("*/loraplane/*/__init__.py")})]
