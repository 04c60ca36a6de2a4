"""Fetch adapter artifacts from ``file://``, ``https://``, ``oci://`` and ``s3://`` as a stream of bytes.

A fetcher only moves bytes: it hands every chunk to a ``sink`` and says when the first byte is about to flow (the
end of the *resolve* stage: connection, redirects, manifest). Hashing, size limits and where the bytes land are
the disk cache's business (``loraplane.sidecar.cache``). Fetchers are blocking and run in worker threads.

Nothing a client sends reaches here: URIs come from AdapterRevision objects (validated by ``loraplane.api``). Still,
a revision's author may point it anywhere, so ``file://`` is refused outside the configured roots, schemes and hosts
pass allow-lists, and every host a fetch connects to (redirects and registry token realms included) is resolved and
refused when any of its addresses is internal (loopback, link-local, private, shared, reserved) unless explicitly
allowed. Connects and reads time out, and a whole fetch has a deadline.
"""

from __future__ import annotations

import fnmatch
import functools
import ipaddress
import socket
import ssl
import time
import urllib.parse
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import httpx
import requests.adapters

from loraplane.api import validation

CHUNK_BYTES = 1 << 20

Sink = Callable[[bytes], None]


class ArtifactError(Exception):
    """An artifact could not be fetched; ``reason`` is a CamelCase word for status reports."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


#: Reasons that refuse an artifact by policy (where it points, what it unpacks to): final for the revision.
REFUSAL_REASONS = frozenset({
    "InvalidUri", "SchemeNotAllowed", "FileOutsideRoots", "HostNotAllowed", "InternalAddress", "InsecureRedirect",
    "TooManyRedirects", "UnpackedTooLarge", "TooManyFiles", "CompressionRatioTooHigh",
})

Allowance = tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, int | None]


def parse_allowance(text: str) -> Allowance:
    """``CIDR``, ``ADDRESS:PORT``, ``CIDR:PORT`` or ``[IPv6 CIDR]:PORT`` -> (network, port or None for any port)."""
    network, port = validation.split_host_port(text.strip())
    return ipaddress.ip_network(network, strict=False), port


@dataclass(frozen=True)
class SourceConfig:
    """Where and how artifacts may be fetched."""

    file_roots: tuple[Path, ...] = ()
    oci_plain_http: frozenset[str] = frozenset()
    https_ca_file: str | None = None
    s3_endpoint_url: str | None = None
    #: schemes a revision may use (any of ``file``, ``https``, ``oci``, ``s3``)
    schemes: frozenset[str] = frozenset(validation.ALLOWED_URI_SCHEMES)
    #: host patterns (``registry.example.com``, ``*.example.com``; s3: bucket names) a URI may name; empty: any
    allowed_hosts: tuple[str, ...] = ()
    #: internal networks (``parse_allowance`` entries) that may be reached anyway, e.g. an in-cluster registry
    allow_internal: tuple[Allowance, ...] = ()
    connect_timeout_s: float = 10.0
    read_timeout_s: float = 30.0
    #: the longest one fetch (resolve, manifest, every byte) may take
    deadline_s: float = 900.0


def _internal(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return not address.is_global or address.is_multicast


class HostGuard:
    """Refuses hosts outside the allow-list and hosts with an internal address (each resolved address checked)."""

    def __init__(self, config: SourceConfig, resolve: Callable[..., Any] = socket.getaddrinfo) -> None:
        self._patterns = tuple(p.lower() for p in config.allowed_hosts)
        self._allow_internal = config.allow_internal
        self._resolve = resolve

    def check_name(self, host: str) -> None:
        """HostNotAllowed unless ``host`` matches the allow-list (when there is one)."""
        host = host.lower()
        if self._patterns and not any(fnmatch.fnmatchcase(host, p) for p in self._patterns):
            raise ArtifactError("HostNotAllowed", f"host {host} is not in the artifact host allow-list")

    def check(self, host: str, port: int) -> str:
        """The first address of ``host`` after checking the name and every address it resolves to."""
        self.check_name(host)
        try:
            infos = self._resolve(host, port, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError) as exc:
            raise ArtifactError("HostUnresolvable", f"cannot resolve {host}: {exc}") from None
        addresses = [ipaddress.ip_address(str(info[4][0]).partition("%")[0]) for info in infos]
        if not addresses:
            raise ArtifactError("HostUnresolvable", f"{host} has no address")
        for address in addresses:
            if _internal(address) and not any(
                address in network and allowed_port in (None, port) for network, allowed_port in self._allow_internal
            ):
                raise ArtifactError("InternalAddress", f"{host}:{port} resolves to internal address {address}, "
                                    "which artifacts may not be fetched from (see --artifact-allow-internal)")
        return str(addresses[0])

    def check_url(self, url: str) -> tuple[urllib.parse.SplitResult, str]:
        """Check an http(s) URL's host; returns its parts and the address to connect to."""
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ArtifactError("InsecureRedirect", f"{url} is not an http(s) URL")
        return parts, self.check(parts.hostname, parts.port or (443 if parts.scheme == "https" else 80))


class Deadline:
    """A sink wrapper refusing chunks once ``seconds`` have passed since the fetch began."""

    def __init__(self, seconds: float, sink: Sink, clock: Callable[[], float] = time.monotonic) -> None:
        self._ends = clock() + seconds
        self._seconds = seconds
        self._sink = sink
        self._clock = clock

    def check(self) -> None:
        """FetchDeadlineExceeded once the time is up."""
        if self._clock() > self._ends:
            raise ArtifactError("FetchDeadlineExceeded", f"the fetch took longer than {self._seconds:g} s")

    def __call__(self, chunk: bytes) -> None:
        self.check()
        self._sink(chunk)


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
    """``https://host/path``: TLS verified (against ``ca_file`` when given), redirects stay on https.

    Each hop's host is checked by the guard and the connection goes to the address it checked (the name stays the
    TLS server name and Host header), so a name that resolves differently a moment later cannot redirect it.
    """

    def __init__(self, ca_file: str | None, guard: HostGuard, timeout: httpx.Timeout) -> None:
        self._verify: ssl.SSLContext | bool = ssl.create_default_context(cafile=ca_file) if ca_file else True
        self._guard = guard
        self._timeout = timeout

    def fetch(self, uri: str, digest: str, sink: Sink, resolved: Callable[[], None]) -> None:
        """GET the URI and stream the body."""
        with httpx.Client(verify=self._verify, timeout=self._timeout, follow_redirects=False) as client:
            url = uri
            for _ in range(5):
                parts, address = self._guard.check_url(url)
                if parts.scheme != "https":
                    raise ArtifactError("InsecureRedirect", f"{uri} redirects to a non-https URL")
                with client.stream("GET", _pinned(url, address), headers={"host": parts.netloc.rpartition("@")[2]},
                                   extensions={"sni_hostname": parts.hostname}) as resp:
                    if resp.is_redirect:
                        url = urllib.parse.urljoin(url, resp.headers["location"])
                        continue
                    if resp.status_code != 200:
                        raise ArtifactError("HttpError", f"GET {uri}: HTTP {resp.status_code}")
                    _pump(resp.iter_bytes(), sink, resolved)  # chunks as they arrive
                    return
            raise ArtifactError("TooManyRedirects", f"{uri}: more than 5 redirects")


def _pinned(url: str, address: str) -> str:
    """``url`` with its host replaced by the checked ``address``."""
    parts = urllib.parse.urlsplit(url)
    userinfo, at, _ = parts.netloc.rpartition("@")
    host = f"[{address}]" if ":" in address else address
    return parts._replace(netloc=f"{userinfo}{at}{host}" + (f":{parts.port}" if parts.port else "")).geturl()


class _GuardedAdapter(requests.adapters.HTTPAdapter):
    """A requests transport that checks every request's host (redirects, token realms), connects to the address it
    checked (TLS server name and Host header keep the name) and sets timeouts."""

    def __init__(self, guard: HostGuard, timeout: tuple[float, float]) -> None:
        super().__init__(max_retries=0)
        self._guard = guard
        self._timeout = timeout
        self._addresses: dict[int, str] = {}

    def send(self, request: requests.PreparedRequest, *args: Any, **kwargs: Any) -> requests.Response:
        parts, address = self._guard.check_url(str(request.url))
        request.headers["Host"] = parts.netloc.rpartition("@")[2]
        kwargs["timeout"] = self._timeout
        self._addresses[id(request)] = address
        try:
            return super().send(request, *args, **kwargs)
        finally:
            self._addresses.pop(id(request), None)

    def build_connection_pool_key_attributes(self, request: requests.PreparedRequest, verify: Any,
                                             cert: Any = None) -> tuple[dict[str, Any], dict[str, Any]]:
        host_params, pool_kwargs = super().build_connection_pool_key_attributes(request, verify, cert)
        address = self._addresses.get(id(request))
        if address is not None and address != host_params["host"]:
            if host_params["scheme"] == "https":
                pool_kwargs["server_hostname"] = pool_kwargs["assert_hostname"] = host_params["host"]
            host_params["host"] = address
        return host_params, pool_kwargs


class OciFetcher:
    """``oci://registry/repository:tag`` (or ``@sha256:...``) through the ORAS client.

    The layer whose digest equals the revision's artifact digest is fetched; a manifest with one layer yields that
    layer (and a digest mismatch later, if it was replaced). ``plain_http`` names registries reached without TLS.
    """

    def __init__(self, plain_http: frozenset[str], guard: HostGuard, timeout: tuple[float, float]) -> None:
        self._plain_http = plain_http
        self._guard = guard
        self._timeout = timeout

    def fetch(self, uri: str, digest: str, sink: Sink, resolved: Callable[[], None]) -> None:
        """Read the manifest, choose the layer, stream its blob."""
        import oras.container

        ref = uri.removeprefix("oci://")
        container = oras.container.Container(ref)
        insecure = container.registry in self._plain_http
        self._guard.check_url(("http://" if insecure else "https://") + container.registry)
        client = _single_try_registry()(hostname=container.registry, insecure=insecure)
        adapter = _GuardedAdapter(self._guard, self._timeout)
        client.session.mount("http://", adapter)
        client.session.mount("https://", adapter)
        try:
            manifest = client.get_manifest(container)
        except ArtifactError:
            raise
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

    def __init__(self, endpoint_url: str | None, guard: HostGuard, timeout: tuple[float, float]) -> None:
        self._endpoint_url = endpoint_url
        self._guard = guard
        self._timeout = timeout
        self._client: Any = None

    def _s3(self) -> Any:
        if self._client is None:
            import boto3
            from botocore.config import Config

            config = Config(connect_timeout=self._timeout[0], read_timeout=self._timeout[1],
                            retries={"max_attempts": 1})
            self._client = boto3.client("s3", endpoint_url=self._endpoint_url, config=config)
        return self._client

    def fetch(self, uri: str, digest: str, sink: Sink, resolved: Callable[[], None]) -> None:
        """GetObject and stream the body (the endpoint is the operator's setting; the bucket must be allowed)."""
        bucket, _, key = uri.removeprefix("s3://").partition("/")
        if not key:
            raise ArtifactError("InvalidUri", f"{uri}: expected s3://bucket/key")
        self._guard.check_name(bucket)
        try:
            body = self._s3().get_object(Bucket=bucket, Key=key)["Body"]
        except Exception as exc:
            raise ArtifactError("S3Error", f"{uri}: {exc}") from exc
        with body:
            _pump(body.iter_chunks(CHUNK_BYTES), sink, resolved)


class ArtifactSources:
    """Dispatches a URI to the fetcher of its scheme."""

    def __init__(self, config: SourceConfig, resolve: Callable[..., Any] = socket.getaddrinfo) -> None:
        """``resolve``: ``socket.getaddrinfo`` or a stand-in with its signature (tests of name resolution)."""
        self.config = config
        guard = HostGuard(config, resolve)
        timeouts = (config.connect_timeout_s, config.read_timeout_s)
        self._fetchers: dict[str, Fetcher] = {
            "file": FileFetcher(config.file_roots),
            "https": HttpsFetcher(config.https_ca_file, guard,
                                  httpx.Timeout(config.read_timeout_s, connect=config.connect_timeout_s)),
            "oci": OciFetcher(config.oci_plain_http, guard, timeouts),
            "s3": S3Fetcher(config.s3_endpoint_url, guard, timeouts),
        }

    def fetch(self, uri: str, digest: str, sink: Sink, resolved: Callable[[], None]) -> None:
        """Stream ``uri`` into ``sink``; ArtifactError for a refused URI or a failed transfer."""
        if why := validation.explain_uri(uri):
            raise ArtifactError("InvalidUri", why)
        scheme = uri.partition("://")[0]
        if scheme not in self.config.schemes:
            raise ArtifactError("SchemeNotAllowed", f"{scheme}:// artifacts are not allowed on this sidecar "
                                f"(allowed: {', '.join(sorted(self.config.schemes))})")
        deadline = Deadline(self.config.deadline_s, sink)
        try:
            self._fetchers[scheme].fetch(uri, digest, deadline, resolved)
        except ArtifactError:
            raise
        except (httpx.HTTPError, requests.RequestException) as exc:
            raise ArtifactError("TransferFailed", f"{uri}: {exc}") from exc
        except OSError as exc:
            raise ArtifactError("TransferFailed", f"{uri}: {exc}") from exc
