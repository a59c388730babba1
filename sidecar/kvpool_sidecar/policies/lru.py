"""Least recently used: the baseline every KV cache ships (vLLM's free-block queue is one)."""

from __future__ import annotations

from collections import OrderedDict
from typing import Hashable


class LRUPolicy:
    name = "lru"

    def __init__(self) -> None:
        # Insertion order is recency order: a page re-enters at the tail when it is released again.
        self._order: OrderedDict[int, None] = OrderedDict()

    def insert(self, page: int, now: float, depth: int, klass: Hashable) -> None:
        self._order[page] = None

    def remove(self, page: int, now: float, hit: bool) -> None:
        del self._order[page]

    def victim(self, now: float) -> int:
        return self._order.popitem(last=False)[0]

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, page: int) -> bool:
        return page in self._order
