"""Pure rendering: a validated policy -> the ConfigMap its sidecars mount."""

from __future__ import annotations

from typing import Any

import yaml
from kvpool_sidecar.config import (
    API_GROUP,
    API_VERSION,
    KIND,
    SCHEMA_KEY,
    SCHEMA_VERSION,
    KVCachePolicySpec,
    config_hash,
    spec_document,
)

CONFIG_KEY = "config.yaml"
HASH_ANNOTATION = f"{API_GROUP}/config-hash"


def configmap_name(policy_name: str) -> str:
    return f"kvpool-{policy_name}"


def config_document(name: str, namespace: str, generation: int, spec: KVCachePolicySpec) -> tuple[str, str]:
    """The sidecar config file and its hash: the spec as the user gave it (a sidecar fills in its own
    defaults, whatever its schema version), its source and the schema version it was written for."""
    document = spec_document(spec)
    digest = config_hash(document)
    # The source (with the hash) comes first: a file cut short keeps it, and then fails the sidecar's check.
    data = {"source": {"name": name, "namespace": namespace, "generation": generation, "hash": digest},
            SCHEMA_KEY: SCHEMA_VERSION, **document}
    return yaml.safe_dump(data, sort_keys=False), digest


def render_configmap(
    name: str, namespace: str, generation: int, spec: KVCachePolicySpec, owner_uid: str | None = None
) -> dict[str, Any]:
    text, digest = config_document(name, namespace, generation, spec)
    metadata: dict[str, Any] = {
        "name": configmap_name(name),
        "namespace": namespace,
        "labels": {"app.kubernetes.io/managed-by": "kvpool-operator", f"{API_GROUP}/policy": name},
        "annotations": {HASH_ANNOTATION: digest},
    }
    if owner_uid:
        metadata["ownerReferences"] = [
            {"apiVersion": f"{API_GROUP}/{API_VERSION}", "kind": KIND, "name": name, "uid": owner_uid,
             "controller": True, "blockOwnerDeletion": True}
        ]
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata, "data": {CONFIG_KEY: text}}


def needs_update(existing: dict[str, Any] | None, desired: dict[str, Any]) -> bool:
    """Whether the live ConfigMap differs from the desired one in what the sidecar reads."""
    if existing is None:
        return True
    return (existing.get("data") or {}).get(CONFIG_KEY) != desired["data"][CONFIG_KEY]
