"""A live policy switch spread over pool calls, so that no call re-inserts a million pages.

:class:`Handover` stands in a partition's policy slot while the new policy takes the cached pages
over: pages released from now on go to the new policy; the old one keeps the rest and names the
victims first (its pages are the ones nobody touched since the switch), and a slice of them moves to
the new policy per pool call (:meth:`PagePool.settle`, also run by the sidecar's background task), in
the old policy's own eviction order, least valuable first. When the old policy is empty the pool puts
the new one in the slot. A switch during a handover hands over the handover itself.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

from kvpool_sidecar.config import KVCachePolicySpec
from kvpool_sidecar.policies import EvictionPolicy


class Handover:
    """The old policy's pages moving to the new one; an :class:`EvictionPolicy` meanwhile."""

    bulk = False  # one victim at a time: from the old policy while it has pages

    def __init__(self, old: EvictionPolicy, new: EvictionPolicy) -> None:
        self.old = old
        self.new = new
        self.name = new.name
        self.uses_frequency = new.uses_frequency

    @property
    def weights(self) -> tuple[float, ...]:
        return self.new.weights  # type: ignore[attr-defined]  # only read when uses_frequency

    def step(self, now: float, budget: int, depth_of: Callable[[int], int], last: Sequence[float],
             klass: Sequence[Hashable]) -> bool:
        """Move up to ``budget`` pages to the new policy; returns whether the old one is empty."""
        old, new = self.old, self.new
        for _ in range(min(budget, len(old))):
            page = old.victim(now)
            depth = depth_of(page)
            new.insert([page], [depth], depth + 1, last[page], klass[page])
        return not len(old)

    def insert(self, pages: list[int], depths: Sequence[int], length: int, now: float, klass: Hashable) -> None:
        self.new.insert(pages, depths, length, now, klass)

    def take(self, page: int, now: float, hit: bool) -> None:
        (self.old if page in self.old else self.new).take(page, now, hit)

    def evict(self, page: int) -> None:
        (self.old if page in self.old else self.new).evict(page)

    def victim(self, now: float) -> int:
        return self.old.victim(now) if len(self.old) else self.new.victim(now)

    def peek(self, now: float) -> int:
        return self.old.peek(now) if len(self.old) else self.new.peek(now)

    def configure(self, spec: KVCachePolicySpec) -> None:
        self.new.configure(spec)

    def victims(self, now: float, count: int, links: tuple[Sequence[int], Sequence[int]]) -> list[int]:
        raise NotImplementedError("a handover names victims one at a time")

    def restore(self, pages: list[int]) -> None:
        raise NotImplementedError("a handover names victims one at a time")

    def check(self) -> None:
        self.old.check()
        self.new.check()

    def set_reuse_weight(self, weight: float | None) -> None:
        self.new.set_reuse_weight(weight)

    def __len__(self) -> int:
        return len(self.old) + len(self.new)

    def __contains__(self, page: int) -> bool:
        return page in self.old or page in self.new
