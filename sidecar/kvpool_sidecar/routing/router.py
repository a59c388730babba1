"""Prefix-affinity routing with bounded load and hot-prefix replicas (pure: no I/O, no clock of its own): the
router the cluster replay (:mod:`kvpool_sidecar.replay.cluster`) simulates; no service runs it.

A request's routing key is the chained hash of its first ``prefixPages`` full pages (the pool's own
keys, tenant salt included), so requests sharing that prefix meet on the pod that caches it. The key
sits on a consistent-hash ring (:mod:`.ring`); bounded load (Mirrokni et al., "Consistent Hashing
with Bounded Loads") lets a pod take a request only while its load stays within ``loadFactor`` times
the mean, otherwise the request walks the ring to the next pod. A prefix hotter than
``hotPrefixQPS`` is served by its owner and the next ``replicas`` pods on its walk, least loaded first.

Invariants:
* R1 the chosen pod is a member; R2 under bounded modes, a pod whose load would pass the bound is
  chosen only when every pod would (never happens with a whole-request bound, see ``_bound``);
* R3 a key's owner depends only on the key and the member set (a membership change moves ~1/N keys).
"""

from __future__ import annotations

import math
import random
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from kvpool_sidecar.config import Routing
from kvpool_sidecar.errors import InvalidRequest
from kvpool_sidecar.keys import DEFAULT_META, WorkloadMeta, prompt_keys, salted, tenant_salt
from kvpool_sidecar.rates import PREFIX_RATE_WINDOW, DecayedCounter
from kvpool_sidecar.routing.ring import HashRing, key_position

ROUTING_MODES: tuple[str, ...] = (
    "random", "round-robin", "least-loaded", "prefix-hash", "bounded-hash", "bounded-hash+replicas",
)
REASONS: tuple[str, ...] = ("owner", "replica", "overflow", "unkeyed", "random", "round-robin", "least-loaded")
HOT_WINDOW_SECONDS = PREFIX_RATE_WINDOW  # a prefix's QPS: its requests over about 10 s, as for auto-pin
_MAX_TRACKED_KEYS = 65_536  # per-key rate counters kept before the cold ones are pruned


class NoPods(LookupError):
    """The router has no member pods to route to."""


@dataclass(frozen=True, slots=True)
class RouteDecision:
    pod: str
    reason: str  # one of REASONS
    alternates: tuple[str, ...]  # the next choices, in order, should the pod refuse
    key: Hashable | None  # the routing key (None: the prompt has no full page)
    hot: bool  # the key is above the hot-prefix QPS
    owner: str | None = None  # the key's ring owner (hash modes with a key)


@dataclass(frozen=True, slots=True)
class KeySpec:
    """How prompts become keys: the pool's page size and tenant rules (from the same policy spec)."""

    page_size: int
    isolate: bool = True
    shared_first: frozenset[str] = frozenset()


class Router:
    def __init__(
        self,
        routing: Routing | None = None,
        keys: KeySpec | None = None,
        *,
        mode: str = "bounded-hash+replicas",
        pods: Sequence[str] = (),
        seed: int = 0,
    ) -> None:
        if mode not in ROUTING_MODES:
            raise ValueError(f"routing mode must be one of {', '.join(ROUTING_MODES)}; got {mode!r}")
        self.mode = mode
        self.keys = keys or KeySpec(16)
        self._random = random.Random(seed)
        self._next = 0
        self.routing = routing or Routing()
        self.ring = HashRing(self.routing.virtualNodes)
        self.load = DecayedCounter(self.routing.load_window_seconds)
        self.key_rate = DecayedCounter(HOT_WINDOW_SECONDS)
        self._prune_at = _MAX_TRACKED_KEYS
        self._members: list[str] = []
        self.decisions: dict[str, int] = dict.fromkeys(REASONS, 0)
        self.set_pods(pods)

    # ------------------------------------------------------------------------------ membership
    @property
    def pods(self) -> list[str]:
        return list(self._members)

    def set_pods(self, pods: Sequence[str]) -> tuple[list[str], list[str]]:
        """Follow a new member set; returns (joined, left). Loads of pods that stay are kept."""
        wanted = list(dict.fromkeys(pods))
        joined = [p for p in wanted if p not in self.ring]
        left = [p for p in self._members if p not in set(wanted)]
        for pod in left:
            self.ring.remove(pod)
            self.load.drop(pod)
        for pod in joined:
            self.ring.add(pod)
        self._members = sorted(wanted)
        return joined, left

    def reconfigure(self, routing: Routing, keys: KeySpec | None = None) -> None:
        """Swap parameters live; the ring is rebuilt only when its point count changes."""
        if routing.virtualNodes != self.routing.virtualNodes:
            self.ring = HashRing(routing.virtualNodes, self._members)
        if routing.load_window_seconds != self.routing.load_window_seconds:
            self.load.window = routing.load_window_seconds
        self.routing = routing
        if keys is not None:
            self.keys = keys

    # ------------------------------------------------------------------------------------ keys
    def prefix_key(
        self,
        tokens: Sequence[int] | None = None,
        *,
        block_hashes: Sequence[Hashable] | None = None,
        num_tokens: int | None = None,
        meta: WorkloadMeta = DEFAULT_META,
    ) -> Hashable | None:
        """The chained key of the prompt's first ``prefixPages`` full pages; None when it has none.

        Raises the pool's :class:`~kvpool_sidecar.errors.InvalidRequest` for a malformed prompt.
        """
        ps = self.keys.page_size
        k = self.routing.prefixPages
        head_tokens: Sequence[int] | None = None
        head_hashes: Sequence[Hashable] | None = None
        if tokens is not None:
            if num_tokens is not None and num_tokens != len(tokens):
                raise InvalidRequest("num_tokens must equal len(tokens)", "num_tokens")
            head_tokens = tokens[: k * ps] if tokens else tokens
        elif block_hashes is not None:
            _, n = prompt_keys(None, block_hashes, num_tokens, ps, None)  # checks the length rule
            head_hashes = block_hashes[: min(k, n // ps)]
            if not head_hashes:
                return None
        salt = tenant_salt(meta.tenant) if salted(self.keys.isolate, meta.tenant, tokens is not None) else None
        keys, _ = prompt_keys(head_tokens, head_hashes, None, ps, salt, self.keys.shared_first)
        return keys[-1] if keys else None

    # ------------------------------------------------------------------------------------ route
    def _bound(self, now: float) -> float:
        """The most load a pod may carry after taking one more request: ceil(c * (total + 1) / n), and
        never less than ``minLoad`` (at a trickle, affinity is worth more than balance)."""
        total = sum(self.load.get(p, now) for p in self._members)
        return max(math.ceil(self.routing.loadFactor * (total + 1) / len(self._members)), self.routing.minLoad)

    def _least_loaded(self, pods: Sequence[str], now: float) -> str:
        return min(pods, key=lambda p: (self.load.get(p, now), p))

    def route_key(self, key: Hashable | None, now: float) -> RouteDecision:
        """Choose a pod for a request with routing key ``key`` at time ``now``; counts its load."""
        if not self._members:
            raise NoPods("no pods to route to")
        hot = False
        if key is not None:
            hot = self.key_rate.add(key, now) / HOT_WINDOW_SECONDS > self.routing.hotPrefixQPS
            if len(self.key_rate) > self._prune_at:
                self.key_rate.prune(now, 1.0)  # keys seen less than about once a window
                self._prune_at = max(_MAX_TRACKED_KEYS, 2 * len(self.key_rate))  # amortised O(1)
        pod, reason, alternates, owner = self._choose(key, hot, now)
        self.load.add(pod, now)
        self.decisions[reason] += 1
        return RouteDecision(pod, reason, alternates, key, hot, owner)

    def _choose(
        self, key: Hashable | None, hot: bool, now: float
    ) -> tuple[str, str, tuple[str, ...], str | None]:
        members = self._members
        mode = self.mode
        if mode == "random":
            return self._random.choice(members), "random", (), None
        if mode == "round-robin":
            pod = members[self._next % len(members)]
            self._next += 1
            return pod, "round-robin", (), None
        if mode == "least-loaded":
            return self._least_loaded(members, now), "least-loaded", (), None
        if key is None:
            return self._least_loaded(members, now), "unkeyed", (), None
        walk = list(self.ring.walk(key_position(key)))
        owner = walk[0]
        if mode == "prefix-hash":
            return owner, "owner", tuple(walk[1:3]), owner
        bound = self._bound(now)
        fits = [self.load.get(p, now) + 1 <= bound for p in walk]
        replicas = self.routing.replicas if (hot and mode == "bounded-hash+replicas") else 0
        group = [p for p, ok in zip(walk[: 1 + replicas], fits[: 1 + replicas], strict=True) if ok]
        if group:
            pod = self._least_loaded(group, now) if replicas else group[0]
            reason = "owner" if pod == owner else "replica"
        else:
            spill = [p for p, ok in zip(walk, fits, strict=True) if ok]
            pod = spill[0] if spill else self._least_loaded(walk, now)
            reason = "overflow"
        return pod, reason, tuple(p for p in walk[:3] if p != pod)[:2], owner

    def route(
        self,
        tokens: Sequence[int] | None = None,
        *,
        block_hashes: Sequence[Hashable] | None = None,
        num_tokens: int | None = None,
        meta: WorkloadMeta = DEFAULT_META,
        now: float,
    ) -> RouteDecision:
        key = self.prefix_key(tokens, block_hashes=block_hashes, num_tokens=num_tokens, meta=meta)
        return self.route_key(key, now)

    def loads(self, now: float) -> dict[str, float]:
        return {p: self.load.get(p, now) for p in self._members}

    def hot_prefixes(self, now: float) -> int:
        threshold = self.routing.hotPrefixQPS
        return sum(1 for k in self.key_rate.names() if self.key_rate.rate(k, now) > threshold)
