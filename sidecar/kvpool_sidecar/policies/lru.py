"""Least recently used: the baseline every KV cache ships (vLLM's free-block queue is one)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence

from kvpool_sidecar.config import KVCachePolicySpec
from kvpool_sidecar.policies.base import PolicyContext


class LRUPolicy:
    name = "lru"

    def __init__(self, ctx: PolicyContext | None = None) -> None:
        # Insertion order is recency order: a page re-enters at the tail each time it is released.
        self._order: OrderedDict[int, None] = OrderedDict()

    def insert(self, pages: list[int], depths: list[int], length: int, now: float, klass: Hashable) -> None:
        self._order.update(dict.fromkeys(pages))

    def take(self, page: int, now: float, hit: bool) -> None:
        del self._order[page]

    def evict(self, page: int) -> None:
        del self._order[page]

    def victim(self, now: float) -> int:
        return self._order.popitem(last=False)[0]

    def victims(self, now: float, count: int, links: tuple[Sequence[int], Sequence[int]]) -> list[int]:
        """The ``count`` least recently used pages, forgotten (one Python call for a whole admission);
        a page with descendants is rare enough under LRU that the pool restores what follows it."""
        popitem = self._order.popitem
        return [popitem(False)[0] for _ in range(count)]

    def restore(self, pages: list[int]) -> None:
        """Victims the pool did not take go back to the front, least recent first."""
        order = self._order
        order.update(dict.fromkeys(pages))
        for page in reversed(pages):
            order.move_to_end(page, last=False)

    def peek(self, now: float) -> int:
        return next(iter(self._order))

    def configure(self, spec: KVCachePolicySpec) -> None:
        pass

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, page: int) -> bool:
        return page in self._order
