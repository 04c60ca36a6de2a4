"""Hostile artifacts against real servers: bombs, internal targets (SSRF), redirects, stalls, refused schemes.

Every refusal must happen before a byte reaches an internal target (the listeners count their connections) and
before a bomb is written out (a watcher thread records the most bytes the cache directory ever held).
"""

from __future__ import annotations

import hashlib
import http.server
import json
import socket
import ssl
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from e2e.fixtures.processes import LOOPBACK
from loraplane.bench.sidecar import self_signed_cert
from loraplane.sidecar.artifacts import ArtifactError, ArtifactSources, SourceConfig, parse_allowance
from loraplane.sidecar.cache import DiskCache, StageTimings, UnpackLimits
from tests.sidecar.adapters import sha256_of, tar_dir, target_for, write_peft_dir, zero_bomb


class CountingListener:
    """A TCP port that accepts connections, counts them, and never answers (an internal service stand-in)."""

    def __init__(self) -> None:
        self.sock = socket.create_server((LOOPBACK, 0))
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        self._held: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            self._held.append(conn)

    def close(self) -> None:
        self.sock.close()
        for conn in self._held:
            conn.close()


@pytest.fixture
def listener() -> Iterator[CountingListener]:
    server = CountingListener()
    yield server
    server.close()


def sources(**config: Any) -> ArtifactSources:
    return ArtifactSources(SourceConfig(**config))


def fetch_error(src: ArtifactSources, uri: str) -> ArtifactError:
    with pytest.raises(ArtifactError) as err:
        src.fetch(uri, "sha256:" + "0" * 64, lambda chunk: None, lambda: None)
    return err.value


@pytest.mark.parametrize("template", [
    "https://127.0.0.1:{port}/adapter.tar",
    "https://localhost:{port}/adapter.tar",
    "https://[::ffff:127.0.0.1]:{port}/adapter.tar",
    "oci://127.0.0.1:{port}/adapters/support:v1",
    "oci://localhost:{port}/adapters/support@sha256:" + "a" * 64,
])
def test_internal_targets_are_refused_before_connecting(listener: CountingListener, template: str) -> None:
    error = fetch_error(sources(oci_plain_http=frozenset({f"127.0.0.1:{listener.port}", f"localhost:{listener.port}"})),
                        template.format(port=listener.port))
    assert error.reason == "InternalAddress", error
    assert "internal address" in str(error)
    assert listener.accepted == 0


@pytest.mark.parametrize(("address", "internal"), [
    ("10.0.0.7", True), ("172.16.4.1", True), ("192.168.1.1", True), ("169.254.169.254", True),
    ("100.64.0.1", True), ("0.0.0.0", True), ("fd00::1", True), ("fe80::1", True), ("::1", True),
    ("93.184.216.34", False),
])
def test_every_resolved_address_is_checked(address: str, internal: bool) -> None:
    """A name is refused when any of its addresses is internal (names resolved by an injected resolver)."""
    def resolve(host: str, port: int, **kw: Any) -> list[tuple[Any, ...]]:
        assert host == "artifacts.example.com"
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("93.184.216.34", port)),
                (socket.AF_INET6 if ":" in address else socket.AF_INET, socket.SOCK_STREAM, 6, "", (address, port))]

    src = ArtifactSources(SourceConfig(connect_timeout_s=0.5, read_timeout_s=0.5), resolve=resolve)
    error = fetch_error(src, "https://artifacts.example.com/a.tar")
    # a public-only name gets as far as connecting (to a documentation address nothing here can reach)
    assert (error.reason == "InternalAddress") is internal, error


def test_host_allow_list_and_scheme_allow_list(tmp_path: Path) -> None:
    src = sources(allowed_hosts=("*.example.com",), schemes=frozenset({"https", "s3"}))
    assert fetch_error(src, "https://evil.example.org/a.tar").reason == "HostNotAllowed"
    assert fetch_error(src, "s3://other-bucket/a.tar").reason == "HostNotAllowed"
    assert fetch_error(src, "oci://registry.example.com/a:v1").reason == "SchemeNotAllowed"
    assert fetch_error(src, f"file://{tmp_path}/a.tar").reason == "SchemeNotAllowed"


def test_an_allowance_names_one_port_only(listener: CountingListener) -> None:
    other = CountingListener()
    try:
        src = sources(allow_internal=(parse_allowance(f"127.0.0.1:{other.port}"),), connect_timeout_s=0.3,
                      read_timeout_s=0.3)
        assert fetch_error(src, f"https://127.0.0.1:{listener.port}/a").reason == "InternalAddress"
        assert listener.accepted == 0
        assert fetch_error(src, f"https://127.0.0.1:{other.port}/a").reason == "TransferFailed"  # allowed: read times out
        assert other.accepted == 1
    finally:
        other.close()


class _Handler(http.server.BaseHTTPRequestHandler):
    """Answers every GET from ``server.answers``: path -> (status, headers, body)."""

    def do_GET(self) -> None:
        status, headers, body = self.server.answers.get(self.path.partition("?")[0], (404, {}, b""))  # type: ignore[attr-defined]
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def scripted(tmp_path: Path) -> Iterator[Any]:
    """Start scripted HTTP(S) servers on loopback: ``scripted(answers, tls=False)`` -> (server, base URL, CA)."""
    servers: list[http.server.ThreadingHTTPServer] = []

    def start(answers: dict[str, tuple[int, dict[str, str], bytes]], tls: bool = False,
              cert_host: str = LOOPBACK) -> tuple[Any, str, str | None]:
        server = http.server.ThreadingHTTPServer((LOOPBACK, 0), _Handler)
        server.answers = answers  # type: ignore[attr-defined]
        ca = None
        if tls:
            workdir = tmp_path / f"tls-{len(servers)}"
            workdir.mkdir()
            ca, key = self_signed_cert(workdir, cert_host)
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(ca, key)
            server.socket = context.wrap_socket(server.socket, server_side=True)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return server, f"{'https' if tls else 'http'}://{LOOPBACK}:{server.server_address[1]}", ca

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def test_https_redirect_to_an_internal_target_is_refused(scripted: Any, listener: CountingListener) -> None:
    server, base, ca = scripted({"/a.tar": (302, {"Location": f"https://127.0.0.1:{listener.port}/x"}, b"")}, tls=True)
    allowed = parse_allowance(f"127.0.0.1:{server.server_address[1]}")
    error = fetch_error(sources(allow_internal=(allowed,), https_ca_file=ca), f"{base}/a.tar")
    assert error.reason == "InternalAddress" and listener.accepted == 0


@pytest.mark.parametrize("trap", ["blob-redirect", "token-realm"])
def test_oci_redirects_and_token_realms_to_internal_targets_are_refused(scripted: Any, listener: CountingListener,
                                                                        trap: str) -> None:
    digest = "sha256:" + "b" * 64
    internal = f"http://127.0.0.1:{listener.port}"
    answers: dict[str, tuple[int, dict[str, str], bytes]] = {
        "/v2/adapters/support/manifests/v1": (200, {"Content-Type": "application/vnd.oci.image.manifest.v1+json"},
                                              _manifest(digest, 10)),
        f"/v2/adapters/support/blobs/{digest}": (307, {"Location": f"{internal}/blob"}, b""),
    }
    if trap == "token-realm":
        answers["/v2/adapters/support/manifests/v1"] = (
            401, {"WWW-Authenticate": f'Bearer realm="{internal}/token",service="r",scope="repository:a:pull"'}, b"")
    _, base, _ = scripted(answers)
    host = base.removeprefix("http://")
    src = sources(allow_internal=(parse_allowance(host),), oci_plain_http=frozenset({host}), read_timeout_s=2)
    error = fetch_error(src, f"oci://{host}/adapters/support:v1")
    assert error.reason == "InternalAddress", error
    assert listener.accepted == 0


def _manifest(layer_digest: str, size: int) -> bytes:
    return json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                       "config": {"mediaType": "application/vnd.oci.empty.v1+json", "size": 2,
                                  "digest": "sha256:" + "c" * 64},
                       "layers": [{"mediaType": "application/octet-stream", "size": size, "digest": layer_digest}]}
                      ).encode()


def test_fetches_connect_to_the_address_the_guard_checked(scripted: Any) -> None:
    """The names here resolve only through the guard's resolver: a fetch that resolved them again would fail."""
    blob = b"adapter bytes"
    digest = "sha256:" + hashlib.sha256(blob).hexdigest()
    oci, _, _ = scripted({
        "/v2/adapters/support/manifests/v1": (200, {"Content-Type": "application/vnd.oci.image.manifest.v1+json"},
                                              _manifest(digest, len(blob))),
        f"/v2/adapters/support/blobs/{digest}": (200, {}, blob),
    })
    https, _, ca = scripted({"/a.bin": (200, {}, blob)}, tls=True, cert_host="artifacts.test")
    resolved: list[str] = []

    def resolve(host: str, port: int, **kw: Any) -> list[tuple[Any, ...]]:
        resolved.append(host)
        assert host in ("registry.test", "artifacts.test"), host
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (LOOPBACK, port))]

    registry = f"registry.test:{oci.server_address[1]}"
    src = ArtifactSources(SourceConfig(allow_internal=(parse_allowance(f"{LOOPBACK}/32"),), https_ca_file=ca,
                                       oci_plain_http=frozenset({registry})), resolve=resolve)
    for uri in (f"oci://{registry}/adapters/support:v1", f"https://artifacts.test:{https.server_address[1]}/a.bin"):
        got = bytearray()
        src.fetch(uri, digest, got.extend, lambda: None)
        assert bytes(got) == blob, uri
    assert set(resolved) == {"registry.test", "artifacts.test"}


def test_silent_hosts_time_out_and_slow_ones_hit_the_deadline(listener: CountingListener, https_files: Any,
                                                               tmp_path: Path) -> None:
    loopback = (parse_allowance("127.0.0.0/8"),)
    silent = sources(allow_internal=loopback, connect_timeout_s=0.3, read_timeout_s=0.3,
                     oci_plain_http=frozenset({f"127.0.0.1:{listener.port}"}))
    assert fetch_error(silent, f"https://127.0.0.1:{listener.port}/a").reason == "TransferFailed"
    assert fetch_error(silent, f"oci://127.0.0.1:{listener.port}/a/b:v1").reason == "ManifestUnavailable"
    assert listener.accepted == 2

    payload = tmp_path / "big.bin"
    payload.write_bytes(bytes(400_000))
    uri = https_files.publish(payload, "slow.bin")
    https_files.throttle_bytes_per_s = 100_000  # 4 s in all, a chunk every 50 ms: no read ever times out
    try:
        slow = sources(allow_internal=loopback, https_ca_file=str(https_files.ca_file), deadline_s=1.0)
        error = fetch_error(slow, uri)
    finally:
        https_files.throttle_bytes_per_s = 0
    assert error.reason == "FetchDeadlineExceeded", error


@pytest.fixture(scope="module")
def gib_bomb(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A ~1 MiB gzip tar holding 1 GiB of zeros."""
    return zero_bomb(tmp_path_factory.mktemp("bomb") / "bomb.tar.gz", 1 << 30)


class DiskWatcher:
    """Polls a directory's total file bytes in a thread; ``most`` is the largest total seen."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.most = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(0.002):
            total = 0
            for path in self.root.rglob("*"):
                try:
                    total += path.stat().st_size if path.is_file() else 0
                except OSError:
                    pass
            self.most = max(self.most, total)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.most


@pytest.mark.slow
@pytest.mark.parametrize(("limits", "reason"), [
    (UnpackLimits(), "CompressionRatioTooHigh"),
    (UnpackLimits(max_bytes=256 << 20, max_ratio=1e9), "UnpackedTooLarge"),
])
def test_a_gzip_bomb_is_refused_while_streaming(tmp_path: Path, gib_bomb: Path, limits: UnpackLimits,
                                                reason: str) -> None:
    assert gib_bomb.stat().st_size < 2 << 20
    cache = DiskCache(tmp_path / "cache", 1 << 30, sources(file_roots=(gib_bomb.parent,)), limits=limits)
    watcher = DiskWatcher(cache.root)
    with pytest.raises(ArtifactError) as err:
        cache.fetch(target_for(f"file://{gib_bomb}", sha256_of(gib_bomb)), keep=(), timings=StageTimings())
    most = watcher.stop()
    assert err.value.reason == reason, err.value
    # the cache held the archive, never its 1 GiB of zeros; nothing is left behind
    assert most < gib_bomb.stat().st_size + (1 << 20), most
    assert [p for p in cache.root.rglob("*") if p.is_file()] == []


@pytest.mark.slow
def test_bombs_spread_over_members_and_file_floods_are_refused(tmp_path: Path) -> None:
    spread = zero_bomb(tmp_path / "spread.tar.gz", 200 << 20, members=20)  # 10 MiB each: below the ratio floor alone
    cache = DiskCache(tmp_path / "cache", 1 << 30, sources(file_roots=(tmp_path,)))
    with pytest.raises(ArtifactError) as err:
        cache.fetch(target_for(f"file://{spread}", sha256_of(spread)), keep=(), timings=StageTimings())
    assert err.value.reason == "CompressionRatioTooHigh"

    flood = zero_bomb(tmp_path / "flood.tar.gz", 70, members=70)
    with pytest.raises(ArtifactError) as err:
        cache.fetch(target_for(f"file://{flood}", sha256_of(flood), revision="v2"), keep=(), timings=StageTimings())
    assert err.value.reason == "TooManyFiles"
    assert [p for p in cache.root.rglob("*") if p.is_file()] == []


def test_a_real_adapter_archive_stays_within_the_limits(tmp_path: Path) -> None:
    archive = tar_dir(write_peft_dir(tmp_path / "src", rank=16), tmp_path / "a.tar.gz")
    cache = DiskCache(tmp_path / "cache", 1 << 30, sources(file_roots=(tmp_path,)),
                      limits=UnpackLimits(max_files=3, max_ratio=3.0, ratio_floor_bytes=0))
    entry = cache.fetch(target_for(f"file://{archive}", sha256_of(archive), rank=16), keep=(), timings=StageTimings())
    assert (entry.path / "adapter_model.safetensors").is_file()
