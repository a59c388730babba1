"""KMock's Kubernetes emulator, patched where kopf needs a real API server's behaviour.

See ../shared/notes/kubernetes-testing.md: objects get uid/resourceVersion/generation/creationTimestamp,
JSON-patches are applied (a failed ``test`` op answers 422, as kopf expects), and watches subscribe
before they list so that no change between the two is lost. Runs in its own thread on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import copy
import datetime
import itertools
import os
import threading
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from typing import Any

import attrs
import jsonpatch
import kmock
import kubernetes

VERBS = ["create", "delete", "get", "list", "patch", "update", "watch"]
RESOURCES = {
    "v1/namespaces": {"namespaced": False, "kind": "Namespace"},
    "v1/events": {"namespaced": True, "kind": "Event"},
    "v1/configmaps": {"namespaced": True, "kind": "ConfigMap"},
    "v1/pods": {"namespaced": True, "kind": "Pod"},
    "apiextensions.k8s.io/v1/customresourcedefinitions": {"namespaced": False, "kind": "CustomResourceDefinition"},
    "kvpool.dev/v1alpha1/kvcachepolicies": {"namespaced": True, "kind": "KVCachePolicy"},
}


@attrs.frozen
class PatchTestFailed(kmock.KubernetesError):
    status: int = 422
    reason: str = "Invalid"
    message: str = "the JSON-patch test operation failed"


def merge_diff(old: Any, new: Any) -> Any:
    """A merge patch turning ``old`` into ``new`` (None deletes a key)."""
    if not isinstance(old, dict) or not isinstance(new, dict):
        return new
    out = {k: None for k in old if k not in new}
    for k, v in new.items():
        if k not in old or old[k] != v:
            out[k] = merge_diff(old.get(k), v)
    return out


@attrs.define(kw_only=True)
class Emulator(kmock.KubernetesEmulator):
    _versions: Iterator[int] = attrs.field(factory=lambda: itertools.count(1), init=False)

    def _current(self, request: kmock.Request) -> dict[str, Any] | None:
        key = (request.resource, request.namespace, request.name)
        if key in self.objects and not self.objects[key].deleted:
            return copy.deepcopy(self.objects[key].raw)
        return None

    async def _handle(self, request: kmock.Request) -> Any:
        if request.resource is not None and request.action == kmock.action.CREATE and isinstance(request.data, dict):
            data = copy.deepcopy(request.data)
            meta = data.setdefault("metadata", {})
            meta.setdefault("uid", str(uuid.uuid4()))
            meta["resourceVersion"] = str(next(self._versions))
            meta.setdefault("generation", 1)
            meta.setdefault("creationTimestamp", datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"))
            object.__setattr__(request, "data", data)  # in place: a copy would lose the parsed routing
        elif request.resource is not None and request.action == kmock.action.UPDATE and request.name:
            current = self._current(request)
            if current is not None:
                if isinstance(request.data, list):  # JSON-patch
                    try:
                        new = jsonpatch.apply_patch(current, request.data)
                    except (jsonpatch.JsonPatchTestFailed, jsonpatch.JsonPatchConflict):
                        return await self._render_error(PatchTestFailed())
                    change = merge_diff(current, new)
                else:
                    change = copy.deepcopy(request.data) or {}
                if not isinstance(change.get("metadata"), dict):
                    change["metadata"] = {}
                change["metadata"]["resourceVersion"] = str(next(self._versions))
                if request.subresource != "status" and "spec" in change:
                    if _merged(current.get("spec"), change["spec"]) != current.get("spec"):
                        change["metadata"]["generation"] = int(current["metadata"].get("generation", 1)) + 1
                object.__setattr__(request, "data", change)
        try:
            return await super()._handle(request)
        except kmock.KubernetesError as exc:  # e.g. a 404 on a read: answer it, not a 500
            return await self._render_error(exc)

    async def _serve_watch(self, request: kmock.Request) -> AsyncIterator[Any]:
        yield b""
        bus = self._buses[request.resource]
        queue: asyncio.Queue[Any] = asyncio.Queue()

        async def pump() -> None:
            async for event in bus:
                await queue.put(event)

        pumping = asyncio.create_task(pump())  # subscribed before listing: nothing is lost
        await asyncio.sleep(0)
        try:
            async with self._lock:
                objs = [o for (res, ns, _), o in self.objects.items()
                        if res == request.resource and (request.namespace is None or ns == request.namespace)
                        and not o.deleted]
                events = [{"type": "ADDED", "object": o.raw} for o in objs]
            listed = {}
            for event in events:
                meta = event["object"].get("metadata", {})
                listed[(meta.get("namespace"), meta.get("name"))] = int(meta.get("resourceVersion") or 0)
                yield event
            while True:
                event = await queue.get()
                meta = event.get("object", {}).get("metadata", {})
                ns = meta.get("namespace")
                seen = listed.get((ns, meta.get("name")))
                if seen is not None and int(meta.get("resourceVersion") or 0) <= seen:
                    continue  # already sent by the listing: a real watch never repeats an event
                if request.namespace is None or ns == request.namespace:
                    yield event
        finally:
            pumping.cancel()


def _merged(old: Any, change: Any) -> Any:
    if not isinstance(old, dict) or not isinstance(change, dict):
        return change
    out = dict(old)
    for k, v in change.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = _merged(old.get(k), v)
    return out


@contextmanager
def running_emulator() -> Iterator[tuple[str, Emulator]]:
    """The emulator serving on 127.0.0.1 from a background thread; yields (url, emulator).

    kopf (through the test-only ``kube_login`` handler) and the kubernetes client both point at it
    for the duration.
    """
    emulator = Emulator()
    for key, info in RESOURCES.items():
        emulator.resources[key] = {**info, "verbs": VERBS}
    ready = threading.Event()
    stop: asyncio.Event | None = None
    box: dict[str, Any] = {}

    async def serve() -> None:
        nonlocal stop
        stop = asyncio.Event()
        async with kmock.Server(emulator) as server:
            box["url"] = str(server.url).rstrip("/")
            box["loop"] = asyncio.get_running_loop()
            ready.set()
            await stop.wait()

    thread = threading.Thread(target=lambda: asyncio.run(serve()), daemon=True)
    thread.start()
    if not ready.wait(10):
        raise RuntimeError("the emulator did not start")
    previous = os.environ.get("KVPOOL_TEST_KUBE_URL")
    os.environ["KVPOOL_TEST_KUBE_URL"] = box["url"]
    config = kubernetes.client.Configuration()
    config.host = box["url"]
    kubernetes.client.Configuration.set_default(config)
    try:
        yield box["url"], emulator
    finally:
        if previous is None:
            os.environ.pop("KVPOOL_TEST_KUBE_URL", None)
        else:
            os.environ["KVPOOL_TEST_KUBE_URL"] = previous
        box["loop"].call_soon_threadsafe(stop.set)  # type: ignore[union-attr]
        thread.join(timeout=10)
