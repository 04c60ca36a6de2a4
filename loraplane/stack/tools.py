"""The kubectl and Helm that loraplane runs: the ones ``scripts/install-tools.sh`` (``make setup``) installs into
``.tools/bin``, never whatever ``kubectl`` or ``helm`` happens to be on PATH (a machine's may be missing, or another
version than the one the stack and the tests were checked with).

``LORAPLANE_TOOLS_BIN`` names another folder holding both (an installed loraplane has no ``.tools/bin`` beside it).
"""

from __future__ import annotations

import os
from pathlib import Path

#: the folder ``scripts/install-tools.sh`` installs into
TOOLS_BIN = Path(__file__).resolve().parents[2] / ".tools" / "bin"
#: environment variable that names another folder with ``kubectl`` and ``helm``
TOOLS_BIN_ENV = "LORAPLANE_TOOLS_BIN"
INSTALL_HINT = "run scripts/install-tools.sh (make setup does it)"


class ToolMissing(FileNotFoundError):
    """A tool loraplane runs is not installed where setup puts it."""


def tools_bin() -> Path:
    """The folder the tools are taken from: ``$LORAPLANE_TOOLS_BIN``, else the checkout's ``.tools/bin``."""
    return Path(os.environ[TOOLS_BIN_ENV]) if os.environ.get(TOOLS_BIN_ENV) else TOOLS_BIN


def tool_path(name: str) -> Path | None:
    """``<tools bin>/<name>`` when it is installed and executable, else None."""
    path = tools_bin() / name
    return path if path.is_file() and os.access(path, os.X_OK) else None


def require_tool(name: str) -> str:
    """The path of ``<tools bin>/<name>``; raises ``ToolMissing`` (saying how to install it) when it is not there."""
    path = tool_path(name)
    if path is None:
        raise ToolMissing(f"{name} is not installed in {tools_bin()}: {INSTALL_HINT}")
    return str(path)


def kubectl() -> str:
    """The path of the kubectl setup installed."""
    return require_tool("kubectl")


def helm() -> str:
    """The path of the Helm setup installed."""
    return require_tool("helm")
