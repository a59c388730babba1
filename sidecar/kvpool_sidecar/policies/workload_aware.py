"""The workload-aware policy: evict the lowest Score = alpha*P_reuse + beta*S_locality + gamma*T_window.

* ``P_reuse`` comes from the per-class reuse model (:mod:`kvpool_sidecar.workload`).
* ``S_locality`` decays with the page's index in its prompt: head pages (system prompts, chat history)
  serve every later turn, tail pages only the exact same continuation.
* ``T_window`` is 1 while the page is younger than its class's window, 0 after: expired pages go first.

Two implementations of one rule:

``workload_aware`` (amortised O(1)): each class's pages sit in time buckets by release time; a bucket
is a heap by the score computed at release (pages of one bucket share their age, so that order
holds). Eviction looks only at the top of each class's oldest bucket, scores those few candidates at
the current time and takes the lowest: age orders buckets, the class's fitted reuse curve trades an
old page of a class that comes back against a young one of a class that does not. A sparse oldest
bucket is merged into its neighbour so that the choice stays a choice. The highest-scoring share of
pages (``protectedPercent``) is kept in a protected segment, evicted from only when nothing else is
left.

``workload_aware_exact`` evaluates the full score, at eviction time, of every candidate that can be
the minimum. Within one (class, depth) group the score never rises with age, so the oldest page of
each group is the only candidate in it: scanning the group heads is an exact arg-min over all pages.
"""

from __future__ import annotations

import heapq
import math
from bisect import insort
from collections import OrderedDict
from collections.abc import Hashable

from kvpool_sidecar.config import KVCachePolicySpec
from kvpool_sidecar.policies.base import PolicyContext
from kvpool_sidecar.workload import ReuseModel

BUCKETS_PER_WINDOW = 8
MERGE_BELOW = 64  # live pages under which the oldest bucket is merged into the next
LOCALITY_HALF_DEPTH = 4.0  # S_locality halves every this many pages into the prompt
_HIST_BINS = 64
_THRESHOLD_EVERY = 256


def locality(depth: int) -> float:
    return 1.0 / (1.0 + depth / LOCALITY_HALF_DEPTH)


class _Scoring:
    """Weights and model shared by both implementations."""

    def __init__(self, ctx: PolicyContext) -> None:
        self.model: ReuseModel = ctx.model
        self.partition = ctx.partition
        self.configure(ctx.spec)

    def configure(self, spec: KVCachePolicySpec) -> None:
        w = spec.eviction.weights
        self.alpha, self.beta, self.gamma = w.reuse, w.locality, w.timeWindow
        self.protected_share = spec.eviction.protectedPercent / 100.0
        window = spec.workloads.toB.window_seconds if self.partition == "toB" else spec.workloads.toC.window_seconds
        self.bucket_width = window / BUCKETS_PER_WINDOW

    def score(self, klass: Hashable, depth: int, age: float) -> float:
        model = self.model
        window = model.window_of(klass)
        t_window = 1.0 if age <= window else 0.0
        p = model.p_reuse(klass, age, window)
        return self.alpha * p + self.beta * locality(depth) + self.gamma * t_window


class _ClassQueue:
    """One class's time buckets: bucket id -> heap of entries, ids kept in ascending order."""

    __slots__ = ("heaps", "live", "order")

    def __init__(self) -> None:
        self.heaps: dict[int, list[list]] = {}
        self.live: dict[int, int] = {}
        self.order: list[int] = []

    def push(self, entry: list) -> None:
        bid = entry[_BID]
        heap = self.heaps.get(bid)
        if heap is None:
            heap = self.heaps[bid] = []
            self.live[bid] = 0
            if self.order and bid < self.order[-1]:
                insort(self.order, bid)
            else:
                self.order.append(bid)
        heapq.heappush(heap, entry)
        self.live[bid] += 1

    def discard(self, bid: int) -> None:
        self.live[bid] -= 1
        if self.live[bid] == 0:
            del self.heaps[bid]
            del self.live[bid]
            self.order.remove(bid)

    def front(self) -> list:
        """The best eviction candidate of the oldest bucket (merging a sparse one into the next first)."""
        order = self.order
        while len(order) > 1 and self.live[order[0]] < MERGE_BELOW:
            bid, nxt = order[0], order[1]
            heap = self.heaps[nxt]
            for entry in self.heaps[bid]:
                if entry[_PAGE] >= 0:
                    entry[_BID] = nxt
                    heap.append(entry)
            heapq.heapify(heap)
            self.live[nxt] += self.live[bid]
            del self.heaps[bid]
            del self.live[bid]
            order.pop(0)
        heap = self.heaps[order[0]]
        while heap[0][_PAGE] < 0:
            heapq.heappop(heap)  # lazily deleted entries
        return heap[0]

    def pop_front(self) -> list:
        entry = heapq.heappop(self.heaps[self.order[0]])
        self.discard(entry[_BID])
        return entry


# Entry fields: [score at release, tiebreak, page (-1 when deleted), bucket id, class, released at, depth]
_PAGE, _BID, _KLASS, _RELEASED, _DEPTH = 2, 3, 4, 5, 6


class WorkloadAwarePolicy(_Scoring):
    name = "workload_aware"

    def __init__(self, ctx: PolicyContext) -> None:
        super().__init__(ctx)
        self._queues: dict[Hashable, _ClassQueue] = {}
        self._entry: dict[int, list] = {}  # evictable page -> its entry
        self._protected: OrderedDict[int, list] = OrderedDict()  # page -> entry, oldest first
        self._tiebreak = 0
        self._hist = [0.0] * _HIST_BINS
        self._threshold = math.inf
        self._since_threshold = 0

    def configure(self, spec: KVCachePolicySpec) -> None:
        super().configure(spec)
        self._top = self.alpha + self.beta + self.gamma

    def _queue(self, klass: Hashable) -> _ClassQueue:
        queue = self._queues.get(klass)
        if queue is None:
            queue = self._queues[klass] = _ClassQueue()
        return queue

    def insert(self, pages: list[int], depths: list[int], now: float, klass: Hashable) -> None:
        base = self.alpha * self.model.p_reuse(klass, 0.0) + self.gamma
        beta = self.beta
        bid = int(now // self.bucket_width)
        threshold = self._threshold
        entries = self._entry
        protected = self._protected
        queue = self._queue(klass)
        for page, depth in zip(pages, depths):
            score = base + beta / (1.0 + depth / LOCALITY_HALF_DEPTH)
            self._tiebreak += 1
            entry = [score, self._tiebreak, page, bid, klass, now, depth]
            entries[page] = entry
            self._note_score(score)
            if score >= threshold:
                protected[page] = entry
            else:
                queue.push(entry)
        limit = self.protected_share * len(entries)
        while len(protected) > limit:
            _, entry = protected.popitem(last=False)
            self._queue(entry[_KLASS]).push(entry)

    def _note_score(self, score: float) -> None:
        top = self._top
        hist = self._hist
        hist[min(int(score / top * _HIST_BINS), _HIST_BINS - 1)] += 1.0
        self._since_threshold += 1
        if self._since_threshold >= _THRESHOLD_EVERY:
            self._since_threshold = 0
            want = sum(hist) * self.protected_share
            acc = 0.0
            self._threshold = math.inf
            for i in range(_HIST_BINS - 1, -1, -1):
                acc += hist[i]
                if acc > want:
                    self._threshold = (i + 1) * top / _HIST_BINS
                    break
            for i in range(_HIST_BINS):
                hist[i] *= 0.5  # forget old scores: the threshold follows the workload

    def take(self, page: int, now: float, hit: bool) -> None:
        self._forget(page)

    def evict(self, page: int) -> None:
        self._forget(page)

    def _forget(self, page: int) -> None:
        entry = self._entry.pop(page)
        if self._protected.pop(page, None) is not None:
            return
        entry[_PAGE] = -1  # lazy deletion from its heap
        self._queues[entry[_KLASS]].discard(entry[_BID])

    def victim(self, now: float) -> int:
        best: list | None = None
        best_score = math.inf
        best_queue: _ClassQueue | None = None
        for queue in self._queues.values():
            if not queue.order:
                continue
            entry = queue.front()
            score = self.score(entry[_KLASS], entry[_DEPTH], now - entry[_RELEASED])
            if score < best_score or (score == best_score and best is not None and entry[_RELEASED] < best[_RELEASED]):
                best, best_score, best_queue = entry, score, queue
        if best_queue is not None:
            best_queue.pop_front()
            page = best[_PAGE]  # type: ignore[index]
            del self._entry[page]
            return page
        page, _ = self._protected.popitem(last=False)
        del self._entry[page]
        return page

    def __len__(self) -> int:
        return len(self._entry)

    def __contains__(self, page: int) -> bool:
        return page in self._entry


class WorkloadAwareExactPolicy(_Scoring):
    name = "workload_aware_exact"

    def __init__(self, ctx: PolicyContext) -> None:
        super().__init__(ctx)
        # (class, depth) -> page -> release time, oldest first
        self._groups: dict[tuple[Hashable, int], OrderedDict[int, float]] = {}
        self._group_of: dict[int, tuple[Hashable, int]] = {}

    def insert(self, pages: list[int], depths: list[int], now: float, klass: Hashable) -> None:
        for page, depth in zip(pages, depths):
            group = (klass, depth)
            members = self._groups.get(group)
            if members is None:
                members = self._groups[group] = OrderedDict()
            members[page] = now
            self._group_of[page] = group

    def _forget(self, page: int) -> None:
        group = self._group_of.pop(page)
        members = self._groups[group]
        del members[page]
        if not members:
            del self._groups[group]

    def take(self, page: int, now: float, hit: bool) -> None:
        self._forget(page)

    def evict(self, page: int) -> None:
        self._forget(page)

    def victim(self, now: float) -> int:
        best_page = -1
        best = (math.inf, math.inf)
        for (klass, depth), members in self._groups.items():
            page, released = next(iter(members.items()))
            key = (self.score(klass, depth, now - released), released)  # ties: the older page
            if key < best:
                best, best_page = key, page
        self._forget(best_page)
        return best_page

    def __len__(self) -> int:
        return len(self._group_of)

    def __contains__(self, page: int) -> bool:
        return page in self._group_of
