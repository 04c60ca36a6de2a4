"""The import contracts of ``.importlinter`` (the layering: api and kernels at the bottom; devcluster/kube and the
shared plumbing; the processes; stack and sim; the benchmarks on top) hold on the tree, and each breaks when one
module imports across it: the check runs on a copy of the namespace (its parts merged into one folder of links to
every file) with one module added."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.layout import REPO, namespace_roots

LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def lint_imports(roots: list[Path]) -> subprocess.CompletedProcess[str]:
    """``lint-imports`` with the checkout's contracts, on the ``loraplane`` namespace whose parts lie under
    ``roots``."""
    if not LINT_IMPORTS.exists():
        pytest.fail(f"{LINT_IMPORTS} is missing: import-linter is a dev dependency (make setup installs it)")
    return subprocess.run([str(LINT_IMPORTS), "--no-cache", str(REPO / ".importlinter")], cwd=roots[0],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(map(str, roots)),
                               "PYTHONDONTWRITEBYTECODE": "1"})


def _link_tree(source: Path, target: Path) -> None:
    """``target``: ``source``'s folders merged into it, each file a link to its original."""
    target.mkdir(exist_ok=True)
    for entry in source.iterdir():
        if entry.name == "__pycache__":
            continue
        if entry.is_dir():
            _link_tree(entry, target / entry.name)
        else:
            (target / entry.name).symlink_to(entry.resolve())


def package_with(tmp_path: Path, module: str, source: str) -> list[Path]:
    """A copy of the namespace with ``loraplane.<module>`` added (``source`` its text); the root to lint it in."""
    for root in namespace_roots():
        _link_tree(root / "loraplane", tmp_path / "loraplane")
    path = tmp_path / "loraplane" / Path(*module.split(".")).with_suffix(".py")
    path.write_text(source)
    return [tmp_path]


def test_the_tree_keeps_every_contract() -> None:
    result = lint_imports(namespace_roots())
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 kept, 0 broken" in result.stdout


@pytest.mark.parametrize(("module", "source", "broken"), [
    # the contract (api) reaching up into a process
    ("api.reaches_up", "from loraplane.picker import scheduler\n", "Layers"),
    # a process reaching up into the stack that starts it
    ("controller.reaches_up", "def f():\n    from loraplane.stack import services\n", "Layers"),
    # two processes importing each other
    ("picker.sideways", "import loraplane.controller.queue\n", "Layers"),
    # a product module importing a benchmark
    ("controller.uses_a_bench", "from loraplane.bench import controller\n", "Layers"),
    # a product module importing a measurement that lives in its own package (no layer crossed)
    ("emulator.uses_fidelity", "from loraplane.emulator import fidelity\n", "Measurements"),
])
def test_a_violation_breaks_its_contract(tmp_path: Path, module: str, source: str, broken: str) -> None:
    result = lint_imports(package_with(tmp_path, module, source))
    assert result.returncode != 0, result.stdout
    assert "1 kept, 1 broken" in result.stdout
    report = result.stdout.split("Broken contracts")[1].strip("-\n ")
    assert report.startswith(broken), result.stdout
    assert re.search(rf"^-\s+loraplane\.{re.escape(module)} -> ", report, re.M), result.stdout
