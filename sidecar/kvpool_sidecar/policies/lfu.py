"""Least frequently used, ties broken by recency: O(1) with one recency-ordered bucket per count."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence

from kvpool_sidecar.config import KVCachePolicySpec
from kvpool_sidecar.policies.base import PolicyBase, PolicyContext


class LFUPolicy(PolicyBase):
    name = "lfu"

    def __init__(self, ctx: PolicyContext | None = None) -> None:
        self._count: dict[int, int] = {}  # hits while cached, for every cached page
        self._buckets: dict[int, OrderedDict[int, None]] = {}
        self._size = 0
        self._min = 0

    def insert(self, pages: list[int], depths: Sequence[int], length: int, now: float, klass: Hashable) -> None:
        for page in pages:
            count = self._count.setdefault(page, 0)
            bucket = self._buckets.get(count)
            if bucket is None:
                bucket = self._buckets[count] = OrderedDict()
            bucket[page] = None
            if self._size == 0 or count < self._min:
                self._min = count
            self._size += 1

    def _unlist(self, page: int) -> None:
        count = self._count[page]
        bucket = self._buckets[count]
        del bucket[page]
        if not bucket:
            del self._buckets[count]
        self._size -= 1

    def take(self, page: int, now: float, hit: bool) -> None:
        self._unlist(page)
        if hit:
            self._count[page] += 1

    def evict(self, page: int) -> None:
        self._unlist(page)
        del self._count[page]

    def _min_bucket(self) -> OrderedDict[int, None]:
        bucket = self._buckets.get(self._min)
        if bucket is None:
            self._min = min(self._buckets)
            bucket = self._buckets[self._min]
        return bucket

    def peek(self, now: float) -> int:
        return next(iter(self._min_bucket()))

    def victim(self, now: float) -> int:
        bucket = self._min_bucket()
        page = bucket.popitem(last=False)[0]
        if not bucket:
            del self._buckets[self._min]
        self._size -= 1
        del self._count[page]
        return page

    def configure(self, spec: KVCachePolicySpec) -> None:
        pass

    def __len__(self) -> int:
        return self._size

    def __contains__(self, page: int) -> bool:
        count = self._count.get(page)
        return count is not None and page in self._buckets.get(count, ())
