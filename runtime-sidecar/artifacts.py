"""Fetch adapter artifacts from ``file://``, ``https://``, ``oci://`` and ``s3://`` as a stream of bytes.

A fetcher only moves bytes: it hands every chunk to a ``sink`` and says when the first byte is about to flow (the
end of the *resolve* stage: connection, redirects, manifest). Hashing, size limits and where the bytes land are
the disk cache's business (``loraplane.sidecar.cache``). Fetchers are blocking and run in worker threads.

Nothing a client sends reaches here: URIs come from AdapterRevision objects (validated by ``loraplane.api``), and
``file://`` is refused outside the configured roots.
"""

from __future__ import annotations

import functools
import ssl
import urllib.parse
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import httpx

from loraplane.api import validation

CHUNK_BYTES = 1 << 20

Sink = Callable[[bytes], None]


class ArtifactError(Exception):
    """An artifact could not be fetched; ``reason`` is a CamelCase word for status reports."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class SourceConfig:
    """Where and how artifacts may be fetched."""

    file_roots: tuple[Path, ...] = ()
    oci_plain_http: frozenset[str] = frozenset()
    https_ca_file: str | None = None
    s3_endpoint_url: str | None = None
    timeout_s: float = 60.0


class Fetcher(Protocol):
    """Streams one URI's bytes into ``sink``; calls ``resolved`` once, right before the first chunk."""

    def fetch(self, uri: str, digest: str, sink: Sink, resolved: Callable[[], None]) -> None: ...


def _pump(chunks: Iterable[bytes], sink: Sink, resolved: Callable[[], None]) -> None:
    resolved()
    for chunk in chunks:
        if chunk:
            sink(chunk)


class FileFetcher:
    """``file:///abs/path``: only below one of the configured roots, symlinks resolved first."""

    def __init__(self, roots: tuple[Path, ...]) -> None:
        self._roots = tuple(root.resolve() for root in roots)

    def path_of(self, uri: str) -> Path:
        """The local path a ``file://`` URI names, or ArtifactError when it is outside every root."""
        raw = urllib.parse.unquote(uri.removeprefix("file://"))
        path = Path(raw).resolve()
        if not any(path.is_relative_to(root) for root in self._roots):
            raise ArtifactError("FileOutsideRoots", f"{uri} is not below an allowed --file-root")
        if not path.is_file():
            raise ArtifactError("NotFound", f"{uri}: no such file")
        return path

    def fetch(self, uri: str, digest: str, sink: Sink, resolved: Callable[[], None]) -> None:
        """Read the file in chunks."""
        path = self.path_of(uri)
        with path.open("rb") as f:
            _pump(iter(lambda: f.read(CHUNK_BYTES), b""), sink, resolved)


class HttpsFetcher:
    """``https://host/path``: TLS verified (against ``ca_file`` when given), redirects stay on https."""

    def __init__(self, ca_file: str | None, timeout_s: float) -> None:
        self._verify: ssl.SSLContext | bool = ssl.create_default_context(cafile=ca_file) if ca_file else True
        self._timeout = timeout_s

    def fetch(self, uri: str, digest: str, sink: Sink, resolved: Callable[[], None]) -> None:
        """GET the URI and stream the body."""
        with httpx.Client(verify=self._verify, timeout=self._timeout, follow_redirects=False) as client:
            url = uri
            for _ in range(5):
                with client.stream("GET", url) as resp:
                    if resp.is_redirect:
                        url = str(resp.url.join(resp.headers["location"]))
                        if not url.startswith("https://"):
                            raise ArtifactError("InsecureRedirect", f"{uri} redirects to a non-https URL")
                        continue
                    if resp.status_code != 200:
                        raise ArtifactError("HttpError", f"GET {uri}: HTTP {resp.status_code}")
                    _pump(resp.iter_bytes(), sink, resolved)  # chunks as they arrive
                    return
            raise ArtifactError("TooManyRedirects", f"{uri}: more than 5 redirects")


class OciFetcher:
    """``oci://registry/repository:tag`` (or ``@sha256:...``) through the ORAS client.

    The layer whose digest equals the revision's artifact digest is fetched; a manifest with one layer yields that
    layer (and a digest mismatch later, if it was replaced). ``plain_http`` names registries reached without TLS.
    """

    def __init__(self, plain_http: frozenset[str]) -> None:
        self._plain_http = plain_http

    def fetch(self, uri: str, digest: str, sink: Sink, resolved: Callable[[], None]) -> None:
        """Read the manifest, choose the layer, stream its blob."""
        import oras.container

        ref = uri.removeprefix("oci://")
        container = oras.container.Container(ref)
        client = _single_try_registry()(hostname=container.registry, insecure=container.registry in self._plain_http)
        try:
            manifest = client.get_manifest(container)
        except Exception as exc:
            raise ArtifactError("ManifestUnavailable", f"{uri}: cannot read the manifest: {exc}") from exc
        layers = manifest.get("layers") or []
        chosen = next((layer for layer in layers if layer.get("digest") == digest), None)
        if chosen is None and len(layers) == 1:
            chosen = layers[0]
        if chosen is None:
            raise ArtifactError("LayerNotFound", f"{uri}: {len(layers)} layers and none has digest {digest}")
        with client.get_blob(container, chosen["digest"], stream=True) as resp:
            if resp.status_code != 200:
                raise ArtifactError("HttpError", f"{uri}: blob {chosen['digest']}: HTTP {resp.status_code}")
            _pump(resp.iter_content(CHUNK_BYTES), sink, resolved)


@functools.cache
def _single_try_registry() -> type[Any]:
    """ORAS's registry client without its built-in sleep-and-retry: the reconcile loop owns backoff."""
    import oras.provider

    class SingleTryRegistry(oras.provider.Registry):
        def do_request(self, *args: Any, **kwargs: Any) -> Any:
            return oras.provider.Registry.do_request.__wrapped__(self, *args, **kwargs)

    return SingleTryRegistry


class S3Fetcher:
    """``s3://bucket/key`` through boto3 (credentials from the usual AWS environment / files)."""

    def __init__(self, endpoint_url: str | None) -> None:
        self._endpoint_url = endpoint_url
        self._client: Any = None

    def _s3(self) -> Any:
        if self._client is None:
            import boto3

            self._client = boto3.client("s3", endpoint_url=self._endpoint_url)
        return self._client

    def fetch(self, uri: str, digest: str, sink: Sink, resolved: Callable[[], None]) -> None:
        """GetObject and stream the body."""
        bucket, _, key = uri.removeprefix("s3://").partition("/")
        if not key:
            raise ArtifactError("InvalidUri", f"{uri}: expected s3://bucket/key")
        try:
            body = self._s3().get_object(Bucket=bucket, Key=key)["Body"]
        except Exception as exc:
            raise ArtifactError("S3Error", f"{uri}: {exc}") from exc
        with body:
            _pump(body.iter_chunks(CHUNK_BYTES), sink, resolved)


class ArtifactSources:
    """Dispatches a URI to the fetcher of its scheme."""

    def __init__(self, config: SourceConfig) -> None:
        self.config = config
        self._fetchers: dict[str, Fetcher] = {
            "file": FileFetcher(config.file_roots),
            "https": HttpsFetcher(config.https_ca_file, config.timeout_s),
            "oci": OciFetcher(config.oci_plain_http),
            "s3": S3Fetcher(config.s3_endpoint_url),
        }

    def fetch(self, uri: str, digest: str, sink: Sink, resolved: Callable[[], None]) -> None:
        """Stream ``uri`` into ``sink``; ArtifactError for a refused URI or a failed transfer."""
        if why := validation.explain_uri(uri):
            raise ArtifactError("InvalidUri", why)
        scheme = uri.partition("://")[0]
        try:
            self._fetchers[scheme].fetch(uri, digest, sink, resolved)
        except ArtifactError:
            raise
        except httpx.HTTPError as exc:
            raise ArtifactError("TransferFailed", f"{uri}: {exc}") from exc
        except OSError as exc:
            raise ArtifactError("TransferFailed", f"{uri}: {exc}") from exc
