"""Least recently used: the baseline every KV cache ships (vLLM's free-block queue is one)."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from kvpool_sidecar.config import KVCachePolicySpec
from kvpool_sidecar.policies.base import NO_PAGE, PolicyBase, PolicyContext


class LRUPolicy(PolicyBase):
    """A doubly linked list threaded through two arrays indexed by page id, closed into a ring by a
    sentinel slot past the last page: the least recent page follows the sentinel, the most recent
    precedes it.

    Linking a page is a few list stores, with no allocation: an ``OrderedDict`` cost three to four
    times as much per page inserted and evicted, and the pool 64 more bytes per cached page.
    ``prev`` of a page outside the list is ``NO_PAGE`` (membership without a set).
    """

    bulk = True

    name = "lru"

    def __init__(self, ctx: PolicyContext | None = None) -> None:
        self._prev: list[int] = [0]
        self._next: list[int] = [0]
        # Always the last slot; moved up when a page id reaches it. Grown on demand rather than sized
        # to the pool: a partition's policy then holds room for the page ids it has seen, not for all.
        self._sentinel = 0
        self._len = 0

    def _grow(self, top: int) -> None:
        """Make room for page ids up to ``top``: the sentinel moves to the new last slot."""
        old = self._sentinel
        new = max(top + 1, 2 * old)
        prev, nxt = self._prev, self._next
        prev.extend([NO_PAGE] * (new + 1 - len(prev)))
        nxt.extend([NO_PAGE] * (new + 1 - len(nxt)))
        head, tail = nxt[old], prev[old]
        if head == old:  # empty ring
            head = tail = new
        nxt[new], prev[new] = head, tail
        prev[head] = nxt[tail] = new
        prev[old] = nxt[old] = NO_PAGE
        self._sentinel = new

    def _splice(self, pages: list[int], at_front: bool) -> None:
        """Link ``pages``, in their order, at the least recent end (``at_front``) or the most recent."""
        if max(pages) >= self._sentinel:
            self._grow(max(pages))
        prev, nxt, s = self._prev, self._next, self._sentinel
        before, after = (s, nxt[s]) if at_front else (prev[s], s)
        for page in pages:
            nxt[before] = page
            prev[page] = before
            before = page
        nxt[before] = after
        prev[after] = before
        self._len += len(pages)

    def insert(self, pages: list[int], depths: Sequence[int], length: int, now: float, klass: Hashable) -> None:
        """Link ``pages`` in the given order at the most recent end."""
        self._splice(pages, False)

    def take(self, page: int, now: float, hit: bool) -> None:
        prev, nxt = self._prev, self._next
        before, after = prev[page], nxt[page]
        nxt[before] = after
        prev[after] = before
        prev[page] = NO_PAGE
        self._len -= 1

    def evict(self, page: int) -> None:
        self.take(page, 0.0, False)

    def victim(self, now: float) -> int:
        page = self._next[self._sentinel]
        self.take(page, now, False)
        return page

    def victims(self, now: float, count: int, links: tuple[Sequence[int], Sequence[int]]) -> list[int]:
        """The ``count`` least recently used pages, unlinked in one cut (one Python call for a whole
        admission); a page with descendants is rare enough under LRU that the pool restores what
        follows it."""
        prev, nxt, s = self._prev, self._next, self._sentinel
        named: list[int] = []
        page = s
        for _ in range(count):
            page = nxt[page]
            prev[page] = NO_PAGE
            named.append(page)
        after = nxt[page]
        nxt[s] = after
        prev[after] = s
        self._len -= count
        return named

    def restore(self, pages: list[int]) -> None:
        """Victims the pool did not take go back to the front, least recent first."""
        self._splice(pages, True)

    def peek(self, now: float) -> int:
        if not self._len:
            raise LookupError("no evictable page")
        return self._next[self._sentinel]

    def configure(self, spec: KVCachePolicySpec) -> None:
        pass

    def order(self) -> list[int]:
        """The evictable pages, least recent first (for tests and introspection; O(n))."""
        nxt, s = self._next, self._sentinel
        pages = []
        page = nxt[s]
        while page != s:
            pages.append(page)
            page = nxt[page]
        return pages

    def check(self) -> None:
        """The ring is whole: walking it forward meets every linked page once, each page's ``prev``
        is the page before it, and the walk counts ``len(self)`` pages (for invariant checks; O(n))."""
        prev, nxt, s = self._prev, self._next, self._sentinel
        page, count = s, 0
        while nxt[page] != s:
            after = nxt[page]
            assert prev[after] == page, f"LRU ring: page {after} links back to {prev[after]}, not {page}"
            page = after
            count += 1
            assert count <= self._len, "LRU ring: more pages linked than counted"
        assert prev[s] == page, "LRU ring: the sentinel's prev is not the last page"
        assert count == self._len, f"LRU ring: {count} pages linked, {self._len} counted"
        members = sum(1 for p in range(s) if prev[p] != NO_PAGE)
        assert members == count, f"LRU ring: {members} pages marked as linked, {count} on the ring"

    def __len__(self) -> int:
        return self._len

    def __contains__(self, page: int) -> bool:
        return 0 <= page < self._sentinel and self._prev[page] != NO_PAGE
