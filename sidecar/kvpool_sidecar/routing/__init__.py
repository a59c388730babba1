"""Routing requests to the pod that holds their prefix: consistent hashing, bounded load, replicas."""

from kvpool_sidecar.rates import DecayedCounter
from kvpool_sidecar.routing.ring import HashRing, key_movement, key_position
from kvpool_sidecar.routing.router import (
    REASONS,
    ROUTING_MODES,
    KeySpec,
    NoPods,
    RouteDecision,
    Router,
)

__all__ = [
    "REASONS", "ROUTING_MODES", "DecayedCounter", "HashRing", "KeySpec", "NoPods", "RouteDecision", "Router",
    "key_movement", "key_position",
]
