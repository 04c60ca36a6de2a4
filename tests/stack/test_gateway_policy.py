"""``loraplane up``'s gateway settings (``picker.envoy.HARDENED``) in the real Envoy: only inference paths reach a
pod, the client's address is forwarded, a configured upstream token replaces the client's, a client that never
finishes its headers is cut off. No picker runs (``fail_open``): Envoy balances over the static pool itself."""

from __future__ import annotations

import dataclasses
import http.server
import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from loraplane.picker.envoy import HARDENED, picker_config
from loraplane.processes import ManagedProcess, envoy_binary, free_port, wait_for_port


@pytest.fixture
def backend() -> Iterator[tuple[int, list[dict[str, Any]]]]:
    seen: list[dict[str, Any]] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def _answer(self) -> None:
            self.rfile.read(int(self.headers.get("content-length", 0)))
            seen.append({"path": self.path, "authorization": self.headers.get("authorization"),
                         "forwarded": self.headers.get("x-forwarded-for")})
            body = json.dumps({"ok": True}).encode()
            self.send_response(200)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = _answer

        def log_message(self, format: str, *args: Any) -> None:
            """Quiet."""

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1], seen
    finally:
        server.shutdown()
        server.server_close()


def _envoy(tmp_path: Path, backend_port: int, **policy: Any) -> tuple[ManagedProcess, int]:
    port = free_port()
    config = picker_config(port, free_port(), free_port(), policy=dataclasses.replace(
        HARDENED, endpoints=[f"127.0.0.1:{backend_port}"], fail_open=True, **policy))
    path = tmp_path / f"envoy-{port}.json"
    path.write_text(json.dumps(config))
    process = ManagedProcess([envoy_binary(), "-c", str(path), "--concurrency", "1", "-l", "warning", "--base-id",
                              str(port)], tmp_path / f"envoy-{port}.log").start()
    wait_for_port(port, proc=process.proc, timeout=30)
    return process, port


def test_only_inference_paths_reach_a_pod_with_the_gateways_token(tmp_path: Path,
                                                                  backend: tuple[int, list[dict[str, Any]]]) -> None:
    backend_port, seen = backend
    envoy, port = _envoy(tmp_path, backend_port, upstream_authorization="pod-secret")
    try:
        url = f"http://127.0.0.1:{port}"
        refused = {path: httpx.post(url + path, json={}, timeout=10).status_code
                   for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/admin/adapters", "/metrics",
                                "/v1/completions/../load_lora_adapter", "/", "/adapters", "/invocations")}
        served = httpx.post(f"{url}/v1/completions", json={"model": "m"}, timeout=10,
                            headers={"authorization": "Bearer client-guess"})
    finally:
        envoy.stop()
    assert set(refused.values()) == {404}, refused
    assert served.status_code == 200
    assert [(s["path"], s["authorization"]) for s in seen] == [("/v1/completions", "Bearer pod-secret")]
    assert seen[0]["forwarded"], "the pod must see that the request came through a proxy"


@pytest.mark.parametrize(("timeout", "sent"), [
    ("request_headers_timeout", b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n"),  # headers never finished
    ("stream_idle_timeout", b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n{"),  # body stalls
], ids=["headers", "body"])
def test_a_client_that_stalls_is_cut_off(tmp_path: Path, backend: tuple[int, list[dict[str, Any]]], timeout: str,
                                         sent: bytes) -> None:
    envoy, port = _envoy(tmp_path, backend[0], **{timeout: "1s"})
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as stalled:
            stalled.sendall(sent)  # and nothing more
            answer = stalled.recv(4096)
            while answer and b"\r\n\r\n" not in answer:
                answer += stalled.recv(4096)
    finally:
        envoy.stop()
    assert answer.startswith(b"HTTP/1.1 408"), answer[:80]  # Envoy's own timeout answered, not the socket's
