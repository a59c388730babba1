"""The protocol between the pool and an eviction policy.

The pool owns page state. A policy orders the *evictable* pages of one partition (cached, refcount 0,
not pinned) and names a victim. Calls on the request path are O(1) or amortised O(1).

A policy may also name victims in bulk, ``victims(now, count, (first_child, next_sibling)) ->
list[int]``: the next ``count`` victims (``count <= len(policy)``) in the order
:meth:`EvictionPolicy.victim` would give them. The two sequences are the pool's prefix tree, read-only
(``NO_PAGE`` ends a list): a victim with a child that is not an earlier victim of the same call has
descendants, which the pool evicts with it and uses before asking for more. The policy either stops
right after such a page or offers ``restore(pages)``, through which the pool puts back, in front and
in order, the victims named after one (LRU does: under LRU a victim's descendants nearly always went
before it, so it names without looking). The workload-aware policy reads the tree from its context
(:class:`PageTree`) and passes over a page with cached descendants until they are gone: ranking
pages of different classes, it would otherwise cut whole subtrees (every chat under a system prompt).

A policy may offer ``check()``, which asserts the consistency of its own structure; the pool's
``check_invariants`` calls it (LRU checks its linked ring).
"""

from __future__ import annotations

from collections.abc import Callable, Container, Hashable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from kvpool_sidecar.config import KVCachePolicySpec
from kvpool_sidecar.workload import ReuseModel

NO_PAGE = -1  # "no page": a free page's parent, a leaf's first child


def has_unnamed_child(page: int, links: tuple[Sequence[int], Sequence[int]], named: Container[int]) -> bool:
    """Whether ``page`` has a cached child outside ``named``: the stop rule of a bulk ``victims`` call."""
    first_child, next_sib = links
    child = first_child[page]
    while child != NO_PAGE and child in named:
        child = next_sib[child]
    return child != NO_PAGE


class PageTree(NamedTuple):
    """The pool's prefix tree, read-only: per page, its parent, first child and next sibling
    (``NO_PAGE`` where there is none). The parent of a page that is not cached may be stale."""

    parent: Sequence[int]
    first_child: Sequence[int]
    next_sib: Sequence[int]


@dataclass(frozen=True, slots=True)
class PolicyContext:
    """What a policy may know of its pool: the spec, the shared reuse model, page keys, its partition
    and (when it runs in a pool) the prefix tree."""

    spec: KVCachePolicySpec
    model: ReuseModel
    key_of: Callable[[int], Hashable | None]
    partition: str = "toC"
    tree: PageTree | None = None


class EvictionPolicy(Protocol):
    name: str

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

    def __len__(self) -> int: ...

    def __contains__(self, page: int) -> bool: ...


class PolicyError(ValueError):
    """An unknown policy name or a bad policy parameter."""
