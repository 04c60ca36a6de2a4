"""``loraplane.kube.Informer`` against a devcluster API server: a watch that has to resume from a resourceVersion the
server has compacted meanwhile gets 410 Gone; the informer lists again, and what it missed reaches ``on_change``."""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client as k8s
from kubernetes import config as k8s_config

from loraplane.devcluster import Cluster, ServerThread, write_kubeconfig
from loraplane.kube import Informer


@pytest.fixture
def server() -> Iterator[ServerThread]:
    with ServerThread(Cluster()) as running:
        yield running


def _pod(name: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"containers": [{"name": "engine", "image": "engine:1"}]}}


async def _until(predicate: Any, what: str, within: float = 20.0) -> None:
    """Wait for ``predicate()`` (checked on the event loop, where the informer applies its changes)."""
    deadline = asyncio.get_running_loop().time() + within
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


async def test_a_watch_gone_410_lists_again_and_reports_what_it_missed(server: ServerThread, tmp_path: Path) -> None:
    api = k8s_config.new_client_from_config(config_file=str(write_kubeconfig(tmp_path / "kubeconfig", server.url)))
    core = k8s.CoreV1Api(api)
    core.create_namespaced_pod("default", _pod("before"))
    lists, watches = [], []
    let_watch = threading.Event()
    let_watch.set()
    held = threading.Event()

    @functools.wraps(core.list_namespaced_pod)
    def list_pods(*args: Any, **kwargs: Any) -> Any:
        """The real list call; a watch waits while ``let_watch`` is clear (the informer is away meanwhile)."""
        (watches if kwargs.get("watch") else lists).append(kwargs.get("resource_version"))
        if kwargs.get("watch") and not let_watch.is_set():
            held.set()
            let_watch.wait(30)
        return core.list_namespaced_pod(*args, **kwargs)

    seen: list[tuple[str, str | None]] = []
    informer = Informer("pods", list_pods, ("default",),
                        lambda kind, obj: seen.append((kind, obj["metadata"]["name"] if obj else None)),
                        watch_timeout=1)
    informer.start()
    try:
        await asyncio.wait_for(informer.synced.wait(), 20)
        assert seen == [("LISTED", None)] and set(informer.items) == {("default", "before")}
        let_watch.clear()  # the watch running now ends (1 s); the next one waits
        assert await asyncio.to_thread(held.wait, 20)
        resume_from = watches[-1]
        core.create_namespaced_pod("default", _pod("after"))
        core.delete_namespaced_pod("before", "default")
        server.call(server.api.cluster.store.compact)  # the changes after resume_from are forgotten: 410 Gone
        let_watch.set()
        await _until(lambda: set(informer.items) == {("default", "after")}, "the informer to see the missed changes")
        assert seen[1:] == [("ADDED", "after"), ("DELETED", "before")]
        assert len(lists) == 2  # the first list and the one after 410
        # and the watch resumes from the new list, not the compacted version
        await _until(lambda: watches[-1] not in (resume_from, None), "a watch from the new list")
        assert int(watches[-1]) > int(resume_from)
    finally:
        informer.stop()
        api.close()


def _revision(name: str, rv: int, phase: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": "default", "resourceVersion": str(rv)}, "status": {"phase": phase}}


def test_a_relist_taken_before_the_callers_own_write_does_not_take_the_cache_back() -> None:
    """At 10,000 revisions a watch broke, the relist took seconds, and it brought back the statuses from before the
    controller's own patches (``remember``): the controller read them as written by someone else and restored its
    own, thousands of times (``bench controller``). A newer cached object stays; what the list reveals still counts."""
    seen: list[tuple[str, str | None, str | None]] = []
    informer = Informer("revisions", lambda *a, **k: None, (),
                        lambda kind, obj: seen.append((kind, obj and obj["metadata"]["name"],
                                                       obj and obj["status"]["phase"])))
    informer._replace([_revision("a", 10, "Verifying"), _revision("b", 11, "Verifying"),
                       _revision("gone", 12, "Stable")], 12)
    informer.remember(_revision("a", 20, "Stable"))  # the caller's patch
    informer.remember(_revision("new", 21, "Pending"))  # created after the list below was taken
    informer._replace([_revision("a", 10, "Verifying"), _revision("b", 15, "Canary")], 15)  # a list from rv 15
    assert {k[1]: o["status"]["phase"] for k, o in informer.items.items()} == {"a": "Stable", "b": "Canary",
                                                                               "new": "Pending"}
    assert seen[1:] == [("MODIFIED", "b", "Canary"), ("DELETED", "gone", "Stable")]
