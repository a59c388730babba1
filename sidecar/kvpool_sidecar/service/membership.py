"""Where a router's pods come from: a static list, or the Kubernetes API (the pods of a policy: those of
its namespace with the pod label ``kvpool.dev/policy: NAME``, :func:`~kvpool_sidecar.config.bound_to`).

A source answers the current members as ``{pod name: Endpoint}``: the engine URL requests are routed
to, and the pod's sidecar URL (page transfers for replica warm-ups). The router polls it; an error
keeps the last known members (an API hiccup must not empty the ring and move every key).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, Protocol

from kvpool_sidecar.config import bound_to, policy_label_selector

SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


class Endpoint(NamedTuple):
    url: str  # where the pod's requests go (the inference engine)
    sidecar_url: str  # the pod's kvpool sidecar API


class MembershipSource(Protocol):
    def members(self) -> dict[str, Endpoint]: ...


class StaticMembership:
    def __init__(self, pods: dict[str, Endpoint]) -> None:
        self._pods = dict(pods)

    def members(self) -> dict[str, Endpoint]:
        return dict(self._pods)


def _url(text: str, item: str) -> str:
    if not text.startswith(("http://", "https://")) or len(text) <= len("https://"):
        raise ValueError(f"--pod {item!r}: use name=http://engine:port[,http://sidecar:port]")
    return text.rstrip("/")


def parse_static(items: list[str]) -> dict[str, Endpoint]:
    """``name=ENGINE_URL[,SIDECAR_URL]`` items (``--pod`` flags); a clear error names the bad item."""
    pods: dict[str, Endpoint] = {}
    for item in items:
        name, sep, urls = item.partition("=")
        parts = urls.split(",")
        if not sep or not name or len(parts) > 2:
            raise ValueError(f"--pod {item!r}: use name=http://engine:port[,http://sidecar:port]")
        engine = _url(parts[0], item)
        sidecar = _url(parts[1], item) if len(parts) == 2 else engine
        if name in pods:
            raise ValueError(f"--pod {item!r}: pod {name!r} is listed twice")
        pods[name] = Endpoint(engine, sidecar)
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
    """The serving pods of ``namespace`` bound to ``policy`` (:func:`~kvpool_sidecar.config.bound_to`): the engine at
    ``http://<pod IP>:<port>``, the sidecar at ``http://<pod IP>:<sidecar_port>``.

    The label goes to the API server as ``labelSelector`` and is checked again here, so a server
    that ignores it (an emulator) gives the same answer.
    """

    namespace: str
    policy: str
    port: int = 8000
    sidecar_port: int = 8100
    list_pods: Callable[[str, str], list[dict[str, Any]]] | None = None

    def members(self) -> dict[str, Endpoint]:
        pods = (self.list_pods or _list_pods)(self.namespace, policy_label_selector(self.policy))
        out = {}
        for pod in pods:
            if bound_to(pod, self.policy) and is_serving(pod):
                ip = pod["status"]["podIP"]
                out[pod["metadata"]["name"]] = Endpoint(f"http://{ip}:{self.port}", f"http://{ip}:{self.sidecar_port}")
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
