"""The protocol between the pool and an eviction policy.

The pool owns page state. A policy orders the *evictable* pages of one partition (cached, refcount 0,
not pinned) and names a victim. Calls on the request path are O(1) or amortised O(1).

A policy may also name victims in bulk (it sets ``bulk``), ``victims(now, count, (first_child, next_sibling)) ->
list[int]``: the next ``count`` victims (``count <= len(policy)``) in the order
:meth:`EvictionPolicy.victim` would give them. The two sequences are the pool's prefix tree, read-only
(``NO_PAGE`` ends a list): a victim with a child that is not an earlier victim of the same call has
descendants, which the pool evicts with it and uses before asking for more. The policy either stops
right after such a page or offers ``restore(pages)``, through which the pool puts back, in front and
in order, the victims named after one (LRU does: under LRU a victim's descendants nearly always went
before it, so it names without looking). The default policy stops: it reads the tree from its context
(:class:`PageTree`) to keep its order prefix-closed.

``check()`` asserts the consistency of a policy's own structure; the pool's ``check_invariants``
calls it (LRU checks its linked ring). ``uses_frequency``: the policy ranks by page counts, so the
pool counts each prompt's page keys in its sketch (and runs the self-tuner).

Every member is in :class:`EvictionPolicy`; :class:`PolicyBase` gives the optional ones their
defaults (no bulk, no counts, nothing to check), so the pool never probes a policy for what it has.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Container, Hashable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from kvpool_sidecar.config import KVCachePolicySpec
from kvpool_sidecar.frequency import FrequencyView

NO_PAGE = -1  # "no page": a free page's parent, a leaf's first child


def has_unnamed_child(page: int, links: tuple[Sequence[int], Sequence[int]], named: Container[int]) -> bool:
    """Whether ``page`` has a cached child outside ``named``: the stop rule of a bulk ``victims`` call."""
    first_child, next_sib = links
    child = first_child[page]
    while child != NO_PAGE and child in named:
        child = next_sib[child]
    return child != NO_PAGE


def run_limit(heap: Sequence[tuple[float, ...]]) -> float:
    """The lowest key of a heap's entries after its top (the root's children): a run of victims
    taken from the top's queue stays below it, so the heap is touched once per run, not per page."""
    if len(heap) < 3:
        return heap[1][0] if len(heap) == 2 else math.inf
    return min(heap[1][0], heap[2][0])


class PageTree(NamedTuple):
    """The pool's prefix tree, read-only: per page, its parent, first child and next sibling
    (``NO_PAGE`` where there is none). The parent of a page that is not cached may be stale."""

    parent: Sequence[int]
    first_child: Sequence[int]
    next_sib: Sequence[int]


@dataclass(frozen=True, slots=True)
class PolicyContext:
    """What a policy may know of its pool: the spec, page keys, its partition and (when it runs in a
    pool) the prefix tree and page counts."""

    spec: KVCachePolicySpec
    key_of: Callable[[int], Hashable | None]
    partition: str = "toC"
    tree: PageTree | None = None
    frequency: FrequencyView | None = None  # the pool's page counts, for a policy that ranks by them


class EvictionPolicy(Protocol):
    name: str
    bulk: bool  # it names victims in bulk: ``victims`` (and, if it does not stop early, ``restore``)
    uses_frequency: bool  # it ranks by page counts: the pool counts prompts' pages in its sketch

    def insert(self, pages: list[int], depths: Sequence[int], length: int, now: float, klass: Hashable) -> None:
        """``pages`` became evictable at ``now``, least valuable first (a prompt's tail before its head).

        ``depths`` are their indexes in a prompt of ``length`` cached pages, ``klass`` the statistics
        class of the request that released them (None when unknown, e.g. at unpin).
        """

    def take(self, page: int, now: float, hit: bool) -> None:
        """``page`` stays cached but is no longer evictable: reused by a request (``hit``) or pinned."""

    def evict(self, page: int) -> None:
        """The pool dropped an evictable ``page`` itself (a descendant of a victim): forget it."""

    def victim(self, now: float) -> int:
        """Forget and return the page to evict next; only called when ``len(self) > 0``."""

    def peek(self, now: float) -> int:
        """The page :meth:`victim` would return now, without evicting it (for idle pre-eviction)."""

    def configure(self, spec: KVCachePolicySpec) -> None:
        """New parameters on the live pool; nothing is re-inserted."""

    def victims(self, now: float, count: int, links: tuple[Sequence[int], Sequence[int]]) -> list[int]:
        """The next ``count`` victims in bulk (see the module's notes); only called when ``bulk``."""

    def restore(self, pages: list[int]) -> None:
        """Put back, in front and in order, victims a bulk call named after a page with descendants."""

    def check(self) -> None:
        """Assert the consistency of the policy's own structure."""

    def set_reuse_weight(self, weight: float | None) -> None:
        """The self-tuner's choice of alpha (None: the configured weights); only when ``uses_frequency``."""

    def __len__(self) -> int: ...

    def __contains__(self, page: int) -> bool: ...


class PolicyBase:
    """The optional capabilities' defaults: one victim at a time, no model, nothing of its own to check."""

    bulk = False
    uses_frequency = False

    def victims(self, now: float, count: int, links: tuple[Sequence[int], Sequence[int]]) -> list[int]:
        raise NotImplementedError(f"{type(self).__name__} names victims one at a time (bulk is False)")

    def restore(self, pages: list[int]) -> None:
        raise NotImplementedError(f"{type(self).__name__} stops a bulk call at a page with descendants")

    def check(self) -> None:
        return None

    def set_reuse_weight(self, weight: float | None) -> None:
        raise NotImplementedError(f"{type(self).__name__} is not self-tuned (uses_frequency is False)")


class PolicyError(ValueError):
    """An unknown policy name or a bad policy parameter."""
