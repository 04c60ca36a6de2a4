"""The local disk cache (L2): verified, unpacked PEFT directories keyed by ``cache_key``, within a byte budget.

Layout under the cache root::

    tmp/                 downloads and unpacking in progress (wiped at start: a killed sidecar leaves no entry)
    adapters/<key hex>/  one complete entry: adapter_config.json, adapter_model.safetensors, ENTRY_META

An entry appears only by an atomic ``rename`` of a fully written, fsync'ed directory, after the artifact's sha256
matched the AdapterRevision's digest and its files were checked. A corrupt or mismatching artifact is deleted and
reported (ArtifactError), never renamed into place.

The artifact digest is the sha256 of the artifact exactly as fetched: the tar archive (plain or gzip), or the bare
``adapter_model.safetensors`` file. A bare safetensors artifact gets an ``adapter_config.json`` written from the
revision's LoraSpec. Each entry also records its ``adapter_digest`` (``loraplane.api.adapter_digest`` over the
entry's adapter_config.json and adapter_model.safetensors): the digest the engine reports for what it loaded.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tarfile
import tempfile
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import asdict, dataclass, field
from pathlib import Path

from loraplane.api import AdapterTarget
from loraplane.api.adapterfiles import adapter_digest_of
from loraplane.sidecar import peft
from loraplane.sidecar.artifacts import ArtifactError, ArtifactSources

ENTRY_META = ".loraplane-entry.json"


@dataclass
class StageTimings:
    """Seconds spent in each stage of bringing one adapter to its tier (None: the stage did not run)."""

    resolve: float | None = None
    download: float | None = None
    verify: float | None = None
    unpack: float | None = None
    disk_load: float | None = None
    h2d: float | None = None


@dataclass
class CacheEntry:
    """One verified adapter on local disk."""

    cache_key: str
    served_name: str
    artifact_digest: str
    adapter_digest: str
    artifact_uri: str
    bytes: int
    fetched_at: float
    path: Path = field(default=Path(), compare=False)


def _key_dir(cache_key: str) -> str:
    return cache_key.removeprefix("sha256:")


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    for path in (root, *root.rglob("*")):
        _fsync(path)


def sha256_hex(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


class _VerifyingWriter:
    """Writes chunks to a file while hashing them and enforcing a size limit; times the hashing."""

    def __init__(self, path: Path, max_bytes: int) -> None:
        self._file = path.open("wb")
        self._hash = hashlib.sha256()
        self._max = max_bytes
        self.bytes = 0
        self.hash_seconds = 0.0

    def write(self, chunk: bytes) -> None:
        self.bytes += len(chunk)
        if self.bytes > self._max:
            raise ArtifactError("ArtifactTooLarge", f"artifact exceeds {self._max} bytes")
        self._file.write(chunk)
        start = time.perf_counter()
        self._hash.update(chunk)
        self.hash_seconds += time.perf_counter() - start

    def finish(self) -> str:
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        return "sha256:" + self._hash.hexdigest()

    def close(self) -> None:
        self._file.close()


@dataclass(frozen=True)
class UnpackLimits:
    """What one archive may unpack to; checked from each member's header before its bytes are written."""

    max_bytes: int = 4 << 30
    max_files: int = 64
    #: unpacked bytes per archive byte, enforced once more than ``ratio_floor_bytes`` are unpacked (zip bombs)
    max_ratio: float = 100.0
    ratio_floor_bytes: int = 16 << 20


def _unpack_tar(archive: Path, dest: Path, limits: UnpackLimits) -> None:
    """Extract regular files and directories only; the PEFT files may sit at the top or in one subdirectory.

    The archive is read as a stream, one member at a time; a member whose header would take the archive past a
    limit is refused before any of its bytes are written, so a bomb is never unpacked.
    """
    staging = dest.with_name(dest.name + ".x")
    staging.mkdir()
    packed = max(1, archive.stat().st_size)
    unpacked = files = 0
    with tarfile.open(archive, "r|*") as tar:
        for member in tar:
            if not (member.isreg() or member.isdir()) or member.issparse():
                raise ArtifactError("InvalidArtifact", f"archive member {member.name!r} is not a regular file")
            files += 1
            unpacked += member.size
            if files > limits.max_files:
                raise ArtifactError("TooManyFiles", f"the archive holds more than {limits.max_files} members")
            if unpacked > limits.max_bytes:
                raise ArtifactError("UnpackedTooLarge", f"the archive unpacks to more than {limits.max_bytes} bytes")
            if unpacked > limits.ratio_floor_bytes and unpacked / packed > limits.max_ratio:
                raise ArtifactError("CompressionRatioTooHigh", f"the archive ({packed} bytes) unpacks to at least "
                                    f"{unpacked} bytes, more than {limits.max_ratio:g} times its size")
            tar.extract(member, staging, filter="data")
    found = [p.parent for p in staging.rglob(peft.CONFIG_FILE)]
    if len(found) != 1:
        raise ArtifactError("InvalidArtifact", f"archive holds {len(found)} {peft.CONFIG_FILE} files, expected 1")
    found[0].rename(dest)
    shutil.rmtree(staging)


def _write_config(target: AdapterTarget, dest: Path) -> None:
    spec = target.lora
    config = {
        "peft_type": "LORA",
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "use_rslora": spec.use_rslora,
        "target_modules": list(spec.target_modules),
        "bias": "none",
        "task_type": "CAUSAL_LM",
    }
    (dest / peft.CONFIG_FILE).write_text(json.dumps(config, indent=2))


class DiskCache:
    """Verified adapters on local disk within ``budget_bytes``. Blocking; call from worker threads."""

    def __init__(
        self,
        root: Path,
        budget_bytes: int,
        sources: ArtifactSources,
        clock: Callable[[], float] = time.time,
        on_evict: Callable[[CacheEntry], None] | None = None,
        limits: UnpackLimits | None = None,
    ) -> None:
        self.root = root
        self.limits = limits or UnpackLimits()
        self._on_evict = on_evict
        self.budget_bytes = budget_bytes
        self._sources = sources
        self._clock = clock
        self._lock = threading.Lock()
        self._tmp = root / "tmp"
        self._adapters = root / "adapters"
        shutil.rmtree(self._tmp, ignore_errors=True)
        self._tmp.mkdir(parents=True)
        self._adapters.mkdir(parents=True, exist_ok=True)
        self._entries: dict[str, CacheEntry] = {}
        self._last_used: dict[str, float] = {}
        for directory in self._adapters.iterdir():
            entry = self._read_entry(directory)
            if entry is None:
                shutil.rmtree(directory, ignore_errors=True)
            else:
                self._entries[entry.cache_key] = entry
                self._last_used[entry.cache_key] = (directory / ENTRY_META).stat().st_mtime

    @staticmethod
    def _read_entry(directory: Path) -> CacheEntry | None:
        try:
            meta = json.loads((directory / ENTRY_META).read_text())
            entry = CacheEntry(**meta, path=directory)
        except (OSError, ValueError, TypeError):
            return None
        if _key_dir(entry.cache_key) != directory.name or not (directory / peft.WEIGHTS_FILE).is_file():
            return None
        return entry

    @property
    def total_bytes(self) -> int:
        """Bytes held by complete entries."""
        with self._lock:
            return sum(e.bytes for e in self._entries.values())

    def entries(self) -> dict[str, CacheEntry]:
        """A snapshot of the complete entries, keyed by cache key."""
        with self._lock:
            return dict(self._entries)

    def get(self, cache_key: str) -> CacheEntry | None:
        """The entry for ``cache_key`` if it is on disk (and marks it used)."""
        with self._lock:
            entry = self._entries.get(cache_key)
            if entry is not None:
                self._last_used[cache_key] = self._clock()
            return entry

    def fetch(self, target: AdapterTarget, keep: Collection[str], timings: StageTimings) -> CacheEntry:
        """Download, verify, unpack and admit ``target``'s artifact; entries whose keys are in ``keep`` stay.

        Raises ArtifactError (with a reason) for anything that is not a good adapter; nothing partial remains.
        """
        if (entry := self.get(target.cache_key)) is not None:
            return entry
        expected = target.artifact.size_bytes
        self._make_room(expected or 0, keep)
        work = Path(tempfile.mkdtemp(dir=self._tmp))
        try:
            entry = self._download_and_unpack(target, work, timings)
            self._make_room(entry.bytes, keep)
            final = self._adapters / _key_dir(target.cache_key)
            shutil.rmtree(final, ignore_errors=True)
            (work / "entry").rename(final)
            _fsync(self._adapters)
            entry.path = final
            with self._lock:
                self._entries[entry.cache_key] = entry
                self._last_used[entry.cache_key] = self._clock()
            return entry
        finally:
            shutil.rmtree(work, ignore_errors=True)

    def _download_and_unpack(self, target: AdapterTarget, work: Path, timings: StageTimings) -> CacheEntry:
        artifact = target.artifact
        blob = work / "artifact"
        limit = artifact.size_bytes or self.budget_bytes
        writer = _VerifyingWriter(blob, limit)
        started = time.perf_counter()
        first_byte = started

        def resolved() -> None:
            nonlocal first_byte
            first_byte = time.perf_counter()
            timings.resolve = first_byte - started

        try:
            self._sources.fetch(artifact.uri, artifact.digest, writer.write, resolved)
            digest = writer.finish()
        finally:
            writer.close()
        timings.download = time.perf_counter() - first_byte - writer.hash_seconds
        timings.verify = writer.hash_seconds
        if artifact.size_bytes is not None and writer.bytes != artifact.size_bytes:
            raise ArtifactError("SizeMismatch", f"artifact is {writer.bytes} bytes, expected {artifact.size_bytes}")
        if digest != artifact.digest:
            raise ArtifactError("DigestMismatch", f"artifact sha256 is {digest}, expected {artifact.digest}")
        start = time.perf_counter()
        entry_dir = work / "entry"
        if peft.looks_like_safetensors(blob):
            entry_dir.mkdir()
            blob.rename(entry_dir / peft.WEIGHTS_FILE)
            _write_config(target, entry_dir)
            weights_hex = digest.removeprefix("sha256:")
        else:
            try:
                is_tar = tarfile.is_tarfile(blob)
            except OSError:
                is_tar = False
            if not is_tar:
                raise ArtifactError("InvalidArtifact", "artifact is neither a tar archive nor a safetensors file")
            try:
                _unpack_tar(blob, entry_dir, self.limits)
            except (tarfile.TarError, OSError) as exc:
                raise ArtifactError("InvalidArtifact", f"cannot unpack the archive: {exc}") from exc
            blob.unlink()
            weights_path = entry_dir / peft.WEIGHTS_FILE
            if not weights_path.is_file():
                raise ArtifactError("InvalidArtifact", f"the archive has no {peft.WEIGHTS_FILE}")
            weights_hex = sha256_hex(weights_path)
        try:
            peft.inspect(entry_dir)
        except peft.InvalidAdapter as exc:
            raise ArtifactError("InvalidArtifact", str(exc)) from exc
        size = sum(p.stat().st_size for p in entry_dir.rglob("*") if p.is_file())
        entry = CacheEntry(
            cache_key=target.cache_key,
            served_name=target.served_name,
            artifact_digest=digest,
            adapter_digest=adapter_digest_of(
                {peft.CONFIG_FILE: sha256_hex(entry_dir / peft.CONFIG_FILE), peft.WEIGHTS_FILE: weights_hex}
            ),
            artifact_uri=artifact.uri,
            bytes=size,
            fetched_at=self._clock(),
        )
        meta = {k: v for k, v in asdict(entry).items() if k != "path"}
        (entry_dir / ENTRY_META).write_text(json.dumps(meta))
        _fsync_tree(entry_dir)
        timings.unpack = time.perf_counter() - start
        return entry

    def _evict(self, needed: int, keep: Collection[str]) -> tuple[list[CacheEntry], int]:
        """Remove least recently used entries outside ``keep`` until ``needed`` more bytes fit the budget.

        Returns the removed entries and the bytes still held.
        """
        with self._lock:
            total = sum(e.bytes for e in self._entries.values())
            victims = sorted((k for k in self._entries if k not in keep), key=lambda k: self._last_used.get(k, 0))
            victim_entries = [self._entries[k] for k in victims]
        removed = []
        for entry in victim_entries:
            if total + needed <= self.budget_bytes:
                break
            total -= entry.bytes
            self.remove(entry.cache_key)
            removed.append(entry)
            if self._on_evict is not None:
                self._on_evict(entry)
        return removed, total

    def _make_room(self, needed: int, keep: Collection[str]) -> None:
        _, total = self._evict(needed, keep)
        if total + needed > self.budget_bytes:
            raise ArtifactError(
                "CacheBudgetExceeded",
                f"{needed} bytes do not fit the disk cache budget of {self.budget_bytes} bytes "
                f"({total} bytes held by adapters in the target state)",
            )

    def release(self, served_names: Collection[str], in_use: Collection[str]) -> list[CacheEntry]:
        """Delete the entries of ``served_names`` (revisions being deleted) except those ``in_use``; returns them."""
        doomed = [e for e in self.entries().values() if e.served_name in served_names and e.served_name not in in_use]
        for entry in doomed:
            self.remove(entry.cache_key)
        return doomed

    def evict_unused(self, keep: Collection[str]) -> list[CacheEntry]:
        """Bring the cache within budget by removing entries outside ``keep``; returns what was removed."""
        return self._evict(0, keep)[0]

    def remove(self, cache_key: str) -> None:
        """Delete one entry (its directory is first renamed away, so a crash never leaves half an entry)."""
        with self._lock:
            entry = self._entries.pop(cache_key, None)
            self._last_used.pop(cache_key, None)
        if entry is None:
            return
        doomed = Path(tempfile.mkdtemp(dir=self._tmp)) / "doomed"
        with contextlib.suppress(OSError):
            entry.path.rename(doomed)
        shutil.rmtree(doomed.parent, ignore_errors=True)
