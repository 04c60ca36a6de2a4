"""The disk cache against real sources: files, a real HTTPS server, a real OCI registry, moto S3."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from e2e.fixtures.registry import LOOPBACK_ALLOWANCE
from loraplane.api import adapter_digest
from loraplane.sidecar import peft
from loraplane.sidecar.artifacts import ArtifactError, ArtifactSources, SourceConfig
from loraplane.sidecar.cache import DiskCache, StageTimings
from tests.sidecar.adapters import (
    sha256_of,
    tar_dir,
    tar_with_member,
    target_for,
    write_peft_dir,
    write_weights,
)


def make_cache(tmp_path: Path, budget: int = 1 << 30, name: str = "cache", **config: object) -> DiskCache:
    config.setdefault("allow_internal", (LOOPBACK_ALLOWANCE,))
    sources = ArtifactSources(SourceConfig(file_roots=(tmp_path / "artifacts",), **config))  # type: ignore[arg-type]
    return DiskCache(tmp_path / name, budget, sources)


def cache_files(cache: DiskCache) -> list[Path]:
    return sorted(p for p in cache.root.rglob("*") if p.is_file())


@pytest.fixture
def artifacts(tmp_path: Path) -> Path:
    path = tmp_path / "artifacts"
    path.mkdir()
    return path


def test_safetensors_file_becomes_a_peft_dir(tmp_path: Path, artifacts: Path) -> None:
    weights = write_weights(artifacts / "w.safetensors", rank=8)
    target = target_for(f"file://{weights}", sha256_of(weights), size=weights.stat().st_size)
    cache = make_cache(tmp_path)
    timings = StageTimings()
    entry = cache.fetch(target, keep=(), timings=timings)
    info = peft.inspect(entry.path)
    assert info.rank == 8 and info.target_modules == {"q_proj", "v_proj"} and info.dtypes == {"float16"}
    assert entry.artifact_digest == target.artifact.digest
    assert entry.adapter_digest == adapter_digest(entry.path)
    assert (entry.path / "adapter_model.safetensors").read_bytes() == weights.read_bytes()
    assert timings.download is not None and timings.verify is not None and timings.unpack is not None
    assert cache.get(target.cache_key) == entry
    # a new cache over the same directory finds the entry again
    assert make_cache(tmp_path).get(target.cache_key) == entry


def test_tar_over_https_is_unpacked(tmp_path: Path, artifacts: Path, https_files) -> None:
    archive = tar_dir(write_peft_dir(tmp_path / "src", rank=16), tmp_path / "a.tar.gz")
    uri = https_files.publish(archive, "support-v1.tar.gz")
    target = target_for(uri, sha256_of(archive), rank=16)
    cache = make_cache(tmp_path, https_ca_file=str(https_files.ca_file))
    entry = cache.fetch(target, keep=(), timings=StageTimings())
    assert entry.artifact_digest == sha256_of(archive)
    assert entry.adapter_digest == adapter_digest(tmp_path / "src")
    assert peft.inspect(entry.path).rank == 16


def test_https_refuses_an_unknown_certificate(tmp_path: Path, artifacts: Path, https_files) -> None:
    weights = write_weights(artifacts / "w.safetensors")
    uri = https_files.publish(weights, "untrusted.safetensors")
    with pytest.raises(ArtifactError) as err:
        make_cache(tmp_path).fetch(target_for(uri, sha256_of(weights)), keep=(), timings=StageTimings())
    assert err.value.reason == "TransferFailed"


def test_oci_pull_and_tampered_layer(tmp_path: Path, artifacts: Path, oci_registry) -> None:
    weights = write_weights(artifacts / "adapter_model.safetensors", seed=1)
    uri = oci_registry.push("adapters/support", "v1", weights)
    cache = make_cache(tmp_path, oci_plain_http=frozenset({oci_registry.host}))
    timings = StageTimings()
    entry = cache.fetch(target_for(uri, sha256_of(weights)), keep=(), timings=timings)
    assert entry.artifact_digest == sha256_of(weights) and timings.resolve is not None

    # someone re-pushes other bytes under the same tag: the revision's digest no longer matches
    good_digest = sha256_of(weights)
    write_weights(weights, seed=2)
    oci_registry.push("adapters/support", "v2", weights)
    tampered = target_for(uri.replace(":v1", ":v2"), good_digest, revision="v2")
    with pytest.raises(ArtifactError) as err:
        cache.fetch(tampered, keep=(), timings=StageTimings())
    assert err.value.reason == "DigestMismatch"
    assert cache.get(tampered.cache_key) is None
    assert not list((cache.root / "tmp").iterdir())
    assert [p.name for p in (cache.root / "adapters").iterdir()] == [entry.path.name]


def test_s3_object(tmp_path: Path, artifacts: Path, s3_server) -> None:
    weights = write_weights(artifacts / "w.safetensors", seed=3)
    s3 = s3_server.client()
    s3.create_bucket(Bucket="adapters")
    s3.put_object(Bucket="adapters", Key="support/v1/adapter_model.safetensors", Body=weights.read_bytes())
    cache = make_cache(tmp_path, s3_endpoint_url=s3_server.endpoint_url)
    target = target_for("s3://adapters/support/v1/adapter_model.safetensors", sha256_of(weights))
    assert cache.fetch(target, keep=(), timings=StageTimings()).artifact_digest == sha256_of(weights)
    missing = target_for("s3://adapters/nothing/here", sha256_of(weights), revision="v2")
    with pytest.raises(ArtifactError, match="NoSuchKey"):
        cache.fetch(missing, keep=(), timings=StageTimings())


@pytest.mark.parametrize(
    ("uri", "reason"),
    [("file:///etc/hostname", "FileOutsideRoots"), ("file:///{artifacts}/../../etc/hostname", "InvalidUri")],
)
def test_file_uris_stay_below_their_roots(tmp_path: Path, artifacts: Path, uri: str, reason: str) -> None:
    target = target_for("file:///placeholder", "sha256:" + "0" * 64)
    target.artifact.uri = uri.format(artifacts=str(artifacts).lstrip("/"))
    with pytest.raises(ArtifactError) as err:
        make_cache(tmp_path).fetch(target, keep=(), timings=StageTimings())
    assert err.value.reason == reason


def test_symlink_out_of_the_root_is_refused(tmp_path: Path, artifacts: Path) -> None:
    (artifacts / "escape").symlink_to("/etc/hostname")
    target = target_for(f"file://{artifacts}/escape", "sha256:" + "0" * 64)
    with pytest.raises(ArtifactError) as err:
        make_cache(tmp_path).fetch(target, keep=(), timings=StageTimings())
    assert err.value.reason == "FileOutsideRoots"


@pytest.mark.parametrize(
    ("name", "link"),
    [("../evil", None), ("/abs/evil", None), ("adapter/link", "/etc/passwd"), ("plain.txt", None)],
)
def test_bad_archives_are_refused_and_leave_nothing(tmp_path: Path, artifacts: Path, name: str,
                                                    link: str | None) -> None:
    archive = tar_with_member(artifacts / "bad.tar", name, symlink_to=link)
    cache = make_cache(tmp_path)
    with pytest.raises(ArtifactError) as err:
        cache.fetch(target_for(f"file://{archive}", sha256_of(archive)), keep=(), timings=StageTimings())
    assert err.value.reason == "InvalidArtifact"
    assert cache_files(cache) == []


def test_size_and_garbage_are_refused(tmp_path: Path, artifacts: Path) -> None:
    garbage = artifacts / "garbage.bin"
    garbage.write_bytes(os.urandom(4096))
    cache = make_cache(tmp_path)
    with pytest.raises(ArtifactError) as err:
        cache.fetch(target_for(f"file://{garbage}", sha256_of(garbage)), keep=(), timings=StageTimings())
    assert err.value.reason == "InvalidArtifact"
    with pytest.raises(ArtifactError) as err:
        cache.fetch(target_for(f"file://{garbage}", sha256_of(garbage), size=100), keep=(), timings=StageTimings())
    assert err.value.reason == "ArtifactTooLarge"
    assert cache_files(cache) == []


def test_budget_evicts_least_recently_used_outside_the_target(tmp_path: Path, artifacts: Path) -> None:
    targets = []
    for i in range(4):
        weights = write_weights(artifacts / f"w{i}.safetensors", seed=i)
        targets.append(target_for(f"file://{weights}", sha256_of(weights), revision=f"v{i}"))
    entry_bytes = make_cache(tmp_path, name="probe").fetch(targets[0], keep=(), timings=StageTimings()).bytes
    cache = make_cache(tmp_path, budget=3 * entry_bytes)
    for t in targets[:3]:
        cache.fetch(t, keep=(), timings=StageTimings())
    cache.get(targets[0].cache_key)  # v0 used recently: v1 is the least recently used
    keep = {targets[2].cache_key, targets[3].cache_key}
    cache.fetch(targets[3], keep=keep, timings=StageTimings())
    assert set(cache.entries()) == {targets[0].cache_key, targets[2].cache_key, targets[3].cache_key}
    assert cache.total_bytes <= cache.budget_bytes

    everything = {t.cache_key for t in targets}
    fifth = write_weights(artifacts / "w5.safetensors", seed=5)
    with pytest.raises(ArtifactError) as err:
        cache.fetch(target_for(f"file://{fifth}", sha256_of(fifth), revision="v5"), keep=everything,
                    timings=StageTimings())
    assert err.value.reason == "CacheBudgetExceeded"
    assert len(cache.entries()) == 3


_SLOW_FETCH = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from loraplane.sidecar.artifacts import ArtifactSources, SourceConfig
    from loraplane.sidecar.cache import DiskCache, StageTimings
    from tests.sidecar.adapters import target_for

    class SlowSources(ArtifactSources):
        def fetch(self, uri, digest, sink, resolved):
            def slow_sink(chunk):
                for i in range(0, len(chunk), 4096):
                    sink(chunk[i:i + 4096])
                    print("progress", flush=True)
                    time.sleep(0.01)
            super().fetch(uri, digest, slow_sink, resolved)

    root, uri, digest = sys.argv[1:4]
    cache = DiskCache(Path(root), 1 << 30, SlowSources(SourceConfig(file_roots=(Path(uri[7:]).parent,))))
    cache.fetch(target_for(uri, digest), keep=(), timings=StageTimings())
    """
)


def test_killed_mid_download_leaves_no_entry(tmp_path: Path, artifacts: Path) -> None:
    weights = write_weights(artifacts / "big.safetensors", hidden=512, rank=16, layers=4)
    cache_root = tmp_path / "cache"
    proc = subprocess.Popen(
        [sys.executable, "-c", _SLOW_FETCH, str(cache_root), f"file://{weights}", sha256_of(weights)],
        stdout=subprocess.PIPE, cwd=Path(__file__).parents[2],
    )
    assert proc.stdout is not None
    for _ in range(5):
        assert proc.stdout.readline() == b"progress\n"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    partial = [p for p in (cache_root / "tmp").rglob("*") if p.is_file()]
    assert partial and 0 < partial[0].stat().st_size < weights.stat().st_size  # really killed mid-download
    assert not list((cache_root / "adapters").iterdir())

    cache = DiskCache(cache_root, 1 << 30, ArtifactSources(SourceConfig(file_roots=(artifacts,))))
    assert cache.entries() == {} and cache_files(cache) == []
    target = target_for(f"file://{weights}", sha256_of(weights))
    assert cache.fetch(target, keep=(), timings=StageTimings()).bytes > weights.stat().st_size


def test_entries_without_valid_metadata_are_dropped_at_start(tmp_path: Path, artifacts: Path) -> None:
    weights = write_weights(artifacts / "w.safetensors")
    cache = make_cache(tmp_path)
    entry = cache.fetch(target_for(f"file://{weights}", sha256_of(weights)), keep=(), timings=StageTimings())
    meta = entry.path / ".loraplane-entry.json"
    meta.write_text(json.dumps({**json.loads(meta.read_text()), "cache_key": "sha256:" + "1" * 64}))
    time.sleep(0)
    assert make_cache(tmp_path).entries() == {}
    assert not entry.path.exists()


def test_release_deletes_the_entries_of_retired_revisions_not_in_use(tmp_path: Path, artifacts: Path) -> None:
    weights = write_weights(artifacts / "w.safetensors")
    cache = make_cache(tmp_path)
    v1, v2 = (cache.fetch(target_for(f"file://{weights}", sha256_of(weights), revision=r), keep=(),
                          timings=StageTimings()) for r in ("v1", "v2"))
    assert cache.release({v1.served_name, v2.served_name}, in_use={v2.served_name}) == [v1]
    assert not v1.path.exists() and cache.get(v1.cache_key) is None
    assert v2.path.is_dir() and cache.get(v2.cache_key) == v2
    assert make_cache(tmp_path).get(v1.cache_key) is None  # gone from disk, not only from memory
