"""Pure status logic: conditions, conflicts between policies, target and synced pods."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from kvpool_sidecar.config import LabelSelector

_HASH_METRIC = re.compile(r'^kvpool_config_info\{[^}]*hash="([0-9a-f]+)"[^}]*\}\s+1(\.0)?\s*$', re.MULTILINE)


@dataclass(frozen=True)
class PolicyRef:
    name: str
    created: str  # metadata.creationTimestamp (RFC 3339): the older policy wins a conflict
    selector: LabelSelector


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


def target_pods(selector: LabelSelector, pods: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    return [p for p in pods if selector.matches((p.get("metadata") or {}).get("labels") or {})]


def conflicting_policy(me: PolicyRef, others: Iterable[PolicyRef], pods: list[dict[str, Any]]) -> PolicyRef | None:
    """The older policy that selects one of my pods, if any (it wins; ties broken by name)."""
    mine = {(p.get("metadata") or {}).get("name") for p in target_pods(me.selector, pods)}
    winner = None
    for other in others:
        if other.name == me.name:
            continue
        theirs = {(p.get("metadata") or {}).get("name") for p in target_pods(other.selector, pods)}
        if mine & theirs and (other.created, other.name) < (me.created, me.name):
            if winner is None or (other.created, other.name) < (winner.created, winner.name):
                winner = other
    return winner


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
    conflict: PolicyRef | None, targets: int, synced: int, previous: dict[str, Any] | None = None,
    prompts: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    prev = (previous or {}).get("conditions") or []
    ok, reason, message = valid
    conditions = [condition("Valid", ok, reason, message, prev)]
    if conflict is not None:
        conditions.append(condition("Conflict", True, "OverlappingSelector",
                                    f"pods are also selected by the older policy {conflict.name}, which wins", prev))
        conditions.append(condition("Ready", False, "Conflict", f"superseded by {conflict.name}", prev))
    elif not ok:
        conditions.append(condition("Ready", False, "InvalidSpec", "the last valid config stays in force", prev))
    else:
        ready = targets > 0 and synced == targets
        message = f"{synced} of {targets} pods run config {config_hash}"
        conditions.append(condition("Ready", ready, "Synced" if ready else "Syncing", message, prev))
    conditions = [{**c, "observedGeneration": generation} for c in conditions]  # each one set for this spec
    status: dict[str, Any] = {"observedGeneration": generation, "targetPods": targets, "syncedPods": synced,
                              "conditions": conditions}
    if config_hash:
        status["configHash"] = config_hash
    if configmap:
        status["configMap"] = configmap
    if prompts is not None:
        status["prompts"] = prompts
    return status
