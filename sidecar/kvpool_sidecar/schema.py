"""The config's schema version and the binding of a pod to a policy: the parts of the contract that name
themselves (API group, the pod label, the version a file was written for, the fields a version removed).
Plain Python only; :mod:`kvpool_sidecar.config` re-exports all of it."""

from __future__ import annotations

from typing import Any

from kvpool_sidecar.fields import ConfigError

API_GROUP = "kvpool.dev"
API_VERSION = "v1alpha1"
KIND = "KVCachePolicy"
# The one binding of a pod to a policy: the pod label ``kvpool.dev/policy: NAME``. The policy's ConfigMap
# (kvpool-NAME) is what that pod's sidecar mounts; the operator counts, and peer sidecars fetch from, the pods of
# the policy's namespace with this label (docs/upgrades.md, "Which config a pod gets").
POLICY_LABEL = f"{API_GROUP}/policy"


def bound_to(pod: dict[str, Any], policy: str) -> bool:
    """Whether a pod (a mapping, as the API serves it) is bound to ``policy``: its :data:`POLICY_LABEL` names it."""
    return ((pod.get("metadata") or {}).get("labels") or {}).get(POLICY_LABEL) == policy


def policy_label_selector(policy: str) -> str:
    """The ``labelSelector`` query of a policy's pods (checked again with :func:`bound_to` where a server may
    ignore it)."""
    return f"{POLICY_LABEL}={policy}"


# The config file's schema: one more each time the contract gains a field (always with a default, so that
# a file without it means what it meant before). The operator writes it into every file it renders; a
# sidecar reads files up to SCHEMA_SKEW versions either side of its own (docs/upgrades.md).
SCHEMA_VERSION = 2
SCHEMA_SKEW = 1
SCHEMA_KEY = "schemaVersion"
# Top-level fields each schema version removed, and why. A file of an older version (by at most SCHEMA_SKEW)
# is read without them; anywhere else such a field is refused naming this reason.
REMOVED_FIELDS: dict[int, dict[str, str]] = {
    2: {"selector": f"removed in schema version 2: a pod takes a policy's config by the pod label "
                    f"{POLICY_LABEL}: NAME (docs/upgrades.md)"},
}


def removal_reason(path: str) -> str | None:
    """Why a top-level field is refused, where a schema version removed it (:data:`REMOVED_FIELDS`)."""
    return next((removed[path] for removed in REMOVED_FIELDS.values() if path in removed), None)


def removed_since(version: int) -> set[str]:
    """The top-level fields removed by the schema versions after ``version``, up to this side's own."""
    return {name for v, removed in REMOVED_FIELDS.items() if version < v <= SCHEMA_VERSION for name in removed}


def schema_version_of(data: dict[str, Any]) -> int:
    """The schema version a config mapping was written for (unset: this side's own), refused naming
    ``schemaVersion`` when it is more than :data:`SCHEMA_SKEW` away from :data:`SCHEMA_VERSION`."""
    version = data.get(SCHEMA_KEY)
    if version is None:
        return SCHEMA_VERSION
    if type(version) is not int:
        raise ConfigError(SCHEMA_KEY, f"must be an integer, got {version!r}")
    low, high = SCHEMA_VERSION - SCHEMA_SKEW, SCHEMA_VERSION + SCHEMA_SKEW
    if not low <= version <= high:
        raise ConfigError(SCHEMA_KEY, f"{version} is {'newer' if version > high else 'older'} than this sidecar "
                          f"reads ({low} to {high}; its own is {SCHEMA_VERSION}): upgrade the "
                          f"{'sidecar' if version > high else 'operator'} (docs/upgrades.md)")
    return version
