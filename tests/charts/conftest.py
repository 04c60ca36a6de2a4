"""Render the Helm chart with real ``helm`` and index what it produced."""

from __future__ import annotations

import contextlib
import http.server
import json
import subprocess
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.fixtures.tools import REPO

CHART = REPO / "charts" / "loraplane"
RELEASE = "lp"
NAMESPACE = "serving"


@dataclass
class Rendered:
    """The objects one ``helm template`` produced."""

    objects: list[dict[str, Any]]

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        """Every object of ``kind``."""
        return [o for o in self.objects if o["kind"] == kind]

    def get(self, kind: str, name: str) -> dict[str, Any]:
        """The one object of ``kind`` named ``name``."""
        found = [o for o in self.of_kind(kind) if o["metadata"]["name"] == name]
        assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
        return found[0]

    def names(self, kind: str) -> set[str]:
        """Names of the objects of ``kind``."""
        return {o["metadata"]["name"] for o in self.of_kind(kind)}

    def workloads(self) -> Iterator[dict[str, Any]]:
        """Deployments and StatefulSets."""
        yield from (o for o in self.objects if o["kind"] in ("Deployment", "StatefulSet"))


def name_of(component: str) -> str:
    """The full name the chart gives a component's objects in the test release."""
    return f"{RELEASE}-loraplane-{component}"


def helm_template(helm: str, values: dict[str, Any], tmp_path: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    """Run ``helm template`` with ``values``; the completed process (it may have failed)."""
    values_file = tmp_path / "values.yaml"
    values_file.write_text(yaml.safe_dump(values))
    return subprocess.run(
        [helm, "template", RELEASE, str(CHART), "--namespace", NAMESPACE, "-f", str(values_file), *extra],
        capture_output=True, text=True, timeout=60, check=False,
    )


RenderFn = Callable[..., Rendered]
#: libyaml's loader when PyYAML has it (several times faster on the chart's output).
_YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


@pytest.fixture(scope="session")
def _render_cache() -> dict[str, str]:
    """helm's output per (values, arguments): tests that render the same values share one ``helm template``."""
    return {}


@pytest.fixture
def render(helm_bin: str, tmp_path: Path, _render_cache: dict[str, str]) -> RenderFn:
    """``render(values, *helm_args)`` -> the rendered objects; fails the test with helm's message on error."""

    def _render(values: dict[str, Any] | None = None, *extra: str) -> Rendered:
        key = json.dumps([values or {}, extra], sort_keys=True)
        if key not in _render_cache:
            result = helm_template(helm_bin, values or {}, tmp_path, *extra)
            assert result.returncode == 0, result.stderr
            _render_cache[key] = result.stdout
        return Rendered([o for o in yaml.load_all(_render_cache[key], Loader=_YAML_LOADER) if o])

    return _render


@dataclass
class ModelServerStandIn:
    """A loopback HTTP server in a model-server pod's place: it answers completions and records what reached it."""

    name: str
    port: int = 0
    seen: list[dict[str, Any]] = field(default_factory=list)

    def handler(self) -> type[http.server.BaseHTTPRequestHandler]:
        """The request handler class, recording into ``seen``."""
        seen = self.seen

        class Handler(http.server.BaseHTTPRequestHandler):
            def _body(self) -> bytes:
                if self.headers.get("transfer-encoding", "").lower() != "chunked":
                    return self.rfile.read(int(self.headers.get("content-length", 0)))
                data = b""  # Envoy streams a body it got back from the picker in FULL_DUPLEX_STREAMED mode
                while size := int(self.rfile.readline().split(b";")[0], 16):
                    data += self.rfile.read(size)
                    self.rfile.readline()
                self.rfile.readline()
                return data

            def do_POST(self) -> None:
                body = json.loads(self._body() or b"{}")
                seen.append({"path": self.path, "model": body.get("model"),
                             "destination": self.headers.get("x-gateway-destination-endpoint"),
                             "authorization": self.headers.get("authorization")})
                out = json.dumps({"model": body.get("model"), "choices": [{"text": "ok"}]}).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, format: str, *args: Any) -> None:
                """Quiet."""

        return Handler


@contextlib.contextmanager
def model_server_stand_in(name: str) -> Iterator[ModelServerStandIn]:
    """A running ``ModelServerStandIn`` on a free loopback port, stopped afterwards."""
    stand_in = ModelServerStandIn(name)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), stand_in.handler())
    stand_in.port = server.server_address[1]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield stand_in
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
