"""``workload_aware_exact``: the workload-aware rule by an exact arg-min at each eviction.

Within one (class, locality level) group the rank never improves with age, so the oldest page of
each group is the only candidate in it: scanning the group heads (and the few deferred pages whose
descendants have gone) is an exact arg-min over all pages without cached descendants. The yardstick
of the bucketed policy's decisions (``bench/eviction.py``), not a production policy: O(groups) per
eviction.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from itertools import islice

from kvpool_sidecar.policies.base import NO_PAGE, PageTree, PolicyContext, has_unnamed_child
from kvpool_sidecar.policies.scoring import Scoring, locality_level

_RECHECK_PER_CALL = 32  # deferred pages looked at again per call (descendants gone unnamed)


class WorkloadAwareExactPolicy(Scoring):
    name = "workload_aware_exact"

    def __init__(self, ctx: PolicyContext) -> None:
        super().__init__(ctx)
        # (class, locality level) -> page -> release time, oldest first
        self._groups: dict[tuple[Hashable, int], OrderedDict[int, float]] = {}
        self._group_of: dict[int, tuple[Hashable, int]] = {}
        # Leaves only, as in the bucketed policy: pages with cached descendants wait out of their
        # group (page -> release time); once their descendants are gone they are candidates of their
        # own ("ready").
        self._deferred: dict[int, float] = {}
        self._ready: dict[int, float] = {}
        tree = ctx.tree
        self._tree = tree if tree is not None else PageTree((), (), ())

    def insert(self, pages: list[int], depths: Sequence[int], length: int, now: float, klass: Hashable) -> None:
        for page, depth in zip(pages, depths, strict=True):
            group = (klass, locality_level(depth, length))
            members = self._groups.get(group)
            if members is None:
                members = self._groups[group] = OrderedDict()
            members[page] = now
            self._group_of[page] = group

    def _leave_group(self, page: int) -> float:
        """Take ``page`` out of its group; returns its release time."""
        group = self._group_of[page]
        members = self._groups[group]
        released = members.pop(page)
        if not members:
            del self._groups[group]
        return released

    def _forget(self, page: int) -> None:
        if page in self._deferred:
            del self._deferred[page]
        elif page in self._ready:
            del self._ready[page]
        else:
            self._leave_group(page)
        del self._group_of[page]

    def take(self, page: int, now: float, hit: bool) -> None:
        self._forget(page)

    def evict(self, page: int) -> None:
        self._forget(page)

    def victim(self, now: float) -> int:
        page = self.peek(now)
        self._forget(page)
        parent_of, first_child, next_sib = self._tree
        if parent_of:
            parent = parent_of[page]
            if parent in self._deferred and not has_unnamed_child(parent, (first_child, next_sib), (page,)):
                self._ready[parent] = self._deferred.pop(parent)
        return page

    def peek(self, now: float) -> int:
        first_child = self._tree.first_child
        for page in list(islice(self._deferred, _RECHECK_PER_CALL)):  # descendants gone unnamed
            released = self._deferred.pop(page)
            if first_child[page] == NO_PAGE:
                self._ready[page] = released
            else:
                self._deferred[page] = released
        while True:
            best_page = -1
            best = (True, math.inf, math.inf)
            for (klass, level), members in self._groups.items():
                page, released = next(iter(members.items()))
                key = (*self.rank(klass, level, now - released), released)  # ties: the older page
                if key < best:
                    best, best_page = key, page
            for page, released in self._ready.items():
                klass, level = self._group_of[page]
                key = (*self.rank(klass, level, now - released), released)
                if key < best:
                    best, best_page = key, page
            if best_page < 0 or not first_child or first_child[best_page] == NO_PAGE:
                if best_page < 0 and self._deferred:  # unreachable while the tree is consistent
                    return next(iter(self._deferred))
                return best_page
            if best_page in self._ready:  # gained a child again since it came back
                released = self._ready.pop(best_page)
            else:
                released = self._leave_group(best_page)
            self._deferred[best_page] = released

    def __len__(self) -> int:
        return len(self._group_of)

    def __contains__(self, page: int) -> bool:
        return page in self._group_of
