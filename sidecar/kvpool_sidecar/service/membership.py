"""Where a router's pods come from: a static list, or the Kubernetes API (the pods of a policy).

A source answers the current members as ``{pod name: sidecar base URL}``. The router polls it; an
error keeps the last known members (an API hiccup must not empty the ring and move every key).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from kvpool_sidecar.config import LabelSelector

SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


class MembershipSource(Protocol):
    def members(self) -> dict[str, str]: ...


class StaticMembership:
    def __init__(self, pods: dict[str, str]) -> None:
        self._pods = dict(pods)

    def members(self) -> dict[str, str]:
        return dict(self._pods)


def parse_static(items: list[str]) -> dict[str, str]:
    """``name=url`` items (``--pod`` flags) as a member map; a clear error names the bad item."""
    pods: dict[str, str] = {}
    for item in items:
        name, sep, url = item.partition("=")
        if not sep or not name or not url.startswith(("http://", "https://")):
            raise ValueError(f"--pod {item!r}: use name=http://host:port")
        if name in pods:
            raise ValueError(f"--pod {item!r}: pod {name!r} is listed twice")
        pods[name] = url.rstrip("/")
    return pods


def is_serving(pod: dict[str, Any]) -> bool:
    """Running, Ready, with an IP, and not being deleted: a pod the router may send requests to."""
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    if meta.get("deletionTimestamp") or status.get("phase") != "Running" or not status.get("podIP"):
        return False
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])


@dataclass
class KubernetesMembership:
    """The serving pods of ``namespace`` that ``selector`` matches, each at ``http://<pod IP>:<port>``.

    The selector goes to the API server as ``labelSelector`` and is applied again here, so a server
    that ignores it (an emulator) gives the same answer.
    """

    namespace: str
    selector: LabelSelector
    port: int = 8000
    list_pods: Callable[[str, str], list[dict[str, Any]]] | None = None

    def members(self) -> dict[str, str]:
        pods = (self.list_pods or _list_pods)(self.namespace, self.selector.to_query())
        out = {}
        for pod in pods:
            labels = (pod.get("metadata") or {}).get("labels") or {}
            if self.selector.matches(labels) and is_serving(pod):
                out[pod["metadata"]["name"]] = f"http://{pod['status']['podIP']}:{self.port}"
        return out


def _list_pods(namespace: str, label_selector: str) -> list[dict[str, Any]]:
    import kubernetes

    api = kubernetes.client.CoreV1Api()
    items = api.list_namespaced_pod(namespace, label_selector=label_selector).items
    return [api.api_client.sanitize_for_serialization(p) for p in items]


def load_kube_config() -> None:
    """In-cluster credentials when running in a pod, else the local kubeconfig."""
    import kubernetes

    try:
        kubernetes.config.load_incluster_config()
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config()


def default_namespace() -> str | None:
    try:
        return SERVICE_ACCOUNT_NAMESPACE.read_text().strip() or None
    except OSError:
        return None
