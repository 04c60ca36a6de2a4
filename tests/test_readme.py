"""The README's Kubernetes quickstart runs, command by command, against the embedded API server with real kubectl."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from e2e.fixtures.devcluster import DevCluster

REPO = Path(__file__).resolve().parents[1]


def quickstart_commands() -> list[list[str]]:
    """The kubectl commands between the README's quickstart markers."""
    text = (REPO / "README.md").read_text()
    block = re.search(r"<!-- quickstart:begin -->\s*```sh\n(.*?)```\s*<!-- quickstart:end -->", text, re.S)
    assert block, "README has no quickstart block"
    return [shlex.split(line) for line in block.group(1).splitlines() if line.strip()]


def test_quickstart_is_kubectl_only() -> None:
    commands = quickstart_commands()
    assert len(commands) >= 5
    assert all(cmd[0] == "kubectl" for cmd in commands)


@pytest.mark.slow
def test_quickstart_runs_against_the_embedded_api_server(devcluster: DevCluster) -> None:
    outputs = []
    for cmd in quickstart_commands():
        result = devcluster.kubectl(*cmd[1:], check=False, timeout=60)
        assert result.returncode == 0, f"{shlex.join(cmd)} failed:\n{result.stderr}{result.stdout}"
        outputs.append(result.stdout)
    listing = outputs[2]
    assert "claims-assistant-v18" in listing and "ADAPTER" in listing and "REVISION" in listing
    assert "REASON" in outputs[3]
    assert "Rollback:" in outputs[4] or "rollback" in outputs[4].lower()
    gone = devcluster.kubectl("get", "adapterrevisions", "-o", "name")
    assert "claims-assistant-v18" not in gone.stdout
