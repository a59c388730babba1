"""Who a sidecar's peers are under ``--peers kubernetes``: the pods of its KVCachePolicy.

The members are the pods of the policy's namespace labelled ``kvpool.dev/policy: NAME``
(:func:`~kvpool_sidecar.config.bound_to`), NAME and the namespace being the ``source`` of the config in force
(which the operator writes; a config without one, a hand-written file or the defaults before the policy's
ConfigMap appears, has no members), each at ``IP:port`` with the one peer port every pod of a policy serves
(``--peer-port``). Only Running, Ready pods with an IP that are not being deleted count, and never this
sidecar's own pod. :func:`peer_members` is the rule (pure); :class:`PolicyPeers` lists the pods through the
Kubernetes API. The caller polls it; an error keeps the last members (an API hiccup must not empty the set).
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvpool_sidecar.config import PolicySource, bound_to, policy_label_selector

KUBERNETES = "kubernetes"  # the --peers value that follows the policy's pods
SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


def is_serving(pod: dict[str, Any]) -> bool:
    """Running, Ready, with an IP, and not being deleted."""
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    if meta.get("deletionTimestamp") or status.get("phase") != "Running" or not status.get("podIP"):
        return False
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])


def peer_members(pods: Iterable[dict[str, Any]], policy: str, port: int, own_pod: str) -> frozenset[tuple[str, int]]:
    """The peer set of a sidecar of ``policy`` in pod ``own_pod``: ``(pod IP, port)`` of each serving pod bound
    to the policy, its own pod aside."""
    return frozenset((pod["status"]["podIP"], port) for pod in pods
                     if bound_to(pod, policy) and is_serving(pod) and pod["metadata"].get("name") != own_pod)


@dataclass
class PolicyPeers:
    """The peer set of the policy named by ``source()`` (the config in force's source), read from the API.

    The label goes to the API server as ``labelSelector`` and is checked again here, so a server that ignores
    it (an emulator) gives the same answer. ``namespace`` serves a source that names none.
    """

    source: Callable[[], PolicySource | None]
    port: int
    namespace: str | None = None
    own_pod: str = field(default_factory=socket.gethostname)  # a pod's hostname is its name
    list_pods: Callable[[str, str], list[dict[str, Any]]] | None = None

    def members(self) -> frozenset[tuple[str, int]]:
        source = self.source()
        if source is None or not source.name:
            return frozenset()
        namespace = source.namespace or self.namespace
        if not namespace:
            return frozenset()
        pods = (self.list_pods or _list_pods)(namespace, policy_label_selector(source.name))
        return peer_members(pods, source.name, self.port, self.own_pod)


def _list_pods(namespace: str, label_selector: str) -> list[dict[str, Any]]:
    import kubernetes

    api = kubernetes.client.CoreV1Api()
    items = api.list_namespaced_pod(namespace, label_selector=label_selector, _request_timeout=5).items
    return [api.api_client.sanitize_for_serialization(p) for p in items]


def load_kube_config() -> None:
    """In-cluster credentials when running in a pod, else the local kubeconfig."""
    import kubernetes

    try:
        kubernetes.config.load_incluster_config()
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config()


def default_namespace() -> str | None:
    """The namespace of the pod this runs in (its service account's), or None outside one."""
    try:
        return SERVICE_ACCOUNT_NAMESPACE.read_text().strip() or None
    except OSError:
        return None
