"""Pure status logic: which pods a policy binds, conditions, synced pods, the Warning Events to post."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from kvpool_sidecar.config import POLICY_LABEL, bound_to

from kvpool_operator.render import configmap_name

_HASH_METRIC = re.compile(r'^kvpool_config_info\{[^}]*hash="([0-9a-f]+)"[^}]*\}\s+1(\.0)?\s*$', re.MULTILINE)

SIDECAR_CONTAINER = "kvpool-sidecar"  # the sidecar's container name, in containers or initContainers
CONFIG_DIR = "/etc/kvpool"  # where the sidecar mounts its policy's ConfigMap
NAMED_PODS = 3  # mis-bound pods a condition's message names; it counts the rest
# Conditions whose turning False (or changing message while False) posts a Warning Event.
WARNED_CONDITIONS = ("ConfigMapOwned", "Bound")


def now_iso() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


MAX_CONDITION_MESSAGE = 32768  # metav1.Condition's bound on a message


def condition(kind: str, ok: bool, reason: str, message: str, previous: list[dict[str, Any]] | None = None,
              at: str | None = None) -> dict[str, Any]:
    """A condition (metav1.Condition's fields but observedGeneration, which build_status sets); lastTransitionTime
    moves only when the status flips."""
    status = "True" if ok else "False"
    when = at or now_iso()
    for old in previous or []:
        if old.get("type") == kind and old.get("status") == status:
            when = old.get("lastTransitionTime", when)
    return {"type": kind, "status": status, "reason": reason, "message": message[:MAX_CONDITION_MESSAGE],
            "lastTransitionTime": when}


def _name(pod: dict[str, Any]) -> str:
    return str((pod.get("metadata") or {}).get("name") or "")


def mounted_configmaps(pod: dict[str, Any]) -> list[str] | None:
    """The ConfigMaps the pod's ``kvpool-sidecar`` container mounts at ``/etc/kvpool`` (a configMap or a
    projected volume); None when the pod has no such container."""
    spec = pod.get("spec") or {}
    containers = [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]
    sidecar = next((c for c in containers if c.get("name") == SIDECAR_CONTAINER), None)
    if sidecar is None:
        return None
    mounts = [m.get("name") for m in sidecar.get("volumeMounts") or []
              if str(m.get("mountPath") or "").rstrip("/") == CONFIG_DIR]
    names = []
    for volume in spec.get("volumes") or []:
        if volume.get("name") not in mounts:
            continue
        if (volume.get("configMap") or {}).get("name"):
            names.append(volume["configMap"]["name"])
        for source in (volume.get("projected") or {}).get("sources") or []:
            if (source.get("configMap") or {}).get("name"):
                names.append(source["configMap"]["name"])
    return names


def binding_problem(pod: dict[str, Any], policy: str) -> str | None:
    """What keeps a pod labelled for ``policy`` from taking its config (None: nothing): its sidecar must
    mount the policy's ConfigMap at /etc/kvpool."""
    names = mounted_configmaps(pod)
    if names is None:
        return f"has no {SIDECAR_CONTAINER} container"
    if configmap_name(policy) in names:
        return None
    if names:
        return f"its {SIDECAR_CONTAINER} mounts ConfigMap {names[0]} at {CONFIG_DIR}"
    return f"its {SIDECAR_CONTAINER} mounts no ConfigMap at {CONFIG_DIR}"


def is_running(pod: dict[str, Any]) -> bool:
    """Running and not being deleted: a pod that counts for Ready."""
    return not (pod.get("metadata") or {}).get("deletionTimestamp") and \
        (pod.get("status") or {}).get("phase") == "Running"


def _is_live(pod: dict[str, Any]) -> bool:
    """Pending or Running, not being deleted: a pod whose binding is checked."""
    return not (pod.get("metadata") or {}).get("deletionTimestamp") and \
        (pod.get("status") or {}).get("phase", "Pending") in ("Pending", "Running")


@dataclass(frozen=True)
class Binding:
    """A policy's pods: ``targets`` (Running, bound, counted for Ready) and ``misbound`` ((pod, problem) of
    the live pods labelled for the policy whose sidecar does not mount its ConfigMap)."""

    targets: list[dict[str, Any]] = field(default_factory=list)
    misbound: list[tuple[str, str]] = field(default_factory=list)


def bind(policy: str, pods: Iterable[dict[str, Any]]) -> Binding:
    """The one rule of which pods a policy has: those labelled ``kvpool.dev/policy: <policy>``."""
    targets, misbound = [], []
    for pod in pods:
        if not bound_to(pod, policy) or not _is_live(pod):
            continue
        problem = binding_problem(pod, policy)
        if problem is not None:
            misbound.append((_name(pod), problem))
        elif is_running(pod):
            targets.append(pod)
    return Binding(targets, sorted(misbound))


def misbound_message(policy: str, misbound: list[tuple[str, str]]) -> str:
    named = "; ".join(f"{pod} ({problem})" for pod, problem in misbound[:NAMED_PODS])
    more = f"; and {len(misbound) - NAMED_PODS} more" if len(misbound) > NAMED_PODS else ""
    return (f"{len(misbound)} pod(s) labelled {POLICY_LABEL}={policy} do not take its config (their "
            f"{SIDECAR_CONTAINER} must mount ConfigMap {configmap_name(policy)} at {CONFIG_DIR}): {named}{more}")


def config_hash_from_metrics(text: str) -> str | None:
    """The config hash a sidecar runs, from its /metrics (``kvpool_config_info{hash=...} 1``).

    How the operator learns which pods are synced: it reads the sidecars' metrics endpoint, which is
    meant to be reachable in-cluster anyway; no extra RBAC, no pod patching by the sidecar.
    """
    match = _HASH_METRIC.search(text)
    return match.group(1) if match else None


_PROMPT_METRIC = re.compile(
    r'^kvpool_named_prompt_pages\{(?=[^}]*kind="(pinned|total)")(?=[^}]*prompt="([^"]+)")[^}]*\}\s+(\S+)\s*$',
    re.MULTILINE)


def prompts_pinned_from_metrics(text: str) -> set[str]:
    """The named prompts a sidecar holds wholly pinned, from its /metrics
    (``kvpool_named_prompt_pages{prompt=...,kind=pinned|total}``)."""
    pages: dict[str, dict[str, float]] = {}
    for kind, name, value in _PROMPT_METRIC.findall(text):
        try:
            pages.setdefault(name, {})[kind] = float(value)
        except ValueError:
            continue
    return {name for name, v in pages.items() if 0 < v.get("total", 0) <= v.get("pinned", -1)}


def prompt_status(names: list[str], pinned_by_pod: list[set[str]]) -> list[dict[str, Any]]:
    """Each named prompt and the pods (of those read) that hold all of it pinned."""
    return [{"name": name, "pinnedPods": sum(name in pod for pod in pinned_by_pod)} for name in names]


def build_status(
    *, generation: int, config_hash: str | None, configmap: str | None, valid: tuple[bool, str, str],
    targets: int, synced: int, owned: tuple[bool, str] | None = None, policy: str = "",
    misbound: list[tuple[str, str]] | None = None, previous: dict[str, Any] | None = None,
    prompts: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The policy's status. ``owned`` (whether its ConfigMap is the operator's, and why not) and ``misbound``
    left None were not looked at this time (an invalid spec): their conditions stay as they were."""
    prev = (previous or {}).get("conditions") or []
    ok, reason, message = valid
    conditions = [condition("Valid", ok, reason, message, prev)]
    if owned is not None:
        conditions.append(condition("ConfigMapOwned", owned[0], "Owned" if owned[0] else "ForeignConfigMap",
                                    owned[1] or f"the operator writes {configmap}", prev))
    if misbound is not None:
        conditions.append(condition("Bound", not misbound, "PodsMisbound" if misbound else "PodsBound",
                                    misbound_message(policy, misbound) if misbound else
                                    f"every pod labelled {POLICY_LABEL}={policy} mounts {configmap}", prev))
    kept = {c["type"] for c in conditions} | {"Ready"}
    carried = [c for c in prev if c.get("type") in WARNED_CONDITIONS and c.get("type") not in kept]
    conditions += carried  # kept as they were, their own observedGeneration included
    foreign = next((c for c in conditions if c["type"] == "ConfigMapOwned" and c["status"] == "False"), None)
    if not ok:
        conditions.append(condition("Ready", False, "InvalidSpec", "the last valid config stays in force", prev))
    elif foreign is not None:
        conditions.append(condition("Ready", False, "ForeignConfigMap", foreign["message"], prev))
    else:
        ready = targets > 0 and synced == targets
        text = f"{synced} of {targets} running bound pods run config {config_hash}"
        conditions.append(condition("Ready", ready, "Synced" if ready else "Syncing", text, prev))
    conditions = [c if c in carried else {**c, "observedGeneration": generation} for c in conditions]
    status: dict[str, Any] = {"observedGeneration": generation, "targetPods": targets, "syncedPods": synced,
                              "conditions": conditions}
    if misbound is not None:
        status["misboundPods"] = len(misbound)
    if config_hash:
        status["configHash"] = config_hash
    if configmap:
        status["configMap"] = configmap
    if prompts is not None:
        status["prompts"] = prompts
    return status


def warnings(previous: dict[str, Any] | None, status: dict[str, Any]) -> list[tuple[str, str]]:
    """(reason, message) of the Warning Events a new status calls for: a warned condition that turned False,
    or changed its message while False. Once each, not at every resync: the operator stays quiet."""
    before = {c.get("type"): c for c in (previous or {}).get("conditions") or []}
    out = []
    for cond in status.get("conditions") or []:
        if cond["type"] not in WARNED_CONDITIONS or cond["status"] != "False":
            continue
        old = before.get(cond["type"]) or {}
        if old.get("status") != "False" or old.get("message") != cond["message"]:
            out.append((cond["reason"], cond["message"]))
    return out
