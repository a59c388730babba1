"""One class's evictable pages for the bucketed workload-aware policy: time buckets of locality FIFOs."""

from __future__ import annotations

from bisect import insort
from collections import deque

from kvpool_sidecar.policies.scoring import LOCALITY_LEVELS

MERGE_BELOW = 64  # live pages under which the oldest bucket is merged into the next
# Entry fields: [page (-1 when deleted), bucket id, class, released at, level]. Rank tuples break ties
# on the page id: two classes' candidates never share one, so entries themselves are never compared.
PAGE, BID, KLASS, RELEASED, LEVEL = 0, 1, 2, 3, 4


class ClassQueue:
    """One class's time buckets, oldest first; a bucket keeps one FIFO per locality level.

    Pages of one class released in one bucket's span share their reuse probability (same class,
    nearly the same age), so their score order is their locality order: the lowest non-empty level's
    oldest page is the bucket's best victim. No heap: every operation is O(1) (amortised over the
    lazily deleted entries skipped at a level's front); ``low`` keeps the scan for the lowest
    non-empty level from starting at level 0 each time.
    """

    __slots__ = ("buckets", "live", "low", "order")

    def __init__(self) -> None:
        self.buckets: dict[int, list[deque[list]]] = {}
        self.live: dict[int, int] = {}
        self.low: dict[int, int] = {}  # bucket id -> no entry sits below this level
        self.order: list[int] = []  # bucket ids, ascending

    def bucket(self, bid: int) -> list[deque[list]]:
        """Bucket ``bid``'s level FIFOs, created (empty, registered in order) if it has none yet."""
        bucket = self.buckets.get(bid)
        if bucket is None:
            bucket = self.buckets[bid] = [deque() for _ in range(LOCALITY_LEVELS + 1)]
            self.live[bid] = 0
            self.low[bid] = LOCALITY_LEVELS
            if self.order and bid < self.order[-1]:
                insort(self.order, bid)
            else:
                self.order.append(bid)
        return bucket

    def push(self, entry: list) -> None:
        bid = entry[BID]
        level = entry[LEVEL]
        (self.buckets.get(bid) or self.bucket(bid))[level].append(entry)
        self.live[bid] += 1
        if level < self.low[bid]:
            self.low[bid] = level

    def _drop_bucket(self, bid: int) -> None:
        del self.buckets[bid]
        del self.live[bid]
        del self.low[bid]
        self.order.remove(bid)

    def discard(self, bid: int) -> None:
        self.live[bid] -= 1
        if self.live[bid] == 0:
            self._drop_bucket(bid)

    def _merge_front(self) -> None:
        """Fold the sparse oldest bucket into the next: its pages go first within each level."""
        bid, nxt = self.order[0], self.order[1]
        older, newer = self.buckets.pop(bid), self.buckets[nxt]
        for level, fifo in enumerate(older):
            alive = [e for e in fifo if e[PAGE] >= 0]
            for entry in alive:
                entry[BID] = nxt
            newer[level].extendleft(reversed(alive))
        self.live[nxt] += self.live.pop(bid)
        self.low[nxt] = min(self.low[nxt], self.low.pop(bid))
        self.order.pop(0)

    def front(self) -> list:
        """The best eviction candidate of the oldest bucket (merging a sparse one into the next first)."""
        order = self.order
        while len(order) > 1 and self.live[order[0]] < MERGE_BELOW:
            self._merge_front()
        bid = order[0]
        bucket = self.buckets[bid]
        for level in range(self.low[bid], LOCALITY_LEVELS + 1):
            fifo = bucket[level]
            while fifo and fifo[0][PAGE] < 0:
                fifo.popleft()  # lazily deleted entries
            if fifo:
                self.low[bid] = level
                return fifo[0]
        raise LookupError("a bucket with live pages has none")  # unreachable: live counts are exact

    def pop_front(self, entry: list) -> None:
        """Remove ``entry``, which :meth:`front` returned (no change to the queue since)."""
        self.buckets[entry[BID]][entry[LEVEL]].popleft()
        self.discard(entry[BID])

    def advance(self, entry: list) -> list | None:
        """Remove ``entry``, which :meth:`front` returned, and return the next front (None: empty)."""
        bid = entry[BID]
        fifo = self.buckets[bid][entry[LEVEL]]
        fifo.popleft()
        live = self.live[bid] - 1
        if live >= MERGE_BELOW:  # no merge due: the next front is likely the next of the same level
            self.live[bid] = live
            while fifo and fifo[0][PAGE] < 0:
                fifo.popleft()
            if fifo:
                return fifo[0]
            return self.front()
        return self.settle(bid, live)

    def settle(self, bid: int, live: int) -> list | None:
        """The next front once bucket ``bid`` holds ``live`` pages, fewer than a merge leaves alone."""
        if live:
            self.live[bid] = live
        else:
            self._drop_bucket(bid)
            if not self.order:
                return None
        return self.front()
