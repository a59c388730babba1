"""Pure rendering: a validated policy -> the ConfigMap its sidecars mount, and whether the operator owns the
ConfigMap of that name it finds (it writes no other)."""

from __future__ import annotations

from typing import Any

import yaml
from kvpool_sidecar.config import (
    API_GROUP,
    API_VERSION,
    KIND,
    POLICY_LABEL,
    SCHEMA_KEY,
    SCHEMA_VERSION,
    KVCachePolicySpec,
    config_hash,
    spec_document,
)

CONFIG_KEY = "config.yaml"
HASH_ANNOTATION = f"{API_GROUP}/config-hash"
MANAGED_BY = ("app.kubernetes.io/managed-by", "kvpool-operator")  # the label of every ConfigMap it writes


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
        "labels": {MANAGED_BY[0]: MANAGED_BY[1], POLICY_LABEL: name},
        "annotations": {HASH_ANNOTATION: digest},
    }
    if owner_uid:
        metadata["ownerReferences"] = [
            {"apiVersion": f"{API_GROUP}/{API_VERSION}", "kind": KIND, "name": name, "uid": owner_uid,
             "controller": True, "blockOwnerDeletion": True}
        ]
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata, "data": {CONFIG_KEY: text}}


def needs_update(existing: dict[str, Any] | None, desired: dict[str, Any]) -> bool:
    """Whether the live ConfigMap differs from the desired one in what the sidecar reads, or lacks the
    desired owner (one adopted: see :func:`ownership`)."""
    if existing is None:
        return True
    owners = {ref.get("uid") for ref in (existing.get("metadata") or {}).get("ownerReferences") or []}
    wanted = {ref["uid"] for ref in desired["metadata"].get("ownerReferences") or []}
    return (existing.get("data") or {}).get(CONFIG_KEY) != desired["data"][CONFIG_KEY] or not wanted <= owners


def ownership(existing: dict[str, Any], policy: str, uid: str | None) -> tuple[bool, str]:
    """Whether the operator may write (and its policy's deletion may take) the ConfigMap ``kvpool-<policy>``
    it found, and why not. Its own: labelled ``app.kubernetes.io/managed-by: kvpool-operator``, and either
    owned by this policy's uid, or, with no controller at all, labelled for this policy (``kvpool.dev/policy``:
    one rendered without an owner, e.g. by ``kvpool-operator render``), which it then adopts. Anything else,
    a ConfigMap someone else made or one a deleted policy of the same name still controls (until the garbage
    collector takes it), is foreign: never overwritten nor deleted."""
    meta = existing.get("metadata") or {}
    name = meta.get("name") or configmap_name(policy)
    labels = meta.get("labels") or {}
    if labels.get(MANAGED_BY[0]) != MANAGED_BY[1]:
        return False, (f"ConfigMap {name} is not the operator's (no label {MANAGED_BY[0]}: {MANAGED_BY[1]}): it is "
                       "left as it is; rename or delete it, or rename the policy")
    refs = meta.get("ownerReferences") or []
    if uid and any(ref.get("uid") == uid for ref in refs):
        return True, ""
    controller = next((ref for ref in refs if ref.get("controller")), None)
    if controller is not None:
        return False, (f"ConfigMap {name} is controlled by {controller.get('kind')} {controller.get('name')} "
                       f"(uid {controller.get('uid')}), not this policy: a deleted policy's, until the garbage "
                       "collector takes it, or someone else's")
    if labels.get(POLICY_LABEL) != policy:
        return False, f"ConfigMap {name} is labelled for policy {labels.get(POLICY_LABEL)!r}, not {policy!r}"
    return True, ""
