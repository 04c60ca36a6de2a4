"""List + watch informers on the official ``kubernetes`` client, shared by the controller and the picker.

``Informer`` keeps a cache of one resource current with list + watch (resourceVersion, bookmarks, relist on
410 Gone) in a daemon thread; every change is applied on the event loop and reported to ``on_change`` (with the
kind of change and the object, so a caller can tell which of its work items the change concerns). The first list
is reported once as ``LISTED``; a later relist (after a broken watch) only as the changes it reveals.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
from collections.abc import Callable
from typing import Any

from kubernetes import watch
from kubernetes.client.exceptions import ApiException

log = logging.getLogger(__name__)

Key = tuple[str, str]
#: Called on the event loop after each change: ("ADDED" | "MODIFIED" | "DELETED" | "LISTED", the object or None).
OnChange = Callable[[str, "dict[str, Any] | None"], None]


def _rv(obj: dict[str, Any]) -> int | None:
    raw = obj.get("metadata", {}).get("resourceVersion")
    return int(raw) if isinstance(raw, str) and raw.isdigit() else None


def object_key(obj: dict[str, Any]) -> Key:
    """(namespace, name) of an object."""
    meta = obj.get("metadata", {})
    return meta.get("namespace") or "", meta["name"]


class Informer:
    """A cache of one resource kept current by list + watch (in a daemon thread; changes applied on the loop)."""

    def __init__(
        self,
        name: str,
        list_fn: Callable[..., Any],
        args: tuple[Any, ...],
        on_change: OnChange,
        watch_timeout: int = 60,
    ) -> None:
        self.name = name
        self.list_fn = list_fn
        self.args = args
        self.on_change = on_change
        self.watch_timeout = watch_timeout
        self.items: dict[Key, dict[str, Any]] = {}
        self.synced = asyncio.Event()
        self._stop = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._watch: watch.Watch | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start listing and watching (call on the event loop)."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name=f"informer-{self.name}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop watching."""
        self._stop.set()
        if self._watch is not None:
            self._watch.stop()

    def remember(self, obj: dict[str, Any]) -> None:
        """Cache an object the caller just wrote (its watch event, which reports the change, may come later), unless
        the cache is newer."""
        self._apply("MODIFIED", obj, notify=False)

    # -- loop side -----------------------------------------------------------------------------------------------
    def _replace(self, items: list[dict[str, Any]], list_rv: int | None = None) -> None:
        """A (re)list: the first one is reported as ``LISTED``; a relist only as the changes it reveals (a watch that
        broke and was listed again changes nothing the caller has to redo). A relist never takes the cache back
        behind what it held: an object cached with a newer resourceVersion than the listed one (or, where the list
        (taken at ``list_rv``) lacks it, than the list) stays; a list of thousands is taken over seconds, and the
        objects the caller wrote meanwhile (``remember``) would otherwise come back as they were before its write."""
        old = self.items
        listed = {object_key(o): o for o in items}
        for key, cached in old.items():
            cached_rv, got = _rv(cached), listed.get(key)
            if cached_rv is None:
                continue
            if got is None:
                if list_rv is not None and cached_rv > list_rv:
                    listed[key] = cached
            elif (got_rv := _rv(got)) is not None and got_rv < cached_rv:
                listed[key] = cached
        self.items = listed
        if not self.synced.is_set():
            self.synced.set()
            self.on_change("LISTED", None)
            return
        for key, obj in self.items.items():
            before = old.get(key)
            if before is None or _rv(before) != _rv(obj) or _rv(obj) is None:
                self.on_change("ADDED" if before is None else "MODIFIED", obj)
        for key in old.keys() - self.items.keys():
            self.on_change("DELETED", old[key])

    def _apply(self, kind: str, obj: dict[str, Any], notify: bool = True) -> None:
        key = object_key(obj)
        if kind == "DELETED":
            self.items.pop(key, None)
        else:
            cached = self.items.get(key)
            new_rv, old_rv = _rv(obj), _rv(cached) if cached else None
            if new_rv is not None and old_rv is not None and new_rv < old_rv:
                return
            self.items[key] = obj
        if notify:
            self.on_change(kind, obj)

    def _post(self, fn: Callable[..., None], *args: Any) -> None:
        assert self._loop is not None
        with contextlib.suppress(RuntimeError):  # the loop is closed: we are shutting down
            self._loop.call_soon_threadsafe(fn, *args)

    # -- thread side ---------------------------------------------------------------------------------------------
    def _run(self) -> None:
        backoff = 0.2
        resource_version: str | None = None
        last_status: int | None = None
        while not self._stop.is_set():
            try:
                if resource_version is None:
                    response = self.list_fn(*self.args, _preload_content=False)
                    listing = json.loads(response.data)
                    resource_version = listing["metadata"]["resourceVersion"]
                    self._post(self._replace, listing.get("items", []), _rv(listing))
                resource_version = self._watch_from(resource_version)
                backoff, last_status = 0.2, None
            except ApiException as exc:
                if exc.status == 410:
                    resource_version = None
                    continue
                # a resource whose CRD is not installed (404) is said once, then retried quietly
                quiet = exc.status == 404 and exc.status == last_status
                last_status = exc.status
                log.log(logging.DEBUG if quiet else logging.WARNING, "%s watch failed (%s); relisting in %.1fs",
                        self.name, exc.status, backoff)
                resource_version = None
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 10.0)
            except Exception as exc:
                log.warning("%s watch failed (%s); relisting in %.1fs", self.name, exc, backoff)
                resource_version = None
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 10.0)

    def _watch_from(self, resource_version: str) -> str | None:
        """Follow the watch until it ends; returns where to resume (None: relist)."""
        self._watch = watch.Watch()
        stream = self._watch.stream(
            self.list_fn, *self.args, resource_version=resource_version, allow_watch_bookmarks=True,
            timeout_seconds=self.watch_timeout, _request_timeout=self.watch_timeout + 10,
        )
        for event in stream:
            if self._stop.is_set():
                break
            kind, obj = event["type"], event["raw_object"]
            if kind == "ERROR":
                code = obj.get("code") if isinstance(obj, dict) else None
                if code == 410:
                    return None
                raise RuntimeError(f"watch error: {obj}")
            resource_version = obj.get("metadata", {}).get("resourceVersion", resource_version)
            if kind != "BOOKMARK":
                self._post(self._apply, kind, obj)
        return resource_version
