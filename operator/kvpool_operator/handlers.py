"""kopf handlers: thin I/O around the pure render and status functions.

The operator uses the official ``kubernetes`` client for ConfigMaps, pods and sibling policies, and
reads each target pod's sidecar ``/metrics`` (port ``METRICS_PORT``) to learn which config hash it
runs (see :func:`kvpool_operator.status.config_hash_from_metrics`). Every handler run is counted and
timed, and each policy's pod counts exported, in :mod:`kvpool_operator.metrics`.
"""

from __future__ import annotations

import logging
import os
import urllib.request
from typing import Any

import kopf
import kubernetes
from kubernetes.client.rest import ApiException
from kvpool_sidecar.config import API_GROUP, API_VERSION, ConfigError, KVCachePolicySpec, LabelSelector, validate_spec

from kvpool_operator import metrics
from kvpool_operator.crd import PLURAL
from kvpool_operator.render import configmap_name, needs_update, render_configmap
from kvpool_operator.status import (
    PolicyRef,
    build_status,
    config_hash_from_metrics,
    conflicting_policy,
    prompt_status,
    prompts_pinned_from_metrics,
    target_pods,
)

METRICS_PORT = 9400
METRICS_TIMEOUT = 1.0
RESYNC_SECONDS = 30.0


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, logger: logging.Logger, **_: Any) -> None:
    settings.persistence.finalizer = f"{API_GROUP}/finalizer"
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        kubernetes.config.load_incluster_config()
        return
    try:
        kubernetes.config.load_kube_config()
    except (kubernetes.config.ConfigException, OSError):
        logger.warning("no in-cluster config and no kubeconfig: the kubernetes client keeps its defaults")


def _core() -> kubernetes.client.CoreV1Api:
    return kubernetes.client.CoreV1Api()


def _pods(namespace: str) -> list[dict[str, Any]]:
    api = _core()
    return [api.api_client.sanitize_for_serialization(p) for p in api.list_namespaced_pod(namespace).items]


def _policies(namespace: str) -> list[PolicyRef]:
    api = kubernetes.client.CustomObjectsApi()
    items = api.list_namespaced_custom_object(API_GROUP, API_VERSION, namespace, PLURAL).get("items", [])
    refs = []
    for item in items:
        meta = item.get("metadata", {})
        if meta.get("deletionTimestamp"):
            continue  # on its way out (its delete handler runs with the finalizer): it no longer wins
        try:
            selector = LabelSelector.model_validate((item.get("spec") or {}).get("selector") or {})
        except ValueError:
            continue
        refs.append(PolicyRef(meta.get("name", ""), meta.get("creationTimestamp") or "", selector))
    return refs


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


def _apply_configmap(desired: dict[str, Any]) -> None:
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
        return
    if needs_update(existing, desired):
        api.patch_namespaced_config_map(meta["name"], meta["namespace"], desired)


@kopf.on.create(API_GROUP, API_VERSION, PLURAL)
@kopf.on.update(API_GROUP, API_VERSION, PLURAL)
@kopf.on.resume(API_GROUP, API_VERSION, PLURAL)
def reconcile(body: kopf.Body, spec: kopf.Spec, meta: kopf.Meta, status: kopf.Status, name: str, namespace: str,
              patch: kopf.Patch, reason: kopf.Reason, logger: logging.Logger, **_: Any) -> None:
    handler = str(getattr(reason, "value", reason))  # create, update or resume
    with metrics.handling(handler):
        generation = int(meta.get("generation") or 0)
        previous = dict(status)
        try:
            policy = validate_spec(dict(spec))
        except ConfigError as exc:
            # The ConfigMap is left as it is: the sidecars keep the last valid config.
            metrics.invalid_spec(handler)
            kopf.warn(body, reason="InvalidSpec", message=str(exc))
            logger.warning("invalid spec: %s", exc)
            patch.status.update(metrics.publish(namespace, name, build_status(
                generation=generation, config_hash=previous.get("configHash"), configmap=previous.get("configMap"),
                valid=(False, "InvalidSpec", str(exc)), conflict=None, targets=previous.get("targetPods", 0),
                synced=previous.get("syncedPods", 0), previous=previous,
            )))
            return
        patch.status.update(metrics.publish(namespace, name, _write_unless_superseded(
            name, namespace, meta, policy, generation, previous)))


def _write_unless_superseded(name: str, namespace: str, meta: kopf.Meta, policy: Any, generation: int,
                             previous: dict[str, Any]) -> dict[str, Any]:
    """Render and write the ConfigMap, unless an older policy selects some of the same pods: then the
    younger one writes nothing (its pods get one config, the older policy's) until the conflict is gone."""
    pods = _pods(namespace)
    me = PolicyRef(name, meta.get("creationTimestamp") or "", policy.selector)
    conflict = conflicting_policy(me, _policies(namespace), pods)
    if conflict is not None:
        return build_status(
            generation=generation, config_hash=previous.get("configHash"), configmap=previous.get("configMap"),
            valid=(True, "Validated", "ok"), conflict=conflict, targets=len(target_pods(policy.selector, pods)),
            synced=previous.get("syncedPods", 0), previous=previous,
        )
    desired = render_configmap(name, namespace, generation, policy, owner_uid=meta.get("uid"))
    _apply_configmap(desired)
    digest = desired["metadata"]["annotations"][f"{API_GROUP}/config-hash"]
    return _observe(name, namespace, meta, policy, generation, digest, previous)


def _in_conflict(status: dict[str, Any]) -> bool:
    return any(c.get("type") == "Conflict" and c.get("status") == "True" for c in status.get("conditions") or [])


def _observe(name: str, namespace: str, meta: kopf.Meta, policy: KVCachePolicySpec, generation: int, digest: str,
             previous: dict[str, Any]) -> dict[str, Any]:
    selector = policy.selector
    prompt_names = [prompt.name for prompt in policy.pinning.prompts]
    pods = _pods(namespace)
    targets = target_pods(selector, pods)
    me = PolicyRef(name, meta.get("creationTimestamp") or "", selector)
    conflict = conflicting_policy(me, _policies(namespace), pods)
    texts = [_sidecar_metrics(pod) for pod in targets]
    synced = [text for text in texts if config_hash_from_metrics(text) == digest]
    return build_status(
        generation=generation, config_hash=digest, configmap=configmap_name(name), valid=(True, "Validated", "ok"),
        conflict=conflict, targets=len(targets), synced=len(synced), previous=previous,
        prompts=prompt_status(prompt_names, [prompts_pinned_from_metrics(text) for text in synced]),
    )


@kopf.timer(API_GROUP, API_VERSION, PLURAL, interval=RESYNC_SECONDS, initial_delay=RESYNC_SECONDS)
def resync(spec: kopf.Spec, meta: kopf.Meta, status: kopf.Status, name: str, namespace: str, patch: kopf.Patch,
           **_: Any) -> None:
    """Pods come and go and sidecars pick up configs at their own pace: refresh the counts."""
    with metrics.handling("resync"):
        previous = dict(status)
        digest = previous.get("configHash")
        generation = int(meta.get("generation") or 0)
        in_conflict = _in_conflict(previous)
        if not in_conflict and previous.get("observedGeneration") != meta.get("generation"):
            return  # the change handler has yet to run on this generation
        try:
            policy = validate_spec(dict(spec))
        except ConfigError:
            metrics.invalid_spec("resync")  # still refused: counted at every resync until it is fixed
            return
        if in_conflict:  # the older policy may be gone: write the ConfigMap now if so
            new_status = _write_unless_superseded(name, namespace, meta, policy, generation, previous)
        elif digest:
            new_status = _observe(name, namespace, meta, policy, generation, digest, previous)
        else:
            return
        patch.status.update(metrics.publish(namespace, name, new_status))


@kopf.on.delete(API_GROUP, API_VERSION, PLURAL)
def delete(name: str, namespace: str, logger: logging.Logger, **_: Any) -> None:
    """Delete the ConfigMap explicitly (garbage collection through ownerReferences is a second net),
    then let the younger policies this one held back write theirs now rather than at the next resync."""
    with metrics.handling("delete"):
        try:
            _core().delete_namespaced_config_map(configmap_name(name), namespace)
        except ApiException as exc:
            if exc.status != 404:
                raise
        metrics.forget(namespace, name)
        _release_held_back(name, namespace, logger)


def _release_held_back(name: str, namespace: str, logger: logging.Logger) -> None:
    api = kubernetes.client.CustomObjectsApi()
    for item in api.list_namespaced_custom_object(API_GROUP, API_VERSION, namespace, PLURAL).get("items", []):
        meta, status = item.get("metadata", {}), item.get("status") or {}
        if meta.get("name") == name or meta.get("deletionTimestamp") or not _in_conflict(status):
            continue
        try:
            policy = validate_spec(item.get("spec") or {})
        except ConfigError:
            continue
        new_status = metrics.publish(namespace, meta["name"], _write_unless_superseded(
            meta["name"], namespace, meta, policy, int(meta.get("generation") or 0), status))
        api.patch_namespaced_custom_object_status(API_GROUP, API_VERSION, namespace, PLURAL, meta["name"],
                                                  {"status": new_status})
        logger.info("policy %s no longer held back by %s: its ConfigMap is written", meta["name"], name)
