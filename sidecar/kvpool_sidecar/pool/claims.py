"""Which pages a partition's share protects: the one test of a page's *claim* (``eviction.admitByEvidence``).

A class is *shown not to come back* when it has released at least as many pages as its partition's share
holds (the share turned over once) and not one of them has come back (the reuse model's decayed counts,
:meth:`~kvpool_sidecar.workload.ReuseModel.evidence`: a class that stops sending forgets both, and is
judged afresh). A cached page holds a claim while it is within its reuse window (not
:meth:`.Eviction.expired`) and its class is not shown not to come back: with no evidence either way (a
cold start, a new class) every page holds one, and the shares protect what fills them as before.

A share protects only claimed pages: :meth:`.Eviction.allocate` takes the other partition's next victim,
within that one's share, before its own when that victim holds no claim (and has no cached descendants)
and its own does; and a save of a class shown not to come back does not evict a claimed page
(:mod:`.growth`). A flood of prompts nobody sends again thus keeps no share and turns over no page that
comes back, while bursts that come back keep theirs. A part of :class:`~kvpool_sidecar.pool.PagePool`.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING

from kvpool_sidecar.keys import workload_class_of
from kvpool_sidecar.policies import NO_PAGE
from kvpool_sidecar.pool.pages import PageTable

if TYPE_CHECKING:
    from kvpool_sidecar.pool.eviction import Eviction


class Claims:
    """The claims of cached pages over a :class:`~.pages.PageTable` and an eviction's partitions."""

    def __init__(self, table: PageTable, eviction: Eviction) -> None:
        self.table = table
        self.eviction = eviction  # its policies and shares, read, never changed here
        # A class's (page releases, page reuses) by now (set by the pool from its reuse model); None: no
        # page holds a claim and nothing is refused (a share protects whatever fills it).
        self.evidence: Callable[[Hashable, float], tuple[float, float]] | None = None

    def never_back(self, klass: Hashable, now: float) -> bool:
        """Whether ``klass`` is shown not to come back: its partition's share of pages released, none reused."""
        evidence = self.evidence
        if evidence is None:
            return False
        releases, reuses = evidence(klass, now)
        if reuses >= 1.0:
            return False
        eviction = self.eviction
        return releases >= max(eviction.caps[eviction.partition_of(workload_class_of(klass))], 1)

    def claimed(self, page: int, now: float) -> bool:
        """Whether cached ``page`` holds a claim: within its reuse window, of a class not shown not to come back."""
        return (self.evidence is not None and self.table.expires[page] >= now
                and not self.never_back(self.table.klass[page], now))

    def takes_unclaimed(self, part: int, now: float) -> bool:
        """Whether a page for ``part`` comes from within the other partition's share: that one's next
        victim holds no claim and has no cached descendants (they might), while ``part``'s own next
        victim holds one."""
        if self.evidence is None:
            return False
        own, theirs = self.eviction.policies[part], self.eviction.policies[1 - part]
        if not len(own) or not len(theirs):
            return False
        victim = theirs.peek(now)
        return (self.table.first_child[victim] == NO_PAGE and not self.claimed(victim, now)
                and self.claimed(own.peek(now), now))
