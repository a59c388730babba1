"""Peer membership under ``--peers kubernetes``: the serving pods of the sidecar's own policy (a fake pod list:
no API server here)."""

from __future__ import annotations

import pytest
from kvpool_sidecar.config import PolicySource, SidecarConfig
from kvpool_sidecar.service.membership import PolicyPeers, peer_members
from kvpool_sidecar.service.server import ServeError, ServeOptions, build_peers
from kvpool_sidecar.service.state import Sidecar
from kvpool_sidecar.storage import KVStorage, ModelShape
from support import CLUSTER_KEYS


def pod(name: str, ip: str | None, policy: str = "chat", phase: str = "Running", ready: bool = True,
        deleting: bool = False) -> dict:
    meta: dict = {"name": name, "labels": {"kvpool.dev/policy": policy, "app": "qwen"}}
    if deleting:
        meta["deletionTimestamp"] = "2026-12-07T00:00:00Z"
    status: dict = {"phase": phase, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
    if ip:
        status["podIP"] = ip
    return {"metadata": meta, "status": status}


PODS = [
    pod("me", "10.0.0.1"),  # this sidecar's own pod
    pod("a", "10.0.0.2"),
    pod("b", "10.0.0.3"),
    pod("starting", "10.0.0.4", ready=False),
    pod("pending", None, phase="Pending", ready=False),
    pod("leaving", "10.0.0.5", deleting=True),
    pod("failed", "10.0.0.6", phase="Failed", ready=False),
    pod("other-policy", "10.0.0.7", policy="batch"),
]


def test_members_are_the_serving_pods_of_the_policy_at_the_policys_peer_port_never_itself():
    assert peer_members(PODS, "chat", 8200, "me") == {("10.0.0.2", 8200), ("10.0.0.3", 8200)}
    assert peer_members(PODS, "batch", 8200, "me") == {("10.0.0.7", 8200)}
    assert peer_members(PODS, "none", 8200, "me") == frozenset()


def test_the_policy_is_the_config_in_forces_source_and_follows_its_reloads():
    asked = []

    def list_pods(namespace: str, selector: str) -> list[dict]:
        asked.append((namespace, selector))
        return PODS  # a server that ignores the selector: the label is checked again

    source: list[PolicySource | None] = [None]
    peers = PolicyPeers(lambda: source[0], 8200, namespace="own-ns", own_pod="me", list_pods=list_pods)
    assert peers.members() == frozenset() and asked == []  # no policy (the defaults, a hand-written file)
    source[0] = PolicySource(name="chat", namespace="llm")
    assert peers.members() == {("10.0.0.2", 8200), ("10.0.0.3", 8200)}
    source[0] = PolicySource(name="batch")  # a source naming no namespace: the pod's own
    assert peers.members() == {("10.0.0.7", 8200)}
    assert asked == [("llm", "kvpool.dev/policy=chat"), ("own-ns", "kvpool.dev/policy=batch")]


def test_peers_kubernetes_needs_the_peer_port_every_member_serves():
    sidecar = Sidecar(SidecarConfig(), 8, transfer_keys=CLUSTER_KEYS,
                      storage=KVStorage(ModelShape(1, 1, 4, "float32"), 16, pages=8))
    try:
        with pytest.raises(ServeError, match="--peers kubernetes: .*give --peer-port"):
            build_peers(ServeOptions(peers="kubernetes"), sidecar)
    finally:
        sidecar.close()
