"""Eviction policies behind one protocol (see :mod:`.base`)."""

from __future__ import annotations

from collections.abc import Callable

from kvpool_sidecar.policies.base import EvictionPolicy, PolicyError
from kvpool_sidecar.policies.lru import LRUPolicy

PolicyFactory = Callable[[], EvictionPolicy]

POLICIES: dict[str, PolicyFactory] = {
    "lru": LRUPolicy,
}


def make_policy(name: str) -> EvictionPolicy:
    try:
        factory = POLICIES[name]
    except KeyError:
        raise PolicyError(f"unknown eviction policy {name!r}; known: {', '.join(sorted(POLICIES))}") from None
    return factory()


__all__ = ["POLICIES", "EvictionPolicy", "LRUPolicy", "PolicyError", "make_policy"]
