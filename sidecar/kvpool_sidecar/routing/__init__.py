"""Routing: the cluster replay's simulated router (consistent hashing, bounded load, replicas) and kvpool's
tier as vLLM KV events (:mod:`.kv_events`) for a router that indexes them (llm-d)."""

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
