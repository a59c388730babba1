"""What a partition can get: the pages it could obtain now, the pages it holds past its share and the
pages it can hold, read off an :class:`~.eviction.Eviction` (its partitions' pages and policies) and
its :class:`~.pages.PageTable`; a part of :class:`~kvpool_sidecar.pool.PagePool` that changes nothing.

The admission checks (a request's pages, a sequence's growth) ask it before :meth:`.Eviction.allocate`
hands pages out; it counts them as that allocation takes them (I7: a class allocates and evicts only
inside its partition).
"""

from __future__ import annotations

from kvpool_sidecar.pool.eviction import Eviction
from kvpool_sidecar.pool.pages import PageTable


class Capacity:
    """The partitions' room, by the rules of :meth:`.Eviction.allocate`."""

    def __init__(self, table: PageTable, eviction: Eviction) -> None:
        self.table = table
        self.eviction = eviction

    def obtainable(self, part: int, exclude: list[int]) -> int:
        """Pages that partition ``part`` could get now, if the pages in ``exclude`` stop being evictable.

        Free pages and, up to its limit, the other partition's evictable pages past that one's share;
        then its own evictable pages. Whatever it gets, its pages in use or pinned stay within its share
        : the other partition's share is then always free or one eviction away.
        """
        ev = self.eviction
        owned, caps = ev.owned, ev.caps
        policies = ev.policies
        evictable = [len(policies[0]), len(policies[1])]
        ref = self.table.ref
        pins = self.table.pins
        part_of = self.table.part
        for page in exclude:
            if not ref[page] and not pins[page]:  # cached, unpinned: in its policy (I1)
                evictable[part_of[page]] -= 1
        other = 1 - part
        room = ev.limits[part] - owned[part]
        spare = min(evictable[other], max(owned[other] - caps[other], 0))
        reachable = evictable[part] + min(max(room, 0), len(self.table.free) + spare)
        return min(reachable, caps[part] - (owned[part] - evictable[part]))

    def surely_obtainable(self, part: int, need: int, excluded: int) -> bool:
        """Whether ``need`` pages are obtainable by a lower bound of :meth:`obtainable` that does not
        look at the excluded pages (each makes at most one page of one partition unevictable): enough
        for the admission check of a big pool, and mostly decided by the partition's own pages."""
        ev = self.eviction
        owned, caps = ev.owned, ev.caps
        own = len(ev.policies[part])
        if caps[part] - (owned[part] - own) - excluded < need:
            return False
        own -= excluded
        if own >= need:
            return True
        room = ev.limits[part] - owned[part]
        if room <= 0:
            return False
        other = 1 - part
        spare = max(min(len(ev.policies[other]) - excluded, owned[other] - caps[other]), 0)
        return max(own, 0) + min(room, len(self.table.free) + spare) >= need

    def borrowed(self, part: int) -> int:
        """Pages ``part`` holds past its share: the other partition's idle share, which it gets back one
        eviction per page."""
        return max(self.eviction.owned[part] - self.eviction.caps[part], 0)

    def reach(self, part: int) -> int:
        """The pages ``part`` can hold now: its limit, less what the other partition holds within its
        own share (pages past that share come back to ``part`` one eviction each)."""
        ev = self.eviction
        other = 1 - part
        return min(ev.limits[part], self.table.total_pages - min(ev.owned[other], ev.caps[other]))
