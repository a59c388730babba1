"""Which pages a partition's share protects: the one test of a page's *claim* (``eviction.admitByEvidence``).

A cached page holds a claim while it is within its reuse window (not :meth:`.Eviction.expired`) and
pages of its statistics class have been seen coming back (the reuse model's evidence,
:meth:`~kvpool_sidecar.workload.ReuseModel.comes_back`). A share protects only claimed pages
(:meth:`.Eviction.allocate` takes an unclaimed page within the other partition's share before a
claimed one of its own), and a save of a class never seen coming back does not evict a claimed page
(:mod:`.growth`): a flood of prompts nobody sends again keeps no share and turns over no page that
comes back, while bursts that come back keep theirs. A part of :class:`~kvpool_sidecar.pool.PagePool`.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

from kvpool_sidecar.policies import EvictionPolicy
from kvpool_sidecar.pool.pages import PageTable


class Claims:
    """The claims of cached pages over a :class:`~.pages.PageTable` and the partitions' policies."""

    def __init__(self, table: PageTable, policies: list[EvictionPolicy]) -> None:
        self.table = table
        self.policies = policies  # the eviction's own list (one per partition), read, never changed here
        # Whether a class's pages come back by now (set by the pool from its reuse model); None: no page
        # holds a claim, and a share protects whatever fills it.
        self.comes_back: Callable[[Hashable, float], bool] | None = None

    def claimed(self, page: int, now: float) -> bool:
        """Whether cached ``page`` holds a claim: within its reuse window, of a class that comes back."""
        comes_back = self.comes_back
        return comes_back is not None and self.table.expires[page] >= now and comes_back(self.table.klass[page], now)

    def fresh(self, klass: Hashable, now: float) -> bool:
        """Whether a page ``klass`` saves now would hold a claim (its class comes back); True when claims
        are off, so that nothing is refused for want of one."""
        return self.comes_back is None or self.comes_back(klass, now)

    def takes_unclaimed(self, part: int, now: float) -> bool:
        """Whether a page for ``part`` comes from within the other partition's share: that one's next
        victim holds no claim while ``part``'s own next victim does."""
        if self.comes_back is None:
            return False
        own, theirs = self.policies[part], self.policies[1 - part]
        if not len(own) or not len(theirs):
            return False
        return not self.claimed(theirs.peek(now), now) and self.claimed(own.peek(now), now)
