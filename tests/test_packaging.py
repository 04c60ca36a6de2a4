"""The distribution: every component imports, every console script answers --help."""

from __future__ import annotations

import importlib
import shutil
import subprocess
import sys

import pytest

from loraplane.cli import BENCHMARKS, COMMANDS

COMPONENTS = ["api", "kernels", "engine", "sidecar", "picker", "controller", "sim"]
SCRIPTS = ["loraplane", "loraplane-picker", "loraplane-controller", "loraplane-sidecar", "loraplane-engine"]


@pytest.mark.parametrize("name", COMPONENTS)
def test_component_imports(name: str) -> None:
    module = importlib.import_module(f"loraplane.{name}")
    assert module.__doc__, f"loraplane.{name} has no docstring"


@pytest.mark.parametrize("script", SCRIPTS)
def test_console_script_help(script: str) -> None:
    exe = shutil.which(script)
    assert exe, f"{script} is not installed"
    out = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "usage" in out.stdout.lower()


def test_cli_targets_name_real_modules_or_say_not_yet() -> None:
    for target in [t for t, _ in COMMANDS.values()] + list(BENCHMARKS.values()):
        module = target.partition(":")[0]
        assert module.startswith("loraplane.")


def test_unknown_subcommand_fails() -> None:
    out = subprocess.run([sys.executable, "-m", "loraplane.cli", "frobnicate"], capture_output=True, text=True)
    assert out.returncode != 0
