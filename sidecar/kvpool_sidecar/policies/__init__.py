"""Eviction policies behind one protocol (see :mod:`.base`)."""

from __future__ import annotations

from collections.abc import Callable

from kvpool_sidecar.policies.adaptive import WorkloadAdaptivePolicy, credit_scale
from kvpool_sidecar.policies.base import (
    NO_PAGE,
    EvictionPolicy,
    PageTree,
    PolicyBase,
    PolicyContext,
    PolicyError,
    has_unnamed_child,
    run_limit,
)
from kvpool_sidecar.policies.fifo import FIFOPolicy, S3FIFOPolicy
from kvpool_sidecar.policies.lfu import LFUPolicy
from kvpool_sidecar.policies.lru import LRUPolicy

PolicyFactory = Callable[[PolicyContext], EvictionPolicy]

POLICIES: dict[str, PolicyFactory] = {
    "lru": LRUPolicy,
    "fifo": FIFOPolicy,
    "lfu": LFUPolicy,
    "s3fifo": S3FIFOPolicy,
    "workload_adaptive": WorkloadAdaptivePolicy,
}


def make_policy(name: str, ctx: PolicyContext) -> EvictionPolicy:
    try:
        factory = POLICIES[name]
    except KeyError:
        raise PolicyError(f"unknown eviction policy {name!r}; known: {', '.join(sorted(POLICIES))}") from None
    return factory(ctx)


__all__ = [
    "NO_PAGE",
    "POLICIES",
    "EvictionPolicy",
    "FIFOPolicy",
    "LFUPolicy",
    "LRUPolicy",
    "PageTree",
    "PolicyBase",
    "PolicyContext",
    "PolicyError",
    "PolicyFactory",
    "S3FIFOPolicy",
    "WorkloadAdaptivePolicy",
    "credit_scale",
    "has_unnamed_child",
    "make_policy",
    "run_limit",
]
