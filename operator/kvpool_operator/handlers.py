"""kopf handlers: thin I/O around the pure render and status functions.

A pod takes a policy's config by the label ``kvpool.dev/policy: NAME`` (``POLICY_LABEL``), its sidecar
mounting the ConfigMap ``kvpool-NAME`` (an optional volume). Every valid policy writes that ConfigMap,
unless someone else's holds the name (:func:`kvpool_operator.render.ownership`); the operator lists the
policy's pods, surfaces those whose sidecar does not mount it, and reads each bound pod's sidecar
``/metrics`` (port ``METRICS_PORT``, at most ``SCRAPE_WORKERS`` at a time) to learn which config hash it
runs (:func:`kvpool_operator.status.config_hash_from_metrics`). Every handler run is counted and timed,
and each policy's pod counts exported, in :mod:`kvpool_operator.metrics`.

No finalizer: nothing has to happen before a policy goes. Its ConfigMap goes by garbage collection
(its ownerReference), and its pods keep their last config. kopf adds its finalizer for non-optional
delete handlers, timers and daemons: there are none, the periodic resync is the operator's own thread
(:class:`Resync`), and the finalizer older versions added (``FINALIZER``) kopf removes from each policy
at its next event (the resume at start-up included), so no policy waits on a stopped operator.
"""

from __future__ import annotations

import logging
import os
import threading
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import kopf
import kubernetes
from kubernetes.client.rest import ApiException
from kvpool_sidecar.config import (
    API_GROUP,
    API_VERSION,
    KIND,
    ConfigError,
    bound_to,
    policy_label_selector,
    validate_spec,
)

from kvpool_operator import metrics
from kvpool_operator.crd import PLURAL
from kvpool_operator.render import HASH_ANNOTATION, configmap_name, needs_update, ownership, render_configmap
from kvpool_operator.status import (
    bind,
    build_status,
    config_hash_from_metrics,
    now_iso,
    prompt_status,
    prompts_pinned_from_metrics,
    warnings,
)

METRICS_PORT = 9400
METRICS_TIMEOUT = 1.0  # seconds, per sidecar scrape
SCRAPE_WORKERS = 8  # sidecar scrapes in flight at once, per policy sync
RESYNC_SECONDS = 30.0
FINALIZER = f"{API_GROUP}/finalizer"  # what versions before schema 2 added: named so that kopf removes it

log = logging.getLogger("kvpool.operator")


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, logger: logging.Logger, **_: Any) -> None:
    settings.persistence.finalizer = FINALIZER
    settings.posting.level = logging.WARNING  # kopf posts an Event per handler run otherwise
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        kubernetes.config.load_incluster_config()
    else:
        try:
            kubernetes.config.load_kube_config()
        except (kubernetes.config.ConfigException, OSError):
            logger.warning("no in-cluster config and no kubeconfig: the kubernetes client keeps its defaults")
    RESYNC.start()


@kopf.on.cleanup()
def stop(**_: Any) -> None:
    RESYNC.stop()


def _core() -> kubernetes.client.CoreV1Api:
    return kubernetes.client.CoreV1Api()


def _policy_pods(namespace: str, name: str) -> list[dict[str, Any]]:
    """The pods of the namespace labelled for the policy (the label checked again: an emulator ignores it)."""
    api = _core()
    items = api.list_namespaced_pod(namespace, label_selector=policy_label_selector(name)).items
    pods = [api.api_client.sanitize_for_serialization(p) for p in items]
    return [pod for pod in pods if bound_to(pod, name)]


def _sidecar_metrics(pod: dict[str, Any]) -> str:
    """A pod's sidecar /metrics ("" when unreachable)."""
    ip = (pod.get("status") or {}).get("podIP")
    if not ip:
        return ""
    try:
        with urllib.request.urlopen(f"http://{ip}:{METRICS_PORT}/metrics", timeout=METRICS_TIMEOUT) as r:
            return r.read().decode()
    except OSError:
        return ""


def _scrape(pods: list[dict[str, Any]]) -> list[str]:
    if not pods:
        return []
    with ThreadPoolExecutor(max_workers=min(SCRAPE_WORKERS, len(pods))) as pool:
        return list(pool.map(_sidecar_metrics, pods))


def _apply_configmap(desired: dict[str, Any], policy: str, uid: str | None) -> tuple[bool, str]:
    """Create or update the policy's ConfigMap where it is the operator's; (owned, why not)."""
    api = _core()
    meta = desired["metadata"]
    try:
        existing = api.api_client.sanitize_for_serialization(
            api.read_namespaced_config_map(meta["name"], meta["namespace"])
        )
    except ApiException as exc:
        if exc.status != 404:
            raise
        api.create_namespaced_config_map(meta["namespace"], desired)
        return True, ""
    owned, why = ownership(existing, policy, uid)
    if owned and needs_update(existing, desired):
        api.patch_namespaced_config_map(meta["name"], meta["namespace"], desired)
    return owned, why


def _sync(name: str, namespace: str, meta: dict[str, Any], spec: dict[str, Any],
          previous: dict[str, Any]) -> dict[str, Any]:
    """Validate, write the ConfigMap (where the operator's), observe the pods; the new status. Raises
    ConfigError on an invalid spec (the ConfigMap is then left as it is)."""
    policy = validate_spec(spec)
    generation = int(meta.get("generation") or 0)
    desired = render_configmap(name, namespace, generation, policy, owner_uid=meta.get("uid"))
    owned, why = _apply_configmap(desired, name, meta.get("uid"))
    digest = desired["metadata"]["annotations"][HASH_ANNOTATION]
    binding = bind(name, _policy_pods(namespace, name))
    texts = _scrape(binding.targets)
    synced = [text for text in texts if config_hash_from_metrics(text) == digest]
    status = build_status(
        generation=generation, config_hash=digest if owned else previous.get("configHash"),
        configmap=configmap_name(name), valid=(True, "Validated", "ok"), owned=(owned, why), policy=name,
        misbound=binding.misbound, targets=len(binding.targets), synced=len(synced), previous=previous,
        prompts=prompt_status([p.name for p in policy.pinning.prompts],
                              [prompts_pinned_from_metrics(text) for text in synced]),
    )
    for reason, message in warnings(previous, status):
        _post_warning(namespace, name, meta.get("uid"), reason, message)
    return status


def _post_warning(namespace: str, name: str, uid: str | None, reason: str, message: str) -> None:
    """A Warning Event on the policy (from the handlers and the resync thread alike, so not kopf's)."""
    now = now_iso()
    event = {
        "metadata": {"name": f"{name}.{uuid.uuid4().hex[:16]}", "namespace": namespace},
        "involvedObject": {"apiVersion": f"{API_GROUP}/{API_VERSION}", "kind": KIND, "name": name,
                           "namespace": namespace, "uid": uid},
        "reason": reason, "message": message[:1024], "type": "Warning", "count": 1,
        "firstTimestamp": now, "lastTimestamp": now, "source": {"component": "kvpool-operator"},
    }
    try:
        _core().create_namespaced_event(namespace, event)
    except ApiException as exc:  # the status says it too: an Event lost is not worth a retry
        log.warning("could not post the %s event on %s/%s: %s", reason, namespace, name, exc.reason)


@kopf.on.create(API_GROUP, API_VERSION, PLURAL)
@kopf.on.update(API_GROUP, API_VERSION, PLURAL)
@kopf.on.resume(API_GROUP, API_VERSION, PLURAL)
def reconcile(body: kopf.Body, spec: kopf.Spec, meta: kopf.Meta, status: kopf.Status, name: str, namespace: str,
              patch: kopf.Patch, reason: kopf.Reason, logger: logging.Logger, **_: Any) -> None:
    handler = str(getattr(reason, "value", reason))  # create, update or resume
    with SEEN.lock_for((namespace, name)), metrics.handling(handler):  # one writer of a policy at a time
        previous = dict(status)
        try:
            new_status = _sync(name, namespace, dict(meta), dict(spec), previous)
        except ConfigError as exc:
            # The ConfigMap is left as it is: the sidecars keep the last valid config.
            metrics.invalid_spec(handler)
            kopf.warn(body, reason="InvalidSpec", message=str(exc))
            logger.warning("invalid spec: %s", exc)
            new_status = build_status(
                generation=int(meta.get("generation") or 0), config_hash=previous.get("configHash"),
                configmap=previous.get("configMap"), valid=(False, "InvalidSpec", str(exc)),
                targets=previous.get("targetPods", 0), synced=previous.get("syncedPods", 0), previous=previous,
            )
        patch.status.update(metrics.publish(namespace, name, new_status))


class Seen:
    """The policies as kopf's own watch last delivered them: what the resync walks, so that it makes no API
    call (and needs no grant) of its own to find them, in either mode."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._bodies: dict[tuple[str, str], dict[str, Any]] = {}
        self._writers: dict[tuple[str, str], threading.Lock] = {}

    def lock_for(self, key: tuple[str, str]) -> threading.Lock:
        """The lock each writer of a policy's ConfigMap, status or series holds (the handlers, the resync,
        a deletion's clean-up): one at a time, each from the policy as last seen."""
        with self._lock:
            return self._writers.setdefault(key, threading.Lock())

    def get(self, key: tuple[str, str]) -> dict[str, Any] | None:
        with self._lock:
            return self._bodies.get(key)

    def update(self, event: kopf.RawEvent) -> tuple[str, str]:
        body = dict(event.get("object") or {})
        meta = body.get("metadata") or {}
        key = (str(meta.get("namespace") or ""), str(meta.get("name") or ""))
        with self._lock:
            if event.get("type") == "DELETED":
                self._bodies.pop(key, None)
            else:
                self._bodies[key] = body
        return key

    def snapshot(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._bodies.values())


SEEN = Seen()


@kopf.on.event(API_GROUP, API_VERSION, PLURAL)
def seen(event: kopf.RawEvent, **_: Any) -> None:
    """Every watch event keeps :data:`SEEN` current; a deleted policy's series go with it (a watch event, not
    a delete handler: no finalizer)."""
    key = SEEN.update(event)
    if event.get("type") == "DELETED":
        with SEEN.lock_for(key):  # after a resync round that had begun on it
            metrics.forget(*key)


def resync_all() -> None:
    """Pods come and go and sidecars pick up configs at their own pace: every policy whose change the
    handlers have seen is synced again (its ConfigMap rewritten only where it drifted) and its status
    refreshed."""
    api = kubernetes.client.CustomObjectsApi()
    for listed in SEEN.snapshot():
        key = (str((listed.get("metadata") or {}).get("namespace") or ""),
               str((listed.get("metadata") or {}).get("name") or ""))
        with SEEN.lock_for(key):
            item = SEEN.get(key)  # as last seen now, not when the round began (a policy's sync takes seconds)
            if item is None:
                continue  # deleted meanwhile
            meta, status = item.get("metadata") or {}, item.get("status") or {}
            if meta.get("deletionTimestamp") or status.get("observedGeneration") != meta.get("generation"):
                continue  # going, or the change handler has yet to run on this generation
            namespace, name = key
            try:
                with metrics.handling("resync"):
                    try:
                        new_status = _sync(name, namespace, meta, item.get("spec") or {}, status)
                    except ConfigError:
                        metrics.invalid_spec("resync")  # still refused: counted at every resync until fixed
                        continue
                    written = api.patch_namespaced_custom_object_status(API_GROUP, API_VERSION, namespace, PLURAL,
                                                                        name, {"status": new_status})
                    if isinstance(written, dict):  # the next round starts from it, whether or not its event is in
                        SEEN.update({"type": "MODIFIED", "object": written})
                    metrics.publish(namespace, name, new_status)  # once written: a failed patch publishes nothing
            except Exception:  # counted by metrics.handling; the next policy and the next round go on
                log.exception("resync of %s/%s failed", namespace, name)


class Resync:
    """The periodic resync, a thread of the operator's own (a kopf timer would put a finalizer on every
    policy): :func:`resync_all` every ``RESYNC_SECONDS``."""

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="kvpool-resync", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(RESYNC_SECONDS):
            try:
                resync_all()
            except Exception:  # the policies could not be listed: try again next round
                log.exception("resync failed")

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)


RESYNC = Resync()
