"""Fixtures of the sidecar tests: a real HTTPS file server and a moto S3 server, both on loopback."""

from __future__ import annotations

import datetime
import http.server
import ipaddress
import shutil
import ssl
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from e2e.fixtures.processes import LOOPBACK, ManagedProcess, free_port, wait_for_port


def _self_signed(directory: Path) -> tuple[Path, Path]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "loraplane-test")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(LOOPBACK))]), False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return cert_path, key_path


@dataclass
class HttpsFiles:
    """Serves files from ``root`` over HTTPS; ``ca_file`` verifies its certificate."""

    root: Path
    port: int
    ca_file: Path

    def publish(self, file: Path, name: str | None = None) -> str:
        """Copy ``file`` into the served root; returns its https:// URI."""
        name = name or file.name
        shutil.copyfile(file, self.root / name)
        return f"https://{LOOPBACK}:{self.port}/{name}"


@pytest.fixture(scope="session")
def https_files(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpsFiles]:
    """A real HTTPS server (a thread of this process) with a self-signed certificate."""
    base = tmp_path_factory.mktemp("https")
    root = base / "files"
    root.mkdir()
    cert, key = _self_signed(base)

    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, directory=str(root), **kwargs)  # type: ignore[arg-type]

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer((LOOPBACK, 0), Handler)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield HttpsFiles(root, server.server_address[1], cert)
    finally:
        server.shutdown()
        server.server_close()


@dataclass
class S3Server:
    """A moto S3 server; ``client()`` is a boto3 client for it."""

    endpoint_url: str

    def client(self) -> object:
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint_url, region_name="us-east-1")


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """moto in server mode (the only S3 stand-in that installs here), a separate process on loopback."""
    moto = shutil.which("moto_server")
    if moto is None:
        pytest.skip("moto_server is not installed (pip install 'moto[s3,server]')")
    port = free_port()
    process = ManagedProcess([moto, "-H", LOOPBACK, "-p", str(port)], tmp_path_factory.mktemp("s3") / "moto.log")
    process.start()
    try:
        wait_for_port(port, proc=process.proc, timeout=30)
        yield S3Server(f"http://{LOOPBACK}:{port}")
    finally:
        process.stop()


@pytest.fixture(autouse=True)
def _aws_test_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
